"""Global RNG states read and written in memory (rawrng): round trips, fallbacks to the
libraries' APIs, the switch that turns memory access off."""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from dataloading import Draws, assert_same_states, collate_with_draw, global_states, passes, same
from torch.utils.data import Dataset

from torchrepro import SeededLoader, derive_seed
from torchrepro.data import raw_access, rawrng, set_raw_access

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
    from torchrepro.data.rawrng import _RawNumpyState, numpy_mt

    np.random.seed(5)
    np.random.standard_normal()
    reference = np.random.get_state()
    saved = numpy_mt.save(np)
    assert isinstance(saved, _RawNumpyState)  # the fast path is found on this NumPy
    for draw in (lambda: np.random.standard_normal(7), lambda: np.random.randint(0, 9, 2000)):
        draw()
        numpy_mt.restore(np, saved)
        assert_same_states((0, reference, torch.zeros(1)), (0, np.random.get_state(), torch.zeros(1)))
    # a state saved from another RandomState object goes back through NumPy's API, values intact
    other = _RawNumpyState(np.random.RandomState(0), saved.mt, saved.aug)
    np.random.seed(6)
    numpy_mt.restore(np, other)
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


# -- the switch: raw access off, the libraries' APIs only -------------------------------------------


@pytest.fixture
def raw_access_off() -> Iterator[None]:
    previous = set_raw_access(False)
    try:
        yield
    finally:
        set_raw_access(previous)


