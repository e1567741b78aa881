"""Op tracing in-process: attribution (module, line, backward) and trace comparison."""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import marked_line
from torchrepro.errors import TraceError
from torchrepro.tracing import OpEvent, OpRecorder, Tracer, compare_traces, trace

HERE = Path(__file__)


def _line(marker: str) -> str:
    """``file:line`` of the line ending with ``# marker``, as a recorder shows it (relative to cwd)."""
    return f"{os.path.relpath(HERE, os.getcwd())}:{marked_line(HERE, marker)}"


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


# ---------------------------------------------------------------------------------------------
# Tracer and compare_traces
# ---------------------------------------------------------------------------------------------


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x) * self.factor  # scaled-mul


class Scaler(torch.autograd.Function):
    noise = 0.0

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * (1.0 + Scaler.noise)  # scaler-backward


def _traced_step(path: Path, *, factor: float = 1.0, noise: float = 0.0, reseed: int | None = None) -> Path:
    """One training step of a fixed model, traced; the keyword arguments perturb one op."""
    torch.manual_seed(0)
    net = Net()
    scaled = Scaled()
    scaled.factor = factor
    opt = torch.optim.Adam([*net.parameters(), *scaled.parameters()], lr=0.1)
    x = torch.randn(4, 1, 6, 6)
    Scaler.noise = noise
    with trace(path):
        if reseed is not None:
            torch.manual_seed(reseed)
        h = Scaler.apply(net(x))
        loss = scaled(h.repeat(1, 2)[:, :3]).square().mean()
        loss.backward()
        opt.step()
    return path


def test_identical_runs_have_identical_traces(tmp_path: Path, rng_changes_ok: None) -> None:
    a, b = _traced_step(tmp_path / "a.json"), _traced_step(tmp_path / "b.json")
    assert compare_traces(a, b) is None
    doc = json.loads(a.read_text())
    assert doc["format"] == "torchrepro.trace"
    names = set(doc["ops"])
    assert {"aten.convolution_backward.default", "aten.bernoulli_.float"} <= names
    assert any(name.startswith(("aten._foreach_", "aten._fused_adam", "aten.addcdiv_")) for name in names), (
        names
    )


def test_a_perturbed_scalar_is_located_at_its_op_not_downstream(tmp_path: Path, rng_changes_ok: None) -> None:
    a = _traced_step(tmp_path / "a.json")
    b = _traced_step(tmp_path / "b.json", factor=1.0 + 2**-20)
    d = compare_traces(a, b)
    assert d is not None
    assert (d.op, d.module, d.location, d.backward) == (
        "aten.mul.Tensor",
        "Scaled",
        _line("scaled-mul"),
        False,
    )
    assert (d.inputs_equal, d.structural) == (False, False)
    assert "non-tensor arguments differ" in d.note
    assert d.to_dict()["location"] == _line("scaled-mul")


def test_a_reseeded_rng_is_located_at_the_random_op_with_equal_inputs(
    tmp_path: Path, rng_changes_ok: None
) -> None:
    a = _traced_step(tmp_path / "a.json", reseed=1)
    b = _traced_step(tmp_path / "b.json", reseed=2)
    d = compare_traces(a, b)
    assert d is not None
    assert (d.op, d.module, d.location) == ("aten.bernoulli_.float", "layer1.drop", _line("block-call"))
    assert d.inputs_equal and "random number generator" in d.note


def test_a_backward_only_perturbation_is_located_in_the_custom_backward(
    tmp_path: Path, rng_changes_ok: None
) -> None:
    a = _traced_step(tmp_path / "a.json")
    b = _traced_step(tmp_path / "b.json", noise=2**-20)
    d = compare_traces(a, b)
    assert d is not None
    assert (d.op, d.location, d.backward) == ("aten.mul.Tensor", _line("scaler-backward"), True)
    assert d.module is None  # Scaler is applied outside any module
    assert d.index > 0 and not d.structural


