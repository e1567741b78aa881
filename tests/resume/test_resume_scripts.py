"""``check --vary resume`` on scripts with their own checkpoints, each verdict set against the
ground truth of the same resume in plain python (no torchrepro): which resumes give the
uninterrupted run's bits.

Each script is killed by SIGKILL after optimizer step 5 of 12 (mid-epoch: 6 steps per epoch) and
restarted in the same directory. ``handwritten.py`` resumes exactly only without a planted bug;
its ``rng`` and ``optimizer`` bugs show only on a resume (uninterrupted, every variant ends with
the same bits); ``nosave`` retrains from step 0 and so ends with the same bits too.
``own_checkpoints.py`` (torchrepro's checkpoints and loader) resumes exactly. ``ddp_resume.py``
(2 ranks through torchrun, gloo) resumes exactly unless every rank restores rank 0's RNG state.

The check must agree with each: exit 0 where the plain resume is exact (and it resumed), exit 1
naming the step after the resume and what was not restored where it is not, exit 3 where the
restart trained from step 0 again; and a plain check (no kill) of the RNG-forgetting script passes:
the bug only shows on a resume, which is why the mode exists.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from ground_truth import GroundTruth, plain_resume, same_bits

from helpers import check_json, needs_isolation
from torchrepro.errors import ReproAssertionError
from torchrepro.results import CheckResult
from torchrepro.testing import assert_reproducible

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parent / "scripts"
HANDWRITTEN = SCRIPTS / "handwritten.py"
OWN = SCRIPTS / "own_checkpoints.py"
DDP = SCRIPTS / "ddp_resume.py"
CRASH_AFTER = 5  # mid-epoch: epoch 0 has 6 steps


def _handwritten(
    bug: str, tmp_path_factory: pytest.TempPathFactory, reference: GroundTruth | None = None
) -> GroundTruth:
    """``reference``: a variant whose uninterrupted run stands for this one's (the bugs only touch
    saving and loading; ``test_handwritten_uninterrupted_runs_are_reproducible`` shows it for
    ``rng``, which runs its own)."""
    workdir = tmp_path_factory.mktemp(f"handwritten-{bug}")
    return plain_resume(
        HANDWRITTEN,
        ["--bug", bug],
        crash_after=CRASH_AFTER,
        workdir=workdir,
        reference=None if reference is None else reference.reference,
    )


@pytest.fixture(scope="module")
def none(tmp_path_factory: pytest.TempPathFactory) -> GroundTruth:
    return _handwritten("none", tmp_path_factory)


@pytest.fixture(scope="module")
def rng(tmp_path_factory: pytest.TempPathFactory) -> GroundTruth:
    return _handwritten("rng", tmp_path_factory)


@pytest.fixture(scope="module")
def optimizer(tmp_path_factory: pytest.TempPathFactory, none: GroundTruth) -> GroundTruth:
    return _handwritten("optimizer", tmp_path_factory, none)


@pytest.fixture(scope="module")
def nosave(tmp_path_factory: pytest.TempPathFactory, none: GroundTruth) -> GroundTruth:
    return _handwritten("nosave", tmp_path_factory, none)


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> GroundTruth:
    return plain_resume(OWN, [], crash_after=CRASH_AFTER, workdir=tmp_path_factory.mktemp("own"))


def test_handwritten_resumes_exactly(none: GroundTruth) -> None:
    assert none.start_step == CRASH_AFTER
    assert none.exact


def test_handwritten_without_rng_state_differs(rng: GroundTruth) -> None:
    assert rng.start_step == CRASH_AFTER
    assert not rng.exact


def test_handwritten_without_optimizer_state_differs(optimizer: GroundTruth) -> None:
    assert optimizer.start_step == CRASH_AFTER
    assert not optimizer.exact


def test_handwritten_without_checkpoints_retrains_from_scratch(nosave: GroundTruth) -> None:
    assert nosave.start_step == 0
    assert nosave.exact  # trained again from step 0: the same bits, just not a resume


def test_own_checkpoints_resume_exactly(own: GroundTruth) -> None:
    assert own.start_step == CRASH_AFTER
    assert own.exact


def test_handwritten_uninterrupted_runs_are_reproducible(none: GroundTruth, rng: GroundTruth) -> None:
    """Two separate processes of two variants; the bugs only touch saving and loading, so
    uninterrupted they end with the same bits: the ``rng`` bug shows only on a resume (and the
    ``optimizer`` and ``nosave`` variants take ``none``'s uninterrupted run as theirs)."""
    assert same_bits(none.reference, rng.reference), "--bug rng differs uninterrupted"


def test_the_resumed_runs_differ_in_bits_not_in_keys(rng: GroundTruth, optimizer: GroundTruth) -> None:
    """A real difference of values, not a missing or renamed tensor."""
    for truth in (rng, optimizer):
        assert truth.resumed.keys() == truth.reference.keys()
        assert any(not truth.reference[k].equal(truth.resumed[k]) for k in truth.reference)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> GroundTruth:
    workdir = tmp_path_factory.mktemp("ddp")
    return plain_resume(DDP, ["--bug", "none"], crash_after=CRASH_AFTER, workdir=workdir, nproc=2)


@pytest.fixture(scope="module")
def ddp_rank_rng(tmp_path_factory: pytest.TempPathFactory, ddp: GroundTruth) -> GroundTruth:
    workdir = tmp_path_factory.mktemp("ddp-rank-rng")
    return plain_resume(  # the bug only touches loading: the exact variant's uninterrupted run is its
        DDP, ["--bug", "rank-rng"], crash_after=CRASH_AFTER, workdir=workdir, nproc=2, reference=ddp.reference
    )


def test_ddp_resumes_exactly_unless_every_rank_restores_rank_0s_rng(
    ddp: GroundTruth, ddp_rank_rng: GroundTruth
) -> None:
    assert ddp.start_step == ddp_rank_rng.start_step == CRASH_AFTER
    assert ddp.exact
    assert not ddp_rank_rng.exact


# --- the check, against the ground truth above -------------------------------------------------------


def _check(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str) -> tuple[int, dict[str, Any]]:
    """``torchrepro check --json --vary resume ARGS`` in a new directory; (exit code, verdict)."""
    needs_isolation()
    code, verdict, stderr = check_json(tmp_path_factory.mktemp(f"check-{name}"), "--vary", "resume", *args)
    assert "error" not in verdict, f"{verdict['error']}\n{stderr}"
    return code, verdict


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, dict[str, Any]]]:
    """The checks the tests below read, each started once."""
    at = ["--resume-at", str(CRASH_AFTER)]
    return {
        "optimizer": _check(tmp_path_factory, "optimizer", *at, str(HANDWRITTEN), "--bug", "optimizer"),
        "nosave": _check(tmp_path_factory, "nosave", *at, str(HANDWRITTEN), "--bug", "nosave"),
        "own": _check(tmp_path_factory, "own", *at, str(OWN)),
        "ddp": _check(tmp_path_factory, "ddp", "--nproc", "2", *at, str(DDP)),
        "never": _check(tmp_path_factory, "never", "--resume-at", "40", str(HANDWRITTEN)),
        "steps": _check(tmp_path_factory, "steps", "--steps", "8", str(HANDWRITTEN)),
        "ddp-rank-rng": _check(
            tmp_path_factory, "ddp-rr", "--nproc", "2", *at, str(DDP), "--bug", "rank-rng"
        ),
    }


