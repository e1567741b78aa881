"""A word-language-model style loop: no torch.optim, the update is written by hand.

``--update data``: ``p.data.add_(p.grad, alpha=-lr)`` (classic examples); ``--update no_grad``: the
same under ``torch.no_grad()``; ``--update custom``: a custom optimizer class that is not a
``torch.optim.Optimizer``. ``--steps N`` (default 6) steps; ``--accumulate K`` backward() calls per
update. Nothing here seeds: under ``torchrepro check`` the runs are seeded, with ``--no-seed`` not.
"""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--update", choices=("data", "no_grad", "custom"), default="data")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--accumulate", type=int, default=1)
args = parser.parse_args()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(20, 8)
        self.rnn = nn.LSTM(8, 8, batch_first=True)
        self.decoder = nn.Linear(8, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.encoder(x))
        return self.decoder(out)


class PlainSGD:
    """A hand-written optimizer: not a torch.optim.Optimizer."""

    def __init__(self, params: list[nn.Parameter], lr: float) -> None:
        self.params, self.lr = params, lr

    def step(self) -> None:
        with torch.no_grad():
            for p in self.params:
                p -= self.lr * p.grad


def train() -> None:
    model = Model()
    opt = PlainSGD(list(model.parameters()), 0.5) if args.update == "custom" else None
    data = torch.randint(0, 20, (args.steps * args.accumulate, 4, 5))
    lr = 0.5
    for i in range(args.steps * args.accumulate):
        x = data[i]
        loss = nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 20), x[:, 1:].reshape(-1))
        loss.backward()
        if (i + 1) % args.accumulate:
            continue
        if opt is not None:
            opt.step()
        elif args.update == "no_grad":
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-lr)
        else:
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
        model.zero_grad()
    print(f"final loss {loss.item():.6f}")


train()
