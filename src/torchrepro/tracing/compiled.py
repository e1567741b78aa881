"""``CompiledProbe``: which op of a ``torch.compile``d (Inductor) graph first differs from eager.

The op tracer cannot see compiled code (under a ``TorchDispatchMode`` Dynamo runs the frame
eagerly), so the compiled side of ``check --vary compile`` is located here: every graph Dynamo
hands to Inductor is kept as Dynamo captured it, and between ``start()`` and ``stop()`` each call of
its compiled code is shadowed by the same graph run eagerly.

Invariants:
- ``install()`` replaces the module attribute ``torch._inductor.compile_fx.compile_fx``, which
  ``torch.compile``'s Inductor backend imports at every compile, so it works before or after the
  script imports Inductor. Only the outermost call of a compile is kept (``compile_fx`` calls itself
  through that attribute); compiles the probe makes itself pass straight through.
- The probe never changes the run. Outside ``start()``/``stop()`` a compiled call goes straight
  through (one attribute test). Inside, the eager shadow runs first, in the call's grad mode, on
  clones of the inputs (nothing the script holds is mutated), and the global RNG state (CPU, and
  CUDA when initialised) is restored after it, so the compiled call starts from the state and
  consumes the numbers it would without the probe; the bisection puts back the state the compiled
  call left. The call's result is returned as is. A failure inside the probe is noted in the file,
  never raised into the run.
- Outputs are compared bit for bit (same dtype, shape and device, ``torch.equal``, NaN where NaN).
  At the first call whose outputs differ, prefixes of its graph (the nodes up to ``n``, returning
  ``n`` only) are compiled with Inductor (the graph's config patches and ``fallback_random``, under
  ``no_grad``) and run from the call's inputs and RNG state, as are their eager twins; a binary
  search over the nodes whose value is a tensor names the first whose compiled value differs. With
  ``fallback_random`` off the graph's first random node is tried first (Inductor's own random
  numbers are the usual cause): when its prefix differs and the one before it does not, it is named
  after two compiles.
- When every forward output matched, the backward is compared by a hook on the compiled outputs'
  autograd node against ``torch.autograd.grad`` of the eager shadow; it names the graph and the
  input whose gradient the backward computes first among those that differ, never an op.
- Names follow the op tracer's: a module path is dotted, without the root's name (an op in the
  root's own ``forward`` gets the root's class name); a line is the user's ``file:line`` (the last
  frame of the node's ``stack_trace`` outside torch, torchrepro, the standard library and the
  frameworks), relative to the directory the probe was made in when below it.
- The reader (``read_compiled_probe``, ``CompiledLocation``) imports no torch, so the parent reads
  the file cheaply; the probe imports torch only inside its methods.

The file (JSON, written atomically by ``stop()``)::

    {"format": 1,
     "graphs": [{"index": 0,                      # in compile order, from 0
                 "code": "model.py:20 forward",   # the compiled function: file:line name
                 "ops": 12,                       # call_function nodes
                 "random_ops": ["torch.nn.functional.dropout"],   # ops that draw random numbers
                 "fallback_random": false}],      # Inductor's config when it was compiled
     "calls": 3,          # forward calls shadowed and compared between start and stop
     "backwards": 1,      # backward calls compared
     "first": null | {"graph": 0, "call": 0,      # the graph, which of the shadowed calls
                      "phase": "forward" | "backward",
                      "output": 0,                # forward: the output; backward: the input
                      "op": "torch.nn.functional.dropout" | null,
                      "node": "dropout" | null,   # the FX node's name
                      "module": "layer.dropout1" | null,
                      "line": "model.py:15" | null,
                      "name": "lin.weight" | null,  # backward: the input whose gradient differs
                      "largest": 0.37 | null,       # largest absolute difference (null: not finite)
                      "node_found": true},          # false: no single op was pinned
     "notes": ["..."]}
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from torchrepro._frames import FRAMEWORKS
from torchrepro._jsonread import parse_json
from torchrepro.errors import TraceError

if TYPE_CHECKING:
    from torch.fx import GraphModule, Node

__all__ = ["FORMAT", "CompiledGraph", "CompiledLocation", "CompiledProbe", "read_compiled_probe"]

FORMAT: Final = 1
"""Version of the probe's file layout (the module docstring); the reader refuses others."""

_MAX_NOTES: Final = 20


