"""Audit a training script for what would break bitwise determinism, on CUDA included, from a CPU run.

Invariants:

- ``audit_script`` runs the script the way its user would run it with plain ``python``: through
  the bootstrap with ``TORCHREPRO_MODE`` unset (no seeding, no switches), with the op recorder
  on, stopped after ``steps`` optimizer steps. So the settings it reports are the ones the script
  itself sets (or inherits from the shell), not torchrepro's.
- Op findings come from the op table ``_audit_ops.json``: data, keyed by torch release, whose
  entries name the items of ``torch.use_deterministic_algorithms.__doc__`` they cover and the aten
  ops that implement them. A test keeps it equal to the installed torch's documentation, and an
  audit says so (TR002) when the installed torch documents items the table lacks.
- Conditions of the table (``bincount`` with weights, ``cumsum`` on floats...) are decided from
  the arguments of the Python-level call at the op's line, which the child's probe records; one
  it cannot decide never yields an error: the finding is a warning that says what is unknown.
- In the child, the probe wraps ``DataLoader.__init__``, ``torch.compile``,
  ``torch.set_num_threads`` and the few functions whose arguments decide a condition; every
  wrapper records and calls through unchanged. One exception: ``use_deterministic_algorithms``
  is recorded as asked but applied with ``warn_only=True``, so an op that raises under strict
  mode (``put_``, ``max_unpool`` raise on the CPU too) is reported instead of ending the audit.
  The parent process changes no global state.
- Findings for a backward op carry the module and source line of the forward call that created
  it (the recorder's location), never ``loss.backward()``.
- The library never prints; ``audit_ops`` and ``audit_settings`` are pure functions of their input.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from torchrepro._io import atomic_write_json
from torchrepro.errors import LaunchError, TraceError

__all__ = ["AuditReport", "Finding", "audit_ops", "audit_script", "audit_settings"]

SEVERITIES = ("error", "warning", "info")
_SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}
_TABLE_FILE = Path(__file__).with_name("_audit_ops.json")
_SETTINGS_ENV = "TORCHREPRO_AUDIT_SETTINGS_OUT"
_CUBLAS_OK = (":4096:8", ":16:8")
_STRICT = "torchrepro run, or torch.use_deterministic_algorithms(True)"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing that breaks (or may break) bitwise reproducibility, with where and how to fix it.

    ``code`` is stable (``TR1xx`` ops, ``TR2xx`` settings, ``TR3xx`` data loading, ``TR4xx``
    compilation, ``TR0xx`` about the audit itself); ``severity`` is ``error`` (raises under strict
    mode on CUDA, or stays nondeterministic whatever the switches), ``warning`` or ``info``; ``op``
    the aten op (or None); ``module`` and ``location`` (``file:line``) the user's code.

    >>> Finding("TR107", "error", "aten.reflection_pad2d_backward", "net.pad", "train.py:12",
    ...         "ReflectionPad2d backward ...", "Use replication padding").to_dict()["location"]
    'train.py:12'
    """

    code: str
    severity: str
    op: str | None
    module: str | None
    location: str | None
    message: str
    fix: str

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"Finding severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        """The finding as a JSON-able dict with the keys of ``audit --json``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Finding:
        """Inverse of :meth:`to_dict`."""
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """The result of :func:`audit_script`: the findings, most severe first, and what was seen."""

    findings: tuple[Finding, ...]
    script: str
    steps: int
    optimizer_steps: int | None
    ops_recorded: int
    torch_version: str
    table_release: str
    settings: Mapping[str, Any]

    @property
    def errors(self) -> tuple[Finding, ...]:
        """The findings of severity ``error``."""
        return tuple(f for f in self.findings if f.severity == "error")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: ``{"findings": [...], "script", "steps", ...}``."""
        return {
            "findings": [f.to_dict() for f in self.findings],
            "script": self.script,
            "steps": self.steps,
            "optimizer_steps": self.optimizer_steps,
            "ops_recorded": self.ops_recorded,
            "torch_version": self.torch_version,
            "table_release": self.table_release,
            "settings": dict(self.settings),
        }


# --------------------------------------------------------------------------------------------
# The op table


@dataclasses.dataclass(frozen=True)
class _OpSpec:
    name: str  # "aten.cumsum"
    overload: str | None  # "dim" or None for any overload
    phase: str  # forward | backward | any


@dataclasses.dataclass(frozen=True)
class _Entry:
    code: str
    title: str
    section: str  # raises | deterministic | extra
    doc: tuple[str, ...]
    ops: tuple[_OpSpec, ...]
    condition: Mapping[str, Any] | None
    fix: str
    why: str | None


@dataclasses.dataclass(frozen=True)
class _OpTable:
    release: str
    exact: bool
    entries: tuple[_Entry, ...]
    cublas_ops: frozenset[str]


def _release_of(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"cannot read a torch release from version {version!r}")
    return int(m.group(1)), int(m.group(2))


@functools.lru_cache(maxsize=4)
def _load_table(torch_version: str | None = None) -> _OpTable:
    """The op table for ``torch_version`` (default: installed): that release's, else the newest older one."""
    version = torch_version or torch.__version__
    data = json.loads(_TABLE_FILE.read_text(encoding="utf-8"))
    releases = sorted(data["releases"], key=_release_of)
    want = _release_of(version)
    older = [r for r in releases if _release_of(r) <= want]
    release = older[-1] if older else releases[0]
    raw = data["releases"][release]
    entries = []
    for e in raw["entries"]:
        ops = []
        for o in e["ops"]:
            parts = o["op"].split(".")
            ops.append(_OpSpec(".".join(parts[:2]), parts[2] if len(parts) > 2 else None, o["phase"]))
        entries.append(
            _Entry(
                code=e["code"],
                title=e["title"],
                section=e["section"],
                doc=tuple(e["doc"]),
                ops=tuple(ops),
                condition=e.get("condition"),
                fix=e["fix"],
                why=e.get("why"),
            )
        )
    return _OpTable(release, _release_of(release) == want, tuple(entries), frozenset(raw["cublas_ops"]))


