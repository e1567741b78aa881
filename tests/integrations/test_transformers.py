"""The Hugging Face Trainer with TorchreproTrainerMixin: exact mid-epoch resume across processes,
the same weights for any number of workers; the stock Trainer, as negative control, gives neither.
The same for streamed train data: a ``torchrepro.ShardedDataset`` and a ``datasets.IterableDataset``
(``max_steps``, a checkpoint every 2 steps, one of them at an epoch's end), where a resume restores
the loader's position and opens only the shards still holding samples.

Every training runs in a subprocess (hf_scripts/train.py): four processes in all, two training
from scratch (saving checkpoints), two resuming from those checkpoints, each several trainings.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE
from typing import Any

import pytest
import torch

import torchrepro
from helpers import user_env
from torchrepro.flags import CUBLAS_CONFIGS, CUBLAS_VAR

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = str(Path(__file__).resolve().parent / "hf_scripts" / "train.py")


def _env() -> dict[str, str]:
    return user_env(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def _run_together(*commands: list[str]) -> None:
    """Run the script once per argument list, all at the same time; each must succeed."""
    procs = [
        (
            args,
            subprocess.Popen(
                [sys.executable, SCRIPT, *args], env=_env(), stdout=PIPE, stderr=PIPE, text=True
            ),
        )
        for args in commands
    ]
    for args, proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{args}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<kind><workers>``: trained from scratch; ``<kind>-resume<step>``: resumed in a new process."""
    root = tmp_path_factory.mktemp("hf")
    _run_together(
        *(
            [
                "run",
                *(f"{kind}:{workers}:{root / f'{kind}{workers}'}" for kind in kinds for workers in (0, 2)),
                *extra,
            ]
            for kinds, extra in (
                (
                    ("repro", "repro-stream"),
                    [f"repro-hf:0:{root / 'repro-hf0'}", f"repro-parts:0:{root / 'repro-parts0'}"],
                ),
                (("stock", "stock-stream"), []),
            )
        )
    )
    _run_together(
        [
            "resume",
            f"repro:0:{root / 'repro0' / 'checkpoint-4'}:{root / 'repro-resume4'}",
            f"repro:0:{root / 'repro0' / 'checkpoint-8'}:{root / 'repro-resume8'}",
            # the streams resume on the other worker count
            f"repro-stream:2:{root / 'repro-stream0' / 'checkpoint-4'}:{root / 'repro-stream-resume4'}",
            f"repro-stream:0:{root / 'repro-stream2' / 'checkpoint-6'}:{root / 'repro-stream-resume6'}",
            f"repro-hf:2:{root / 'repro-hf0' / 'checkpoint-4'}:{root / 'repro-hf-resume4'}",
            f"repro-parts:2:{root / 'repro-parts0' / 'checkpoint-4'}:{root / 'repro-parts-resume4'}",
        ],
        [
            "resume",
            f"stock:0:{root / 'stock0' / 'checkpoint-8'}:{root / 'stock-resume8'}",
            f"stock-stream:0:{root / 'stock-stream0' / 'checkpoint-4'}:{root / 'stock-stream-resume4'}",
        ],
    )
    return root


def _weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    state = torch.load(root / name / "final.pt", weights_only=True)
    assert isinstance(state, dict) and state
    return state


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [name for name in a if not torch.equal(a[name], b[name])]


@pytest.mark.parametrize("step", [4, 8], ids=["epoch0", "epoch1"])
def test_resume_mid_epoch_with_accumulation_equals_the_uninterrupted_run(runs: Path, step: int) -> None:
    # Step 4 is batch 8 of 11 in epoch 0, step 8 is batch 4 of epoch 1; accumulation 2.
    assert _differing(_weights(runs, "repro0"), _weights(runs, f"repro-resume{step}")) == []


def test_the_same_weights_with_0_and_2_workers(runs: Path) -> None:
    assert _differing(_weights(runs, "repro0"), _weights(runs, "repro2")) == []


def test_negative_control_stock_trainer_resume_differs(runs: Path) -> None:
    assert _differing(_weights(runs, "stock0"), _weights(runs, "stock-resume8")) != []


