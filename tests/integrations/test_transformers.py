"""The Hugging Face Trainer with TorchreproTrainerMixin: exact mid-epoch resume across processes,
the same weights for any number of workers; the stock Trainer, as negative control, gives neither.

Every training runs in a subprocess (hf_scripts/train.py): two processes in all, one training
from scratch (saving checkpoints every 4 steps), one resuming from those checkpoints.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SRC = str(Path(__file__).resolve().parents[2] / "src")
SCRIPT = str(Path(__file__).resolve().parent / "hf_scripts" / "train.py")


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, SCRIPT, *args], env=_env(), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"{args}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<kind><workers>``: trained from scratch; ``<kind>-resume<step>``: resumed in a new process."""
    root = tmp_path_factory.mktemp("hf")
    _run(
        "run",
        *(
            f"{kind}:{workers}:{root / f'{kind}{workers}'}"
            for kind in ("repro", "stock")
            for workers in (0, 2)
        ),
    )
    _run(
        "resume",
        f"repro:0:{root / 'repro0' / 'checkpoint-4'}:{root / 'repro-resume4'}",
        f"repro:0:{root / 'repro0' / 'checkpoint-8'}:{root / 'repro-resume8'}",
        f"stock:0:{root / 'stock0' / 'checkpoint-8'}:{root / 'stock-resume8'}",
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


def test_the_trainer_checkpoint_rng_state_loads_with_weights_only(runs: Path) -> None:
    """The resume relies on the Trainer's own rng_state.pth; it is a safe, exact RNG snapshot."""
    state = torch.load(runs / "repro0" / "checkpoint-8" / "rng_state.pth", weights_only=True)
    assert {"python", "numpy", "cpu"} <= state.keys()
    assert isinstance(state["cpu"], torch.Tensor) and state["cpu"].dtype == torch.uint8


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120
    )


def test_import_torchrepro_imports_no_framework() -> None:
    """Fresh process: ``import torchrepro`` (and using it) loads no framework; the integration
    module does (the control: the probe sees a framework once it is imported)."""
    probe = "sorted(m for m in ('transformers', 'accelerate', 'lightning', 'datasets') if m in sys.modules)"
    proc = _python(
        "import sys, torchrepro, torchrepro.integrations; torchrepro.SeededLoader; "
        f"torchrepro.save_checkpoint; print({probe}); "
        f"import torchrepro.integrations.transformers; print({probe})"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "['accelerate', 'transformers']"]


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