_DOC_HEAD = re.compile(
    r"The following normally-nondeterministic operations will\s+"
    r"(act\s+deterministically|throw\s+a\s+:class:`RuntimeError`)\s+when\s+``mode=True``:[ \t]*\n"
)


def _documented_items(doc: str | None = None) -> dict[str, str]:
    """Items of ``torch.use_deterministic_algorithms.__doc__``: text -> ``raises`` or ``deterministic``.

    An item is a ``*`` bullet with its indented continuation lines (sub-bullets included), its
    whitespace collapsed to single spaces.
    """
    text = (torch.use_deterministic_algorithms.__doc__ or "") if doc is None else doc
    items: dict[str, str] = {}
    for m in _DOC_HEAD.finditer(text):
        section = "deterministic" if m.group(1).startswith("act") else "raises"
        current: list[str] | None = None
        indent = 0
        found: list[list[str]] = []
        for line in text[m.end() :].splitlines():
            stripped = line.strip()
            width = len(line) - len(line.lstrip())
            if stripped.startswith("* "):
                current, indent = [stripped[2:]], width
                found.append(current)
            elif not stripped:
                continue
            elif current is not None and width > indent:
                current.append(stripped)
            else:
                break
        for parts in found:
            items[" ".join(" ".join(parts).split())] = section
    return items


# --------------------------------------------------------------------------------------------
# Recorded events


@dataclasses.dataclass(frozen=True)
class _Event:
    name: str  # "aten.cumsum"
    overload: str | None
    module: str | None
    location: str | None
    backward: bool
    count: int
    args: Sequence[Any] | None


def _field(event: Any, name: str, default: Any = None) -> Any:
    if isinstance(event, Mapping):
        return event.get(name, default)
    return getattr(event, name, default)


def _as_event(event: Any) -> _Event:
    if isinstance(event, _Event):
        return event
    op = _field(event, "op")
    if not isinstance(op, str) or not op:
        raise TraceError(f"An op event needs an 'op' name like 'aten.cumsum.default'; got {op!r}.")
    parts = str(op).split(".")
    if len(parts) >= 3:
        name, overload = ".".join(parts[:2]), ".".join(parts[2:])
    else:
        name, overload = op, None
    args = None
    for key in ("args", "arguments"):
        value = _field(event, key)
        if isinstance(value, (list, tuple)):
            args = value
            break
    count = _field(event, "count", 1)
    return _Event(
        name=name,
        overload=overload,
        module=_field(event, "module"),
        location=_field(event, "location"),
        backward=bool(_field(event, "backward", False)),
        count=count if isinstance(count, int) and count > 0 else 1,
        args=args,
    )


_UNKNOWN = object()


def _arg(event: _Event, index: int) -> Any:
    if event.args is None or index >= len(event.args):
        return _UNKNOWN
    return event.args[index]


def _tensor_attr(value: Any, attr: str) -> Any:
    """An attribute of a recorded tensor argument (a summary dict, or a tensor), else _UNKNOWN."""
    if isinstance(value, torch.Tensor):
        if attr == "dtype":
            return str(value.dtype)
        if attr == "quantized":
            return value.is_quantized
        if attr == "sparse":
            return value.layout != torch.strided
    if isinstance(value, Mapping) and attr in value:
        return value[attr]
    if isinstance(value, Mapping) and attr == "sparse" and "layout" in value:
        return value["layout"] != "torch.strided"
    return _UNKNOWN


def _is_float_or_complex(dtype: Any) -> bool | None:
    if not isinstance(dtype, str):
        return None
    name = dtype.removeprefix("torch.")
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        return None
    return d.is_floating_point or d.is_complex