def test_negative_control_stock_trainer_differs_between_0_and_2_workers(runs: Path) -> None:
    assert _differing(_weights(runs, "stock0"), _weights(runs, "stock2")) != []


# -- streamed train data ------------------------------------------------------------------------
# 36 samples in 8 shards (one empty), batches of 4, accumulation 3: 9 batches and 3 steps an
# epoch; max_steps=8; checkpoint-4 is 3 batches into epoch 1, checkpoint-6 at the end of epoch 1.


def _stream_position(checkpoint: Path) -> dict[str, Any]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    position = state["stateful_callbacks"]["TorchreproStreamPosition"]["attributes"]["position"]
    assert isinstance(position, dict)
    return position


@pytest.mark.parametrize("step", [4, 6], ids=["mid-epoch", "epoch-end"])
def test_stream_resume_equals_the_uninterrupted_run(runs: Path, step: int) -> None:
    """The checkpoint holds the stream's position; the resumed run (on the other worker count)
    restores it, and the one saved at an epoch's end goes on with the next epoch."""
    saved_by = "repro-stream0" if step == 4 else "repro-stream2"
    position = _stream_position(runs / saved_by / f"checkpoint-{step}")
    assert (position["epoch"], position["batches_consumed"]) == ((1, 3) if step == 4 else (1, 9))
    assert _differing(_weights(runs, "repro-stream0"), _weights(runs, f"repro-stream-resume{step}")) == []


def test_partitioned_stream_resumes_on_another_worker_count(runs: Path) -> None:
    """TorchreproTrainer(partitions=2): global batches of one optimizer step (4 x 3 accumulated)
    from 2 partitions; the checkpoint's position resumes with 2 workers to the same weights."""
    position = _stream_position(runs / "repro-parts0" / "checkpoint-4")
    assert (position["partitions"], position["global_batch_size"]) == (2, 12)
    assert _differing(_weights(runs, "repro-parts0"), _weights(runs, "repro-parts-resume4")) == []
    assert _differing(_weights(runs, "repro-parts0"), _weights(runs, "repro-stream0")) != []  # other batches


def test_stream_the_same_weights_with_0_and_2_workers(runs: Path) -> None:
    assert _differing(_weights(runs, "repro-stream0"), _weights(runs, "repro-stream2")) == []


def test_stream_resume_reads_only_the_shards_still_holding_samples(runs: Path) -> None:
    """The resumed run's reads of epoch 1 (told apart by the seed the loader gives each open) are
    exactly those of a loader restored in this process from the checkpoint's position."""
    position = _stream_position(runs / "repro-stream0" / "checkpoint-4")
    noisy = _script_module("noisy")
    expected: list[tuple[int, int, int]] = []

    def read_shard(shard: int, start: int = 0) -> Any:
        expected.append((shard, start, torch.initial_seed()))
        yield from range(start, noisy.SHARD_LENGTHS[shard])

    data = torchrepro.ShardedDataset(range(len(noisy.SHARD_LENGTHS)), read_shard)
    loader = torchrepro.SeededLoader(data, batch_size=4, seed=0, shuffle_buffer=8)
    loader.load_state_dict(position)
    for _ in loader:
        pass
    opened = [
        tuple(int(v) for v in line.split())
        for path in (runs / "repro-stream-resume4").glob("reads.*.txt")
        for line in path.read_text().splitlines()
    ]
    in_epoch_1 = [r for r in opened if r[2] == torchrepro.derive_seed(0, "sample", 1, r[0], r[1])]
    assert sorted(in_epoch_1) == sorted(expected)
    assert len({shard for shard, _, _ in expected}) < 7  # of the 7 non-empty shards


def test_a_hugging_face_iterable_dataset_is_streamed_and_resumes(runs: Path) -> None:
    """A ``datasets.IterableDataset`` (6 shards, a noise ``map``) is streamed through
    ``ShardedDataset.from_hf``: the same weights with 2 workers and after a resume."""
    assert _differing(_weights(runs, "repro-hf0"), _weights(runs, "repro-hf-resume4")) == []
    assert _differing(_weights(runs, "repro-hf0"), _weights(runs, "repro-stream0")) != []  # other data


