"""``clip_grad_norm_`` in one process: torch's result within float rounding, the same scaling, and
one summation order whatever the threads and however a gradient's rows are split.

Negative controls: torch's total changes when the same values come as several tensors (which is
what sharding does to its per-tensor norms), and a contiguous CPU ``pow`` gives an element other
bits depending on where it falls in the tensor; ours does neither. Sharding across processes
(FSDP2 on 2 and 4 ranks) is ``test_clip_fsdp.py``.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from helpers import free_port
from torchrepro import InvariantTrainingError, clip_grad_norm_
from torchrepro.invariant.clip import pairwise, row_sums

SHAPES = [(24, 13), (24,), (7, 24), (7,), (), (5, 3, 4)]
P_VALUES = [2.0, 1.0, 3.0, 2.5, 0.5, math.inf]


def params(seed: int = 0, dtype: torch.dtype = torch.float32, shapes: list = SHAPES) -> list[nn.Parameter]:
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=g) * 3).to(dtype)
        out.append(p)
    return out


def grads(ps: list[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad.clone() for p in ps if p.grad is not None]


def reference(x: torch.Tensor) -> torch.Tensor:
    """The pairwise halving as its definition reads (fresh tensors, ``torch.cat``)."""
    while x.shape[1] > 1:
        k, h = x.shape[1], x.shape[1] // 2
        y = x[:, :h] + x[:, h : 2 * h]
        x = torch.cat([y, x[:, 2 * h :]], dim=1) if k % 2 else y
    return x[:, 0]


def sharded_total(pieces: list[list[torch.Tensor]], p: float) -> torch.Tensor:
    """The total of gradients each given as row blocks (a shard per rank), as the ranks compute it:
    each block's row sums, concatenated; each parameter's rows halved; the parameters halved."""
    combine = torch.maximum if p == math.inf else torch.add
    sums = []
    for blocks in pieces:
        rows = torch.cat(row_sums(blocks, p))
        sums.append(pairwise(rows.view(1, -1).clone(), combine)[0])
    total = pairwise(torch.stack(sums).view(1, -1), combine)[0]
    return total if p in (1.0, math.inf) else total.sqrt() if p == 2 else total.pow(1 / p)


# --- torch's result, torch's scaling --------------------------------------------------------------


@pytest.mark.parametrize("p", P_VALUES)
def test_the_total_is_torchs_within_rounding_and_the_scaling_is_torchs(p: float) -> None:
    ours, theirs = params(), params()
    before = grads(ours)
    total = clip_grad_norm_(ours, 1.0, p)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, p)
    assert type(total) is torch.Tensor and total.dim() == 0 and total.dtype == expected.dtype
    torch.testing.assert_close(total, expected, rtol=2e-6, atol=0)
    coef = torch.clamp(1.0 / (total + 1e-6), max=1.0)
    for g, p_ in zip(before, ours, strict=True):
        assert torch.equal(p_.grad, g * coef)  # exactly total -> coef -> g * coef
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-6, atol=0)


def test_equal_totals_give_torchs_clipped_bits() -> None:
    ours, theirs = params(), params()
    total, expected = clip_grad_norm_(ours, 1.0), torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert torch.equal(total, expected)  # seeded: the two orders happen to round alike here
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs, strict=True))


def test_small_gradients_are_left_alone_and_a_single_tensor_is_taken() -> None:
    (p,) = params(shapes=[(4, 4)])
    g = p.grad.clone()
    total = clip_grad_norm_(p, max_norm=1e6)
    assert torch.equal(p.grad, g)
    assert float(total) == pytest.approx(float(torch.linalg.vector_norm(g)), rel=1e-6)


def test_the_inf_norm_is_the_largest_magnitude_exactly() -> None:
    ours, theirs = params(), params()
    assert torch.equal(
        clip_grad_norm_(ours, 1.0, math.inf), torch.nn.utils.clip_grad_norm_(theirs, 1.0, "inf")
    )
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_half_and_double_gradients(dtype: torch.dtype) -> None:
    ours, theirs = params(dtype=dtype), params(dtype=dtype)
    total, expected = clip_grad_norm_(ours, 1.0), torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert total.dtype == expected.dtype == dtype  # torch's dtype; summed in float32 (float64)
    exact = torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads(params(dtype=dtype))]))
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    assert float(total) == pytest.approx(float(exact), rel=tol)
    torch.testing.assert_close(total, expected, rtol=tol, atol=0)
    if torch.equal(total, expected):
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs, strict=True))


def test_mixed_dtypes_sum_in_the_widest() -> None:
    ps = params(shapes=[(6, 5)]) + params(seed=1, dtype=torch.float64, shapes=[(3,)])
    total = clip_grad_norm_(ps, 1.0)
    assert total.dtype == torch.float64


def test_parameters_without_gradients_are_skipped() -> None:
    ps = params()
    ps[1].grad = None
    ps[4].grad = None
    rest = params()
    del rest[4], rest[1]
    assert torch.equal(clip_grad_norm_(ps, 1.0), clip_grad_norm_(rest, 1.0))
    assert ps[1].grad is None and ps[4].grad is None


def test_no_gradient_at_all_returns_zero() -> None:
    assert torch.equal(clip_grad_norm_([], 1.0), torch.tensor(0.0))
    ps = params(shapes=[(3,)])
    ps[0].grad = None
    assert torch.equal(clip_grad_norm_(ps, 1.0), torch.tensor(0.0))
    assert torch.equal(clip_grad_norm_(iter(params()), 1.0), clip_grad_norm_(params(), 1.0))  # a generator


def test_an_empty_gradient_adds_nothing() -> None:
    ps = params(shapes=[(4, 3)])
    empty = nn.Parameter(torch.zeros(0, 5))
    empty.grad = torch.zeros(0, 5)
    assert torch.equal(
        clip_grad_norm_([*params(shapes=[(4, 3)]), empty], 1.0, math.inf), clip_grad_norm_(ps, 1.0, math.inf)
    )


# --- one order: threads, row blocks, ranks --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [2.0, 2.5])
def test_the_same_bits_with_1_and_2_threads(dtype: torch.dtype, p: float) -> None:
    shapes = [(600, 1000), (1000,), (3000, 7)]  # big enough for two threads to split the ops
    threads = torch.get_num_threads()
    totals, clipped = [], []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            ps = params(seed=3, dtype=dtype, shapes=shapes)
            totals.append(clip_grad_norm_(ps, 1.0, p))
            clipped.append(grads(ps))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(totals[0], totals[1])
    assert all(torch.equal(a, b) for a, b in zip(*clipped, strict=True))


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("world", [2, 3, 4, 7])
def test_every_row_sharding_gives_the_same_total(p: float, world: int) -> None:
    """What the ranks of FSDP2 compute (each its chunk of rows, torch.chunk-style) is the total of
    the whole gradients, bit for bit."""
    ps = params(seed=5)
    whole = clip_grad_norm_(params(seed=5), 1.0, p)
    pieces = [list(p_.grad.chunk(world)) if p_.grad.dim() else [p_.grad] for p_ in ps]
    assert torch.equal(sharded_total(pieces, p).to(whole.dtype), whole)


def test_negative_control_torchs_total_changes_when_the_same_values_are_split() -> None:
    """torch sums each tensor, then the tensors' norms: a gradient in four pieces (as four ranks'
    shards are) gives other bits. Ours, summed by rows, gives the same for any row split."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 1024, generator=g) * torch.logspace(-4, 4, 1024)  # magnitudes mixed
    print("seed 0")

    def torch_total(tensors: list[torch.Tensor]) -> torch.Tensor:
        ps = [nn.Parameter(torch.zeros_like(t)) for t in tensors]
        for p, t in zip(ps, tensors, strict=True):
            p.grad = t.clone()
        return torch.nn.utils.clip_grad_norm_(ps, 1.0)

    assert not torch.equal(torch_total([x]), torch_total(list(x.chunk(4))))
    whole = nn.Parameter(torch.zeros_like(x))
    whole.grad = x.clone()
    ours = clip_grad_norm_([whole], 1.0)
    assert torch.equal(sharded_total([list(x.chunk(4))], 2.0), ours)
    assert float(ours) == pytest.approx(float(torch.linalg.vector_norm(x.double())), rel=1e-6)