class PythonLate(Dataset[torch.Tensor]):
    """Draws from Python's random only from index 8 on, from NumPy only for odd indices: a process
    learns from the first batch that they are not drawn from, and must notice when they are."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        a = random.random() if index >= 8 else -1.0
        b = float(np.random.rand()) if index % 2 else -1.0
        return torch.tensor(
            [float(index), a, b, float(np.random.standard_normal(1 + index % 2)[0])], dtype=torch.float64
        )


def expected_late(index: int, epoch: int) -> list[float]:
    key = derive_seed(6, "sample", epoch, index)
    rs = np.random.RandomState(key >> 32)
    a = random.Random(key).random() if index >= 8 else -1.0
    b = float(rs.rand()) if index % 2 else -1.0
    return [float(index), a, b, float(rs.standard_normal(1 + index % 2)[0])]


def loaded(**kwargs: Any) -> list[torch.Tensor]:
    """Draws and PythonLate batches, two epochs each, as a SeededLoader loads them."""
    draws = passes(SeededLoader(Draws(), batch_size=4, seed=3, collate_fn=collate_with_draw, **kwargs))
    late = passes(SeededLoader(PythonLate(), batch_size=4, seed=6, shuffle=False, **kwargs))
    for epoch, rows in enumerate((torch.cat(late[:4]), torch.cat(late[4:]))):
        assert [row.tolist() for row in rows] == [expected_late(int(row[0]), epoch) for row in rows]
    return draws + late


@pytest.mark.parametrize("num_workers", [0, 2])
def test_with_raw_access_off_the_loader_gives_the_same_samples_and_draws(
    num_workers: int, rng_changes_ok: None
) -> None:
    reference = loaded(num_workers=num_workers)
    random.seed(1)
    random.gauss(0.0, 1.0)  # a gaussian cached in each library: they must come back too
    np.random.seed(1)
    np.random.standard_normal()
    before = global_states()
    assert raw_access()
    set_raw_access(False)
    try:
        got = loaded(num_workers=num_workers)
    finally:
        assert set_raw_access(True) is False
    assert same(got, reference)
    assert_same_states(before, global_states())
    assert random.getstate()[2] is not None and np.random.get_state()[3] == 1


class _RawAccessMade(AssertionError):
    pass


class _Forbidden:
    """Raises on any use: put where rawrng keeps ctypes and its memory views."""

    def __getattr__(self, name: str) -> Any:
        raise _RawAccessMade(f"raw access: {name}")

    def __getitem__(self, index: Any) -> Any:
        raise _RawAccessMade(f"raw access: [{index}]")


def _forbid_raw_access(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Every way rawrng reaches memory raises; returns counts of the library API calls made."""
    assert isinstance(rawrng._python_mt.save(), rawrng._RawPythonState)  # views attached...
    assert isinstance(rawrng.numpy_mt.save(np), rawrng._RawNumpyState)  # ...on this interpreter
    monkeypatch.setattr(rawrng, "ctypes", _Forbidden())
    monkeypatch.setattr(rawrng._python_mt, "words", _Forbidden())
    monkeypatch.setattr(rawrng.numpy_mt, "words", _Forbidden())
    calls = {"random.getstate": 0, "np.random.get_state": 0}

    def counted(name: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(random, "getstate", counted("random.getstate", random.getstate))
    monkeypatch.setattr(np.random, "get_state", counted("np.random.get_state", np.random.get_state))
    return calls


def test_with_raw_access_off_no_memory_is_read_or_written(
    monkeypatch: pytest.MonkeyPatch, raw_access_off: None, rng_changes_ok: None
) -> None:
    set_raw_access(True)
    reference = loaded()
    calls = _forbid_raw_access(monkeypatch)
    set_raw_access(False)
    before = global_states()
    assert same(loaded(), reference)
    assert_same_states(before, global_states())
    assert calls["random.getstate"] > 0 and calls["np.random.get_state"] > 0  # the APIs instead
    assert not isinstance(rawrng._python_mt.save(), rawrng._RawPythonState)
    assert not isinstance(rawrng.numpy_mt.save(np), rawrng._RawNumpyState)


def test_the_forbidden_memory_is_what_raw_access_uses(
    monkeypatch: pytest.MonkeyPatch, rng_changes_ok: None
) -> None:
    """Negative control: with raw access on, the same traps fire, so the test above can fail."""
    assert raw_access()
    _forbid_raw_access(monkeypatch)
    with pytest.raises(_RawAccessMade):
        passes(SeededLoader(Draws(8), batch_size=4, seed=0), epochs=1)


def test_a_raw_state_saved_before_the_switch_goes_back_through_the_api(
    raw_access_off: None, rng_changes_ok: None
) -> None:
    set_raw_access(True)
    random.seed(4)
    np.random.seed(4)
    reference = global_states()
    saved = rawrng._python_mt.save(), rawrng.numpy_mt.save(np)
    assert isinstance(saved[0], rawrng._RawPythonState) and isinstance(saved[1], rawrng._RawNumpyState)
    random.random(), np.random.rand()
    set_raw_access(False)
    rawrng._python_mt.restore(saved[0])
    rawrng.numpy_mt.restore(np, saved[1])
    assert_same_states(reference, (*global_states()[:2], reference[2]))


class ReportsRawAccess(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(raw_access())])


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_follow_the_switch(context: str, raw_access_off: None) -> None:
    loader = SeededLoader(
        ReportsRawAccess(), batch_size=2, seed=0, num_workers=1, multiprocessing_context=context
    )
    assert [batch.flatten().tolist() for batch in loader] == [[0.0, 0.0], [0.0, 0.0]]


def test_the_dataset_view_carries_the_switch_when_pickled(raw_access_off: None) -> None:
    view = SeededLoader(list(range(4)), batch_size=2, seed=0).dataset
    off = pickle.dumps(view)
    set_raw_access(True)
    on = pickle.dumps(view)
    pickle.loads(on)
    assert raw_access()  # control: a view pickled with raw access on changes nothing
    pickle.loads(off)
    assert not raw_access()


def test_set_raw_access_takes_a_bool_and_returns_the_previous_setting(raw_access_off: None) -> None:
    assert set_raw_access(True) is False and set_raw_access(True) is True
    with pytest.raises(TypeError, match="set_raw_access expects a bool, got int 0"):
        set_raw_access(0)  # type: ignore[arg-type]
    assert raw_access()
