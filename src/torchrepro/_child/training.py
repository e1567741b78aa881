"""What the recorder sees of training: named parameters, gradients, optimizer state, backward() steps.

Invariants:
- Every tensor of an ``init`` or ``compute`` event is named: ``param:<name>``, ``grad:<name>`` or
  ``state:<name>:<key>``, where ``<name>`` is the parameter's path in the module that holds it
  (``encoder.layer.0.attn.q.weight``), found among the modules the calling frames and
  ``__main__`` refer to (a wrapper's ``.module`` or a compiled module's ``_orig_mod`` unwrapped);
  a parameter found in none is ``#<i>``, its position in the event. Names are looked up once per
  parameter (a cache checked by identity), never from an object's ``repr``. When two separate
  models in scope have a parameter of the same path (a GAN's ``netG`` and ``netD`` both with
  ``main.0.weight``), the path starts with the variable that holds the model
  (``netD.main.0.weight``), so every name says which object it is.
- An optimizer step's ``compute`` event holds, in this order, the gradients the step used, the
  optimizer's state after it, and the parameters after it: the first differing tensor names the
  earliest cause (a gradient that the update rounded away is still a divergence at that step).
- Training that no ``torch.optim.Optimizer`` sees is recorded per ``backward()``: the leaves of
  the graph that no optimizer holds are the trained tensors. At the first such backward an
  ``init`` event (key ``backward``) holds their values; after backward ``k`` a ``compute`` event
  (key ``backward``, step ``k``) holds their gradients; at backward ``k+1`` (or at exit) a second
  one holds their values, i.e. the parameters after step ``k``'s hand-written update.
- A ``backward()`` inside another (reentrant checkpointing) or on another thread is not a step.
- Watching only reads tensors; it changes nothing the script computes.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from torchrepro.events import BACKWARD_KEY
from torchrepro.recorder import Recorder, freed

__all__ = ["BackwardSteps", "ParamNames", "optimizer_items"]

_WRAPPER_ATTRS = ("module", "_orig_mod")
_HOLDER_ATTRS = ("model", "module", "net", "network", "model_wrapped")
_FRAMES = 40


def _module_candidates(frame: types.FrameType | None) -> Iterator[tuple[str, torch.nn.Module]]:
    """Modules the frames from ``frame`` outward and ``__main__`` refer to (one attribute deep),
    each with the variable that holds it (``netD``, ``trainer.model``)."""
    seen: set[int] = set()

    def found(name: str, value: Any) -> Iterator[tuple[str, torch.nn.Module]]:
        held = (
            []
            if isinstance(value, type)
            else [(f"{name}.{a}", getattr(value, a, None)) for a in _HOLDER_ATTRS]
        )
        for label, obj in ((name, value), *held):
            if isinstance(obj, torch.nn.Module) and id(obj) not in seen:
                seen.add(id(obj))
                yield label, obj

    depth = 0
    while frame is not None and depth < _FRAMES:
        for name, value in list(frame.f_locals.items()):
            yield from found(name, value)
        frame = frame.f_back
        depth += 1
    main = sys.modules.get("__main__")
    if main is not None:
        for name, value in list(vars(main).items()):
            yield from found(name, value)


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The module a wrapper (DDP, DataParallel, a compiled module) holds, with the same parameters."""
    for _ in range(4):
        inner = next(
            (
                getattr(module, a)
                for a in _WRAPPER_ATTRS
                if isinstance(getattr(module, a, None), torch.nn.Module)
            ),
            None,
        )
        if inner is None or sum(1 for _ in inner.parameters()) != sum(1 for _ in module.parameters()):
            break
        module = inner
    return module


