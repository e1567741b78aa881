"""The public checkpoint functions end to end: every kind of object round-trips exactly, and a
resume mid-epoch (on CPU, on CUDA, on every rank under torchrun) continues with the bits of a run
without a break.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import make_model, trained, warm_up_optimizer
from torch import nn

import torchrepro
from torchrepro import CheckpointError, fingerprint, load_checkpoint
from torchrepro import save_checkpoint as save

pytestmark = pytest.mark.usefixtures("rng_changes_ok")  # building modules draws from the torch RNG

warm_up_optimizer()


def fresh() -> tuple[nn.Module, torch.optim.Optimizer, Any, torch.amp.GradScaler]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return (
        model,
        opt,
        torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        torch.amp.GradScaler("cpu"),
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
