"""How two records were started differently, and how their environments differ.

Invariants: a difference in ``settings.json`` or on the command line is named as a setting
(``SettingDifference``), with what it means where the bare values would mislead (a thread count
is a setting, not nondeterminism); an environment difference says whether it exists between any
two records (volatile: when and where each was recorded) and which setting set it. An
environment that is missing, failed to collect or is malformed never hides the verdict.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from torchrepro.errors import EnvFileError, ReproError
from torchrepro.protocol import HASH_SEED_VAR, OMP_THREADS_VAR
from torchrepro.results import (
    SettingDifference,
)
from torchrepro.runrecord import (
    COMMAND_FILE,
    ENV_FILE,
    RunRecord,
    read_json,
    read_node_envs,
    read_nodes,
    read_uncovered,
)

__all__ = [
    "env_difference_dict",
    "environment_differences",
    "explaining_setting",
    "is_volatile",
    "node_notes",
    "setting_differences",
    "unrecorded_notes",
    "varied_threads",
]


_THREADS_DETAIL = (
    "a settings difference, not nondeterminism: CPU reductions split across another number of "
    "threads can round differently; give both runs the same --threads"
)


_PORTABLE_DETAIL = (
    "a settings difference, not nondeterminism: portable mode (oneMKL's strict reproducibility, "
    "a fixed CPU instruction set, oneDNN off) runs other CPU kernels; give both runs the same --portable"
)


# settings.json fields that change what a run computes (not the run's index or what was traced)
_COMPARED_SETTINGS = (
    "seed",
    "mode",
    "threads",
    "nproc",
    "script",
    "module",
    "cpu_capability",
    "steps",
    "vary",
    HASH_SEED_VAR,
    OMP_THREADS_VAR,
    "portable",
    "MKL_CBWR",
    "ATEN_CPU_CAPABILITY",
)


def setting_differences(a: RunRecord, b: RunRecord) -> tuple[SettingDifference, ...]:
    """The settings and command-line arguments two records were started with differently."""
    found = []
    if a.settings is not None and b.settings is not None:
        for name in _COMPARED_SETTINGS:
            va, vb = getattr(a.settings, name), getattr(b.settings, name)
            if va != vb and not (name == "portable" and not va and not vb):  # False: an older record's None
                found.append(SettingDifference(name, va, vb))
        if found and found[0].name == "seed":  # the hash seed is derived from the seed: one cause
            found = [d for d in found if d.name != HASH_SEED_VAR]
        if any(d.name == "threads" for d in found):  # --threads sets OMP_NUM_THREADS: one cause
            found = [
                replace(d, detail=_threads_detail(a, b)) if d.name == "threads" else d
                for d in found
                if d.name != OMP_THREADS_VAR
            ]
        names = {d.name for d in found}
        if "portable" in names:  # --portable sets MKL_CBWR and the CPU ISA: one cause
            found = [
                replace(d, detail=_PORTABLE_DETAIL) if d.name == "portable" else d
                for d in found
                if d.name not in ("MKL_CBWR", "ATEN_CPU_CAPABILITY")
            ]
        elif "cpu_capability" in names:  # --cpu-capability sets ATEN_CPU_CAPABILITY
            found = [d for d in found if d.name != "ATEN_CPU_CAPABILITY"]
    argv_a, argv_b = _script_args(a), _script_args(b)
    if argv_a is not None and argv_b is not None and argv_a != argv_b:
        found.append(SettingDifference("arguments", " ".join(argv_a), " ".join(argv_b)))
    return tuple(found)


def _threads_detail(a: RunRecord, b: RunRecord) -> str:
    """What a ``--threads`` difference means; when both environments show the count in use."""
    used = [None if run.env is None else run.env.get("num_threads") for run in (a, b)]
    if used[0] is not None and used[0] == used[1] and isinstance(used[0], int):
        return f"{_THREADS_DETAIL}; both runs used {used[0]} threads, so here it changed nothing"
    return _THREADS_DETAIL


def varied_threads(started: Sequence[SettingDifference]) -> str | None:
    """A thread-count difference in the words ``locate_in_traces`` takes (else None)."""
    for d in started:
        if d.name == "threads":
            a, b = (
                f"{v} thread{'s' if v != 1 else ''}" if v is not None else "unpinned threads"
                for v in (d.a, d.b)
            )
            return f"between {a} (run A) and {b} (run B)"
    return None


def _explained_env_keys(setting: str) -> tuple[str, ...]:
    """The environment keys (``env_diff`` keys, or their prefixes) a setting difference sets."""
    from torchrepro.portable import CBWR_VAR
    from torchrepro.protocol import CPU_CAPABILITY_VAR, variable

    threads = (
        "num_threads",
        "omp_max_threads",
        "mkl_max_threads",
        "env_vars.OMP_NUM_THREADS",
        "env_vars.MKL_NUM_THREADS",
        f"env_vars.{variable('threads')}",
    )
    hash_seed = ("env_vars.PYTHONHASHSEED",)
    isa = (f"env_vars.{variable('cpu_capability')}", f"env_vars.{CPU_CAPABILITY_VAR}", "cpu_capability")
    cbwr = (f"env_vars.{CBWR_VAR}",)
    table: dict[str, tuple[str, ...]] = {
        "seed": (f"env_vars.{variable('seed')}", *hash_seed),
        "mode": (f"env_vars.{variable('mode')}", "determinism"),
        "threads": threads,
        OMP_THREADS_VAR: threads,
        "cpu_capability": isa,
        "ATEN_CPU_CAPABILITY": isa,
        "MKL_CBWR": cbwr,
        "portable": (
            f"env_vars.{variable('portable')}",
            *cbwr,
            *isa,
            "determinism.mkldnn_enabled",
        ),
        HASH_SEED_VAR: hash_seed,
        "steps": (f"env_vars.{variable('max_steps')}",),
        "vary": (f"env_vars.{variable('num_workers')}", *hash_seed, *threads),
    }
    return table.get(setting, ())


def explaining_setting(key: str, started: Sequence[SettingDifference]) -> str | None:
    """The setting difference (``threads``...) that set the environment difference ``key``, if any."""
    for d in started:
        if any(key == k or key.startswith((k + ".", k + "[")) for k in _explained_env_keys(d.name)):
            return d.name
    return None


def is_volatile(key: str) -> bool:
    """Whether an environment difference exists between any two records: when each was collected,
    where each run wrote its record. Never a cause; ``compare`` leaves them out of its report."""
    from torchrepro.protocol import LOCATION_VARIABLES

    return key == "collected_at" or key in {f"env_vars.{v}" for v in LOCATION_VARIABLES}


def _script_args(run: RunRecord) -> list[str] | None:
    """The arguments after the script (or module) in a record's ``command.json``, if readable."""
    try:
        command = read_json(os.path.join(run.path, COMMAND_FILE))
    except ReproError:
        return None
    argv = command.get("argv") if isinstance(command, dict) else None
    if not isinstance(argv, list) or not all(isinstance(x, str) for x in argv):
        return None
    target = run.settings.script or run.settings.module if run.settings is not None else None
    for i, arg in enumerate(argv):
        if target is not None and (arg == target or os.path.basename(arg) == os.path.basename(target)):
            return argv[i + 1 :]
    return argv


