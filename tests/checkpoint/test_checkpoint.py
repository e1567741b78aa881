"""Checkpoints: every kind of object round-trips exactly, the RNG comes back last, and every way a
file or a restore can go wrong is a CheckpointError that names the file and the object."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import torchrepro
from torchrepro import CheckpointError, ReproWarning, fingerprint, latest_checkpoint, load_checkpoint
from torchrepro import save_checkpoint as save
from torchrepro._io import TMP_SUFFIX
from torchrepro.checkpoint.format import _digest

pytestmark = pytest.mark.usefixtures("rng_changes_ok")  # building modules draws from the torch RNG


def _warm_up_optimizer() -> None:
    """torch's first ``optimizer.step()`` imports dynamo, which writes TORCHINDUCTOR_CACHE_DIR into
    os.environ once per process; take that step at import, before the per-test environment guard."""
    p = torch.zeros(1, requires_grad=True)
    p.sum().backward()
    torch.optim.SGD([p], lr=0.1).step()


_warm_up_optimizer()


def make_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 2))


def trained() -> tuple[nn.Module, torch.optim.Optimizer, Any, torch.amp.GradScaler]:
    """A model, SGD-momentum optimizer, scheduler and scaler that all carry non-default state."""
    g = torch.Generator().manual_seed(0)
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 1, 4, 4, generator=g)).sum().backward()
        opt.step()
        sched.step()
    scaler.scale(torch.ones(1))  # starts the scale tensor
    scaler.update(new_scale=77.0)
    return model, opt, sched, scaler


def fresh() -> tuple[nn.Module, torch.optim.Optimizer, Any, torch.amp.GradScaler]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return (
        model,
        opt,
        torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        torch.amp.GradScaler("cpu"),
    )


def draws(*gens: Any) -> list[Any]:
    out = [random.random(), float(np.random.rand()), torch.rand(3)]
    for g in gens:
        out.append(torch.rand(2, generator=g) if isinstance(g, torch.Generator) else float(g.random()))
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True)
    )


def test_every_kind_round_trips_exactly_and_loads_weights_only(tmp_path: Path) -> None:
    model, opt, sched, scaler = trained()
    tensor = torch.arange(5.0)
    path = save(
        tmp_path / "c.pt", model=model, optimizer=opt, scheduler=sched, scaler=scaler,
        step=7, lr=0.5, name="run", done=False, nothing=None, tensor=tensor,
        config={"widths": [3, 12], "tag": "x", "nested": {"t": torch.ones(2)}},
    )  # fmt: skip
    assert path == str(tmp_path / "c.pt")
    raw = torch.load(path, weights_only=True)  # no pickled objects anywhere
    assert raw["meta"]["names"][:4] == ["model", "optimizer", "scheduler", "scaler"]

    model2, opt2, sched2, scaler2 = fresh()
    values = load_checkpoint(path, model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2)
    assert fingerprint(model2) == fingerprint(model)
    assert fingerprint(opt2.state_dict()) == fingerprint(opt.state_dict())
    assert sched2.state_dict() == sched.state_dict() and sched2.get_last_lr() == sched.get_last_lr()
    assert scaler2.get_scale() == 77.0
    assert set(values) == {"step", "lr", "name", "done", "nothing", "tensor", "config"}
    assert (values["step"], values["lr"], values["name"], values["done"], values["nothing"]) == (
        7,
        0.5,
        "run",
        False,
        None,
    )
    assert torch.equal(values["tensor"], tensor) and torch.equal(
        values["config"]["nested"]["t"], torch.ones(2)
    )
    # the resumed optimizer continues exactly like the original one
    x = torch.randn(4, 1, 4, 4)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    assert fingerprint(model2) == fingerprint(model)


def test_rng_is_restored_last_and_exactly(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    npgen = np.random.default_rng(4)
    path = save(tmp_path / "c.pt", model=nn.Linear(2, 2), gen=gen, npgen=npgen)
    expected = draws(gen, npgen)
    model = nn.Linear(2, 2)  # building it draws from the torch RNG: the restore must come after
    load_checkpoint(path, model=model, gen=gen, npgen=npgen)
    assert same(draws(gen, npgen), expected)
    # negative control: without the RNG restore, the next draws are different
    load_checkpoint(path, model=model, restore_rng=False)
    assert not same(draws(), expected[:3])


def test_load_errors_name_what_is_wrong(tmp_path: Path) -> None:
    model, opt, _, _ = trained()
    path = save(tmp_path / "c.pt", model=model, optimizer=opt, step=1)
    with pytest.raises(CheckpointError, match=r"no object 'modle'; it holds: model, optimizer, step"):
        load_checkpoint(path, modle=model)
    with pytest.raises(CheckpointError, match=r"holds a module .* under 'model', but an optimizer"):
        load_checkpoint(path, model=opt)
    with pytest.raises(TypeError, match=r"'step' is a plain value: load_checkpoint returns"):
        load_checkpoint(path, step=3)
    with pytest.raises(CheckpointError, match=r"Cannot restore 'model' \(Sequential\) from .*size mismatch"):
        load_checkpoint(path, model=nn.Sequential(nn.Conv2d(1, 4, 3)))
    with pytest.raises(CheckpointError, match=r"Cannot restore 'model' .*Unexpected key"):
        load_checkpoint(
            path, model=nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten())
        )
    with pytest.raises(CheckpointError, match=r"No checkpoint file at .*missing\.pt"):
        load_checkpoint(tmp_path / "missing.pt", model=model)


def test_dtype_narrowing_is_caught_by_the_digest(tmp_path: Path) -> None:
    model = nn.Linear(3, 3)
    with torch.no_grad():
        model.weight.add_(1e-4)  # values float16 cannot hold exactly
    path = save(tmp_path / "c.pt", model=model)
    with pytest.raises(CheckpointError, match=r"Restoring 'model' from .*did not reproduce the saved state"):
        load_checkpoint(path, model=nn.Linear(3, 3).half(), restore_rng=False)
    load_checkpoint(path, model=nn.Linear(3, 3), restore_rng=False)  # same dtype: fine


class Lossy:
    """A stateful object whose load_state_dict silently drops a key (a partial load)."""

    def __init__(self) -> None:
        self.state = {"a": 1, "b": 2}

    def state_dict(self) -> dict[str, int]:
        return dict(self.state)

    def load_state_dict(self, d: dict[str, int]) -> None:
        self.state = {"a": d["a"], "b": 0}


def test_partial_restore_is_caught_by_the_digest(tmp_path: Path) -> None:
    path = save(tmp_path / "c.pt", thing=Lossy())
    with pytest.raises(CheckpointError, match=r"Restoring 'thing' .*did not reproduce"):
        load_checkpoint(path, thing=Lossy(), restore_rng=False)


class Unsafe:
    def state_dict(self) -> dict[str, Any]:
        return {"ok": 1, "nested": {"fn": [1, print]}}

    def load_state_dict(self, d: dict[str, Any]) -> None:  # pragma: no cover - never loaded
        pass


def test_save_refuses_what_weights_only_cannot_load(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"'thing': its state at \['nested'\]\['fn'\]\[1\] is an arbitrary"
    ):
        save(tmp_path / "c.pt", thing=Unsafe())
    with pytest.raises(TypeError, match=r"Cannot checkpoint 'obj' of type builtins.object"):
        save(tmp_path / "c.pt", obj=object())
    with pytest.raises(TypeError, match=r"plain torch DataLoader .* torchrepro.SeededLoader"):
        save(tmp_path / "c.pt", loader=torch.utils.data.DataLoader(list(range(4))))
    with pytest.raises(ValueError, match="at least one object"):
        save(tmp_path / "c.pt")
    with pytest.raises(ValueError, match="temporary or per-rank"):
        save(tmp_path / "c.pt.rank1", x=1)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temp file


def _flip_tensor_byte(path: Path) -> None:
    """Flip one bit inside the largest tensor record (the zip stays structurally valid)."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    offset = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.file_size // 2
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _damage(kind: str, path: Path) -> None:
    data = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "garbage":
        path.write_bytes(os.urandom(300))
    elif kind == "flipped-bit":
        _flip_tensor_byte(path)
    elif kind == "plain-torch-save":
        torch.save({"model": torch.ones(3)}, path)
    elif kind == "pickled-object":
        torch.save({"fn": Lossy()}, path)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("truncated", "truncated"),
        ("empty", "empty"),
        ("garbage", "not a torch zip file"),
        ("flipped-bit", "did not reproduce the saved state"),
        ("plain-torch-save", "not a torchrepro checkpoint"),
        ("pickled-object", "pickled Python objects"),
    ],
)
def test_damaged_files_are_checkpoint_errors_naming_the_file(tmp_path: Path, kind: str, message: str) -> None:
    path = tmp_path / "c.pt"
    save(path, model=nn.Linear(64, 64))  # its weight is the largest tensor in the file
    _damage(kind, path)
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(path, model=nn.Linear(64, 64), restore_rng=False)
    assert str(path) in str(info.value)
    error = info.value  # never a raw unpickling traceback underneath
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def test_flipped_bit_in_a_plain_value_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    save(path, table=torch.arange(10000.0))
    _flip_tensor_byte(path)
    with pytest.raises(CheckpointError, match=r"stored state of 'table' does not match its checksum"):
        load_checkpoint(path, restore_rng=False)


