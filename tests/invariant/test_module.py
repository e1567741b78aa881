"""InvariantDataParallel in one process (world size 1, no process group): what .grad holds, the
keyed forwards, BatchNorm's replay, and every refusal with its reason."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchrepro
from helpers import tree_sum
from torchrepro import InvariantTrainingError

V, MICRO = 6, 3

pytestmark = pytest.mark.usefixtures("rng_changes_ok")  # models are built seeded


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = 2 * V * MICRO
    return torch.utils.data.TensorDataset(torch.randn(n, 5, generator=g), torch.randn(n, 1, generator=g))


def loader(**kwargs) -> torchrepro.SeededLoader:
    return torchrepro.SeededLoader(data(), batch_size=MICRO, global_batch_size=V * MICRO, seed=0, **kwargs)


def net(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Dropout(dropout), nn.Linear(4, 1))


def test_grad_is_the_tree_mean_of_the_micro_batch_gradients_bit_for_bit() -> None:
    ld = loader(shuffle=False)
    model = torchrepro.InvariantDataParallel(net(), ld)
    reference = net()
    leaves: list[list[torch.Tensor]] = []
    for i, (x, y) in enumerate(ld):
        nn.functional.mse_loss(model(x), y).backward()
        reference.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        leaves.append([p.grad.clone() for p in reference.parameters()])
        if (i + 1) % ld.accumulation_steps == 0:
            break
        assert all(p.grad is None for p in model.parameters())  # taken out after each backward
    for n, p in enumerate(model.parameters()):
        expected = tree_sum([leaf[n] for leaf in leaves], (0, V)).div_(V)
        assert torch.equal(p.grad, expected)
        assert p.grad.shape == p.shape
    assert model.peak_buffers <= 4  # partial sums held at once for V = 6


def test_forwards_are_keyed_and_leave_the_global_stream_alone() -> None:
    ld = loader()
    model = torchrepro.InvariantDataParallel(net(dropout=0.5), ld)
    x = torch.ones(MICRO, 5)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    it = iter(ld)
    next(it)
    out1 = model(x)
    assert torch.equal(torch.get_rng_state(), before)  # loading and the forward both put it back
    out2 = model(x)  # a second call in the same micro-batch draws another key
    assert not torch.equal(out1, out2)
    torch.manual_seed(999)  # another stream position changes nothing: the key decides
    again = torchrepro.InvariantDataParallel(net(dropout=0.5), loader())
    it2 = iter(again._loader)
    next(it2)
    assert torch.equal(again(x), out1)
    model.eval()
    torch.manual_seed(5)
    assert torch.equal(model(x), model(x))  # eval: the module's own forward


def test_an_unused_parameter_keeps_grad_none_and_carried_grads_are_added() -> None:
    class WithSpare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = net()
            self.spare = nn.Linear(1, 1)  # never called

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    module = WithSpare()
    spare = module.spare
    ld = loader()
    model = torchrepro.InvariantDataParallel(module, ld)
    first = module.body[0].weight
    first.grad = torch.full_like(first, 1.0)  # left from before: no zero_grad
    for i, (x, y) in enumerate(ld):
        nn.functional.mse_loss(model(x), y).backward()
        if i + 1 == ld.accumulation_steps:
            break
    assert spare.weight.grad is None
    carried = first.grad.clone()
    assert not torch.equal(carried, torch.full_like(first, 1.0))
    # The same global batch without the carried gradient: the difference is the carry.
    module2 = net()
    ld2 = loader()
    model2 = torchrepro.InvariantDataParallel(module2, ld2)
    for i, (x, y) in enumerate(ld2):
        nn.functional.mse_loss(model2(x), y).backward()
        if i + 1 == ld2.accumulation_steps:
            break
    assert torch.equal(carried, 1.0 + module2[0].weight.grad)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_running_statistics_end_as_a_sequential_run_leaves_them(momentum: float | None) -> None:
    """Replayed in global micro-batch order from the kernel's own shares, the running statistics
    are what stock BatchNorm leaves after the same micro-batches one after another, up to the
    rounding of each share to float32 (the kernel adds in double). Their bits on every world size
    are the subject of test_world_sizes."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4, momentum=momentum), nn.Linear(4, 1))
    stock = copy.deepcopy(module)
    bn = module[1]
    ld = loader(shuffle=False)
    model = torchrepro.InvariantDataParallel(module, ld)
    for i, (x, y) in enumerate(ld):
        before = bn.running_mean.clone()
        nn.functional.mse_loss(model(x), y).backward()
        stock(x)
        if i + 1 == ld.accumulation_steps:
            break
        assert torch.equal(bn.running_mean, before)  # still during the global batch
    assert int(bn.num_batches_tracked) == V
    assert torch.equal(bn.num_batches_tracked, stock[1].num_batches_tracked)
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(bn, name), getattr(stock[1], name), rtol=1e-6, atol=1e-7)
        assert not torch.equal(getattr(bn, name), getattr(module[1], name) * 0)  # it moved


def test_refusals_say_what_was_wrong() -> None:
    plain = torchrepro.SeededLoader(data(), batch_size=MICRO, seed=0)
    with pytest.raises(InvariantTrainingError, match="global_batch_size"):
        torchrepro.InvariantDataParallel(net(), plain)
    with pytest.raises(InvariantTrainingError, match=r"sync \(SyncBatchNorm\).*reduced across ranks"):
        torchrepro.InvariantDataParallel(nn.ModuleDict({"sync": nn.SyncBatchNorm(4)}), loader())
    with pytest.raises(InvariantTrainingError, match=r"inorm \(InstanceNorm1d\)"):
        torchrepro.InvariantDataParallel(
            nn.ModuleDict({"inorm": nn.InstanceNorm1d(4, track_running_stats=True)}), loader()
        )
    with pytest.raises(InvariantTrainingError, match=r"rank 1 of 2, but this process is rank 0 of 1"):
        torchrepro.InvariantDataParallel(net(), loader(rank=1, world_size=2))
    with pytest.raises(TypeError, match=r"wraps an nn\.Module"):
        torchrepro.InvariantDataParallel(lambda x: x, loader())  # type: ignore[arg-type]


def test_misuse_in_the_loop_is_refused() -> None:
    ld = loader()
    inner = net()
    model = torchrepro.InvariantDataParallel(inner, ld)
    x = torch.ones(MICRO, 5)
    with pytest.raises(InvariantTrainingError, match="before its loader delivered"):
        model(x)
    it = iter(ld)
    next(it)
    loss = model(x).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(InvariantTrainingError, match="second backward"):
        loss.backward()
    next(it)
    model(x)
    next(it)
    with pytest.raises(InvariantTrainingError, match="had a forward but no backward"):
        model(x)
    model2 = torchrepro.InvariantDataParallel(net(), loader())
    with pytest.raises(InvariantTrainingError, match="call the wrapper, not the wrapped module"):
        model2.module(x).sum().backward()


def test_a_buffer_changed_in_training_is_refused_by_name() -> None:
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 1)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen += 1
            return self.lin(x)

    ld = loader()
    model = torchrepro.InvariantDataParallel(Counting(), ld)
    with pytest.raises(InvariantTrainingError, match=r"the buffers seen changed during training"):
        for x, y in ld:
            nn.functional.mse_loss(model(x), y).backward()
