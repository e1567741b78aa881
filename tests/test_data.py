"""SeededLoader and sample_rng: invariance to how batches are loaded, resume, shards, errors.

Every invariance claim has a negative control showing that a plain DataLoader differs.
Datasets are tiny; worker processes are real (fork, and spawn once).
"""

from __future__ import annotations

import json
import random
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset

import torchrepro
from torchrepro import DataLoaderStateError, ReproError, SeededLoader, derive_seed, sample_rng
from torchrepro.data import view as data_view
from torchrepro.data import LoaderConfigError, UnsupportedDatasetError

many_workers = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
no_accelerator = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")


# -- datasets (module level: spawn workers import them) ---------------------------------------


class Draws(Dataset[torch.Tensor]):
    """Sample i: [i, and one draw from every RNG a dataset may use]."""

    def __init__(self, n: int = 23, *, use_sample_rng: bool = True) -> None:
        self.n = n
        self.use_sample_rng = use_sample_rng

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        extra = [sample_rng().random()] if self.use_sample_rng else []
        draws = [random.random(), float(np.random.rand()), float(torch.rand(()))]
        return torch.tensor([float(index), *draws, *extra], dtype=torch.float64)


class Compose:
    def __init__(self, transforms: list[Any]) -> None:
        self.transforms = transforms


class HeldGenerators(Dataset[torch.Tensor]):
    """Draws from RNG objects made in __init__: every worker gets a copy of them."""

    def __init__(self, n: int = 16) -> None:
        self.n = n
        self.np_rng = np.random.default_rng(0)
        self.torch_gen = torch.Generator().manual_seed(0)
        self.transform = Compose([random.Random(0)])  # found inside a transform pipeline too

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        draws = [
            float(self.np_rng.random()),
            float(torch.rand((), generator=self.torch_gen)),
            self.transform.transforms[0].random(),
        ]
        return torch.tensor([float(index), *draws], dtype=torch.float64)


