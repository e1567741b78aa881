"""The child's session: what configuring a process sets up, shared by the bootstrap and by the
python children a script starts (``_child.children``), torn down at exit.

Invariants:
- ``configure`` seeds and sets the switches (and, with ``portable``, turns oneDNN off) before the
  script's first line, and installs the hooks (``_child.hooks``) before the script can create an
  optimizer or a DataLoader; with an audit spec the audit's settings probe (``_child.probe``) is
  installed first (once per process), and counts the session's backward steps as training; an
  audited python child writes its op record as ``runrecord.ops_process_path`` when it has no rank
  of its own, with the facts ``audit.threads`` notes about each op's calls.
- The events file is chosen at the first event (``rankclaim.RankClaim``): the process group's rank
  if initialised, else the rank the environment names, else 0; a rank a script-started process
  already records is not written twice.
- ``max_steps=N`` ends the run with exit code 0 right after the N-th optimizer step (or, in a
  script no optimizer sees, as the (N+1)-th ``backward()`` starts, after the N-th update), events
  flushed (``MaxStepsReached``); at exit a ``final`` event holds the state of every module the
  script's globals hold; the tracing package is imported only when the spec asks for a trace or
  an op record. With ``compile_probe`` the traced step is not op-traced: its compiled graph calls
  are compared with eager runs of the same graphs (``tracing.compiled``, installed at configure,
  before the script compiles anything).
- A configured process reaches the interpreter's exit only once torch's gloo worker threads are
  idle (``_child.teardown``, installed at ``configure``): its finalization, which closes the files
  the script left open, runs as for plain python.
- ``kill_at=K`` (``check --vary resume``): before the (K+1)-th step of the first optimizer, after
  everything the script did after step K, the process notes ``runrecord.killpoint_path`` and
  waits for the check to SIGKILL its run (a crash at a moment the check chose, on every rank);
  ``resume_states`` notes the RNG states before every such step and the parameters and optimizer
  state before a process's first (``runrecord.states_path``): what a restarted run is aligned by.
- ``compile="compiled"`` (``check --vary compile``): each compilation Dynamo finishes is counted in
  ``runrecord.compiled_path`` (hooked when Dynamo is imported, never importing it), so a run that
  compiled nothing is told from one that did.
- A process forked from a configured one inherits its hooks but records nothing (the recorder
  stays silent there) and never traces; when it trains (an optimizer step, a ``backward()`` step)
  it leaves one ``uncovered`` note, so a check says the training ran unrecorded.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import torchrepro.recorder as _recorder
from torchrepro import _runtime, runrecord
from torchrepro._child import teardown
from torchrepro._child.hooks import install_hooks, install_world_hook, worker_mapping
from torchrepro._child.probe import SettingsProbe, install_probe
from torchrepro._child.rankclaim import RankClaim
from torchrepro._child.training import BackwardSteps
from torchrepro._imports import when_imported
from torchrepro._io import atomic_write_json
from torchrepro._runtime import env_rank
from torchrepro.events import FINAL_KEY
from torchrepro.protocol import BACKWARD_STEPS, ChildSpec
from torchrepro.recorder import Recorder

__all__ = ["MaxStepsReached", "Session", "configure"]


class MaxStepsReached(SystemExit):
    """Raised from the optimizer hook after ``max_steps`` optimizer steps: a clean exit 0."""


class Session:
    """Everything the bootstrap set up in this process, torn down at exit."""

    def __init__(self, spec: ChildSpec, script: str | None, *, main: bool = True) -> None:
        self.main = main
        self.pid = os.getpid()
        self._fork_noted: int | None = None  # the forked process that noted its training
        self.claim: RankClaim | None = None
        self.varied: list[tuple[int, int]] = []  # (num_workers asked, used) per DataLoader varied
        self.spec = spec
        self.trace_out = spec.trace_out  # None once tracing turned out to be unavailable
        self.tracer: Any = None
        self.compiled_probe: Any = None  # spec.compile_probe: compiled graphs against eager, not ops
        self.ops_recorder: Any = None
        self.recorder: Recorder | None = None
        self.steps: dict[int, int] = {}
        self.has_optimizer = False
        self.backward_steps: BackwardSteps | None = None
        self.probe: SettingsProbe | None = None
        self._state_noted = False  # the parameters and optimizer state of the first step (resume)
        if spec.record_dir:
            kwargs = {} if spec.record_values is None else {"values_max": spec.record_values}
            self.claim = RankClaim(spec.record_dir, main=main)
            self.recorder = Recorder(None, claim=self.claim.open, whole_shards=spec.whole_shards, **kwargs)
            local_zero = main and int(os.environ.get("LOCAL_RANK", "0") or 0) == 0
            node = _node() if spec.nnodes else None
            if local_zero and ((env_rank() or 0) == 0 or node is not None):
                _write_env(spec.record_dir, script, node=node, rank_zero=(env_rank() or 0) == 0)
        if self.ships:
            from torchrepro._child.ship import post_token

            assert spec.record_dir is not None
            post_token(spec.record_dir)
        self.compiles = 0
        if spec.compile == "compiled" and spec.record_dir and main:
            when_imported("torch._dynamo", self._watch_compiles)  # never imports Dynamo itself

    @property
    def rank(self) -> int | None:
        """The rank this process records as (None: a child with no rank of its own, or none yet)."""
        if self.claim is not None and self.claim.rank is not None:
            return self.claim.rank
        return (env_rank() or 0) if self.main else None

    def _watch_compiles(self, dynamo: Any) -> None:
        """Count the compilations Dynamo finishes in this process (``check --vary compile`` tells a
        run that compiled from one that only imported Dynamo)."""
        import torch._dynamo.callback as callback

        callback.callback_handler.register_end_callback(self._compiled)

    def _compiled(self, *args: Any) -> None:
        rank = self.rank
        if os.getpid() != self.pid or rank is None or not self.spec.record_dir:
            return
        self.compiles += 1
        try:
            runrecord.write_compiled(self.spec.record_dir, rank, self.compiles)
        except OSError as exc:
            print(f"torchrepro: could not note a compilation: {exc}", file=sys.stderr)

    def on_join(self, rank: int, world_size: int) -> None:
        if self.spec.record_dir:
            try:
                node = _node() if self.spec.nnodes else None
                host = socket.gethostname() if node is not None else None
                runrecord.write_world(self.spec.record_dir, rank, world_size, node=node, host=host)
            except (OSError, TypeError, ValueError) as exc:
                print(f"torchrepro: could not note rank {rank} of {world_size}: {exc}", file=sys.stderr)

    # --- tracing (spec.trace_step / spec.ops_out) ---
    def install_compiled_probe(self) -> None:
        """``compile_probe``: keep every graph Inductor compiles from now on, to compare the traced
        step's calls with eager runs of the same graphs (``tracing.compiled``)."""
        if not self.spec.compile_probe or self.trace_out is None or not self.main:
            return
        try:
            from torchrepro.tracing.compiled import CompiledProbe

            probe = CompiledProbe(runrecord.trace_path(self.trace_out, env_rank() or 0))
            probe.install()
            self.compiled_probe = probe
        except Exception as exc:  # locating is best effort: never break the run
            print(f"torchrepro bootstrap: the compiled-graph probe is unavailable: {exc}", file=sys.stderr)

    def _start_tracer(self) -> None:
        rank = self.rank
        if self.tracer is not None or self.trace_out is None or rank is None or os.getpid() != self.pid:
            return  # a forked process must not write the trace of the process it was forked from
        if self.compiled_probe is not None:
            self.tracer = self.compiled_probe  # started once; stop() writes its file
            self.compiled_probe = None
            self.tracer.start()
            return
        try:
            from torchrepro.tracing import Tracer

            capture = None
            if self.spec.capture_op is not None and self.spec.capture_out is not None:  # check --repro
                from torchrepro.tracing.capture import CaptureRequest

                capture = CaptureRequest(
                    self.spec.capture_op, *runrecord.capture_paths(self.spec.capture_out, rank)
                )
            self.tracer = Tracer(runrecord.trace_path(self.trace_out, rank), capture=capture)
            self.tracer.start()
            _recorder.trace_pause = self.tracer.paused
        except Exception as exc:  # locating is best effort: never break the run
            print(f"torchrepro bootstrap: op tracing unavailable: {exc}", file=sys.stderr)
            self.trace_out = None
            self.tracer = None

    def _stop_tracer(self) -> None:
        tracer, self.tracer = self.tracer, None
        _recorder.trace_pause = None
        if tracer is not None:
            try:
                tracer.stop()
            except Exception as exc:
                print(f"torchrepro bootstrap: op tracing failed: {exc}", file=sys.stderr)

    def start_ops(self) -> None:
        if not self.spec.ops_out:
            return
        try:
            from torchrepro.audit.threads import facts
            from torchrepro.tracing import OpRecorder

            self.ops_recorder = OpRecorder(facts=facts)
            self.ops_recorder.start()
        except Exception as exc:
            print(f"torchrepro bootstrap: op recording unavailable: {exc}", file=sys.stderr)
            self.ops_recorder = None

    def finish_ops(self) -> None:
        rec, self.ops_recorder = self.ops_recorder, None
        ops_out = self.spec.ops_out
        rank = self.rank
        if rec is None or not ops_out or (rank is None and self.main):
            return
        from torchrepro._io import atomic_write_json

        # a python child the script started, without a rank of its own: a file of its own
        path = (
            runrecord.ops_path(ops_out, rank)
            if rank is not None
            else runrecord.ops_process_path(ops_out, os.getpid())
        )
        try:
            events = rec.stop()
            atomic_write_json(path, [e.to_dict() for e in events])
        except Exception as exc:
            print(f"torchrepro bootstrap: writing the op record failed: {exc}", file=sys.stderr)

    def _forked_training(self) -> bool:
        """In a process forked from this session's (it inherited the hooks): note once that it
        trained unrecorded, and return True; in the configured process itself, False."""
        pid = os.getpid()
        if pid == self.pid:
            return False
        if self._fork_noted != pid and self.spec.record_dir:
            self._fork_noted = pid
            argv = [sys.executable, *sys.argv]  # the script's command line (a fork runs no other)
            why = (
                "it was forked from a process of the run and trained there: a forked process is no new "
                "interpreter, so torchrepro cannot configure it and it records nothing (start it with "
                "the spawn method, or train in the process torchrepro starts)"
            )
            try:
                runrecord.write_uncovered(self.spec.record_dir, pid, argv, why)
            except (OSError, TypeError, ValueError) as exc:
                print(f"torchrepro: a forked process trained unrecorded: {exc}", file=sys.stderr)
        return True

    # --- hooks ---
    def on_init(self, opt: torch.optim.Optimizer, index: int) -> None:
        self.has_optimizer = True  # from now on --steps counts optimizer steps, not backward() calls
        if self.spec.trace_step == 0 and index == self.spec.trace_optimizer:
            self._start_tracer()

    def on_step(self, opt: torch.optim.Optimizer, index: int, step: int) -> None:
        self._forked_training()
        self.steps[index] = step + 1
        if self.spec.trace_step is not None and index == self.spec.trace_optimizer:
            if step == self.spec.trace_step - 1:
                self._start_tracer()
            elif step == self.spec.trace_step:
                self._stop_tracer()
        if self.spec.max_steps is not None and min(self.steps.values()) >= self.spec.max_steps:
            raise MaxStepsReached(0)

    def on_pre_step(
        self, opt: torch.optim.Optimizer, index: int, step: int, items: Callable[[], list[tuple[str, Any]]]
    ) -> None:
        """Before step ``step`` of optimizer ``index``: the states and the kill point of ``check
        --vary resume`` (first optimizer, the configured process only)."""
        if index != 0 or os.getpid() != self.pid or not self.spec.record_dir:
            return
        rank = self.rank
        if rank is None:
            return
        if self.spec.resume_states:
            self._note_state(rank, step, items)
        if self.spec.kill_at is not None and step == self.spec.kill_at:
            self._wait_to_be_killed(rank, step)

    def _note_state(self, rank: int, step: int, items: Callable[[], list[tuple[str, Any]]]) -> None:
        from torchrepro.hashing import fingerprint

        entry: dict[str, Any] = {"step": step, "rng": _rng_fingerprints()}
        if not self._state_noted:
            self._state_noted = True
            with _recorder.paused():
                entry["t"] = [
                    {"n": name, "fp": fingerprint(value)}
                    for name, value in items()
                    if name.startswith(("param:", "state:")) and isinstance(value, torch.Tensor)
                ]
        assert self.spec.record_dir is not None
        try:
            with open(runrecord.states_path(self.spec.record_dir, rank), "a", encoding="utf-8") as f:
                f.write(json.dumps(entry, separators=(",", ":")) + "\n")
        except OSError as exc:
            print(f"torchrepro: could not note the state before step {step}: {exc}", file=sys.stderr)

    def _wait_to_be_killed(self, rank: int, step: int) -> None:
        assert self.spec.record_dir is not None
        atomic_write_json(runrecord.killpoint_path(self.spec.record_dir, rank), {"step": step})
        deadline = time.monotonic() + _KILL_WAIT
        while time.monotonic() < deadline:  # the check SIGKILLs every process of the run
            time.sleep(0.1)
        print(
            f"torchrepro: waited {_KILL_WAIT:.0f} s after step {step} to be killed; ending", file=sys.stderr
        )
        os._exit(70)

    def on_backward(self, step: int, ended: bool) -> None:
        """Steps counted by ``backward()``: training no optimizer sees (``_child.training``)."""
        traced = self.spec.trace_step if self.spec.trace_optimizer == BACKWARD_STEPS else None
        if ended:
            self._forked_training()
        if not ended:
            if traced is not None and step == traced + 1:
                self._stop_tracer()  # step ``trace_step``'s update ran before this backward
            if self.spec.max_steps is not None and not self.has_optimizer and step >= self.spec.max_steps:
                raise MaxStepsReached(0)
        else:
            if self.probe is not None:
                self.probe.after_backward()
            if traced is not None and step == traced - 1:
                self._start_tracer()

    def on_vary(self, original: int, used: int) -> None:
        self.varied.append((original, used))
        self._save_varied()  # now: a check stops a run at its first divergence, before close()

    def _save_varied(self) -> None:
        rank = self.rank
        if self.spec.num_workers is None or not self.spec.record_dir or rank is None:
            return  # a rank learned later saves at close
        try:
            runrecord.write_varied(self.spec.record_dir, rank, self.varied)
        except OSError as exc:
            print(f"torchrepro: could not note the varied DataLoaders: {exc}", file=sys.stderr)

    def close(self) -> None:
        """Flush and write what the run recorded."""
        if self.backward_steps is not None:
            self.backward_steps.flush(last=True)  # the last hand-written update
        self._stop_tracer()
        self.finish_ops()
        if self.recorder is not None:
            _record_final_state(self.recorder)
            self.recorder.close()
        if self.claim is not None and self.main:
            self.claim.touch()
        self._save_varied()

    @property
    def ships(self) -> bool:
        """Whether this process's records travel to the node of rank 0 at its end (``_child.ship``)."""
        spec = self.spec
        return self.main and bool(spec.record_dir) and (spec.nnodes or 1) > 1 and not spec.relayed

    def ship(self, *, failed: bool) -> None:
        """After ``close``: send this rank's records to the node of global rank 0 (rank 0: receive
        every rank's); ``failed``: the script failed here (wait less for peers)."""
        if not self.ships:
            return
        from torchrepro._child.ship import ship_records
        from torchrepro._io import wait_pending

        assert self.spec.record_dir is not None
        try:
            wait_pending(self.spec.record_dir)  # every record file published before it travels
        except OSError as exc:
            print(f"torchrepro: a record file was not written: {exc}", file=sys.stderr)
        ship_records(self.spec.record_dir, failed=failed)