# --------------------------------------------------------------------------------------------
# The reader (no torch)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompiledLocation:
    """What the compiled side's probe found: the first compiled graph call that differs from its
    eager twin and, where the bisection pinned one, the op in it (``graph`` None: no call differed
    in ``calls`` forward and ``backwards`` backward calls compared)."""

    graph: int | None
    code: str | None
    """The compiled function the graph comes from: ``file:line name``."""
    call: int | None
    phase: str | None
    """``"forward"`` or ``"backward"``."""
    output: int | None
    op: str | None
    module: str | None
    line: str | None
    name: str | None
    """Backward: the graph input whose gradient differs (a parameter's name where known)."""
    largest: float | None
    node_found: bool
    random_ops: tuple[str, ...]
    """Ops that draw random numbers in the differing graph (in every graph when none differed)."""
    fallback_random: bool | None
    """Inductor's ``fallback_random`` when that graph (every graph: all of them) was compiled."""
    calls: int
    backwards: int
    graphs: int
    notes: tuple[str, ...]

    @property
    def found(self) -> bool:
        """Whether a compiled graph call differed from its eager twin."""
        return self.graph is not None

    @property
    def inductor_random(self) -> bool:
        """Whether Inductor draws its own random numbers in that graph (random ops compiled with
        ``fallback_random`` off): they never match eager's."""
        return bool(self.random_ops) and self.fallback_random is False

    def describe(self) -> str:
        """One line: the op, its module and line, the graph and the largest difference."""
        if self.graph is None:
            what = f"{self.calls} compiled forward call(s)"
            if self.backwards:
                what += f" and {self.backwards} backward call(s)"
            return f"{what} matched eager bit for bit"
        where = f"compiled graph {self.graph}" + (f" of {_code_text(self.code)}" if self.code else "")
        largest = f"; largest difference {self.largest:.3g}" if self.largest is not None else ""
        call = f"call {self.call} of the step" if self.call is not None else "a call of the step"
        if self.phase == "backward":
            grad = f"the gradient of {self.name}" if self.name else "a gradient"
            return f"{grad} in the compiled backward of {where} ({call}{largest})"
        if not self.node_found:
            output = f"output {self.output}" if self.output is not None else "an output"
            return f"{output} of {where} ({call}; no single op pinned{largest})"
        module = f" in {self.module}" if self.module else ""
        line = f" at {self.line}" if self.line else ""
        return f"{self.op or 'an op'}{module}{line} ({where}{largest})"


def _code_text(code: str) -> str:
    """``model.py:20 forward`` as ``forward at model.py:20``."""
    location, _, name = code.partition(" ")
    return f"{name} at {location}" if name else location


