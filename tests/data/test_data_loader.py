"""SeededLoader: invariance to how batches are loaded, resume, arguments, loop shapes.

Every invariance claim has a negative control showing that a plain DataLoader differs.
Datasets are tiny; worker processes are real (fork, and spawn once).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from dataloading import Draws, assert_same_states, collate_with_draw, global_states, order, passes, same
from torch.utils.data import DataLoader, Dataset, IterableDataset

import torchrepro
from torchrepro import DataLoaderStateError, ReproError, SeededLoader
from torchrepro.data import LoaderConfigError, UnsupportedDatasetError

no_accelerator = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")

# -- datasets (module level: spawn workers import them) --------------------------------------------


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


class Counting(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.loaded.append(index)
        return index


class Indexed(Dataset[torch.Tensor]):
    """Sample i: [i, a torch draw]; raises on anything but an int index (as a user's dataset would)."""

    def __len__(self) -> int:
        return 18

    def __getitem__(self, index: int) -> torch.Tensor:
        if not isinstance(index, int):
            raise IndexError(f"expected an int index, got {index!r}")
        return torch.tensor([float(index), float(torch.rand(()))], dtype=torch.float64)


# -- invariance ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> list[torch.Tensor]:
    return passes(SeededLoader(Draws(), batch_size=4, seed=3, collate_fn=collate_with_draw))


LOADING_CONFIGS = [
    pytest.param({"num_workers": 1}, id="workers1"),
    pytest.param({"num_workers": 2}, id="workers2"),
    pytest.param({"num_workers": 3}, id="workers3"),
    pytest.param({"num_workers": 2, "persistent_workers": True}, id="persistent"),
    pytest.param({"num_workers": 2, "prefetch_factor": 1}, id="prefetch1"),
    pytest.param(
        {"num_workers": 3, "prefetch_factor": 4, "persistent_workers": True},
        id="workers3-prefetch4-persistent",
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


# -- the training loop's RNG -----------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loading_never_moves_the_global_rng(num_workers: int) -> None:
    before = global_states()
    batches = passes(SeededLoader(Draws(), batch_size=4, seed=0, num_workers=num_workers), epochs=1)
    assert len(batches) == 6
    assert_same_states(before, global_states())


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


# -- resume ----------------------------------------------------------------------------------------


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


# -- arguments -------------------------------------------------------------------------------------


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
        ({"dataset": Stream()}, UnsupportedDatasetError, "IterableDataset Stream.*torchrepro.ShardedDataset"),
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


# -- loop shapes: set_epoch after a restore, a checkpoint at an epoch's last batch -----------------


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


# -- frameworks: a loader rebuilt from its parts or its attributes ---------------------------------


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