def test_stream_negative_control_stock_trainer_differs_across_workers_and_resume(runs: Path) -> None:
    """The stock Trainer over the same ShardedDataset: each worker reads every other shard with
    its own RNG, and a resume fast-forwards by iterating the stream from its start."""
    assert _differing(_weights(runs, "stock-stream0"), _weights(runs, "stock-stream2")) != []
    assert _differing(_weights(runs, "stock-stream0"), _weights(runs, "stock-stream-resume4")) != []


def _script_module(name: str) -> Any:
    sys.path.insert(0, str(Path(SCRIPT).parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120
    )


def test_import_torchrepro_imports_no_framework() -> None:
    """Fresh process: ``import torchrepro`` (and using it) loads no framework (the control: the
    probe sees a framework once one is imported)."""
    probe = "sorted(m for m in ('transformers', 'accelerate', 'lightning', 'datasets') if m in sys.modules)"
    proc = _python(
        "import sys, torchrepro, torchrepro.integrations; torchrepro.SeededLoader; "
        f"torchrepro.save_checkpoint; print({probe}); "
        f"import accelerate; print({probe})"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "['accelerate']"]


@pytest.mark.parametrize("missing", ["transformers", "accelerate"])
def test_a_missing_framework_names_the_extra_to_install(missing: str) -> None:
    # sys.modules[name] = None makes `import name` fail as if it were not installed.
    proc = _python(
        f"import sys; sys.modules[{missing!r}] = None\n"
        "try:\n"
        "    import torchrepro.integrations.transformers\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name); print(e)\n"
    )
    assert proc.returncode == 0, proc.stderr
    name, message = proc.stdout.split("\n", 1)
    assert name == missing
    assert "pip install torchrepro[transformers]" in message
    assert f"`{missing}` is not installed" in message


@pytest.mark.parametrize(
    ("setting", "fix"),
    [
        ({"train_sampling_strategy": "group_by_length"}, "train_sampling_strategy='random'"),
        ({"dataloader_in_order": False}, "dataloader_in_order=True"),
    ],
    ids=["group_by_length", "in_order"],
)
def test_settings_a_seeded_loader_cannot_honour_are_refused_with_the_fix(
    tmp_path: Path, rng_changes_ok: None, setting: dict[str, object], fix: str
) -> None:
    import transformers

    from torchrepro.errors import LoaderConfigError
    from torchrepro.integrations.transformers import TorchreproTrainer

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", disable_tqdm=True, use_cpu=True, **setting
    )
    trainer = TorchreproTrainer(model=torch.nn.Linear(2, 1), args=args, train_dataset=[{"x": torch.zeros(2)}])
    with pytest.raises(LoaderConfigError, match=re.escape(fix)):
        trainer.get_train_dataloader()


def test_partitions_for_a_map_style_dataset_are_refused(tmp_path: Path, rng_changes_ok: None) -> None:
    import transformers

    from torchrepro.errors import LoaderConfigError
    from torchrepro.integrations.transformers import TorchreproTrainer

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", disable_tqdm=True, use_cpu=True
    )
    data = [{"x": torch.zeros(2)}]
    trainer = TorchreproTrainer(model=torch.nn.Linear(2, 1), args=args, train_dataset=data, partitions=2)
    with pytest.raises(LoaderConfigError, match="is map-style: drop partitions"):
        trainer.get_train_dataloader()


def _shard(rank: int, world_size: int) -> list[torch.Tensor]:
    """Epoch 1 of the SeededLoader the script's TorchreproTrainer builds, on ``rank``."""
    sys.path.insert(0, str(Path(SCRIPT).parent))
    try:
        from noisy import Noisy
    finally:
        sys.path.pop(0)
    loader = torchrepro.SeededLoader(Noisy(), batch_size=4, seed=0, rank=rank, world_size=world_size)
    loader.set_epoch(1)
    return [batch["x"] for batch in loader]


