"""The audit's probe in the child (``_child.probe``): which global RNGs a dataset draws from, the
sampler that draws the order, seeds drawn from unseeded sources, the random-augmentation hint."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from torchrepro._child.probe import _probe_dataset, _random_hint, _sampler_facts

# --------------------------------------------------------------------------------------------
# The DataLoader random-augmentation hint


class RandomCropLike:
    def __call__(self, x: object) -> object:
        return x


class Compose:
    def __init__(self, transforms: list[object]) -> None:
        self.transforms = transforms


class WithTransform(torch.utils.data.Dataset[int]):
    transform = Compose([RandomCropLike()])

    def __getitem__(self, i: int) -> int:
        return i


class DrawsNumpy(torch.utils.data.Dataset[float]):
    def __getitem__(self, i: int) -> float:
        import numpy as np

        return float(np.random.uniform())


class Plain(torch.utils.data.Dataset[int]):
    def __getitem__(self, i: int) -> int:
        return i * 2


def test_random_hint() -> None:
    assert _random_hint(WithTransform()) == "transforms RandomCropLike"
    assert _random_hint(DrawsNumpy()) == "DrawsNumpy.__getitem__ calls np.random."
    assert _random_hint(Plain()) is None
    assert _random_hint(torch.utils.data.Subset(WithTransform(), [0])) == "transforms RandomCropLike"


# --------------------------------------------------------------------------------------------
# The per-dataset probe: which global RNG does __getitem__ draw from, found by loading index 0


class _Sized(torch.utils.data.Dataset[Any]):
    def __len__(self) -> int:
        return 4


class DrawsRandom(_Sized):
    def __getitem__(self, i: int) -> float:
        import random

        return i + random.random()


class DrawsNumpyGlobal(_Sized):
    def __getitem__(self, i: int) -> Any:
        import numpy as np

        return {"x": np.arange(3.0) + np.random.uniform(), "y": i}


class DrawsTorch(_Sized):
    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(3)


class FakeDataLike(_Sized):
    """torchvision's FakeData: seeds torch per index and restores the state; its source calls
    torch.randn, so the name/source heuristic takes it for random augmentation."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        state = torch.get_rng_state()
        torch.manual_seed(i + 7)
        x = torch.randn(3)
        torch.set_rng_state(state)
        return x, i


class OwnUnseededGenerator(_Sized):
    def __getitem__(self, i: int) -> float:
        import numpy as np

        return float(np.random.default_rng().uniform())


class Doubles(_Sized):
    def __getitem__(self, i: int) -> int:
        return i * 2


class Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(3))


class Broken(_Sized):
    def __getitem__(self, i: int) -> int:
        raise KeyError(i)


@pytest.mark.parametrize(
    ("dataset", "expected"),
    [
        (DrawsRandom(), {"ran": True, "draws": ["random"], "unstable": False}),
        (DrawsNumpyGlobal(), {"ran": True, "draws": ["numpy"], "unstable": False}),
        (DrawsTorch(), {"ran": True, "draws": ["torch"], "unstable": False}),
        (FakeDataLike(), {"ran": True, "draws": [], "unstable": False}),
        (Doubles(), {"ran": True, "draws": [], "unstable": False}),
        (OwnUnseededGenerator(), {"ran": True, "draws": [], "unstable": True}),
        (Stream(), {"ran": False, "reason": "an IterableDataset has no index to load twice"}),
        (Broken(), {"ran": False, "reason": "loading index 0 raised KeyError"}),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, torch.utils.data.Dataset) else "",
)
def test_probe_finds_the_global_rng_a_dataset_draws_from(dataset: Any, expected: dict[str, Any]) -> None:
    # the autouse fixture asserts the probe left every global RNG state as it found it
    found = _probe_dataset(dataset)
    assert {k: v for k, v in found.items() if k != "sites"} == expected
    if sys.gettrace() is None:  # a line for each RNG drawn (none under a tracer: coverage, a debugger)
        assert set(found.get("sites", {})) == set(expected.get("draws", ()))


def _draw_line(obj: Any, text: str) -> str:
    """``file:line`` (as the probe shows it) of the line of ``obj``'s source holding ``text``."""
    import inspect
    import os

    lines, first = inspect.getsourcelines(obj)
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    return f"{os.path.relpath(inspect.getfile(obj))}:{first + offset}"


def _flip(x: float) -> float:
    import random

    return -x if random.random() < 0.5 else x  # the draw, in a helper __getitem__ calls


class DrawsInAHelper(_Sized):
    def __getitem__(self, i: int) -> float:
        x = float(i)
        x = _flip(x)
        return x


class DrawsTwoRngs(_Sized):
    def __getitem__(self, i: int) -> Any:
        import numpy as np

        a = torch.rand(1)
        b = np.random.uniform()
        return a, b


@pytest.mark.skipif(sys.gettrace() is not None, reason="a tracer (coverage, a debugger) is on")
def test_probe_finds_the_line_that_draws() -> None:
    assert _probe_dataset(DrawsRandom())["sites"] == {"random": _draw_line(DrawsRandom, "random.random()")}
    assert _probe_dataset(DrawsTwoRngs())["sites"] == {
        "torch": _draw_line(DrawsTwoRngs, "torch.rand(1)"),
        "numpy": _draw_line(DrawsTwoRngs, "np.random.uniform()"),
    }
    assert _probe_dataset(DrawsInAHelper())["sites"] == {"random": _draw_line(_flip, "random.random()")}
    # a tracer already on (a debugger, coverage) is left alone: no line, the rest unchanged
    previous = sys.gettrace()
    sys.settrace(lambda *a: None)
    try:
        found = _probe_dataset(DrawsRandom())
    finally:
        sys.settrace(previous)
    assert found == {"ran": True, "draws": ["random"], "unstable": False}


