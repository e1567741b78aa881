"""Global RNG states read and written in memory (rawrng): round trips, fallbacks to the
libraries' APIs, the switch that turns memory access off."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from dataloading import assert_same_states, global_states, passes
from torch.utils.data import Dataset

from torchrepro import SeededLoader

# -- the main process's states after loading -------------------------------------------------------


class Gaussians(Dataset[torch.Tensor]):
    """Legacy NumPy gaussians: an odd count per sample leaves one cached in the RandomState."""

    def __len__(self) -> int:
        return 9

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(np.random.standard_normal(3 + index % 2))[:3]


def test_loading_keeps_the_main_processes_cached_gaussian_and_numpy_state(rng_changes_ok: None) -> None:
    """NumPy's state is saved as raw bytes around each batch: the gaussian cache must come back."""
    np.random.seed(11)
    np.random.standard_normal()  # one gaussian cached (has_gauss = 1)
    before = global_states()
    assert before[1][3] == 1
    expected = np.random.standard_normal(5)  # what the script draws next...
    np.random.set_state(before[1])
    batches = passes(SeededLoader(Gaussians(), batch_size=4, seed=0, collate_fn=torch.stack), epochs=1)
    assert len(batches) == 3
    assert_same_states(before, global_states())
    assert np.array_equal(np.random.standard_normal(5), expected)  # ...and still draws


# -- raw states ------------------------------------------------------------------------------------


def test_raw_numpy_state_round_trips_like_numpys_own(rng_changes_ok: None) -> None:
    from torchrepro.data.rawrng import _numpy_mt, _RawNumpyState

    np.random.seed(5)
    np.random.standard_normal()
    reference = np.random.get_state()
    saved = _numpy_mt.save(np)
    assert isinstance(saved, _RawNumpyState)  # the fast path is found on this NumPy
    for draw in (lambda: np.random.standard_normal(7), lambda: np.random.randint(0, 9, 2000)):
        draw()
        _numpy_mt.restore(np, saved)
        assert_same_states((0, reference, torch.zeros(1)), (0, np.random.get_state(), torch.zeros(1)))
    # a state saved from another RandomState object goes back through NumPy's API, values intact
    other = _RawNumpyState(np.random.RandomState(0), saved.mt, saved.aug)
    np.random.seed(6)
    _numpy_mt.restore(np, other)
    assert_same_states((0, reference, torch.zeros(1)), (0, np.random.get_state(), torch.zeros(1)))


def test_raw_python_state_round_trips_like_pythons_own(rng_changes_ok: None) -> None:
    from torchrepro.data.rawrng import _python_mt, _RawPythonState

    random.seed(5)
    random.gauss(0.0, 1.0)  # one gaussian cached in gauss_next
    reference = random.getstate()
    saved = _python_mt.save()
    assert isinstance(saved, _RawPythonState)  # the fast path is found on this interpreter
    token = _python_mt.token()
    draws = (lambda: random.random(), lambda: random.gauss(0.0, 1.0), lambda: random.getrandbits(32 * 624))
    for draw in draws:
        draw()
        assert _python_mt.token() != token  # every kind of draw is seen (the cached gaussian too)
        _python_mt.restore(saved)
        assert random.getstate() == reference
        assert _python_mt.token() == token
    # a state saved from another Random object goes back through the API, values intact
    other = _RawPythonState(random.Random(0), saved.mt, saved.gauss_next)
    random.seed(6)
    _python_mt.restore(other)
    assert random.getstate() == reference


def test_python_state_falls_back_to_the_api_for_a_replaced_random(
    monkeypatch: pytest.MonkeyPatch, rng_changes_ok: None
) -> None:
    """A module whose functions are not bound to a stock Random is saved through getstate."""
    from torchrepro.data.rawrng import _PythonMT

    class Patched(random.Random):
        pass

    inst = Patched(3)
    for name in ("random", "getstate", "setstate"):
        monkeypatch.setattr(random, name, getattr(inst, name))
    python_mt = _PythonMT()
    saved = python_mt.save()
    assert saved == inst.getstate()
    inst.random()
    assert python_mt.token() != saved
    python_mt.restore(saved)
    assert inst.getstate() == saved