def _same_batches(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("workers", [0, 2])
def test_the_train_loader_yields_the_seeded_loaders_batches(runs: Path, workers: int) -> None:
    got = torch.load(runs / f"repro{workers}" / "batches.rank0.pt", weights_only=True)
    assert _same_batches(got, _shard(0, 1))


@pytest.mark.slow
def test_two_processes_each_get_their_shard_and_resume_exactly(tmp_path: Path) -> None:
    """Under torchrun the SeededLoader shards by torch.distributed's rank, and the resumed epoch is
    set from the Trainer's step counter (the loader skip_first_batches rebuilds has no set_epoch).
    A stream's position, saved by process 0, resumes both processes (on another worker count)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    for args in (
        # 6 batches, 3 steps an epoch on each process; the stream: 5 batches (of 8 steps' samples)
        ["run", f"repro:0:{tmp_path / 'full'}", f"repro-stream:0:{tmp_path / 'stream'}"],
        [
            "resume",
            f"repro:0:{tmp_path / 'full' / 'checkpoint-4'}:{tmp_path / 'resumed'}",  # epoch 1
            f"repro-stream:2:{tmp_path / 'stream' / 'checkpoint-4'}:{tmp_path / 'stream-resumed'}",
        ],
    ):
        proc = subprocess.run(
            [*torchrun, SCRIPT, *args], env=_env(), capture_output=True, text=True, timeout=240
        )
        assert proc.returncode == 0, f"{args}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    for rank in (0, 1):
        got = torch.load(tmp_path / "full" / f"batches.rank{rank}.pt", weights_only=True)
        assert _same_batches(got, _shard(rank, 2))
    assert _differing(_weights(tmp_path, "full"), _weights(tmp_path, "resumed")) == []
    position = _stream_position(tmp_path / "stream" / "checkpoint-4")
    assert (position["world_size"], position["epoch"], position["batches_consumed"]) == (2, 3, 3)
    assert _differing(_weights(tmp_path, "stream"), _weights(tmp_path, "stream-resumed")) == []


class _Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.linear(x).squeeze(-1)
        return {"loss": (out - labels).pow(2).mean(), "logits": out}


def _train_warnings(
    tmp_path: Path,
    mode: str | None,
    *,
    data: Any = None,
    stock: bool = False,
    resume: str | None = None,
    **arguments: Any,
) -> list[str]:
    """The ReproWarnings of a real in-process TorchreproTrainer.train() of 2 steps (or the stock
    Trainer's, or from a checkpoint) over 8 samples (or ``data``)."""
    import warnings

    import transformers

    from torchrepro import errors
    from torchrepro.flags import DeterminismFlags
    from torchrepro.integrations.transformers import TorchreproTrainer

    flags, env, warned = DeterminismFlags.capture(), dict(os.environ), set(errors._warned)
    errors._warned.clear()
    # strict mode refuses to start without CUBLAS_WORKSPACE_CONFIG once CUDA has started, which on a
    # machine with a GPU an earlier test in this process may have done: set as a GPU user sets it
    os.environ.setdefault(CUBLAS_VAR, CUBLAS_CONFIGS[0])  # put back with the rest below
    try:
        if mode is not None:
            torchrepro.set_determinism(mode)
        settings: dict[str, Any] = {"max_steps": 2, "save_strategy": "no", **arguments}
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            report_to="none",
            disable_tqdm=True,
            use_cpu=True,
            **settings,
        )
        if data is None:
            data = [{"x": torch.full((2,), float(i)), "labels": torch.tensor(1.0)} for i in range(8)]
        cls: Any = transformers.Trainer if stock else TorchreproTrainer
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls(model=_Regression(), args=args, train_dataset=data).train(resume_from_checkpoint=resume)
    finally:
        flags.restore()
        os.environ.clear()
        os.environ.update(env)
        errors._warned.clear()
        errors._warned.update(warned)
    return [str(w.message) for w in caught if issubclass(w.category, torchrepro.ReproWarning)]


def test_training_with_the_switches_off_names_them_once(tmp_path: Path, rng_changes_ok: None) -> None:
    [message] = _train_warnings(tmp_path, "off")
    assert "short of strict mode (deterministic_algorithms, cudnn.deterministic" in message
    assert "torchrepro.set_determinism('strict')" in message and "`torchrepro run`" in message
    assert _train_warnings(tmp_path, "strict") == []
    # the Trainer's own switch sets them too: nothing to say
    assert _train_warnings(tmp_path, None, full_determinism=True) == []


def _samples(n: int) -> Any:
    return ({"x": torch.full((2,), float(i)), "labels": torch.tensor(1.0)} for i in range(n))


def test_a_stream_without_max_steps_is_refused_with_the_fix(tmp_path: Path, rng_changes_ok: None) -> None:
    import transformers

    from torchrepro.errors import LoaderConfigError
    from torchrepro.integrations.transformers import TorchreproTrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    stream = torchrepro.ShardedDataset([3, 4], _samples)
    with pytest.raises(LoaderConfigError, match=re.escape("Pass TrainingArguments(max_steps=N)")):
        TorchreproTrainer(model=_Regression(), args=args, train_dataset=stream)
    trainer = TorchreproTrainer(model=_Regression(), args=args, train_dataset=[{"x": torch.zeros(2)}])
    trainer.train_dataset = stream  # set after construction: refused when the loader is built
    with pytest.raises(LoaderConfigError, match="its length is known only once it is read"):
        trainer.get_train_dataloader()
    # with max_steps: each loader built restores the stream's position; the Trainer's copy of the
    # arguments skips its own fast-forward, the caller's are left as given
    given = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=2
    )
    streaming = TorchreproTrainer(model=_Regression(), args=given, train_dataset=stream)
    for _ in range(2):
        assert streaming.get_train_dataloader().restores
        assert streaming.args.ignore_data_skip and not given.ignore_data_skip
    streaming.train_dataset = [{"x": torch.zeros(2)}]
    streaming.get_train_dataloader()
    assert not streaming.args.ignore_data_skip  # map-style again: the Trainer's own resume
    mapped = TorchreproTrainer(
        model=_Regression(), args=args, train_dataset=[{"x": torch.zeros(2)}], shuffle_buffer=8
    )
    with pytest.raises(LoaderConfigError, match="is map-style, shuffled whole each epoch"):
        mapped.get_train_dataloader()


