"""Where a seeding call's value came from, read from the script's source (``_child.sources``):
only calls to an unseeded source that the run confirms were made from that line count."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from torchrepro._child.sources import seed_source

MODULE = """
import fake_random as random
from fake_random import randint


def direct(seed):
    return seed(random.randint(1, 10000))


def through_names(seed):
    drawn = randint(1, 10000)
    value = drawn % 100
    return seed(value)


def constant(seed):
    random.randint(42, 42)
    return seed(42)


def reassigned(seed):
    value = random.randint(1, 10000)
    value = 42
    return seed(value)


def branch_not_taken(seed, fresh=False):
    value = 42
    if fresh:
        value = random.randint(1, 10000)
    return seed(value)


def parameter(seed, value):
    return seed(value)


def two_calls_on_a_line(seed):
    return seed(7) + seed(random.randint(1, 10))


GLOBAL = random.randint(1, 10000)


def reads_a_global(seed):
    return seed(GLOBAL)
"""


@pytest.fixture
def scripted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, list[Any]]:
    """The module above, with a ``fake_random`` whose ``randint`` notes the lines that call it
    (as the probe's wrapper does), and a seeding function that asks ``seed_source``."""
    sites: set[tuple[str, int]] = set()
    fake = types.ModuleType("fake_random")

    def randint(a: int, b: int) -> int:
        caller = sys._getframe(1)
        sites.add((caller.f_code.co_filename, caller.f_lineno))
        return a

    randint._torchrepro_source = "random.randint"  # type: ignore[attr-defined]
    fake.randint = randint  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_random", fake)
    path = tmp_path / "user_script.py"
    path.write_text(MODULE)
    spec = importlib.util.spec_from_file_location("user_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found: list[Any] = []

    def confirmed(filename: str, first: int, last: int, source: str) -> bool:
        return source == "random.randint" and any((filename, n) in sites for n in range(first, last + 1))

    def seed(value: Any) -> int:
        found.append(seed_source(sys._getframe(1), confirmed))
        return 0

    module.seed = seed  # type: ignore[attr-defined]
    return module, found


@pytest.mark.parametrize(
    ("function", "expected"),
    [
        ("direct", ["random.randint"]),
        ("through_names", ["random.randint"]),
        ("reads_a_global", ["random.randint"]),
        pytest.param(
            "two_calls_on_a_line",
            [None, "random.randint"],  # each call its own argument
            marks=pytest.mark.skipif(sys.version_info < (3, 11), reason="calls told apart by column: 3.11+"),
        ),
        # never a constant, whatever the source returned elsewhere
        ("constant", [None]),
        ("reassigned", [None]),
        ("branch_not_taken", [None]),  # the draw on the line the value names never ran
    ],
)
def test_seed_source(
    scripted: tuple[types.ModuleType, list[Any]], function: str, expected: list[Any]
) -> None:
    module, found = scripted
    getattr(module, function)(module.seed)
    assert found == expected


def test_a_parameter_is_not_traced_into_the_caller(scripted: tuple[types.ModuleType, list[Any]]) -> None:
    module, found = scripted
    module.parameter(module.seed, module.randint(1, 10000))
    assert found == [None]


SWITCHES = """
import torch
from torch.backends import cudnn

if torch.cuda.is_available():
    torch.backends.cudnn.benchmark = True
    torch.set_float32_matmul_precision("high")
elif args.fast:
    cudnn.allow_tf32 = True
else:
    torch.backends.cuda.matmul.allow_tf32 = False
torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cudnn.benchmark = args.benchmark
torch.backends.cudnn.benchmark = (
    True
)
"""


def test_switch_statements_with_literal_values_and_what_decides_them(tmp_path: Path) -> None:
    from torchrepro._child.sources import switch_statements

    path = tmp_path / "train.py"
    path.write_text(SWITCHES)
    found = [
        (s["line"], s["switch"], s["value"], s["condition"], s["cuda"]) for s in switch_statements(str(path))
    ]
    assert found == [
        (6, "cudnn_benchmark", True, "if torch.cuda.is_available()", True),
        (7, "float32_matmul_precision", "high", "if torch.cuda.is_available()", True),
        (9, "cudnn_allow_tf32", True, "if args.fast", False),  # the elif's own test decides it
        (11, "cuda_matmul_allow_tf32", False, "else of if args.fast", False),
        (12, "deterministic_algorithms", True, None, False),
        # line 13 (a value only known at run time) is not one
        (14, "cudnn_benchmark", True, None, False),
    ]
    (deterministic,) = [s for s in switch_statements(str(path)) if s["line"] == 12]
    assert deterministic["warn_only"] is True
    assert deterministic["text"] == "torch.use_deterministic_algorithms(True, warn_only=True)"
    assert switch_statements(str(path))[-1]["end_line"] == 16


ACCUMULATING = """\
import torch

for i, (x, y) in enumerate(loader):
    if (i + 1) % 4:
        with ddp.no_sync():
            loss(ddp(x), y).backward()
    fsdp_model.set_requires_gradient_sync((i + 1) % 4 == 0)
    fsdp_model.set_requires_gradient_sync(True)
    fsdp_model.set_requires_gradient_sync(
        False
    )
"""


def test_accumulation_statements_are_the_calls_that_delay_the_reduction(tmp_path: Path) -> None:
    from torchrepro._child.sources import accumulation_statements

    path = tmp_path / "train.py"
    path.write_text(ACCUMULATING)
    found = [(s["line"], s["call"], s["wrapper"]) for s in accumulation_statements(str(path))]
    assert found == [  # syncing every backward (a literal True, line 8) accumulates nothing
        (5, "no_sync", "DDP"),
        (7, "set_requires_gradient_sync", "FSDP2"),
        (9, "set_requires_gradient_sync", "FSDP2"),
    ]
    assert accumulation_statements(str(path))[-1]["text"] == "fsdp_model.set_requires_gradient_sync( False )"