class ParamNames:
    """Parameter names, looked up among the modules the caller's frames refer to; cached."""

    def __init__(self) -> None:
        self._names: dict[int, tuple[weakref.ref[torch.Tensor], str | None, int]] = {}
        """id -> (the parameter, its name or None when none was found, its position)."""

    def _entry(self, p: torch.Tensor) -> tuple[weakref.ref[torch.Tensor], str | None, int] | None:
        entry = self._names.get(id(p))
        return entry if entry is not None and entry[0]() is p else None

    def _cached(self, p: torch.Tensor) -> str | None:
        entry = self._entry(p)
        return None if entry is None else entry[1]

    def position(self, p: torch.Tensor) -> int:
        """Where ``p`` comes in its module's ``named_parameters()`` (after every named one if unnamed)."""
        entry = self._entry(p)
        return entry[2] if entry is not None else 1 << 62

    def names(self, params: Sequence[torch.Tensor], frame: types.FrameType | None) -> list[str]:
        """The name of each of ``params`` (``#<i>`` where none is found)."""
        missing = {id(p): p for p in params if self._entry(p) is None}
        if missing:
            self._search(missing, frame)
            for p in missing.values():  # looked for once: not again at every step
                with contextlib.suppress(TypeError):
                    self._names[id(p)] = (weakref.ref(p), None, 1 << 62)
        return [self._cached(p) or f"#{i}" for i, p in enumerate(params)]

    def _search(self, missing: dict[int, torch.Tensor], frame: types.FrameType | None) -> None:
        try:
            candidates = [(label, _unwrap(m)) for label, m in _module_candidates(frame)]
        except Exception:  # an object whose attribute access fails: names are a courtesy
            return
        # The root model holds the most parameters: its paths are the ones people read.
        candidates.sort(key=lambda c: -sum(1 for _ in c[1].parameters()))
        prefixes = _prefixes(candidates)
        for _, module in candidates:
            prefix = prefixes.get(id(module), "")
            for position, (name, p) in enumerate(module.named_parameters()):
                if missing.get(id(p)) is p:
                    try:
                        self._names[id(p)] = (weakref.ref(p), prefix + name, position)
                    except TypeError:
                        continue
                    del missing[id(p)]
            if not missing:
                return


def _prefixes(candidates: Sequence[tuple[str, torch.nn.Module]]) -> dict[int, str]:
    """``{id(root): "<variable>."}`` for separate models (no parameter in common) that share a
    parameter path, largest first: their paths alone would not say which model they belong to."""
    roots: list[tuple[str, torch.nn.Module, set[str]]] = []
    held: set[int] = set()
    seen: set[int] = set()
    for label, module in candidates:
        if id(module) in seen:  # two wrappers of one model
            continue
        seen.add(id(module))
        named = list(module.named_parameters())
        ids = {id(p) for _, p in named}
        if ids and not ids & held:
            roots.append((label, module, {n for n, _ in named}))
            held |= ids
    return {
        id(module): f"{label}."
        for label, module, paths in roots
        if any(paths & other for _, m, other in roots if m is not module)
    }


def optimizer_items(
    opt: torch.optim.Optimizer, names: Sequence[str], *, with_state: bool = True
) -> list[tuple[str, Any]]:
    """(name, value) of an optimizer's gradients, state and parameters, in that order."""
    params = [p for group in opt.param_groups for p in group["params"]]
    if not with_state:
        return [(f"param:{n}", p) for n, p in zip(names, params, strict=True)]
    items: list[tuple[str, Any]] = [(f"grad:{n}", p.grad) for n, p in zip(names, params, strict=True)]
    for n, p in zip(names, params, strict=True):
        state = opt.state.get(p)
        if isinstance(state, dict):
            for key in sorted(state, key=str):
                items.append((f"state:{n}:{key}", state[key]))
    items.extend((f"param:{n}", p) for n, p in zip(names, params, strict=True))
    return items


