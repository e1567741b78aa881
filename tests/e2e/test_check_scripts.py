"""End-to-end: ``torchrepro check`` on real scripts, in real subprocesses (torchrun with gloo).

Every "reproducible" verdict is paired with a negative control in which the same script, run as
plain python would (``--no-seed``) or with one irrelevant setting varied, is caught diverging.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import check_json as check
from helpers import isolation_here, user_env
from torchrepro.protocol import python_hash_seed
from torchrepro.verdict import FINAL_NOT_LOCATED

SCRIPTS = Path(__file__).parent / "scripts"


def script(name: str) -> str:
    return str(SCRIPTS / name)


def test_unseeded_script_is_reproducible_under_check_and_not_without_seeding(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, script("unseeded.py"))
    assert (code, verdict["reproducible"]) == (0, True), err
    assert verdict == {
        "reproducible": True,
        "runs": 2,
        "steps_compared": 4,
        "optimizer_steps": 4,
        "steps_per_optimizer": {"optimizer0": 4},
        "first_divergence": None,
        "inconclusive": False,
        "reason": None,
        "varied": None,
        "portable": None,
        "coverage": {
            "per_kind": {"compute": 4, "data": 4, "final": 1, "init": 1},
            "per_rank": {"0": {"compute": 4, "data": 4, "final": 1, "init": 1}},
            "uncovered_ranks": [],
        },
        "notes": verdict["notes"],  # below: a note where the machine refuses isolation, else none
        "repro": None,
        "isolation": verdict["isolation"],  # below: what this machine allows
        "shared_writes": [],
    }
    # how the runs were kept apart depends on the kernel: an overlay (in a user namespace unless
    # root), or none, with the reason, where the kernel refuses one (and a note saying so)
    here = isolation_here()
    isolation = verdict["isolation"]
    assert (isolation["mode"], isolation["root"]) == (here["mode"], os.path.realpath(tmp_path)), isolation
    if here["mode"] == "overlay":
        assert (isolation["user_namespace"], isolation["reason"]) == (here["user_namespace"], None)
        assert verdict["notes"] == []
    else:
        assert isolation["reason"] and isolation["user_namespace"] is False, isolation
        shared = f"the runs shared {isolation['root']}: {isolation['reason']}"
        assert verdict["notes"] == [f"the runs were not isolated: {shared}"]

    code, verdict, err = check(tmp_path, "--no-seed", script("unseeded.py"))
    assert (code, verdict["reproducible"]) == (1, False), err
    assert verdict["first_divergence"] == {
        "step": 0,
        "rank": 0,
        "kind": "init",
        "op": None,
        "module": None,
        "location": None,
        "key": "optimizer0",
        "name": "param:0.weight",  # the first layer of the script's nn.Sequential
        "shape": [16, 8],
        "dtype": "float32",
    }


def test_vary_workers_exposes_worker_randomness_in_a_plain_dataloader(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, script("worker_random.py"))
    assert (code, verdict["reproducible"]) == (0, True), err
    code, verdict, err = check(tmp_path, "--vary", "workers", script("worker_random.py"))
    assert code == 1, err
    assert verdict["first_divergence"]["kind"] == "data"
    assert verdict["first_divergence"]["step"] == 0
    assert "--vary workers: num_workers 2 -> 0 in 1 DataLoader (run 2)" in verdict["notes"]


def test_vary_workers_that_varies_nothing_is_inconclusive(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, script("no_loader.py"))
    assert (code, verdict["reproducible"]) == (0, True), err  # the control: a plain check passes
    code, verdict, err = check(tmp_path, "--vary", "workers", script("no_loader.py"))
    assert (code, verdict["reproducible"], verdict["inconclusive"]) == (3, None, True), err
    assert "--vary workers: run 2 created no DataLoader; nothing was varied" in verdict["notes"]
    # the headline's reason is the real one, not "not enough was compared" after 4 compared steps
    assert verdict["steps_compared"] == 4
    assert verdict["reason"] == "--vary workers varied nothing: the script created no DataLoader"


def test_vary_workers_survives_a_loader_rebuilt_by_accelerate(tmp_path: Path) -> None:
    """accelerator.prepare rebuilds the loader from the varied one: the variation must stay."""
    code, verdict, err = check(tmp_path, script("worker_random_accelerate.py"))
    assert (code, verdict["reproducible"]) == (0, True), err
    code, verdict, err = check(tmp_path, "--vary", "workers", script("worker_random_accelerate.py"))
    assert code == 1, err
    assert verdict["first_divergence"]["kind"] == "data"


def test_urandom_reseed_before_step_5_is_a_compute_divergence_at_step_5(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, "--no-locate", "--runs", "3", script("urandom_reseed.py"))
    assert code == 1, err
    assert verdict["runs"] == 3
    assert verdict["first_divergence"]["kind"] == "compute"
    assert verdict["first_divergence"]["step"] == 5
    assert verdict["steps_compared"] == 6


def test_unseeded_numpy_generator_in_a_dataset_is_a_data_divergence_at_step_0(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, script("numpy_generator.py"))
    assert code == 1, err
    assert verdict["first_divergence"]["kind"] == "data"
    assert verdict["first_divergence"]["step"] == 0
    assert verdict["steps_compared"] == 0


def test_set_ordered_vocabulary_is_reproducible_and_exposed_by_vary_hashseed(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, script("vocab_set.py"))
    assert (code, verdict["reproducible"]) == (0, True), err
    code, verdict, err = check(tmp_path, "--vary", "hashseed", script("vocab_set.py"))
    assert code == 1, err
    assert verdict["first_divergence"]["kind"] == "data"
    assert verdict["first_divergence"]["step"] == 0


def test_two_rank_ddp_is_reproducible_with_nproc_2(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, "--nproc", "2", script("ddp_train.py"))
    assert (code, verdict["reproducible"]) == (0, True), err
    assert verdict["steps_compared"] == 4
    checks = list((tmp_path / ".torchrepro" / "checks").iterdir())
    assert sorted(p.name for p in (checks[0] / "run0").glob("events.rank*.jsonl")) == [
        "events.rank0.jsonl",
        "events.rank1.jsonl",
    ]
    # negative control: the same launch without seeding differs from the start
    code, verdict, err = check(tmp_path, "--nproc", "2", "--no-seed", script("ddp_train.py"))
    assert code == 1, err
    assert verdict["first_divergence"]["kind"] == "init"


def test_a_script_that_raises_is_exit_2_with_its_traceback_never_a_divergence(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, script("crash.py"))
    assert code == 2
    assert verdict["reproducible"] is None and verdict["first_divergence"] is None
    assert "ValueError: boom at step 1" in err
    assert 'crash.py", line 12' in err
    assert "bootstrap.py" not in err  # the traceback is the script's, as python shows it


def test_a_missing_script_is_exit_2_naming_it(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torchrepro", "check", "--json", "no_such_train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "no_such_train.py" in proc.stderr
    assert not (tmp_path / ".torchrepro").exists()


@pytest.mark.parametrize("n", [1])
def test_steps_stops_every_run_after_n_optimizer_steps_also_serially(tmp_path: Path, n: int) -> None:
    code, verdict, err = check(tmp_path, "--serial", "--steps", str(n), script("unseeded.py"))
    assert (code, verdict["steps_compared"]) == (0, n), err


def test_nothing_compared_is_inconclusive_never_reproducible(tmp_path: Path) -> None:
    """A script that trains nothing (no step, no backward, no batch): exit 3 and the coverage."""
    code, verdict, err = check(tmp_path, script("zero_steps.py"))
    assert code == 3, err
    assert verdict["reproducible"] is None and verdict["inconclusive"] is True
    assert verdict["steps_compared"] == 0 and verdict["coverage"]["uncovered_ranks"] == [0]
    assert verdict["coverage"]["per_kind"] == {"final": 1}  # the state at exit alone is not a pass
    assert any(note.startswith("inconclusive:") for note in verdict["notes"])
    assert verdict["reason"] == (
        "nothing that changes during training was compared: the script took no optimizer step, ran no "
        "backward(), read no DataLoader batch and recorded no value"
    )
    # control: the state at exit is compared, and differs when the runs are not seeded
    code, verdict, err = check(tmp_path, "--no-seed", script("zero_steps.py"))
    assert code == 1 and verdict["first_divergence"]["name"] == "final:model.0.weight", err
    # ... said as what it is (no step to locate), not as "compute at step 0" with a traced re-run
    assert verdict["reason"].startswith("the runs differ only in the final state of model: ")
    assert FINAL_NOT_LOCATED in verdict["notes"]
    assert not [n for n in verdict["notes"] if n.startswith("locating")], verdict["notes"]


def test_a_hand_written_update_loop_is_compared_step_by_step(tmp_path: Path) -> None:
    """No torch.optim: a step per backward(); gradients and the hand-updated weights compared."""
    code, verdict, err = check(tmp_path, script("manual_sgd.py"))
    assert (code, verdict["reproducible"], verdict["inconclusive"]) == (0, True, False), err
    assert verdict["steps_compared"] == 5
    # per step: the gradients after backward(), and the weights after the hand-written update
    assert verdict["coverage"]["per_kind"] == {"compute": 10, "final": 1, "init": 1}
    # the weights really differ between runs that draw different seeds: caught at init
    code, verdict, err = check(tmp_path, script("manual_sgd.py"), "--unseeded")
    assert code == 1, err
    assert verdict["first_divergence"]["kind"] == "init"
    assert verdict["first_divergence"]["name"] == "param:weight"
    # the same loop through torch.optim is compared as optimizer steps
    code, verdict, err = check(tmp_path, script("manual_sgd.py"), "--optim")
    assert (code, verdict["reproducible"], verdict["inconclusive"]) == (0, True, False), err
    assert verdict["coverage"]["per_kind"] == {"compute": 5, "final": 1, "init": 1}


@pytest.mark.parametrize("update", ["data", "no_grad", "custom"])
def test_every_hand_written_update_shape_is_seen_and_stopped_by_steps(tmp_path: Path, update: str) -> None:
    """``p.data.add_``, an update under no_grad, a custom optimizer class: each recorded and stopped."""
    args = (script("manual_update.py"), "--update", update, "--steps", "50")
    code, verdict, err = check(tmp_path, "--steps", "3", *args)
    assert (code, verdict["reproducible"]) == (0, True), err
    assert verdict["steps_compared"] == 3
    assert verdict["coverage"]["per_kind"] == {"compute": 6, "init": 1}
    code, verdict, err = check(tmp_path, "--steps", "3", "--no-seed", *args)  # unseeded runs part
    assert code == 1 and verdict["first_divergence"]["kind"] == "init", err
    assert verdict["first_divergence"]["name"] == "param:encoder.weight"


def test_two_seeds_of_a_hand_written_update_loop_are_not_identical(tmp_path: Path) -> None:
    env = user_env()
    target = (script("manual_update.py"), "--steps", "2")
    for seed in ("1", "2"):
        run = [sys.executable, "-m", "torchrepro", "run", "--seed", seed, "--record", f"s{seed}", *target]
        subprocess.run(run, cwd=tmp_path, env=env, check=True, capture_output=True)
    compare = [sys.executable, "-m", "torchrepro", "compare", "--json", "s1", "s2"]
    proc = subprocess.run(compare, cwd=tmp_path, env=env, capture_output=True, text=True)
    result = json.loads(proc.stdout)
    assert proc.returncode == 1 and result["reproducible"] is False, proc.stderr
    assert result["first_divergence"]["kind"] == "init"
    assert result["notes"][0] == "started with different seed: 1 vs 2"
    assert result["tensor"]["name"] == "param:encoder.weight"


@pytest.mark.parametrize("optim", ["sgd0", "adam"])
def test_a_gradient_only_difference_is_found_at_step_0(tmp_path: Path, optim: str) -> None:
    """Gradients (and Adam's state) differ at step 0 while the parameters do not: step 0, not later."""
    code, verdict, err = check(tmp_path, "--no-locate", script("grad_only.py"), "--optim", optim)
    assert code == 1, err
    d = verdict["first_divergence"]
    assert (d["kind"], d["step"], d["key"], d["name"]) == ("compute", 0, "optimizer0", "grad:0.weight")
    assert (d["shape"], d["dtype"]) == ([8, 6], "float32")
    # the parameters themselves are equal at that step: a parameter-only fingerprint would pass it
    run_dirs = sorted(Path(tmp_path).glob(".torchrepro/checks/*/run*"))
    events = [
        [json.loads(line) for line in (r / "events.rank0.jsonl").read_text().splitlines()] for r in run_dirs
    ]
    step0 = [next(e for e in ev if e["kind"] == "compute") for ev in events]
    pairs = zip(step0[0]["t"], step0[1]["t"], strict=True)
    differs = {la["n"].split(":")[0] for la, lb in pairs if la["fp"] != lb["fp"]}
    assert differs == ({"grad", "state"} if optim == "adam" else {"grad"})
    # control: the same script with an equal factor in both runs is reproducible
    code, verdict, err = check(tmp_path, script("grad_only.py"), "--optim", optim, "--same")
    assert (code, verdict["reproducible"]) == (0, True), err


def test_an_init_divergence_names_the_parameter_by_its_module_path(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, script("named_init.py"))
    assert code == 1, err
    d = verdict["first_divergence"]
    assert (d["kind"], d["name"]) == ("init", "param:encoder.layer.1.attn.k.weight")


def test_a_data_divergence_names_the_loader_line_and_the_batch_field(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, script("named_batch_field.py"))
    assert code == 1, err
    d = verdict["first_divergence"]
    line = next(
        i
        for i, text in enumerate((SCRIPTS / "named_batch_field.py").read_text().splitlines(), 1)
        if text.startswith("loader = DataLoader(")
    )
    assert (d["kind"], d["step"], d["key"]) == ("data", 0, "loader0")
    assert d["location"] == f"{script('named_batch_field.py')}:{line}"
    assert (d["name"], d["shape"], d["dtype"]) == ('["labels"]', [4, 5], "int64")


def test_a_divergence_in_a_hand_written_update_loop_is_located(tmp_path: Path) -> None:
    """Steps counted by backward() are traced and located like optimizer steps."""
    code, verdict, err = check(tmp_path, script("manual_dropout.py"))
    assert code == 1, err
    d = verdict["first_divergence"]
    assert (d["kind"], d["step"], d["key"]) == ("compute", 2, "backward")
    assert d["op"].startswith("aten.bernoulli") and d["module"] == "1"
    assert d["location"] == f"{script('manual_dropout.py')}:13"


def test_vary_threads_names_the_op_whose_result_depends_on_the_thread_count(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, script("threads_layernorm.py"))
    assert (code, verdict["reproducible"]) == (0, True), err  # the control: same thread count
    code, verdict, err = check(tmp_path, "--vary", "threads", script("threads_layernorm.py"))
    assert code == 1, err
    d = verdict["first_divergence"]
    assert (d["kind"], d["step"], d["name"]) == ("compute", 0, "grad:1.weight")
    assert d["op"] == "aten.native_layer_norm_backward.default"
    note = next(n for n in verdict["notes"] if "source op" in n)
    assert "between 1 thread (first run) and 2 threads (other run)" in note
    assert "depends on that setting" in note and "random" not in note.split("not on")[0]
    assert verdict["varied"] == "1 vs 2 threads"


# --- verdicts that name the real reason -----------------------------------------------------------


def _locating(verdict: dict[str, object]) -> list[str]:
    return [n for n in verdict["notes"] if str(n).startswith("locating")]  # type: ignore[attr-defined]


def test_training_in_forked_processes_is_named_as_the_reason_and_never_located(tmp_path: Path) -> None:
    """Hogwild!: forked trainers update a shared model, the main process takes no step. The final
    state differs: said as training that was not recorded, with no traced re-run (there is no
    recorded step to trace) and --steps said not applied to what was compared."""
    code, verdict, err = check(tmp_path, "--steps", "2", script("hogwild.py"), "--noisy")
    assert code == 1, err
    d = verdict["first_divergence"]
    assert (d["kind"], d["key"], d["name"]) == ("compute", "final", "final:model.0.weight")
    assert verdict["reason"].startswith(
        "the runs differ only in the final state of model: the training that changed it was not "
        "recorded (it trained in python processes torchrepro does not record"
    ), verdict["reason"]
    notes = "\n".join(verdict["notes"])
    assert "hogwild.py --noisy` was not recorded: it was forked from a process of the run" in notes
    assert FINAL_NOT_LOCATED in verdict["notes"]
    assert _locating(verdict) == [] and "op tracing unavailable" not in notes
    assert not list(tmp_path.glob(".torchrepro/checks/*/locate*"))  # no traced re-run started
    assert "--steps 2 could not be applied to what was compared" in notes
    # control: the trainers one after the other, without noise, end in the same state; nothing
    # was compared, and the headline says where the training went
    code, verdict, err = check(tmp_path, script("hogwild.py"), "--sequential")
    assert (code, verdict["reproducible"], verdict["first_divergence"]) == (3, None, None), err
    assert verdict["reason"] == (
        "nothing was compared: the training ran in python processes torchrepro does not record "
        "(see the notes)"
    )


def test_an_update_no_optimizer_or_backward_made_is_named_and_steps_is_not_silently_ignored(
    tmp_path: Path,
) -> None:
    """torch.autograd.grad and an in-place update: nothing the recorder counts as a step."""
    code, verdict, err = check(tmp_path, "--steps", "2", script("grad_update.py"), "--noisy")
    assert code == 1, err
    assert verdict["reason"].startswith(
        "the runs differ only in the final state of model: the training that changed it was not "
        "recorded (the process holding it took no optimizer step and ran no backward()"
    ), verdict["reason"]
    assert _locating(verdict) == [] and FINAL_NOT_LOCATED in verdict["notes"]
    assert (
        "--steps 2 was not applied: the script took no optimizer step and ran no backward() that "
        "torchrepro counts, so every run ran to its end"
    ) in verdict["notes"]
    # control: the same update from a seeded generator ends in equal states; not a pass either
    code, verdict, err = check(tmp_path, script("grad_update.py"))
    assert (code, verdict["reproducible"]) == (3, None), err
    assert verdict["reason"].startswith("nothing that changes during training was compared")


@pytest.mark.parametrize(
    ("vary", "varied"),
    [
        ("threads", "1 vs 2 threads"),
        ("workers", "num_workers 0 vs 2 in 1 DataLoader"),
        ("hashseed", f"PYTHONHASHSEED {python_hash_seed(0, 'vary', 0)} vs {python_hash_seed(0, 'vary', 1)}"),
    ],
)
def test_a_reproducible_verdict_under_vary_says_what_was_varied(
    tmp_path: Path, vary: str, varied: str
) -> None:
    code, verdict, err = check(tmp_path, "--vary", vary, script("unseeded.py"))
    assert (code, verdict["reproducible"], verdict["varied"]) == (0, True, varied), err
    assert verdict["reason"] is None


def test_two_optimizers_are_counted_as_optimizer_steps_and_two_models_told_apart(tmp_path: Path) -> None:
    """A GAN: optimizerD and optimizerG step 3 times each (6 optimizer steps in 3 training steps);
    netG and netD both hold main.0.weight, and each name says which model it is."""
    code, verdict, err = check(tmp_path, script("gan.py"))
    assert (code, verdict["reproducible"]) == (0, True), err
    assert (verdict["steps_compared"], verdict["optimizer_steps"]) == (3, 6)
    assert verdict["steps_per_optimizer"] == {"optimizer0": 3, "optimizer1": 3}
    (run0,) = tmp_path.glob(".torchrepro/checks/*/run0")
    events = [json.loads(line) for line in (run0 / "events.rank0.jsonl").read_text().splitlines()]
    inits = {e["key"]: [leaf["n"] for leaf in e["t"]] for e in events if e["kind"] == "init"}
    assert inits["optimizer0"][0] == "param:netD.main.0.weight"
    assert inits["optimizer1"][0] == "param:netG.main.0.weight"
    # control: noise in what netD sees parts the runs in netD's gradients, named as netD's
    code, verdict, err = check(tmp_path, "--no-locate", script("gan.py"), "--noisy")
    assert code == 1, err
    d = verdict["first_divergence"]
    assert (d["kind"], d["step"], d["key"], d["name"]) == (
        "compute",
        0,
        "optimizer0",
        "grad:netD.main.0.weight",
    )


def test_vary_workers_on_a_stream_of_shards_is_reproducible_through_seeded_loader(tmp_path: Path) -> None:
    """The batches the loop receives from a streamed SeededLoader are recorded (not the shards
    its workers hand over), and they are the same with 2 workers and none; the plain DataLoader
    over the same ShardedDataset is caught at its first batch."""
    code, verdict, err = check(tmp_path, "--vary", "workers", script("stream_shards.py"), "seeded")
    assert (code, verdict["reproducible"]) == (0, True), err
    assert verdict["coverage"]["per_kind"]["data"] == verdict["coverage"]["per_kind"]["compute"] == 26
    code, verdict, err = check(tmp_path, "--vary", "workers", script("stream_shards.py"), "plain")
    assert code == 1, err
    assert (verdict["first_divergence"]["kind"], verdict["first_divergence"]["step"]) == ("data", 0)
