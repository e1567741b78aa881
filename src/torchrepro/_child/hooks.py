"""Every recording patch the child installs on torch, in one place (the audit's probe: ``_child.probe``).

Invariants:
- Only the child process installs these (``_child.bootstrap``), once, before the user's script
  runs; importing this module patches nothing.
- Every wrapper calls through to the original unchanged (same arguments, same result), and only
  reads tensors: recording changes nothing the script computes. One exception, asked for:
  ``--vary workers`` changes the ``num_workers`` a DataLoader is created with.
- Recording hooks: ``torch.optim.Optimizer.__init__`` (an ``init`` event), the global optimizer
  step post-hook (a ``compute`` event: gradients, optimizer state, parameters, each named),
  ``torch.autograd.backward`` (steps of training no optimizer sees: ``_child.training``),
  ``DataLoader.__init__`` (where the script created it), ``DataLoader.__iter__`` and
  ``_BaseDataLoaderIter.__next__`` (a ``data`` event per batch, fetched with any op tracer paused).
- ``install_world_hook``: ``init_process_group`` reports (rank, world size) after it returns.
- User locations are found by ``torchrepro._frames`` (the walker op tracing uses too): they skip
  torch, torchrepro, the standard library and the frameworks' packages (Lightning, transformers,
  accelerate), so the line shown is the user's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torchrepro import recorder as _recorder
from torchrepro._child.training import BackwardSteps, ParamNames, optimizer_items
from torchrepro._frames import user_site
from torchrepro.events import optimizer_key
from torchrepro.recorder import Recorder

__all__ = [
    "BackwardCallback",
    "InitCallback",
    "PreStepCallback",
    "StepCallback",
    "install_hooks",
    "install_world_hook",
    "worker_mapping",
]


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

PreStepCallback = Callable[[torch.optim.Optimizer, int, int, Callable[[], list[tuple[str, Any]]]], None]
"""Called before every optimizer step with (optimizer, optimizer index, index of the step about to
run, a function returning the optimizer's named gradients, state and parameters as they are)."""

InitCallback = Callable[[torch.optim.Optimizer, int], None]
"""Called after an optimizer is created with (optimizer, optimizer index)."""

BackwardCallback = Callable[[int, bool], None]
"""Called around every ``backward()`` step (training no optimizer sees) with (step index, ended):
before the step runs (``ended`` False: steps 0..k-1 are complete) and after its backward."""


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


class _Owned:
    """The parameters some optimizer holds, by identity (tensors compare elementwise, not by id)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}

    def add(self, params: list[torch.Tensor]) -> None:
        for p in params:
            with contextlib.suppress(TypeError):
                self._refs[id(p)] = weakref.ref(p)

    def __call__(self, p: torch.Tensor) -> bool:
        ref = self._refs.get(id(p))
        return ref is not None and ref() is p


def install_hooks(
    recorder: Recorder | None,
    *,
    num_workers: Callable[[int], int] | None = None,
    on_vary: Callable[[int, int], None] | None = None,
    on_init: InitCallback | None = None,
    on_step: StepCallback | None = None,
    on_backward: BackwardCallback | None = None,
    on_pre_step: PreStepCallback | None = None,
) -> BackwardSteps:
    """Install the process-global recording hooks (the bootstrap calls this once per process).

    ``recorder`` receives the events (None: only the callbacks run). ``num_workers`` maps the
    ``num_workers`` every DataLoader is created with to the value actually used (``--vary
    workers``), and ``on_vary(original, used)`` hears of each DataLoader it changed (a loader
    rebuilt from one it changed is not counted again). ``on_init``/``on_step``/``on_backward``
    run after the recorder's own event is written; ``on_pre_step`` before each optimizer step.
    Returns the ``backward()`` step watcher (its
    ``flush()`` writes the last hand-written update at exit).
    """
    _recorder.activate(recorder)
    names = ParamNames()
    owned = _Owned()
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
        params = _params(self)
        owned.add(params)
        if recorder is not None:
            named = optimizer_items(self, names.names(params, sys._getframe(1)), with_state=False)
            recorder.write("init", optimizer_key(index), 0, named, named=True)
        if on_init is not None:
            on_init(self, index)

    optim_cls.__init__ = init_wrapper  # type: ignore[method-assign]

    def step_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        index: int = getattr(opt, "_torchrepro_index", 0)
        if recorder is not None:
            step = recorder.optimizer_steps.get(index, 0)
            recorder.optimizer_steps[index] = step + 1
            params = _params(opt)
            owned.add(params)  # a param group added since
            items = optimizer_items(opt, names.names(params, sys._getframe(1)))
            recorder.write("compute", optimizer_key(index), step, items, named=True)
        else:
            step = _counter(f"step{index}")
        if on_step is not None:
            on_step(opt, index, step)

    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_post_hook(step_hook)

    if on_pre_step is not None:
        callback = on_pre_step

        def pre_step_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            index: int = getattr(opt, "_torchrepro_index", 0)
            step = recorder.optimizer_steps.get(index, 0) if recorder is not None else 0
            frame = sys._getframe(1)

            def items() -> list[tuple[str, Any]]:
                return optimizer_items(opt, names.names(_params(opt), frame))

            callback(opt, index, step, items)

        register_optimizer_step_pre_hook(pre_step_hook)

    def backward_started(k: int) -> None:
        if on_backward is not None:
            on_backward(k, False)

    def backward_ended(k: int) -> None:
        if recorder is not None:
            recorder.backward_steps = k + 1
        if on_backward is not None:
            on_backward(k, True)

    steps = BackwardSteps(recorder, names, owned, on_step=backward_started, on_step_end=backward_ended)
    if recorder is not None or on_backward is not None:
        steps.install()

    from torch.utils.data import dataloader as dl

    if num_workers is not None:
        _patch_num_workers(dl.DataLoader, num_workers, on_vary)
    _patch_loader_iteration(dl, recorder)
    return steps


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
    original_init = loader_cls.__init__
    original_iter = loader_cls.__iter__
    original_next = iter_cls.__next__

    created: dict[int, tuple[object, str | None]] = {}  # id(dataset) -> (dataset, first loader's line)

    @functools.wraps(original_init)
    def init_wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if recorder is None or "_torchrepro_src" in self.__dict__:
            return
        source, framework = user_site(outer=False)
        # a SeededLoader's dataset is a view: the user's dataset identifies the loader
        dataset = getattr(self, "source_dataset", None)
        if dataset is None:
            dataset = self.__dict__.get("dataset")
        earlier = created.get(id(dataset))
        if earlier is not None and earlier[0] is dataset:
            if framework is not None or source is None:
                source = earlier[1]  # a framework rebuilding the script's loader: the script's line
        elif dataset is not None:
            created[id(dataset)] = (dataset, source)
        object.__setattr__(self, "_torchrepro_src", source)

    def loader_key(loader: Any) -> int | None:
        """The number of ``loader`` in the run's data events (given at its first pass)."""
        key: int | None = loader.__dict__.get("_torchrepro_loader")
        if key is None and recorder is not None:
            key = recorder.n_loaders
            recorder.n_loaders += 1
            recorder.loader_batches[key] = 0
            object.__setattr__(loader, "_torchrepro_loader", key)
        return key

    def record_batch(key: int | None, source: str | None, batch: Any) -> None:
        if key is not None and recorder is not None:
            index = recorder.loader_batches.get(key, 0)
            recorder.loader_batches[key] = index + 1
            recorder.write("data", f"loader{key}", index, batch, source=source)

    def iter_wrapper(self: Any) -> Any:
        with _recorder.paused():
            it = original_iter(self)
        # A loader whose torch iterator moves something else than the batches (a streamed
        # SeededLoader's shards) records the batches its own iterator delivers (below).
        own = getattr(type(self), "_tr_batches_elsewhere", False)
        it._torchrepro_loader = None if own else loader_key(self)
        it._torchrepro_src = self.__dict__.get("_torchrepro_src")
        return it

    def next_wrapper(self: Any) -> Any:
        with _recorder.paused():
            batch = original_next(self)
        record_batch(self.__dict__.get("_torchrepro_loader"), self.__dict__.get("_torchrepro_src"), batch)
        return batch

    loader_cls.__init__ = init_wrapper
    loader_cls.__iter__ = iter_wrapper
    iter_cls.__next__ = next_wrapper

    from torchrepro.data import loader as seeded

    original_seeded_next = seeded.SeededLoaderIter.__next__

    def seeded_next_wrapper(self: Any) -> Any:
        with _recorder.paused():
            batch = original_seeded_next(self)
        loader = self._loader
        if getattr(type(loader), "_tr_batches_elsewhere", False):
            record_batch(loader_key(loader), loader.__dict__.get("_torchrepro_src"), batch)
        return batch

    seeded.SeededLoaderIter.__next__ = seeded_next_wrapper  # type: ignore[method-assign]


def install_world_hook(on_join: Callable[[int, int], None]) -> None:
    """Call ``on_join(rank, world_size)`` after every ``torch.distributed.init_process_group``
    (so the ranks a script starts itself are known, recorded or not)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d

    original = distributed_c10d.init_process_group
    if getattr(original, "_torchrepro_world_hook", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        on_join(dist.get_rank(), dist.get_world_size())
        return result

    init_process_group._torchrepro_world_hook = True  # type: ignore[attr-defined]
    distributed_c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group