def env_difference_dict(d: Any, started: Sequence[SettingDifference] = ()) -> dict[str, Any]:
    to_dict = getattr(d, "to_dict", None)
    result = to_dict() if callable(to_dict) else None
    if not isinstance(result, dict):
        result = {k: getattr(d, k, None) for k in ("key", "a", "b", "breaks", "reason")}
    key = str(result.get("key"))
    return {**result, "volatile": is_volatile(key), "setting": explaining_setting(key, started)}


def unrecorded_notes(a: RunRecord, b: RunRecord) -> list[str]:
    """The notes of python processes that trained without a record in either run, each once."""
    la, lb = read_uncovered(a.path), read_uncovered(b.path)
    notes = [f"in both runs: {line}" for line in la if line in lb]
    notes += [f"in run A: {line}" for line in la if line not in lb]
    notes += [f"in run B: {line}" for line in lb if line not in la]
    return notes


def environment_differences(a: RunRecord, b: RunRecord) -> tuple[list[Any], list[str]]:
    """The environment differences of two records, or none and a note saying why not.

    An environment that is missing, failed to collect or is malformed never hides the verdict.
    """
    if a.env is None or b.env is None:
        return [], []  # no environment recorded (an older or hand-made record)
    from torchrepro.env import Environment, diff_env  # imports torch: only when there is work

    envs = []
    for run in (a, b):
        where = os.path.join(run.path, ENV_FILE)
        assert run.env is not None
        if "error" in run.env:
            return [], [f"environments not compared: {where} says collecting it failed"]
        try:
            envs.append(Environment.from_dict(run.env))
        except EnvFileError as exc:
            return [], [f"environments not compared: {where} is malformed: {exc}"]
    return list(diff_env(envs[0], envs[1])), []


