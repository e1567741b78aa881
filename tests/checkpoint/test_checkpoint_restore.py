"""Restoring (checkpoint.restore): the RNG comes back last and exactly, gradients come back with
their module, and a restore that cannot reproduce the saved state is a CheckpointError naming the
file and the object, raised before anything is copied wherever a check can tell.

Every refusal is paired with the good case, and, where it shows something, with a control that
plain torch does what the issue describes (so the test cannot pass vacuously).
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from checkpoint_helpers import Lossy, make_model, net, trained, warm_up_optimizer
from torch import nn

from torchrepro import CheckpointError, fingerprint, load_checkpoint
from torchrepro import save_checkpoint as save
from torchrepro.checkpoint.format import _digest

pytestmark = pytest.mark.usefixtures("rng_changes_ok")  # building modules draws from the torch RNG

warm_up_optimizer()


def draws(*gens: Any) -> list[Any]:
    out = [random.random(), float(np.random.rand()), torch.rand(3)]
    for g in gens:
        out.append(torch.rand(2, generator=g) if isinstance(g, torch.Generator) else float(g.random()))
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True)
    )


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


def test_partial_restore_is_caught_by_the_digest(tmp_path: Path) -> None:
    path = save(tmp_path / "c.pt", thing=Lossy())
    with pytest.raises(CheckpointError, match=r"Restoring 'thing' .*did not reproduce"):
        load_checkpoint(path, thing=Lossy(), restore_rng=False)


def test_other_world_size_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    save(path, x=1)
    payload = torch.load(path, weights_only=True)
    payload["meta"]["world_size"] = 2
    torch.save(payload, path)
    with pytest.raises(CheckpointError, match=r"world size 2; this run has world size 1.*--nproc-per-node 2"):
        load_checkpoint(path)


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


# --------------------------------------------------------------------------- validate before copying


def with_extra_layer() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2), nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (lambda: net(out=3), r"Cannot restore 'model' \(Sequential\) from .*size mismatch for 2.weight"),
        (with_extra_layer, r"Cannot restore 'model' .*Missing key\(s\) in the checkpoint: '3.weight'"),
        (lambda: net(dtype=torch.float16), r"Restoring 'model' from .*did not reproduce the saved state"),
    ],
    ids=["shape", "keys", "dtype"],
)
def test_a_refused_module_load_leaves_the_module_unchanged(tmp_path: Path, target: Any, message: str) -> None:
    saved = net()
    path = save(tmp_path / "c.pt", model=saved)
    control = target()
    before = fingerprint(control)
    with contextlib.suppress(RuntimeError):  # shapes, keys: raises after copying the rest
        control.load_state_dict(saved.state_dict())  # dtypes: converts
    assert fingerprint(control) != before  # control: plain torch changes the module
    model = target()
    before = fingerprint(model)
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(path, model=model)
    assert "Nothing was changed" in str(info.value)
    assert fingerprint(model) == before
    good = net()
    load_checkpoint(path, model=good)  # the good case
    assert fingerprint(good) == fingerprint(saved)


def test_verify_false_still_converts_dtypes(tmp_path: Path) -> None:
    """The dtype check belongs to ``verify``: without it a float32 state loads into float16."""
    saved = net()
    path = save(tmp_path / "c.pt", model=saved)
    half = net(dtype=torch.float16)
    load_checkpoint(path, model=half, verify=False, restore_rng=False)
    assert torch.equal(half[0].weight, saved[0].weight.half())


def test_a_later_object_refused_leaves_the_earlier_ones_unchanged(tmp_path: Path) -> None:
    saved = net()
    opt = torch.optim.SGD(saved.parameters(), lr=0.1, momentum=0.9)
    saved(torch.ones(1, 4)).sum().backward()
    opt.step()
    path = save(tmp_path / "c.pt", model=saved, optimizer=opt, gen=torch.Generator().manual_seed(1))

    model = net()
    before = fingerprint(model)
    only_last = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)  # other groups
    with pytest.raises(
        CheckpointError, match=r"'optimizer' \(SGD\) .*parameter groups of \[4\] .*, the optimizer \[2\]"
    ):
        load_checkpoint(path, model=model, optimizer=only_last, gen=torch.Generator().manual_seed(1))
    assert fingerprint(model) == before
    with pytest.raises(CheckpointError, match=r"RNG state .*captured as a torch generator but a numpy"):
        load_checkpoint(path, model=model, gen=np.random.default_rng(0))
    assert fingerprint(model) == before

    good = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # the good case
    load_checkpoint(path, model=model, optimizer=good, gen=torch.Generator())
    assert fingerprint(model) == fingerprint(saved)
    assert fingerprint(good.state_dict()) == fingerprint(opt.state_dict())
