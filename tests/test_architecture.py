"""The layout's rules, checked: one owner per shared fact, no import cycles, light imports.

See docs/architecture.md for the parts and what each owns.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "torchrepro"
MODULES = sorted(SRC.rglob("*.py"))


def _name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string constant that is not a docstring, with its line."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def _spelled(needles: tuple[str, ...], owner: str) -> list[str]:
    """Non-docstring strings outside ``owner`` matching a needle (a regular expression)."""
    found = []
    for path in MODULES:
        if _name(path) == owner:
            continue
        for line, text in _strings(ast.parse(path.read_text(encoding="utf-8"))):
            hits = [n for n in needles if re.search(n, text)]
            if hits:
                found.append(f"{path.relative_to(SRC.parent)}:{line}: {hits}")
    return found


def test_only_the_child_protocol_names_torchrepro_variables() -> None:
    assert _spelled(("TORCHREPRO_",), "torchrepro.protocol") == []


RECORD_FILES = (
    r"command\.json",
    r"settings\.json",
    r"env\.json",
    r"events\.rank",
    r"(?<!--)trace-step",  # the file prefix, not the --trace-step flag
    r"verdict\.json",
    r"stdout\.log",
    r"stderr\.log",
    r"writes\.jsonl",
    r"files\.deleted",
)


def test_only_runrecord_names_record_files() -> None:
    assert _spelled(RECORD_FILES, "torchrepro.runrecord") == []


def test_only_the_protocol_spells_process_start_variables() -> None:
    """PYTHONHASHSEED and the OpenMP/oneMKL thread counts: names a launcher sets and a run records."""
    assert (
        _spelled((r"^PYTHONHASHSEED$", r"^OMP_NUM_THREADS$", r"^MKL_NUM_THREADS$"), "torchrepro.protocol")
        == []
    )


def test_only_runrecord_spells_the_records_root() -> None:
    """``.torchrepro`` as a path (help texts may name it in words)."""
    assert _spelled((r"^\.torchrepro(/|$)",), "torchrepro.runrecord") == []


def test_the_owner_checks_can_fail() -> None:
    """Negative control: the scan does see spelled names (a docstring alone does not count)."""
    tree = ast.parse('"""doc: env.json"""\nx = "TORCHREPRO_SEED"\ny = f"events.rank{0}.jsonl"\n')
    texts = [t for _, t in _strings(tree)]
    assert "TORCHREPRO_SEED" in texts and any("events.rank" in t for t in texts)
    assert not any("env.json" in t for t in texts)


def test_only_the_flags_module_spells_modes_and_cublas_values() -> None:
    assert _spelled((":4096:8", ":16:8", r"\(\s*\"strict\", \"warn\""), "torchrepro.flags") == []


def test_only_the_portable_module_spells_mkl_cbwr_values() -> None:
    assert _spelled((r"AVX\d*,STRICT", r"MKL_CBWR="), "torchrepro.portable") == []


def test_only_tracing_touches_dispatch_internals() -> None:
    offenders = []
    for path in MODULES:
        if _name(path).startswith("torchrepro.tracing"):
            continue
        text = path.read_text(encoding="utf-8")
        if "_python_dispatch" in text or "torch._dispatch" in text or "TorchDispatchMode" in text:
            offenders.append(_name(path))
    assert offenders == []


def _module_level_imports(
    path: Path, name: str | None = None, *, in_functions: bool = False, type_checking: bool = False
) -> set[str]:
    """torchrepro modules imported when ``path`` is imported (``in_functions``: also those its
    functions and methods import when they run; ``type_checking``: also those imported for types
    only, under ``if TYPE_CHECKING:``, but in a package's lazy face, whose block mirrors the names
    its submodules hold for type checkers)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = _name(path) if name is None else name
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    type_checking = type_checking and path.name != "__init__.py"
    out: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not type_checking:
                continue
            if in_functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(node.body)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name.startswith("torchrepro"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(p for p in [*parts[: len(parts) - node.level + 1], base] if p)
                if not base.startswith("torchrepro"):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    out.add(sub if any(_name(p) == sub for p in MODULES) else base)

    visit(tree.body)
    return out


@pytest.mark.parametrize(
    ("in_functions", "type_checking"),
    [(False, False), (True, False), (True, True)],
    ids=["module-level", "in-functions-too", "type-imports-too"],
)
def test_no_import_cycles(in_functions: bool, type_checking: bool) -> None:
    """No cycle among imports, module-level or inside functions (a lazy import that closes a cycle
    hides an order dependence between two parts: the bootstrap and the children it configured),
    nor counting imports for types only: a type belongs below the code that produces it
    (``results``), so the parts that name it (``errors``, ``verdict``) never reach up for it."""
    graph = {
        _name(p): _module_level_imports(p, in_functions=in_functions, type_checking=type_checking)
        - {_name(p)}
        for p in MODULES
    }
    for name, deps in graph.items():  # importing a.b.c imports its packages a and a.b first
        for dep in list(deps):
            parts = dep.split(".")
            deps.update(".".join(parts[:i]) for i in range(1, len(parts)))
        deps.discard(name)
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def dfs(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                dfs(dep, [*stack, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node, [node])
    assert cycles == []


def test_cycle_detection_can_fail(tmp_path: Path) -> None:
    """Negative control: the import scan sees the edges a cycle needs, in functions when asked."""
    a = tmp_path / "a.py"
    a.write_text(
        "from torchrepro import runrecord\nimport torchrepro.launch as _l\nfrom . import check\n"
        "def f():\n    from torchrepro._child.session import configure\n"
        "class C:\n    def m(self):\n        if True:\n            import torchrepro.env\n"
    )
    found = _module_level_imports(a, "torchrepro.a")
    assert {"torchrepro.runrecord", "torchrepro.launch", "torchrepro.check"} <= found
    assert not {"torchrepro._child.session", "torchrepro.env"} & found
    assert {"torchrepro._child.session", "torchrepro.env"} <= _module_level_imports(
        a, "torchrepro.a", in_functions=True
    )


CLI_LAZY = {
    "torchrepro.protocol",
    "torchrepro.portable",
    "torchrepro.audit",
    "torchrepro.check",
    "torchrepro.compare",
    "torchrepro.env",
    "torchrepro.flags",
    "torchrepro.launch",
    "torchrepro.nodes",
    "torchrepro.runrecord",
    "torchrepro.report",
    "torchrepro.seeding",
    "torchrepro.status_report",
}
"""What the command line imports only when a command needs it (``--help`` and ``--version`` stay
fast): a new lazy import is a decision, listed here, and the cycle test above covers it."""


def test_the_command_lines_lazy_imports_are_the_listed_ones() -> None:
    path = SRC / "cli.py"
    lazy = _module_level_imports(path, in_functions=True) - _module_level_imports(path)
    assert lazy == CLI_LAZY


def _loaded_after(code: str, first: str = "import torch") -> list[str]:
    probe = (
        f"import sys, json; {first}; before = set(sys.modules); {code}; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout))


def test_import_torchrepro_loads_no_submodule() -> None:
    loaded = _loaded_after("import torchrepro", first="pass")
    assert [m for m in loaded if m.startswith("torchrepro.")] == ["torchrepro._lazy"]  # stdlib only
    assert "torch" not in loaded  # nothing at all until a name is used


@pytest.mark.parametrize(
    "module",
    # data and checkpoint are lazy packages: their loader and restore modules import the rest
    [
        "torchrepro.data",
        "torchrepro.data.loader",
        "torchrepro.seeding",
        "torchrepro.checkpoint",
        "torchrepro.checkpoint.restore",
    ],
)
def test_importing_one_part_does_not_load_tracing(module: str) -> None:
    loaded = _loaded_after(f"import {module}")
    assert [m for m in loaded if m.startswith("torchrepro.tracing") or "dispatch" in m] == []


def test_using_trace_loads_tracing() -> None:
    """Control for the test above: the probe does see tracing when it is used."""
    loaded = _loaded_after("import torchrepro; torchrepro.trace")
    assert "torchrepro.tracing.tracer" in loaded


def test_the_pytest_plugin_imports_nothing_heavy() -> None:
    """The plugin loads in every pytest session wherever torchrepro is installed: pytest and the
    standard library only, until a test uses the fixture or the marker."""
    loaded = _loaded_after("import pytest; import torchrepro.testing.plugin", first="pass")
    assert "torch" not in loaded and "numpy" not in loaded
    assert sorted(m for m in loaded if m.startswith("torchrepro.")) == [
        "torchrepro._lazy",
        "torchrepro.errors",
        "torchrepro.testing",
        "torchrepro.testing.plugin",
    ]


def test_only_the_plugin_imports_pytest() -> None:
    """pytest is no dependency: the library and ``assert_reproducible`` work without it."""
    importers = [
        _name(p)
        for p in MODULES
        if re.search(r"^\s*(import pytest|from pytest|from _pytest)", p.read_text(encoding="utf-8"), re.M)
    ]
    assert importers == ["torchrepro.testing.plugin"]


def test_the_command_lines_parent_imports_no_torch() -> None:
    """Parsing arguments and starting children (run, check, compare) never pays for ``import torch``."""
    parent = "import torchrepro.cli, torchrepro.launch, torchrepro.check, torchrepro.compare"
    loaded = _loaded_after(
        f"{parent}; torchrepro.cli.build_parser().parse_args(['run', 'x.py'])", first="pass"
    )
    assert "torch" not in loaded and "numpy" not in loaded


def test_the_parent_probe_sees_torch_when_it_is_imported() -> None:
    """Control for the test above: a module that needs torch does load it."""
    assert "torch" in _loaded_after("import torchrepro.recorder", first="pass")


def _face_imports(path: Path) -> list[str]:
    """Imports of the package face (``torchrepro/__init__``) in ``path``, at any depth."""
    submodules = {p.stem for p in SRC.iterdir() if p.suffix == ".py"} | {
        p.name for p in SRC.iterdir() if p.is_dir()
    }
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import torchrepro" for a in node.names if a.name == "torchrepro"]
        elif isinstance(node, ast.ImportFrom) and node.module == "torchrepro" and node.level == 0:
            found += [
                f"{node.lineno}: from torchrepro import {a.name}"
                for a in node.names
                if a.name not in submodules
            ]
    return found


def test_no_module_imports_the_package_face() -> None:
    """The face (``torchrepro/__init__``) is for users: a part that imported it would load whatever
    it re-exports, and ties every part to the whole (``env.py`` took ``__version__`` from it)."""
    offenders = {_name(p): found for p in MODULES if (found := _face_imports(p))}
    assert offenders == {}


def test_the_face_import_scan_can_fail(tmp_path: Path) -> None:
    """Negative control: the scan sees a face import inside a function, and not a submodule's."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f():\n    from torchrepro import __version__\n    from torchrepro import runrecord\n"
    )
    assert _face_imports(probe) == ["2: from torchrepro import __version__"]