_NODE_DIFFERENCES_SHOWN = 4


def _breaking(a: dict[str, Any], b: dict[str, Any]) -> list[Any] | None:
    """The differences of two node environments that can change bits (None: one is unreadable)."""
    from torchrepro.env import Environment, diff_env  # imports torch: only when there is work
    from torchrepro.protocol import PARENT_RANK_VAR

    try:
        ea, eb = Environment.from_dict(a), Environment.from_dict(b)
    except EnvFileError:
        return None
    rank_mark = f"env_vars.{PARENT_RANK_VAR}"  # differs from rank to rank by design
    return [d for d in diff_env(ea, eb) if d.breaks and not is_volatile(d.key) and d.key != rank_mark]


def _listed(differences: list[Any]) -> str:
    shown = "; ".join(f"{d.key} {d.a!r} vs {d.b!r}" for d in differences[:_NODE_DIFFERENCES_SHOWN])
    more = len(differences) - _NODE_DIFFERENCES_SHOWN
    return shown + (f" (and {more} more)" if more > 0 else "")


def node_notes(a: RunRecord, b: RunRecord, rank: int | None = None) -> list[str]:
    """What two multi-node records say of their nodes: the node (and host) ``rank`` ran on in each,
    every node whose environment differs, in what can change bits, from the node of global rank 0
    of its run, and every node whose environment differs between the runs (the node of rank 0 is
    compared through ``env.json``). Nothing for records of one node."""
    notes: list[str] = []
    nodes = {run.path: read_nodes(run.path) for run in (a, b)}
    envs = {run.path: read_node_envs(run.path) for run in (a, b)}
    if rank is not None:
        where = {path: found[rank] for path, found in nodes.items() if rank in found}
        if where:
            places = set(where.values())
            if len(places) == 1:
                node, host = next(iter(places))
                notes.append(f"rank {rank} ran on node {node} (host {host})")
            else:
                notes.append(
                    f"rank {rank} ran on "
                    + " and ".join(f"node {n} (host {h}) in {p}" for p, (n, h) in where.items())
                )
    for run in (a, b):
        found = envs[run.path]
        ref = nodes[run.path].get(0, (min(found, default=0), ""))[0]
        if len(found) < 2 or ref not in found:
            continue
        for node, env in found.items():
            diffs = None if node == ref else _breaking(found[ref], env)
            if diffs:
                host = env.get("hostname") or "?"
                notes.append(
                    f"in {run.path}, node {node} (host {host}) runs in another environment than node {ref} "
                    f"of rank 0: {_listed(diffs)}"
                )
    ea, eb = envs[a.path], envs[b.path]
    refs = {nodes[r.path].get(0, (None, ""))[0] for r in (a, b)}
    for node in sorted(set(ea) & set(eb)):
        if node in refs:
            continue
        diffs = _breaking(ea[node], eb[node])
        if diffs:
            notes.append(f"node {node} runs in another environment in the two runs: {_listed(diffs)}")
    return notes
