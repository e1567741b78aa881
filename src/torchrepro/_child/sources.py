"""The user's source, read with ``ast``: where the value a seeding call was given came from, and
the determinism switches a file sets (``switch_statements``).

The audit's probe (``_child.probe``) asks this when a seed does not identify itself (a value an
unseeded source returned, compared by identity or, from 2**16 up, by value): a seed such as
``random.randint(1, 10000)`` is small enough to be any constant, so the expression the script
wrote decides, never the number.

Invariants:
- A seed is traced only through what the source says and the run confirms: the seeding call is
  found by the position of the call being made in the caller's frame; its argument is followed
  through calls and, for a name, through the last assignment to it before that line in the same
  function (or at module level); a call counts as a source only when its callee resolves, in
  that frame, to one of the probe's wrapped sources *and* the probe saw that source called from
  that line while it was unseeded (``confirmed``). So a constant (``torch.manual_seed(42)``),
  a parameter, an attribute or a branch that did not run is never taken for a drawn value.
- A switch statement is an assignment to ``...cudnn.benchmark``, ``...cudnn.allow_tf32``,
  ``...cudnn.deterministic``, ``...matmul.allow_tf32`` or a call of
  ``...set_float32_matmul_precision`` / ``...use_deterministic_algorithms``, with a literal value
  (anything else cannot be judged unrun); the ``if`` deciding it is named as written.
- An accumulation statement is a call of ``<module>.no_sync()`` (DDP's context manager) or of
  ``<module>.set_requires_gradient_sync(...)`` with anything but the literal ``True`` (FSDP2): the
  script sums gradients over several backward passes before they are reduced across ranks.
- Names resolve through modules and classes only (``getattr`` on nothing else: no property of a
  user's object runs); a file is parsed once (through ``linecache``, the source python ran); a
  file that does not parse traces nothing.
- Standard library only.
"""

from __future__ import annotations

import ast
import builtins
import linecache
import types
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["accumulation_statements", "seed_source", "switch_statements", "tree"]

_TREES: dict[str, ast.Module | None] = {}
_PARENTS: dict[int, dict[int, ast.AST]] = {}
_DEPTH = 4
"""Assignments followed from a seeding call's argument, at most."""

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.Module)


def tree(filename: str) -> ast.Module | None:
    """The parsed source of ``filename`` (None: no source, or it does not parse)."""
    if filename not in _TREES:
        parsed: ast.Module | None = None
        text = "".join(linecache.getlines(filename))
        if text:
            try:
                parsed = ast.parse(text, filename)
            except (SyntaxError, ValueError):
                parsed = None
        _TREES[filename] = parsed
    return _TREES[filename]


def _parents(module: ast.Module) -> dict[int, ast.AST]:
    parents = _PARENTS.get(id(module))
    if parents is None:
        parents = {id(child): node for node in ast.walk(module) for child in ast.iter_child_nodes(node)}
        _PARENTS[id(module)] = parents
    return parents


def _position(frame: types.FrameType) -> tuple[int | None, ...] | None:
    """(line, end line, column, end column) of the instruction the frame is executing."""
    positions = getattr(frame.f_code, "co_positions", None)  # Python 3.11+
    if positions is None:
        return None
    try:
        for i, position in enumerate(positions()):
            if i == frame.f_lasti // 2:
                return tuple(position)
    except (AttributeError, ValueError):
        pass
    return None


_CALLS: dict[tuple[types.CodeType, int], ast.Call | None] = {}


def _call_at(module: ast.Module, frame: types.FrameType) -> ast.Call | None:
    """The call the frame is making (by the instruction's position; else the innermost call on
    its line); cached by code and instruction."""
    key = (frame.f_code, frame.f_lasti)
    if key not in _CALLS:
        _CALLS[key] = _find_call(module, frame)
    return _CALLS[key]


def _find_call(module: ast.Module, frame: types.FrameType) -> ast.Call | None:
    calls = [n for n in ast.walk(module) if isinstance(n, ast.Call)]
    position = _position(frame)
    for node in calls:
        if (node.lineno, node.end_lineno, node.col_offset, node.end_col_offset) == position:
            return node
    line = frame.f_lineno
    around = [n for n in calls if n.lineno <= line <= (n.end_lineno or n.lineno)]
    if not around:
        return None
    return min(
        around, key=lambda n: ((n.end_lineno or n.lineno) - n.lineno, (n.end_col_offset or 0) - n.col_offset)
    )


