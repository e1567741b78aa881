"""InvariantDataParallel's kept buffers: each piece's gradients are flattened into flat buffers
reused between steps, and the global mean goes into tensors of its own.

- A parameter without a gradient in a micro-batch is a leaf of zeros, bit for bit, signs of zero
  included (``-0.0 + 0.0`` is ``0.0``); compared as integers, since ``torch.equal`` takes
  ``-0.0`` for ``0.0``.
- ``.grad`` tensors a training loop keeps after a step hold their values through the next steps
  (they are never the reused buffers), in one process and on two gloo processes.
- ``backward(create_graph=True)`` gives the same bits, as plain values (the buffers hold no graph).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import torchrepro
from helpers import tree_sum

V, MICRO = 6, 2
# z's gradient per global micro-batch (None: z takes no part in that micro-batch's loss). Leaves
# 2 and 5, the right children of (1, 3) and (4, 6), are absent: entry 0 of the mean is +0.0 only
# if their zeros are added (-0.0 + 0.0).
COEFFICIENTS = [
    [-0.0, 1.0, -0.0, 2.0],
    [-0.0, -0.0, 3.0, -0.0],
    None,
    [-0.0, 5.0, -0.0, -0.0],
    [-0.0, -0.0, -0.0, -0.0],
    None,
]

pytestmark = pytest.mark.usefixtures("rng_changes_ok")  # models are built seeded


class WithZ(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(3, 1)
        self.z = nn.Parameter(torch.zeros(4))
        self.coefficients: torch.Tensor | None = None  # set per micro-batch by the loop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x).pow(2).sum()  # a gradient that depends on the weights (create_graph)
        if self.coefficients is not None:
            out = out + (self.z * self.coefficients).sum()  # dloss/dz = the coefficients, bit for bit
        return out


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(3 * V * MICRO, 3, generator=g))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


Grads = list[list[torch.Tensor]]


def train(steps: int, *, create_graph: bool = False) -> tuple[Grads, Grads]:
    """The ``.grad`` tensors after each step as kept (no copy) and as cloned then."""
    module = WithZ()
    loader = torchrepro.SeededLoader(data(), batch_size=MICRO, global_batch_size=V * MICRO, seed=0)
    model = torchrepro.InvariantDataParallel(module, loader)
    rank = dist.get_rank() if dist.is_initialized() else 0
    a = loader.accumulation_steps
    kept: list[list[torch.Tensor]] = []
    cloned: list[list[torch.Tensor]] = []
    for i, (x,) in enumerate(loader):
        c = COEFFICIENTS[rank * a + i % a]
        module.coefficients = None if c is None else torch.tensor(c)
        model(x).backward(create_graph=create_graph)
        if (i + 1) % a == 0:
            grads = [p.grad for p in module.parameters()]
            assert all(g is not None for g in grads)
            kept.append(grads)  # type: ignore[arg-type]
            cloned.append([g.clone() for g in grads])  # type: ignore[union-attr]
            for p in module.parameters():
                p.grad = None  # zero_grad()
            if len(kept) == steps:
                break
    return kept, cloned


def test_a_parameter_without_a_gradient_is_a_leaf_of_zeros_signs_of_zero_included() -> None:
    kept, _ = train(1)
    zeros = torch.zeros(4)
    leaves = [zeros if c is None else torch.tensor(c) for c in COEFFICIENTS]
    expected = tree_sum(leaves, (0, V)).div_(V)
    assert torch.equal(bits(kept[0][0]), bits(expected))  # z: the module's own parameter comes first
    assert expected[0] == 0 and not torch.signbit(expected[0])
    # Negative control: leaving an absent leaf out (as if it were -0.0) ends with -0.0.
    left_out = tree_sum(
        [torch.full((4,), -0.0) if c is None else torch.tensor(c) for c in COEFFICIENTS], (0, V)
    )
    assert torch.signbit(left_out.div_(V)[0])


def test_grads_kept_from_a_step_hold_their_values_through_the_next_steps() -> None:
    kept, cloned = train(3)
    for step_kept, step_cloned in zip(kept, cloned, strict=True):
        for g, c in zip(step_kept, step_cloned, strict=True):
            assert torch.equal(bits(g), bits(c))
    assert not all(torch.equal(a, b) for a, b in zip(cloned[0], cloned[1], strict=True))  # they moved


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
def test_create_graph_gives_the_same_bits_as_plain_values() -> None:
    _, plain = train(2)
    kept, graphed = train(2, create_graph=True)
    for step in range(2):
        assert not any(g.requires_grad for g in kept[step])
        for a, b in zip(plain[step], graphed[step], strict=True):
            assert torch.equal(bits(a), bits(b))


def _rank(rank: int, world: int, path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        kept, cloned = train(3)
        torch.save({"kept": kept, "cloned": cloned}, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_on_two_gloo_processes_kept_grads_hold_and_equal_one_process(tmp_path: Path) -> None:
    fd, path = tempfile.mkstemp(dir=tmp_path)
    os.close(fd)
    os.unlink(path)
    out = str(tmp_path / "grads")
    mp.start_processes(_rank, args=(2, path, out), nprocs=2, start_method="spawn")
    _, alone = train(3)
    for rank in range(2):
        got = torch.load(f"{out}.rank{rank}", weights_only=True)
        for step in range(3):
            for g, c, a in zip(got["kept"][step], got["cloned"][step], alone[step], strict=True):
                assert torch.equal(bits(g), bits(c)), (rank, step)
                assert torch.equal(bits(g), bits(a)), (rank, step)