_KILL_WAIT = 600.0
"""Seconds a process at its kill point waits for the check to kill it (then it ends itself)."""


def _rng_fingerprints() -> dict[str, str]:
    """The fingerprints of the global RNG states this process has: torch's CPU generator, CUDA's
    (once initialised), NumPy's legacy global one (once imported) and Python's ``random``."""
    from torchrepro.hashing import fingerprint

    with _recorder.paused():
        found = {"torch": fingerprint(torch.get_rng_state())}
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            found["cuda"] = fingerprint(torch.cuda.get_rng_state_all())
        np = sys.modules.get("numpy")
        if np is not None:
            state = np.random.get_state()
            found["numpy"] = fingerprint([state[1], int(state[2])])
        found["python"] = fingerprint(list(random.getstate()[1]))
    return found


def _record_final_state(recorder: Recorder) -> None:
    """One ``final`` event: the state of every module the script's globals hold, at exit."""
    main = sys.modules.get("__main__")
    if main is None:
        return
    items: list[tuple[str, Any]] = []
    seen: set[int] = set()
    try:
        for var, value in sorted(vars(main).items()):
            if isinstance(value, torch.nn.Module) and id(value) not in seen:
                seen.add(id(value))
                items.extend((f"final:{var}.{k}", v) for k, v in value.state_dict().items())
        if items:
            recorder.write("compute", FINAL_KEY, recorder.current_step, items, named=True)
    except Exception as exc:  # never turn a finished run into a failed one
        print(f"torchrepro bootstrap: recording the final state failed: {exc}", file=sys.stderr)


