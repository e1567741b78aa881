"""``TorchreproCallback`` with real Lightning: a fit SIGKILLed mid-epoch and resumed from its last
checkpoint ends with the same parameter bits as the uninterrupted fit, on 1 process and on 2-rank
DDP (gloo, CPU); the stock Lightning path resumed the same way differs (the negative controls).

The model has dropout and the dataset draws noise from the global torch RNG on every load
(``lightning_scripts/train.py``). The uninterrupted references run as plain fresh interpreters
(for DDP, Lightning starts rank 1 itself by running the script again). The other runs are forked
from a *zygote* that has imported Lightning once (``lightning_scripts/zygote.py``), with DDP ranks
started externally (``LOCAL_RANK``): each is a new process that starts from nothing but its
arguments and the checkpoint file, and the fresh references show they give the same bits.
All runs start together in one module fixture and every test reads their results.

Streamed data (``SeededLoader(ShardedDataset(...))``, no ``len()``) has a fixture of its own
(``stream_runs``, slow): mid-epoch, epoch-end, ``limit_train_batches`` and 2-rank DDP resumes,
the shards a resume opens, and a plain ``DataLoader`` over the same shards as negative control.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrepro
from helpers import free_port, user_env
from torchrepro.flags import CUBLAS_CONFIGS, CUBLAS_VAR

SCRIPTS = Path(__file__).resolve().parent / "lightning_scripts"
TRAIN = SCRIPTS / "train.py"

# 32 samples, batches of 4: 8 batches an epoch on 1 process, 4 per rank on 2 ranks.
SINGLE = ["--epochs", "2", "--every", "5"]  # checkpoints at steps 5, 10, 15
SINGLE_KILL, SINGLE_CKPT = 12, "epoch=1-step=10.ckpt"  # last.ckpt: epoch 1 after 2 of 8 batches
EPOCH_END = ["--epochs", "2", "--every", "8", "--kill-at", "10"]  # last.ckpt: epoch 0's last batch
FIRST_EPOCH = ["--epochs", "2", "--every", "5", "--kill-at", "7"]  # last.ckpt: epoch 0 after 5 of 8
DDP = ["--devices", "2", "--epochs", "2", "--every", "3"]  # checkpoints at steps 3, 6
DDP_KILL, DDP_CKPT = 7, "epoch=1-step=6.ckpt"  # last.ckpt: epoch 1 after 2 of 4 batches
TIMEOUT = 240


_RANK_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


def _env(**extra: str) -> dict[str, str]:
    return user_env(drop=("PL_", *_RANK_VARIABLES), **{"OMP_NUM_THREADS": "1", **extra})


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@dataclass
class Run:
    """One training run: its directory, its log(s), and its exit code(s) once waited for."""

    name: str
    out: Path
    logs: list[Path]
    codes: list[int] = field(default_factory=list)

    def text(self) -> str:
        parts = [f"--- {log.name} ---\n{log.read_text() if log.exists() else ''}" for log in self.logs]
        return f"run {self.name}: exit codes {self.codes}\n" + "\n".join(parts)

    def ok(self) -> bool:
        return bool(self.codes) and all(code == 0 for code in self.codes)

    def final(self) -> dict[str, torch.Tensor]:
        assert self.ok(), self.text()
        return torch.load(self.out / "final.pt", weights_only=True)

    def last(self) -> str:
        return str(self.out / "ckpt" / "last.ckpt")

    def ckpt(self, name: str = "last.ckpt") -> dict[str, Any]:
        return torch.load(self.out / "ckpt" / name, weights_only=True)  # what Lightning does too


class Runner:
    """Starts fresh interpreters and zygote children; every process is in a session it ends."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.fresh: dict[str, subprocess.Popen[bytes]] = {}
        self.zygote = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "zygote.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
            start_new_session=True,
        )
        self.pending: dict[str, tuple[Run, list[int]]] = {}

    def start_fresh(self, name: str, *argv: str, launcher: tuple[str, ...] = ()) -> Run:
        run = Run(name, self.base / name, [self.base / f"{name}.log"])
        with open(run.logs[0], "wb") as log:
            self.fresh[name] = subprocess.Popen(
                [sys.executable, *launcher, str(TRAIN), str(run.out), *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_env(),
                start_new_session=True,
            )
        self.pending[name] = (run, [])
        return run

    def _fork(self, argv: list[str], env: dict[str, str], log: Path) -> int:
        assert self.zygote.stdin is not None and self.zygote.stdout is not None
        cmd = {"op": "run", "argv": argv, "env": env, "log": str(log)}
        self.zygote.stdin.write(json.dumps(cmd) + "\n")
        self.zygote.stdin.flush()
        return int(self.zygote.stdout.readline())

    def start(self, name: str, *argv: str, ranks: int = 1) -> Run:
        run = Run(name, self.base / name, [self.base / f"{name}.rank{r}.log" for r in range(ranks)])
        full = [str(run.out), *argv]
        if ranks == 1:
            pids = [self._fork(full, {}, run.logs[0])]
        else:  # ranks started externally, like torchrun: Lightning launches nothing itself
            port = str(free_port())
            pids = [
                self._fork(
                    full,
                    {
                        "LOCAL_RANK": str(r),
                        "NODE_RANK": "0",
                        "WORLD_SIZE": str(ranks),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port,
                    },
                    log,
                )
                for r, log in enumerate(run.logs)
            ]
        self.pending[name] = (run, pids)
        return run

    def wait(self, *runs: Run) -> None:
        assert self.zygote.stdin is not None and self.zygote.stdout is not None
        for run in runs:
            _, pids = self.pending.pop(run.name)
            if run.name in self.fresh:
                run.codes.append(self.fresh.pop(run.name).wait(timeout=TIMEOUT))
                continue
            for pid in pids:
                self.zygote.stdin.write(json.dumps({"op": "wait", "pid": pid}) + "\n")
                self.zygote.stdin.flush()
                run.codes.append(int(self.zygote.stdout.readline()))

    def close(self) -> None:
        for proc in [*self.fresh.values(), self.zygote]:
            if proc.poll() is None or proc is self.zygote:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the session this runner created, only it
            proc.wait()
        for pipe in (self.zygote.stdin, self.zygote.stdout):
            if pipe is not None:
                pipe.close()


def _strip_rng_state(src: Path, dst: Path) -> None:
    ckpt = torch.load(src, weights_only=True)
    del ckpt["callbacks"]["TorchreproCallback"]
    dst.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, dst)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    base = tmp_path_factory.mktemp("lightning")
    runner = Runner(base)
    try:
        r: dict[str, Run] = {}
        # Wave 1: the uninterrupted references as fresh interpreters, the first half of the rest.
        r["full"] = runner.start_fresh("full", *SINGLE)
        r["ddp_full"] = runner.start_fresh("ddp_full", *DDP)
        run_seed = ("-m", "torchrepro", "run", "--seed", "3", "--mode", "warn")
        r["under_run"] = runner.start_fresh("under_run", *DDP[:2], "--epochs", "1", launcher=run_seed)
        r["kill"] = runner.start("kill", *SINGLE, "--workers", "2", "--kill-at", str(SINGLE_KILL))
        r["kill_epoch_end"] = runner.start("kill_epoch_end", *EPOCH_END, "--workers", "2")
        r["kill_first_epoch"] = runner.start("kill_first_epoch", *FIRST_EPOCH)
        r["stock_full"] = runner.start("stock_full", *SINGLE, "--variant", "stock")
        stock = [*SINGLE, "--variant", "stock"]
        r["stock_kill"] = runner.start("stock_kill", *stock, "--kill-at", str(SINGLE_KILL))
        r["ddp_kill"] = runner.start("ddp_kill", *DDP, "--kill-at", str(DDP_KILL), ranks=2)
        r["ddp_stock_full"] = runner.start("ddp_stock_full", *DDP, "--variant", "stock", ranks=2)
        runner.wait(*(run for run in r.values() if run.name not in runner.fresh))
        # Wave 2: the resumes.
        last = r["kill"].out / "ckpt" / "last.ckpt"
        r["resume"] = runner.start("resume", *SINGLE, "--workers", "2", "--resume", str(last))
        r["resume_epoch_end"] = runner.start(
            "resume_epoch_end", *EPOCH_END[:4], "--workers", "2", "--resume", r["kill_epoch_end"].last()
        )
        r["resume_first_epoch"] = runner.start(
            "resume_first_epoch", *FIRST_EPOCH[:4], "--resume", r["kill_first_epoch"].last()
        )
        stripped = base / "stripped" / "last.ckpt"
        if last.exists():
            _strip_rng_state(last, stripped)
        r["no_rng"] = runner.start("no_rng", *SINGLE, "--resume", str(stripped))
        r["stock_resume"] = runner.start("stock_resume", *stock, "--resume", r["stock_kill"].last())
        ddp_last = r["ddp_kill"].last()
        r["ddp_resume"] = runner.start("ddp_resume", *DDP, "--resume", ddp_last, ranks=2)
        r["ddp_on_one"] = runner.start("ddp_on_one", *SINGLE, "--resume", ddp_last)
        r["ddp_stock_resume"] = runner.start(
            "ddp_stock_resume",
            *DDP,
            "--variant",
            "stock",
            "--resume",
            str(r["ddp_stock_full"].out / "ckpt" / DDP_CKPT),
            ranks=2,
        )
        runner.wait(*(run for run in r.values() if not run.codes and run.name not in runner.fresh))
        runner.wait(r["full"], r["ddp_full"], r["under_run"])
        yield r
    finally:
        runner.close()
    shutil.rmtree(base, ignore_errors=True)


