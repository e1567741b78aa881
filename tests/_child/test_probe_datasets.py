"""Which global RNGs a DataLoader's dataset draws from, and the line that draws
(``_child.probe.datasets``); the random-augmentation hint beside it."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from torchrepro._child.probe.datasets import probe_dataset, random_hint

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


def testrandom_hint() -> None:
    assert random_hint(WithTransform()) == "transforms RandomCropLike"
    assert random_hint(DrawsNumpy()) == "DrawsNumpy.__getitem__ calls np.random."
    assert random_hint(Plain()) is None
    assert random_hint(torch.utils.data.Subset(WithTransform(), [0])) == "transforms RandomCropLike"


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
    found = probe_dataset(dataset)
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
    assert probe_dataset(DrawsRandom())["sites"] == {"random": _draw_line(DrawsRandom, "random.random()")}
    assert probe_dataset(DrawsTwoRngs())["sites"] == {
        "torch": _draw_line(DrawsTwoRngs, "torch.rand(1)"),
        "numpy": _draw_line(DrawsTwoRngs, "np.random.uniform()"),
    }
    assert probe_dataset(DrawsInAHelper())["sites"] == {"random": _draw_line(_flip, "random.random()")}
    # a tracer already on (a debugger, coverage) is left alone: no line, the rest unchanged
    previous = sys.gettrace()
    sys.settrace(lambda *a: None)
    try:
        found = probe_dataset(DrawsRandom())
    finally:
        sys.settrace(previous)
    assert found == {"ran": True, "draws": ["random"], "unstable": False}


def test_probe_is_not_fooled_by_what_the_source_says() -> None:
    # negative control: the source heuristic flags the self-seeding dataset, the probe does not
    assert random_hint(FakeDataLike()) == "FakeDataLike.__getitem__ calls torch.randn"
    assert probe_dataset(FakeDataLike())["draws"] == []
    # nor by the class name: a self-seeding class named like one that draws is still clean
    namesake = type("DrawsRandom", (FakeDataLike,), {})
    assert probe_dataset(namesake())["draws"] == [] and probe_dataset(DrawsRandom())["draws"] == ["random"]


def test_probe_leaves_the_scripts_draws_alone(rng_changes_ok: None) -> None:
    import random

    random.seed(3)
    torch.manual_seed(3)
    expected = (random.random(), torch.rand(2))
    random.seed(3)
    torch.manual_seed(3)
    probe_dataset(DrawsRandom())
    probe_dataset(DrawsTorch())
    got = (random.random(), torch.rand(2))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])
