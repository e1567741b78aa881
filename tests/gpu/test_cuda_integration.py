"""The library's parts on a CUDA device, in process: items 1-3 of the ``integration`` GPU section.

- A ``SeededLoader`` with workers and ``pin_memory=True`` yields pinned batches that, copied with
  ``non_blocking=True``, are bitwise the batches of a main-process loader without pinning.
- ``RngState`` captures and restores the CUDA generators (the global one and a ``torch.Generator``
  on the device), also through ``torch.save`` + ``torch.load(weights_only=True)``; ``fork_rng``
  isolates them.
- A checkpoint resumes training on CUDA exactly: the CUDA generator is restored with it.

Each claim has its negative control (a plain ``DataLoader``, the draws without a restore, a load
with ``restore_rng=False``). Skipped without a device; ``pytest --require-cuda`` on a GPU machine.
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import torchrepro
from torchrepro import RngState, SeededLoader, fork_rng, sample_rng

pytestmark = pytest.mark.requires_cuda


class Augmented(Dataset[torch.Tensor]):
    """Sample i: [i, a draw from Python's, NumPy's and torch's global RNG, and from sample_rng()]."""

    def __init__(self, *, seeded: bool = True) -> None:
        self.seeded = seeded  # sample_rng() exists only inside a SeededLoader

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> torch.Tensor:
        draws = [random.random(), float(np.random.rand()), *torch.rand(3).tolist()]
        if self.seeded:
            draws.append(float(sample_rng().random()))
        return torch.tensor([float(index), *draws], dtype=torch.float64)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


@pytest.fixture
def cuda_rng() -> Iterator[None]:
    """Put every CUDA generator back as the test found it (the global-state guard reads CPU only;
    the tests that ask for it also request ``rng_changes_ok``: what they assert is the CUDA streams)."""
    states = torch.cuda.get_rng_state_all()
    yield
    torch.cuda.set_rng_state_all(states)


# -- SeededLoader ----------------------------------------------------------------------------------


def _to_cuda(loader: DataLoader[torch.Tensor], epochs: int) -> tuple[list[torch.Tensor], list[bool]]:
    batches, pinned = [], []
    for epoch in range(epochs):
        if isinstance(loader, SeededLoader):
            loader.set_epoch(epoch)
        for batch in loader:
            pinned.append(batch.is_pinned())
            batches.append(batch.to("cuda", non_blocking=True))
    torch.cuda.synchronize()
    return batches, pinned


def test_pinned_worker_batches_copied_to_cuda_equal_main_process_batches() -> None:
    def seeded(**kwargs: object) -> SeededLoader:
        return SeededLoader(Augmented(), batch_size=4, seed=3, **kwargs)

    got, pinned = _to_cuda(seeded(num_workers=2, pin_memory=True), epochs=2)
    reference, unpinned = _to_cuda(seeded(), epochs=2)
    again, _ = _to_cuda(seeded(num_workers=2, pin_memory=True), epochs=2)
    assert len(got) == 16 and all(batch.is_cuda for batch in got)
    assert all(pinned) and not any(unpinned)
    assert _same(got, reference)
    assert _same(got, again)
    assert not _same(got[:8], got[8:])  # the epochs differ: the draws are random


def test_a_plain_loader_with_workers_gives_other_batches() -> None:
    def plain(workers: int) -> list[torch.Tensor]:
        with fork_rng(3):  # the same global streams for both, put back afterwards
            loader = DataLoader(Augmented(seeded=False), batch_size=4, num_workers=workers, pin_memory=True)
            return _to_cuda(loader, epochs=1)[0]

    assert not _same(plain(0), plain(2))


# -- RngState and fork_rng -------------------------------------------------------------------------


def _cuda_draws(gen: torch.Generator) -> list[torch.Tensor]:
    return [
        torch.rand(64, device="cuda"),
        F.dropout(torch.ones(256, device="cuda"), 0.5, training=True),
        torch.randn(64, device="cuda"),
        torch.randn(64, device="cuda", generator=gen),
    ]


@pytest.mark.usefixtures("cuda_rng", "rng_changes_ok")
def test_rng_state_captures_and_restores_the_cuda_generators() -> None:
    torch.rand(1, device="cuda")  # CUDA has started: RngState captures the devices already started
    gen = torch.Generator(device="cuda").manual_seed(1)
    named = {"noise": gen}
    state = RngState.capture(generators=named)
    assert 0 in state.cuda and state.generators["noise"].device.startswith("cuda")
    first = _cuda_draws(gen)
    state.restore(generators=named)
    assert _same(first, _cuda_draws(gen))
    assert not _same(first, _cuda_draws(gen))  # without a restore the streams moved on
    buffer = io.BytesIO()
    torch.save(state.to_dict(), buffer)
    buffer.seek(0)
    RngState.from_dict(torch.load(buffer, weights_only=True)).restore(generators=named)
    assert _same(first, _cuda_draws(gen))


@pytest.mark.usefixtures("cuda_rng", "rng_changes_ok")
def test_fork_rng_isolates_the_cuda_generators() -> None:
    torch.rand(1, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    named = {"noise": gen}
    before = RngState.capture(generators=named)
    with fork_rng(generators=named):
        _cuda_draws(gen)
    after_block = _cuda_draws(gen)
    before.restore(generators=named)
    assert _same(after_block, _cuda_draws(gen))
    before.restore(generators=named)
    _cuda_draws(gen)  # the same block without fork_rng moves the streams
    assert not _same(after_block, _cuda_draws(gen))
    with fork_rng(5):
        a = _cuda_draws(gen)[:3]
    with fork_rng(5):
        b = _cuda_draws(gen)[:3]
    with fork_rng(6):
        c = _cuda_draws(gen)[:3]
    assert _same(a, b) and not _same(a, c)


# -- checkpoints -----------------------------------------------------------------------------------


def _build() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4)).cuda()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):  # data and dropout masks: all drawn from the CUDA generator
        x = torch.randn(32, 16, device="cuda")
        y = torch.randint(0, 4, (32,), device="cuda")
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.usefixtures("cuda_rng", "rng_changes_ok")
def test_a_checkpoint_resumes_cuda_training_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, opt = _build()
    _train(model, opt, 3)
    path = torchrepro.save_checkpoint(tmp_path / "step-3.pt", model=model, optimizer=opt, step=3)
    _train(model, opt, 3)
    expected = torchrepro.fingerprint(model)
    got = {}
    for restore_rng in (True, False):
        resumed, resumed_opt = _build()
        torch.manual_seed(1234)  # other streams, CPU and CUDA, unless the load restores them
        values = torchrepro.load_checkpoint(
            path, model=resumed, optimizer=resumed_opt, restore_rng=restore_rng
        )
        _train(resumed, resumed_opt, 6 - values["step"])
        got[restore_rng] = torchrepro.fingerprint(resumed)
    assert got[True] == expected
    assert got[False] != expected  # the control: the CUDA generator's state is what made it exact
    raw = torch.load(path, weights_only=True)
    assert "0" in raw["rng"]["state"]["cuda"]