def _condition_holds(cond: Mapping[str, Any], event: _Event) -> bool | None:
    """Whether the recorded call meets ``cond``; None when the recording cannot tell."""
    kind = cond["kind"]
    value = _arg(event, int(cond.get("arg", 0)))
    if value is _UNKNOWN:
        return None
    if kind == "reduction_not_none":
        return value != 0 if isinstance(value, int) else None
    if kind == "embedding_bag_max":
        return value == 2 if isinstance(value, int) else None
    if kind == "weights_given":
        return value is not None
    if kind == "reduce_in":
        return value in cond["values"] if isinstance(value, str) else None
    if kind == "floating_or_complex":
        return _is_float_or_complex(_tensor_attr(value, "dtype"))
    if kind in ("quantized", "sparse"):
        attr = _tensor_attr(value, kind)
        return bool(attr) if isinstance(attr, bool) else None
    return None


_FACT_OF_CONDITION = {
    "reduction_not_none": "reduction",
    "embedding_bag_max": "mode",
    "weights_given": "weights",
    "reduce_in": "reduce",
    "floating_or_complex": "floating",
}


def _fact_holds(cond: Mapping[str, Any], value: Any) -> bool | None:
    kind = cond["kind"]
    if kind == "reduction_not_none":
        return value != "none" if isinstance(value, str) else None
    if kind == "embedding_bag_max":
        return value == "max" if isinstance(value, str) else None
    if kind == "reduce_in":
        return value in cond["values"] if isinstance(value, str) else None
    return value if isinstance(value, bool) else None


def _condition_from_calls(
    cond: Mapping[str, Any], event: _Event, calls: Mapping[str | None, list[Mapping[str, Any]]]
) -> bool | None:
    """The condition decided from the Python-level calls the probe saw at the event's line."""
    fact = _FACT_OF_CONDITION.get(cond["kind"])
    if fact is None or event.location is None:
        return None
    verdicts = [_fact_holds(cond, c[fact]) for c in calls.get(event.location, ()) if fact in c]
    if not verdicts or None in verdicts:
        return None
    return any(verdicts)


_CONDITION_TEXT = {
    "reduction_not_none": "reduction is 'mean' or 'sum' (the default)",
    "embedding_bag_max": "mode='max'",
    "weights_given": "weights were given",
    "reduce_in": "reduce is {values}",
    "floating_or_complex": "the tensor is floating point or complex",
    "quantized": "the tensor is quantized",
    "sparse": "an input is sparse",
}


def _condition_text(cond: Mapping[str, Any]) -> str:
    return _CONDITION_TEXT[cond["kind"]].format(values=" or ".join(repr(v) for v in cond.get("values", ())))


def _matches(spec: _OpSpec, event: _Event) -> bool:
    if spec.name != event.name:
        return False
    if spec.overload is not None and spec.overload != event.overload:
        return False
    return spec.phase == "any" or (spec.phase == "backward") == event.backward


# --------------------------------------------------------------------------------------------
# Op analysis


def _sort_key(f: Finding) -> tuple[int, str, str, str]:
    return (_SEVERITY_RANK[f.severity], f.code, f.location or "", f.op or "")


def _op_message(entry: _Entry, phases: set[bool], uncertain: bool, ops: Sequence[str], sites: int) -> str:
    where = ""
    if phases == {True}:
        where = " (recorded in backward; the location is its forward call)"
    elif phases == {True, False}:
        where = " (in forward and in backward; the location is the forward call)"
    if entry.section == "raises":
        msg = (
            f"{entry.title}{where}: no deterministic CUDA implementation. On CUDA, strict mode "
            "(torch.use_deterministic_algorithms(True)) raises RuntimeError here; without it the "
            "result can differ from run to run."
        )
        if uncertain:
            cond = entry.condition or {}
            msg += (
                f" This applies only if {_condition_text(cond)}, which the op recording cannot tell: "
                "check the call."
            )
        return msg
    why = entry.why or (
        "nondeterministic on CUDA (and on the CPU where the documentation says so) unless deterministic "
        "algorithms are on; strict mode makes it deterministic, at some speed cost"
    )
    msg = f"{entry.title}: {why}. Ran as {', '.join(ops)}"
    msg += "." if sites <= 1 else f" at {sites} places; the first is shown."
    if uncertain:
        msg += f" Only if {_condition_text(entry.condition or {})}, which the op recording cannot tell."
    return msg