def test_hidden_running_stat_updates_count_as_outputs(tmp_path: Path, rng_changes_ok: None) -> None:
    """BatchNorm's normalised output does not depend on momentum; only its running stats do."""

    def run(path: Path, momentum: float) -> Path:
        bn = nn.BatchNorm1d(3, momentum=momentum)
        with trace(path):
            y = bn(torch.arange(12.0).reshape(4, 3))
        assert bn.running_mean.sum() > 0
        del y
        return path

    d = compare_traces(run(tmp_path / "a.json", 0.1), run(tmp_path / "b.json", 0.2))
    assert d is not None
    assert d.op.startswith(("aten.native_batch_norm", "aten._native_batch_norm_legit")), d
    assert d.module == "BatchNorm1d"


def test_a_branch_on_python_state_is_a_structural_divergence(tmp_path: Path) -> None:
    def run(path: Path, branch: bool) -> Path:
        x = torch.arange(4.0)
        with trace(path):
            y = x + 1
            y = y.exp() if branch else y.sin()  # branch
            del y
        return path

    d = compare_traces(run(tmp_path / "a.json", True), run(tmp_path / "b.json", False))
    assert d is not None
    assert (d.op, d.other_op, d.structural, d.index) == ("aten.exp.default", "aten.sin.default", True, 1)
    assert d.location == _line("branch")

    # A trace that stops early is structural too, at the first op the other one has in addition.
    x = torch.arange(4.0)
    with trace(tmp_path / "short.json"):
        x.add(1)
    d = compare_traces(tmp_path / "short.json", tmp_path / "a.json")
    assert d is not None and d.structural and d.index == 1


def test_uninitialised_memory_is_never_compared_as_data(tmp_path: Path) -> None:
    """Negative control: the raw contents ``torch.empty`` returns differ from run to run.

    What ``empty()`` returns is the allocator's business: glibc's malloc hands back the bytes the
    freed ``junk`` left, but an allocator that fills memory itself (``MALLOC_PERTURB_``, a
    debugging allocator) returns the same bytes every time. There the comparison cannot fail,
    and the test says so (a skip) instead of failing a control that measured the allocator.
    """
    from torchrepro.hashing import fingerprint

    raw = []

    def run(path: Path, garbage: float) -> Path:
        x = torch.arange(64.0)
        junk = torch.full((64,), garbage)  # leave different bytes behind for empty() to find
        del junk
        with trace(path):
            buf = torch.empty(64)
            raw.append(fingerprint(buf))
            scratch = buf * 0  # computed from garbage: not data either (may even be NaN)
            buf.copy_(x)  # fully overwritten: data from here on
            out = (buf * 2).sum() + scratch.shape[0]
            like = torch.empty_like(x).fill_(3.0) + out
            del like
        return path

    a, b = run(tmp_path / "a.json", 1.5), run(tmp_path / "b.json", -7.25)
    assert compare_traces(a, b) is None
    doc = json.loads(a.read_text())
    records = {doc["ops"][r[0]]: r for r in doc["records"]}
    assert [doc["values"][i] for i in records["aten.empty.memory_format"][4]] == ["uninit"]
    assert [doc["values"][i] for i in records["aten.copy_.default"][4]] != ["uninit"]
    if raw[0] == raw[1]:
        pytest.skip(
            "no negative control here: empty() returned the same bytes in both runs (this allocator "
            "fills the memory it hands out, e.g. MALLOC_PERTURB_), so equal traces prove nothing"
        )


