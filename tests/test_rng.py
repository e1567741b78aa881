"""RngState and fork_rng: exact round trips through weights_only files, isolation, bad input."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import torchrepro
from helpers import user_env
from torchrepro import RngState, RngStateError, fork_rng
from torchrepro.rng import RNG_STATE_VERSION

pytestmark = pytest.mark.usefixtures("rng_changes_ok")


def make_generators() -> dict[str, Any]:
    return {
        "torch": torch.Generator().manual_seed(11),
        "pcg": np.random.default_rng(12),
        "sfc": np.random.Generator(np.random.SFC64(13)),
        "philox": np.random.Generator(np.random.Philox(14)),
        "legacy": np.random.RandomState(15),
    }


def draw(gens: dict[str, Any]) -> list[float]:
    """One draw from every stream, including a Gaussian (cached second values are state too)."""
    return [
        random.random(),
        random.gauss(0, 1),
        float(np.random.rand()),
        float(np.random.randn()),
        float(torch.rand(1)),
        float(torch.randn(1)),
        float(torch.rand(1, generator=gens["torch"])),
        float(gens["pcg"].random()),
        float(gens["pcg"].integers(2**32)),  # leaves a cached uint32 in the bit generator state
        float(gens["sfc"].random()),
        float(gens["philox"].random()),
        float(gens["legacy"].randn()),
    ]


def roundtrip(d: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    loaded: dict[str, Any] = torch.load(buf, weights_only=True)
    return loaded


def test_file_round_trip_gives_identical_next_draws() -> None:
    torchrepro.seed_everything(3)
    gens = make_generators()
    draw(gens)  # leave Gaussian caches half used
    state = RngState.capture(generators=gens)
    expected = [draw(gens) for _ in range(3)]
    draw(gens)
    restored = RngState.from_dict(roundtrip(state.to_dict()))
    restored.restore(generators=gens)
    assert [draw(gens) for _ in range(3)] == expected


def test_to_dict_is_plain_data() -> None:
    d = RngState.capture(generators=make_generators()).to_dict()

    def check(value: object) -> None:
        if isinstance(value, dict):
            assert all(isinstance(k, str) for k in value)
            for v in value.values():
                check(v)
        elif isinstance(value, list):
            for v in value:
                check(v)
        else:
            assert isinstance(value, (torch.Tensor, int, float, str)), type(value)

    check(d)
    assert d["version"] == RNG_STATE_VERSION
    # Everything but the torch states is JSON as is.
    plain = {k: v for k, v in d.items() if k not in ("torch", "cuda", "generators")}
    assert json.loads(json.dumps(plain)) == plain


def test_restore_in_place_only_touches_named_generators() -> None:
    gens = make_generators()
    state = RngState.capture(generators=gens)
    first = float(gens["pcg"].random())
    other = float(gens["sfc"].random())
    state.restore(generators={"pcg": gens["pcg"]})
    assert float(gens["pcg"].random()) == first
    assert float(gens["sfc"].random()) != other  # not passed, so not rewound


def test_capture_copies_state() -> None:
    state = RngState.capture()
    a = torch.rand(4)
    state.restore()
    state.restore()  # restoring twice gives the same point again: nothing aliased
    assert torch.equal(torch.rand(4), a)


def test_capture_does_not_initialise_cuda() -> None:
    # in a fresh process: in this one, on a machine with a GPU, an earlier test may have started CUDA
    code = (
        "import torch\nfrom torchrepro import RngState, fork_rng\nRngState.capture()\n"
        "with fork_rng(1):\n    torch.rand(1)\nprint(torch.cuda.is_initialized())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=user_env(), capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.split() == ["False"], proc.stdout + proc.stderr


def test_fork_rng_isolates_every_stream() -> None:
    torchrepro.seed_everything(5)
    gens = make_generators()
    state = RngState.capture(generators=gens)
    expected = draw(gens)
    state.restore(generators=gens)
    with fork_rng(generators=gens):
        draw(gens)
        draw(gens)
    assert draw(gens) == expected


def test_fork_rng_with_seed_matches_seed_everything_and_restores() -> None:
    torchrepro.seed_everything(7)
    outer = [random.random(), float(np.random.rand()), float(torch.rand(1))]
    torchrepro.seed_everything(7)
    with fork_rng(99):
        inside = [random.random(), float(np.random.rand()), float(torch.rand(1))]
    assert [random.random(), float(np.random.rand()), float(torch.rand(1))] == outer
    torchrepro.seed_everything(99)
    assert [random.random(), float(np.random.rand()), float(torch.rand(1))] == inside


def test_fork_rng_restores_after_an_exception() -> None:
    state = RngState.capture()
    expected = torch.rand(3)
    state.restore()
    with pytest.raises(KeyError), fork_rng(1):
        torch.rand(10)
        raise KeyError("boom")
    assert torch.equal(torch.rand(3), expected)


def test_fork_rng_disabled_is_a_no_op() -> None:
    state = RngState.capture()
    with fork_rng(enabled=False):
        a = torch.rand(2)
    state.restore()
    assert torch.equal(torch.rand(2), a)


# --- bad input: every one names what is wrong and the fix ---


def good() -> dict[str, Any]:
    return RngState.capture(generators={"g": torch.Generator(), "n": np.random.default_rng(0)}).to_dict()


def set_key(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        d[key] = value

    return edit


def _del(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda d: d.pop(key)


BAD_DICTS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("missing key", _del("torch"), r"missing keys \['torch'\]"),
    ("unknown key", set_key("model", {}), r"unknown keys \['model'\]"),
    ("newer version", set_key("version", RNG_STATE_VERSION + 1), "upgrade torchrepro"),
    ("bad version", set_key("version", "one"), r"'version': expected 1"),
    ("torch dtype", set_key("torch", torch.zeros(5056)), "1-D torch.uint8 tensor"),
    ("torch size", set_key("torch", torch.zeros(7, dtype=torch.uint8)), "size"),
    ("python type", set_key("python", [3]), "'python'"),
    ("python bad", lambda d: d["python"].update(state=[1, 2]), "'python'"),
    ("numpy bad", lambda d: d["numpy"].update(bit_generator="Nope"), "'numpy'"),
    ("cuda type", set_key("cuda", [torch.zeros(16, dtype=torch.uint8)]), "device index"),
    ("cuda key", set_key("cuda", {"x": torch.zeros(16, dtype=torch.uint8)}), "index strings"),
    ("generator kind", lambda d: d["generators"]["g"].update(kind="jax"), "'kind' one of"),
    ("generator device", lambda d: d["generators"]["g"].update(device="gpu:x"), "bad device"),
    ("numpy generator", lambda d: d["generators"]["n"]["state"].update(bit_generator="X"), "bit generator"),
]


@pytest.mark.parametrize(("edit", "message"), [b[1:] for b in BAD_DICTS], ids=[b[0] for b in BAD_DICTS])
def test_from_dict_rejects_bad_state(edit: Callable[[dict[str, Any]], None], message: str) -> None:
    d = good()
    edit(d)
    with pytest.raises(RngStateError, match=message):
        RngState.from_dict(d)


def test_from_dict_rejects_non_dict() -> None:
    with pytest.raises(RngStateError, match=r"RngState\.to_dict"):
        RngState.from_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a process without CUDA devices")
def test_device_count_mismatch_names_the_devices_fix() -> None:
    d = good()
    d["cuda"] = {"0": torch.zeros(16, dtype=torch.uint8), "1": torch.zeros(16, dtype=torch.uint8)}
    with pytest.raises(RngStateError, match=r"2 CUDA devices into a process with 0; pass devices=\[\]"):
        RngState.from_dict(d)
    state = RngState.from_dict(d, devices=[])
    assert dict(state.cuda) == {}
    with pytest.raises(ValueError, match=r"captured CUDA device indices \[0, 1\]"):
        RngState.from_dict(d, devices=[2])
    with pytest.raises(TypeError, match="list of CUDA device indices"):
        RngState.from_dict(d, devices="0")  # type: ignore[arg-type]


def test_restore_checks_generators_before_changing_anything() -> None:
    state = RngState.capture(generators={"g": torch.Generator(), "n": np.random.default_rng(0)})
    expected = torch.rand(2)
    torch.rand(5)
    with pytest.raises(RngStateError, match=r"No RNG state for generator 'x'.*\['g', 'n'\]"):
        state.restore(generators={"x": torch.Generator()})
    with pytest.raises(RngStateError, match="captured as a torch generator but a numpy"):
        state.restore(generators={"g": np.random.default_rng(0)})
    with pytest.raises(RngStateError, match=r"numpy\.random\.Generator\(numpy\.random\.PCG64\(\)\)"):
        state.restore(generators={"n": np.random.Generator(np.random.MT19937(0))})
    state.restore()
    assert torch.equal(torch.rand(2), expected)


@pytest.mark.parametrize(
    ("generators", "error", "message"),
    [
        ([torch.Generator()], TypeError, "mapping of name -> generator"),
        ({"a": 5}, TypeError, "generator 'a' is a int"),
        ({1: torch.Generator()}, TypeError, "names must be str"),
    ],
)
def test_capture_rejects_bad_generators(generators: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        RngState.capture(generators=generators)  # type: ignore[arg-type]


@pytest.mark.parametrize(("seed", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_fork_rng_rejects_bad_seed(seed: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="seed must be"), fork_rng(seed):  # type: ignore[arg-type]
        pass