def _scope(module: ast.Module, node: ast.AST) -> ast.AST:
    """The innermost function (or the module) whose body holds ``node``."""
    parents = _parents(module)
    current = parents.get(id(node))
    while current is not None and not isinstance(
        current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)
    ):
        current = parents.get(id(current))
    return current if current is not None else module


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``scope``'s body, not those of the functions and classes it defines."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def _assigned(scope: ast.AST, name: str, before: int | None) -> ast.expr | None:
    """The value of the last assignment to ``name`` in ``scope`` on a line before ``before``
    (None: any line)."""
    best: tuple[int, ast.expr] | None = None
    for node in _own_nodes(scope):
        value: ast.expr | None = None
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            value = node.value
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
            target = node.target
            if isinstance(target, ast.Name) and target.id == name:
                value = node.value
        if value is None or (before is not None and value.lineno >= before):
            continue
        if best is None or value.lineno >= best[0]:
            best = (value.lineno, value)
    return best[1] if best is not None else None


def _resolve(node: ast.expr, frame: types.FrameType) -> Any:
    """The object a dotted name (``time.time``, ``np.random.randint``, ``randint``) names in the
    frame, through modules and classes only; None when it names anything else."""
    dotted = _dotted(node)
    if dotted is None:
        return None
    head, *parts = dotted.split(".")
    missing = object()
    obj = frame.f_locals.get(head, missing)
    if obj is missing:
        obj = frame.f_globals.get(head, missing)
    if obj is missing:
        obj = getattr(builtins, head, None)
    for attr in parts:
        if not isinstance(obj, (types.ModuleType, type)):
            return None
        obj = getattr(obj, attr, None)
    return obj


def seed_source(frame: types.FrameType, confirmed: Callable[[str, int, int, str], bool]) -> str | None:
    """The unseeded source the value of the seeding call ``frame`` is making came from
    (``random.randint``, ``time.time``...), or None when the source shows none.

    ``confirmed(filename, first_line, last_line, source)`` says whether the probe saw
    ``source`` called, unseeded, from one of those lines of ``filename``.
    """
    filename = frame.f_code.co_filename
    module = tree(filename)
    if module is None:
        return None
    call = _call_at(module, frame)
    if call is None:
        return None
    argument: ast.expr | None = call.args[0] if call.args else None
    if argument is None and call.keywords:
        argument = call.keywords[0].value
    if argument is None or isinstance(argument, ast.Starred):
        return None
    seen: set[tuple[int, str, int]] = set()

    def trace(expr: ast.expr, scope: ast.AST, line: int, depth: int) -> str | None:
        for node in ast.walk(expr):
            if isinstance(node, ast.Call):
                source = getattr(_resolve(node.func, frame), "_torchrepro_source", None)
                if isinstance(source, str) and confirmed(
                    filename, node.lineno, node.end_lineno or node.lineno, source
                ):
                    return source
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and depth < _DEPTH:
                key = (id(scope), node.id, line)
                if key in seen:
                    continue
                seen.add(key)
                value = _assigned(scope, node.id, line)
                outer: ast.AST = scope
                if value is None and not isinstance(scope, ast.Module):
                    outer = module  # a global the function reads: its last module-level value
                    value = _assigned(module, node.id, None)
                if value is not None:
                    found = trace(value, outer, value.lineno, depth + 1)
                    if found is not None:
                        return found
        return None

    return trace(argument, _scope(module, call), call.lineno, 0)


# --------------------------------------------------------------------------------------------
# Determinism switches a file sets (the probe reports those on lines that did not run)

_ASSIGNED_SWITCHES = {
    "cudnn.benchmark": "cudnn_benchmark",
    "cudnn.allow_tf32": "cudnn_allow_tf32",
    "cudnn.deterministic": "cudnn_deterministic",
    "matmul.allow_tf32": "cuda_matmul_allow_tf32",
}
"""The end of an assignment's dotted target -> the switch (``ProbeSettings``'s field name)."""
_CALLED_SWITCHES = {
    "set_float32_matmul_precision": "float32_matmul_precision",
    "use_deterministic_algorithms": "deterministic_algorithms",
}
"""The end of a call's dotted name -> the switch it sets."""
_CUDA_WORDS = ("cuda", "gpu", "device")
_SWITCHES: dict[str, list[dict[str, Any]]] = {}


