"""The settings rules (``audit.settings_rules``, ``audit.loader_rules``) on given settings and ops."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from torchrepro.audit import ProbeSettings, audit_settings
from torchrepro.flags import CUBLAS_CONFIGS

# --------------------------------------------------------------------------------------------
# audit_settings


def _settings(**changes: Any) -> ProbeSettings:
    """Settings with which a script is reproducible and nothing is reported, changed as given."""
    base = ProbeSettings(
        hash_randomization=False,
        pythonhashseed="0",
        cublas_workspace_config=CUBLAS_CONFIGS[0],
        deterministic_algorithms=True,
        warn_only=False,
        cudnn_benchmark=False,
        cudnn_deterministic=True,
        cudnn_allow_tf32=False,
        cuda_matmul_allow_tf32=False,
        float32_matmul_precision="highest",
        num_threads=1,
        set_num_threads_called=True,
        thread_env={"OMP_NUM_THREADS": None, "MKL_NUM_THREADS": None},
        torch_seeded=True,
        seeded={"random": True, "numpy": True, "torch": True},
        tainted_seeds=(),
        inductor_deterministic=None,
        compile_calls=(),
        dataloaders=(),
        optimizer_steps=1,
        calls=(),
        cuda_initialized=False,
    )
    records = {k: tuple(v) for k, v in changes.items() if isinstance(v, list)}
    return dataclasses.replace(base, **{**changes, **records})


def test_reproducible_settings_give_no_finding() -> None:
    assert audit_settings(_settings(), events=CONV + MM) == []


CONV = [{"op": "aten.convolution.default"}]
MM = [{"op": "aten.addmm.default"}]


@pytest.mark.parametrize(
    ("settings", "events", "expected"),
    [
        ({"hash_randomization": True}, [], [("TR201", "warning")]),
        ({"hash_randomization": False}, [], []),
        ({"cublas_workspace_config": None, "deterministic_algorithms": False}, MM, [("TR202", "warning")]),
        ({"cublas_workspace_config": None}, [], []),
        ({"cublas_workspace_config": ":4096:8"}, MM, []),
        (
            {"cublas_workspace_config": None, "deterministic_algorithms": True, "warn_only": False},
            MM,
            [("TR202", "error")],
        ),
        ({"cudnn_benchmark": True}, [], [("TR203", "warning")]),
        ({"cuda_matmul_allow_tf32": True, "float32_matmul_precision": "high"}, [], [("TR204", "info")]),
        ({"cudnn_allow_tf32": True}, [], []),
        ({"cudnn_allow_tf32": True}, CONV, [("TR204", "info")]),
        ({"deterministic_algorithms": False, "cudnn_deterministic": False}, CONV, [("TR205", "warning")]),
        ({"deterministic_algorithms": False, "cudnn_deterministic": True}, CONV, []),
        ({"deterministic_algorithms": False}, MM, []),
        ({"deterministic_algorithms": True, "warn_only": True}, [], [("TR206", "warning")]),
        ({"set_num_threads_called": False, "thread_env": {}, "num_threads": 8}, [], [("TR207", "warning")]),
        ({"set_num_threads_called": False, "thread_env": {"OMP_NUM_THREADS": "4"}}, [], []),
        ({"torch_seeded": False}, [], [("TR208", "warning")]),
        ({"torch_seeded": True}, [], []),
        ({"dataloaders": [{"num_workers": 2, "random_hint": "RandomCrop"}]}, [], [("TR301", "warning")]),
        ({"dataloaders": [{"num_workers": 2, "random_hint": "x", "seeded_loader": True}]}, [], []),
        ({"dataloaders": [{"num_workers": 2}]}, [], [("TR302", "info")]),
        ({"dataloaders": [{"num_workers": 0, "shuffle": True, "generator": False}]}, [], [("TR303", "info")]),
        ({"dataloaders": [{"num_workers": 0, "shuffle": True, "generator": True}]}, [], []),
        (
            {"compile_calls": [{"backend": "inductor"}], "deterministic_algorithms": False},
            [],
            [("TR401", "warning")],
        ),
        ({"compile_calls": [{"backend": "inductor"}], "inductor_deterministic": True}, [], []),
        ({"compile_calls": [{"backend": "eager"}]}, [], []),
        ({"optimizer_steps": 0}, [], [("TR003", "info")]),
        ({}, CONV + MM, []),
    ],
)
def test_settings_findings(
    settings: dict[str, Any], events: list[dict[str, Any]], expected: list[tuple[str, str]]
) -> None:
    # every other setting as in _settings(): reproducible, nothing to report
    found = audit_settings(_settings(**settings), events=events)
    assert [(f.code, f.severity) for f in found] == expected


def test_warn_only_finding_names_the_ops_that_stay_nondeterministic() -> None:
    events = [{"op": "aten.upsample_bilinear2d_backward.default", "backward": True}]
    (finding,) = audit_settings(_settings(warn_only=True), events=events)
    assert "aten.upsample_bilinear2d_backward" in finding.message


_SEEDED = {"random": True, "numpy": True, "torch": True}
_UNSEEDED = {"random": False, "numpy": False, "torch": False}


def _loader(**kw: Any) -> dict[str, Any]:
    return {"dataset": "Aug", "location": "train.py:9", "num_workers": 0, **kw}


def _draws(*rngs: str) -> dict[str, Any]:
    return {"ran": True, "draws": list(rngs), "unstable": False}


@pytest.mark.parametrize(
    ("loader", "seeded", "expected"),
    [
        # main-process loading: every global RNG the dataset draws from must be seeded by the script
        (_loader(probe=_draws("random")), {**_SEEDED, "random": False}, ["TR304"]),
        (_loader(probe=_draws("numpy")), {**_SEEDED, "random": False}, []),
        (_loader(probe=_draws("numpy")), _SEEDED, []),
        # in workers torch reseeds all three from the base seed: only torch's seeding (or generator=) counts
        (_loader(num_workers=2, probe=_draws("numpy")), {**_UNSEEDED, "torch": True}, ["TR301"]),
        (_loader(num_workers=2, probe=_draws("numpy")), _UNSEEDED, ["TR301", "TR304"]),
        (_loader(num_workers=2, probe=_draws("numpy"), generator=True), _UNSEEDED, ["TR301"]),
        # measured to draw nothing: no "might draw" info either
        (_loader(num_workers=2, probe=_draws(), random_hint="RandomCrop"), _UNSEEDED, []),
        # the probe could not run: the heuristic decides
        (_loader(num_workers=2, probe={"ran": False}, random_hint="RandomCrop"), _UNSEEDED, ["TR301"]),
        (_loader(probe={"ran": True, "draws": [], "unstable": True}), _SEEDED, ["TR306"]),
    ],
)
def test_dataset_findings(loader: dict[str, Any], seeded: dict[str, bool], expected: list[str]) -> None:
    findings = audit_settings(_settings(dataloaders=[loader], seeded=seeded))
    assert sorted(f.code for f in findings) == expected
    assert all(f.location == "train.py:9" for f in findings)


def test_dataset_finding_names_the_rng_and_the_framework_setting() -> None:
    loader = _loader(probe=_draws("random", "numpy"), framework="lightning")
    (finding,) = audit_settings(_settings(dataloaders=[loader], seeded={**_SEEDED, "numpy": False}))
    assert "Aug.__getitem__" in finding.message and "NumPy's global RNG" in finding.message
    assert "Python's global random" not in finding.message  # seeded: not named
    assert "np.random.seed(0)" in finding.fix and "seed_everything(0, workers=True)" in finding.fix
    (hf,) = audit_settings(_settings(dataloaders=[{**loader, "framework": "transformers"}], seeded=_UNSEEDED))
    assert "TrainingArguments(seed=" in hf.fix


@pytest.mark.parametrize(
    ("loader", "fix"),
    [
        ({"shuffle": True, "generator": False}, "Pass generator="),
        (
            {"shuffle": True, "generator": True, "sampler_generator": False, "sampler_given": "sampler"},
            "Give the generator to the sampler: RandomSampler(dataset, generator=",
        ),
        (
            {"shuffle": True, "sampler_generator": False, "sampler_given": "batch_sampler"},
            "Give the generator to the sampler",
        ),
        ({"shuffle": True, "generator": False, "sampler_generator": True, "sampler_given": "sampler"}, None),
    ],
)
def test_shuffle_fix_names_the_generator_that_draws_the_order(
    loader: dict[str, Any], fix: str | None
) -> None:
    findings = audit_settings(
        _settings(dataloaders=[{"num_workers": 0, "sampler": "RandomSampler", **loader}])
    )
    assert [f.fix.startswith(fix) for f in findings] == ([] if fix is None else [True])
    if loader.get("generator") and loader.get("sampler_given"):
        assert "does not reach it" in findings[0].message


def test_seed_drawn_from_an_unseeded_source() -> None:
    call = {"call": "torch.manual_seed", "rng": "torch", "location": "train.py:3", "source": "random.randint"}
    (finding,) = audit_settings(_settings(tainted_seeds=[call]))
    assert (finding.code, finding.severity, finding.location) == ("TR305", "warning", "train.py:3")
    assert "random.randint" in finding.message and "torch's global RNG" in finding.message


# --------------------------------------------------------------------------------------------
# Training seen as check sees it: backward steps, and training in child processes


def _child(pid: int, **kw: Any) -> dict[str, Any]:
    return {
        "pid": pid,
        "main": False,
        "followed": True,
        "target": "train",
        "location": "train.py:11",
        "optimizer_steps": 0,
        "backward_steps": 0,
        "torch_seeded": True,
        **kw,
    }


_MAIN = {
    "pid": 1,
    "main": True,
    "followed": True,
    "optimizer_steps": 0,
    "backward_steps": 0,
    "torch_seeded": True,
}


def test_a_hand_written_update_loop_is_training() -> None:
    # backward() steps with no optimizer: training (check counts a step per backward())
    assert audit_settings(_settings(optimizer_steps=0, backward_steps=1)) == []
    # control: nothing trained at all is still said
    (finding,) = audit_settings(_settings(optimizer_steps=0, backward_steps=0))
    assert finding.code == "TR003" and "no optimizer step and ran no backward()" in finding.message


def test_training_in_child_processes_is_training() -> None:
    procs = [_MAIN, _child(2, optimizer_steps=1), _child(3, optimizer_steps=1)]
    assert audit_settings(_settings(optimizer_steps=2, processes=procs)) == []
    # control: children that did not train either
    idle = [_MAIN, _child(2), _child(3)]
    (finding,) = audit_settings(_settings(optimizer_steps=0, processes=idle))
    assert finding.code == "TR003"
    assert ", nor did the 2 child processes started at train.py:11 (target train);" in finding.message


def test_children_the_audit_did_not_follow_are_named_never_called_no_training() -> None:
    procs = [_MAIN, _child(2, followed=False, torch_seeded=None, location="train.py:20")]
    (finding,) = audit_settings(_settings(optimizer_steps=0, processes=procs))
    assert (finding.code, finding.severity) == ("TR003", "info")
    assert "1 child process started at train.py:20 (target train) ran outside the audit" in finding.message
    assert "inference-only" not in finding.message and "made no optimizer step" not in finding.message
    # training seen elsewhere: nothing to say about the unfollowed one in TR003's place
    trained = [{**_MAIN, "optimizer_steps": 1}, procs[1]]
    assert audit_settings(_settings(optimizer_steps=1, processes=trained)) == []


def test_torch_seeding_is_judged_in_the_processes_that_trained() -> None:
    # the parent seeds nothing, each child seeds itself: nothing to report
    seeding_children = [
        {**_MAIN, "torch_seeded": False},
        _child(2, optimizer_steps=1),
        _child(3, optimizer_steps=1),
    ]
    assert audit_settings(_settings(torch_seeded=False, processes=seeding_children)) == []
    # control: the children train unseeded
    unseeded = [
        _MAIN,
        _child(2, optimizer_steps=1, torch_seeded=False),
        _child(3, optimizer_steps=1, torch_seeded=False),
    ]
    (finding,) = audit_settings(_settings(processes=unseeded))
    assert finding.code == "TR208"
    assert finding.message.startswith(
        "The 2 child processes started at train.py:11 (target train) train without"
    )
    # the parent trains unseeded: the script's own message
    parent = [{**_MAIN, "optimizer_steps": 1, "torch_seeded": False}, _child(2, optimizer_steps=1)]
    (finding,) = audit_settings(_settings(processes=parent))
    assert finding.message.startswith("The script never seeds torch's RNG")


def test_a_loader_in_a_child_is_judged_by_that_childs_seeding() -> None:
    loader = _loader(probe=_draws("random"))
    # the judged process seeded random, the child that built the loader did not
    child_loader = {**loader, "seeded": {**_SEEDED, "random": False}, "pid": 2}
    assert [f.code for f in audit_settings(_settings(dataloaders=[child_loader]))] == ["TR304"]
    assert audit_settings(_settings(dataloaders=[{**child_loader, "seeded": _SEEDED}])) == []


# --------------------------------------------------------------------------------------------
# TR501: processes updating one module in shared memory at the same time (hogwild)

_SHARED_UPDATE = {
    "module": "Linear",
    "variable": "model",
    "via": "optimizer",
    "steps": 3,
    "first": 1,
    "last": 3,
}


def _hog(pid: int, started: int, joined: int | None, **kw: Any) -> dict[str, Any]:
    child = _child(pid, parent_pid=1, started=started, joined=joined, optimizer_steps=3)
    return {**child, "shared_updates": [_SHARED_UPDATE], **kw}


def _tr501(procs: list[dict[str, Any]], **settings: Any) -> list[Any]:
    found = audit_settings(_settings(processes=procs, **settings))
    return [f for f in found if f.code == "TR501"]


def test_two_processes_updating_a_shared_model_at_once_is_an_error() -> None:
    shared = ({"class": "Linear", "variable": "model", "location": "train.py:8", "params": 2},)
    (finding,) = _tr501([_MAIN, _hog(2, 1, 3), _hog(3, 2, 4)], shared_modules=shared)
    assert (finding.severity, finding.location) == ("error", "train.py:11")
    assert finding.message.startswith("The 2 child processes started at train.py:11 (target train) update")
    assert "Linear `model`, put in shared memory at train.py:8" in finding.message
    assert "DistributedDataParallel" in finding.fix
    # never joined: they run to the end together
    assert _tr501([_MAIN, _hog(2, 1, None), _hog(3, 2, None)])


def test_the_script_updating_the_shared_model_while_its_child_does() -> None:
    main = {**_MAIN, "optimizer_steps": 3, "shared_updates": [{**_SHARED_UPDATE, "first": 2, "last": 4}]}
    (finding,) = _tr501([main, _hog(2, 1, 5)])
    assert "and the script's own process update" in finding.message
    # control: the script updates it only after joining its child
    after = {**main, "shared_updates": [{**_SHARED_UPDATE, "first": 6, "last": 8}]}
    assert _tr501([after, _hog(2, 1, 5)]) == []


def test_no_hogwild_without_two_concurrent_shared_updaters() -> None:
    # one process updating the shared model
    assert _tr501([_MAIN, _hog(2, 1, 2)]) == []
    # two, one after the other (each joined before the next starts)
    assert _tr501([_MAIN, _hog(2, 1, 2), _hog(3, 3, 4)]) == []
    # two at once, each training a model of its own (DDP-style): no shared updates
    assert _tr501([_MAIN, _hog(2, 1, 3, shared_updates=[]), _hog(3, 2, 4, shared_updates=[])]) == []


# --------------------------------------------------------------------------------------------
# Switches set on lines that did not run (a branch only a GPU takes)


def _statement(switch: str, value: Any, *, ran: bool = False, cuda: bool = True, **kw: Any) -> dict[str, Any]:
    condition = "if torch.cuda.is_available()" if cuda else "if args.fast"
    return {
        "switch": switch,
        "value": value,
        "text": f"{switch} = {value}",
        "location": "train.py:7",
        "condition": condition,
        "cuda": cuda,
        "ran": ran,
        **kw,
    }


@pytest.mark.parametrize(
    ("statement", "settings", "events", "expected"),
    [
        (_statement("cudnn_benchmark", True), {}, [], [("TR203", "warning")]),
        (_statement("cuda_matmul_allow_tf32", True), {}, [], [("TR204", "info")]),
        (_statement("float32_matmul_precision", "high"), {}, [], [("TR204", "info")]),
        (_statement("cudnn_allow_tf32", True), {}, CONV, [("TR204", "info")]),
        (_statement("cudnn_allow_tf32", True), {}, [], []),  # no convolution: TF32 convs do not matter
        (
            _statement("deterministic_algorithms", False),
            {"cudnn_deterministic": False},
            CONV,
            [("TR205", "warning")],
        ),
        (
            _statement("deterministic_algorithms", True, warn_only=True),
            {"cudnn_deterministic": False},
            CONV,
            [("TR206", "warning")],
        ),
        # a condition that does not name CUDA: one step lower
        (_statement("cudnn_benchmark", True, cuda=False), {}, [], [("TR203", "info")]),
        # the fix, on a branch: nothing
        (_statement("cudnn_benchmark", False), {}, [], []),
        # the line ran: the runtime rule alone reports it (once)
        (
            _statement("cudnn_benchmark", True, ran=True),
            {"cudnn_benchmark": True},
            [],
            [("TR203", "warning")],
        ),
        # on at runtime already, from another line: reported once, by the runtime rule
        (_statement("cudnn_benchmark", True), {"cudnn_benchmark": True}, [], [("TR203", "warning")]),
    ],
)
def test_switches_on_lines_that_did_not_run(
    statement: dict[str, Any], settings: dict[str, Any], events: list[dict[str, Any]], expected: list[Any]
) -> None:
    found = audit_settings(_settings(switch_statements=[statement], **settings), events=events)
    assert [(f.code, f.severity) for f in found if f.code != "TR120"] == expected


def test_a_switch_on_a_cuda_branch_says_where_and_what_it_would_set() -> None:
    (finding,) = audit_settings(_settings(switch_statements=[_statement("cudnn_benchmark", True)]))
    assert finding.location == "train.py:7"
    assert (
        "(on a branch not taken in this run: line 7, under `if torch.cuda.is_available()`)" in finding.message
    )
    assert "on CUDA it turns cuDNN benchmarking on" in finding.message
    (lower,) = audit_settings(_settings(switch_statements=[_statement("cudnn_benchmark", True, cuda=False)]))
    assert "line that did not run in this audit: line 7, under `if args.fast`" in lower.message
    assert "one step lower" in lower.message


def test_a_dataset_draw_is_reported_at_the_line_that_draws() -> None:
    probe = {**_draws("random", "numpy"), "sites": {"random": "data.py:20", "numpy": "data.py:21"}}
    (finding,) = audit_settings(
        _settings(dataloaders=[_loader(probe=probe)], seeded={**_SEEDED, "random": False})
    )
    assert finding.code == "TR304" and finding.location == "data.py:20"
    assert "by the DataLoader at train.py:9) draws from Python's global random here" in finding.message
    (workers,) = [
        f
        for f in audit_settings(
            _settings(dataloaders=[_loader(num_workers=2, probe=probe)], seeded=_UNSEEDED)
        )
        if f.code == "TR304"
    ]
    assert (
        workers.location == "data.py:20"
        and "DataLoader workers of the DataLoader at train.py:9" in workers.message
    )
    # control: without a traced line, the loader's line (as before)
    (plain,) = audit_settings(_settings(dataloaders=[_loader(probe=_draws("random"))], seeded=_UNSEEDED))
    assert plain.location == "train.py:9" and "DataLoader at" not in plain.message


# --------------------------------------------------------------------------------------------
# One finding per cause: records of one line (a loop, a helper, each process) are one finding


def test_loaders_made_at_one_line_are_one_finding_per_code() -> None:
    shuffling = _loader(shuffle=True, num_workers=2, random_hint="RandomCrop")
    train, val = {**shuffling, "dataset": "Train"}, {**shuffling, "dataset": "Val", "pid": 2}
    found = audit_settings(_settings(dataloaders=[train, val, train]))
    assert [(f.code, f.location) for f in found] == [("TR301", "train.py:9"), ("TR303", "train.py:9")]
    assert all(
        f.message.endswith(
            "This finding covers the 3 DataLoaders created at train.py:9 (datasets Train, Val)."
        )
        for f in found
    )
    # control: a loader made at another line is another cause, with its own findings
    other = {**train, "location": "train.py:30"}
    found = audit_settings(_settings(dataloaders=[train, other]))
    assert [(f.code, f.location) for f in found] == [
        ("TR301", "train.py:30"),
        ("TR301", "train.py:9"),
        ("TR303", "train.py:30"),
        ("TR303", "train.py:9"),
    ]
    assert not any("covers" in f.message for f in found)


def test_a_draw_two_loaders_reach_is_one_finding_at_the_drawing_line() -> None:
    probe = {**_draws("random"), "sites": {"random": "data.py:20"}}
    loaders = [_loader(probe=probe), _loader(probe=probe, location="train.py:12")]
    (finding,) = audit_settings(_settings(dataloaders=loaders, seeded={**_SEEDED, "random": False}))
    assert (finding.code, finding.location) == ("TR304", "data.py:20")
    assert finding.message.endswith("covers the 2 DataLoaders created at train.py:9, train.py:12.")


def test_compile_calls_at_one_line_are_one_finding_counting_them() -> None:
    calls = [{"backend": "inductor", "location": "train.py:5"}] * 3 + [{"location": "train.py:8"}]
    found = audit_settings(_settings(compile_calls=calls, deterministic_algorithms=False))
    assert [(f.code, f.location) for f in found] == [("TR401", "train.py:5"), ("TR401", "train.py:8")]
    assert "(3 calls at this line)" in found[0].message and "calls at this line" not in found[1].message


def test_a_seed_every_process_draws_at_one_line_is_one_finding() -> None:
    call = {"call": "random.seed", "rng": "random", "location": "train.py:3", "source": "the current time"}
    (finding,) = audit_settings(_settings(tainted_seeds=[call, call]))  # e.g. from two spawned ranks
    assert (finding.code, finding.location) == ("TR305", "train.py:3")
    # two seeding calls on one line: one finding that says both
    numpy = {**call, "call": "np.random.seed", "rng": "numpy"}
    (both,) = audit_settings(_settings(tainted_seeds=[call, numpy]))
    assert "random.seed seeds Python's global random" in both.message
    assert "Also here: np.random.seed seeds NumPy's global RNG" in both.message


def test_accumulation_under_stock_ddp_or_fsdp2_is_a_warning_naming_the_invariant_wrapper() -> None:
    statements = [
        {"text": "ddp.no_sync()", "call": "no_sync", "wrapper": "DDP", "location": "train.py:5"},
        {
            "text": "net.set_requires_gradient_sync(last)",
            "call": "set_requires_gradient_sync",
            "wrapper": "FSDP2",
            "location": "train.py:7",
        },
    ]
    findings = [f for f in audit_settings(_settings(accumulation_statements=statements)) if f.code == "TR502"]
    expected = [("warning", "train.py:5"), ("warning", "train.py:7")]
    assert [(f.severity, f.location) for f in findings] == expected
    assert "stock DDP" in findings[0].message and "world size" in findings[0].message
    assert "InvariantDataParallel" in findings[0].fix and "instead of DDP" in findings[0].fix
    assert "after fully_shard" in findings[1].fix
    assert not [f for f in audit_settings(_settings()) if f.code == "TR502"]  # nothing without them