def _killed(run: Run) -> None:
    assert run.codes and all(code == -9 for code in run.codes), run.text()


# -- 1 process ---------------------------------------------------------------------------------


def test_single_killed_mid_epoch_and_resumed_equals_uninterrupted(runs: dict[str, Run]) -> None:
    _killed(runs["kill"])
    ckpt = runs["kill"].ckpt()
    assert ckpt["global_step"] == 10 and ckpt["epoch"] == 1  # 2 of the 8 batches of epoch 1
    state = ckpt["callbacks"]["TorchreproCallback"]
    assert state["world_size"] == 1 and len(state["rng"]) == 1
    # The uninterrupted run loads with num_workers=0, the killed and resumed ones with 2.
    assert _same(runs["resume"].final(), runs["full"].final()), runs["resume"].text()


def test_single_checkpoint_at_an_epochs_last_batch_resumes_exactly(runs: dict[str, Run]) -> None:
    """Lightning validates right after that checkpoint and, resumed, skips it: validation must not
    move the training streams. Checkpointing every 8 steps instead of 5 changes nothing either."""
    _killed(runs["kill_epoch_end"])
    assert runs["kill_epoch_end"].ckpt()["global_step"] == 8
    assert _same(runs["resume_epoch_end"].final(), runs["full"].final()), runs["resume_epoch_end"].text()


