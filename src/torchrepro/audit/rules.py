"""The audit's rules: pure functions from recorded ops and settings to findings.

Invariants:

- Nothing here runs a script or changes global state: ``audit_ops`` and ``audit_settings`` are
  pure functions of their input (the recorded ops and the probe's settings dict), testable
  without running anything. ``audit.runner`` runs the script; ``_child.hooks`` probes it.
- Op findings come from the op table (``audit.optable``): which ops raise or become deterministic
  is read from the installed torch's ``torch.use_deterministic_algorithms.__doc__``, the aten ops
  and fix hints from ``ops_table.json``; each op finding names the documentation its list comes
  from. An audit says so when that documentation could not be read (TR001) or lists items the
  table has no ops for (TR002).
- Conditions of the table (``bincount`` with weights, ``cumsum`` on floats...) are decided from
  the arguments of the Python-level call at the op's line, which the child's probe records; one
  it cannot decide never yields an error: the finding is a warning that says what is unknown.
- Findings for a backward op carry the module and source line of the forward call that created
  it (the recorder's location), never ``loss.backward()``.
- Data findings trust the probe's measurement (which global RNGs a dataset draws from) over the
  source heuristic, which decides only when the probe could not run. A dataset drawing from a
  global RNG is a finding only when that draw is unseeded where it runs: in the main process,
  the script's own seeding of that RNG; in workers (torch reseeds random, NumPy and torch from
  the base seed), the loader's ``generator=`` or the script's torch seed.
- The library never prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from torchrepro.audit.optable import _Entry, _load_table, _OpSpec
from torchrepro.errors import TraceError
from torchrepro.flags import CUBLAS_CONFIGS

__all__ = ["SEVERITIES", "AuditReport", "Finding", "audit_ops", "audit_settings", "report"]

SEVERITIES = ("error", "warning", "info")
_SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}
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
    source = f" ({entry.listed_in})" if entry.listed_in else ""
    if entry.section == "raises":
        device = {
            False: "on CUDA",
            True: "on any device, the CPU included",
            None: "on CUDA, nor on the CPU in some of the documented cases",
        }[entry.cpu]
        msg = (
            f"{entry.title}{where}: no deterministic implementation {device}{source}. There, strict mode "
            "(torch.use_deterministic_algorithms(True)) raises RuntimeError; without it the result can "
            "differ from run to run."
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
    msg = f"{entry.title}: {why}{source}. Ran as {', '.join(ops)}"
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
    """TR001/TR002: this torch's documentation could not be read, or documents items the table lacks."""
    table = _load_table()
    out = []
    if not table.read:
        out.append(
            Finding(
                "TR001",
                "info",
                None,
                None,
                None,
                f"torch {torch.__version__}'s use_deterministic_algorithms documentation could not be read, "
                f"so the op lists are {table.listed_in}"
                + ("." if table.exact else ": ops added or fixed since may be missed or reported wrongly."),
                "Upgrade torchrepro (torchrepro/audit/optable.py reads the documentation; "
                "tests/test_audit.py checks it against the installed torch).",
            )
        )
    new = list(table.uncovered)
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
                "Check these ops in your script by hand, and add them to torchrepro/audit/ops_table.json.",
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
    if cublas is not _UNKNOWN and cublas not in CUBLAS_CONFIGS and uses_cublas:
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
                f"Set CUBLAS_WORKSPACE_CONFIG={CUBLAS_CONFIGS[0]} (or {CUBLAS_CONFIGS[1]}) in the "
                "environment before CUDA starts (torchrepro run does).",
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
    seeded = settings.get("seeded")
    if not isinstance(seeded, Mapping):  # an older probe: only torch is known
        seeded = {"torch": settings.get("torch_seeded", True)}
    for loader in settings.get("dataloaders") or ():
        out.extend(_loader_findings(loader, seeded))
    for call in settings.get("tainted_seeds") or ():
        out.append(_tainted_seed_finding(call))
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


