"""The audit's settings probe: what the audited script sets, seeds and loads, noted in the child.

Invariants:
- Only an audited process installs it (``_child.session.configure`` through ``install_probe``:
  the bootstrap, and each python child the script starts, ``_child.children``), once per process,
  before the user's code runs; importing this module patches nothing. The process torchrepro
  started writes the spec's path; any other (a python child, a fork of a probed process) writes
  ``runrecord.process_path(path, pid)``, its own counts and records only (what a fork inherits,
  its seeding and switches, stays).
- ``SettingsProbe`` wraps ``DataLoader.__init__``, ``torch.compile``,
  ``torch.use_deterministic_algorithms``, ``torch.set_num_threads``, the setters of cuDNN's
  ``benchmark``/``allow_tf32``/``deterministic``, cuBLAS's ``allow_tf32`` and
  ``set_float32_matmul_precision`` (the lines that set a switch), the few functions whose
  arguments decide an op-table condition, the seeding functions (``random.seed``,
  ``np.random.seed``, ``torch.manual_seed``, ``torch.seed``, ``np.random.default_rng``, and
  ``torch.Generator``, replaced by a subclass: see ``_watch_generators``), the unseeded sources a
  seed may be drawn from (``random.randint``/``randrange``/``getrandbits``/``random``,
  ``np.random.randint``, ``secrets.randbits``/``randbelow``, ``os.urandom``, ``time.time``/
  ``time_ns``, ``os.getpid``), ``multiprocessing``'s ``Process.start``/``join``/``_bootstrap``
  and ``share_memory()``: they only note values and call through to the original unchanged. One
  exception, asked for: ``use_deterministic_algorithms`` is applied with ``warn_only=True`` (the
  probe records the request), so the audit sees every op.
- At each DataLoader's creation the probe loads index 0 of its dataset a few times (at most
  ``_PROBE_BUDGET_S``, once per dataset object) under global RNG states of its own, then restores
  every global RNG state (Python, NumPy, torch CPU) with op tracing paused: the script's draws
  are unchanged. Side effects of ``__getitem__`` itself (a cache, a counter) cannot be undone.
- What it saw is written as ``audit.settings.ProbeSettings`` JSON after each training step (an
  optimizer step, or a backward step no optimizer sees), when a ``multiprocessing`` process it
  runs ends, and at exit; a DataLoader worker writes nothing. User locations come from
  ``torchrepro._frames`` (the user's line, not a framework's).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import linecache
import os
import re
import sys
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from torchrepro import recorder as _recorder
from torchrepro import runrecord
from torchrepro._child.sources import seed_source, switch_statements
from torchrepro._frames import is_user, shown, user_frame, user_site
from torchrepro._io import atomic_write_json
from torchrepro._runtime import cuda_started
from torchrepro.audit.settings import ProbeSettings
from torchrepro.flags import DeterminismFlags

__all__ = ["SettingsProbe", "install_probe", "installed_probe"]

_WORKER_MODULE = "torch.utils.data._utils.worker"
"""The module of the DataLoader worker loop: a ``Process`` target that is never followed."""
_SPAWN_WRAPPER_MODULE = "torch.multiprocessing.spawn"
"""``mp.spawn`` starts ``_wrap(fn, i, ...)``: the user's function is its first argument."""
_TORCHREPRO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SHARED_CHECKED = 256
"""Parameters of a step checked for shared memory (hogwild shares the whole model)."""


def _user_location() -> str | None:
    """``file:line`` of the user's line (see ``_frames.user_site``)."""
    return user_site(outer=False)[0]