def test_probe_is_not_fooled_by_what_the_source_says() -> None:
    # negative control: the source heuristic flags the self-seeding dataset, the probe does not
    assert _random_hint(FakeDataLike()) == "FakeDataLike.__getitem__ calls torch.randn"
    assert _probe_dataset(FakeDataLike())["draws"] == []
    # nor by the class name: a self-seeding class named like one that draws is still clean
    namesake = type("DrawsRandom", (FakeDataLike,), {})
    assert _probe_dataset(namesake())["draws"] == [] and _probe_dataset(DrawsRandom())["draws"] == ["random"]


def test_probe_leaves_the_scripts_draws_alone(rng_changes_ok: None) -> None:
    import random

    random.seed(3)
    torch.manual_seed(3)
    expected = (random.random(), torch.rand(2))
    random.seed(3)
    torch.manual_seed(3)
    _probe_dataset(DrawsRandom())
    _probe_dataset(DrawsTorch())
    got = (random.random(), torch.rand(2))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])


def test_sampler_facts_name_the_sampler_that_draws_the_order() -> None:
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    data = Doubles()
    seeded = torch.Generator().manual_seed(0)
    cases = [
        (DataLoader(data, shuffle=True), None, ("RandomSampler", False)),
        (DataLoader(data, shuffle=True, generator=seeded), None, ("RandomSampler", True)),
        (
            DataLoader(data, sampler=RandomSampler(data), generator=seeded),
            "sampler",
            ("RandomSampler", False),
        ),
        (
            DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data, generator=seeded), 2, False)),
            "batch_sampler",
            ("RandomSampler", True),
        ),
        (DataLoader(data), None, ("SequentialSampler", False)),
    ]
    for loader, given, (sampler, has_generator) in cases:
        facts = _sampler_facts(loader, given)
        assert (facts["sampler"], facts["sampler_generator"]) == (sampler, has_generator)
        assert facts["shuffle"] == (sampler == "RandomSampler")


def test_probe_tells_seeds_drawn_from_unseeded_sources(tmp_path: Path) -> None:
    import time

    from torchrepro._child.probe import SettingsProbe

    probe = SettingsProbe(str(tmp_path / "probe.json"))  # not installed: nothing is patched
    probe._drawn[1_234_567] = "random.randint"
    probe._on_seed("torch", "torch.manual_seed", 1_234_567)
    probe._on_seed("numpy", "np.random.seed", int(time.time() * 1000))
    probe._on_seed("random", "random.seed", None)
    assert [(c["call"], c["source"]) for c in probe.tainted_seeds] == [
        ("torch.manual_seed", "random.randint"),
        ("np.random.seed", "the current time"),
        ("random.seed", "OS entropy (called without a seed)"),
    ]
    assert probe.seeded == {"torch": False, "numpy": False, "random": False}
    # constants no unseeded source returned are clean, and the last seeding decides
    for value in (0, 1_234_568, 2**31 - 1):
        probe._on_seed("torch", "torch.manual_seed", value)
        assert probe.seeded["torch"] is True
    assert len(probe.tainted_seeds) == 3


def test_a_constant_seed_is_clean_whatever_an_unseeded_source_returned(tmp_path: Path) -> None:
    import sys

    from torchrepro._child.probe import SettingsProbe

    probe = SettingsProbe(str(tmp_path / "probe.json"))  # not installed: nothing is patched
    here = sys._getframe()
    probe._drawn_from("random.randint", 42, here, lambda v: [v], user_only=False)
    drawn = int("4821")  # an int object of its own, as randint returns
    probe._drawn_from("random.randint", drawn, here, lambda v: [v], user_only=False)
    probe._on_seed("torch", "torch.manual_seed", 42, sys._getframe())
    probe._on_seed("torch", "torch.manual_seed", 4821, sys._getframe())
    assert probe.tainted_seeds == [] and probe.seeded["torch"] is True
    # the object the source returned is recognised by identity, however small its value
    probe._on_seed("torch", "torch.manual_seed", drawn, sys._getframe())
    assert [(c["source"], c["rng"]) for c in probe.tainted_seeds] == [("random.randint", "torch")]


def test_generators_keep_working_and_their_seeding_is_noted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io
    import pickle
    import sys
    import time

    from torchrepro._child.probe import SettingsProbe

    monkeypatch.setattr(torch, "Generator", torch.Generator)  # restored after the test
    probe = SettingsProbe(str(tmp_path / "probe.json"))
    probe._watch_generators()
    clock = time.time_ns()
    probe._drawn_from("time.time_ns", clock, sys._getframe(), None, user_only=False)
    g = torch.Generator().manual_seed(clock)
    fixed = torch.Generator().manual_seed(7)
    assert [(c["call"], c["rng"], c["source"]) for c in probe.tainted_seeds] == [
        ("torch.Generator().manual_seed", "generator", "time.time_ns")
    ]
    assert probe.seeded == {}  # a generator's seed is not a global RNG's
    # every generator is still a torch.Generator, and torch takes the new ones everywhere
    assert isinstance(g, torch.Generator) and isinstance(torch.default_generator, torch.Generator)
    assert issubclass(torch._C.Generator, torch.Generator)
    loader = torch.utils.data.DataLoader(list(range(8)), shuffle=True, generator=fixed)
    expected = torch.utils.data.DataLoader(
        list(range(8)), shuffle=True, generator=torch._C.Generator().manual_seed(7)
    )
    assert [b.tolist() for b in loader] == [b.tolist() for b in expected]
    # saved, it is a plain generator (loadable without torchrepro)
    buffer = io.BytesIO()
    torch.save(g, buffer)
    assert pickle.loads(pickle.dumps(g)).__class__ is torch._C.Generator
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False).initial_seed() == clock