_RNG_NAMES = {
    "random": "Python's global random",
    "numpy": "NumPy's global RNG",
    "torch": "torch's global RNG",
}
_RNG_SEEDS = {"random": "random.seed(0)", "numpy": "np.random.seed(0)", "torch": "torch.manual_seed(0)"}
_FRAMEWORK_FIX = {
    "lightning": "With Lightning: call lightning.seed_everything(0, workers=True) before trainer.fit "
    "(it seeds random, NumPy and torch, and gives the DataLoader workers a worker_init_fn); a DataModule's "
    "DataLoader takes generator=torch.Generator().manual_seed(0).",
    "pytorch_lightning": "With Lightning: call pytorch_lightning.seed_everything(0, workers=True) before "
    "trainer.fit; a DataModule's DataLoader takes generator=torch.Generator().manual_seed(0).",
    "transformers": "With the HF Trainer: TrainingArguments(seed=0) seeds random, NumPy and torch when the "
    "Trainer is created, and data_seed= seeds its sampler; seed nothing randomly after that.",
    "accelerate": "With accelerate: call accelerate.utils.set_seed(0) before accelerator.prepare(...); "
    "Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)) seeds the order.",
}


def _names(rngs: Sequence[str]) -> str:
    return " and ".join(_RNG_NAMES.get(r, r) for r in rngs)


def _with_framework(fix: str, loader: Mapping[str, Any]) -> str:
    extra = _FRAMEWORK_FIX.get(str(loader.get("framework")))
    return f"{fix} {extra}" if extra else fix


def _loader_findings(loader: Mapping[str, Any], seeded: Mapping[str, Any] | None = None) -> list[Finding]:
    """Findings for one DataLoader the probe saw (``seeded``: which global RNGs the script seeded)."""
    if loader.get("seeded_loader"):
        return []
    seeded = seeded or {}
    out = []
    location = loader.get("location")
    workers = int(loader.get("num_workers") or 0)
    dataset = loader.get("dataset") or "the dataset"
    probe = loader.get("probe") if isinstance(loader.get("probe"), Mapping) else None
    measured = probe is not None and probe.get("ran") is True
    draws: list[str] = list(probe.get("draws") or ()) if measured and probe else []
    unstable = bool(measured and probe and probe.get("unstable"))
    hint = f"{dataset}.__getitem__ draws from {_names(draws)}" if draws else None
    if not measured:
        hint = loader.get("random_hint")
    fix_seed = (
        "or better, draw the randomness from torchrepro.sample_rng() inside __getitem__ and load with "
        "torchrepro.SeededLoader (the same samples for any num_workers)."
    )
    if draws:
        if workers == 0:
            unseeded = [r for r in draws if not seeded.get(r, True)]
            if unseeded:
                out.append(
                    _settings_finding(
                        "TR304",
                        "warning",
                        f"{dataset}.__getitem__ (loaded in the main process, num_workers=0) draws from "
                        f"{_names(unseeded)}, which the script never seeds: its samples differ every run "
                        "(found by loading one sample twice under different global RNG states).",
                        _with_framework(
                            f"Seed it before loading ({', '.join(_RNG_SEEDS[r] for r in unseeded)}, or "
                            f"torchrepro.seed_everything(0)), {fix_seed}",
                            loader,
                        ),
                        location,
                    )
                )
        elif not loader.get("generator") and not seeded.get("torch", True):
            out.append(
                _settings_finding(
                    "TR304",
                    "warning",
                    f"{dataset}.__getitem__ draws from {_names(draws)} in {workers} DataLoader workers. "
                    "torch reseeds random, NumPy and torch in each worker from the loader's base seed, but "
                    "that base seed is drawn from torch's global RNG, which the script never seeds, and the "
                    "loader has no generator=: its samples differ every run (found by loading one sample "
                    "twice under different global RNG states).",
                    _with_framework(
                        "Seed torch before iterating (torch.manual_seed(0) or torchrepro.seed_everything(0)) "
                        f"or pass DataLoader(generator=torch.Generator().manual_seed(0)), {fix_seed}",
                        loader,
                    ),
                    location,
                )
            )
    if unstable:
        out.append(
            _settings_finding(
                "TR306",
                "warning",
                f"{dataset}[0] differs between two loads under the same global RNG states: __getitem__ "
                "draws from something no global seed reaches (an unseeded np.random.default_rng() or "
                "torch.Generator, random.Random(), time, os.urandom), or it changes state as it loads.",
                "Draw per-sample randomness from torchrepro.sample_rng() inside __getitem__ (keyed by seed, "
                "epoch and index), or seed the generator the dataset holds.",
                location,
            )
        )
    if workers > 0 and hint:
        out.append(
            _settings_finding(
                "TR301",
                "warning",
                f"A plain DataLoader with num_workers={workers} runs random augmentation ({hint}): each "
                "worker seeds itself with base_seed + worker_id, so which worker handles a sample, and so "
                "its augmentation, changes with num_workers (and with the base seed drawn from the global "
                "torch RNG).",
                _with_framework(
                    "Use torchrepro.SeededLoader (same batches for any num_workers) and draw augmentation "
                    "randomness from torchrepro.sample_rng() inside __getitem__.",
                    loader,
                ),
                location,
            )
        )
    elif workers > 0 and not measured:
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
    sampler_generator = loader.get("sampler_generator", loader.get("generator"))
    if loader.get("shuffle") and not sampler_generator:
        given = loader.get("sampler_given")
        sampler = loader.get("sampler") or "RandomSampler"
        if given:
            ignored = (
                " The DataLoader's generator= does not reach it (it seeds only the workers' base seed)."
                if loader.get("generator")
                else ""
            )
            message = (
                f"The {sampler} given as {given}= has no generator: it draws the order from the global "
                "torch RNG, so any extra draw before it (a new layer, a validation pass) changes the "
                f"training batches.{ignored}"
            )
            fix = (
                f"Give the generator to the sampler: {sampler}(dataset, generator=torch.Generator()"
                ".manual_seed(seed)); DataLoader(generator=...) is not used by a sampler you pass."
            )
        else:
            message = (
                "A shuffling DataLoader without generator= draws its order from the global torch RNG: any "
                "extra draw before it (a new layer, a validation pass) changes the training batches."
            )
            fix = "Pass generator=torch.Generator().manual_seed(seed), or use torchrepro.SeededLoader."
        out.append(_settings_finding("TR303", "info", message, _with_framework(fix, loader), location))
    return out