def _in_loader_fetch() -> bool:
    """Whether a DataLoader (or the probe) is loading samples up the stack: a dataset seeding
    itself per index is not the script seeding."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _probe_dataset.__code__ or frame.f_code.co_filename.endswith(
            os.path.join("_utils", "fetch.py")
        ):
            return True
        frame = frame.f_back
    return False


# The global RNGs the probe varies, by the name findings use.
_GLOBAL_RNGS = ("random", "numpy", "torch")
_PROBE_SLOW_S = 0.5  # one load slower than this: no further loads (the heuristic decides)
_PROBE_BUDGET_S = 2.0  # all the probe's loads of one dataset
_PROBE_STATES = 8  # other global RNG states tried before deciding a sample does not depend on them


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _sample_key(obj: Any, depth: int = 0) -> Any:
    """A hashable, comparable summary of a loaded sample (tensors, arrays, images, containers)."""
    if depth > 20:
        return "..."
    if obj is None or isinstance(obj, (bool, int, str, bytes)):
        return obj
    if isinstance(obj, float):
        return repr(obj)  # NaN equals itself
    if isinstance(obj, torch.Tensor):
        import hashlib

        t = obj.detach().cpu()
        if t.layout != torch.strided:
            t = t.to_dense()
        flat = t.contiguous().reshape(-1)
        data = flat.view(torch.uint8) if flat.numel() and flat.dtype != torch.bool else flat.to(torch.uint8)
        return ("tensor", str(t.dtype), tuple(t.shape), hashlib.sha1(data.numpy().tobytes()).hexdigest())
    if isinstance(obj, Mapping):
        return ("map", tuple(sorted((repr(k), _sample_key(v, depth + 1)) for k, v in obj.items())))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_sample_key(v, depth + 1) for v in obj))
    tobytes = getattr(obj, "tobytes", None)  # NumPy arrays and scalars, PIL images
    if callable(tobytes):
        return (type(obj).__name__, str(getattr(obj, "shape", getattr(obj, "size", ""))), tobytes())
    fields = getattr(obj, "__dict__", None)
    if isinstance(fields, dict):
        return (type(obj).__name__, _sample_key(fields, depth + 1))
    return (type(obj).__name__, repr(obj))


def _rng_states(numpy: Any) -> dict[str, Any]:
    import random

    return {
        "random": random.getstate(),
        "numpy": numpy.random.get_state() if numpy is not None else None,
        "torch": torch.get_rng_state(),
    }


def _set_rng_states(states: Mapping[str, Any], numpy: Any) -> None:
    import random

    random.setstate(states["random"])
    if numpy is not None and states["numpy"] is not None:
        numpy.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])


def _probe_dataset(dataset: Any) -> dict[str, Any]:
    """Decide empirically which global RNGs ``dataset[0]`` draws from.

    Loads index 0 under fixed global RNG states, again under the same states (a sample that
    differs then draws from something no global seed reaches: ``unstable``), then with every
    global RNG set to other states, and if that differs, with each changed alone. A draw may not
    show in one change (a coin flip lands the same way half the time), so each comparison tries
    up to ``_PROBE_STATES`` other states and stops at the first difference. Every global RNG
    state is restored afterwards and op tracing is paused, so the script computes what it would
    have. A dataset that seeds itself per index (torchvision's ``FakeData``) draws nothing.
    When it draws, one more load under the first states, traced line by line, finds the line
    that draws from each (``sites``: RNG -> ``file:line``, where the findings point).
    Returns ``{"ran": False, "reason": ...}`` when it cannot tell (no ``__len__``, an
    ``IterableDataset``, a load that raises, one slow load or ``_PROBE_BUDGET_S`` in all).
    """
    import random
    import time

    import torch.utils.data as data_mod

    if isinstance(dataset, data_mod.IterableDataset):
        return {"ran": False, "reason": "an IterableDataset has no index to load twice"}
    try:
        size = len(dataset)
    except Exception:
        return {"ran": False, "reason": "the dataset has no len()"}
    if size < 1:
        return {"ran": False, "reason": "the dataset is empty"}
    numpy = _numpy()
    names = [n for n in _GLOBAL_RNGS if n != "numpy" or numpy is not None]
    fixed = {
        seed: {
            "random": random.Random(seed).getstate(),
            "numpy": numpy.random.RandomState(seed).get_state() if numpy is not None else None,
            "torch": torch.Generator().manual_seed(seed).get_state(),
        }
        for seed in range(1, _PROBE_STATES + 2)
    }
    start = time.perf_counter()

    def load(changed: Sequence[str] = (), seed: int = 1) -> Any:
        if time.perf_counter() - start > _PROBE_BUDGET_S:
            raise TimeoutError
        _set_rng_states({n: fixed[seed if n in changed else 1][n] for n in _GLOBAL_RNGS}, numpy)
        return _sample_key(dataset[0])

    def differs(changed: Sequence[str], base: Any) -> bool:
        return any(load(changed, seed) != base for seed in range(2, _PROBE_STATES + 2))

    saved = _rng_states(numpy)
    sites: dict[str, str] = {}
    try:
        with _recorder.paused():
            base = load()
            if time.perf_counter() - start > _PROBE_SLOW_S:
                return {"ran": False, "reason": f"loading one sample takes over {_PROBE_SLOW_S} s"}
            unstable = load() != base
            draws = []
            if not unstable and differs(names, base):
                draws = [n for n in names if differs((n,), base)] or names  # only together: all
            if draws:
                _set_rng_states(fixed[1], numpy)
                with contextlib.suppress(Exception):
                    sites = _draw_sites(dataset, draws, numpy)
    except TimeoutError:
        return {"ran": False, "reason": f"loading index 0 again and again took over {_PROBE_BUDGET_S} s"}
    except Exception as exc:
        return {"ran": False, "reason": f"loading index 0 raised {type(exc).__name__}"}
    finally:
        _set_rng_states(saved, numpy)
    out: dict[str, Any] = {"ran": True, "draws": draws, "unstable": unstable}
    if sites:
        out["sites"] = sites
    return out


def _rng_reader(name: str, numpy: Any) -> Any:
    """A cheap comparable snapshot of one global RNG's state."""
    import random

    if name == "random":
        return random.getstate
    if name == "numpy":
        return lambda: (lambda st: (st[1].tobytes(), st[2], st[3], st[4]))(numpy.random.get_state())
    return lambda: torch.get_rng_state().numpy().tobytes()


def _draw_sites(dataset: Any, draws: Sequence[str], numpy: Any) -> dict[str, str]:
    """The user's line where loading ``dataset[0]`` first draws from each global RNG of
    ``draws``: one load traced line by line in the user's own files (not in installed packages,
    torch or the standard library: a draw inside a torchvision transform is the user's line that
    calls it), the RNG states compared after every line. Nothing when something else traces
    (a debugger, coverage): its tracing is left alone."""
    if sys.gettrace() is not None:
        return {}
    readers = {name: _rng_reader(name, numpy) for name in draws}
    before = {name: read() for name, read in readers.items()}
    sites: dict[str, str] = {}
    last: list[tuple[str, int] | None] = [None]

    def check() -> None:
        for name, read in readers.items():
            if name in sites:
                continue
            now = read()
            if now != before[name]:
                before[name] = now
                if last[0] is not None:
                    sites[name] = f"{shown(last[0][0])}:{last[0][1]}"

    def own(code: Any) -> bool:
        parts = code.co_filename.split(os.sep)
        return "site-packages" not in parts and "dist-packages" not in parts

    def local(frame: Any, event: str, arg: Any) -> Any:
        check()
        if event == "line":
            last[0] = (frame.f_code.co_filename, frame.f_lineno)
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        if event != "call" or not is_user(frame) or not own(frame.f_code):
            return None
        check()
        return local

    sys.settrace(calls)
    try:
        dataset[0]
    finally:
        sys.settrace(None)
    check()
    return sites


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


def _sampler_facts(loader: Any, given: str | None) -> dict[str, Any]:
    """The sampler that draws the order (the one given, alone or inside a batch sampler, or the
    one DataLoader made from ``shuffle=``, which takes the loader's generator) and whether it is
    seeded: it holds a generator, or it is accelerate's ``SeedableRandomSampler`` (it seeds itself
    each pass from ``data_seed`` or torch's initial seed)."""
    import torch.utils.data as data_mod

    sampler = loader.sampler
    if given == "batch_sampler" or not isinstance(sampler, data_mod.RandomSampler):
        inner = getattr(loader.batch_sampler, "sampler", None)
        sampler = inner if inner is not None else sampler
    return {
        "shuffle": isinstance(sampler, data_mod.RandomSampler),
        "sampler": type(sampler).__name__,
        "sampler_generator": getattr(sampler, "generator", None) is not None
        or type(sampler).__name__ == "SeedableRandomSampler",
    }


def _code(function: Any) -> Any:
    """A function's code object (typed loosely: ``functools.wraps`` hides it from mypy)."""
    return function.__code__


def _target_name(target: Any, args: Sequence[Any] = ()) -> str | None:
    """The name of a process's target (``mp.spawn``: the function it wraps)."""
    if target is None:
        return None
    if getattr(target, "__module__", None) == _SPAWN_WRAPPER_MODULE and args and callable(args[0]):
        target = args[0]
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    return str(name or type(target).__name__)


def _shared_cpu(tensors: Iterable[Any]) -> list[torch.Tensor]:
    """The CPU tensors among ``tensors`` whose storage is in shared memory (a CUDA tensor always
    says it is shared: it is not counted)."""
    out = []
    for i, t in enumerate(tensors):
        if i >= _SHARED_CHECKED:
            break
        with contextlib.suppress(Exception):
            tensor: Any = t
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and tensor.is_shared():
                out.append(t)
    return out


def _receiver(frame: types.FrameType, method: str) -> str | None:
    """The expression a method was called on at the frame's line (``model`` in ``model.share_memory()``)."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    m = re.search(r"([A-Za-z_][\w.]*)\s*\.\s*" + re.escape(method) + r"\s*\(", line)
    return m.group(1) if m else None


def _holder(tensors: Sequence[torch.Tensor], frame: types.FrameType | None) -> tuple[str | None, str | None]:
    """``(class, variable)`` of the module holding ``tensors`` (or of the tensor itself) that the
    frames from ``frame`` outward, then ``__main__``, refer to; ``(None, None)`` when none does."""
    ids = {id(t) for t in tensors}
    namespaces: list[Mapping[str, Any]] = []
    depth = 0
    while frame is not None and depth < 40:
        namespaces.append(frame.f_locals)
        frame = frame.f_back
        depth += 1
    for name in ("__main__", "__mp_main__"):
        module = sys.modules.get(name)
        if module is not None:
            namespaces.append(vars(module))
    tensor_name: str | None = None
    for namespace in namespaces:
        for var, value in list(namespace.items()):
            if isinstance(value, torch.nn.Module):
                with contextlib.suppress(Exception):
                    if any(id(p) in ids for p in value.parameters()):
                        return type(value).__name__, var
            elif tensor_name is None and isinstance(value, torch.Tensor) and id(value) in ids:
                tensor_name = var
    return ("Tensor", tensor_name) if tensor_name else (None, None)


class SettingsProbe:
    """Watches what the audited script sets; writes it as JSON after each optimizer step and at exit.

    ``main``: the process the audit started (writes ``path``); otherwise a python child the
    script started, or a fork of a probed process, which writes ``runrecord.process_path(path, pid)``.
    """

    def __init__(self, path: str, *, main: bool = True) -> None:
        self.base_path = path
        self.path = path if main else str(runrecord.process_path(path, os.getpid()))
        self.disabled = False  # a DataLoader worker: writes nothing
        self.process: dict[str, Any] = {
            "pid": os.getpid(),
            "parent_pid": os.getppid(),
            "main": main,
            "target": None,
            "start_method": None,
            "argv": None if main else [str(a) for a in getattr(sys, "orig_argv", sys.argv)[:4]],
        }
        self.backward: Any = None  # the session's BackwardSteps (``steps``: backward steps begun)
        self._backward_base = 0
        self.started: list[dict[str, Any]] = []
        self.shared_modules: list[dict[str, Any]] = []
        self._shared_updates: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._holders: dict[tuple[int, ...], tuple[str | None, str | None]] = {}
        self._seq = 0  # this process's clock of starts, joins and shared updates
        self.start_seed = torch.initial_seed()
        self.start_env = {
            k: os.environ.get(k) for k in ("PYTHONHASHSEED", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
        }
        self.hash_randomization = bool(sys.flags.hash_randomization)
        self.set_num_threads_called = False
        self._loaders: list[tuple[Any, dict[str, Any]]] = []  # (weakref to the loader, its record)
        self.compile_calls: list[dict[str, Any]] = []
        self.optimizer_steps = 0
        self.calls: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.requested_deterministic: tuple[bool, bool] | None = None
        # the script's seeding: per global RNG, whether its last seeding used a value no other
        # unseeded source produced; and each seeding call whose value came from one
        self.seeded: dict[str, bool] = {}
        self.tainted_seeds: list[dict[str, Any]] = []
        self._drawn: dict[int, str] = {}  # values unseeded sources returned -> the source
        self._drawn_objects: dict[int, tuple[Any, str]] = {}  # id -> (int object returned, source)
        self._sites: dict[tuple[str, int], str] = {}  # (file, line) an unseeded source was called from
        self._wrapper_codes: set[Any] = set()
        self._switch_lines: set[tuple[str, int]] = set()  # (file, line) that set a switch
        self._probed: dict[int, tuple[Any, dict[str, Any]]] = {}  # id(dataset) -> (dataset, probe)

    def install(self) -> None:
        import torch.optim.optimizer as optim_mod
        import torch.utils.data as data_mod

        probe = self
        original_init = data_mod.DataLoader.__init__
        signature = inspect.signature(original_init)

        @functools.wraps(original_init)
        def init(loader: Any, *a: Any, **kw: Any) -> None:
            original_init(loader, *a, **kw)
            with contextlib.suppress(Exception):
                probe._record_loader(loader, signature.bind(loader, *a, **kw).arguments)

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

        torch.compile = compile_

        original_deterministic = torch.use_deterministic_algorithms

        @functools.wraps(original_deterministic)
        def use_deterministic_algorithms(mode: bool, *, warn_only: bool = False) -> None:
            # Record what the script asks for, but only warn: an op that raises under strict mode
            # (max_unpool, put_ on the CPU; many more on CUDA) must not stop the audit at the first.
            probe.requested_deterministic = (bool(mode), bool(warn_only))
            probe._switch_set(sys._getframe(1))
            original_deterministic(mode, warn_only=True)

        torch.use_deterministic_algorithms = use_deterministic_algorithms

        original_threads = torch.set_num_threads

        @functools.wraps(original_threads)
        def set_num_threads(n: int) -> None:
            probe.set_num_threads_called = True
            original_threads(n)

        torch.set_num_threads = set_num_threads  # type: ignore[assignment]

        def after_step(opt: Any, *_: Any) -> None:
            probe.optimizer_steps += 1
            with contextlib.suppress(Exception):
                params = [p for group in opt.param_groups for p in group["params"]]
                probe._note_shared_update(params, "optimizer", sys._getframe(1))
            probe.write()

        self._watch_calls()
        self._watch_seeding()
        self._watch_switches()
        self._watch_processes()
        self._watch_sharing()
        optim_mod.register_optimizer_step_post_hook(after_step)
        atexit.register(self.write)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)

    # --- switches set on lines that did not run -------------------------------------------------
    def _switch_set(self, frame: Any) -> None:
        """A determinism switch was set: note the user's line that set it."""
        with contextlib.suppress(Exception):
            user = user_frame(frame)
            if user is not None and len(self._switch_lines) < 10_000:
                self._switch_lines.add((user.f_code.co_filename, user.f_lineno))

    def _watch_switches(self) -> None:
        """Note the lines that set cuDNN's ``benchmark``/``allow_tf32``/``deterministic``, cuBLAS's
        ``allow_tf32``, the float32 matmul precision (and, in ``install``, the deterministic
        algorithms): the statements setting them that the script's source holds on other lines
        did not run (``_switch_statements``)."""
        probe = self
        cudnn_cls: Any = type(torch.backends.cudnn)
        for name in ("benchmark", "allow_tf32", "deterministic"):
            prop = cudnn_cls.__dict__.get(name)
            if prop is None or not hasattr(prop, "__set__"):
                continue

            class _Noted:
                def __init__(self, prop: Any) -> None:
                    self.prop = prop

                def __get__(self, obj: Any, objtype: Any = None) -> Any:
                    return self.prop.__get__(obj, objtype)

                def __set__(self, obj: Any, value: Any) -> None:
                    probe._switch_set(sys._getframe(1))
                    self.prop.__set__(obj, value)

            setattr(cudnn_cls, name, _Noted(prop))
        matmul_cls: Any = type(torch.backends.cuda.matmul)
        original_setattr = matmul_cls.__setattr__

        def setattr_(obj: Any, name: str, value: Any) -> Any:
            if name == "allow_tf32":
                probe._switch_set(sys._getframe(1))
            return original_setattr(obj, name, value)

        matmul_cls.__setattr__ = setattr_
        original_precision = torch.set_float32_matmul_precision

        @functools.wraps(original_precision)
        def set_float32_matmul_precision(precision: str) -> None:
            probe._switch_set(sys._getframe(1))
            original_precision(precision)

        torch.set_float32_matmul_precision = set_float32_matmul_precision

    def _user_files(self) -> list[str]:
        """The script and the modules imported from its directory tree (not installed packages,
        not torchrepro), as their code names them."""
        main = sys.modules.get("__main__")
        script = getattr(main, "__file__", None)
        if not isinstance(script, str):
            return []
        root = os.path.dirname(os.path.abspath(script)) + os.sep
        files = [script]
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if not isinstance(path, str) or not path.endswith(".py") or path == script:
                continue
            absolute = os.path.abspath(path)
            parts = absolute.split(os.sep)
            if (
                absolute.startswith(root)
                and not absolute.startswith(_TORCHREPRO_DIR)
                and "site-packages" not in parts
                and "dist-packages" not in parts
            ):
                files.append(path)
        return files[:200]

    def _switch_statements(self) -> list[dict[str, Any]]:
        """The switch statements of the user's files, each with whether it ran (its line set a
        switch in this process)."""
        out = []
        for filename in self._user_files():
            with contextlib.suppress(Exception):
                for statement in switch_statements(filename):
                    lines = range(statement["line"], statement["end_line"] + 1)
                    ran = any((filename, n) in self._switch_lines for n in lines)
                    record = {k: v for k, v in statement.items() if k not in ("line", "end_line")}
                    out.append({**record, "location": f"{shown(filename)}:{statement['line']}", "ran": ran})
        return out

    # --- processes ---------------------------------------------------------------------------
    def _tick(self) -> int:
        self._seq += 1
        return self._seq

    def _after_fork(self) -> None:
        """In a fork of a probed process: a process of its own, with a record of its own. What
        the parent set (seeds, switches) is inherited; what it counted and saw is not."""
        self.path = str(runrecord.process_path(self.base_path, os.getpid()))
        self.process = {
            "pid": os.getpid(),
            "parent_pid": os.getppid(),
            "main": False,
            "target": None,
            "start_method": "fork",
            "argv": None,
        }
        self.optimizer_steps = 0
        self._backward_base = getattr(self.backward, "steps", 0)
        self.compile_calls = []
        self._loaders = []
        self.calls = {}
        self.tainted_seeds = []
        self.started = []
        self.shared_modules = []
        self._shared_updates = {}
        self._seq = 0

    def _enter_process(self, process: Any) -> None:
        """A ``multiprocessing`` process begins its target here."""
        self.process["target"] = _target_name(
            getattr(process, "_target", None), getattr(process, "_args", ())
        )
        if not self.process.get("start_method"):
            self.process["start_method"] = getattr(process, "_start_method", None)

    def _watch_processes(self) -> None:
        """Note each ``multiprocessing`` process the script starts (where, which target, its pid,
        when it was joined), and write this process's record when one it runs ends: a process
        ``multiprocessing`` forked leaves with ``os._exit``, without ``atexit``."""
        import multiprocessing.process as mp_process

        probe = self
        cls: Any = mp_process.BaseProcess
        original_start = cls.start
        original_join = cls.join
        original_bootstrap = cls._bootstrap

        @functools.wraps(original_start)
        def start(process: Any) -> None:
            target = getattr(process, "_target", None)
            record: dict[str, Any] | None = None
            if getattr(target, "__module__", None) != _WORKER_MODULE and not probe.disabled:
                with contextlib.suppress(Exception):
                    args = tuple(getattr(process, "_args", ()))
                    record = {
                        "pid": None,
                        "location": _user_location(),
                        "target": _target_name(target, args),
                        "start_method": None,
                        "started": probe._tick(),
                        "joined": None,
                        "shared_args": probe._shared_args(args, getattr(process, "_kwargs", {})),
                    }
            original_start(process)
            if record is not None:
                record["pid"] = process.pid
                record["start_method"] = getattr(getattr(process, "_popen", None), "method", None)
                probe.started.append(record)
                process._torchrepro_started = record

        @functools.wraps(original_join)
        def join(process: Any, *a: Any, **kw: Any) -> None:
            original_join(process, *a, **kw)
            record = getattr(process, "_torchrepro_started", None)
            if record is not None and record["joined"] is None and process.exitcode is not None:
                record["joined"] = probe._tick()

        @functools.wraps(original_bootstrap)
        def bootstrap(process: Any, *a: Any, **kw: Any) -> Any:
            if getattr(getattr(process, "_target", None), "__module__", None) == _WORKER_MODULE:
                probe.disabled = True
                return original_bootstrap(process, *a, **kw)
            with contextlib.suppress(Exception):
                probe._enter_process(process)
            try:
                return original_bootstrap(process, *a, **kw)
            finally:
                probe.write()

        cls.start = start
        cls.join = join
        cls._bootstrap = bootstrap

    def _shared_args(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[str]:
        """The modules and tensors in shared memory among a process's arguments (by class)."""
        out = []
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.nn.Module) and _shared_cpu(value.parameters()):
                out.append(type(value).__name__)
            elif isinstance(value, torch.Tensor) and _shared_cpu([value]):
                out.append("Tensor")
        return out

    # --- shared memory -------------------------------------------------------------------------
    def _watch_sharing(self) -> None:
        """Note the script's ``share_memory()`` calls (on a module, or ``share_memory_()`` on a tensor)."""
        probe = self
        module_share = torch.nn.Module.share_memory
        tensor_share: Any = torch.Tensor.share_memory_

        def note(obj: Any, method: str, tensors: list[torch.Tensor]) -> None:
            frame = sys._getframe(2)
            if not is_user(frame) or len(probe.shared_modules) >= 100:
                return  # called by a library (a module sharing its tensors), not by the script
            location = _user_location()
            if any(m["location"] == location and m["_id"] == id(obj) for m in probe.shared_modules):
                return
            probe.shared_modules.append(
                {
                    "location": location,
                    "class": type(obj).__name__,
                    "variable": _receiver(frame, method),
                    "params": len(tensors),
                    "_id": id(obj),
                }
            )

        @functools.wraps(module_share)
        def share_memory(module: Any) -> Any:
            result = module_share(module)
            with contextlib.suppress(Exception):
                note(module, "share_memory", list(module.parameters()))
            return result

        @functools.wraps(tensor_share)
        def share_memory_(tensor: Any) -> Any:
            result = tensor_share(tensor)
            with contextlib.suppress(Exception):
                note(tensor, "share_memory_", [tensor])
            return result

        torch.nn.Module.share_memory = share_memory  # type: ignore[method-assign,assignment]
        torch.Tensor.share_memory_ = share_memory_  # type: ignore[method-assign]

    def _note_shared_update(self, tensors: Sequence[torch.Tensor], via: str, frame: Any) -> None:
        """A step updated ``tensors``: note the ones in shared memory, by the module holding them."""
        shared = _shared_cpu(tensors)
        if not shared:
            return
        key_ids = tuple(id(t) for t in shared[:8])
        holder = self._holders.get(key_ids)
        if holder is None:
            holder = self._holders[key_ids] = _holder(shared, user_frame(frame))
        key = (*holder, via)
        seq = self._tick()
        record = self._shared_updates.get(key)
        if record is None:
            if len(self._shared_updates) >= 20:
                return
            record = self._shared_updates[key] = {
                "module": holder[0],
                "variable": holder[1],
                "params": len(shared),
                "via": via,
                "steps": 0,
                "first": seq,
            }
        record["steps"] += 1
        record["last"] = seq

    def after_backward(self) -> None:
        """A ``backward()`` step ended (training no optimizer sees): note it and write."""
        with contextlib.suppress(Exception):
            trained = [t for _, t in getattr(self.backward, "_last", ())]
            self._note_shared_update(trained, "backward", sys._getframe(1))
        self.write()

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

        def scatter(a: Sequence[Any], kw: Mapping[str, Any]) -> dict[str, Any]:
            return {"reduce": kw["reduce"]} if "reduce" in kw else {}  # keyword-only in torch

        def loss(a: Sequence[Any], kw: Mapping[str, Any]) -> dict[str, Any]:
            reduction = pos(a, kw, 6, "reduction", "mean")
            return {"reduction": "none" if kw.get("reduce") is False else reduction}

        def embedding_bag(a: Sequence[Any], kw: Mapping[str, Any]) -> dict[str, Any]:
            return {"mode": pos(a, kw, 6, "mode", "mean")}

        for owner in (torch, torch.Tensor):
            wrap(owner, "cumsum", cumsum)
            wrap(owner, "bincount", bincount)
            wrap(owner, "scatter_reduce", scatter_reduce)
            wrap(owner, "scatter", scatter)
        wrap(torch.Tensor, "scatter_", scatter)
        wrap(torch.Tensor, "cumsum_", cumsum)
        wrap(torch.Tensor, "scatter_reduce_", scatter_reduce)
        wrap(fn, "nll_loss", loss)
        wrap(fn, "cross_entropy", loss)
        wrap(fn, "embedding_bag", embedding_bag)

    def _watch_seeding(self) -> None:
        """Wrap the seeding functions, and the unseeded sources a seed may be drawn from.

        Seeding: ``random.seed``, ``np.random.seed``, ``torch.manual_seed`` (the global RNGs),
        ``torch.Generator(...).manual_seed``/``.seed`` (``torch.Generator`` becomes a subclass
        whose instances pass every ``isinstance`` check and pickle as plain generators) and
        ``np.random.default_rng``. Sources: ``random.randint``/``randrange``/``getrandbits``/
        ``random`` before any ``random.seed``, ``np.random.randint`` likewise, ``secrets``,
        ``os.urandom``, ``torch.seed()``, the clock (``time.time``/``time_ns``) and the process
        id (``os.getpid``). A seed is tainted (TR305) when its value is an object such a source
        returned (by identity: never a small cached int), a value of 2**16 and up one returned
        (so a small constant is never mistaken for one), the clock (within an hour of now, in
        s, ms, us or ns), ``seed()`` from OS entropy, or, read from the script's own source
        (``_child.sources``), an expression that called such a source on a line where the probe
        saw it called unseeded. A global seeding call counts as seeding its RNG when untainted;
        calls made while a DataLoader fetches (a dataset seeding itself per index) do not count.
        """
        import random
        import secrets
        import time

        probe = self
        numpy = _numpy()

        def unseeded_source(
            owner: Any,
            name: str,
            source: str,
            rng: str | None,
            to_int: Any = None,
            *,
            user_only: bool = False,
        ) -> None:
            original = getattr(owner, name, None)
            if original is None:
                return

            @functools.wraps(original)
            def wrapper(*a: Any, **kw: Any) -> Any:
                value = original(*a, **kw)
                if rng is None or not probe.seeded.get(rng):
                    with contextlib.suppress(Exception):
                        probe._drawn_from(source, value, sys._getframe(1), to_int, user_only=user_only)
                return value

            wrapper._torchrepro_source = source  # type: ignore[attr-defined]
            probe._wrapper_codes.add(_code(wrapper))
            setattr(owner, name, wrapper)

        def ints(value: Any) -> list[int]:
            return [int(value)]

        def from_bytes(value: Any) -> list[int]:
            return [int.from_bytes(value, "big"), int.from_bytes(value, "little")] if len(value) <= 8 else []

        def seeding(owner: Any, name: str, rng: str, what: str) -> None:
            original = getattr(owner, name)

            @functools.wraps(original)
            def wrapper(*a: Any, **kw: Any) -> Any:
                value = a[0] if a else next(iter(kw.values()), None)
                with contextlib.suppress(Exception):
                    if not _in_loader_fetch():
                        probe._on_seed(rng, what, value, sys._getframe(1))
                return original(*a, **kw)

            setattr(owner, name, wrapper)

        for name in ("randint", "randrange", "getrandbits"):
            unseeded_source(random, name, f"random.{name}", "random", ints)
        unseeded_source(random, "random", "random.random", "random")
        for name in ("randbits", "randbelow"):
            unseeded_source(secrets, name, f"secrets.{name}", None, ints)
        unseeded_source(os, "urandom", "os.urandom", None, from_bytes)
        unseeded_source(torch, "seed", "torch.seed()", None, ints)
        # called by libraries all the time: noted only where the script calls them
        unseeded_source(time, "time", "time.time", None, user_only=True)
        unseeded_source(time, "time_ns", "time.time_ns", None, user_only=True)
        unseeded_source(os, "getpid", "os.getpid", None, user_only=True)
        entropy_seed = torch.seed

        @functools.wraps(entropy_seed)
        def torch_seed() -> int:
            probe.seeded["torch"] = False  # torch.seed() seeds from OS entropy
            return entropy_seed()

        torch.seed = torch_seed
        self._wrapper_codes.add(_code(torch_seed))
        seeding(random, "seed", "random", "random.seed")
        seeding(torch, "manual_seed", "torch", "torch.manual_seed")
        self._watch_generators()
        if numpy is not None:
            unseeded_source(
                numpy.random, "randint", "np.random.randint", "numpy", lambda v: numpy.ravel(v)[:1]
            )
            seeding(numpy.random, "seed", "numpy", "np.random.seed")
            default_rng = numpy.random.default_rng

            @functools.wraps(default_rng)
            def default_rng_(*a: Any, **kw: Any) -> Any:
                value = a[0] if a else kw.get("seed")
                with contextlib.suppress(Exception):
                    frame = sys._getframe(1)
                    if value is not None and is_user(frame):  # None: OS entropy, TR306's
                        probe._on_seed("numpy_generator", "np.random.default_rng", value, frame)
                return default_rng(*a, **kw)

            numpy.random.default_rng = default_rng_

    def _watch_generators(self) -> None:
        """Make ``torch.Generator(...)`` a subclass instance whose seeding the probe notes.

        ``torch._C.Generator`` is a C type (its methods cannot be replaced), so ``torch.Generator``
        becomes a subclass: ``isinstance(x, torch.Generator)`` still holds for every generator
        (torch's own default ones included), every op and ``DataLoader(generator=...)`` takes it,
        and it pickles (``torch.save``) as a plain ``torch.Generator``. Only seeding called
        from the script's own code is noted (not torch's samplers seeding theirs).
        """
        base: Any = torch.Generator
        probe = self

        class _Meta(type(base)):  # type: ignore[misc]
            def __instancecheck__(cls, obj: Any) -> bool:
                return isinstance(obj, base)

            def __subclasscheck__(cls, sub: Any) -> bool:
                return issubclass(sub, base)

        def note(value: Any, what: str) -> None:
            with contextlib.suppress(Exception):
                frame = sys._getframe(2)
                if is_user(frame):
                    probe._on_seed("generator", what, value, frame)

        class Generator(base, metaclass=_Meta):  # type: ignore[misc]
            __doc__ = base.__doc__

            def manual_seed(self, seed: Any) -> Any:
                note(seed, "torch.Generator().manual_seed")
                return super().manual_seed(seed)

            def seed(self) -> Any:
                note(None, "torch.Generator().seed")
                return super().seed()

            def __reduce__(self) -> Any:
                reduced = super().__reduce__()
                return (base, *reduced[1:])

        Generator.__module__ = base.__module__
        Generator.__qualname__ = Generator.__name__ = "Generator"
        torch.Generator = Generator  # type: ignore[misc]

    def _drawn_from(self, source: str, value: Any, frame: Any, to_int: Any, *, user_only: bool) -> None:
        """An unseeded source returned ``value`` to ``frame``'s line: note the line (for the
        source tracing of ``_child.sources``), the object (by identity), and large values."""
        import numbers

        while frame is not None and frame.f_code in self._wrapper_codes:
            frame = frame.f_back  # a wrapper of ours calling another
        if frame is None or frame.f_code.co_filename == __file__ or (user_only and not is_user(frame)):
            return  # the probe's own call, or (the clock, the pid) a library's
        if len(self._sites) < 10_000:
            self._sites.setdefault((frame.f_code.co_filename, frame.f_lineno), source)
        small = isinstance(value, int) and -5 <= value <= 256  # cached: one object for every 42
        if isinstance(value, numbers.Integral) and not small and len(self._drawn_objects) < 10_000:
            self._drawn_objects.setdefault(id(value), (value, source))
        if to_int is not None and len(self._drawn) < 10_000:
            for v in to_int(value):
                if abs(v) >= 2**16:  # a small constant seed (0, 42) is never taken for one
                    self._drawn.setdefault(v, source)

    def _confirmed(self, filename: str, first: int, last: int, source: str) -> bool:
        return any(self._sites.get((filename, line)) == source for line in range(first, last + 1))

    def _on_seed(self, rng: str, what: str, value: Any, frame: Any = None) -> None:
        """A seeding call (``rng``: ``random``, ``numpy``, ``torch`` for the global RNGs, else a
        generator's kind) with ``value``, made from ``frame``'s line."""
        import operator
        import time

        if value is None:
            source: str | None = "OS entropy (called without a seed)"
        else:
            try:
                number = operator.index(value)
            except TypeError:
                number = None
            drawn = self._drawn_objects.get(id(value))
            source = drawn[1] if drawn is not None and drawn[0] is value else None
            if source is None and number is not None:
                source = self._drawn.get(number)
            if number is not None and source is None and number > 10**9:
                # the clock in seconds, milliseconds or nanoseconds, within an hour of now
                now = time.time()
                if any(abs(number / scale - now) < 3600 for scale in (1, 10**3, 10**6, 10**9)):
                    source = "the current time"
            if source is None and frame is not None and is_user(frame):  # the script's own call
                with contextlib.suppress(Exception):
                    source = seed_source(frame, self._confirmed)
        if rng in _GLOBAL_RNGS:
            self.seeded[rng] = source is None
        if source is not None and len(self.tainted_seeds) < 100:
            location, framework = user_site()
            record = {
                "call": what,
                "rng": rng,
                "location": location,
                "source": source,
                "framework": framework,
            }
            if record not in self.tainted_seeds:
                self.tainted_seeds.append(record)

    def _record_loader(self, loader: Any, arguments: Mapping[str, Any]) -> None:
        import weakref

        seeded = any(
            c.__name__ == "SeededLoader" and c.__module__.startswith("torchrepro")
            for c in type(loader).__mro__
        )
        given = "batch_sampler" if arguments.get("batch_sampler") is not None else None
        given = "sampler" if arguments.get("sampler") is not None else given
        location, framework = user_site()
        dataset = loader.dataset
        probe: dict[str, Any] = {"ran": False, "reason": "a SeededLoader seeds every sample"}
        earlier = self._probed.get(id(dataset))
        if seeded:
            pass
        elif earlier is not None and earlier[0] is dataset:
            probe = earlier[1]
        else:
            probe = _probe_dataset(dataset)
            self._probed[id(dataset)] = (dataset, probe)
        record = {
            "location": location,
            "framework": framework,
            "class": type(loader).__name__,
            "dataset": type(dataset).__name__,
            "seeded_loader": seeded,
            "num_workers": int(loader.num_workers),
            "worker_init_fn": loader.worker_init_fn is not None,
            "generator": loader.generator is not None,
            "sampler_given": given,
            **_sampler_facts(loader, given),
            "probe": probe,
            "random_hint": _random_hint(dataset),
        }
        # a framework rebuilding a loader over the same dataset from the same user line (the HF
        # Trainer, then accelerate's prepare) replaces the earlier record: one loader, one finding
        for i, (_, old) in enumerate(self._loaders):
            if old["location"] == location and old.get("_dataset") == id(dataset) and not seeded:
                del self._loaders[i]
                break
        record["_dataset"] = id(dataset)
        self._loaders.append((weakref.ref(loader), record))

    def _loader_records(self) -> list[dict[str, Any]]:
        """The loaders' records, their sampler facts read now: a framework may swap the sampler
        after creating the loader (accelerate's ``set_sampler``)."""
        out = []
        for ref, record in self._loaders:
            loader = ref()
            if loader is not None:
                with contextlib.suppress(Exception):
                    record.update(_sampler_facts(loader, record["sampler_given"]))
            out.append({k: v for k, v in record.items() if not k.startswith("_")})
        return out

    def snapshot(self) -> ProbeSettings:
        """What the probe has seen so far."""
        inductor = sys.modules.get("torch._inductor.config")
        flags = DeterminismFlags.capture()
        deterministic, warn_only = flags.deterministic_algorithms, flags.warn_only
        if self.requested_deterministic is not None and self.requested_deterministic[0] == deterministic:
            warn_only = self.requested_deterministic[1]  # the probe turned a strict request into warn-only
        return ProbeSettings(
            hash_randomization=self.hash_randomization,
            pythonhashseed=self.start_env["PYTHONHASHSEED"],
            cublas_workspace_config=flags.cublas_workspace_config,
            deterministic_algorithms=deterministic,
            warn_only=warn_only,
            cudnn_benchmark=flags.cudnn_benchmark,
            cudnn_deterministic=flags.cudnn_deterministic,
            cudnn_allow_tf32=flags.cudnn_allow_tf32,
            cuda_matmul_allow_tf32=flags.cuda_matmul_allow_tf32,
            float32_matmul_precision=flags.float32_matmul_precision,
            num_threads=torch.get_num_threads(),
            set_num_threads_called=self.set_num_threads_called,
            thread_env={k: v for k, v in self.start_env.items() if k != "PYTHONHASHSEED"},
            torch_seeded=torch.initial_seed() != self.start_seed,
            seeded={
                "random": self.seeded.get("random", False),
                "numpy": self.seeded.get("numpy", False),
                "torch": torch.initial_seed() != self.start_seed and self.seeded.get("torch", True),
            },
            tainted_seeds=tuple(self.tainted_seeds),
            inductor_deterministic=getattr(inductor, "deterministic", None) if inductor else None,
            compile_calls=tuple(self.compile_calls),
            dataloaders=tuple(self._loader_records()),
            optimizer_steps=self.optimizer_steps,
            calls=tuple(self.calls.values()),
            cuda_initialized=cuda_started(),
            backward_steps=max(0, getattr(self.backward, "steps", 0) - self._backward_base),
            process=dict(self.process),
            started=tuple(dict(r) for r in self.started),
            shared_modules=tuple(
                {k: v for k, v in m.items() if not k.startswith("_")} for m in self.shared_modules
            ),
            shared_updates=tuple(dict(u) for u in self._shared_updates.values()),
            switch_statements=tuple(self._switch_statements()),
        )

    def write(self) -> None:
        if self.disabled:
            return
        with contextlib.suppress(Exception):
            atomic_write_json(self.path, self.snapshot().to_dict())


_installed: SettingsProbe | None = None


def install_probe(path: str, *, main: bool = True) -> SettingsProbe:
    """Install the audit's probe in this process, once (a later call returns the one installed:
    a python child installs it before its parent's ``__main__`` is imported again, and its
    session finds it then)."""
    global _installed
    if _installed is None:
        probe = SettingsProbe(path, main=main)
        probe.install()
        _installed = probe
    return _installed


def installed_probe() -> SettingsProbe | None:
    """The probe installed in this process (inherited by a fork), or None."""
    return _installed