def audit_ops(events: Iterable[Any], *, calls: Iterable[Mapping[str, Any]] = ()) -> list[Finding]:
    """Findings for recorded op events (``OpEvent`` objects or their ``to_dict()`` dicts).

    ``calls`` are facts about Python-level calls (``{"fn", "location", "weights"|"floating"|
    "reduce"|"reduction"|"mode": ...}``, as the audited child's probe records them) that decide
    the conditions of the table for ops recorded at the same ``location``.

    Ops that raise under strict mode on CUDA (or stay nondeterministic) give one ``error`` per op
    and call site (a ``warning`` when a condition of the table cannot be checked from the
    recording); ops that strict mode makes deterministic give one ``info`` per table entry. Ops not
    in the table give nothing.

    >>> [f.code for f in audit_ops([{"op": "aten.relu.default", "module": "net.act",
    ...                               "location": "t.py:3", "backward": False}])]
    []
    """
    table = _load_table()
    by_name: dict[str, list[tuple[_Entry, _OpSpec]]] = {}
    for entry in table.entries:
        for spec in entry.ops:
            by_name.setdefault(spec.name, []).append((entry, spec))
    by_location: dict[str | None, list[Mapping[str, Any]]] = {}
    for call in calls:
        by_location.setdefault(call.get("location"), []).append(call)
    groups: dict[tuple[Any, ...], tuple[_Entry, _Event, list[bool], dict[str, None], set[Any]]] = {}
    for raw in events:
        event = _as_event(raw)
        for entry, spec in by_name.get(event.name, ()):
            if not _matches(spec, event):
                continue
            uncertain = False
            if entry.condition is not None:
                holds = _condition_holds(entry.condition, event)
                if holds is None:
                    holds = _condition_from_calls(entry.condition, event, by_location)
                if holds is False:
                    continue
                if holds is None:
                    if entry.condition.get("if_unknown") == "skip":
                        continue
                    uncertain = True
            op = event.name if event.overload in (None, "default") else f"{event.name}.{event.overload}"
            if entry.section == "raises":
                key: tuple[Any, ...] = (entry.code, op, event.module, event.location)
            else:
                key = (entry.code,)
            if key not in groups:
                groups[key] = (entry, dataclasses.replace(event, name=op), [], {}, set())
            groups[key][2].append(uncertain)
            groups[key][3][op] = None
            groups[key][4].add((event.location, event.backward))
    findings = []
    for entry, event, unsure_list, ops, sites in groups.values():
        unsure = all(unsure_list)
        severity = ("warning" if unsure else "error") if entry.section == "raises" else "info"
        phases = {backward for _, backward in sites}
        findings.append(
            Finding(
                code=entry.code,
                severity=severity,
                op=event.name,
                module=event.module,
                location=event.location,
                message=_op_message(entry, phases, unsure, list(ops), len({loc for loc, _ in sites})),
                fix=entry.fix,
            )
        )
    return sorted(findings, key=_sort_key)