def _node() -> int | None:
    """This process's node in a multi-node run (torchrun's ``GROUP_RANK``); None: not known."""
    text = os.environ.get("GROUP_RANK", "")
    return int(text) if text.isdigit() else None


def _write_env(
    record_dir: str, script: str | None, *, node: int | None = None, rank_zero: bool = True
) -> None:
    """The run's ``env.json`` (``rank_zero``: the process of global rank 0) and, in a multi-node
    run, this node's ``env.node<N>.json`` (its local rank 0), collected once."""
    try:
        from torchrepro.env import collect_env

        env = collect_env(script=script).to_dict()
    except Exception as exc:  # the record stays useful without it
        env = {"error": f"collect_env failed: {type(exc).__name__}: {exc}"}
    for target in ([None] if rank_zero else []) + ([] if node is None else [node]):
        try:
            runrecord.write_env(record_dir, env, node=target)
        except (OSError, TypeError, ValueError) as exc:
            name = runrecord.ENV_FILE if target is None else runrecord.node_env_path(record_dir, target).name
            print(f"torchrepro bootstrap: could not write {name}: {exc}", file=sys.stderr)


def _configure(spec: ChildSpec) -> None:
    """Threads, portable mode, seeds and switches, before the script's first line."""
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    if spec.portable:
        from torchrepro.portable import disable_onednn

        disable_onednn()
    if spec.seed is not None:
        from torchrepro.seeding import seed_everything

        seed_everything(spec.seed)
    if spec.mode is not None:
        from torchrepro.flags import set_determinism

        set_determinism(spec.mode)
    _runtime.mark_bootstrapped(seeded=spec.seed is not None)