def read_compiled_probe(path: str | os.PathLike[str]) -> CompiledLocation | None:
    """The probe's file at ``path``; None when there is none (the probe never stopped).

    A file that is not the probe's (malformed, another format) raises ``TraceError`` naming it.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TraceError(f"Cannot read the compiled probe's file {os.fspath(path)}: {exc}.") from None
    try:
        return _location(parse_json(data))
    except (ValueError, TypeError) as exc:
        raise TraceError(
            f"Cannot read the compiled probe's file {os.fspath(path)}: {exc}. CompiledProbe.stop() "
            "writes it; run the compiled side again to write it anew."
        ) from None


def _location(doc: Any) -> CompiledLocation:
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if doc.get("format") != FORMAT:
        raise ValueError(f"its format is {doc.get('format')!r}, expected {FORMAT}")
    graphs = [g for g in _typed(doc, "graphs", list) if isinstance(g, dict)]
    calls, backwards = _typed(doc, "calls", int), _typed(doc, "backwards", int)
    notes = tuple(str(n) for n in _typed(doc, "notes", list))
    first = doc.get("first")
    if first is None:  # nothing differed: say what every graph holds
        first, random_ops = {}, sorted({str(op) for g in graphs for op in g.get("random_ops", ())})
        fallbacks = {g.get("fallback_random") for g in graphs}
        fallback = _flag(fallbacks.pop()) if len(fallbacks) == 1 else None
        graph = info = None
    elif isinstance(first, dict):
        graph = _typed(first, "graph", int)
        info = next((g for g in graphs if g.get("index") == graph), {})
        random_ops = [str(op) for op in info.get("random_ops", ())]
        fallback = _flag(info.get("fallback_random"))
    else:
        raise ValueError("'first' is neither null nor an object")
    return CompiledLocation(
        graph=graph,
        code=_text(info.get("code")) if info else None,
        call=_typed(first, "call", int, optional=True),
        phase=_text(first.get("phase")),
        output=_typed(first, "output", int, optional=True),
        op=_text(first.get("op")),
        module=_text(first.get("module")),
        line=_text(first.get("line")),
        name=_text(first.get("name")),
        largest=_number(first.get("largest")),
        node_found=first.get("node_found") is True,
        random_ops=tuple(random_ops),
        fallback_random=fallback,
        calls=calls,
        backwards=backwards,
        graphs=len(graphs),
        notes=notes,
    )


def _typed(doc: Mapping[str, Any], key: str, kind: type, *, optional: bool = False) -> Any:
    value = doc.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ValueError(f"{key!r} is {type(value).__name__}, expected {kind.__name__}")
    return value


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


# --------------------------------------------------------------------------------------------
# Naming nodes: op, module path, user line, random ops
# --------------------------------------------------------------------------------------------

_FRAME: Final = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')
_RESUMED: Final = re.compile(r"torch_dynamo_resume_in_(\w+?)_at_\d+")
"""The name Dynamo gives the code that resumes a function after a graph break."""
_ROOT: Final = re.compile(r"^[LG]\[['\"]([^'\"]*)['\"]\]")
"""The root of a Dynamo source name: ``L['self']``."""
_PART: Final = re.compile(
    r"\._(?:modules|parameters|buffers)\[['\"]([^'\"]+)['\"]\]|\[['\"]([^'\"]+)['\"]\]|\[(\d+)\]"
)
"""A step of a Dynamo source name that is one dotted part: ``._modules['lin']``, ``[0]``."""
_LIBRARY_DIRS: Final = tuple(
    os.path.normcase(directory) + os.sep
    for directory in (
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # torchrepro
        os.path.dirname(os.path.abspath(os.__file__)),  # the standard library
    )
)
# Ops that draw random numbers only when switched on: name -> (p at, p keyword, training at,
# training keyword, training's default); p None: no probability argument.
_SWITCHED: Final[Mapping[str, tuple[int | None, str, int, str, bool]]] = {
    "dropout": (1, "p", 2, "training", True),
    "dropout1d": (1, "p", 2, "training", True),
    "dropout2d": (1, "p", 2, "training", True),
    "dropout3d": (1, "p", 2, "training", True),
    "alpha_dropout": (1, "p", 2, "training", False),
    "feature_alpha_dropout": (1, "p", 2, "training", False),
    "native_dropout": (1, "p", 2, "train", True),
    "multi_head_attention_forward": (10, "dropout_p", 13, "training", True),
    "scaled_dot_product_attention": (4, "dropout_p", -1, "", True),
    "rrelu": (None, "", 3, "training", False),
    "rrelu_": (None, "", 3, "training", False),
}
_RANDOM: Final = frozenset(
    {
        "bernoulli", "bernoulli_", "cauchy_", "exponential_", "geometric_", "gumbel_softmax",
        "log_normal_", "multinomial", "normal", "normal_", "poisson", "rand", "rand_like", "randint",
        "randint_like", "randn", "randn_like", "random_", "randperm", "rrelu_with_noise",
        "uniform_",
    }
)  # fmt: skip


def _is_user_file(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    path = os.path.normcase(os.path.abspath(filename))
    if path.startswith(_LIBRARY_DIRS):
        return False
    for package in ("torch", *FRAMEWORKS):
        module_file = getattr(sys.modules.get(package), "__file__", None)
        if isinstance(module_file, str) and path.startswith(
            os.path.normcase(os.path.dirname(os.path.abspath(module_file))) + os.sep
        ):
            return False
    return True


def _shown(filename: str, cwd: str) -> str:
    path = os.path.abspath(filename)
    if os.path.normcase(path).startswith(os.path.normcase(cwd) + os.sep):
        return os.path.relpath(path, cwd)
    return path


def _user_frame(stack_trace: Any, cwd: str, *, outer: bool = False) -> tuple[str, str] | None:
    """``(file:line, function)`` of the innermost (``outer``: outermost) user frame of a node's
    ``stack_trace``."""
    if not isinstance(stack_trace, str):
        return None
    frames = [m for m in _FRAME.finditer(stack_trace) if _is_user_file(m["file"])]
    if not frames:
        return None
    m = frames[0] if outer else frames[-1]
    return f"{_shown(m['file'], cwd)}:{m['line']}", m["name"]


def _dotted(name: str) -> tuple[str, str] | None:
    """A Dynamo source name as ``(root, dotted rest)``: ``L['self']._modules['lin']`` ->
    ``("self", "lin")``; None when it has no root."""
    root = _ROOT.match(name)
    if root is None:
        return None
    rest = _PART.sub(lambda m: "." + (m[1] or m[2] or m[3]), name[root.end() :]).strip(".")
    return root[1], rest


def _module_path(nn_module_stack: Any) -> str | None:
    """The innermost module of a node's ``nn_module_stack``, dotted, without the root's name (the
    root's class name for the root itself)."""
    if not isinstance(nn_module_stack, Mapping) or not nn_module_stack:
        return None
    entries = list(nn_module_stack.values())
    try:
        key, cls = str(entries[-1][0]), entries[-1][1]
    except (TypeError, IndexError):
        return None
    parts = _dotted(key)
    rest = parts[1] if parts is not None else key.partition(".")[2]
    return rest or getattr(cls, "__name__", None)


def _input_name(node: Node) -> str:
    """A graph input by its name in the script (``lin.weight``, ``x``), else its placeholder's."""
    try:
        name = node.meta["grapharg"].source.name  # a property in torch 2.13, a method before
        name = str(name() if callable(name) else name)
    except (KeyError, AttributeError, TypeError):
        return str(node.target)
    parts = _dotted(name)
    return name if parts is None else parts[1] or parts[0]


def _op_name(node: Node) -> str:
    """The op a node calls as the user writes it (``torch.nn.functional.dropout``, ``Tensor.sum``)."""
    import torch

    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if node.op == "call_module":
        return str(target)
    name = getattr(target, "__name__", None)
    if isinstance(name, str):
        for namespace, text in ((torch.nn.functional, "torch.nn.functional"), (torch, "torch")):
            if getattr(namespace, name, None) is target:
                return f"{text}.{name}"
    try:
        text = torch.fx.node._get_qualified_name(target)  # type: ignore[arg-type]
    except Exception:
        text = str(target)
    return text.replace("_operator.", "operator.")


def _random_op(node: Node) -> str | None:
    """The op's name when the node draws random numbers (a dropout only when training with p > 0)."""
    if node.op not in ("call_function", "call_method"):
        return None
    short = str(node.target if isinstance(node.target, str) else getattr(node.target, "__name__", ""))
    switched = _SWITCHED.get(short)
    if switched is not None:
        p_at, p_key, training_at, training_key, default = switched
        p = 1.0 if p_at is None else _argument(node, p_at, p_key, 0.5)
        training = default if training_at < 0 else _argument(node, training_at, training_key, default)
        if training is False or (isinstance(p, (int, float)) and p == 0):
            return None
        return _op_name(node)
    return _op_name(node) if short in _RANDOM else None


def _argument(node: Node, position: int, keyword: str, default: Any) -> Any:
    if keyword in node.kwargs:
        return node.kwargs[keyword]
    return node.args[position] if position < len(node.args) else default


# --------------------------------------------------------------------------------------------
# Tensors: compare, clone, RNG state
# --------------------------------------------------------------------------------------------


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def _difference(a: Any, b: Any) -> float | None:
    """None when ``a`` and ``b`` are equal bit for bit (NaN where NaN), else the largest absolute
    difference (``inf`` when dtype, shape, device or the places of NaN differ)."""
    import torch

    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None if type(a) is type(b) and a == b else math.inf
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return math.inf
    a, b = a.detach(), b.detach()
    if torch.equal(a, b):
        return None
    if a.is_floating_point() or a.is_complex():
        nan_a, nan_b = a.isnan(), b.isnan()
        if not torch.equal(nan_a, nan_b):
            return math.inf
        if nan_a.any():
            a, b = a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
            if torch.equal(a, b):
                return None
    wide = torch.complex128 if a.is_complex() else torch.float64
    return float((a.to(wide) - b.to(wide)).abs().max())


def _clone(value: Any, *, grad: bool = False) -> Any:
    import torch

    if not isinstance(value, torch.Tensor):
        return value
    copy = value.detach().clone()
    return copy.requires_grad_(True) if grad and value.requires_grad else copy


def _capture_rng() -> tuple[Any, Any]:
    import torch

    cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None


def _restore_rng(state: tuple[Any, Any]) -> None:
    import torch

    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _first(graph: int, call: int, phase: str, output: int, largest: float | None) -> dict[str, Any]:
    """A ``first`` entry of the file, nothing named yet."""
    return {
        "graph": graph,
        "call": call,
        "phase": phase,
        "output": output,
        "op": None,
        "node": None,
        "module": None,
        "line": None,
        "name": None,
        "largest": _finite(largest),
        "node_found": False,
    }


# --------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class CompiledGraph:
    """One graph Dynamo handed to Inductor, as Dynamo captured it (before Inductor)."""

    index: int
    gm: GraphModule
    """A copy of Dynamo's graph module (Inductor may rewrite the original), sharing its attributes."""
    code: str | None
    """The compiled function: ``file:line name``."""
    patches: dict[str, Any]
    """The Inductor config patches it was compiled with, and ``fallback_random`` at the time."""
    ops: int
    random_ops: list[str]
    names: list[str]
    """Its inputs, by their names in the script (``lin.weight``, ``x``) where Dynamo knows them."""
    first_use: list[int]
    """Per input, the place of its first user among the nodes: the later, the sooner the backward
    completes its gradient."""

    def summary(self) -> dict[str, Any]:
        """The graph's entry in the probe's file."""
        return {
            "index": self.index,
            "code": self.code,
            "ops": self.ops,
            "random_ops": self.random_ops,
            "fallback_random": bool(self.patches.get("fallback_random")),
        }


@dataclasses.dataclass(eq=False)
class _Pending:
    """A shadowed forward call whose backward is still to be compared."""

    graph: CompiledGraph
    call: int
    eager_out: list[Any]
    eager_in: list[tuple[int, Any]]  # (input position, eager clone requiring grad)


class CompiledProbe:
    """Shadow every Inductor-compiled graph call between ``start()`` and ``stop()`` with the same
    graph run eagerly, and name the first op whose compiled value differs (see the module).

    ``install()`` once, before the script compiles (or after: graphs compiled before are not
    seen); ``start()`` and ``stop()`` around the step to look at; ``stop()`` writes the file at
    ``path`` that ``read_compiled_probe`` reads. ``keep_eager``: keep each shadowed call's eager
    outputs in ``eager_outputs`` as ``(graph index, outputs)``.
    """

    def __init__(self, path: str | os.PathLike[str], *, keep_eager: bool = False) -> None:
        self.path = Path(path)
        self.graphs: list[CompiledGraph] = []
        """Every graph compiled since ``install()``, in order."""
        self.eager_outputs: list[tuple[int, list[Any]]] = []
        self._compile_notes: list[str] = []  # kept across start(): compiles happen before it
        self._keep_eager = keep_eager
        self._cwd = os.getcwd()
        self._original: Callable[..., Any] | None = None
        self._module: Any = None
        self._local = threading.local()  # depth: > 0 while the probe runs or compiles itself
        self._active = False
        self._reset()

    def _reset(self) -> None:
        self._calls = 0
        self._backwards = 0
        self._found: dict[str, Any] | None = None
        self._notes: list[str] = []
        self.eager_outputs = []

    # -- lifecycle ------------------------------------------------------------------------------
    def install(self) -> None:
        """Intercept every Inductor compile from now on (idempotent)."""
        import warnings

        with warnings.catch_warnings():  # importing Inductor warns of ``torch.jit`` deprecations
            warnings.simplefilter("ignore", DeprecationWarning)  # (hidden by Python's defaults)
            import torch._inductor.compile_fx as module

        current = module.compile_fx
        if getattr(current, "_torchrepro_probe", None) is self:
            return
        self._original, self._module = current, module

        def compile_fx(model_: Any, example_inputs_: Any, *args: Any, **kwargs: Any) -> Any:
            return self._compile(current, model_, example_inputs_, args, kwargs)

        compile_fx.__doc__ = current.__doc__
        compile_fx._torchrepro_probe = self  # type: ignore[attr-defined]
        module.compile_fx = compile_fx

    def remove(self) -> None:
        """Put back the ``compile_fx`` found at ``install()`` (code compiled meanwhile stays wrapped,
        going straight through outside ``start()``/``stop()``)."""
        module = self._module
        if module is not None and getattr(module.compile_fx, "_torchrepro_probe", None) is self:
            module.compile_fx = self._original

    def start(self) -> None:
        """Shadow compiled calls from now on (one training step)."""
        self._reset()
        self._active = True

    def stop(self) -> Path:
        """Stop shadowing, write the file and return its path."""
        from torchrepro._io import atomic_write_json

        self._active = False
        doc = {
            "format": FORMAT,
            "graphs": [g.summary() for g in self.graphs],
            "calls": self._calls,
            "backwards": self._backwards,
            "first": self._found,
            "notes": (self._compile_notes + self._notes)[:_MAX_NOTES],
        }
        try:
            atomic_write_json(self.path, doc)
        except OSError as exc:
            raise TraceError(f"Cannot write the compiled probe's file {self.path}: {exc}.") from None
        return self.path

    def _note(self, text: str) -> None:
        if len(self._notes) < _MAX_NOTES and text not in self._notes:
            self._notes.append(text)

    def _failed(self, graph: int, what: str, exc: BaseException) -> None:
        self._note(f"graph {graph}: {what} failed: {type(exc).__name__}: {exc}")

    @property
    def _depth(self) -> int:
        return int(getattr(self._local, "depth", 0))

    @_depth.setter
    def _depth(self, value: int) -> None:
        self._local.depth = value

    # -- compile --------------------------------------------------------------------------------
    def _compile(
        self,
        original: Callable[..., Any],
        gm: Any,
        example_inputs: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        import torch

        if self._depth or not isinstance(gm, torch.fx.GraphModule):
            return original(gm, example_inputs, *args, **kwargs)
        graph = None
        try:
            from torch._inductor import config

            patches = dict(kwargs.get("config_patches", args[1] if len(args) > 1 else None) or {})
            patches.setdefault("fallback_random", config.fallback_random)
            graph = self._keep(gm, patches)
        except Exception as exc:  # never break the run
            note = f"a compiled graph was not kept, its calls not shadowed: {type(exc).__name__}: {exc}"
            if len(self._compile_notes) < _MAX_NOTES:
                self._compile_notes.append(note)
        self._depth += 1
        try:
            compiled = original(gm, example_inputs, *args, **kwargs)
        finally:
            self._depth -= 1
        if graph is None or not callable(compiled) or isinstance(compiled, torch.nn.Module):
            return compiled
        return self._wrap(graph, compiled)

    def _keep(self, gm: GraphModule, patches: dict[str, Any]) -> CompiledGraph:
        import copy

        import torch
        from torch._guards import TracingContext

        kept = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name="CompiledGraph")
        nodes = list(kept.graph.nodes)
        code = None
        traced = getattr(TracingContext.try_get(), "traced_code", None)
        if traced:  # the code objects Dynamo traced, the compiled frame's first
            root = traced[0]
            resumed = _RESUMED.fullmatch(root.co_name)  # the rest of a function after a graph break
            name = f"{resumed[1]}, resumed after a graph break" if resumed else root.co_name
            code = f"{_shown(root.co_filename, self._cwd)}:{root.co_firstlineno} {name}"
        else:
            frames = (_user_frame(n.meta.get("stack_trace"), self._cwd, outer=True) for n in nodes)
            found = next((f for f in frames if f is not None), None)
            code = f"{found[0]} {found[1]}" if found else None
        place = {node: i for i, node in enumerate(nodes)}
        inputs = [n for n in nodes if n.op == "placeholder"]
        graph = CompiledGraph(
            index=len(self.graphs),
            gm=kept,
            code=code,
            patches=patches,
            ops=sum(n.op == "call_function" for n in nodes),
            random_ops=[op for op in map(_random_op, nodes) if op is not None],
            names=[_input_name(n) for n in inputs],
            first_use=[min((place[u] for u in n.users), default=-1) for n in inputs],
        )
        self.graphs.append(graph)
        return graph

    def _wrap(self, graph: CompiledGraph, compiled: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self._active or self._depth or self._found is not None:
                return compiled(*args, **kwargs)
            return self._shadow(graph, compiled, args, kwargs)

        call.__dict__.update(getattr(compiled, "__dict__", {}))
        call.__wrapped__ = compiled  # type: ignore[attr-defined]
        return call

    # -- shadow ---------------------------------------------------------------------------------
    def _shadow(
        self,
        graph: CompiledGraph,
        compiled: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        import torch

        prepared = None
        try:
            # Dynamo calls with the inputs unpacked, a boxed call passes one list (``_boxed_call``
            # is no guide: AOT's unboxed wrapper copies it from the boxed function it wraps)
            boxed = len(args) == 1 and isinstance(args[0], list) and len(graph.names) != 1
            prepared = self._eager(graph, list(args[0]) if boxed else list(args))
        except Exception as exc:
            self._failed(graph.index, "the eager shadow", exc)
        out = compiled(*args, **kwargs)
        if prepared is None:
            return out
        call = self._calls
        self._calls += 1
        try:
            pristine, rng, eager_out, eager_in = prepared
            compiled_out = list(_leaves(out))
            if self._keep_eager:
                self.eager_outputs.append((graph.index, [_clone(v) for v in eager_out]))
            self._compare(graph, call, pristine, rng, eager_out, compiled_out)
            if self._found is None and eager_in and torch.is_grad_enabled():
                self._watch_backward(_Pending(graph, call, eager_out, eager_in), compiled_out)
        except Exception as exc:
            self._failed(graph.index, "comparing", exc)
        return out

    def _eager(
        self, graph: CompiledGraph, inputs: list[Any]
    ) -> tuple[list[Any], tuple[Any, Any], list[Any], list[tuple[int, Any]]]:
        """Run the graph eagerly on clones from the RNG state the compiled call will start from
        (restored after), in the call's grad mode: pristine input clones, that RNG state, the
        eager outputs and the eager inputs that require grad."""
        import torch

        rng = _capture_rng()
        pristine = [_clone(v) for v in inputs]
        eager_inputs = [_clone(v, grad=torch.is_grad_enabled()) for v in inputs]
        eager_in = [(i, v) for i, v in enumerate(eager_inputs) if getattr(v, "requires_grad", False)]
        self._depth += 1
        try:
            out = graph.gm(*eager_inputs)
        finally:
            self._depth -= 1
            _restore_rng(rng)
        return pristine, rng, list(_leaves(out)), eager_in

    def _compare(
        self,
        graph: CompiledGraph,
        call: int,
        pristine: list[Any],
        rng: tuple[Any, Any],
        eager_out: list[Any],
        compiled_out: list[Any],
    ) -> None:
        if len(eager_out) != len(compiled_out):
            counts = f"{len(compiled_out)} compiled outputs, {len(eager_out)} eager"
            self._note(f"graph {graph.index}: {counts}; not compared")
            return
        for output, (e, c) in enumerate(zip(eager_out, compiled_out, strict=True)):
            largest = _difference(c, e)
            if largest is not None:
                self._found = _first(graph.index, call, "forward", output, largest)
                after = _capture_rng()  # what the compiled call left: the run goes on from it
                try:
                    self._found.update(self._bisect(graph, pristine, rng))
                except Exception as exc:
                    self._failed(graph.index, "bisecting", exc)
                finally:
                    _restore_rng(after)
                return

    # -- bisect ---------------------------------------------------------------------------------
    def _bisect(self, graph: CompiledGraph, pristine: list[Any], rng: tuple[Any, Any]) -> dict[str, Any]:
        """The first node whose compiled prefix differs from its eager prefix (see the module)."""
        import torch

        candidates = [
            n
            for n in graph.gm.graph.nodes
            if n.op in ("call_function", "call_method", "call_module")
            and isinstance(n.meta.get("example_value"), torch.Tensor)
        ]
        results: dict[int, float | None] = {}

        def differs(i: int) -> bool:
            if i not in results:
                results[i] = self._prefix_difference(graph, candidates[i], pristine, rng)
            return results[i] is not None

        lo = self._first_random(graph, candidates, differs)
        if lo is None and (not candidates or not differs(len(candidates) - 1)):
            self._note(
                f"graph {graph.index}: no prefix of the graph differs from eager (the difference "
                "shows only in the whole graph: fusion across the prefixes' ends); the graph is "
                "named, not an op"
            )
            return {}
        if lo is None:
            lo, hi = 0, len(candidates) - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if differs(mid):
                    hi = mid
                else:
                    lo = mid + 1
        node = candidates[lo]
        while (
            node.target is operator.getitem
            and isinstance(node.args[0], torch.fx.Node)
            and not isinstance(node.args[0].meta.get("example_value"), torch.Tensor)
        ):
            node = node.args[0]  # an element of a tuple: the op that made the tuple
        site = _user_frame(node.meta.get("stack_trace"), self._cwd)
        return {
            "op": _op_name(node),
            "node": node.name,
            "module": _module_path(node.meta.get("nn_module_stack")),
            "line": site[0] if site else None,
            "largest": _finite(results[lo]),
            "node_found": True,
        }

    @staticmethod
    def _first_random(
        graph: CompiledGraph, candidates: list[Node], differs: Callable[[int], bool]
    ) -> int | None:
        """The index of the graph's first random node when Inductor draws its own numbers there
        (``fallback_random`` off) and it is the first node that differs: its prefix differs and the
        prefix before it does not (two compiles instead of the bisection's ``log2`` of the nodes).
        None: not so, or no such node; the bisection decides (it re-uses what was compiled here)."""
        if graph.patches.get("fallback_random"):
            return None
        first = next((i for i, n in enumerate(candidates) if _random_op(n) is not None), None)
        if first is None or not differs(first) or (first > 0 and differs(first - 1)):
            return None
        return first

    def _prefix_difference(
        self, graph: CompiledGraph, node: Node, pristine: list[Any], rng: tuple[Any, Any]
    ) -> float | None:
        import torch

        prefix = _prefix(graph.gm, node)
        original = self._original
        assert original is not None
        self._depth += 1
        try:
            with torch.no_grad():
                _restore_rng(rng)
                eager = prefix(*[_clone(v) for v in pristine])
                inputs = [_clone(v) for v in pristine]
                patches = {**graph.patches, "triton.cudagraphs": False}  # (reduce-overhead mode)
                compiled = original(prefix, inputs, config_patches=patches)
                _restore_rng(rng)
                result = compiled(*inputs)
        finally:
            self._depth -= 1
            _restore_rng(rng)
        return _difference(next(_leaves(result)), next(_leaves(eager)))

    # -- backward -------------------------------------------------------------------------------
    def _watch_backward(self, pending: _Pending, compiled_out: list[Any]) -> None:
        import torch

        nodes = (t.grad_fn for t in compiled_out if isinstance(t, torch.Tensor) and t.grad_fn is not None)
        node = next((n for n in nodes if "CompiledFunction" in type(n).__name__), None)
        if node is None:
            return

        def hook(grad_inputs: Sequence[Any], grad_outputs: Sequence[Any]) -> None:
            try:
                self._compare_backward(pending, grad_inputs, grad_outputs)
            except Exception as exc:
                self._failed(pending.graph.index, "comparing the backward", exc)

        node.register_hook(hook)

    def _compare_backward(
        self, pending: _Pending, grad_inputs: Sequence[Any], grad_outputs: Sequence[Any]
    ) -> None:
        import torch

        graph = pending.graph
        if self._found is not None or not self._active:
            return
        if len(grad_outputs) != len(pending.eager_out) or len(grad_inputs) != len(graph.names):
            self._note(
                f"graph {graph.index}: its compiled backward takes {len(grad_outputs)} gradients and "
                f"gives {len(grad_inputs)}, for {len(pending.eager_out)} outputs and {len(graph.names)} "
                "inputs: not compared"
            )
            return
        pairs = [
            (e, g.detach())
            for e, g in zip(pending.eager_out, grad_outputs, strict=True)
            if isinstance(e, torch.Tensor) and e.requires_grad and isinstance(g, torch.Tensor)
        ]
        if not pairs:
            return
        self._depth += 1
        try:
            with torch.enable_grad():
                eager = torch.autograd.grad(
                    [e for e, _ in pairs], [v for _, v in pending.eager_in], [g for _, g in pairs],
                    allow_unused=True,
                )  # fmt: skip
        finally:
            self._depth -= 1
        self._backwards += 1
        differing: list[tuple[int, float]] = []
        for (position, _), e in zip(pending.eager_in, eager, strict=True):
            c = grad_inputs[position]
            if c is None and e is None:
                continue
            if c is None:
                c = torch.zeros_like(e)
            elif e is None:
                e = torch.zeros_like(c)
            largest = _difference(c, e)
            if largest is not None:
                differing.append((position, largest))
        if differing:
            position, largest = max(differing, key=lambda d: graph.first_use[d[0]])
            self._found = _first(graph.index, pending.call, "backward", position, largest)
            self._found["name"] = graph.names[position]
            names = ", ".join(graph.names[p] for p, _ in differing)
            self._note(f"graph {graph.index}: the compiled backward's gradients of {names} differ from eager")


def _prefix(gm: GraphModule, last: Node) -> GraphModule:
    """``gm``'s nodes up to ``last`` (every placeholder kept), returning ``(last,)``."""
    import torch

    graph = torch.fx.Graph()
    copies: dict[Node, Node] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            break
        copies[node] = graph.node_copy(node, lambda n: copies[n])
        if node is last:
            break
    graph.output((copies[last],))
    return torch.fx.GraphModule(gm, graph, class_name="CompiledPrefix")
