"""What the recorder sees of training: parameter names, graph leaves, steps counted by backward()."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchrepro._child.training import BackwardSteps, ParamNames, _graph_leaves, optimizer_items
from torchrepro.recorder import Recorder, _digest
from torchrepro.runrecord import read_events

pytestmark = pytest.mark.usefixtures("rng_changes_ok")  # models are built from the global RNG


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(3, 3)
        self.ff = nn.Linear(3, 3)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block.ff(block.attn(x))
        return self.head(x)


class Wrapper(nn.Module):
    """Like DDP: holds the model as ``.module`` (its parameter names would start with ``module.``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


class Holder:
    """Like a framework trainer: holds the model as ``.model``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model


def _names_from_here(params: list[torch.Tensor]) -> list[str]:
    import sys

    return ParamNames().names(params, sys._getframe(1))


def test_parameters_are_named_by_their_path_in_the_root_model() -> None:
    net = Net()
    block = net.layers[1]  # a submodule in scope too: the root's paths win
    params = [block.ff.weight, net.head.bias, net.layers[0].attn.weight]
    assert _names_from_here(params) == ["layers.1.ff.weight", "head.bias", "layers.0.attn.weight"]
    del block


def test_wrappers_and_holders_are_seen_through() -> None:
    def names_in(scope_obj: Any, params: list[torch.Tensor]) -> list[str]:
        return _names_from_here(params)

    net = Net()
    wrapped = Wrapper(net)
    assert names_in(wrapped, [net.head.weight]) == ["head.weight"]
    holder = Holder(net)
    assert names_in(holder, [net.layers[0].ff.bias]) == ["layers.0.ff.bias"]
    del wrapped, holder, net


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))


def test_two_models_with_the_same_paths_are_told_apart_by_their_variable() -> None:
    """A GAN: netG and netD both have main.0.weight; each name says which model it is."""
    netG, netD = Generator(), Discriminator()  # the names DCGAN scripts use
    params = [netD.main[0].weight, netG.main[0].weight, netG.main[2].bias]
    assert _names_from_here(params) == ["netD.main.0.weight", "netG.main.0.weight", "netG.main.2.bias"]
    # control: one model alone (or two without a path in common) keeps its bare paths
    assert _names_from_here([netG.main[0].weight]) != ["main.0.weight"]  # netD is still in scope
    del netD
    assert _names_from_here([netG.main[0].weight]) == ["main.0.weight"]
    net = Net()
    assert _names_from_here([net.head.bias, netG.main[0].bias]) == ["head.bias", "main.0.bias"]
    del net, netG


def test_a_parameter_no_module_holds_is_numbered() -> None:
    stray = nn.Parameter(torch.zeros(2))
    assert ParamNames().names([stray], None) == ["#0"]


def test_optimizer_items_are_gradients_then_state_then_parameters() -> None:
    net = nn.Linear(2, 1)
    opt = torch.optim.Adam(net.parameters())
    net(torch.ones(1, 2)).sum().backward()
    opt.step()
    names = [name for name, _ in optimizer_items(opt, ["weight", "bias"])]
    assert names == [
        "grad:weight",
        "grad:bias",
        "state:weight:exp_avg",
        "state:weight:exp_avg_sq",
        "state:weight:step",
        "state:bias:exp_avg",
        "state:bias:exp_avg_sq",
        "state:bias:step",
        "param:weight",
        "param:bias",
    ]


def test_graph_leaves_are_the_tensors_gradients_accumulate_into() -> None:
    net = Net()
    frozen = nn.Linear(3, 3).requires_grad_(False)
    x = torch.randn(2, 3, requires_grad=True)
    loss = net(frozen(x)).sum()
    leaves = _graph_leaves([loss])
    expected = {id(p) for p in net.parameters()} | {id(x)}
    assert {id(t) for t in leaves} == expected and len(leaves) == len(expected)


def _watch(
    recorder: Recorder | None, monkeypatch: pytest.MonkeyPatch, owned: Any = lambda p: False
) -> BackwardSteps:
    monkeypatch.setattr(torch.autograd, "backward", torch.autograd.backward)  # restored after the test
    steps = BackwardSteps(recorder, ParamNames(), owned)
    steps.install()
    return steps


def test_a_hand_written_update_is_recorded_per_backward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder(tmp_path / "events.jsonl")
    steps = _watch(recorder, monkeypatch)
    model = nn.Linear(2, 1)
    for _ in range(2):
        model(torch.ones(4, 2)).pow(2).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    steps.flush()  # at exit: the last update
    recorder.close()
    events = read_events(tmp_path / "events.jsonl")
    shape = [(e["kind"], e["key"], e["step"], [t["n"] for t in e["t"]]) for e in events]
    params, grads = ["param:weight", "param:bias"], ["grad:weight", "grad:bias"]
    assert shape == [
        ("init", "backward", 0, params),
        ("compute", "backward", 0, grads),
        ("compute", "backward", 0, params),  # the weights after step 0's update
        ("compute", "backward", 1, grads),
        ("compute", "backward", 1, params),
    ]
    assert events[2]["fp"] != events[0]["fp"] and events[4]["fp"] != events[2]["fp"]
    assert steps.steps == 2


# torch 2.4's own reentrant checkpoint calls its deprecated torch.cpu.amp.autocast (the floor tier)
@pytest.mark.filterwarnings(r"ignore:`torch\.cpu\.amp\.autocast\(args\.\.\.\)` is deprecated:FutureWarning")
def test_reentrant_checkpointing_is_one_step_and_owned_leaves_are_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = Net()
    owned_ids = {id(net.head.weight), id(net.head.bias)}
    steps = _watch(None, monkeypatch, owned=lambda p: id(p) in owned_ids)
    x = torch.randn(2, 3, requires_grad=True)
    out = checkpoint(lambda t: net.layers[0].ff(net.layers[0].attn(t)), x, use_reentrant=True)
    net.head(out).sum().backward()  # the inner backward of the checkpoint is not a step
    assert steps.steps == 1
    owned_ids |= {id(p) for p in net.parameters()}
    net(torch.randn(2, 3)).sum().backward()  # every leaf held by an optimizer: the optimizer's steps count
    assert steps.steps == 1
    thread = threading.Thread(target=lambda: nn.Linear(2, 1)(torch.ones(1, 2)).sum().backward())
    thread.start()
    thread.join()
    assert steps.steps == 1  # another thread's backward is not the script's step


def test_batch_leaves_are_named_by_their_path() -> None:
    batch = {"input_ids": torch.zeros(2, dtype=torch.long), "pair": (torch.ones(1), [torch.ones(2)])}
    _, entries = _digest(batch, 0)
    assert [e["n"] for e in entries] == ['["input_ids"]', '["pair"][0]', '["pair"][1][0]']
    _, entries = _digest(
        [("grad:w", torch.ones(1)), ("state:w:exp_avg", {"a": torch.ones(1)})], 0, named=True
    )
    assert [e["n"] for e in entries] == ["grad:w", 'state:w:exp_avg["a"]']