def test_in_place_writes_through_an_alias_are_digested_again(tmp_path: Path) -> None:
    p = nn.Parameter(torch.ones(3))
    with trace(tmp_path / "t.json"):
        before = p * 1
        p.data.mul_(2)  # .data has its own version counter: the tracer must still notice
        after = p * 1
        _ = p.sum().item()  # a non-tensor output
    del before, after
    doc = json.loads((tmp_path / "t.json").read_text())
    muls = [r for r in doc["records"] if doc["ops"][r[0]] == "aten.mul.Tensor"]
    p_before, p_after = doc["values"][muls[0][3][0]], doc["values"][muls[1][3][0]]
    assert p_before != p_after
    item = next(r for r in doc["records"] if doc["ops"][r[0]] == "aten._local_scalar_dense.default")
    assert [doc["values"][i] for i in item[4]] == ["s:6.0"]


def test_a_tracer_under_an_op_recorder_does_not_show_its_own_ops(
    rng_changes_ok: None, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    with OpRecorder() as alone:
        _one_step(Net())
    torch.manual_seed(0)
    with OpRecorder() as outer, trace(tmp_path / "t.json"):
        _one_step(Net())
    seen, expected = [(e.op, e.count) for e in outer.events], [(e.op, e.count) for e in alone.events]
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13):
        # Before torch 2.13 the outer recorder sees one more backward aten.detach per parameter
        # while a tracer runs (measured on 2.4, 2.5 and 2.6, at the backward() line; not explained
        # yet). Every other op and count must still be equal.
        detach = "aten.detach.default"
        seen, expected = ([x for x in ops if x[0] != detach] for ops in (seen, expected))
    assert seen == expected


def test_bad_trace_files_raise_trace_error_naming_the_file(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    with trace(good):
        torch.ones(2).add(1)
    with pytest.raises(TraceError, match=r"missing\.json"):
        compare_traces(good, tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TraceError, match=r"bad\.json"):
        compare_traces(bad, good)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(TraceError, match="not a torchrepro op trace"):
        compare_traces(good, other)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**json.loads(good.read_text()), "records": [[99, 0, 0, [], []]]}))
    with pytest.raises(TraceError, match="malformed"):
        compare_traces(good, broken)