def test_single_killed_in_the_first_epoch_and_resumed_equals_uninterrupted(runs: dict[str, Run]) -> None:
    """Lightning creates the first epoch's iterator before it calls ``set_epoch(0)``."""
    _killed(runs["kill_first_epoch"])
    ckpt = runs["kill_first_epoch"].ckpt()
    assert ckpt["global_step"] == 5 and ckpt["epoch"] == 0
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batches_consumed"] == 5
    assert _same(runs["resume_first_epoch"].final(), runs["full"].final()), runs["resume_first_epoch"].text()


def test_single_resumed_without_rng_state_differs(runs: dict[str, Run]) -> None:
    """Negative control: the same checkpoint without the callback's RNG states."""
    assert "without RNG states" in runs["no_rng"].text()
    assert not _same(runs["no_rng"].final(), runs["full"].final())


def test_single_stock_lightning_resumed_mid_epoch_differs(runs: dict[str, Run]) -> None:
    """Negative control: no callback, a shuffling DataLoader, ``lightning.seed_everything``."""
    _killed(runs["stock_kill"])
    at_kill = runs["stock_kill"].ckpt()
    assert at_kill["global_step"] == 10
    # The stock run is reproducible up to the checkpoint: the difference comes from the resume.
    assert _same(at_kill["state_dict"], runs["stock_full"].ckpt(SINGLE_CKPT)["state_dict"])
    assert not _same(runs["stock_resume"].final(), runs["stock_full"].final())


