"""The Hugging Face Trainer with TorchreproTrainerMixin: exact mid-epoch resume across processes,
the same weights for any number of workers; the stock Trainer, as negative control, gives neither.

Every training runs in a subprocess (hf_scripts/train.py): two processes in all, one training
from scratch (saving checkpoints every 4 steps), one resuming from those checkpoints.
"""

from __future__ import annotations

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
            ["run", f"{kind}:0:{root / f'{kind}0'}", f"{kind}:2:{root / f'{kind}2'}"]
            for kind in ("repro", "stock")
        )
    )
    _run_together(
        [
            "resume",
            f"repro:0:{root / 'repro0' / 'checkpoint-4'}:{root / 'repro-resume4'}",
            f"repro:0:{root / 'repro0' / 'checkpoint-8'}:{root / 'repro-resume8'}",
        ],
        ["resume", f"stock:0:{root / 'stock0' / 'checkpoint-8'}:{root / 'stock-resume8'}"],
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
    set from the Trainer's step counter (the loader skip_first_batches rebuilds has no set_epoch)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    for args in (
        ["run", f"repro:0:{tmp_path / 'full'}"],  # 6 batches, 3 steps an epoch on each process
        ["resume", f"repro:0:{tmp_path / 'full' / 'checkpoint-4'}:{tmp_path / 'resumed'}"],  # epoch 1
    ):
        proc = subprocess.run(
            [*torchrun, SCRIPT, *args], env=_env(), capture_output=True, text=True, timeout=240
        )
        assert proc.returncode == 0, f"{args}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    for rank in (0, 1):
        got = torch.load(tmp_path / "full" / f"batches.rank{rank}.pt", weights_only=True)
        assert _same_batches(got, _shard(rank, 2))
    assert _differing(_weights(tmp_path, "full"), _weights(tmp_path, "resumed")) == []


class _Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.linear(x).squeeze(-1)
        return {"loss": (out - labels).pow(2).mean(), "logits": out}


def _train_warnings(tmp_path: Path, mode: str | None, **arguments: Any) -> list[str]:
    """The ReproWarnings of a real in-process TorchreproTrainer.train() of 2 steps."""
    import warnings

    import transformers

    from torchrepro import errors
    from torchrepro.flags import DeterminismFlags
    from torchrepro.integrations.transformers import TorchreproTrainer

    flags, env, warned = DeterminismFlags.capture(), dict(os.environ), set(errors._warned)
    errors._warned.clear()
    try:
        if mode is not None:
            torchrepro.set_determinism(mode)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path),
            max_steps=2,
            per_device_train_batch_size=2,
            report_to="none",
            disable_tqdm=True,
            use_cpu=True,
            save_strategy="no",
            **arguments,
        )
        data = [{"x": torch.full((2,), float(i)), "labels": torch.tensor(1.0)} for i in range(8)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            TorchreproTrainer(model=_Regression(), args=args, train_dataset=data).train()
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