@pytest.fixture(scope="module")
def asserted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CheckResult | ReproAssertionError]:
    """``assert_reproducible(..., vary="resume")`` of the exact script at two kill points (one check,
    two killed and restarted runs) and of the RNG-forgetting one."""
    needs_isolation()
    found: dict[str, CheckResult | ReproAssertionError] = {}
    with contextlib.chdir(tmp_path_factory.mktemp("asserted")):
        found["none"] = assert_reproducible(
            HANDWRITTEN, "--bug", "none", vary="resume", resume_at=(3, CRASH_AFTER)
        )
        try:
            found["rng"] = assert_reproducible(
                HANDWRITTEN, "--bug", "rng", vary="resume", resume_at=CRASH_AFTER
            )
        except ReproAssertionError as exc:
            found["rng"] = exc
        found["rng-plain"] = assert_reproducible(HANDWRITTEN, "--bug", "rng")  # no kill: it passes
    return found


def test_the_exact_script_is_certified_at_every_kill_point(
    asserted: dict[str, CheckResult | ReproAssertionError], none: GroundTruth
) -> None:
    assert none.exact and none.start_step == CRASH_AFTER
    result = asserted["none"]
    assert isinstance(result, CheckResult) and result.reproducible is True
    assert result.resume is not None
    points = [(p.killed_after, p.restored_at, p.steps_compared) for p in result.resume.points]
    assert points == [(3, 3, 12 - 3), (CRASH_AFTER, CRASH_AFTER, 12 - CRASH_AFTER)]
    assert result.to_dict()["resume"]["killed_after"] == 3


def test_forgetting_the_rng_state_is_named_at_the_first_step_after_the_resume(
    asserted: dict[str, CheckResult | ReproAssertionError], rng: GroundTruth
) -> None:
    assert not rng.exact
    error = asserted["rng"]
    assert isinstance(error, ReproAssertionError), "the check passed a resume the ground truth says differs"
    (result,) = error.results
    assert result.reproducible is False
    d = result.first_divergence
    assert d is not None and (d.step, d.kind, d.key) == (CRASH_AFTER, "compute", "optimizer0")
    assert d.name is not None and d.name.startswith("grad:")  # dropout's masks change the gradients first
    assert result.reason is not None and "torch's CPU RNG state before step 5" in result.reason
    assert "NOT reproducible across a resume" in str(error)


