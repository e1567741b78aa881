"""The child-process bootstrap: ``python -m torchrepro._child.bootstrap [--] script.py|-m module [args]``.

Configured only by the child protocol (``ChildSpec.from_env()``; see ``protocol``). Invariants:
- With no protocol variable set it behaves like plain ``python script.py``: the script's
  ``__main__`` semantics (``sys.argv``, its directory first on ``sys.path``, its exit code and
  tracebacks) are those of python, and nothing is seeded or switched.
- A malformed spec ends the child with exit code 2 and one line naming the variable, before the
  script runs.
- ``session.configure`` (shared with the children the script starts, ``_child.children``) seeds,
  sets the switches and installs the hooks before the first line of the script; see
  ``_child.session`` for what a session records and when a run stops (``max_steps``).
"""

from __future__ import annotations

import builtins
import importlib.machinery
import importlib.util
import io
import os
import signal
import sys
import traceback
import types
from typing import Any

from torchrepro._child.session import MaxStepsReached, configure
from torchrepro.protocol import ChildSpec


def _usage() -> SystemExit:
    return SystemExit(
        "usage: python -m torchrepro._child.bootstrap [--] script.py [args...] | -m module [args...]"
    )


def _parse(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise _usage()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise _usage()
        return None, argv[1], argv[2:]
    return argv[0], None, argv[1:]


def _script_code(path: str) -> types.CodeType:
    with io.open_code(path) as f:
        source = f.read()
    return compile(source, path, "exec", dont_inherit=True)


def _module_code(name: str) -> tuple[types.CodeType, importlib.machinery.ModuleSpec]:
    """The code and spec ``python -m name`` runs (a package runs its ``__main__``)."""
    try:
        spec = importlib.util.find_spec(name)
    except ImportError as exc:  # a missing parent package: python -m says it in one line too
        raise SystemExit(
            f"{sys.executable}: Error while finding module specification for {name!r} ({exc})"
        ) from None
    if spec is None:
        raise SystemExit(f"{sys.executable}: No module named {name}")
    if spec.submodule_search_locations is not None:  # a package: run its __main__
        return _module_code(f"{name}.__main__")
    loader = spec.loader
    get_code = getattr(loader, "get_code", None)
    code = get_code(name) if get_code is not None else None
    if code is None:
        raise SystemExit(f"{sys.executable}: No code object available for {name}")
    return code, spec


def _run_as_main(
    code: types.CodeType, *, file: str | None, spec: importlib.machinery.ModuleSpec | None
) -> None:
    """Execute ``code`` as the real ``__main__`` module, which stays alive until interpreter exit.

    Like python (and unlike ``runpy.run_path``, whose temporary module is dropped on return), the
    script's globals are only destroyed at interpreter shutdown: destroying them earlier, e.g. a
    DDP model holding a gloo process group, can deadlock with torch's background threads.
    """
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=file, __cached__=None, __spec__=spec, __builtins__=builtins)
    main.__dict__["__loader__"] = spec.loader if spec is not None else None
    main.__dict__["__package__"] = spec.parent if spec is not None else None
    previous = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    if sys.modules.get("__mp_main__") is previous:
        # multiprocessing, imported with torch before the script, aliased the bootstrap as its main
        # module; it aliases the script's under python. That alias also keeps the module alive into
        # the interpreter's finalization, which then clears its globals (closing the files they
        # hold) even when something still references them (a hook's function globals).
        sys.modules["__mp_main__"] = main
    exec(code, main.__dict__)


def _print_user_traceback(exc: BaseException) -> None:
    """Print the traceback like python would, without the bootstrap's frames."""
    tb = exc.__traceback__
    skip = {os.path.abspath(__file__)}
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in skip:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def main(argv: list[str] | None = None) -> int:
    """Run a script or module like python would, under the settings the environment gives."""
    script, module, args = _parse(sys.argv[1:] if argv is None else argv)
    if script is not None and not os.path.exists(script):
        print(f"torchrepro: can't open file {script!r}: no such file", file=sys.stderr)
        return 2
    try:
        spec = ChildSpec.from_env()
    except ValueError as exc:
        print(f"torchrepro bootstrap: {exc}", file=sys.stderr)
        return 2
    session = configure(spec, script)
    code: Any = 0
    try:
        if script is not None:
            sys.argv = [script, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            _run_as_main(_script_code(script), file=script, spec=None)
        else:
            assert module is not None
            sys.path[0] = os.getcwd()
            module_code, module_spec = _module_code(module)
            sys.argv = [module_spec.origin or module, *args]
            _run_as_main(module_code, file=module_spec.origin, spec=module_spec)
    except MaxStepsReached:
        code = 0
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt as exc:  # Ctrl-C: the user's frames, and the code a shell shows
        _print_user_traceback(exc)
        code = 128 + signal.SIGINT
    except Exception as exc:
        _print_user_traceback(exc)
        code = 1
    finally:
        session.close()
    sys.stdout.flush()
    sys.stderr.flush()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    session.ship(failed=code != 0)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