def test_an_iterable_dataset_without_shards_is_refused_naming_sharded_dataset(
    tmp_path: Path, rng_changes_ok: None
) -> None:
    import transformers

    from torchrepro.errors import UnsupportedDatasetError
    from torchrepro.integrations.transformers import TorchreproTrainer

    class Plain(torch.utils.data.IterableDataset[Any]):
        def __iter__(self) -> Any:
            return _samples(4)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=2
    )
    trainer = TorchreproTrainer(model=_Regression(), args=args, train_dataset=Plain())
    with pytest.raises(
        UnsupportedDatasetError, match=re.escape("torchrepro.ShardedDataset(shards, read_shard)")
    ):
        trainer.get_train_dataloader()


def test_a_stream_resumed_from_a_checkpoint_without_its_position_warns(
    tmp_path: Path, rng_changes_ok: None
) -> None:
    """A checkpoint the stock Trainer saved over the stream has no position: the resume says so
    (once), and still saves its own checkpoints (which then hold the position)."""
    stream = torchrepro.ShardedDataset([3, 4, 5], _samples)
    assert (
        _train_warnings(tmp_path, "strict", data=stream, stock=True, save_strategy="steps", save_steps=2)
        == []
    )
    checkpoint = str(tmp_path / "checkpoint-2")
    [message] = _train_warnings(
        tmp_path, "strict", data=stream, resume=checkpoint, max_steps=3, save_strategy="steps", save_steps=1
    )
    assert "from a checkpoint without the position of the streamed train data" in message
    position = _stream_position(tmp_path / "checkpoint-3")
    assert (position["epoch"], position["batches_consumed"]) == (0, 1)
    # With the Trainer's own restore of stateful callbacks (it replaces the callback): the same.
    resumed = _train_warnings(
        tmp_path,
        "strict",
        data=stream,
        resume=str(tmp_path / "checkpoint-3"),
        max_steps=4,
        save_strategy="steps",
        save_steps=1,
        restore_callback_states_from_checkpoint=True,
    )
    assert resumed == []
    position = _stream_position(tmp_path / "checkpoint-4")
    assert (position["epoch"], position["batches_consumed"]) == (0, 2)