def test_traces_digested_with_other_algorithms_are_refused_not_compared(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        with trace(path):
            torch.ones(2).add(1)
    doc = json.loads(a.read_text())
    assert doc["digest"] == "xxh3_128"
    assert compare_traces(a, b) is None  # control: same algorithm, same values
    legacy = tmp_path / "legacy.json"  # written before the header named its algorithm (SHA-1)
    legacy.write_text(json.dumps({k: v for k, v in doc.items() if k != "digest"}))
    with pytest.raises(TraceError, match=r"different algorithms \(xxh3_128 and sha1\)"):
        compare_traces(a, legacy)
    assert compare_traces(legacy, legacy) is None  # two legacy traces still compare


def test_compiled_modules_are_recorded_without_dynamo_tracing_the_recorder(
    monkeypatch: pytest.MonkeyPatch, rng_changes_ok: None
) -> None:
    """torch.compile during a recording: no warning (filterwarnings=error), modules still named."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # importing dynamo sets it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with OpRecorder() as recorder:
        compiled = torch.compile(model, backend="eager")
        compiled(torch.ones(2, 4)).sum().backward()
    forward = {(e.op, e.module) for e in recorder.events if not e.backward}
    assert ("aten.addmm.default", "0") in forward
    assert any(e.op == "aten.relu.default" and e.module == "1" for e in recorder.events)


def test_large_digest_is_exact_and_independent_of_hash_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hashing = sys.modules["torchrepro.hashing"]  # the module holding the digests and the pool
    big = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: hashed in parallel chunks
    digest = hashing.exact_digest(big)
    assert hashing.exact_digest(big.clone()) == digest
    flipped = big.clone()
    flipped.view(torch.int32)[2_500_000] ^= 1  # one bit, in a later chunk
    assert hashing.exact_digest(flipped) != digest
    monkeypatch.setattr(hashing, "_pool", ThreadPoolExecutor(max_workers=1))
    monkeypatch.setattr(hashing, "_pool_pid", os.getpid())
    assert hashing.exact_digest(big) == digest


@pytest.mark.parametrize("shape", [(0,), (3,), (1000,), (64, 1025)], ids=str)
def test_small_digests_in_one_call_equal_streamed_digests(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...]
) -> None:
    hashing = sys.modules["torchrepro.hashing"]
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    one_call = hashing.exact_digest(t)
    monkeypatch.setattr(hashing, "_COPY_BYTES", -1)
    assert hashing.exact_digest(t) == one_call
    assert hashing.exact_digest(t.reshape(-1)) != one_call or t.dim() == 1  # the shape counts
    assert hashing.exact_digest(t.to(torch.float64)) != one_call


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_ops_of_a_forked_child_pass_through_untraced(tmp_path: Path) -> None:
    """A DataLoader worker forked while tracing inherits the mode: its ops are not recorded."""
    tracer = Tracer(tmp_path / "t.json")
    with tracer:
        torch.ones(2).add(1)
        before = len(tracer)
        pid = os.fork()
        if pid == 0:  # the child: run ops, report through the exit code only
            torch.ones(3).mul(2)
            os._exit(0 if len(tracer) == before else 1)
        _, status = os.waitpid(pid, 0)
        torch.ones(2).sub(1)  # control: the parent still traces
        assert len(tracer) > before
    assert os.WEXITSTATUS(status) == 0


_SEND_RECV = """
import sys
import torch, torch.distributed as dist
from torchrepro.tracing import trace
dist.init_process_group("gloo")
rank = dist.get_rank()
with trace(f"{sys.argv[1]}.rank{rank}"):
    if rank == 1:
        dist.send(torch.arange(4.0), dst=0)
    else:
        received = torch.empty(4)
        dist.recv(received, src=1)
        received.mul(2)
    gathered = torch.empty(4)  # all-to-all into uninitialised memory: written whole, then compared
    dist.all_to_all_single(gathered, torch.arange(4.0) + 10 * rank)
    gathered.neg()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_send_recv_and_all_to_all_are_traced_without_waiting_twice(tmp_path: Path) -> None:
    # gloo completes a send/recv work handle once per wait: a tracer waiting before the caller did
    # left both ranks blocked for ever; the received tensor is digested when the next op reads it.
    # An all-to-all's output buffer is only written: the empty buffer it fills is not read, and what
    # it received is digested (taken as uninitialised, a difference a rank received was invisible)
    import subprocess

    from helpers import user_env

    script = tmp_path / "send_recv.py"
    script.write_text(_SEND_RECV, encoding="utf-8")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*torchrun, str(script), str(tmp_path / "trace")],
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    docs = [json.loads((tmp_path / f"trace.rank{r}").read_text(encoding="utf-8")) for r in (0, 1)]

    def ops(doc: dict[str, object]) -> dict[str, tuple[list[str], list[str]]]:
        values, names = doc["values"], doc["ops"]
        return {
            names[r[0]]: ([values[i] for i in r[3]], [values[i] for i in r[4]])  # type: ignore[index]
            for r in doc["records"]  # type: ignore[attr-defined]
        }

    sent = ops(docs[1])["c10d.send.default"][0][0]
    recv_inputs, recv_outputs = ops(docs[0])["c10d.recv_.default"]
    assert recv_inputs[0] == "overwritten"  # received whole: not read from the empty buffer
    assert recv_outputs[-1] == sent == ops(docs[0])["aten.mul.Tensor"][0][0]
    from torchrepro.hashing import exact_digest

    for rank, doc in enumerate(docs):
        a2a_inputs, a2a_outputs = ops(doc)["c10d.alltoall_base_.default"]
        expected = torch.tensor([0.0, 1.0, 10.0, 11.0]) + 2 * rank  # chunk `rank` of both ranks
        assert a2a_inputs[0] == "overwritten"
        assert a2a_outputs[0] == exact_digest(expected) == ops(doc)["aten.neg.default"][0][0]