# -- 2-rank DDP --------------------------------------------------------------------------------


def test_ddp_killed_mid_epoch_and_resumed_equals_uninterrupted(runs: dict[str, Run]) -> None:
    _killed(runs["ddp_kill"])
    ckpt = runs["ddp_kill"].ckpt()
    assert ckpt["global_step"] == 6 and ckpt["epoch"] == 1  # 2 of the 4 batches of epoch 1
    state = ckpt["callbacks"]["TorchreproCallback"]
    assert state["world_size"] == 2
    assert not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])  # one state per rank
    # The reference ran as `python train.py --devices 2` with rank 1 started by Lightning.
    assert _same(runs["ddp_resume"].final(), runs["ddp_full"].final()), runs["ddp_resume"].text()


def test_ddp_stock_lightning_resumed_mid_epoch_differs(runs: dict[str, Run]) -> None:
    """Negative control: the stock path resumed from the uninterrupted run's own mid-epoch checkpoint."""
    assert runs["ddp_stock_full"].ckpt(DDP_CKPT)["global_step"] == 6
    assert not _same(runs["ddp_stock_resume"].final(), runs["ddp_stock_full"].final())


def test_ddp_checkpoint_resumed_on_one_process_is_refused(runs: dict[str, Run]) -> None:
    run = runs["ddp_on_one"]
    assert run.codes and run.codes[0] != 0
    assert "holds the RNG states of 2 rank(s), but this run has 1" in run.text(), run.text()


# -- streamed data: SeededLoader(ShardedDataset) ----------------------------------------------

# 36 samples in 8 shards (one empty), batches of 4: 9 batches an epoch on 1 process (the last of
# them 4 samples), 5 steps of 8 samples on 2 ranks (the last padded); a shuffle buffer of 8.
STREAM = ["--stream", "--epochs", "2", "--every", "4"]  # checkpoints at steps 4, 8, 12, 16
STREAM_KILL = 17  # last.ckpt: step 16, epoch 1 after 7 of its 9 batches
STREAM_END = ["--stream", "--epochs", "2", "--every", "9"]  # killed at 11, last.ckpt: epoch 0 ends
STREAM_LIMIT = [*STREAM, "--limit", "6"]  # limit_train_batches=6: checkpoints at 4, 8
STREAM_DDP = ["--stream", "--devices", "2", "--epochs", "2", "--every", "3"]  # checkpoints at 3, 6, 9
STREAM_DDP_KILL = 7  # last.ckpt: step 6, epoch 1 after 1 of its 5 steps
# Global batches of 8 from 2 partitions, each rank reading its own: 4 steps in epoch 0, 3 in epoch 1.
STREAM_PARTS = ["--stream", "--partitions", "2", "--devices", "2", "--epochs", "2", "--every", "3"]
STREAM_PARTS_KILL = 5  # last.ckpt: step 3, epoch 0 after 3 of its 4 steps


