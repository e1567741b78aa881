"""A tiny transformer language model with dropout, trained through ``torch.compile``.

``torchrepro check --vary compile examples/compile_tiny.py`` runs it once eager (compilation turned
off) and once compiled, and says whether compiling keeps eager's bits: where the runs first part
(step, tensor, and the compiled graph's op, module and line) and how far apart each step goes.
Under strict mode Inductor's ``fallback_random`` is on and the dropout masks are eager's; with
``--mode off`` they are Inductor's own, and the runs part at the dropout.

    python examples/compile_tiny.py [--steps N] [--eager]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.drop = nn.Dropout(0.1)
        self.block = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.drop(self.embed(tokens))  # dropout
        return self.head(self.block(hidden))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--eager", action="store_true", help="do not compile")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyLM()
    forward = model if args.eager else torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        tokens = torch.randint(0, 64, (4, 12), generator=data)
        logits = forward(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"final loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