def test_other_environment_warns_with_the_differences(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    save(path, x=1)
    payload = torch.load(path, weights_only=True)
    payload["env"]["torch"] = "1.13.1"
    payload["env"]["determinism"]["cudnn.benchmark"] = True
    torch.save(payload, path)
    with pytest.warns(
        ReproWarning, match=r"torch: saved '1.13.1', now .*determinism.cudnn.benchmark: saved True"
    ):
        assert load_checkpoint(path, restore_rng=False) == {"x": 1}


def test_other_world_size_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    save(path, x=1)
    payload = torch.load(path, weights_only=True)
    payload["meta"]["world_size"] = 2
    torch.save(payload, path)
    with pytest.raises(CheckpointError, match=r"world size 2; this run has world size 1.*--nproc-per-node 2"):
        load_checkpoint(path)


def test_newer_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    save(path, x=1)
    payload = torch.load(path, weights_only=True)
    payload["torchrepro_checkpoint"] = 99
    torch.save(payload, path)
    with pytest.raises(CheckpointError, match="format version 99"):
        load_checkpoint(path)


def test_failed_write_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.pt"
    save(path, step=1)

    def crash(obj: Any, f: Any) -> None:
        f.write(b"PK\x03\x04 partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save(path, step=2)
    monkeypatch.undo()
    assert load_checkpoint(path, restore_rng=False) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_latest_uses_the_save_clock_not_mtime(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    for step in (1, 2, 3):
        save(tmp_path / f"zz-{4 - step}.pt", step=step)  # names sort opposite to save order
    os.utime(tmp_path / "zz-3.pt", (2e9, 2e9))  # the oldest save gets the newest mtime
    (tmp_path / "notes.txt").write_text("not a checkpoint")  # ignored silently
    (tmp_path / f".zz-0.pt.abc{TMP_SUFFIX}").write_bytes(b"PK\x03\x04 write in progress")  # ignored
    assert latest_checkpoint(tmp_path) == str(tmp_path / "zz-1.pt")


@pytest.mark.parametrize("kind", ["truncated", "flipped-bit", "garbage"])
def test_latest_skips_damaged_files_with_a_warning(tmp_path: Path, kind: str) -> None:
    save(tmp_path / "step-1.pt", model=nn.Linear(64, 64), step=1)
    save(tmp_path / "step-2.pt", model=nn.Linear(64, 64), step=2)
    _damage(kind, tmp_path / "step-2.pt")
    with pytest.warns(ReproWarning, match=r"Skipping checkpoint: .*step-2\.pt"):
        assert latest_checkpoint(tmp_path) == str(tmp_path / "step-1.pt")


def test_latest_skips_incomplete_rank_sets(tmp_path: Path) -> None:
    save(tmp_path / "step-1.pt", step=1)
    path = tmp_path / "step-2.pt"
    save(path, step=2)
    payload = torch.load(path, weights_only=True)
    payload["meta"]["world_size"] = 2  # rank 1's file never got written
    torch.save(payload, path)
    with pytest.warns(
        ReproWarning, match=r"step-2\.pt is incomplete: rank 1's file step-2\.pt\.rank1 is missing"
    ):
        assert latest_checkpoint(tmp_path) == str(tmp_path / "step-1.pt")


def test_latest_on_a_missing_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        latest_checkpoint(tmp_path / "nope")


def test_resume_mid_epoch_with_seeded_loader(tmp_path: Path) -> None:
    """Training through a save + load in a fresh model/loader gives the same bits as no break."""

    def run(stop: int | None, resume: bool) -> str:
        torchrepro.seed_everything(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        data = torch.utils.data.TensorDataset(torch.linspace(-1, 1, 40).reshape(10, 4))
        loader = torchrepro.SeededLoader(data, batch_size=2, seed=5)
        step = 0
        if resume:
            step = load_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, loader=loader)["step"]
        for (x,) in loader:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            step += 1
            if step == stop:
                save(tmp_path / "c.pt", model=model, optimizer=opt, loader=loader, step=step)
                return ""
        return fingerprint(model)

    straight = run(None, False)
    run(2, False)
    assert run(None, True) == straight
    # negative control: resuming without the RNG and loader position differs
    run(2, False)
    torchrepro.seed_everything(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    load_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, restore_rng=False)
    loader = torchrepro.SeededLoader(
        torch.utils.data.TensorDataset(torch.linspace(-1, 1, 40).reshape(10, 4)), batch_size=2, seed=5
    )
    for (x,) in loader:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    assert fingerprint(model) != straight


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_and_rng_round_trip(tmp_path: Path) -> None:
    model = nn.Linear(8, 8).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8, device="cuda")).sum().backward()
    opt.step()
    path = save(tmp_path / "c.pt", model=model, optimizer=opt)
    expected = torch.rand(4, device="cuda")
    model2 = nn.Linear(8, 8).cuda()
    opt2 = torch.optim.Adam(model2.parameters())
    load_checkpoint(path, model=model2, optimizer=opt2)
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    assert fingerprint(model2) == fingerprint(model)
    assert fingerprint(opt2.state_dict()) == fingerprint(opt.state_dict())
    # a CPU checkpoint restores into a CUDA model, and verifies (the checksum ignores the device)
    cpu_path = save(tmp_path / "cpu.pt", model=nn.Linear(8, 8))
    load_checkpoint(cpu_path, model=nn.Linear(8, 8).cuda(), restore_rng=False)


DIST_SCRIPT = """
import json, sys
import torch, torch.distributed as dist
import torchrepro

dist.init_process_group("gloo")
rank, ckpt = dist.get_rank(), sys.argv[1]
torch.manual_seed(torchrepro.derive_seed(7, "rank", rank))  # every rank has its own stream
model = torch.nn.Linear(2, 2)
written = torchrepro.save_checkpoint(f"{ckpt}/step-1.pt", model=model, step=1)
expected = torch.rand(3).tolist()
dist.barrier()  # every rank's file is written
torch.manual_seed(999)
latest = torchrepro.latest_checkpoint(ckpt)
values = torchrepro.load_checkpoint(latest, model=model)
got = torch.rand(3).tolist()
result = {"written": written, "latest": latest, "values": values, "expected": expected, "got": got}
with open(f"{ckpt}/result{rank}.json", "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_each_rank_saves_and_restores_its_own_rng_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "dist_ckpt.py"
    script.write_text(DIST_SCRIPT)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run([*cmd, str(script), str(ckpt)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r0, r1 = (json.loads((ckpt / f"result{r}.json").read_text()) for r in (0, 1))
    assert r0["written"] == r0["latest"] == r1["latest"] == str(ckpt / "step-1.pt")
    assert r1["written"] == str(ckpt / "step-1.pt.rank1")
    assert r0["values"] == r1["values"] == {"step": 1}
    assert r0["got"] == r0["expected"] and r1["got"] == r1["expected"]
    assert r0["expected"] != r1["expected"]  # control: one shared RNG state could not serve both
    with pytest.raises(CheckpointError, match=r"world size 2; this run has world size 1"):
        load_checkpoint(ckpt / "step-1.pt", model=nn.Linear(2, 2))


# -- gradients: a save inside an accumulation window ---------------------------------------------


def test_gradients_are_saved_and_restored_none_stays_none(tmp_path: Path) -> None:
    model = make_model()
    model(torch.randn(2, 1, 4, 4)).sum().backward()  # the first micro-batch of a window
    first_linear = model[4].weight  # type: ignore[index]
    first_linear.grad = None  # a parameter without a gradient must come back without one
    save(tmp_path / "mid.pt", model=model)
    expected = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}

    other = make_model()
    other(torch.randn(2, 1, 4, 4)).sum().backward()  # stale gradients everywhere, to be replaced
    kept = other[0].weight.grad  # type: ignore[index]
    load_checkpoint(tmp_path / "mid.pt", model=other)
    for name, p in other.named_parameters():
        want = expected[name]
        assert (p.grad is None) if want is None else torch.equal(p.grad, want), name  # type: ignore[arg-type]
    assert other[0].weight.grad is kept  # copied into the existing tensor (DDP bucket views stay)  # type: ignore[index]
    with torch.no_grad():
        assert torch.load(tmp_path / "mid.pt", weights_only=True)["objects"]["model"]["grads"]


def test_accumulation_window_resumes_exactly_only_with_gradients(tmp_path: Path) -> None:
    """Save between the two backward() calls of an accumulation window, resume, finish the step."""
    data = torch.randn(4, 2, 1, 4, 4, generator=torch.Generator().manual_seed(1))

    def run(stop_after: int | None, resume: Path | None, keep_grads: bool = True) -> nn.Module:
        torch.manual_seed(0)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        start = 0
        if resume is not None:
            start = load_checkpoint(resume, model=model, optimizer=opt)["micro"]
            if not keep_grads:
                opt.zero_grad()  # what a resume without saved gradients amounts to
        for micro in range(start, len(data)):
            model(data[micro]).sum().backward()
            if micro % 2 == 1:
                opt.step()
                opt.zero_grad()
            if micro == stop_after:
                save(tmp_path / "ckpt.pt", model=model, optimizer=opt, micro=micro + 1)
                break
        return model

    reference = run(None, None)
    run(0, None)  # saved after the first backward of the first window
    resumed = run(None, tmp_path / "ckpt.pt")
    assert all(
        torch.equal(a, b)
        for a, b in zip(reference.state_dict().values(), resumed.state_dict().values(), strict=True)
    )
    dropped = run(None, tmp_path / "ckpt.pt", keep_grads=False)  # negative control
    assert not all(
        torch.equal(a, b)
        for a, b in zip(reference.state_dict().values(), dropped.state_dict().values(), strict=True)
    )


def test_gradients_that_do_not_fit_change_nothing(tmp_path: Path) -> None:
    model = make_model()
    model(torch.randn(2, 1, 4, 4)).sum().backward()
    save(tmp_path / "g.pt", model=model)
    payload = torch.load(tmp_path / "g.pt", weights_only=True)
    payload["objects"]["model"]["grads"]["4.weight"] = torch.zeros(3, 3)
    payload["objects"]["model"]["grads_digest"] = _digest(payload["objects"]["model"]["grads"], "model")
    torch.save(payload, tmp_path / "bad.pt")
    target = make_model()
    before = fingerprint(target)
    with pytest.raises(
        CheckpointError, match=r"gradient of '4.weight' has shape \(3, 3\).*Nothing was changed"
    ):
        load_checkpoint(tmp_path / "bad.pt", model=target)
    assert fingerprint(target) == before and all(p.grad is None for p in target.parameters())
    payload["objects"]["model"]["grads"]["4.weight"] = torch.ones(2, 12)  # right shape, wrong checksum
    torch.save(payload, tmp_path / "corrupt.pt")
    with pytest.raises(CheckpointError, match=r"stored gradients of 'model' do not match"):
        load_checkpoint(tmp_path / "corrupt.pt", model=target)


# -- a load racing saves of the same path ----------------------------------------------------------


def _keep_saving(path: str, stop: Any) -> None:
    model = nn.Linear(64, 64)
    tag = 0
    while not stop.is_set():
        tag += 1
        with torch.no_grad():
            model.weight.fill_(float(tag))
            model.bias.fill_(float(tag))
        save(path, model=model, tag=tag)


@pytest.mark.parametrize("verify", [False, True])
def test_a_load_racing_saves_reads_one_file(tmp_path: Path, verify: bool) -> None:
    import multiprocessing
    import time

    path = str(tmp_path / "last.pt")
    save(path, model=nn.Linear(64, 64), tag=0)
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    writer = ctx.Process(target=_keep_saving, args=(path, stop))
    writer.start()
    mixed, loads = [], 0
    try:
        deadline = time.monotonic() + 3.0
        model = nn.Linear(64, 64)
        while time.monotonic() < deadline:
            tag = load_checkpoint(path, model=model, verify=verify, restore_rng=False)["tag"]
            loads += 1
            if tag and not (bool((model.weight == tag).all()) and bool((model.bias == tag).all())):
                mixed.append(tag)
    finally:
        stop.set()
        writer.join(timeout=30)
    assert loads > 20 and mixed == [], f"{len(mixed)} of {loads} loads mixed two saves"
