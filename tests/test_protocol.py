"""ChildSpec, the child protocol: validation, to_env()/from_env() round trips, process-start variables."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrepro.errors import SettingsError
from torchrepro.flags import CUBLAS_CONFIGS, CUBLAS_VAR, MODES
from torchrepro.portable import CBWR_DEFAULT, CBWR_VAR, portable_isa
from torchrepro.protocol import (
    COMPILE_CHOICES,
    COMPILE_OFF_VARS,
    CPU_CAPABILITIES,
    CPU_CAPABILITY_VAR,
    ENV_PREFIX,
    ChildSpec,
    python_hash_seed,
)

PROCESS_START = ("PYTHONHASHSEED", CUBLAS_VAR, "OMP_NUM_THREADS", "MKL_NUM_THREADS", CPU_CAPABILITY_VAR)

paths = st.text(st.characters(blacklist_characters="\x00"), min_size=1, max_size=20)
counts = st.none() | st.integers(1, 2**40)


@st.composite
def specs(draw: st.DrawFn) -> ChildSpec:
    """Every valid spec whose fields all travel through the environment.

    Left out on purpose (each has its own test): ``hash_seed`` travels as ``PYTHONHASHSEED`` only,
    ``trace_optimizer`` only goes with ``trace_step``.
    """
    seed = draw(st.none() | st.integers(0, 2**64 - 1))
    trace_step = draw(st.none() | st.integers(0, 2**40))
    capture_op = None if trace_step is None else draw(st.none() | st.integers(0, 2**40))
    return ChildSpec(
        seed=seed,
        mode=draw(st.none() | st.sampled_from(MODES)),
        threads=draw(counts),
        record_dir=draw(st.none() | paths),
        record_values=draw(st.none() | st.integers(0, 2**40)),
        max_steps=draw(counts),
        trace_step=trace_step,
        trace_out=None if trace_step is None else draw(paths),
        trace_optimizer=0 if trace_step is None else draw(st.integers(0, 100)),
        capture_op=capture_op,
        capture_out=None if capture_op is None else draw(paths),
        ops_out=draw(st.none() | paths),
        audit_settings_out=draw(st.none() | paths),
        num_workers=draw(st.none() | st.just("other") | st.integers(0, 64).map(str)),
        cpu_capability=draw(st.none() | st.sampled_from(CPU_CAPABILITIES)),
        portable=draw(st.booleans()),
        kill_at=draw(counts),
        resume_states=draw(st.booleans()),
        compile=draw(st.none() | st.sampled_from(COMPILE_CHOICES)),
        compile_cache=draw(st.none() | paths),
        compile_probe=False if trace_step is None else draw(st.booleans()),
        nnodes=draw(counts),
        relayed=draw(st.booleans()),
        whole_shards=draw(st.booleans()),
    )


@settings(max_examples=200, deadline=None)
@given(specs())
def test_to_env_from_env_round_trips_every_field(spec: ChildSpec) -> None:
    env = spec.to_env({})
    assert ChildSpec.from_env(env) == spec
    assert all(isinstance(v, str) for v in env.values())


def test_the_round_trip_strategy_covers_every_field() -> None:
    # a new ChildSpec field must be added to `specs()` (or to the fields with their own tests)
    own_tests = {"hash_seed"}
    assert {f.name for f in dataclasses.fields(ChildSpec)} - own_tests == {
        "seed",
        "mode",
        "threads",
        "record_dir",
        "record_values",
        "max_steps",
        "trace_step",
        "trace_out",
        "trace_optimizer",
        "capture_op",
        "capture_out",
        "ops_out",
        "audit_settings_out",
        "num_workers",
        "cpu_capability",
        "portable",
        "kill_at",
        "resume_states",
        "compile",
        "compile_cache",
        "compile_probe",
        "nnodes",
        "relayed",
        "whole_shards",
    }


def test_round_trip_detects_a_lost_field() -> None:
    # the check above can fail: a variable missing from the environment is a different spec
    env = ChildSpec(seed=3, threads=2).to_env({})
    del env[ENV_PREFIX + "THREADS"]
    assert ChildSpec.from_env(env) != ChildSpec(seed=3, threads=2)


def test_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    assert ChildSpec.from_env() == ChildSpec()
    monkeypatch.setenv(ENV_PREFIX + "SEED", "5")
    monkeypatch.setenv(ENV_PREFIX + "MAX_STEPS", "3")
    assert ChildSpec.from_env() == ChildSpec(seed=5, max_steps=3)


def test_empty_variables_read_as_unset() -> None:
    assert ChildSpec.from_env({ENV_PREFIX + "SEED": "", ENV_PREFIX + "RECORD_DIR": ""}) == ChildSpec()


def test_base_environment_protocol_variables_are_dropped() -> None:
    base = {
        "PATH": "/bin",
        ENV_PREFIX + "SEED": "9",
        ENV_PREFIX + "MAX_STEPS": "1",
        ENV_PREFIX + "SOMETHING_NEW": "x",
    }
    env = ChildSpec(seed=3).to_env(base)
    assert env[ENV_PREFIX + "SEED"] == "3"
    assert ENV_PREFIX + "MAX_STEPS" not in env
    assert ENV_PREFIX + "SOMETHING_NEW" not in env
    assert env["PATH"] == "/bin"
    assert base[ENV_PREFIX + "SEED"] == "9"  # the caller's mapping is not modified
    assert ChildSpec().to_env(base) == {"PATH": "/bin"}


def test_to_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_PREFIX + "TEST_MARKER", "1")  # a protocol-looking name: dropped
    monkeypatch.setenv("SPEC_TEST_MARKER", "kept")
    env = ChildSpec().to_env()
    assert env["SPEC_TEST_MARKER"] == "kept"
    assert ENV_PREFIX + "TEST_MARKER" not in env


def test_unseeded_spec_is_plain_python() -> None:
    base = {"PYTHONHASHSEED": "5", CUBLAS_VAR: ":16:8"}
    spec = ChildSpec(max_steps=2)
    assert not spec.seeded
    env = spec.to_env(base)
    # the base's own process-start settings are kept as python would; nothing is pinned or switched
    assert env == {**base, ENV_PREFIX + "MAX_STEPS": "2"}
    assert ChildSpec().to_env({}) == {}
    assert ChildSpec.from_env(env).mode is None
    # switches without seeding are a spec of their own: the mode travels, nothing is pinned
    switched = ChildSpec(mode="warn")
    assert switched.to_env(base) == {**base, ENV_PREFIX + "MODE": "warn"}
    assert ChildSpec.from_env(switched.to_env(base)) == switched


def test_seeded_spec_pins_hash_seed_cublas_and_mode() -> None:
    spec = ChildSpec(seed=3)
    assert spec.seeded and spec.mode == "strict"  # a seeded spec defaults to strict
    env = spec.to_env({"PYTHONHASHSEED": "5", CUBLAS_VAR: ":16:8"})
    assert env["PYTHONHASHSEED"] == str(python_hash_seed(3))
    assert env[CUBLAS_VAR] == CUBLAS_CONFIGS[0]
    assert (env[ENV_PREFIX + "SEED"], env[ENV_PREFIX + "MODE"]) == ("3", "strict")
    assert ChildSpec(seed=4).to_env({})["PYTHONHASHSEED"] != env["PYTHONHASHSEED"]


@pytest.mark.parametrize("seed", [None, 3])
def test_hash_seed_overrides_the_derived_one(seed: int | None) -> None:
    env = ChildSpec(seed=seed, hash_seed=7).to_env({"PYTHONHASHSEED": "5"})
    assert env["PYTHONHASHSEED"] == "7"
    assert (CUBLAS_VAR in env) == (seed is not None)
    # it travels as PYTHONHASHSEED only: the child does not need it back
    assert not any("HASH" in k for k in env if k.startswith(ENV_PREFIX))
    assert ChildSpec.from_env(env).hash_seed is None


def test_threads_set_omp_and_mkl() -> None:
    env = ChildSpec(threads=3).to_env({"OMP_NUM_THREADS": "8"})
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == env[ENV_PREFIX + "THREADS"] == "3"
    assert ChildSpec().to_env({"OMP_NUM_THREADS": "8"}) == {"OMP_NUM_THREADS": "8"}


@pytest.mark.parametrize("capability", CPU_CAPABILITIES)
def test_cpu_capability_sets_aten_cpu_capability(capability: str) -> None:
    env = ChildSpec(cpu_capability=capability).to_env({})
    assert env[CPU_CAPABILITY_VAR] == capability
    assert CPU_CAPABILITY_VAR not in ChildSpec().to_env({})


def test_portable_sets_its_start_values_and_keeps_valid_ones_of_the_user() -> None:
    env = ChildSpec(portable=True).to_env({"PATH": "/bin"})
    assert env[ENV_PREFIX + "PORTABLE"] == "1" and env[CBWR_VAR] == CBWR_DEFAULT
    assert env.get(CPU_CAPABILITY_VAR) == portable_isa()
    kept = ChildSpec(portable=True).to_env({CBWR_VAR: "AVX512,STRICT", CPU_CAPABILITY_VAR: "avx512"})
    assert (kept[CBWR_VAR], kept[CPU_CAPABILITY_VAR]) == ("AVX512,STRICT", "avx512")
    chosen = ChildSpec(portable=True, cpu_capability="default").to_env({CPU_CAPABILITY_VAR: "avx512"})
    assert chosen[CPU_CAPABILITY_VAR] == "default"  # --cpu-capability wins over the environment
    # control: without portable nothing of it is set, and a user's value passes through untouched
    assert not {CBWR_VAR, ENV_PREFIX + "PORTABLE"} & set(ChildSpec(seed=0).to_env({}))
    assert ChildSpec().to_env({CBWR_VAR: "nonsense"}) == {CBWR_VAR: "nonsense"}


@pytest.mark.parametrize(
    ("base", "named"),
    [({CBWR_VAR: "AVX3,STRICT"}, CBWR_VAR), ({CPU_CAPABILITY_VAR: "avx9"}, CPU_CAPABILITY_VAR)],
)
def test_portable_refuses_a_value_of_the_user_it_cannot_use(base: dict[str, str], named: str) -> None:
    with pytest.raises(SettingsError, match=f"--portable: {named}="):
        ChildSpec(portable=True).to_env(base)


def test_trace_optimizer_only_travels_with_a_trace_step() -> None:
    env = ChildSpec(trace_optimizer=2).to_env({})
    assert env == {}
    env = ChildSpec(trace_step=4, trace_out="/t", trace_optimizer=2).to_env({})
    assert env[ENV_PREFIX + "TRACE_OPTIMIZER"] == "2"
    assert (env[ENV_PREFIX + "TRACE_STEP"], env[ENV_PREFIX + "TRACE_OUT"]) == ("4", "/t")


def test_path_fields_accept_path_objects() -> None:
    spec = ChildSpec(record_dir=Path("/r"), trace_step=0, trace_out=Path("/t"))  # type: ignore[arg-type]
    assert (spec.record_dir, spec.trace_out) == ("/r", "/t")
    assert spec.to_env({})[ENV_PREFIX + "RECORD_DIR"] == "/r"


def test_every_process_start_variable_only_when_asked() -> None:
    assert not set(PROCESS_START) & set(ChildSpec(max_steps=1, record_dir="/r").to_env({}))
    full = ChildSpec(seed=0, threads=1, cpu_capability="default").to_env({})
    assert set(PROCESS_START) <= set(full)


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 0, "mode": "loose"}, "mode"),
        ({"mode": "loose"}, "mode"),
        ({"threads": 0}, "threads"),
        ({"threads": True}, "threads"),
        ({"threads": 1.5}, "threads"),
        ({"record_values": -1}, "record_values"),
        ({"max_steps": 0}, "max_steps"),
        ({"trace_step": -1, "trace_out": "/t"}, "trace_step"),
        ({"trace_step": 2}, "trace_step and trace_out"),
        ({"trace_out": "/t"}, "trace_step and trace_out"),
        ({"trace_optimizer": -2}, "trace_optimizer"),
        ({"trace_step": 0, "trace_out": "/t", "capture_op": -1, "capture_out": "/c"}, "capture_op"),
        ({"trace_step": 0, "trace_out": "/t", "capture_op": 3}, "capture_op and capture_out"),
        ({"capture_op": 3, "capture_out": "/c"}, "capture_op captures an op of the traced step"),
        ({"num_workers": "x"}, "num_workers"),
        ({"num_workers": "-1"}, "num_workers"),
        ({"num_workers": ""}, "num_workers"),
        ({"cpu_capability": "sse9"}, "cpu_capability"),
        ({"hash_seed": 2**32}, "hash_seed"),
        ({"hash_seed": -1}, "hash_seed"),
        ({"hash_seed": True}, "hash_seed"),
        ({"portable": "yes"}, "portable"),
        ({"portable": 1}, "portable"),
    ],
)
def test_invalid_values_are_refused_naming_the_field(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ChildSpec(**bad)


@pytest.mark.parametrize(
    "good",
    [
        {"seed": 0},
        {"seed": 2**64 - 1},
        {"threads": 1},
        {"record_values": 0},
        {"max_steps": 1},
        {"trace_step": 0, "trace_out": "/t"},
        {"num_workers": "0"},
        {"num_workers": "other"},
        {"hash_seed": 0},
        {"hash_seed": 2**32 - 1},
    ],
)
def test_boundary_values_are_accepted(good: dict[str, Any]) -> None:
    spec = ChildSpec(**good)
    assert ChildSpec.from_env(spec.to_env({})) == dataclasses.replace(spec, hash_seed=None)


def test_a_seed_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(TypeError, match="seed"):
        ChildSpec(seed="3")  # type: ignore[arg-type]


def test_num_workers_is_refused_unless_int_can_read_it() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        ChildSpec(num_workers="²")


_INT_VARIABLES = ["SEED", "THREADS", "RECORD_VALUES", "MAX_STEPS", "TRACE_STEP", "TRACE_OPTIMIZER"]


@pytest.mark.parametrize("var", _INT_VARIABLES)
@pytest.mark.parametrize("text", ["x", "1.5", "3a"])
def test_from_env_malformed_integer_names_the_variable(var: str, text: str) -> None:
    env = {ENV_PREFIX + var: text, ENV_PREFIX + "TRACE_OUT": "/t"}
    with pytest.raises(ValueError, match=f"{ENV_PREFIX + var} must be an integer, got {text!r}"):
        ChildSpec.from_env(env)


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"SEED": "-1"}, "seed"),
        ({"SEED": "0", "MODE": "loose"}, "mode"),
        ({"THREADS": "0"}, "threads"),
        ({"MAX_STEPS": "0"}, "max_steps"),
        ({"TRACE_STEP": "2"}, "trace_step and trace_out"),
        ({"NUM_WORKERS": "x"}, "num_workers"),
        ({"CPU_CAPABILITY": "sse9"}, "cpu_capability"),
    ],
)
def test_from_env_invalid_value_is_a_value_error_naming_the_field(env: dict[str, str], field: str) -> None:
    with pytest.raises(ValueError, match=f"malformed {ENV_PREFIX}.*{field}"):
        ChildSpec.from_env({ENV_PREFIX + k: v for k, v in env.items()})


@pytest.mark.parametrize("text", ["yes", "true", "2", " 1"])
def test_from_env_malformed_flag_names_the_variable(text: str) -> None:
    with pytest.raises(ValueError, match=f"{ENV_PREFIX}PORTABLE must be 0 or 1, got {text!r}"):
        ChildSpec.from_env({ENV_PREFIX + "PORTABLE": text})


def test_replace_validates_again_and_leaves_the_original() -> None:
    spec = ChildSpec(seed=1, threads=2)
    assert spec.replace(threads=4) == ChildSpec(seed=1, threads=4)
    assert spec.threads == 2
    with pytest.raises(ValueError, match="threads"):
        spec.replace(threads=0)
    with pytest.raises(ValueError, match="trace_step and trace_out"):
        spec.replace(trace_step=3)
    with pytest.raises(ValueError, match="hash_seed"):
        spec.replace(hash_seed=2**32)
    assert spec.replace(trace_step=3, trace_out="/t").trace_step == 3
    assert spec.replace(record_dir=Path("/r")).record_dir == "/r"  # normalised again


def test_spec_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ChildSpec().seed = 1  # type: ignore[misc]


@settings(deadline=None)
@given(st.integers(0, 2**64 - 1), st.lists(st.integers(0, 100) | st.text(max_size=4), max_size=3))
def test_python_hash_seed_is_pure_and_in_range(seed: int, keys: list[int | str]) -> None:
    h = python_hash_seed(seed, *keys)
    assert h == python_hash_seed(seed, *keys)
    assert 0 <= h < 2**32


def test_compile_eager_turns_compile_off_and_compiled_clears_the_users_switches() -> None:
    user = {"PATH": "/bin", "TORCHDYNAMO_DISABLE": "1", "TORCH_COMPILE_DISABLE": "1"}
    eager = ChildSpec(compile="eager").to_env(user)
    assert eager["TORCH_COMPILE_DISABLE"] == "1" and "TORCHDYNAMO_DISABLE" not in eager
    compiled = ChildSpec(compile="compiled", compile_cache="/c").to_env(user)
    assert not set(COMPILE_OFF_VARS) & set(compiled)
    assert compiled["TORCHINDUCTOR_CACHE_DIR"] == "/c" and compiled["TRITON_CACHE_DIR"] == "/c/triton"
    # the control: without the field the user's switches pass through untouched
    assert ChildSpec().to_env(user)["TORCHDYNAMO_DISABLE"] == "1"


@pytest.mark.parametrize(
    ("bad", "says"),
    [({"compile": "inductor"}, "compile must be one of"), ({"compile_probe": True}, "give trace_step")],
)
def test_compile_fields_are_validated(bad: dict[str, Any], says: str) -> None:
    with pytest.raises(SettingsError, match=says):
        ChildSpec(**bad)