@pytest.fixture(scope="module")
def stream_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """Fits over a streamed ShardedDataset, all forked from one zygote (the fresh references
    of ``runs`` show the zygote's children give the bits of fresh interpreters)."""
    base = tmp_path_factory.mktemp("lightning-stream")
    runner = Runner(base)
    try:
        r: dict[str, Run] = {}
        # Wave 1: the uninterrupted references and the killed runs (killed ones load with 2 workers).
        r["full"] = runner.start("full", *STREAM)
        r["kill"] = runner.start("kill", *STREAM, "--workers", "2", "--kill-at", str(STREAM_KILL))
        r["kill_end"] = runner.start("kill_end", *STREAM_END, "--kill-at", "11")
        r["limit_full"] = runner.start("limit_full", *STREAM_LIMIT)
        r["limit_kill"] = runner.start("limit_kill", *STREAM_LIMIT, "--workers", "2", "--kill-at", "10")
        stock = [*STREAM, "--variant", "stock"]
        r["stock0"] = runner.start("stock0", *stock)
        r["stock2"] = runner.start("stock2", *stock, "--workers", "2")
        r["stock_kill"] = runner.start("stock_kill", *stock, "--kill-at", str(STREAM_KILL))
        r["ddp_full"] = runner.start("ddp_full", *STREAM_DDP, ranks=2)
        r["ddp_kill"] = runner.start("ddp_kill", *STREAM_DDP, "--kill-at", str(STREAM_DDP_KILL), ranks=2)
        r["parts_full"] = runner.start("parts_full", *STREAM_PARTS, ranks=2)
        r["parts_kill"] = runner.start(
            "parts_kill", *STREAM_PARTS, "--workers", "2", "--kill-at", str(STREAM_PARTS_KILL), ranks=2
        )
        runner.wait(*r.values())
        # Wave 2: the resumes, each in a new process, on another worker count than the killed run.
        r["resume"] = runner.start("resume", *STREAM, "--resume", r["kill"].last())
        end = r["kill_end"].last()
        r["resume_end"] = runner.start("resume_end", *STREAM_END, "--workers", "2", "--resume", end)
        r["limit_resume"] = runner.start("limit_resume", *STREAM_LIMIT, "--resume", r["limit_kill"].last())
        r["stock_resume"] = runner.start("stock_resume", *stock, "--resume", r["stock_kill"].last())
        r["ddp_resume"] = runner.start("ddp_resume", *STREAM_DDP, "--resume", r["ddp_kill"].last(), ranks=2)
        r["parts_resume"] = runner.start(
            "parts_resume", *STREAM_PARTS, "--resume", r["parts_kill"].last(), ranks=2
        )
        runner.wait(*(run for run in r.values() if not run.codes))
        yield r
    finally:
        runner.close()
    shutil.rmtree(base, ignore_errors=True)


def _loader_state(run: Run, name: str = "last.ckpt") -> dict[str, Any]:
    [state] = run.ckpt(name)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    return state


def _reads(run: Run) -> list[tuple[int, int, int]]:
    """Every shard the run opened, in any process: ``(shard, start, torch seed at the open)``."""
    lines = [line for path in run.out.glob("reads.*.txt") for line in path.read_text().splitlines()]
    return sorted(tuple(int(v) for v in line.split()) for line in lines)  # type: ignore[misc]