def _tainted_seed_finding(call: Mapping[str, Any]) -> Finding:
    what = call.get("call") or "a seeding call"
    source = call.get("source") or "an unseeded source"
    if source.startswith("OS entropy"):
        origin = "OS entropy (no seed given)"
    elif source == "the current time":
        origin = "the current time"
    elif source.startswith(("random.", "np.random.")):
        origin = f"a value drawn from {source} before anything seeded that RNG"
    else:
        origin = f"a value from {source}, which no seed reaches"
    message = (
        f"{what} seeds {_RNG_NAMES.get(str(call.get('rng')), 'an RNG')} from {origin}: the seed, and "
        "everything it seeds, changes every run."
    )
    fix = (
        "Seed with a fixed value (e.g. 0), or take it from the command line or config and log it; "
        "torchrepro run --seed N seeds everything."
    )
    extra = _FRAMEWORK_FIX.get(str(call.get("framework")))
    return _settings_finding(
        "TR305", "warning", message, f"{fix} {extra}" if extra else fix, call.get("location")
    )


def report(*, script: str, steps: int, events: Sequence[Any], settings: Mapping[str, Any]) -> AuditReport:
    """The audit report of a run: table, op and settings findings, most severe first."""
    calls = settings.get("calls") or ()
    findings = _table_findings() + audit_ops(events, calls=calls) + audit_settings(settings, events=events)
    steps_done = settings.get("optimizer_steps")
    return AuditReport(
        findings=tuple(sorted(findings, key=_sort_key)),
        script=script,
        steps=steps,
        optimizer_steps=steps_done if isinstance(steps_done, int) else None,
        ops_recorded=sum(_as_event(e).count for e in events),
        torch_version=torch.__version__,
        table_release=_load_table().release,
        settings=settings,
    )
