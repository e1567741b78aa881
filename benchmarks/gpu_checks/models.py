"""The workloads the GPU sections train: a small CNN and a small GPT, with their data and steps.

Invariants:

- Inputs come from a CPU ``torch.Generator`` seeded from (seed, model, step), then move to the
  device: the data never depends on the device, the process or the determinism mode.
- ``CNN``: convolutions, BatchNorm, dropout, max pooling, SGD with momentum. ``GPT``: token and
  position embeddings (embedding backward accumulates with atomics on CUDA), causal
  ``scaled_dot_product_attention`` with dropout, LayerNorm, AdamW; ``gpt_bf16`` is the same under
  bf16 autocast, where CUDA picks the flash attention kernels.
- ``SIZES["check"]`` is small (bitwise checks: seconds); ``SIZES["cost"]`` is big enough that a
  step is GPU-bound on an H100 (cost ratios mean something); ``SIZES["tiny"]`` is for the CPU
  self-test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

MODELS = ("cnn", "gpt", "gpt_bf16")

SIZES: dict[str, dict[str, dict[str, int]]] = {
    "tiny": {
        "cnn": {"batch": 8, "width": 8, "image": 16},
        "gpt": {"batch": 4, "width": 32, "layers": 2, "heads": 2, "seq": 32, "vocab": 97},
    },
    "check": {
        "cnn": {"batch": 64, "width": 32, "image": 32},
        "gpt": {"batch": 16, "width": 128, "layers": 4, "heads": 4, "seq": 128, "vocab": 1024},
    },
    "cost": {
        "cnn": {"batch": 256, "width": 64, "image": 32},
        "gpt": {"batch": 32, "width": 512, "layers": 6, "heads": 8, "seq": 512, "vocab": 8192},
    },
}


class CNN(nn.Module):
    def __init__(self, width: int, classes: int = 10) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(3, w, 3, padding=1),
            nn.BatchNorm2d(w),
            nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, padding=1),
            nn.BatchNorm2d(2 * w),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1),
            nn.BatchNorm2d(2 * w),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.25), nn.LazyLinear(classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(
        self, vocab: int, width: int, layers: int, heads: int, seq: int, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.Sequential(*(Block(width, heads, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.out(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def _data_generator(seed: int, model: str, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + MODELS.index(model) * 10_007 + step)


def build(model: str, size: str, device: torch.device | str, seed: int = 0) -> tuple[nn.Module, Any]:
    """The model (initialised from ``seed`` on the CPU, then moved) and its optimizer."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; one of {MODELS}")
    dims = SIZES[size]["cnn" if model == "cnn" else "gpt"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if model == "cnn":
            net: nn.Module = CNN(dims["width"])
            net(torch.zeros(1, 3, dims["image"], dims["image"]))  # materialise the lazy layer
            net = net.to(device)
            opt: Any = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        else:
            net = GPT(dims["vocab"], dims["width"], dims["layers"], dims["heads"], dims["seq"]).to(device)
            opt = torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.1)
    return net, opt


def batch(
    model: str, size: str, step: int, device: torch.device | str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    dims = SIZES[size]["cnn" if model == "cnn" else "gpt"]
    g = _data_generator(seed, model, step)
    if model == "cnn":
        x = torch.randn(dims["batch"], 3, dims["image"], dims["image"], generator=g)
        y = torch.randint(0, 10, (dims["batch"],), generator=g)
    else:
        tokens = torch.randint(0, dims["vocab"], (dims["batch"], dims["seq"] + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
    return x.to(device), y.to(device)


def step_fn(
    model: str, net: nn.Module, opt: Any, device: torch.device | str
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One training step (forward, loss, backward, optimizer step); returns the detached loss."""
    on_cuda = torch.device(device).type == "cuda"

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        autocast = (
            torch.autocast("cuda" if on_cuda else "cpu", dtype=torch.bfloat16)
            if model == "gpt_bf16"
            else contextlib.nullcontext()
        )
        with autocast:
            out = net(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def train(model: str, size: str, steps: int, device: torch.device | str, seed: int = 0) -> dict[str, Any]:
    """Train ``steps`` steps; the losses' bits and a fingerprint of parameters and optimizer state.

    Dropout draws from the device's default generator, seeded here from ``seed``.
    """
    import torchrepro

    torch.manual_seed(seed)  # the dropout masks: the CPU generator and every CUDA device's
    net, opt = build(model, size, device, seed)
    net.train()
    step = step_fn(model, net, opt, device)
    losses = [step(*batch(model, size, i, device, seed)) for i in range(steps)]
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return {
        "losses": [float(v) for v in torch.stack(losses).cpu()],
        "loss_bits": torch.stack(losses).cpu().float().view(torch.int32).tolist(),
        "params": torchrepro.fingerprint(net.state_dict()),
        "optimizer": torchrepro.fingerprint(opt.state_dict()),
    }


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """Where two ``train`` results part: ``None`` when equal, else the first step or the state."""
    for i, (x, y) in enumerate(zip(a["loss_bits"], b["loss_bits"], strict=True)):
        if x != y:
            return f"loss at step {i} ({a['losses'][i]!r} vs {b['losses'][i]!r})"
    for key in ("params", "optimizer"):
        if a[key] != b[key]:
            return f"{key} after the last step"
    return None