def _table_findings() -> list[Finding]:
    """TR001/TR002: the table is for another torch release, or this torch documents items it lacks."""
    table = _load_table()
    out = []
    if not table.exact:
        out.append(
            Finding(
                "TR001",
                "info",
                None,
                None,
                None,
                f"The op table was made for torch {table.release}; this is torch {torch.__version__}, "
                "so ops added or fixed since may be missed or reported wrongly.",
                "Upgrade torchrepro, or add a release to torchrepro/_audit_ops.json (tests/test_audit.py "
                "checks it against the installed torch's documentation).",
            )
        )
    known = {d for e in table.entries for d in e.doc}
    new = sorted(set(_documented_items()) - known)
    if new:
        out.append(
            Finding(
                "TR002",
                "warning",
                None,
                None,
                None,
                "torch.use_deterministic_algorithms documents ops the audit's table does not cover: "
                + "; ".join(new),
                "Check these ops in your script by hand, and add them to torchrepro/_audit_ops.json.",
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# Settings analysis


def _settings_finding(
    code: str, severity: str, message: str, fix: str, location: str | None = None
) -> Finding:
    return Finding(code, severity, None, None, location, message, fix)


def audit_settings(settings: Mapping[str, Any], *, events: Iterable[Any] = ()) -> list[Finding]:
    """Findings for the determinism settings a script ran with (the probe's ``settings`` dict).

    ``events`` (the recorded ops) decide which settings matter: the CUBLAS variable only when
    cuBLAS ops ran, deterministic mode only when ops that need it ran. Keys missing from
    ``settings`` are not judged.

    >>> [f.code for f in audit_settings({"cudnn_benchmark": True})]
    ['TR203']
    """
    table = _load_table()
    evs = [_as_event(e) for e in events]
    op_findings = audit_ops(evs, calls=settings.get("calls") or ())
    needs_strict = sorted({f.op or "" for f in op_findings if f.severity == "info"})
    if settings.get("cudnn_deterministic"):
        conv = {s.name for e in table.entries if e.code == "TR120" for s in e.ops}
        needs_strict = [o for o in needs_strict if o.rsplit(".", 1)[0] not in conv and o not in conv]
    cannot = sorted({f.op or "" for f in op_findings if f.severity in ("error", "warning")})
    uses_cublas = any(e.name in table.cublas_ops for e in evs)
    uses_conv = any(e.name in ("aten.convolution", "aten._convolution") for e in evs)
    deterministic = settings.get("deterministic_algorithms")
    warn_only = settings.get("warn_only")
    out: list[Finding] = []
    add = out.append

    if settings.get("hash_randomization"):
        add(
            _settings_finding(
                "TR201",
                "warning",
                "Hash randomisation is on (PYTHONHASHSEED unset when Python started): the iteration order "
                "of sets of str/bytes changes every run. It is read once at interpreter start, so setting "
                "os.environ inside the script changes nothing for that process.",
                "Start the script with PYTHONHASHSEED=0 (torchrepro run does), or call "
                "torchrepro.relaunch() at the top of the script.",
            )
        )
    cublas = settings.get("cublas_workspace_config", _UNKNOWN)
    if cublas is not _UNKNOWN and cublas not in _CUBLAS_OK and uses_cublas:
        strict = bool(deterministic) and not warn_only
        add(
            _settings_finding(
                "TR202",
                "error" if strict else "warning",
                f"CUBLAS_WORKSPACE_CONFIG is {'unset' if cublas is None else repr(cublas)} and the script "
                "runs cuBLAS matmuls: "
                + (
                    "with the deterministic algorithms it turns on, every matmul raises RuntimeError on CUDA."
                    if strict
                    else "on CUDA, cuBLAS may then pick nondeterministic reductions."
                ),
                "Set CUBLAS_WORKSPACE_CONFIG=:4096:8 (or :16:8) in the environment before CUDA starts "
                "(torchrepro run does).",
            )
        )
    if settings.get("cudnn_benchmark"):
        add(
            _settings_finding(
                "TR203",
                "warning",
                "torch.backends.cudnn.benchmark is on: cuDNN times candidate algorithms and may pick a "
                "different one each run.",
                "Set torch.backends.cudnn.benchmark = False (strict mode does).",
            )
        )
    tf32 = []
    if settings.get("matmul_allow_tf32"):
        tf32.append("torch.backends.cuda.matmul.allow_tf32 is on")
    precision = settings.get("float32_matmul_precision")
    if precision not in (None, "highest"):
        tf32.append(f"float32 matmul precision is {precision!r}")
    if settings.get("cudnn_allow_tf32") and uses_conv:
        tf32.append("torch.backends.cudnn.allow_tf32 is on (the default) and the script convolves")
    if tf32:
        add(
            _settings_finding(
                "TR204",
                "info",
                "Reduced-precision float32 math: "
                + "; ".join(tf32)
                + ". Results are repeatable on the same hardware but differ from full float32 and between "
                "GPU generations (TF32 on Ampere and later; bf16 matmuls on some CPUs).",
                "torch.backends.cuda.matmul.allow_tf32 = False, torch.backends.cudnn.allow_tf32 = False, "
                "torch.set_float32_matmul_precision('highest') (strict mode does).",
            )
        )
    if deterministic is False and needs_strict:
        add(
            _settings_finding(
                "TR205",
                "warning",
                "Deterministic algorithms are off, and the script runs ops that are nondeterministic on CUDA "
                "without them: " + ", ".join(needs_strict) + ".",
                f"Turn strict mode on ({_STRICT}); it makes these ops deterministic at some speed cost.",
            )
        )
    if deterministic and warn_only:
        stays = ", ".join(cannot + needs_strict) or "none recorded in this run"
        add(
            _settings_finding(
                "TR206",
                "warning",
                "Deterministic algorithms are in warn-only mode: ops without a deterministic implementation "
                f"only warn and stay nondeterministic (and so do SDPA backward kernels). Affected: {stays}.",
                "Use torch.use_deterministic_algorithms(True) without warn_only, and fix the ops it rejects.",
            )
        )
    threads_env = settings.get("thread_env") or {}
    if settings.get("set_num_threads_called") is False and not any(threads_env.values()):
        n = settings.get("num_threads")
        add(
            _settings_finding(
                "TR207",
                "warning",
                f"The thread count is not pinned (torch uses {n} threads here, from the machine's cores): "
                "CPU results (convolution backward, large sums) change with the thread count, so the same "
                "script differs between machines.",
                "Pin it: torchrepro run --threads N, OMP_NUM_THREADS=N, or torch.set_num_threads(N).",
            )
        )
    if settings.get("torch_seeded") is False:
        add(
            _settings_finding(
                "TR208",
                "warning",
                "The script never seeds torch's RNG: initial weights, dropout masks and shuffling differ "
                "every run.",
                "Call torchrepro.seed_everything(0) (or torch.manual_seed) before building the model, "
                "or run it with torchrepro run --seed N.",
            )
        )
    for loader in settings.get("dataloaders") or ():
        out.extend(_loader_findings(loader))
    for call in settings.get("compile_calls") or ():
        backend = call.get("backend") or "inductor"
        inductor_det = settings.get("inductor_deterministic")
        if backend == "inductor" and not deterministic and not inductor_det:
            mode = call.get("mode")
            add(
                _settings_finding(
                    "TR401",
                    "warning",
                    "torch.compile with Inductor and without its deterministic mode: on GPU Inductor "
                    "benchmarks and autotunes kernels (matmul padding, templates, reduction configs) and "
                    "keeps the fastest, which can change the numerics from run to run"
                    + (f"; mode={mode!r} autotunes even more." if mode and "autotune" in str(mode) else "."),
                    "Turn on deterministic algorithms (strict mode; it switches Inductor to its "
                    "deterministic mode) or set torch._inductor.config.deterministic = True "
                    "(TORCHINDUCTOR_DETERMINISTIC=1).",
                    call.get("location"),
                )
            )
    steps = settings.get("optimizer_steps")
    if steps == 0:
        add(
            _settings_finding(
                "TR003",
                "info",
                "The script made no optimizer step while audited; the findings cover what ran (an "
                "inference-only run records no backward ops).",
                "Audit with arguments under which the script trains (a short config is enough: the audit "
                "stops after --steps optimizer steps).",
            )
        )
    return sorted(out, key=_sort_key)


def _loader_findings(loader: Mapping[str, Any]) -> list[Finding]:
    if loader.get("seeded_loader"):
        return []
    out = []
    location = loader.get("location")
    workers = int(loader.get("num_workers") or 0)
    hint = loader.get("random_hint")
    if workers > 0 and hint:
        out.append(
            _settings_finding(
                "TR301",
                "warning",
                f"A plain DataLoader with num_workers={workers} runs random augmentation ({hint}): each "
                "worker seeds itself with base_seed + worker_id, so which worker handles a sample, and so "
                "its augmentation, changes with num_workers (and with the base seed drawn from the global "
                "torch RNG).",
                "Use torchrepro.SeededLoader (same batches for any num_workers) and draw augmentation "
                "randomness from torchrepro.sample_rng() inside __getitem__.",
                location,
            )
        )
    elif workers > 0:
        out.append(
            _settings_finding(
                "TR302",
                "info",
                f"A plain DataLoader with num_workers={workers}: if __getitem__ draws random numbers, the "
                "result depends on num_workers (workers seed with base_seed + worker_id).",
                "Use torchrepro.SeededLoader, and torchrepro.sample_rng() for per-sample randomness.",
                location,
            )
        )
    if loader.get("shuffle") and not loader.get("generator"):
        out.append(
            _settings_finding(
                "TR303",
                "info",
                "A shuffling DataLoader without generator= draws its order from the global torch RNG: any "
                "extra draw before it (a new layer, a validation pass) changes the training batches.",
                "Pass generator=torch.Generator().manual_seed(seed), or use torchrepro.SeededLoader.",
                location,
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# Running a script


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _child_env(ops_prefix: str, settings_path: str, steps: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHREPRO_")}
    env["TORCHREPRO_OPS_OUT"] = ops_prefix
    env["TORCHREPRO_MAX_STEPS"] = str(steps)
    env[_SETTINGS_ENV] = settings_path
    src = str(Path(__file__).resolve().parents[1])
    # torchrepro must be importable in the child; the user's own PYTHONPATH entries stay first
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), src) if p)
    return env


def audit_script(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    steps: int = 1,
    module: bool = False,
    timeout: float | None = None,
) -> AuditReport:
    """Run ``script`` (or, with ``module=True``, ``python -m script``) as plain python would, for
    ``steps`` optimizer steps with the op recorder on, and return what breaks determinism.

    The script runs in a fresh subprocess in the current directory, with the current environment
    minus any ``TORCHREPRO_*`` variable (no seeding, no determinism switches), so the settings
    findings describe the script as its user runs it. Raises ``LaunchError`` when the script is
    missing or fails (with the tail of its stderr), and ``ValueError`` for a bad ``steps``.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    target = os.fspath(script)
    if not module and not Path(target).is_file():
        raise LaunchError(f"Cannot audit {target!r}: no such file (expected a Python training script).")
    with tempfile.TemporaryDirectory(prefix="torchrepro-audit-") as tmp:
        ops_prefix = str(Path(tmp) / "ops")
        settings_path = str(Path(tmp) / "settings.json")
        runner = "import sys; from torchrepro.audit import _child_main; _child_main(sys.argv[1:])"
        launch = ["-m", target] if module else ["--", target]
        cmd = [sys.executable, "-c", runner, *launch, *args]
        try:
            proc = subprocess.run(
                cmd,
                env=_child_env(ops_prefix, settings_path, steps),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise LaunchError(
                f"Auditing {target!r} took longer than {timeout} s; pass a larger timeout or fewer steps."
            ) from None
        if proc.returncode != 0:
            raise LaunchError(
                f"The script {target!r} failed while audited (exit code {proc.returncode}); "
                f"its last output:\n{_tail(proc.stderr or proc.stdout)}"
            )
        events = _read_events(Path(tmp))
        settings = _read_json(Path(settings_path)) if Path(settings_path).is_file() else {}
    calls = settings.get("calls") or ()
    findings = _table_findings() + audit_ops(events, calls=calls) + audit_settings(settings, events=events)
    steps_done = settings.get("optimizer_steps")
    return AuditReport(
        findings=tuple(sorted(findings, key=_sort_key)),
        script=target,
        steps=steps,
        optimizer_steps=steps_done if isinstance(steps_done, int) else None,
        ops_recorded=sum(_as_event(e).count for e in events),
        torch_version=torch.__version__,
        table_release=_load_table().release,
        settings=settings,
    )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TraceError(f"Cannot read the audit's recording {path.name}: {exc}") from None


def _read_events(directory: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    files = sorted(directory.glob("ops.rank*.json"))
    if not files:
        raise TraceError(
            "The audited script ran but left no op recording (expected ops.rank0.json from the bootstrap); "
            "was it started through torchrepro's bootstrap?"
        )
    for path in files:
        data = _read_json(path)
        if isinstance(data, Mapping):
            data = data.get("events", [])
        if not isinstance(data, list):
            raise TraceError(f"The op recording {path.name} is not a list of events.")
        events.extend(data)
    return events


# --------------------------------------------------------------------------------------------
# Inside the audited child: the settings probe


def _user_location() -> str | None:
    """``file:line`` of the innermost caller outside torch, torchrepro and the standard library."""
    skip = tuple(
        os.path.normcase(os.path.dirname(os.path.abspath(f))) + os.sep
        for f in (torch.__file__, __file__, os.__file__)
    )
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not os.path.normcase(filename).startswith(skip) and not frame.f_code.co_filename.startswith("<"):
            try:
                rel = os.path.relpath(filename)
            except ValueError:
                rel = filename
            shown = filename if rel.startswith("..") else rel
            return f"{shown}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


_RANDOM_SOURCE = re.compile(
    r"\b(random\.\w+\(|np\.random\.|numpy\.random\.|torch\.(rand|randn|randint|randperm|bernoulli|normal|"
    r"multinomial)\b|\.(uniform_|normal_|random_|bernoulli_)\(|default_rng\()"
)


def _random_hint(dataset: Any) -> str | None:
    """A short reason to think ``dataset`` draws random numbers per sample, else None (a heuristic)."""
    stack: list[Any] = [dataset]
    seen: set[int] = set()
    names: list[str] = []
    while stack and len(seen) < 50:
        obj = stack.pop()
        if id(obj) in seen or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            stack.extend(obj)
            continue
        cls = type(obj).__name__
        if cls.startswith("Random") or cls in (
            "ColorJitter",
            "AutoAugment",
            "RandAugment",
            "TrivialAugmentWide",
        ):
            names.append(cls)
        for attr in (
            "transform",
            "transforms",
            "target_transform",
            "augment",
            "augmentation",
            "dataset",
            "datasets",
        ):
            with contextlib.suppress(Exception):
                stack.append(getattr(obj, attr, None))
    if names:
        return "transforms " + ", ".join(sorted(set(names)))
    getitem = getattr(type(dataset), "__getitem__", None)
    try:
        source = inspect.getsource(getitem) if getitem is not None else ""
    except (OSError, TypeError):
        source = ""
    m = _RANDOM_SOURCE.search(source)
    if m:
        return f"{type(dataset).__name__}.__getitem__ calls {m.group(0).rstrip('(')}"
    return None


class _SettingsProbe:
    """Watches what the audited script sets; writes it as JSON after each optimizer step and at exit."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.start_seed = torch.initial_seed()
        self.start_env = {
            k: os.environ.get(k) for k in ("PYTHONHASHSEED", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
        }
        self.hash_randomization = bool(sys.flags.hash_randomization)
        self.set_num_threads_called = False
        self.dataloaders: list[dict[str, Any]] = []
        self.compile_calls: list[dict[str, Any]] = []
        self.optimizer_steps = 0
        self.calls: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.requested_deterministic: tuple[bool, bool] | None = None

    def install(self) -> None:
        import torch.optim.optimizer as optim_mod
        import torch.utils.data as data_mod

        probe = self
        original_init = data_mod.DataLoader.__init__

        @functools.wraps(original_init)
        def init(loader: Any, *a: Any, **kw: Any) -> None:
            original_init(loader, *a, **kw)
            with contextlib.suppress(Exception):
                probe._record_loader(loader)

        data_mod.DataLoader.__init__ = init  # type: ignore[method-assign,assignment]

        original_compile = torch.compile

        @functools.wraps(original_compile)
        def compile_(*a: Any, **kw: Any) -> Any:
            backend = kw.get("backend", "inductor")
            probe.compile_calls.append(
                {
                    "location": _user_location(),
                    "backend": backend
                    if isinstance(backend, str)
                    else getattr(backend, "__name__", "custom"),
                    "mode": kw.get("mode"),
                }
            )
            return original_compile(*a, **kw)

        torch.compile = compile_  # type: ignore[assignment]

        original_deterministic = torch.use_deterministic_algorithms

        @functools.wraps(original_deterministic)
        def use_deterministic_algorithms(mode: bool, *, warn_only: bool = False) -> None:
            # Record what the script asks for, but only warn: an op that raises under strict mode
            # (max_unpool, put_ on the CPU; many more on CUDA) must not stop the audit at the first.
            probe.requested_deterministic = (bool(mode), bool(warn_only))
            original_deterministic(mode, warn_only=True)

        torch.use_deterministic_algorithms = use_deterministic_algorithms

        original_threads = torch.set_num_threads

        @functools.wraps(original_threads)
        def set_num_threads(n: int) -> None:
            probe.set_num_threads_called = True
            original_threads(n)

        torch.set_num_threads = set_num_threads  # type: ignore[assignment]

        def after_step(*_: Any) -> None:
            probe.optimizer_steps += 1
            probe.write()

        self._watch_calls()
        optim_mod.register_optimizer_step_post_hook(after_step)
        atexit.register(self.write)

    def _watch_calls(self) -> None:
        """Wrap the few functions whose arguments decide a table condition; record the facts by line."""
        import torch.nn.functional as fn

        def wrap(owner: Any, name: str, facts: Any) -> None:
            original = getattr(owner, name, None)
            if original is None:
                return
            probe = self

            @functools.wraps(original)
            def wrapper(*a: Any, **kw: Any) -> Any:
                with contextlib.suppress(Exception):
                    if len(probe.calls) < 10_000:
                        record = {"fn": name.rstrip("_"), "location": _user_location(), **facts(a, kw)}
                        probe.calls.setdefault(tuple(sorted(record.items())), record)
                return original(*a, **kw)

            setattr(owner, name, wrapper)

        def pos(a: Sequence[Any], kw: Mapping[str, Any], index: int, key: str, default: Any) -> Any:
            return kw[key] if key in kw else (a[index] if len(a) > index else default)

        def cumsum(a: Sequence[Any], kw: Mapping[str, Any]) -> dict[str, Any]:
            dtype = kw.get("dtype") or getattr(a[0], "dtype", None)
            return {"floating": dtype.is_floating_point or dtype.is_complex} if dtype is not None else {}

        def bincount(a: Sequence[Any], kw: Mapping[str, Any]) -> dict[str, Any]:
            return {"weights": pos(a, kw, 1, "weights", None) is not None}

        def scatter_reduce(a: Sequence[Any], kw: Mapping[str, Any]) -> dict[str, Any]:
            return {"reduce": pos(a, kw, 4, "reduce", None)}

        def loss(a: Sequence[Any], kw: Mapping[str, Any]) -> dict[str, Any]:
            reduction = pos(a, kw, 6, "reduction", "mean")
            return {"reduction": "none" if kw.get("reduce") is False else reduction}

        def embedding_bag(a: Sequence[Any], kw: Mapping[str, Any]) -> dict[str, Any]:
            return {"mode": pos(a, kw, 6, "mode", "mean")}

        for owner in (torch, torch.Tensor):
            wrap(owner, "cumsum", cumsum)
            wrap(owner, "bincount", bincount)
            wrap(owner, "scatter_reduce", scatter_reduce)
        wrap(torch.Tensor, "cumsum_", cumsum)
        wrap(torch.Tensor, "scatter_reduce_", scatter_reduce)
        wrap(fn, "nll_loss", loss)
        wrap(fn, "cross_entropy", loss)
        wrap(fn, "embedding_bag", embedding_bag)

    def _record_loader(self, loader: Any) -> None:
        import torch.utils.data as data_mod

        seeded = any(
            c.__name__ == "SeededLoader" and c.__module__.startswith("torchrepro")
            for c in type(loader).__mro__
        )
        self.dataloaders.append(
            {
                "location": _user_location(),
                "class": type(loader).__name__,
                "seeded_loader": seeded,
                "num_workers": int(loader.num_workers),
                "worker_init_fn": loader.worker_init_fn is not None,
                "generator": loader.generator is not None,
                "shuffle": isinstance(getattr(loader, "sampler", None), data_mod.RandomSampler),
                "random_hint": _random_hint(loader.dataset),
            }
        )

    def snapshot(self) -> dict[str, Any]:
        inductor = sys.modules.get("torch._inductor.config")
        deterministic = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        if self.requested_deterministic is not None and self.requested_deterministic[0] == deterministic:
            warn_only = self.requested_deterministic[1]  # the probe turned a strict request into warn-only
        return {
            "hash_randomization": self.hash_randomization,
            "pythonhashseed": self.start_env["PYTHONHASHSEED"],
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "deterministic_algorithms": deterministic,
            "warn_only": warn_only,
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "num_threads": torch.get_num_threads(),
            "set_num_threads_called": self.set_num_threads_called,
            "thread_env": {k: v for k, v in self.start_env.items() if k != "PYTHONHASHSEED"},
            "torch_seeded": torch.initial_seed() != self.start_seed,
            "inductor_deterministic": getattr(inductor, "deterministic", None) if inductor else None,
            "compile_calls": self.compile_calls,
            "dataloaders": self.dataloaders,
            "optimizer_steps": self.optimizer_steps,
            "calls": list(self.calls.values()),
            "cuda_initialized": torch.cuda.is_initialized(),  # type: ignore[no-untyped-call]
        }

    def write(self) -> None:
        with contextlib.suppress(Exception):
            atomic_write_json(self.path, self.snapshot())


def _child_main(argv: list[str]) -> None:
    """Entry point of the audited child: install the settings probe, then run the bootstrap."""
    from torchrepro import _bootstrap

    path = os.environ.get(_SETTINGS_ENV)
    if path:
        _SettingsProbe(path).install()
    sys.exit(_bootstrap.main(argv))