def test_negative_control_a_contiguous_pow_depends_on_where_an_element_falls() -> None:
    """CPU ``pow`` computes a vector's last few elements with a scalar kernel that rounds some
    values otherwise: an element near the end of a shard (rank 0's first m rows) gets other bits
    than in the whole tensor. ``row_sums`` takes the scalar kernel for every element (p = 2.5
    here), so its rows do not move."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1_003, generator=g) * 10
    full = x.pow(2.5)
    assert any(not torch.equal(x[:m].clone().pow(2.5), full[:m]) for m in range(100, 140))
    rows = row_sums([x], 2.5)[0]
    for m in range(100, 140):
        assert torch.equal(torch.cat(row_sums([x[:m], x[m:]], 2.5)), rows)


# --- the pure functions ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 6), k=st.integers(0, 70), seed=st.integers(0, 2**31 - 1))
def test_pairwise_is_its_definition(rows: int, k: int, seed: int) -> None:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) ** 3
    expected = reference(x.clone()) if k else torch.zeros(rows, dtype=torch.float64)
    assert torch.equal(pairwise(x.clone()), expected)
    assert torch.equal(pairwise(x.clone(), torch.maximum), x.amax(dim=1) if k else expected)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 9), max_size=4),
    p=st.sampled_from(P_VALUES),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_row_sums_of_row_blocks_are_the_row_sums(
    shape: list[int], cuts: list[int], p: float, dtype: torch.dtype, seed: int
) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)
    bounds = sorted({0, shape[0], *(min(c, shape[0]) for c in cuts)})
    blocks = [x[a:b] for a, b in itertools.pairwise(bounds)] or [x]
    whole = row_sums([x], p)[0]
    assert whole.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert whole.shape == (shape[0],)
    assert torch.equal(torch.cat(row_sums(blocks, p)), whole)
    assert torch.equal(torch.cat(row_sums(list(reversed(blocks)), p)[::-1]), whole)  # batched others


def test_row_sums_of_large_tensors_are_taken_block_by_block_with_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(300, 37, generator=torch.Generator().manual_seed(2))
    whole = row_sums([x], 2.0)[0]
    monkeypatch.setattr("torchrepro.invariant.clip.BLOCK", 100)
    assert torch.equal(row_sums([x], 2.0)[0], whole)
    assert torch.equal(row_sums([x[:1], x[1:]], 2.0)[0], whole[:1])


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"max_norm": -1.0}, ValueError, "max_norm must be >= 0, got -1.0"),
        ({"max_norm": math.nan}, ValueError, "max_norm must be >= 0"),
        ({"max_norm": "big"}, ValueError, "max_norm must be a number, .* got 'big'"),
        ({"max_norm": None}, TypeError, "max_norm must be a number"),
        ({"norm_type": 0.0}, ValueError, "norm_type must be positive"),
        ({"norm_type": -2.0}, ValueError, "norm_type must be positive"),
        ({"norm_type": math.nan}, ValueError, "norm_type must be positive"),
        ({"norm_type": "fro"}, ValueError, "norm_type must be a positive number or float\\('inf'\\)"),
        ({"norm_type": None}, TypeError, "norm_type must be a positive number"),
    ],
)
def test_bad_arguments_say_what_and_how_to_fix(kwargs: dict, error: type, words: str) -> None:
    args = {"max_norm": 1.0, **kwargs}
    with pytest.raises(error, match=words):
        clip_grad_norm_(params(), **args)


def test_sparse_and_complex_gradients_are_refused_by_parameter() -> None:
    ps = params(shapes=[(3,), (4, 2)])
    ps[1].grad = ps[1].grad.to_sparse()
    with pytest.raises(TypeError, match=r"parameter 1's gradient is torch\.sparse_coo .*sparse=False"):
        clip_grad_norm_(ps, 1.0)
    c = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    c.grad = torch.ones(2, dtype=torch.complex64)
    with pytest.raises(TypeError, match=r"parameter 0's gradient is torch\.complex64"):
        clip_grad_norm_([c], 1.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_total(bad: float) -> None:
    ps = params()
    ps[2].grad[1, 3] = bad
    with pytest.raises(InvariantTrainingError, match=r"parameter 2's.*error_if_nonfinite=False"):
        clip_grad_norm_(ps, 1.0, error_if_nonfinite=True)
    assert isinstance(InvariantTrainingError("x"), RuntimeError)  # torch raises a RuntimeError
    big = params(shapes=[(1,), (1,)])
    for q in big:
        q.grad.fill_(1.4e19)  # each square fits float32, their sum does not
    with pytest.raises(InvariantTrainingError, match=r"is inf \(the sum overflows\)"):
        clip_grad_norm_(big, 1.0, error_if_nonfinite=True)
    theirs = params()
    theirs[2].grad[1, 3] = bad
    total = clip_grad_norm_(ps, 1.0)  # like torch: the gradients scaled by a non-finite coefficient
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    torch.testing.assert_close(total, expected, rtol=0, atol=0, equal_nan=True)
    for a, b in zip(ps, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)


# --- DTensor gradients on a 1-process group -------------------------------------------------------


@pytest.fixture
def group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dparams(
    placements: list, mesh_shape: tuple[int, ...] = (1,), shapes: tuple = ((24, 13), (7,))
) -> list[nn.Parameter]:
    from torch.distributed.tensor import distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    out = []
    for p in params(shapes=list(shapes)):
        d = nn.Parameter(distribute_tensor(p.detach(), mesh, placements))
        d.grad = distribute_tensor(p.grad, mesh, placements)
        out.append(d)
    return out


@pytest.mark.usefixtures("group")
def test_shard0_and_replicated_dtensor_gradients_give_the_plain_bits() -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    plain = params(shapes=[(24, 13), (7,)])
    expected = clip_grad_norm_(plain, 1.0)
    for placements in ([Shard(0)], [Replicate()]):
        ps = dparams(placements)
        total = clip_grad_norm_(ps, 1.0)
        assert type(total) is torch.Tensor and not isinstance(total, DTensor)
        assert torch.equal(total, expected)
        for d, p in zip(ps, plain, strict=True):
            assert isinstance(d.grad, DTensor) and torch.equal(d.grad.full_tensor(), p.grad)


@pytest.mark.usefixtures("group")
@pytest.mark.parametrize("which", ["shard1", "partial", "2d"])
def test_other_placements_are_refused_by_parameter_and_placement(which: str) -> None:
    from torch.distributed.tensor import DTensor, Partial, Shard, init_device_mesh

    if which == "shard1":
        ps, words = (
            dparams([Shard(1)], shapes=((24, 13),)),
            r"parameter 0's gradient is a DTensor placed \(Shard\(dim=1\),\)",
        )
    elif which == "2d":
        ps, words = dparams([Shard(0), Shard(0)], (1, 1)), "parameter 0's .* on a 2-D mesh"
    else:
        ps = dparams([Shard(0)])
        mesh = init_device_mesh("cpu", (1,))
        ps[1].grad = DTensor.from_local(torch.ones(7), mesh, [Partial()])
        words = r"parameter 1's gradient is a DTensor placed \(Partial\(sum\),\)"
    with pytest.raises(InvariantTrainingError, match=words + ".*Shard\\(0\\) on a 1-D mesh"):
        clip_grad_norm_(ps, 1.0)
