"""Portable mode's start values (``torchrepro.portable``): what is set, what is kept, what is refused.

The runs that show what the mode buys (equal bits at 1 and 2 threads) are in tests/e2e/test_portable.py.
"""

from __future__ import annotations

import pytest

from torchrepro.errors import SettingsError
from torchrepro.launch import _start_settings_missing
from torchrepro.portable import (
    CBWR_DEFAULT,
    CBWR_VAR,
    CPU_CAPABILITIES,
    CPU_CAPABILITY_VAR,
    notes,
    portable_isa,
    start_values,
)

AVX2 = frozenset({"sse2", "avx", "avx2", "fma"})


@pytest.mark.parametrize(
    ("machine", "flags", "isa"),
    [
        ("x86_64", AVX2, "avx2"),
        ("AMD64", AVX2 | {"avx512f"}, "avx2"),  # an AVX-512 CPU runs the AVX2 kernels too
        ("x86_64", frozenset({"sse2", "sse4_2"}), "default"),
        ("aarch64", frozenset({"asimd", "sve"}), None),
        ("arm64", AVX2, None),
    ],
)
def test_the_portable_isa_is_avx2_on_x86_with_avx2(
    machine: str, flags: frozenset[str], isa: str | None
) -> None:
    assert portable_isa(machine, flags) == isa
    assert isa is None or isa in CPU_CAPABILITIES


def test_the_portable_isa_of_this_machine_is_one_torch_accepts() -> None:
    assert portable_isa() in (*CPU_CAPABILITIES, None)


@pytest.mark.parametrize(
    "value",
    [
        "AVX2,STRICT",
        "avx2,strict",
        "BRANCH=AVX2,STRICT",
        "AVX512,STRICT",
        "AVX2",
        "COMPATIBLE",
        "AUTO",
        "AVX512_E1",
    ],
)
def test_a_value_of_mkl_cbwr_onemkl_accepts_is_kept(value: str) -> None:
    assert start_values({CBWR_VAR: value}, isa="avx2")[CBWR_VAR] == value


@pytest.mark.parametrize("value", ["AVX3,STRICT", "STRICT", "AVX2;STRICT", "yes", "AVX2,STRICT,AVX512"])
def test_a_value_of_mkl_cbwr_onemkl_refuses_is_an_error_naming_it(value: str) -> None:
    with pytest.raises(SettingsError, match=f"{CBWR_VAR}={value!r} in the environment is not a value oneMKL"):
        start_values({CBWR_VAR: value})


def test_the_isa_comes_from_the_option_then_the_environment_then_the_machine() -> None:
    assert start_values({}, isa="avx2") == {CBWR_VAR: CBWR_DEFAULT, CPU_CAPABILITY_VAR: "avx2"}
    assert start_values({CPU_CAPABILITY_VAR: "avx512"}, isa="avx2")[CPU_CAPABILITY_VAR] == "avx512"
    picked = start_values({CPU_CAPABILITY_VAR: "avx512"}, cpu_capability="default", isa="avx2")
    assert picked[CPU_CAPABILITY_VAR] == "default"
    # --cpu-capability given: a wrong value in the environment does not matter
    assert start_values({CPU_CAPABILITY_VAR: "avx9"}, cpu_capability="avx2")[CPU_CAPABILITY_VAR] == "avx2"
    with pytest.raises(
        SettingsError, match=f"{CPU_CAPABILITY_VAR}='avx9' in the environment is not a value torch"
    ):
        start_values({CPU_CAPABILITY_VAR: "avx9"})
    assert CPU_CAPABILITY_VAR not in start_values({}, isa="")  # nothing to pin (not x86)


def test_notes_say_what_weakens_the_mode_and_nothing_otherwise() -> None:
    assert notes(start_values({}, isa="avx2")) == []
    (kept,) = notes(start_values({CBWR_VAR: "AVX2"}, isa="avx2"))
    assert kept.startswith(f"--portable kept {CBWR_VAR}=AVX2 from the environment: without STRICT")
    assert notes({CBWR_VAR: "AVX512,STRICT", CPU_CAPABILITY_VAR: "avx512"}) == []
    (unset,) = notes({CBWR_VAR: CBWR_DEFAULT})
    assert f"left {CPU_CAPABILITY_VAR} unset" in unset
    (default,) = notes({CBWR_VAR: CBWR_DEFAULT, CPU_CAPABILITY_VAR: "default"})
    assert "this CPU has no AVX2" in default


def test_relaunch_asks_for_what_portable_mode_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.delenv(CBWR_VAR, raising=False)
    monkeypatch.delenv(CPU_CAPABILITY_VAR, raising=False)
    assert _start_settings_missing(0, None) == {}  # control: without portable nothing is missing
    assert _start_settings_missing(0, None, portable=True) == start_values({})
    for key, value in start_values({}).items():
        monkeypatch.setenv(key, value)
    assert _start_settings_missing(0, None, portable=True) == {}
