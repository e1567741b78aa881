"""Op tracing in-process: attribution (module, line, backward) and trace comparison."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from torchrepro.errors import TraceError
from torchrepro.trace import OpEvent, OpRecorder

HERE = Path(__file__)


def _line(marker: str) -> str:
    """``tests/test_trace.py:N`` of the line ending with ``# marker`` (as the recorder shows it)."""
    for number, text in enumerate(HERE.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# {marker}"):
            return f"{os.path.relpath(HERE, os.getcwd())}:{number}"
    raise AssertionError(f"no line marked {marker!r}")


class Doubler(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.mul(2)  # custom-backward


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.conv(x))  # block-call


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = Block()
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer1(x)
        h = self.pool(h)  # pool-call
        h = Doubler.apply(h)  # custom-call
        return self.fc(h.flatten(1)) * 3  # root-mul


def _one_step(net: nn.Module) -> None:
    x = torch.ones(4, 1, 6, 6)
    loss = net(x).square().mean()
    loss.backward()  # backward-call


def _events(rng: None = None) -> list[OpEvent]:
    torch.manual_seed(0)
    net = Net()
    with OpRecorder() as recorder:
        _one_step(net)
    return recorder.events


def _find(events: list[OpEvent], op: str, *, backward: bool) -> OpEvent:
    found = [e for e in events if e.op == op and e.backward == backward]
    assert len(found) == 1, (op, backward, found)
    return found[0]


def test_forward_ops_get_module_path_and_user_line(rng_changes_ok: None) -> None:
    events = _events()
    conv = _find(events, "aten.convolution.default", backward=False)
    assert (conv.module, conv.location) == ("layer1.conv", _line("block-call"))
    bernoulli = _find(events, "aten.bernoulli_.float", backward=False)
    assert (bernoulli.module, bernoulli.location) == ("layer1.drop", _line("block-call"))
    pool = _find(events, "aten._adaptive_avg_pool2d.default", backward=False)
    assert (pool.module, pool.location) == ("pool", _line("pool-call"))
    root_mul = [e for e in events if e.op == "aten.mul.Tensor" and e.location == _line("root-mul")]
    assert [(e.module, e.backward) for e in root_mul] == [("Net", False), ("Net", True)]


def test_backward_ops_are_attributed_to_the_forward_that_created_them(rng_changes_ok: None) -> None:
    events = _events()
    conv_bw = _find(events, "aten.convolution_backward.default", backward=True)
    assert (conv_bw.module, conv_bw.location) == ("layer1.conv", _line("block-call"))
    pool_bw = _find(events, "aten._adaptive_avg_pool2d_backward.default", backward=True)
    assert (pool_bw.module, pool_bw.location) == ("pool", _line("pool-call"))
    # The custom Function's backward is user code: its own line, in the module that applied it.
    custom = [e for e in events if e.backward and e.location == _line("custom-backward")]
    assert [(e.op, e.module) for e in custom] == [("aten.mul.Tensor", "Net")]
    # Nothing in backward is blamed on the line that called backward() except grad accumulation.
    blamed = {e.op for e in events if e.backward and e.location == _line("backward-call")}
    assert blamed <= {"aten.detach.default", "aten.add.Tensor", "aten.add_.Tensor"}


def test_counts_and_round_trip(rng_changes_ok: None) -> None:
    torch.manual_seed(0)
    net = Net()
    recorder = OpRecorder()
    recorder.start()
    for _ in range(3):
        _one_step(net)
    events = recorder.stop()
    assert _find(events, "aten.convolution.default", backward=False).count == 3
    assert [OpEvent.from_dict(e.to_dict()) for e in events] == events
    assert len({(e.op, e.module, e.location, e.backward) for e in events}) == len(events)


def test_hooks_and_mode_are_removed_after_stop(rng_changes_ok: None) -> None:
    from torch.nn.modules import module as nn_module
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    before = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))
    _events()
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == before
    assert _get_current_dispatch_mode() is None


def test_misuse_raises_trace_error() -> None:
    recorder = OpRecorder()
    with pytest.raises(TraceError, match="not started"):
        recorder.stop()
    recorder.start()
    try:
        with pytest.raises(TraceError, match="already started"):
            recorder.start()
    finally:
        recorder.stop()
    with pytest.raises(TraceError, match="'op'"):
        OpEvent.from_dict({"module": "x"})
    with pytest.raises(TraceError, match="count"):
        OpEvent.from_dict({"op": "aten.add.Tensor", "count": 0})