def _graph_leaves(roots: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors that a backward from ``roots`` accumulates gradients into, in graph order."""
    leaves: list[torch.Tensor] = []
    seen: set[int] = set()
    keep: list[Any] = []  # holds the nodes visited, so their ids are not reused meanwhile
    stack: list[Any] = []
    for t in roots:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            leaves.append(t)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
            continue
        for child, _ in reversed(node.next_functions):
            if child is not None and id(child) not in seen:
                stack.append(child)
    unique: dict[int, torch.Tensor] = {}
    for t in leaves:
        unique.setdefault(id(t), t)
    return list(unique.values())


class BackwardSteps:
    """Records training that no optimizer sees, a step per ``backward()`` (see the invariants).

    ``owned(p)`` says whether an optimizer holds ``p``; ``on_step(k)`` is called before backward
    ``k`` runs (steps 0..k-1 complete: it may end the run) and ``on_step_end(k)`` after it.
    """

    def __init__(
        self,
        recorder: Recorder | None,
        names: ParamNames,
        owned: Callable[[torch.Tensor], bool],
        *,
        on_step: Callable[[int], None] | None = None,
        on_step_end: Callable[[int], None] | None = None,
    ) -> None:
        self.recorder = recorder
        self.names = names
        self.owned = owned
        self.on_step = on_step
        self.on_step_end = on_step_end
        self.steps = 0
        """Backward steps begun (each one that reached the original ``backward``)."""
        self._last: list[tuple[str, torch.Tensor]] = []
        self._pending_update = False
        self._local = threading.local()
        self._thread = threading.main_thread()

    def install(self) -> None:
        """Wrap ``torch.autograd.backward`` (``Tensor.backward`` calls it)."""
        original = torch.autograd.backward
        watcher = self

        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(watcher._local, "inside", False) or threading.current_thread() is not watcher._thread:
                return original(tensors, *args, **kwargs)
            watcher._local.inside = True
            try:
                trained = watcher._before(tensors, kwargs.get("inputs"), sys._getframe(1))
                result = original(tensors, *args, **kwargs)
                if trained:
                    watcher._after()
                return result
            finally:
                watcher._local.inside = False

        backward.__wrapped__ = original  # type: ignore[attr-defined]
        backward.__doc__ = original.__doc__
        torch.autograd.backward = backward

    def _before(self, tensors: Any, inputs: Any, frame: types.FrameType) -> bool:
        if inputs is not None:
            candidates = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
            leaves = [t for t in candidates if isinstance(t, torch.Tensor) and t.is_leaf]
        else:
            roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            leaves = _graph_leaves(t for t in roots if isinstance(t, torch.Tensor))
        # FSDP2's gathered parameters are leaves too, their storage freed once resharded: never
        # read (the optimizer's sharded parameters are recorded)
        trained = [t for t in leaves if t.requires_grad and not self.owned(t) and not freed(t)]
        if not trained:
            return False
        names = self.names.names(trained, frame)
        order = sorted(range(len(trained)), key=lambda i: (self.names.position(trained[i]), i))
        named = [(names[i], trained[i]) for i in order]
        k = self.steps
        self.flush()  # the parameters after step k-1's update
        if self.on_step is not None:
            self.on_step(k)
        if k == 0 and self.recorder is not None:
            self.recorder.write("init", BACKWARD_KEY, 0, [(f"param:{n}", t) for n, t in named], named=True)
        self._last = named
        self.steps = k + 1
        return True

    def _after(self) -> None:
        k = self.steps - 1
        if self.recorder is not None:
            grads = [(f"grad:{n}", t.grad) for n, t in self._last]
            self.recorder.write("compute", BACKWARD_KEY, k, grads, named=True)
        self._pending_update = True
        if self.on_step_end is not None:
            self.on_step_end(k)

    def flush(self, *, last: bool = False) -> None:
        """Write the parameters after the last backward step's update (at the next step, or at exit:
        ``last``, which also lets go of the script's tensors, so nothing of ours keeps them, nor the
        globals of the hooks they hold, alive into the interpreter's finalization)."""
        if self._pending_update:
            self._pending_update = False
            if self.recorder is not None:
                params = [(f"param:{n}", t) for n, t in self._last]
                self.recorder.write("compute", BACKWARD_KEY, self.steps - 1, params, named=True)
        if last:
            self._last = []