def _dotted(node: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _switch(node: ast.stmt) -> tuple[str, Any, dict[str, Any]] | None:
    """``(switch, value, extra)`` a statement sets with a literal value, else None."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        name = _dotted(node.targets[0])
        value = node.value
        for suffix, switch in _ASSIGNED_SWITCHES.items():
            named = name is not None and (name == suffix or name.endswith("." + suffix))
            if named and isinstance(value, ast.Constant) and isinstance(value.value, bool):
                return switch, value.value, {}
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        call = node.value
        name = _dotted(call.func)
        for suffix, switch in _CALLED_SWITCHES.items():
            if name is None or not (name == suffix or name.endswith("." + suffix)) or not call.args:
                continue
            first = call.args[0]
            if not isinstance(first, ast.Constant):
                return None
            extra: dict[str, Any] = {}
            for keyword in call.keywords:
                if keyword.arg == "warn_only" and isinstance(keyword.value, ast.Constant):
                    extra["warn_only"] = bool(keyword.value.value)
            return switch, first.value, extra
    return None


def _condition(module: ast.Module, node: ast.AST, text: str) -> tuple[str | None, bool]:
    """The innermost ``if`` that decides whether ``node`` runs (``if X`` / ``else of if X``), and
    whether that test names CUDA (a GPU, a device)."""
    parents = _parents(module)
    child: ast.AST = node
    current = parents.get(id(node))
    while current is not None and not isinstance(
        current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)
    ):
        if isinstance(current, ast.If):
            test = ast.get_source_segment(text, current.test) or "..."
            test = " ".join(test.split())
            branch = f"if {test}" if child in current.body else f"else of if {test}"
            return branch, any(w in test.lower() for w in _CUDA_WORDS)
        child, current = current, parents.get(id(current))
    return None, False


def switch_statements(filename: str) -> list[dict[str, Any]]:
    """The statements of ``filename`` that set a determinism switch to a literal value: each
    ``{"text", "switch", "value", "line", "end_line", "condition", "cuda"}`` (plus ``warn_only`` for
    ``use_deterministic_algorithms``), cached."""
    if filename not in _SWITCHES:
        found: list[dict[str, Any]] = []
        module = tree(filename)
        if module is not None:
            text = "".join(linecache.getlines(filename))
            for node in ast.walk(module):
                if not isinstance(node, ast.stmt):
                    continue
                switch = _switch(node)
                if switch is None:
                    continue
                condition, cuda = _condition(module, node, text)
                written = " ".join((ast.get_source_segment(text, node) or "").split())
                found.append(
                    {
                        "text": written if len(written) <= 120 else written[:117] + "...",
                        "switch": switch[0],
                        "value": switch[1],
                        **switch[2],
                        "line": node.lineno,
                        "end_line": node.end_lineno or node.lineno,
                        "condition": condition,
                        "cuda": cuda,
                    }
                )
        _SWITCHES[filename] = sorted(found, key=lambda s: s["line"])
    return _SWITCHES[filename]


_ACCUMULATION_CALLS = {"no_sync": "DDP", "set_requires_gradient_sync": "FSDP2"}
_ACCUMULATIONS: dict[str, list[dict[str, Any]]] = {}


def accumulation_statements(filename: str) -> list[dict[str, Any]]:
    """The calls in ``filename`` that accumulate gradients under stock DDP or FSDP2 (the module
    invariants): each ``{"text", "call", "wrapper", "line"}``, cached."""
    if filename not in _ACCUMULATIONS:
        found: list[dict[str, Any]] = []
        module = tree(filename)
        if module is not None:
            text = "".join(linecache.getlines(filename))
            for node in ast.walk(module):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                wrapper = _ACCUMULATION_CALLS.get(node.func.attr)
                if wrapper is None:
                    continue
                first = node.args[0] if node.args else None
                if wrapper == "FSDP2" and isinstance(first, ast.Constant) and first.value is True:
                    continue  # syncing every backward: no accumulation before the reduction
                written = " ".join((ast.get_source_segment(text, node) or "").split())
                found.append(
                    {
                        "text": written if len(written) <= 120 else written[:117] + "...",
                        "call": node.func.attr,
                        "wrapper": wrapper,
                        "line": node.lineno,
                    }
                )
        _ACCUMULATIONS[filename] = sorted(found, key=lambda s: s["line"])
    return _ACCUMULATIONS[filename]
