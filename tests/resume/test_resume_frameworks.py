"""``check --vary resume --resume-args --resume`` on the frameworks' own resume, against its ground
truth in plain python: stock Lightning's ``ckpt_path="last"`` does not resume to the uninterrupted
run's bits; the Hugging Face Trainer's ``resume_from_checkpoint=True`` does.

Each script (12 optimizer steps, 6 per epoch, a checkpoint after every step) is SIGKILLed after
step 5 (mid-epoch) and restarted with ``--resume`` in the same directory. Both frameworks restart
at the right step (``START_STEP`` is 5). (Checked by hand at the epoch boundary, step 6, too:
the same verdicts, for the reasons below.)

``lightning_last.py`` (``lightning.seed_everything(0)``, ``DataLoader(shuffle=True)``, dropout,
Adam) restores the weights, the optimizer and the loop's progress, but not the global RNG states:
the restart draws from the state ``seed_everything(0)`` left, as a fresh run does. So the dropout
masks after the resume are those of a fresh start, and so is the order of the next epoch, which
``RandomSampler`` draws from the global torch RNG when the epoch's iterator is made. Mid-epoch, the
plain ``DataLoader`` cannot resume its position either: Lightning starts a new iterator and
runs only the epoch's remaining batch of it, so step 6 trains on the first batch of a fresh
permutation (epoch 0's first batch) instead of the sixth. Every tensor of ``final.pt`` differs.

``hf_resume.py`` (``transformers.Trainer``, ``seed=0``, the same kind of model and data) resumes
exactly: accelerate's seedable sampler draws each epoch's order from ``seed + epoch``, the
Trainer skips the batches the epoch already trained (``skip_first_batches``), and it restores
the Python, NumPy and torch RNG states from the checkpoint's ``rng_state.pth`` before the next
step (at an epoch boundary, before the epoch starts).

Uninterrupted, each script is reproducible (HF: the restart has the reference's bits; Lightning:
a second reference run has them). The check must say the same: Lightning NOT reproducible across a
resume, first at step 5 with the batch (the loader's position) and the RNG named; HF exact.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from ground_truth import GroundTruth, plain_resume, plain_run, same_bits

from helpers import check_json, needs_isolation

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parent / "scripts"
FRAMEWORKS = {"lightning": SCRIPTS / "lightning_last.py", "hf": SCRIPTS / "hf_resume.py"}
CRASH_AFTER = 5  # mid-epoch (6 steps an epoch)


@pytest.fixture(scope="module")
def truths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, GroundTruth]:
    """The plain ground truth of each framework's resume."""

    def resume(name: str) -> GroundTruth:
        workdir = tmp_path_factory.mktemp(name)
        return plain_resume(
            FRAMEWORKS[name], [], crash_after=CRASH_AFTER, resume_args=["--resume"], workdir=workdir
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(FRAMEWORKS, pool.map(resume, FRAMEWORKS), strict=True))


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, dict[str, Any]]]:
    needs_isolation()
    found = {}
    for name, script in FRAMEWORKS.items():
        at = ["--resume-at", str(CRASH_AFTER), "--resume-args", "--resume"]
        code, verdict, stderr = check_json(
            tmp_path_factory.mktemp(f"check-{name}"), "--vary", "resume", *at, str(script)
        )
        assert "error" not in verdict, f"{verdict['error']}\n{stderr}"
        found[name] = code, verdict
    return found


def test_lightning_last_checkpoint_resumes_at_the_step_but_not_exactly(
    truths: dict[str, GroundTruth], tmp_path: Path
) -> None:
    truth = truths["lightning"]
    assert truth.start_step == CRASH_AFTER
    assert not truth.exact
    assert truth.resumed.keys() == truth.reference.keys()
    same = [k for k in truth.reference if truth.reference[k].equal(truth.resumed[k])]
    assert not same, f"expected every tensor to differ after the resume, these did not: {same}"
    # uninterrupted, it is reproducible: the resume is what differs
    assert same_bits(truth.reference, plain_run(FRAMEWORKS["lightning"], workdir=tmp_path / "again"))


def test_hf_trainer_resumes_exactly(truths: dict[str, GroundTruth]) -> None:
    truth = truths["hf"]
    assert truth.start_step == CRASH_AFTER
    assert truth.exact


def test_the_check_names_where_lightnings_resume_parts(
    checked: dict[str, tuple[int, dict[str, Any]]], truths: dict[str, GroundTruth]
) -> None:
    assert not truths["lightning"].exact
    code, verdict = checked["lightning"]
    assert code == 1 and verdict["reproducible"] is False
    d = verdict["first_divergence"]
    assert d["kind"] == "data" and d["location"].startswith(f"{FRAMEWORKS['lightning']}:")
    assert "the loader did not resume at its position" in verdict["reason"]
    assert "torch's CPU RNG state before step 5" in verdict["reason"]
    assert verdict["resume"]["restored_at"] == CRASH_AFTER  # it did restore the weights of step 5


def test_the_check_certifies_the_hf_trainers_resume(
    checked: dict[str, tuple[int, dict[str, Any]]], truths: dict[str, GroundTruth]
) -> None:
    assert truths["hf"].exact
    code, verdict = checked["hf"]
    assert code == 0 and verdict["reproducible"] is True
    assert verdict["resume"]["restored_at"] == CRASH_AFTER
    assert verdict["resume"]["steps_compared"] == 12 - CRASH_AFTER