def _expected_reads(state: dict[str, Any]) -> list[tuple[int, int, int]]:
    """The shards a streamed SeededLoader resumed from ``state`` opens for the rest of its epoch."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import train
    finally:
        sys.path.pop(0)
    reads: list[tuple[int, int, int]] = []

    def read_shard(shard: int, start: int = 0) -> Iterator[int]:
        reads.append((shard, start, torch.initial_seed()))
        yield from range(start, train.SHARD_LENGTHS[shard])

    data = torchrepro.ShardedDataset(range(len(train.SHARD_LENGTHS)), read_shard)
    loader = torchrepro.SeededLoader(data, batch_size=4, seed=train.SEED, shuffle_buffer=8)
    loader.load_state_dict(state)
    for _ in loader:
        pass
    return sorted(reads)


@pytest.mark.slow
def test_stream_killed_mid_epoch_and_resumed_equals_uninterrupted(stream_runs: dict[str, Run]) -> None:
    _killed(stream_runs["kill"])
    ckpt = stream_runs["kill"].ckpt()
    assert ckpt["global_step"] == 16 and ckpt["epoch"] == 1
    # Lightning fetches one batch ahead of the loop for a loader without len(): the position saved
    # is the loop's (7 batches of epoch 1), not the loader's (8).
    state = _loader_state(stream_runs["kill"])
    assert (state["epoch"], state["batches_consumed"], state["finished"]) == (1, 7, False)
    assert _same(stream_runs["resume"].final(), stream_runs["full"].final()), stream_runs["resume"].text()


@pytest.mark.slow
def test_stream_resume_reads_only_the_shards_still_holding_samples(stream_runs: dict[str, Run]) -> None:
    """The resumed fit opens exactly the shards a loader restored from the checkpoint's position
    opens (each from the offset it needs, seeded for epoch 1), not the epoch from its start."""
    state = _loader_state(stream_runs["kill"])
    expected = _expected_reads(state)
    assert len({shard for shard, _, _ in expected}) < 7  # the 7 non-empty shards of an epoch
    assert _reads(stream_runs["resume"]) == expected


@pytest.mark.slow
def test_stream_checkpoint_at_an_epochs_last_batch_resumes_exactly(stream_runs: dict[str, Run]) -> None:
    """Lightning knows the last batch by fetching ahead (the loader's pass has ended), resumes in
    the next epoch and validates first: the saved position is the next epoch's start."""
    _killed(stream_runs["kill_end"])
    state = _loader_state(stream_runs["kill_end"])
    assert stream_runs["kill_end"].ckpt()["global_step"] == 9
    assert (state["epoch"], state["batches_consumed"], state["finished"]) == (0, 9, True)
    run = stream_runs["resume_end"]
    assert _same(run.final(), stream_runs["full"].final()), run.text()


@pytest.mark.slow
def test_stream_with_limit_train_batches_resumes_exactly(stream_runs: dict[str, Run]) -> None:
    """With ``limit_train_batches`` Lightning knows the length and does not fetch ahead; each
    epoch is the first 6 batches of the loader's epoch."""
    _killed(stream_runs["limit_kill"])
    state = _loader_state(stream_runs["limit_kill"])
    assert (state["epoch"], state["batches_consumed"]) == (1, 2)
    run = stream_runs["limit_resume"]
    assert _same(run.final(), stream_runs["limit_full"].final()), run.text()
    assert not _same(run.final(), stream_runs["full"].final())


@pytest.mark.slow
def test_stream_ddp_killed_mid_epoch_and_resumed_equals_uninterrupted(stream_runs: dict[str, Run]) -> None:
    """Lightning keeps the streamed loader under DDP (its sampler is a DistributedSampler); each
    rank takes its part of every step."""
    _killed(stream_runs["ddp_kill"])
    state = _loader_state(stream_runs["ddp_kill"])
    assert (state["epoch"], state["batches_consumed"], state["world_size"]) == (1, 1, 2)
    run = stream_runs["ddp_resume"]
    assert _same(run.final(), stream_runs["ddp_full"].final()), run.text()


@pytest.mark.slow
def test_partitioned_stream_under_ddp_killed_mid_epoch_and_resumed_equals_uninterrupted(
    stream_runs: dict[str, Run],
) -> None:
    """Partitions under Lightning DDP: each rank reads only its partition (the ranks agree on each
    epoch's end), the position saved is the loop's, and the resume (from 2 workers onto 0) trains
    the uninterrupted run's bits."""
    _killed(stream_runs["parts_kill"])
    state = _loader_state(stream_runs["parts_kill"])
    assert (state["epoch"], state["batches_consumed"], state["partitions"], state["world_size"]) == (
        0,
        3,
        2,
        2,
    )
    run = stream_runs["parts_resume"]
    assert _same(run.final(), stream_runs["parts_full"].final()), run.text()
    assert not _same(run.final(), stream_runs["ddp_full"].final())


@pytest.mark.slow
def test_stream_negative_control_stock_dataloader_differs_across_workers_and_resume(
    stream_runs: dict[str, Run],
) -> None:
    """A plain DataLoader over the same ShardedDataset: each worker reads its own shards with
    its own RNG (another order and other noise with 2 workers), and a resume restarts the stream."""
    assert not _same(stream_runs["stock0"].final(), stream_runs["stock2"].final())
    _killed(stream_runs["stock_kill"])
    at_kill = stream_runs["stock_kill"].ckpt()["state_dict"]
    assert _same(at_kill, stream_runs["stock0"].ckpt("epoch=1-step=16.ckpt")["state_dict"])  # until the kill
    assert not _same(stream_runs["stock_resume"].final(), stream_runs["stock0"].final())


# -- under `torchrepro run` ------------------------------------------------------------------


def test_under_torchrepro_run_the_runs_settings_are_kept(runs: dict[str, Run]) -> None:
    """``TorchreproCallback(seed=0, mode="strict")`` under ``torchrepro run --seed 3 --mode warn``,
    2-rank DDP: rank 0 was set up by the run, rank 1 is started by Lightning (not by the run)."""
    run = runs["under_run"]
    assert run.ok(), run.text()
    assert "`torchrepro run --seed 3 --mode warn`: the run's seed and mode are kept" in run.text()
    assert [(run.out / f"mode.rank{r}.txt").read_text() for r in (0, 1)] == ["warn", "warn"]


# -- imports -----------------------------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120, check=False
    )