def configure(spec: ChildSpec, script: str | None, *, main: bool = True) -> Session:
    """Seed, set the switches and install the hooks in this process; return what was set up.

    ``main``: the process torchrepro started; otherwise a python child the script started
    (``_child.children``), which records only under a rank of its own.
    """
    probe = install_probe(spec.audit_settings_out, main=main) if spec.audit_settings_out else None
    _configure(spec)
    teardown.install()
    session = Session(spec, script, main=main)
    session.probe = probe
    session.backward_steps = install_hooks(
        session.recorder,
        num_workers=worker_mapping(spec.num_workers),
        on_vary=session.on_vary if spec.num_workers is not None else None,
        on_init=session.on_init,
        on_step=session.on_step,
        on_pre_step=session.on_pre_step if spec.kill_at is not None or spec.resume_states else None,
        on_backward=(
            session.on_backward if spec.max_steps or spec.trace_step is not None or spec.record_dir else None
        ),
    )
    if probe is not None:
        probe.backward = session.backward_steps  # the probe counts backward steps as the session does
    if spec.record_dir:
        install_world_hook(session.on_join)
    session.start_ops()
    session.install_compiled_probe()
    if spec.trace_step == 0 and spec.trace_optimizer == BACKWARD_STEPS:
        session._start_tracer()  # step 0 of training no optimizer sees: from the script's start
    return session
