"""End-to-end: ``torchrepro check`` names the op, module and source line where two runs part.

Each script is copied into a fresh directory and checked from there (so ``location`` is relative),
in real subprocesses (torchrun with gloo for the 2-rank case). Each case is its own negative
control: the divergence is real (check exits 1), and the test asserts that the op, module and line
the tool names are those of the one line that makes the runs differ, not a victim downstream.
The four checks run concurrently to keep the wall time down.

Scripts that load through a DataLoader with worker processes, in a plain loop and under Lightning,
are checked 5 times each: every check must name the same op, module and line (the main process
rebuilds a varying number of worker batches between model ops; those ops must not be aligned).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing  # registers how tensors are pickled between processes
import torch.utils.data

from helpers import marked_line, user_env

SCRIPTS = Path(__file__).parent / "locate_scripts"
CASES: dict[str, tuple[str, ...]] = {
    "dropout_urandom": (),
    "pid_factor": (),
    "custom_backward_noise": (),
    "ddp_rank1": ("--nproc", "2"),
    "idp_rank1": ("--nproc", "3"),
}


def _line(script: Path, marker: str) -> int:
    return marked_line(script, f"locate: {marker}")


def _start_check(
    directory: Path, name: str, *extra: str, script_args: tuple[str, ...] = ()
) -> subprocess.Popen[str]:
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(SCRIPTS / f"{name}.py", directory / f"{name}.py")
    env = user_env()
    return subprocess.Popen(
        [sys.executable, "-m", "torchrepro", "check", "--json", *extra, f"{name}.py", *script_args],
        cwd=directory,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 300) -> tuple[int, dict[str, Any], str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"check timed out:\n{err[-3000:]}") from None
    lines = out.strip().splitlines()
    assert len(lines) == 1, f"stdout must be exactly one JSON object:\n{out}\n{err[-3000:]}"
    return proc.returncode, json.loads(lines[0]), err


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, dict[str, Any], str]]:
    root = tmp_path_factory.mktemp("locate")
    procs = {name: _start_check(root / name, name, *extra) for name, extra in CASES.items()}
    return {name: _finish(proc) for name, proc in procs.items()}


def _divergence(verdicts: dict[str, tuple[int, dict[str, Any], str]], name: str) -> dict[str, Any]:
    code, verdict, err = verdicts[name]
    assert (code, verdict["reproducible"]) == (1, False), err[-3000:]
    first: dict[str, Any] = verdict["first_divergence"]
    assert first["kind"] == "compute", first
    return first


def test_dropout_reseeded_from_urandom_is_located_at_the_dropout_call(
    verdicts: dict[str, tuple[int, dict[str, Any], str]],
) -> None:
    first = _divergence(verdicts, "dropout_urandom")
    assert first["step"] == 2
    assert "bernoulli" in first["op"] or "dropout" in first["op"], first
    script = SCRIPTS / "dropout_urandom.py"
    assert (first["module"], first["location"]) == ("drop", f"dropout_urandom.py:{_line(script, 'dropout')}")


def test_pid_dependent_factor_is_located_at_the_mul_in_its_layer(
    verdicts: dict[str, tuple[int, dict[str, Any], str]],
) -> None:
    first = _divergence(verdicts, "pid_factor")
    assert (first["step"], first["op"]) == (0, "aten.mul.Tensor")
    script = SCRIPTS / "pid_factor.py"
    # model = Sequential(Linear, Sequential(Tanh, Scale), Linear): the Scale layer is "1.1".
    assert (first["module"], first["location"]) == ("1.1", f"pid_factor.py:{_line(script, 'pid mul')}")


def test_noise_added_only_in_a_custom_backward_is_located_at_the_backward_line(
    verdicts: dict[str, tuple[int, dict[str, Any], str]],
) -> None:
    first = _divergence(verdicts, "custom_backward_noise")
    assert first["step"] == 0
    assert first["op"].startswith("aten.add."), first
    script = SCRIPTS / "custom_backward_noise.py"
    expected = f"custom_backward_noise.py:{_line(script, 'noisy backward')}"
    # The Function is applied in Net.forward itself, so its module is the root ("Net").
    assert (first["module"], first["location"]) == ("Net", expected)


def test_two_rank_run_where_only_rank_1_diverges_names_rank_1(
    verdicts: dict[str, tuple[int, dict[str, Any], str]],
) -> None:
    code, verdict, err = verdicts["ddp_rank1"]
    assert (code, verdict["reproducible"]) == (1, False), err[-3000:]
    first = verdict["first_divergence"]
    script = SCRIPTS / "ddp_rank1.py"
    expected = {
        "step": 0,
        "rank": 1,
        "kind": "compute",
        "op": "aten.mul.Tensor",
        "module": "1",  # DDP's "module." prefix is dropped: Sequential(Linear, Wobble, Linear)[1]
        "location": f"ddp_rank1.py:{_line(script, 'rank 1 mul')}",
        # the all-reduced gradient differs first; its name drops DDP's "module." prefix too
        "key": "optimizer0",
        "name": "grad:0.weight",
        "shape": [6, 4],
        "dtype": "float32",
    }
    assert first == expected, err[-3000:]


# --------------------------------------------------------------------------------------------
# Locating with DataLoader workers, in a plain loop and under Lightning: stable over repeats

HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None
REPEATS = 2
# (script, num_workers) -> how many times it is checked. Only with workers: without them no
# worker timing is involved (the cases above locate without workers; budget: < 60 s on 2 cores).
LOADER_CASES: dict[tuple[str, int], int] = {
    ("loader_workers", 2): REPEATS,
    **({("loader_lightning", 2): REPEATS} if HAS_LIGHTNING else {}),
}
CONCURRENT_CHECKS = 4
Verdict = tuple[int, dict[str, Any], str]


@pytest.fixture(scope="module")
def loader_verdicts(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[str, int], list[Verdict]]:
    root = tmp_path_factory.mktemp("locate_loader")
    jobs = [(case, i) for case, n in LOADER_CASES.items() for i in range(n)]
    results: dict[tuple[str, int], list[Verdict]] = {case: [] for case in LOADER_CASES}
    running: list[tuple[tuple[str, int], subprocess.Popen[str]]] = []
    for (name, workers), i in jobs:
        if len(running) == CONCURRENT_CHECKS:
            case, proc = running.pop(0)
            results[case].append(_finish(proc))
        proc = _start_check(root / f"{name}-w{workers}-{i}", name, script_args=("--workers", str(workers)))
        running.append(((name, workers), proc))
    for case, proc in running:
        results[case].append(_finish(proc))
    return results


def _loader_case(name: str, workers: int) -> Any:
    marks = []
    if name == "loader_lightning":
        marks.append(pytest.mark.skipif(not HAS_LIGHTNING, reason="needs lightning: pip install -e '.[dev]'"))
    return pytest.param(name, workers, id=f"{name}-workers{workers}", marks=marks)


@pytest.mark.parametrize(
    ("name", "workers"),
    [_loader_case(name, 2) for name in ("loader_workers", "loader_lightning")],
)
def test_locate_with_dataloader_workers_names_the_same_op_every_time(
    loader_verdicts: dict[tuple[str, int], list[Verdict]], name: str, workers: int
) -> None:
    runs = loader_verdicts[(name, workers)]
    assert len(runs) == LOADER_CASES[(name, workers)]
    expected = ("drop", f"{name}.py:{_line(SCRIPTS / f'{name}.py', 'dropout')}")
    named = []
    for code, verdict, err in runs:
        assert (code, verdict["reproducible"]) == (1, False), err[-3000:]
        first = verdict["first_divergence"]
        assert (first["step"], first["kind"]) == (1, "compute"), verdict
        assert "bernoulli" in first["op"] or "dropout" in first["op"], verdict
        assert not any("Control flow parted" in note for note in verdict["notes"]), verdict["notes"]
        named.append((first["op"], first["module"], first["location"]))
    assert {(module, location) for _, module, location in named} == {expected}, named
    assert len(set(named)) == 1, named


def test_ops_of_torch_data_loading_are_left_out_of_the_aligned_op_stream(tmp_path: Path) -> None:
    """Tensors rebuilt from another process and batches collated by torch, on the main thread or
    another one, a varying number of times: the traces still align; the same ops issued by the
    script itself are traced (the negative control)."""
    from multiprocessing.reduction import ForkingPickler

    from torchrepro.tracing import Tracer, compare_traces
    from torchrepro.tracing.compare import load_trace

    samples = [torch.ones(2), torch.zeros(2)]
    x = torch.ones(3)

    def traced(n: int, path: Path, *, by_script: bool = False) -> Path:
        payloads = [ForkingPickler.dumps(torch.arange(6.0)) for _ in range(n)]  # shared memory
        with Tracer(path):
            for payload in payloads:
                ForkingPickler.loads(payload)  # rebuilt as a DataLoader rebuilds worker batches
                torch.utils.data.default_collate(samples)
                if by_script:
                    torch.stack(samples)
            thread = threading.Thread(
                target=lambda: [torch.utils.data.default_collate(samples) for _ in range(n)]
            )
            thread.start()
            thread.join()
            _ = x * 2
        return path

    one, three = traced(1, tmp_path / "one"), traced(3, tmp_path / "three")
    assert [r.op for r in load_trace(one).records] == ["aten.mul.Tensor"]
    assert compare_traces(one, three) is None
    control_one, control_three = (
        traced(1, tmp_path / "c1", by_script=True),
        traced(3, tmp_path / "c3", by_script=True),
    )
    assert [r.op for r in load_trace(control_one).records] == ["aten.stack.default", "aten.mul.Tensor"]
    divergence = compare_traces(control_one, control_three)
    assert divergence is not None and divergence.structural


def test_invariant_data_parallel_rank_1_source_is_found_through_the_reductions_all_to_all(
    verdicts: dict[str, tuple[int, dict[str, Any], str]],
) -> None:
    # on 3 ranks, rank 0's first differing op is the all-to-all bringing it rank 1's chunk (a
    # collective, so the source is looked for on the other ranks; its output buffer is empty memory
    # it only writes, which the tracer once took for uninitialised data and left uncompared)
    first = _divergence(verdicts, "idp_rank1")
    script = SCRIPTS / "idp_rank1.py"
    assert (first["step"], first["rank"], first["op"]) == (0, 1, "aten.mul.Tensor"), first
    assert (first["module"], first["location"]) == ("1", f"idp_rank1.py:{_line(script, 'rank 1 mul')}")