class Batched(Dataset[torch.Tensor]):
    """Loads whole batches through __getitems__."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> torch.Tensor:
        raise AssertionError("SeededLoader should call __getitems__")

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        return [torch.tensor([float(i), float(torch.rand(()))], dtype=torch.float64) for i in indices]


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


def collate_with_draw(samples: list[torch.Tensor]) -> torch.Tensor:
    """A collate_fn that draws: its draw must be keyed by (seed, epoch, batch index)."""
    batch = torch.stack(samples)
    return torch.cat([batch, torch.rand(len(samples), 1, dtype=torch.float64)], dim=1)


def passes(loader: Any, epochs: int = 2) -> list[torch.Tensor]:
    return [batch for _ in range(epochs) for batch in loader]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    pairs = zip(a, b, strict=False)
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in pairs)


def global_states() -> tuple[Any, ...]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def assert_same_states(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert a[0] == b[0]
    assert a[1][0] == b[1][0] and np.array_equal(a[1][1], b[1][1]) and a[1][2:] == b[1][2:]
    assert torch.equal(a[2], b[2])


# -- invariance --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> list[torch.Tensor]:
    return passes(SeededLoader(Draws(), batch_size=4, seed=3, collate_fn=collate_with_draw))


LOADING_CONFIGS = [
    pytest.param({"num_workers": 1}, id="workers1"),
    pytest.param({"num_workers": 2}, id="workers2"),
    pytest.param({"num_workers": 3}, id="workers3", marks=many_workers),
    pytest.param({"num_workers": 2, "persistent_workers": True}, id="persistent"),
    pytest.param({"num_workers": 2, "prefetch_factor": 1}, id="prefetch1"),
    pytest.param(
        {"num_workers": 3, "prefetch_factor": 4, "persistent_workers": True},
        id="workers3-prefetch4-persistent",
        marks=many_workers,
    ),
    pytest.param({"num_workers": 2, "pin_memory": True}, id="pin_memory", marks=no_accelerator),
    pytest.param({"num_workers": 2, "multiprocessing_context": "fork"}, id="fork"),
    pytest.param(
        {"num_workers": 2, "multiprocessing_context": "spawn", "persistent_workers": True}, id="spawn"
    ),
]


@pytest.mark.parametrize("config", LOADING_CONFIGS)
def test_batches_are_identical_however_they_are_loaded(
    reference: list[torch.Tensor], config: dict[str, Any]
) -> None:
    loader = SeededLoader(Draws(), batch_size=4, seed=3, collate_fn=collate_with_draw, **config)
    assert same(passes(loader), reference)


def test_reference_draws_never_repeat_and_epochs_differ(reference: list[torch.Tensor]) -> None:
    epoch0, epoch1 = torch.cat(reference[:6]), torch.cat(reference[6:])
    assert sorted(epoch0[:, 0].tolist()) == sorted(epoch1[:, 0].tolist()) == list(range(23))
    assert not torch.equal(epoch0[:, 0], epoch1[:, 0])  # a new order every epoch
    draws = torch.cat([epoch0, epoch1])[:, 1:]
    for column in draws.T:  # python, numpy, torch, sample_rng, collate
        assert len(set(column.tolist())) == len(column)


def test_negative_control_plain_dataloader_depends_on_num_workers(rng_changes_ok: None) -> None:
    def run(num_workers: int) -> list[torch.Tensor]:
        torchrepro.seed_everything(3)
        loader = DataLoader(
            Draws(use_sample_rng=False),
            batch_size=4,
            shuffle=True,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(3),
        )
        return passes(loader)

    a, b = run(0), run(2)
    assert [x[:, 0].tolist() for x in a] == [x[:, 0].tolist() for x in b]  # same order...
    assert not same(a, b)  # ...but different augmentation


def test_rng_objects_held_by_the_dataset_are_keyed_per_sample(rng_changes_ok: None) -> None:
    # (the plain DataLoader draws its worker base seed from the global torch RNG)
    plain = torch.cat(list(DataLoader(HeldGenerators(), batch_size=2, num_workers=2)))
    by_index = {int(row[0]): row[1:].tolist() for row in plain}
    assert by_index[0] == by_index[2]  # negative control: each worker repeats the copied stream

    runs = [
        torch.cat(passes(SeededLoader(HeldGenerators(), batch_size=2, seed=1, num_workers=w))) for w in (0, 2)
    ]
    assert torch.equal(runs[0], runs[1])
    for column in runs[0][:, 1:].T:
        assert len(set(column.tolist())) == len(column)


def test_dataset_with_getitems_is_seeded_per_batch() -> None:
    a, b = (passes(SeededLoader(Batched(), batch_size=4, seed=0, num_workers=w)) for w in (0, 2))
    assert same(a, b)
    assert len({x[1].item() for batch in a for x in batch}) == 40


# -- the training loop's RNG ---------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loading_never_moves_the_global_rng(num_workers: int) -> None:
    before = global_states()
    batches = passes(SeededLoader(Draws(), batch_size=4, seed=0, num_workers=num_workers), epochs=1)
    assert len(batches) == 6
    assert_same_states(before, global_states())


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


def test_extra_validation_pass_does_not_shift_training(rng_changes_ok: None) -> None:
    dropout = torch.nn.Dropout(0.5)

    def train(make: Any, *, validate: bool) -> list[torch.Tensor]:
        torchrepro.seed_everything(0)
        train_loader, val_loader = make(Draws(12, use_sample_rng=False)), make(Draws(8, use_sample_rng=False))
        out = []
        for _ in range(2):
            out += [dropout(batch) for batch in train_loader]  # the model's RNG stream
            if validate:
                list(val_loader)
        return out

    def seeded(ds: Dataset[torch.Tensor]) -> Any:
        return SeededLoader(ds, batch_size=4, seed=0)

    def plain(ds: Dataset[torch.Tensor]) -> Any:
        return DataLoader(ds, batch_size=4, shuffle=True)

    assert same(train(seeded, validate=False), train(seeded, validate=True))
    assert not same(train(plain, validate=False), train(plain, validate=True))  # negative control


# -- order, epochs, shards --------------------------------------------------------------------


def order(loader: SeededLoader) -> list[int]:
    return [int(i) for batch in loader for i in batch]


def test_order_is_a_pure_function_of_seed_and_epoch(rng_changes_ok: None) -> None:
    a = SeededLoader(list(range(50)), batch_size=8, seed=5)
    first = order(a)
    torch.manual_seed(123)  # the global RNG does not matter
    b = SeededLoader(list(range(50)), batch_size=8, seed=5)
    assert order(b) == first
    assert a.epoch == b.epoch == 0
    second = order(a)  # each new pass is the next epoch
    assert a.epoch == 1 and second != first and sorted(second) == list(range(50))
    c = SeededLoader(list(range(50)), batch_size=8, seed=5)
    c.set_epoch(1)
    assert order(c) == second
    assert order(SeededLoader(list(range(50)), batch_size=8, seed=6)) != first
    assert order(SeededLoader(list(range(50)), batch_size=8, seed=5, shuffle=False)) == list(range(50))


@pytest.mark.parametrize(
    ("n", "world_size", "drop_last"), [(12, 3, False), (10, 3, False), (10, 3, True), (2, 4, False)]
)
def test_rank_shards_are_disjoint_and_cover_the_dataset(n: int, world_size: int, drop_last: bool) -> None:
    for epoch in (0, 1):
        shards = []
        for rank in range(world_size):
            loader = SeededLoader(
                list(range(n)), batch_size=1, seed=0, rank=rank, world_size=world_size, drop_last=drop_last
            )
            loader.set_epoch(epoch)
            shards.append(order(loader))
        sizes = {len(s) for s in shards}
        assert len(sizes) == 1  # every rank gets as many samples (and batches)
        flat = [i for s in shards for i in s]
        if drop_last:  # the uneven tail is dropped: disjoint, all but n % world_size covered
            assert len(set(flat)) == len(flat) == n - n % world_size
        else:  # padded with the first indices: covering, only the padding repeats
            assert set(flat) == set(range(n))
            assert len(flat) - len(set(flat)) == -n % world_size


def test_rank_and_world_size_come_from_torch_distributed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        state = SeededLoader(list(range(10)), batch_size=2, seed=0).state_dict()
        assert (state["rank"], state["world_size"]) == (0, 1)
    finally:
        dist.destroy_process_group()


# -- per-sample keys -----------------------------------------------------------------------------


class Keys(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> torch.Tensor:
        first, again = sample_rng(), sample_rng()
        assert first is again  # one generator per sample: two calls never repeat draws
        return torch.tensor([index, torch.initial_seed(), first.integers(2**62)], dtype=torch.float64).to(
            torch.float64
        )


def test_sample_keys_are_derive_seed_of_seed_epoch_index() -> None:
    loader = SeededLoader(Keys(), batch_size=3, seed=9, collate_fn=list)
    for epoch in (0, 1):
        for batch in loader:
            for index, initial, drawn in (t.tolist() for t in batch):
                key = derive_seed(9, "sample", epoch, int(index))
                assert initial == float(key)
                assert drawn == float(np.random.default_rng(key).integers(2**62))


def test_globals_are_seeded_as_by_the_public_calls() -> None:
    """The fast per-sample seeding leaves the state random.seed / np.random.seed / manual_seed give."""
    loader = SeededLoader(Draws(5, use_sample_rng=False), batch_size=5, seed=4, shuffle=False)
    (batch,) = list(loader)
    for index, py, npy, th in batch.tolist():
        key = derive_seed(4, "sample", 0, int(index))
        assert py == random.Random(key).random()
        assert npy == np.random.RandomState(key >> 32).rand()
        assert th == float(torch.rand((), generator=torch.Generator().manual_seed(key)))


def test_collate_is_keyed_by_batch(rng_changes_ok: None) -> None:
    batches = list(SeededLoader(Draws(8), batch_size=4, seed=2, collate_fn=collate_with_draw))
    for b, batch in enumerate(batches):
        torch.default_generator.manual_seed(derive_seed(2, "batch", 0, b))
        expected = torch.rand(4, 1, dtype=torch.float64)
        assert torch.equal(batch[:, -1:], expected)


def test_sample_rng_outside_a_loader_raises() -> None:
    with pytest.raises(ReproError, match="outside a sample being loaded by a SeededLoader"):
        sample_rng()


# -- resume ------------------------------------------------------------------------------------


def test_resume_in_process_continues_exactly(reference: list[torch.Tensor]) -> None:
    """Stop and resume several times (mid-epoch, at the boundary, twice in one epoch)."""

    def make(num_workers: int) -> SeededLoader:
        return SeededLoader(
            Draws(), batch_size=4, seed=3, collate_fn=collate_with_draw, num_workers=num_workers
        )

    got: list[torch.Tensor] = []
    state: dict[str, Any] | None = None
    passes = 0
    for stop, num_workers in [((0, 2), 0), ((0, 6), 2), ((1, 1), 0), ((1, 4), 0), ((1, 6), 2)]:
        loader = make(num_workers)
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))
        stopped = False
        while not stopped:  # an epoch loop: a resume at (0, 6) first finishes epoch 0's (empty) rest
            passes += 1
            for batch in loader:
                got.append(batch)
                if (loader.epoch, loader.state_dict()["batches_consumed"]) == stop:
                    stopped = True
                    break
        state = loader.state_dict()
        assert (state["epoch"], state["batches_consumed"], state["finished"]) == (*stop, False)
    assert same(got, reference)
    assert passes == 6  # one pass per resume, plus epoch 0's empty rest after the stop at (0, 6)


class Counting(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.loaded.append(index)
        return index


def test_resume_skips_by_index_without_loading_skipped_samples() -> None:
    first = SeededLoader(Counting(40), batch_size=4, seed=0)
    it = iter(first)
    consumed = [next(it).tolist() for _ in range(7)]
    dataset = Counting(40)
    resumed = SeededLoader(dataset, batch_size=4, seed=0)
    resumed.load_state_dict(first.state_dict())
    rest = [b.tolist() for b in resumed]
    assert dataset.loaded == [i for b in rest for i in b]  # only the remaining 12 samples
    assert sorted(i for b in consumed + rest for i in b) == list(range(40))
    assert len(iter(resumed)) == 10  # the next pass is a whole new epoch


def test_position_counts_received_batches_not_prefetched() -> None:
    loader = SeededLoader(Draws(40), batch_size=2, seed=0, num_workers=2, prefetch_factor=4)
    it = iter(loader)
    next(it), next(it)
    assert loader.state_dict()["batches_consumed"] == 2
    assert len(it) == 18


def test_state_after_a_finished_epoch_resumes_at_the_next_epoch() -> None:
    loader = SeededLoader(list(range(10)), batch_size=4, seed=0)
    list(loader)
    state = loader.state_dict()
    assert (state["epoch"], state["batches_consumed"], state["num_batches"]) == (0, 3, 3)
    resumed = SeededLoader(list(range(10)), batch_size=4, seed=0)
    resumed.load_state_dict(state)
    assert order(resumed) == order(loader) and resumed.epoch == loader.epoch == 1


def test_state_dict_is_json_and_round_trips() -> None:
    loader = SeededLoader(list(range(10)), batch_size=4, seed=2**64 - 1, rank=1, world_size=2)
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state["version"] == 1 and state["seed"] == 2**64 - 1
    assert (state["dataset_length"], state["batch_size"], state["rank"], state["world_size"]) == (10, 4, 1, 2)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"dataset": list(range(11))}, "dataset_length: state has 10, this loader has 11"),
        ({"batch_size": 5}, "batch_size: state has 4, this loader has 5"),
        ({"world_size": 3}, "world_size: state has 2, this loader has 3"),
        ({"seed": 1}, "seed: state has 0, this loader has 1"),
        ({"drop_last": True}, "drop_last: state has False, this loader has True"),
        ({"shuffle": False}, "shuffle: state has True, this loader has False"),
    ],
)
def test_mismatched_state_names_the_mismatch(kwargs: dict[str, Any], named: str) -> None:
    base = {"dataset": list(range(10)), "batch_size": 4, "seed": 0, "rank": 0, "world_size": 2}
    state = SeededLoader(**base).state_dict()  # type: ignore[arg-type]
    other = SeededLoader(**{**base, **kwargs})  # type: ignore[arg-type]
    with pytest.raises(DataLoaderStateError, match=named):
        other.load_state_dict(state)


def test_state_from_another_rank_loads() -> None:
    saved = SeededLoader(list(range(10)), batch_size=2, seed=0, rank=1, world_size=2)
    it = iter(saved)
    next(it)
    loader = SeededLoader(list(range(10)), batch_size=2, seed=0, rank=0, world_size=2)
    loader.load_state_dict(saved.state_dict())
    assert len(order(loader)) == 3  # 5 samples per rank in batches of 2, 1 batch consumed


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 99}, "version 99"),
        ({"epoch": -1}, "epoch=-1"),
        ({"batches_consumed": 4}, "batches_consumed=4, but an epoch of this loader has only 3"),
        ({"batch_size": None}, "batch_size=None"),
    ],
)
def test_malformed_state_is_rejected(change: dict[str, Any], message: str) -> None:
    loader = SeededLoader(list(range(10)), batch_size=4, seed=0)
    with pytest.raises(DataLoaderStateError, match=message):
        loader.load_state_dict({**loader.state_dict(), **change})
    with pytest.raises(DataLoaderStateError, match="missing"):
        loader.load_state_dict({"version": 1})
    with pytest.raises(DataLoaderStateError, match="expects the dict"):
        loader.load_state_dict([1, 2])  # type: ignore[arg-type]


# -- arguments ---------------------------------------------------------------------------------


def test_is_a_dataloader_and_keeps_the_users_dataset(rng_changes_ok: None) -> None:
    dataset = Draws(10, use_sample_rng=False)
    loader = SeededLoader(dataset, batch_size=4, seed=0, drop_last=True)
    assert isinstance(loader, DataLoader)
    assert loader.source_dataset is dataset
    # loader.dataset is a seeding view: the user's attributes, length and plain indices pass through.
    view: Any = loader.dataset
    assert (len(view), view.n, view.use_sample_rng) == (10, 10, False)
    torchrepro.seed_everything(0)
    plain = view[3]
    torchrepro.seed_everything(0)
    assert torch.equal(plain, dataset[3]) and int(plain[0]) == 3
    with pytest.raises(AttributeError):
        view.no_such_attribute  # noqa: B018
    assert (loader.batch_size, loader.drop_last, len(loader), loader.seed) == (4, True, 2, 0)


def test_seed_defaults_to_seed_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchrepro.seeding, "_current_seed", None)
    with pytest.raises(ReproError, match=r"pass seed=<int>, or call torchrepro.seed_everything"):
        SeededLoader(list(range(4)), batch_size=2)
    monkeypatch.setattr(torchrepro.seeding, "_current_seed", 7)
    assert order(SeededLoader(list(range(9)), batch_size=2)) == order(
        SeededLoader(list(range(9)), batch_size=2, seed=7)
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"sampler": [0, 1]}, LoaderConfigError, "does not accept sampler=.*shuffle=False"),
        ({"batch_sampler": [[0]]}, LoaderConfigError, "does not accept batch_sampler="),
        ({"generator": torch.Generator()}, LoaderConfigError, "owns its generators"),
        ({"in_order": False}, LoaderConfigError, "in_order=True"),
        ({"batch_size": 0}, ValueError, "positive int, got 0"),
        ({"batch_size": None}, ValueError, "positive int, got None"),
        ({"shuffle": 1}, TypeError, "shuffle must be a bool"),
        ({"rank": 0}, LoaderConfigError, "pass both"),
        ({"rank": 2, "world_size": 2}, ValueError, "0 <= rank < world_size"),
        ({"seed": -1}, ValueError, r"seed must be in \[0, 2\*\*64 - 1\]"),
        ({"dataset": Stream()}, UnsupportedDatasetError, "map-style datasets.*IterableDataset Stream"),
        ({"dataset": 5}, UnsupportedDatasetError, "__getitem__ and __len__"),
    ],
)
def test_bad_arguments_are_explained(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    base: dict[str, Any] = {"dataset": list(range(4)), "batch_size": 2, "seed": 0}
    with pytest.raises(error, match=message):
        SeededLoader(**{**base, **kwargs})


def test_config_errors_are_repro_errors() -> None:
    assert issubclass(LoaderConfigError, ReproError) and issubclass(LoaderConfigError, ValueError)
    assert issubclass(UnsupportedDatasetError, ReproError) and issubclass(UnsupportedDatasetError, TypeError)


# -- loop shapes: set_epoch after a restore, a checkpoint at an epoch's last batch ---------------


def _epochs(loader: SeededLoader) -> list[tuple[int, list[int]]]:
    """One pass: (epoch, indices) per batch."""
    return [(loader.epoch, [int(i) for i in batch]) for batch in loader]


def test_set_epoch_keeps_a_restored_position_and_starts_other_epochs() -> None:
    full = SeededLoader(list(range(20)), batch_size=4, seed=1)
    epoch0, epoch1 = order(full), order(full)
    saver = SeededLoader(list(range(20)), batch_size=4, seed=1)
    saver.set_epoch(1)
    it = iter(saver)
    next(it), next(it)
    state = saver.state_dict()

    resumed = SeededLoader(list(range(20)), batch_size=4, seed=1)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # `for epoch in range(start, E): loader.set_epoch(epoch)` after the restore
    assert order(resumed) == epoch1[8:]  # the position was kept: no replay
    resumed.set_epoch(1)  # that pass ended: the same epoch again starts from its first batch
    assert order(resumed) == epoch1
    resumed.set_epoch(0)
    assert order(resumed) == epoch0

    other = SeededLoader(list(range(20)), batch_size=4, seed=1)
    other.load_state_dict(state)
    other.set_epoch(0)  # another epoch than the restored one starts that epoch
    assert order(other) == epoch0

    # Only a restored position is kept: a pass left early (a peek at one batch, an evaluation
    # capped at a few batches) restarts with set_epoch, as with DistributedSampler.
    peeked = SeededLoader(list(range(20)), batch_size=4, seed=1)
    next(iter(peeked))
    peeked.set_epoch(0)
    assert order(peeked) == epoch0


def test_a_checkpoint_at_an_epochs_last_batch_resumes_into_its_empty_rest() -> None:
    def loop(loader: SeededLoader, epochs: int, stop: tuple[int, int] | None = None) -> list[str]:
        """An epoch loop with code after the inner loop; stops (without ending the pass) at `stop`."""
        log = []
        while loader.epoch < epochs or loader.state_dict()["finished"] is False:
            for batch in loader:
                log.append(f"batch {loader.epoch}:{int(batch[0])}")
                if stop == (loader.epoch, loader.state_dict()["batches_consumed"]):
                    return log
            log.append(f"end of epoch {loader.epoch}")
            if loader.epoch == epochs - 1:
                break
        return log

    make = lambda: SeededLoader(list(range(12)), batch_size=4, seed=2)  # noqa: E731
    reference = loop(make(), 3)
    assert reference.count("end of epoch 0") == 1 and len(reference) == 12
    for stop in [(e, b) for e in range(3) for b in range(1, 4)]:
        first = make()
        head = loop(first, 3, stop)
        saved = first.state_dict()
        assert saved["finished"] is False
        resumed = make()
        resumed.load_state_dict(json.loads(json.dumps(saved)))
        assert head + loop(resumed, 3) == reference, stop

    # Saved after the inner loop ended: the next pass is the next epoch.
    after = make()
    for _ in after:
        pass
    state = after.state_dict()
    assert (state["epoch"], state["batches_consumed"], state["finished"]) == (0, 3, True)
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.epoch == 1 and len(order(resumed)) == 12
    # A state written before "finished" existed reads as before (a full epoch is finished).
    old = {k: v for k, v in state.items() if k != "finished"}
    legacy = make()
    legacy.load_state_dict(old)
    assert legacy.epoch == 1


def test_the_sampler_is_a_distributed_sampler_read_at_each_pass() -> None:
    from torch.utils.data.distributed import DistributedSampler

    loader = SeededLoader(list(range(10)), batch_size=2, seed=0)
    sampler: Any = loader.sampler
    assert isinstance(sampler, DistributedSampler)
    assert (sampler.rank, sampler.num_replicas, sampler.num_samples, sampler.shuffle) == (0, 1, 10, True)
    fixed: Any = SeededLoader(list(range(10)), batch_size=2, seed=0, rank=1, world_size=3).sampler
    assert (fixed.rank, fixed.num_replicas, fixed.num_samples, fixed.total_size) == (1, 3, 4, 12)
    with pytest.raises(LoaderConfigError, match=r"use_distributed_sampler=False"):
        SeededLoader(list(range(10)), batch_size=2, seed=0, sampler=DistributedSampler(range(10), 1, 0))


class Indexed(Dataset[torch.Tensor]):
    """Sample i: [i, a torch draw]; raises on anything but an int index (as a user's dataset would)."""

    def __len__(self) -> int:
        return 18

    def __getitem__(self, index: int) -> torch.Tensor:
        if not isinstance(index, int):
            raise IndexError(f"expected an int index, got {index!r}")
        return torch.tensor([float(index), float(torch.rand(()))], dtype=torch.float64)


def rebuilt(loader: SeededLoader, **kwargs: Any) -> DataLoader[Any]:
    """What accelerate's prepare (and other frameworks) build from a loader's parts."""
    return DataLoader(
        loader.dataset,
        batch_sampler=loader.batch_sampler,
        collate_fn=loader.collate_fn,
        generator=loader.generator,
        **kwargs,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_plain_dataloader_rebuilt_from_its_parts_keeps_its_batches(
    num_workers: int, rng_changes_ok: None
) -> None:
    reference = passes(SeededLoader(Indexed(), batch_size=4, seed=5), epochs=3)
    loader = SeededLoader(Indexed(), batch_size=4, seed=5)
    plain = rebuilt(loader, num_workers=num_workers)
    got = passes(plain, epochs=3)  # each pass of the rebuilt loader advances the epoch by itself
    assert same(got, reference)
    assert loader.epoch == 2 and loader.state_dict()["finished"] is True
    # Without workers, the position of a rebuilt loader's pass is what the loop received.
    if num_workers == 0:
        sampler_loader = SeededLoader(Indexed(), batch_size=4, seed=5)
        for i, _ in enumerate(rebuilt(sampler_loader)):
            if i == 2:
                break
        state = sampler_loader.state_dict()
        assert (state["epoch"], state["batches_consumed"], state["finished"]) == (0, 3, False)
        resumed = SeededLoader(Indexed(), batch_size=4, seed=5)
        resumed.load_state_dict(state)
        assert same(passes(resumed, epochs=1), reference[3:5])
    # set_epoch through the sampler (what accelerate's and the HF Trainer's set_epoch call)
    sampler: Any = plain.batch_sampler.sampler  # type: ignore[union-attr]
    sampler.set_epoch(1)
    assert same(passes(plain, epochs=1), reference[5:10])

    # negative control: the same rebuild from a plain DataLoader draws differently per worker count
    base = DataLoader(Indexed(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    a = passes(DataLoader(Indexed(), batch_sampler=base.batch_sampler, num_workers=0), epochs=1)
    torch.manual_seed(0)
    b = passes(DataLoader(Indexed(), batch_sampler=base.batch_sampler, num_workers=num_workers), epochs=1)
    assert not same(a, b) or num_workers == 0
    assert not same(a, reference[:5])


def test_a_seededloader_rebuilt_from_its_attributes_keeps_its_batches() -> None:
    """Lightning-style re-instantiation: the constructor gets the instance's attributes back."""
    reference = passes(SeededLoader(Indexed(), batch_size=4, seed=5, collate_fn=collate_with_draw))
    original = SeededLoader(Indexed(), batch_size=4, seed=5, collate_fn=collate_with_draw)
    attrs = {k: v for k, v in vars(original).items() if not k.startswith("_")}
    again = SeededLoader(
        attrs.pop("dataset"),
        batch_size=attrs.pop("batch_size"),
        drop_last=attrs.pop("drop_last"),
        sampler=attrs.pop("sampler"),
        batch_sampler=attrs.pop("batch_sampler"),
        generator=attrs.pop("generator"),
        collate_fn=attrs.pop("collate_fn"),
    )
    assert again.seed == 5 and again.source_dataset is original.source_dataset
    assert same(passes(again), reference)


# -- lazily seeded globals: only the RNGs a dataset draws from, never a different result -------


class Sometimes(Dataset[torch.Tensor]):
    """Draws from NumPy only from index 12 on and from Python's random only for odd indices
    (a process learns, from the first batches, that the dataset does not draw from them)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        a = float(np.random.rand()) if index >= 12 else -1.0
        b = random.random() if index % 2 else -1.0
        return torch.tensor([float(index), a, b], dtype=torch.float64)


def expected_sometimes(seed: int, epoch: int, index: int) -> list[float]:
    """What a sample is when every global RNG is seeded from its key, computed by hand."""
    key = derive_seed(seed, "sample", epoch, index)
    np.random.seed(key >> 32)
    random.seed(key)
    a = float(np.random.rand()) if index >= 12 else -1.0
    b = random.random() if index % 2 else -1.0
    return [float(index), a, b]


@pytest.mark.parametrize("config", [{"num_workers": 0}, {"num_workers": 2, "persistent_workers": True}])
def test_lazily_seeded_globals_give_every_sample_its_keyed_draws(
    config: dict[str, Any], rng_changes_ok: None
) -> None:
    loader = SeededLoader(Sometimes(), batch_size=4, seed=11, shuffle=False, **config)
    for epoch in range(2):
        for batch in loader:
            for row in batch.tolist():
                assert row == expected_sometimes(11, epoch, int(row[0])), (epoch, row)


def test_lazy_seeding_is_load_bearing(monkeypatch: pytest.MonkeyPatch, rng_changes_ok: None) -> None:
    """Negative control: without the check after each batch (nothing seen drawn), the samples
    that draw from an RNG the process stopped seeding get draws that are not theirs."""
    monkeypatch.setattr(data_view, "_changed", lambda which, before, np: 0)
    loader = SeededLoader(Sometimes(), batch_size=4, seed=11, shuffle=False)
    rows = [row for batch in loader for row in batch.tolist()]
    wrong = [row for row in rows if row != expected_sometimes(11, 0, int(row[0]))]
    assert wrong and all(row[0] >= 12 or row[0] % 2 for row in wrong)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_set_epoch_between_iter_and_first_batch_or_after_it(num_workers: int) -> None:
    """Frameworks (Lightning) create the iterator, then call set_epoch, possibly after their
    first fetch: the epoch set before the first batch decides the pass, and a set_epoch of the
    same epoch during a pass leaves that pass counting."""
    make = lambda: SeededLoader(list(range(12)), batch_size=4, seed=4, num_workers=num_workers)  # noqa: E731
    reference = make()
    epochs = [order(reference) for _ in range(3)]

    loader = make()
    it = iter(loader)
    loader.set_epoch(2)  # before the first batch: the pass is epoch 2 (workers start at iter())
    assert [int(i) for batch in it for i in batch] == epochs[2]

    live = make()
    it = iter(live)
    first = [int(i) for i in next(it)]
    live.set_epoch(0)  # during the pass, same epoch: it goes on counting
    rest = [int(i) for batch in it for i in batch]
    assert first + rest == epochs[0]
    assert (live.state_dict()["batches_consumed"], live.state_dict()["finished"]) == (3, True)

    restored = make()
    state = {**live.state_dict(), "batches_consumed": 1, "finished": False}
    restored.load_state_dict(state)
    it = iter(restored)
    restored.set_epoch(0)  # the restored epoch: continue after the restored batch
    assert [int(i) for batch in it for i in batch] == epochs[0][4:]