def test_a_plain_check_of_the_rng_forgetting_script_passes(
    asserted: dict[str, CheckResult | ReproAssertionError], rng: GroundTruth, none: GroundTruth
) -> None:
    """The control: uninterrupted, the script is reproducible (in plain python too: its reference
    has the exact script's bits), so only a resume shows the bug."""
    assert same_bits(rng.reference, none.reference)
    result = asserted["rng-plain"]
    assert isinstance(result, CheckResult) and result.reproducible is True and result.resume is None


def test_forgetting_the_optimizer_state_names_the_state_not_restored(
    checked: dict[str, tuple[int, dict[str, Any]]], optimizer: GroundTruth
) -> None:
    assert not optimizer.exact
    code, verdict = checked["optimizer"]
    assert code == 1 and verdict["reproducible"] is False
    d = verdict["first_divergence"]
    assert (d["step"], d["kind"], d["name"]) == (CRASH_AFTER, "compute", "state:0.weight:exp_avg")
    assert "was not restored" in verdict["reason"]
    assert verdict["resume"] == {
        "killed_after": CRASH_AFTER,
        "restored_at": CRASH_AFTER,
        "steps_compared": 1,
        "points": [{"killed_after": CRASH_AFTER, "restored_at": CRASH_AFTER, "steps_compared": 1}],
    }


def test_a_script_that_saves_nothing_is_not_certified(
    checked: dict[str, tuple[int, dict[str, Any]]], nosave: GroundTruth
) -> None:
    """Its restart ends with the same bits (it trained again from step 0): a plain comparison of the
    final weights would pass it; the check says it restored nothing (exit 3)."""
    assert nosave.exact and nosave.start_step == 0
    code, verdict = checked["nosave"]
    assert code == 3 and verdict["reproducible"] is None and verdict["inconclusive"]
    assert "restored nothing" in verdict["reason"]
    assert verdict["resume"]["restored_at"] is None


def test_torchrepros_own_checkpoints_resume_exactly(
    checked: dict[str, tuple[int, dict[str, Any]]], own: GroundTruth
) -> None:
    assert own.exact
    code, verdict = checked["own"]
    assert code == 0 and verdict["reproducible"] is True
    assert verdict["resume"]["restored_at"] == CRASH_AFTER
    assert verdict["resume"]["steps_compared"] == 12 - CRASH_AFTER
    assert verdict["coverage"]["per_kind"]["data"] > 0  # its SeededLoader's batches were compared too


def test_every_rank_is_killed_and_compared_under_torchrun(
    checked: dict[str, tuple[int, dict[str, Any]]], ddp: GroundTruth, ddp_rank_rng: GroundTruth
) -> None:
    assert ddp.exact and not ddp_rank_rng.exact
    code, verdict = checked["ddp"]
    assert code == 0 and verdict["reproducible"] is True
    assert set(verdict["coverage"]["per_rank"]) == {"0", "1"}
    code, verdict = checked["ddp-rank-rng"]
    assert code == 1 and verdict["first_divergence"]["step"] == CRASH_AFTER
    assert verdict["reason"].startswith("on rank 1, torch's CPU RNG state before step 5")


def test_a_kill_point_the_script_never_reaches_is_not_a_pass(
    checked: dict[str, tuple[int, dict[str, Any]]],
) -> None:
    code, verdict = checked["never"]
    assert code == 3 and verdict["reproducible"] is None
    assert "ended by itself after 12 optimizer step(s), so it was never killed" in verdict["reason"]


def test_with_steps_the_kill_defaults_to_the_middle_and_the_end_is_not_compared(
    checked: dict[str, tuple[int, dict[str, Any]]],
) -> None:
    code, verdict = checked["steps"]
    assert code == 0 and verdict["reproducible"] is True
    assert verdict["resume"]["points"] == [{"killed_after": 4, "restored_at": 4, "steps_compared": 4}]
    assert any("the state at exit was not compared" in note for note in verdict["notes"])


def test_a_checkpoint_outside_the_working_directory_is_named_not_certified(tmp_path: Path) -> None:
    """Only the working directory is isolated: runs writing one checkpoint under /tmp read each
    other's (the race decides how the runs go wrong); the check names the path and never passes."""
    needs_isolation()
    shared = tmp_path / "shared" / "ckpt.pt"  # outside the check's working directory, "work"
    shared.parent.mkdir()
    (tmp_path / "work").mkdir()
    code, verdict, stderr = check_json(
        tmp_path / "work",
        "--vary",
        "resume",
        "--resume-at",
        str(CRASH_AFTER),
        str(HANDWRITTEN),
        "--ckpt",
        str(shared),
    )
    assert code != 0 and verdict["reproducible"] is not True, stderr
    notes = [n for n in verdict["notes"] if "outside the working directory" in n]
    assert notes, (verdict, stderr)
    note = notes[0]
    assert str(shared) in note and "give the script's checkpoints a path inside the working directory" in note
