"""The child-process bootstrap: ``python -m torchrepro._bootstrap [--] script.py|-m module [args]``.

Configured only by environment variables (see PROTOCOL: ``TORCHREPRO_SEED``, ``_MODE``,
``_RECORD_DIR``, ``_MAX_STEPS``, ``_TRACE_STEP``/``_TRACE_OUT``, ``_OPS_OUT``, plus
``_THREADS``, ``_NUM_WORKERS``, ``_RECORD_VALUES``, ``_TRACE_OPTIMIZER``). Invariants:
- With no ``TORCHREPRO_*`` variable set it behaves like plain ``python script.py``: the
  script's ``__main__`` semantics (``sys.argv``, its directory first on ``sys.path``, its exit
  code and tracebacks) are those of python, and nothing is seeded or switched.
- Seeding and switches happen before the first line of the script; hooks are installed before
  the script can create an optimizer or a DataLoader.
- ``TORCHREPRO_MAX_STEPS=N`` ends the run with exit code 0 right after the N-th optimizer step,
  events flushed; the trace module is imported only when a trace variable is set.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.machinery
import importlib.util
import io
import os
import sys
import traceback
import types
from typing import Any

import torch

import torchrepro.launch as _launch
import torchrepro.record as _record
from torchrepro.record import Recorder, events_path, install_hooks


class _MaxStepsReached(SystemExit):
    """Raised from the optimizer hook after TORCHREPRO_MAX_STEPS steps: a clean exit 0."""


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"torchrepro bootstrap: {name} must be an integer, got {value!r}") from None


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def _usage() -> SystemExit:
    return SystemExit("usage: python -m torchrepro._bootstrap [--] script.py [args...] | -m module [args...]")


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


def _worker_mapping(spec: str | None) -> Any:
    if not spec:
        return None
    if spec == "other":
        return lambda n: 0 if n > 0 else 2
    fixed = int(spec)
    return lambda n: fixed


class _Session:
    """Everything the bootstrap set up in this process, torn down at exit."""

    def __init__(self, script: str | None) -> None:
        self.rank = _rank()
        self.max_steps = _int_env("TORCHREPRO_MAX_STEPS")
        self.trace_step = _int_env("TORCHREPRO_TRACE_STEP")
        self.trace_out = os.environ.get("TORCHREPRO_TRACE_OUT")
        self.trace_optimizer = _int_env("TORCHREPRO_TRACE_OPTIMIZER") or 0
        self.ops_out = os.environ.get("TORCHREPRO_OPS_OUT")
        self.tracer: Any = None
        self.ops_recorder: Any = None
        self.recorder: Recorder | None = None
        self.steps: dict[int, int] = {}
        record_dir = os.environ.get("TORCHREPRO_RECORD_DIR")
        if record_dir:
            values_max = _int_env("TORCHREPRO_RECORD_VALUES")
            kwargs = {} if values_max is None else {"values_max": values_max}
            self.recorder = Recorder(events_path(record_dir, self.rank), **kwargs)
            if self.rank == 0 and int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
                _write_env(record_dir, script)

    # --- tracing (TORCHREPRO_TRACE_STEP / TORCHREPRO_OPS_OUT) ---
    def _start_tracer(self) -> None:
        if self.tracer is not None or self.trace_out is None:
            return
        try:
            from torchrepro.trace import Tracer

            self.tracer = Tracer(f"{self.trace_out}.rank{self.rank}")
            self.tracer.start()
            _record.trace_pause = self.tracer.paused
        except Exception as exc:  # locating is best effort: never break the run
            print(f"torchrepro bootstrap: op tracing unavailable: {exc}", file=sys.stderr)
            self.trace_out = None
            self.tracer = None

    def _stop_tracer(self) -> None:
        tracer, self.tracer = self.tracer, None
        _record.trace_pause = None
        if tracer is not None:
            try:
                tracer.stop()
            except Exception as exc:
                print(f"torchrepro bootstrap: op tracing failed: {exc}", file=sys.stderr)

    def start_ops(self) -> None:
        if not self.ops_out:
            return
        try:
            from torchrepro.trace import OpRecorder  # type: ignore[attr-defined]

            self.ops_recorder = OpRecorder()
            self.ops_recorder.start()
        except Exception as exc:
            print(f"torchrepro bootstrap: op recording unavailable: {exc}", file=sys.stderr)
            self.ops_recorder = None

    def finish_ops(self) -> None:
        rec, self.ops_recorder = self.ops_recorder, None
        if rec is None or not self.ops_out:
            return
        from torchrepro._io import atomic_write_json

        try:
            events = rec.stop()
            atomic_write_json(f"{self.ops_out}.rank{self.rank}.json", [e.to_dict() for e in events])
        except Exception as exc:
            print(f"torchrepro bootstrap: writing the op record failed: {exc}", file=sys.stderr)

    # --- hooks ---
    def on_init(self, opt: torch.optim.Optimizer, index: int) -> None:
        if self.trace_step == 0 and index == self.trace_optimizer:
            self._start_tracer()

    def on_step(self, opt: torch.optim.Optimizer, index: int, step: int) -> None:
        self.steps[index] = step + 1
        if self.trace_step is not None and index == self.trace_optimizer:
            if step == self.trace_step - 1:
                self._start_tracer()
            elif step == self.trace_step:
                self._stop_tracer()
        if self.max_steps is not None and min(self.steps.values()) >= self.max_steps:
            raise _MaxStepsReached(0)

    def close(self) -> None:
        self._stop_tracer()
        self.finish_ops()
        if self.recorder is not None:
            self.recorder.close()


def _write_env(record_dir: str, script: str | None) -> None:
    from torchrepro._io import atomic_write_json

    try:
        from torchrepro.env import collect_env

        env = collect_env(script=script).to_dict()  # type: ignore[call-arg,attr-defined,unused-ignore]
    except Exception as exc:  # the record stays useful without it
        env = {"error": f"collect_env failed: {type(exc).__name__}: {exc}"}
    try:
        atomic_write_json(os.path.join(record_dir, "env.json"), env)
    except (OSError, TypeError, ValueError) as exc:
        print(f"torchrepro bootstrap: could not write env.json: {exc}", file=sys.stderr)


def _configure() -> None:
    threads = _int_env("TORCHREPRO_THREADS")
    if threads is not None:
        torch.set_num_threads(threads)
    seed = _int_env("TORCHREPRO_SEED")
    mode = os.environ.get("TORCHREPRO_MODE") or None
    if seed is not None:
        from torchrepro.seeding import seed_everything

        seed_everything(seed)
    if mode is not None:
        from torchrepro.flags import set_determinism

        with contextlib.suppress(NotImplementedError):  # flags.py still a placeholder in this build
            set_determinism(mode)
    _launch._mark_bootstrapped(seeded=seed is not None)


def _script_code(path: str) -> types.CodeType:
    with io.open_code(path) as f:
        source = f.read()
    return compile(source, path, "exec", dont_inherit=True)


def _module_code(name: str) -> tuple[types.CodeType, importlib.machinery.ModuleSpec]:
    """The code and spec ``python -m name`` runs (a package runs its ``__main__``)."""
    spec = importlib.util.find_spec(name)
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
    sys.modules["__main__"] = main
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
    _configure()
    session = _Session(script)
    install_hooks(
        session.recorder,
        num_workers=_worker_mapping(os.environ.get("TORCHREPRO_NUM_WORKERS")),
        on_init=session.on_init,
        on_step=session.on_step,
    )
    session.start_ops()
    code: Any = 0
    try:
        if script is not None:
            sys.argv = [script, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            _run_as_main(_script_code(script), file=script, spec=None)
        else:
            assert module is not None
            sys.path[0] = os.getcwd()
            code, spec = _module_code(module)
            sys.argv = [spec.origin or module, *args]
            _run_as_main(code, file=spec.origin, spec=spec)
    except _MaxStepsReached:
        code = 0
    except SystemExit as exc:
        code = exc.code
    except Exception as exc:
        _print_user_traceback(exc)
        code = 1
    finally:
        session.close()
    sys.stdout.flush()
    sys.stderr.flush()
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