def test_import_torchrepro_does_not_import_lightning() -> None:
    code = (
        "import sys, torchrepro, torchrepro.integrations\n"
        "torchrepro.seed_everything(0)\n"
        "print([m for m in sys.modules if m.split('.')[0] in "
        "('lightning', 'pytorch_lightning', 'lightning_fabric', 'transformers')])"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("blocked", [("lightning",), ("lightning", "pytorch_lightning")])
def test_missing_lightning_names_the_extra(blocked: tuple[str, ...]) -> None:
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "try:\n"
        "    import torchrepro.integrations.lightning\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(type(exc).__name__, exc.name, '|', exc)\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ModuleNotFoundError lightning |"), proc.stdout
    assert "`pip install torchrepro[lightning]`" in proc.stdout
    assert ("pytorch_lightning is installed" in proc.stdout) == ("pytorch_lightning" not in blocked)


def test_check_names_the_scripts_loader_line_and_the_parameter_paths_under_lightning(tmp_path: Path) -> None:
    """Lightning rebuilds the script's loaders: a data divergence still names the script's line.

    ``--vary workers`` gives the validation loader (the first one iterated: the sanity check)
    2 workers instead of 0, so its noise draws change; the parameters are named by their path in
    the LightningModule (``configure_optimizers`` hands them over)."""
    cmd = [sys.executable, "-m", "torchrepro", "check", "--json", "--vary", "workers"]
    cmd += [str(TRAIN), str(tmp_path / "out"), "--variant", "stock", "--epochs", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    verdict = json.loads(proc.stdout)
    assert proc.returncode == 1, proc.stderr
    d = verdict["first_divergence"]
    line = next(
        i for i, t in enumerate(TRAIN.read_text().splitlines(), 1) if "DataLoader(NoisyPoints(8)" in t
    )
    assert (d["kind"], d["key"], d["name"], d["location"]) == ("data", "loader0", "[0]", f"{TRAIN}:{line}")
    events = (tmp_path / ".torchrepro" / "checks").glob("*/run0/events.rank0.jsonl")
    init = json.loads(next(events).read_text().splitlines()[0])
    assert [t["n"] for t in init["t"]] == [f"param:net.{i}.{p}" for i in (0, 3) for p in ("weight", "bias")]


class _Tiny(__import__("lightning").pytorch.LightningModule):  # type: ignore[misc]
    def __init__(self, loaders: Any) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
        self.loaders = loaders

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        first = next(iter(batch.values())) if isinstance(batch, dict) else batch
        return self.net(first[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return self.loaders


def _fit_warnings(tmp_path: Path, loaders: Any) -> list[str]:
    """The ReproWarnings of a real in-process fit of 2 steps with TorchreproCallback."""
    import warnings

    import lightning.pytorch as pl

    from torchrepro import errors
    from torchrepro.flags import DeterminismFlags
    from torchrepro.integrations.lightning import TorchreproCallback
    from torchrepro.rng import RngState

    flags, rng, warned = DeterminismFlags.capture(), RngState.capture(), set(errors._warned)
    errors._warned.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = pl.Trainer(
                accelerator="cpu",
                max_steps=2,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                default_root_dir=tmp_path,
                callbacks=[TorchreproCallback(seed=0)],
            )
            trainer.fit(_Tiny(loaders))
    finally:
        flags.restore()
        rng.restore()
        errors._warned.clear()
        errors._warned.update(warned)
    return [str(w.message) for w in caught if issubclass(w.category, torchrepro.ReproWarning)]


def test_a_plain_train_dataloader_is_named_once_at_fit_start(
    tmp_path: Path, rng_changes_ok: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # strict mode refuses to start without CUBLAS_WORKSPACE_CONFIG once CUDA has started, which on a
    # machine with a GPU an earlier test in this process may have done: set as a GPU user sets it
    monkeypatch.setenv(CUBLAS_VAR, CUBLAS_CONFIGS[0])
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(8, 2))
    plain = _fit_warnings(tmp_path, DataLoader(data, batch_size=2, shuffle=True))
    assert len(plain) == 1
    assert "train_dataloader(): DataLoader over TensorDataset" in plain[0]
    assert "torchrepro.SeededLoader" in plain[0]
    several = _fit_warnings(
        tmp_path,
        {"a": torchrepro.SeededLoader(data, batch_size=2, seed=0), "b": DataLoader(data, batch_size=2)},
    )
    assert len(several) == 1 and "train_dataloader()['b']: DataLoader" in several[0]
    assert "['a']" not in several[0]
    # a SeededLoader resumes exactly: nothing to say
    assert _fit_warnings(tmp_path, torchrepro.SeededLoader(data, batch_size=2, seed=0)) == []


def test_a_streamed_train_loaders_checkpoint_holds_the_loops_position(
    tmp_path: Path, rng_changes_ok: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process: Lightning fetches a batch ahead of the loop for a loader without len(); the
    position saved is the loop's. A plain DataLoader over the same shards is named."""
    # strict mode refuses to start without CUBLAS_WORKSPACE_CONFIG once CUDA has started, which on a
    # machine with a GPU an earlier test in this process may have done: set as a GPU user sets it
    monkeypatch.setenv(CUBLAS_VAR, CUBLAS_CONFIGS[0])
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from torchrepro.flags import DeterminismFlags
    from torchrepro.integrations.lightning import TorchreproCallback

    data = torchrepro.ShardedDataset([3, 5, 4], lambda n: (torch.full((2,), float(i)) for i in range(n)))
    flags = DeterminismFlags.capture()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's own (its pytree use on this torch)
            trainer = pl.Trainer(
                accelerator="cpu",
                max_steps=3,
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                default_root_dir=tmp_path,
                callbacks=[
                    TorchreproCallback(seed=0),
                    ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3),
                ],
            )
            trainer.fit(_Tiny(torchrepro.SeededLoader(data, batch_size=2, seed=0, shuffle_buffer=4)))
    finally:
        flags.restore()
    [ckpt] = tmp_path.glob("*.ckpt")
    [state] = torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    position = (state["stream"], state["epoch"], state["batches_consumed"], state["finished"])
    assert position == (True, 0, 3, False)
    plain = _fit_warnings(tmp_path, DataLoader(data, batch_size=2))
    assert len(plain) == 1 and "train_dataloader(): DataLoader over ShardedDataset" in plain[0]
