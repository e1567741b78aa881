"""Every patch the child installs on torch or the standard library, in one place.

Invariants:
- Only the child process installs these (``_child.bootstrap``), once, before the user's script
  runs; importing this module patches nothing.
- Every wrapper calls through to the original unchanged (same arguments, same result), and only
  reads tensors: recording changes nothing the script computes. Two exceptions, both asked for:
  ``--vary workers`` changes the ``num_workers`` a DataLoader is created with, and the audit's
  probe applies ``use_deterministic_algorithms`` with ``warn_only=True`` (it records the request).
- Recording hooks: ``torch.optim.Optimizer.__init__`` (an ``init`` event), the global optimizer
  step post-hook (a ``compute`` event), ``DataLoader.__iter__`` and ``_BaseDataLoaderIter.__next__``
  (a ``data`` event per batch, fetched with any op tracer paused).
- The audit's settings probe (``SettingsProbe``) wraps ``DataLoader.__init__``, ``torch.compile``,
  ``torch.use_deterministic_algorithms``, ``torch.set_num_threads`` and the few functions whose
  arguments decide an op-table condition.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torchrepro import recorder as _recorder
from torchrepro._io import atomic_write_json
from torchrepro.flags import DeterminismFlags
from torchrepro.recorder import Recorder

__all__ = ["InitCallback", "SettingsProbe", "StepCallback", "install_hooks", "worker_mapping"]


def worker_mapping(spec: str | None) -> Callable[[int], int] | None:
    """The ``num_workers`` mapping of a ``ChildSpec.num_workers`` value (None: unchanged)."""
    if not spec:
        return None
    if spec == "other":
        return lambda n: 0 if n > 0 else 2
    fixed = int(spec)
    return lambda n: fixed


StepCallback = Callable[[torch.optim.Optimizer, int, int], None]
"""Called after every recorded optimizer step with (optimizer, optimizer index, step index)."""

InitCallback = Callable[[torch.optim.Optimizer, int], None]
"""Called after an optimizer is created with (optimizer, optimizer index)."""


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def install_hooks(
    recorder: Recorder | None,
    *,
    num_workers: Callable[[int], int] | None = None,
    on_vary: Callable[[int, int], None] | None = None,
    on_init: InitCallback | None = None,
    on_step: StepCallback | None = None,
) -> None:
    """Install the process-global recording hooks (the bootstrap calls this once per process).

    ``recorder`` receives the events (None: only the callbacks run). ``num_workers`` maps the
    ``num_workers`` every DataLoader is created with to the value actually used (``--vary
    workers``), and ``on_vary(original, used)`` hears of each DataLoader it changed (a loader
    rebuilt from one it changed is not counted again). ``on_init``/``on_step`` run after the
    recorder's own event is written.
    """
    _recorder.activate(recorder)
    optim_cls = torch.optim.Optimizer
    original_init = optim_cls.__init__

    def init_wrapper(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if hasattr(self, "_torchrepro_index"):
            return
        index = recorder.n_optimizers if recorder is not None else _counter("optim")
        if recorder is not None:
            recorder.n_optimizers += 1
            recorder.optimizer_steps[index] = 0
        self._torchrepro_index = index  # type: ignore[attr-defined]
        if recorder is not None:
            recorder.write("init", f"optimizer{index}", 0, _params(self))
        if on_init is not None:
            on_init(self, index)

    optim_cls.__init__ = init_wrapper  # type: ignore[method-assign]

    def step_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        index: int = getattr(opt, "_torchrepro_index", 0)
        if recorder is not None:
            step = recorder.optimizer_steps.get(index, 0)
            recorder.optimizer_steps[index] = step + 1
            recorder.write("compute", f"optimizer{index}", step, _params(opt))
        else:
            step = _counter(f"step{index}")
        if on_step is not None:
            on_step(opt, index, step)

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(step_hook)

    from torch.utils.data import dataloader as dl

    if num_workers is not None:
        _patch_num_workers(dl.DataLoader, num_workers, on_vary)
    _patch_loader_iteration(dl, recorder)


_counters: dict[str, int] = {}


def _counter(name: str) -> int:
    value = _counters.get(name, 0)
    _counters[name] = value + 1
    return value


def _patch_num_workers(
    loader_cls: type, mapping: Callable[[int], int], on_vary: Callable[[int, int], None] | None = None
) -> None:
    """Make every DataLoader load with ``mapping(num_workers)`` workers.

    A loader built over a dataset an earlier loader already varied keeps that loader's varied
    count: frameworks rebuild a loader from the varied one (``accelerator.prepare`` passes its
    ``num_workers`` on), and mapping again would undo the variation (2 -> 0 -> 2).
    """
    original_init = loader_cls.__init__  # type: ignore[misc]
    signature = inspect.signature(original_init)
    varied: dict[int, tuple[object, int]] = {}  # id(dataset) -> (dataset, its varied count)

    def init_wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        dataset = arguments.get("dataset")
        earlier = varied.get(id(dataset))
        if earlier is not None and earlier[0] is dataset:
            new = earlier[1]
        else:
            original = int(arguments.get("num_workers", 0) or 0)
            new = mapping(original)
            varied[id(dataset)] = (dataset, new)
            if on_vary is not None:
                on_vary(original, new)
        arguments["num_workers"] = new
        if new == 0:
            arguments["prefetch_factor"] = None
            arguments["persistent_workers"] = False
        original_init(*bound.args, **bound.kwargs)

    loader_cls.__init__ = init_wrapper  # type: ignore[misc]


def _patch_loader_iteration(dl: Any, recorder: Recorder | None) -> None:
    loader_cls = dl.DataLoader
    iter_cls = dl._BaseDataLoaderIter
    original_iter = loader_cls.__iter__
    original_next = iter_cls.__next__

    def iter_wrapper(self: Any) -> Any:
        with _recorder.paused():
            it = original_iter(self)
        key = self.__dict__.get("_torchrepro_loader")
        if key is None and recorder is not None:
            key = recorder.n_loaders
            recorder.n_loaders += 1
            recorder.loader_batches[key] = 0
            object.__setattr__(self, "_torchrepro_loader", key)
        it._torchrepro_loader = key
        return it

    def next_wrapper(self: Any) -> Any:
        with _recorder.paused():
            batch = original_next(self)
        key = self.__dict__.get("_torchrepro_loader")
        if key is not None and recorder is not None:
            index = recorder.loader_batches.get(key, 0)
            recorder.loader_batches[key] = index + 1
            recorder.write("data", f"loader{key}", index, batch)
        return batch

    loader_cls.__iter__ = iter_wrapper
    iter_cls.__next__ = next_wrapper


# --------------------------------------------------------------------------------------------
# The audit's settings probe


def _user_location() -> str | None:
    """``file:line`` of the innermost caller outside torch, torchrepro and the standard library."""
    skip = tuple(
        os.path.normcase(os.path.dirname(os.path.abspath(f))) + os.sep
        for f in (torch.__file__, os.path.dirname(__file__), os.__file__)
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


class SettingsProbe:
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

        torch.compile = compile_

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
        flags = DeterminismFlags.capture()
        deterministic, warn_only = flags.deterministic_algorithms, flags.warn_only
        if self.requested_deterministic is not None and self.requested_deterministic[0] == deterministic:
            warn_only = self.requested_deterministic[1]  # the probe turned a strict request into warn-only
        return {
            "hash_randomization": self.hash_randomization,
            "pythonhashseed": self.start_env["PYTHONHASHSEED"],
            "cublas_workspace_config": flags.cublas_workspace_config,
            "deterministic_algorithms": deterministic,
            "warn_only": warn_only,
            "cudnn_benchmark": flags.cudnn_benchmark,
            "cudnn_deterministic": flags.cudnn_deterministic,
            "cudnn_allow_tf32": flags.cudnn_allow_tf32,
            "matmul_allow_tf32": flags.cuda_matmul_allow_tf32,
            "float32_matmul_precision": flags.float32_matmul_precision,
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
