"""Section ``optable``: the audit's op table against this GPU and this torch.

Every entry of ``src/torchrepro/audit/ops_table.json`` (each TR1xx code) has cases here, one per
public function or condition branch its ops stand for, plus cases where an entry's condition is
not met and cases of ops the audit does not flag at all (``code`` None, the "fine" ops). Where a
public function avoids the table's aten op under strict mode on CUDA (``F.interpolate`` bilinear
and trilinear, and ``F.max_pool3d`` from torch 2.13, run a decomposition), or may (``F.pad``
reflect 2-d ran under strict mode on an H200 with torch 2.11), a second case calls the aten op
directly, so that the table's op and the public function are each checked. Each case
runs three times under ``torch.use_deterministic_algorithms(True)`` and three times with it off;
the record says whether strict mode raised, warned about determinism or ran, whether its calls
gave equal bits (``equal_bits``), and whether they did with it off (``equal_bits_off``: whether
the op is in fact nondeterministic here, a measurement with no verdict).

``compare(records, table)`` lists every disagreement between what the table claims for this
torch and what was observed on CUDA: an op the table says raises that ran; an op it says strict
mode makes deterministic (or an op it does not flag) that raised, warned, or gave unequal bits.

Invariants:

- A case builds its inputs from its own fixed-seed generator, with strict mode off, afresh for
  every call; only the op under test (forward, and backward for backward-phase ops) runs under the
  mode measured. Nothing reads or advances the global RNG (dropout forks and restores it).
- The expectation of a case is derived from ``load_table()`` of the torch that runs it (the
  documentation of that release), never from a list kept here; an op absent from this release's
  lists is expected to be fine.
- Claims are compared on CUDA only. On the CPU the same cases run and are recorded (rows
  ``info``), and the summary row says ``skip``: the table's claims are about CUDA.
- ``run`` restores every determinism switch it touches (``DeterminismFlags``), and
  ``CUBLAS_WORKSPACE_CONFIG`` when it had to set it. A case that breaks is an ``error`` row, never
  an exception out of the section. ``compare`` is a pure function of JSON-able records.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gpu_checks.common import Context, Row
from torchrepro._runtime import cuda_started
from torchrepro.audit.optable import Entry, _OpTable, _table_data, load_table
from torchrepro.flags import CUBLAS_VAR, DeterminismFlags

NAME = "optable"

CUBLAS_VALUE = ":4096:8"
CALLS = 3  # calls per mode: the bits of every call are compared with the first's
_ALERT = re.compile(r"determinis", re.IGNORECASE)  # strict mode's error, and its warn_only warning

Outputs = Tensor | tuple[Tensor, ...]
Thunk = Callable[[], Outputs]


# ---------------------------------------------------------------------------------------------
# Cases


class _Maker:
    """Inputs of one call of a case: a fresh generator with the case's seed, sizes by ``quick``.

    ``n`` elements scattered into ``bins`` slots: about a thousand values per slot on the GPU,
    so atomic accumulation collides (and rounds differently by arrival order) if it happens.
    """

    def __init__(self, device: str, quick: bool, seed: int) -> None:
        self.device = device
        self.quick = quick
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        self.n = 1 << 12 if quick else 1 << 20
        self.bins = 64 if quick else 1024

    def size(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> Tensor:
        t = torch.randn(shape, generator=self.gen, device=self.device, dtype=dtype)
        return t.requires_grad_(grad)

    def rand(self, *shape: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> Tensor:
        t = torch.rand(shape, generator=self.gen, device=self.device, dtype=dtype)
        return t.requires_grad_(grad)

    def randint(self, low: int, high: int, *shape: int) -> Tensor:
        return torch.randint(low, high, shape, generator=self.gen, device=self.device)

    def grads(self, fn: Callable[..., Tensor], *leaves: Tensor, with_output: bool = False) -> Thunk:
        """A thunk: ``fn(*leaves)``, then the gradients of the leaves for a random upstream gradient."""

        def thunk() -> Outputs:
            out = fn(*leaves)
            upstream = torch.randn(out.shape, generator=self.gen, device=out.device, dtype=out.dtype)
            grads = torch.autograd.grad(out, leaves, upstream)
            return (out.detach(), *grads) if with_output else tuple(grads)

        return thunk


@dataclasses.dataclass(frozen=True)
class Case:
    code: str | None  # the TR code of the table entry, None for an op the audit does not flag
    name: str
    op: str  # the aten op of the entry this case exercises ("aten.cumsum", "aten.median.dim")
    build: Callable[[_Maker], Thunk]
    applies: bool = True  # the entry's condition is met (False: the case where it is not)
    note: str = ""
    cpu_only: bool = False  # runs on the CPU even in a CUDA run (quantized tensors)

    @property
    def direct(self) -> bool:
        """The aten op called itself, not through the public function the audit sees."""
        return self.name.endswith("(called directly)")


CASES: list[Case] = []


def _case(
    code: str | None, name: str, op: str, *, applies: bool = True, note: str = "", cpu_only: bool = False
) -> Callable[[Callable[[_Maker], Thunk]], Callable[[_Maker], Thunk]]:
    def register(build: Callable[[_Maker], Thunk]) -> Callable[[_Maker], Thunk]:
        CASES.append(Case(code, name, op, build, applies, note, cpu_only))
        return build

    return register


# TR101-TR104: pooling backward. Windows overlap heavily (stride 1, or an adaptive output larger
# than its input), so one input element takes the gradient of many windows.


@_case("TR101", "avg_pool3d backward", "aten.avg_pool3d_backward")
def _avg_pool3d(m: _Maker) -> Thunk:
    s = m.size(24, 8)
    return m.grads(lambda x: F.avg_pool3d(x, 3, stride=1), m.randn(2, 4, s, s, s, grad=True))


@_case("TR102", "adaptive_avg_pool2d backward", "aten._adaptive_avg_pool2d_backward")
def _adaptive_avg2d(m: _Maker) -> Thunk:
    s = m.size(16, 6)
    x = m.randn(8, 16, s, s, grad=True)
    return m.grads(lambda x: F.adaptive_avg_pool2d(x, m.size(61, 20)), x)


@_case("TR102", "adaptive_avg_pool3d backward", "aten._adaptive_avg_pool3d_backward")
def _adaptive_avg3d(m: _Maker) -> Thunk:
    s = m.size(8, 4)
    x = m.randn(2, 4, s, s, s, grad=True)
    return m.grads(lambda x: F.adaptive_avg_pool3d(x, m.size(21, 9)), x)


@_case("TR103", "adaptive_max_pool2d backward", "aten.adaptive_max_pool2d_backward")
def _adaptive_max2d(m: _Maker) -> Thunk:
    s = m.size(16, 6)
    x = m.randn(8, 16, s, s, grad=True)
    return m.grads(lambda x: F.adaptive_max_pool2d(x, m.size(61, 20)), x)


@_case("TR104", "fractional_max_pool2d backward", "aten.fractional_max_pool2d_backward")
def _fractional2d(m: _Maker) -> Thunk:
    s = m.size(64, 12)
    x = m.randn(4, 8, s, s, grad=True)
    samples = m.rand(4, 8, 2)
    return m.grads(lambda x: F.fractional_max_pool2d(x, 3, output_size=s - 3, _random_samples=samples), x)


@_case("TR104", "fractional_max_pool3d backward", "aten.fractional_max_pool3d_backward")
def _fractional3d(m: _Maker) -> Thunk:
    s = m.size(20, 8)
    x = m.randn(2, 4, s, s, s, grad=True)
    samples = m.rand(2, 4, 3)
    return m.grads(lambda x: F.fractional_max_pool3d(x, 3, output_size=s - 3, _random_samples=samples), x)


# TR105: max_unpool (forward). The pooling that makes the indices runs outside the measured mode.


@_case("TR105", "max_unpool1d", "aten.max_unpool2d", note="max_unpool1d runs as aten.max_unpool2d")
def _unpool1d(m: _Maker) -> Thunk:
    out, idx = F.max_pool1d(m.randn(8, 16, m.size(4096, 64)), 2, return_indices=True)
    return lambda: F.max_unpool1d(out, idx, (2,))


@_case("TR105", "max_unpool2d", "aten.max_unpool2d")
def _unpool2d(m: _Maker) -> Thunk:
    s = m.size(128, 16)
    out, idx = F.max_pool2d(m.randn(4, 16, s, s), 2, return_indices=True)
    return lambda: F.max_unpool2d(out, idx, (2, 2))


@_case("TR105", "max_unpool3d", "aten.max_unpool3d")
def _unpool3d(m: _Maker) -> Thunk:
    s = m.size(32, 8)
    out, idx = F.max_pool3d(m.randn(2, 8, s, s, s), 2, return_indices=True)
    return lambda: F.max_unpool3d(out, idx, (2, 2, 2))


# TR106: interpolate backward, each listed mode (and antialiased), and 'nearest', not listed.


def _interpolate(m: _Maker, shape: tuple[int, ...], **kwargs: Any) -> Thunk:
    return m.grads(lambda x: F.interpolate(x, **kwargs), m.randn(*shape, grad=True))


@_case("TR106", "interpolate linear backward", "aten.upsample_linear1d_backward")
def _interp_linear(m: _Maker) -> Thunk:
    return _interpolate(m, (8, 16, m.size(4096, 64)), scale_factor=3.0, mode="linear")


@_case("TR106", "interpolate bilinear backward", "aten.upsample_bilinear2d_backward")
def _interp_bilinear(m: _Maker) -> Thunk:
    s = m.size(128, 12)
    return _interpolate(m, (4, 8, s, s), scale_factor=3.0, mode="bilinear")


@_case("TR106", "interpolate bicubic backward", "aten.upsample_bicubic2d_backward")
def _interp_bicubic(m: _Maker) -> Thunk:
    s = m.size(128, 12)
    return _interpolate(m, (4, 8, s, s), scale_factor=3.0, mode="bicubic")


@_case("TR106", "interpolate trilinear backward", "aten.upsample_trilinear3d_backward")
def _interp_trilinear(m: _Maker) -> Thunk:
    s = m.size(24, 6)
    return _interpolate(m, (2, 4, s, s, s), scale_factor=2.5, mode="trilinear")


@_case("TR106", "interpolate bilinear antialias backward", "aten._upsample_bilinear2d_aa_backward")
def _interp_bilinear_aa(m: _Maker) -> Thunk:
    s = m.size(128, 24)
    return _interpolate(m, (4, 8, s, s), size=(s // 3, s // 3), mode="bilinear", antialias=True)


@_case("TR106", "interpolate bicubic antialias backward", "aten._upsample_bicubic2d_aa_backward")
def _interp_bicubic_aa(m: _Maker) -> Thunk:
    s = m.size(128, 24)
    return _interpolate(m, (4, 8, s, s), size=(s // 3, s // 3), mode="bicubic", antialias=True)


# On CUDA under strict mode F.interpolate computes bilinear and trilinear through a decomposition
# (whose backward is index_put): these call the aten ops the table names, directly.


@_case(
    "TR106",
    "aten.upsample_bilinear2d backward (called directly)",
    "aten.upsample_bilinear2d_backward",
    note="the op itself: F.interpolate avoids it under strict mode on CUDA",
)
def _aten_bilinear(m: _Maker) -> Thunk:
    s = m.size(128, 12)
    up = torch.ops.aten.upsample_bilinear2d.vec
    return m.grads(lambda x: up(x, None, False, [3.0, 3.0]), m.randn(4, 8, s, s, grad=True))


@_case(
    "TR106",
    "aten.upsample_trilinear3d backward (called directly)",
    "aten.upsample_trilinear3d_backward",
    note="the op itself: F.interpolate avoids it under strict mode on CUDA",
)
def _aten_trilinear(m: _Maker) -> Thunk:
    s = m.size(24, 6)
    up = torch.ops.aten.upsample_trilinear3d.vec
    return m.grads(lambda x: up(x, None, False, [2.5, 2.5, 2.5]), m.randn(2, 4, s, s, s, grad=True))


@_case(
    "TR106",
    "interpolate nearest backward",
    "aten.upsample_nearest2d_backward",
    applies=False,
    note="mode='nearest' is not among the documented modes",
)
def _interp_nearest(m: _Maker) -> Thunk:
    s = m.size(128, 12)
    return _interpolate(m, (4, 8, s, s), scale_factor=3.0, mode="nearest")


# TR107, TR121: padding backward. Padding as wide as the input: an element near an edge takes the
# gradient of itself and of several reflections/replicas (three or more addends per element).


def _pad(m: _Maker, shape: tuple[int, ...], pad: int, mode: str) -> Thunk:
    pads = (pad,) * (2 * (len(shape) - 2))
    return m.grads(lambda x: F.pad(x, pads, mode=mode), m.randn(*shape, grad=True))


@_case("TR107", "reflection_pad1d backward", "aten.reflection_pad1d_backward")
def _reflect1d(m: _Maker) -> Thunk:
    s = m.size(256, 16)
    return _pad(m, (64, 64, s), s - 1, "reflect")


@_case("TR107", "reflection_pad2d backward", "aten.reflection_pad2d_backward")
def _reflect2d(m: _Maker) -> Thunk:
    s = m.size(64, 8)
    return _pad(m, (8, 16, s, s), s - 1, "reflect")


@_case("TR107", "reflection_pad3d backward", "aten.reflection_pad3d_backward")
def _reflect3d(m: _Maker) -> Thunk:
    s = m.size(16, 5)
    return _pad(m, (2, 4, s, s, s), s - 1, "reflect")


@_case(
    "TR107",
    "aten.reflection_pad2d backward (called directly)",
    "aten.reflection_pad2d_backward",
    note="the op itself, not through F.pad",
)
def _aten_reflect2d(m: _Maker) -> Thunk:
    s = m.size(64, 8)
    pad = torch.ops.aten.reflection_pad2d.default
    return m.grads(lambda x: pad(x, [s - 1] * 4), m.randn(8, 16, s, s, grad=True))


@_case("TR121", "replication_pad1d backward", "aten.replication_pad1d_backward")
def _replicate1d(m: _Maker) -> Thunk:
    s = m.size(256, 16)
    return _pad(m, (64, 64, s), s, "replicate")


@_case("TR121", "replication_pad2d backward", "aten.replication_pad2d_backward")
def _replicate2d(m: _Maker) -> Thunk:
    s = m.size(64, 8)
    return _pad(m, (8, 16, s, s), s, "replicate")


@_case("TR121", "replication_pad3d backward", "aten.replication_pad3d_backward")
def _replicate3d(m: _Maker) -> Thunk:
    s = m.size(16, 5)
    return _pad(m, (2, 4, s, s, s), s, "replicate")


# TR108: nll_loss on inputs with spatial dimensions (forward), reduced or not.


def _nll2d_inputs(m: _Maker) -> tuple[Tensor, Tensor]:
    s = m.size(128, 8)
    return m.randn(8, 10, s, s), m.randint(0, 10, 8, s, s)


@_case("TR108", "nll_loss 4-d reduction='mean'", "aten.nll_loss2d_forward")
def _nll2d_mean(m: _Maker) -> Thunk:
    logits, target = _nll2d_inputs(m)
    logp = F.log_softmax(logits, 1)
    return lambda: F.nll_loss(logp, target)


@_case("TR108", "cross_entropy 4-d reduction='sum'", "aten.nll_loss2d_forward")
def _ce2d_sum(m: _Maker) -> Thunk:
    logits, target = _nll2d_inputs(m)
    return lambda: F.cross_entropy(logits, target, reduction="sum")


@_case("TR108", "nll_loss 4-d reduction='none'", "aten.nll_loss2d_forward", applies=False)
def _nll2d_none(m: _Maker) -> Thunk:
    logits, target = _nll2d_inputs(m)
    logp = F.log_softmax(logits, 1)
    return lambda: F.nll_loss(logp, target, reduction="none")


@_case(
    "TR109",
    "ctc_loss backward",
    "aten._ctc_loss_backward",
    note="int64 targets on the device: the native kernel, not cuDNN's",
)
def _ctc(m: _Maker) -> Thunk:
    t, n, c, s = m.size(200, 30), m.size(16, 2), 20, m.size(50, 8)
    x = m.randn(t, n, c, grad=True)
    targets = m.randint(1, c, n, s)
    in_lens = torch.full((n,), t, dtype=torch.long, device=m.device)
    tgt_lens = torch.full((n,), s, dtype=torch.long, device=m.device)
    return m.grads(lambda x: F.ctc_loss(x.log_softmax(2), targets, in_lens, tgt_lens), x)


# TR110: embedding_bag backward, mode='max' (the condition) and mode='sum'.


def _embedding_bag(m: _Maker, mode: str) -> Thunk:
    rows, bag = m.size(1000, 50), 16
    weight = m.randn(rows, 64, grad=True)
    idx = m.randint(0, rows, m.n // 16)
    offsets = torch.arange(0, idx.numel(), bag, device=m.device)
    return m.grads(lambda w: F.embedding_bag(idx, w, offsets, mode=mode), weight)


@_case("TR110", "embedding_bag mode='max' backward", "aten._embedding_bag_backward")
def _bag_max(m: _Maker) -> Thunk:
    return _embedding_bag(m, "max")


@_case("TR110", "embedding_bag mode='sum' backward", "aten._embedding_bag_backward", applies=False)
def _bag_sum(m: _Maker) -> Thunk:
    return _embedding_bag(m, "sum")


# Scatter-like ops: n values into `bins` slots, indices repeated about n / bins times each.


def _scatter_inputs(m: _Maker) -> tuple[Tensor, Tensor, Tensor]:
    """(self: zeros(bins), index: n ints in [0, bins), src: n normal floats)."""
    return torch.zeros(m.bins, device=m.device), m.randint(0, m.bins, m.n), m.randn(m.n)


@_case("TR111", "put_ accumulate=False", "aten.put_")
def _put_false(m: _Maker) -> Thunk:
    x, idx, src = _scatter_inputs(m)
    return lambda: x.put_(idx, src)


@_case("TR111", "put_ accumulate=True", "aten.put_")
def _put_true(m: _Maker) -> Thunk:
    x, idx, src = _scatter_inputs(m)
    return lambda: x.put_(idx, src, accumulate=True)


@_case("TR111", "put accumulate=True (out of place)", "aten.put")
def _put_out_of_place(m: _Maker) -> Thunk:
    x, idx, src = _scatter_inputs(m)
    return lambda: x.put(idx, src, accumulate=True)


@_case("TR112", "histc", "aten.histc")
def _histc(m: _Maker) -> Thunk:
    x = m.randn(m.n)
    return lambda: torch.histc(x, bins=100, min=-3.0, max=3.0)


@_case("TR113", "bincount with weights", "aten.bincount")
def _bincount_weights(m: _Maker) -> Thunk:
    x, w = m.randint(0, m.bins, m.n), m.rand(m.n)
    return lambda: torch.bincount(x, weights=w)


@_case("TR113", "bincount without weights", "aten.bincount", applies=False)
def _bincount(m: _Maker) -> Thunk:
    x = m.randint(0, m.bins, m.n)
    return lambda: torch.bincount(x)


def _tied(m: _Maker) -> Tensor:
    """Rows of small integers as floats: the median or k-th value of a row is tied many times."""
    return m.randint(0, 5, m.size(256, 8), m.size(4096, 64)).float()


@_case("TR114", "median with dim (values and indices)", "aten.median.dim")
def _median_dim(m: _Maker) -> Thunk:
    x = _tied(m)
    return lambda: tuple(torch.median(x, dim=1))


@_case("TR114", "median without dim (no indices)", "aten.median.default", applies=False)
def _median_all(m: _Maker) -> Thunk:
    x = _tied(m)
    return lambda: torch.median(x)


# TR115: grid_sample backward; many sampling points per input pixel.


def _grid_sample(m: _Maker, dims: int, align_corners: bool) -> Thunk:
    s, g = (m.size(32, 6), m.size(128, 16)) if dims == 2 else (m.size(12, 4), m.size(32, 8))
    x = m.randn(2, 8, *(s,) * dims, grad=True)
    grid = m.rand(2, *(g,) * dims, dims) * 2 - 1
    return m.grads(lambda x: F.grid_sample(x, grid, align_corners=align_corners), x)


@_case("TR115", "grid_sample 2-d backward", "aten.grid_sampler_2d_backward")
def _grid2d(m: _Maker) -> Thunk:
    return _grid_sample(m, 2, align_corners=False)


@_case(
    "TR115",
    "grid_sample 2-d align_corners=True backward",
    "aten.cudnn_grid_sampler_backward",
    note="bilinear, zeros, align_corners=True: cuDNN's sampler on CUDA (the native one on the CPU)",
)
def _grid2d_cudnn(m: _Maker) -> Thunk:
    return _grid_sample(m, 2, align_corners=True)


@_case("TR115", "grid_sample 3-d backward", "aten.grid_sampler_3d_backward")
def _grid3d(m: _Maker) -> Thunk:
    return _grid_sample(m, 3, align_corners=False)


# TR116: cumsum, floating or complex (the condition) and integer.


@_case("TR116", "cumsum float32", "aten.cumsum")
def _cumsum_float(m: _Maker) -> Thunk:
    x = m.randn(m.n)
    return lambda: torch.cumsum(x, 0)


@_case("TR116", "cumsum_ float32 (in place)", "aten.cumsum_")
def _cumsum_inplace(m: _Maker) -> Thunk:
    x = m.randn(16, m.n // 16)
    return lambda: x.cumsum_(1)


@_case("TR116", "cumsum complex64", "aten.cumsum")
def _cumsum_complex(m: _Maker) -> Thunk:
    x = torch.complex(m.randn(m.n), m.randn(m.n))
    return lambda: torch.cumsum(x, 0)


@_case("TR116", "cumsum int64", "aten.cumsum", applies=False)
def _cumsum_int(m: _Maker) -> Thunk:
    x = m.randint(-1000, 1000, m.n)
    return lambda: torch.cumsum(x, 0)


# TR117, TR128: scatter_reduce by reduction. Products of values near 1 (no overflow).


def _scatter_reduce(m: _Maker, reduce: str, *, inplace: bool = False) -> Thunk:
    x, idx, src = _scatter_inputs(m)
    if reduce == "prod":
        x, src = x + 1, 1 + src / 1000
    if inplace:
        return lambda: x.scatter_reduce_(0, idx, src, reduce=reduce)
    return lambda: x.scatter_reduce(0, idx, src, reduce=reduce)


@_case("TR117", "scatter_reduce prod", "aten.scatter_reduce.two")
def _sr_prod(m: _Maker) -> Thunk:
    return _scatter_reduce(m, "prod")


@_case("TR117", "scatter_reduce_ prod (in place)", "aten.scatter_reduce_.two")
def _sr_prod_inplace(m: _Maker) -> Thunk:
    return _scatter_reduce(m, "prod", inplace=True)


@_case("TR117", "scatter_reduce amax", "aten.scatter_reduce.two", applies=False)
def _sr_amax(m: _Maker) -> Thunk:
    return _scatter_reduce(m, "amax")


@_case("TR128", "scatter_reduce sum", "aten.scatter_reduce.two")
def _sr_sum(m: _Maker) -> Thunk:
    return _scatter_reduce(m, "sum")


@_case("TR128", "scatter_reduce_ mean (in place)", "aten.scatter_reduce_.two")
def _sr_mean_inplace(m: _Maker) -> Thunk:
    return _scatter_reduce(m, "mean", inplace=True)


@_case("TR128", "scatter_reduce amin", "aten.scatter_reduce.two", applies=False)
def _sr_amin(m: _Maker) -> Thunk:
    return _scatter_reduce(m, "amin")


# TR118: resize_ of a quantized tensor (quantized tensors live on the CPU), and of a float one.


@_case(
    "TR118",
    "resize_ of a quantized tensor",
    "aten.resize_",
    cpu_only=True,
    note="quantized tensors are CPU tensors: runs on the CPU in a CUDA run too",
)
def _resize_quantized(m: _Maker) -> Thunk:
    q = torch.quantize_per_tensor(m.randn(64, 64), 0.1, 0, torch.quint8)

    def thunk() -> Outputs:
        q.resize_(128, 128)
        return q.int_repr()

    return thunk


@_case(
    "TR118",
    "resize_ of a float tensor (grows)",
    "aten.resize_",
    applies=False,
    note="the new memory is uninitialised: strict mode fills it (fill_uninitialized_memory)",
)
def _resize_float(m: _Maker) -> Thunk:
    x = m.randn(m.n // 4)
    return lambda: x.resize_(m.n)


@_case("TR119", "kthvalue", "aten.kthvalue")
def _kthvalue(m: _Maker) -> Thunk:
    x = _tied(m)
    return lambda: tuple(torch.kthvalue(x, x.shape[1] // 3, dim=1))


# TR120: convolutions, forward and backward (output, input gradient, weight gradient).


def _conv(m: _Maker, fn: Callable[..., Tensor], x: tuple[int, ...], w: tuple[int, ...]) -> Thunk:
    return m.grads(
        lambda x, w: fn(x, w, padding=1), m.randn(*x, grad=True), m.randn(*w, grad=True), with_output=True
    )


@_case("TR120", "conv1d forward and backward", "aten.convolution")
def _conv1d(m: _Maker) -> Thunk:
    return _conv(m, F.conv1d, (32, 64, m.size(512, 32)), (64, 64, 3))


@_case("TR120", "conv2d forward and backward", "aten.convolution")
def _conv2d(m: _Maker) -> Thunk:
    s = m.size(32, 8)
    return _conv(m, F.conv2d, (16, 32, s, s), (64, 32, 3, 3))


@_case("TR120", "conv3d forward and backward", "aten.convolution")
def _conv3d(m: _Maker) -> Thunk:
    s = m.size(16, 5)
    return _conv(m, F.conv3d, (4, 16, s, s, s), (32, 16, 3, 3, 3))


@_case("TR120", "conv_transpose1d forward and backward", "aten.convolution")
def _convt1d(m: _Maker) -> Thunk:
    return _conv(m, F.conv_transpose1d, (32, 64, m.size(512, 32)), (64, 64, 3))


@_case("TR120", "conv_transpose2d forward and backward", "aten.convolution")
def _convt2d(m: _Maker) -> Thunk:
    s = m.size(32, 8)
    return _conv(m, F.conv_transpose2d, (16, 32, s, s), (32, 64, 3, 3))


@_case("TR120", "conv_transpose3d forward and backward", "aten.convolution")
def _convt3d(m: _Maker) -> Thunk:
    s = m.size(16, 5)
    return _conv(m, F.conv_transpose3d, (4, 16, s, s, s), (16, 32, 3, 3, 3))


# TR122: bmm of a sparse and a dense tensor; the dense bmm is the condition not met.


def _bmm_inputs(m: _Maker) -> tuple[Tensor, Tensor]:
    b, s = m.size(8, 2), m.size(256, 16)
    a = m.randn(b, s, s) * (m.rand(b, s, s) < 0.1)
    return a, m.randn(b, s, s)


@_case("TR122", "bmm sparse @ dense", "aten.bmm")
def _bmm_sparse(m: _Maker) -> Thunk:
    a, d = _bmm_inputs(m)
    sparse = a.to_sparse()
    return lambda: torch.bmm(sparse, d)


@_case("TR122", "bmm dense @ dense", "aten.bmm", applies=False)
def _bmm_dense(m: _Maker) -> Thunk:
    a, d = _bmm_inputs(m)
    return lambda: torch.bmm(a, d)


# TR123: index_put and its callers (indexed assignment, backward of advanced indexing).


@_case("TR123", "index_put_ accumulate=False (repeated indices)", "aten.index_put_")
def _index_put_false(m: _Maker) -> Thunk:
    x, idx, src = _scatter_inputs(m)
    return lambda: x.index_put_((idx,), src)


@_case("TR123", "index_put accumulate=True", "aten.index_put")
def _index_put_true(m: _Maker) -> Thunk:
    x, idx, src = _scatter_inputs(m)
    return lambda: x.index_put((idx,), src, accumulate=True)


@_case("TR123", "x[idx] = v (repeated indices)", "aten.index_put_")
def _setitem(m: _Maker) -> Thunk:
    x, idx, src = _scatter_inputs(m)

    def thunk() -> Outputs:
        x[idx] = src
        return x

    return thunk


@_case("TR123", "x[i, j] backward (a list of index tensors)", "aten._index_put_impl_")
def _getitem_backward(m: _Maker) -> Thunk:
    r = m.size(64, 8)
    x = m.randn(r, r, 16, grad=True)
    i, j = m.randint(0, r, m.n // 16), m.randint(0, r, m.n // 16)
    return m.grads(lambda x: x[i, j], x)


# TR124: scatter_add and the backward of gather.


@_case("TR124", "scatter_add_ 1-d", "aten.scatter_add_")
def _scatter_add_1d(m: _Maker) -> Thunk:
    x, idx, src = _scatter_inputs(m)
    return lambda: x.scatter_add_(0, idx, src)


@_case("TR124", "scatter_add 2-d (out of place)", "aten.scatter_add")
def _scatter_add_2d(m: _Maker) -> Thunk:
    x = torch.zeros(m.bins, 8, device=m.device)
    idx, src = m.randint(0, m.bins, m.n // 8, 8), m.randn(m.n // 8, 8)
    return lambda: torch.scatter_add(x, 0, idx, src)


@_case("TR124", "gather backward", "aten.scatter_add_")
def _gather_backward(m: _Maker) -> Thunk:
    x = m.randn(m.bins, 8, grad=True)
    idx = m.randint(0, m.bins, m.n // 8, 8)
    return m.grads(lambda x: torch.gather(x, 0, idx), x)


# TR125: index_add and the backward of index_select and repeat_interleave.


@_case("TR125", "index_add_ 1-d", "aten.index_add_")
def _index_add_1d(m: _Maker) -> Thunk:
    x, idx, src = _scatter_inputs(m)
    return lambda: x.index_add_(0, idx, src)


@_case("TR125", "index_add 2-d (out of place)", "aten.index_add")
def _index_add_2d(m: _Maker) -> Thunk:
    x = torch.zeros(m.bins, 16, device=m.device)
    idx, src = m.randint(0, m.bins, m.n // 16), m.randn(m.n // 16, 16)
    return lambda: torch.index_add(x, 0, idx, src)


@_case("TR125", "index_select backward", "aten.index_add_")
def _index_select_backward(m: _Maker) -> Thunk:
    x = m.randn(m.bins, 16, grad=True)
    idx = m.randint(0, m.bins, m.n // 16)
    return m.grads(lambda x: torch.index_select(x, 0, idx), x)


@_case("TR125", "repeat_interleave backward", "aten.index_add_")
def _repeat_interleave_backward(m: _Maker) -> Thunk:
    x = m.randn(m.bins, 16, grad=True)
    repeats = m.randint(1, 2 * m.n // (16 * m.bins), m.bins)
    return m.grads(lambda x: torch.repeat_interleave(x, repeats, dim=0), x)


# TR126, TR127: index_copy and scatter with a tensor src (repeated indices: which write wins).


@_case("TR126", "index_copy_ (repeated indices)", "aten.index_copy_")
def _index_copy_inplace(m: _Maker) -> Thunk:
    x, idx, src = _scatter_inputs(m)
    return lambda: x.index_copy_(0, idx, src)


@_case("TR126", "index_copy (out of place)", "aten.index_copy")
def _index_copy(m: _Maker) -> Thunk:
    x, idx, src = _scatter_inputs(m)
    return lambda: torch.index_copy(x, 0, idx, src)


@_case("TR127", "scatter_ src (repeated indices)", "aten.scatter_.src")
def _scatter_inplace(m: _Maker) -> Thunk:
    x, idx, src = _scatter_inputs(m)
    return lambda: x.scatter_(0, idx, src)


@_case("TR127", "scatter src (out of place)", "aten.scatter.src")
def _scatter(m: _Maker) -> Thunk:
    x, idx, src = _scatter_inputs(m)
    return lambda: torch.scatter(x, 0, idx, src)


@_case("TR132", "scatter_ reduce='add'", "aten.scatter_.reduce")
def _scatter_add_reduce(m: _Maker) -> Thunk:
    x, idx, src = _scatter_inputs(m)
    return lambda: x.scatter_(0, idx, src, reduce="add")


@_case("TR133", "scatter_ reduce='multiply'", "aten.scatter_.reduce")
def _scatter_mul_reduce(m: _Maker) -> Thunk:
    x, idx, src = _scatter_inputs(m)
    x, src = x + 1, 1 + src / 1000
    return lambda: x.scatter_(0, idx, src, reduce="multiply")


@_case("TR129", "max_pool3d backward", "aten.max_pool3d_with_indices_backward")
def _max_pool3d(m: _Maker) -> Thunk:
    s = m.size(24, 8)
    return m.grads(lambda x: F.max_pool3d(x, 3, stride=1), m.randn(2, 4, s, s, s, grad=True))


@_case(
    "TR129",
    "aten.max_pool3d_with_indices backward (called directly)",
    "aten.max_pool3d_with_indices_backward",
    note="the op itself: from torch 2.13 F.max_pool3d avoids it under strict mode on CUDA",
)
def _aten_max_pool3d(m: _Maker) -> Thunk:
    s = m.size(24, 8)
    pool = torch.ops.aten.max_pool3d_with_indices.default
    return m.grads(lambda x: pool(x, [3, 3, 3], [1, 1, 1])[0], m.randn(2, 4, s, s, s, grad=True))


# TR130: scaled_dot_product_attention backward with the flash and memory-efficient kernels.


def _sdpa(m: _Maker, backend: str, *, backward: bool = True) -> Thunk:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = m.device == "cuda"
    # On the CPU there is no memory-efficient kernel: both cases use the CPU flash kernel.
    chosen = getattr(SDPBackend, backend) if cuda or backend == "MATH" else SDPBackend.FLASH_ATTENTION
    dtype = torch.bfloat16 if cuda and backend == "FLASH_ATTENTION" else torch.float32
    b, h, n, d = m.size(4, 1), m.size(8, 2), m.size(1024, 32), m.size(64, 16)
    q, k, v = (m.randn(b, h, n, d, dtype=dtype, grad=backward) for _ in range(3))

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    if backward:
        return m.grads(attend, q, k, v)
    return lambda: attend(q, k, v)


@_case(
    "TR130",
    "sdpa flash backward",
    "aten._scaled_dot_product_flash_attention_backward",
    note="bfloat16 on CUDA; on the CPU the CPU flash kernel, float32",
)
def _sdpa_flash(m: _Maker) -> Thunk:
    return _sdpa(m, "FLASH_ATTENTION")


@_case(
    "TR130",
    "sdpa memory-efficient backward",
    "aten._scaled_dot_product_efficient_attention_backward",
    note="float32 on CUDA; on the CPU the CPU flash kernel",
)
def _sdpa_efficient(m: _Maker) -> Thunk:
    return _sdpa(m, "EFFICIENT_ATTENTION")


# TR131: embedding backward; the CUDA kernel differs for few (<= 3072) and many indices.


def _embedding(m: _Maker, count: int) -> Thunk:
    rows = m.size(1000, 50)
    idx = m.randint(0, rows, count)
    return m.grads(lambda w: F.embedding(idx, w), m.randn(rows, 64, grad=True))


@_case("TR131", "embedding backward, 2048 indices", "aten.embedding_dense_backward")
def _embedding_few(m: _Maker) -> Thunk:
    return _embedding(m, m.size(2048, 256))


@_case("TR131", "embedding backward, many indices", "aten.embedding_dense_backward")
def _embedding_many(m: _Maker) -> Thunk:
    return _embedding(m, m.n // 8)


# Ops the audit does not flag: expected to run under strict mode, without a warning, bit-equal.
# (A dense bmm is TR122's case whose condition is not met.)


@_case(None, "mm", "aten.mm")
def _mm(m: _Maker) -> Thunk:
    s = m.size(1024, 64)
    a, b = m.randn(s, s), m.randn(s, s)
    return lambda: a @ b


@_case(None, "addmm", "aten.addmm")
def _addmm(m: _Maker) -> Thunk:
    s = m.size(1024, 64)
    c, a, b = m.randn(s), m.randn(s, s), m.randn(s, s)
    return lambda: torch.addmm(c, a, b)


@_case(None, "linear forward and backward", "aten.addmm")
def _linear(m: _Maker) -> Thunk:
    x, w, b = m.randn(m.size(2048, 64), 512, grad=True), m.randn(512, 512, grad=True), m.randn(512, grad=True)
    return m.grads(F.linear, x, w, b, with_output=True)


@_case(None, "layer_norm forward and backward", "aten.native_layer_norm")
def _layer_norm(m: _Maker) -> Thunk:
    x = m.randn(m.size(4096, 64), 1024, grad=True)
    w, b = m.randn(1024, grad=True), m.randn(1024, grad=True)
    return m.grads(lambda x, w, b: F.layer_norm(x, (1024,), w, b), x, w, b, with_output=True)


@_case(None, "softmax forward and backward", "aten._softmax")
def _softmax(m: _Maker) -> Thunk:
    return m.grads(lambda x: F.softmax(x, -1), m.randn(m.size(4096, 64), 1024, grad=True), with_output=True)


@_case(None, "sum", "aten.sum")
def _sum(m: _Maker) -> Thunk:
    x = m.randn(4 * m.n)
    return lambda: x.sum()


@_case(None, "mean over a dim", "aten.mean")
def _mean(m: _Maker) -> Thunk:
    x = m.randn(64, m.n // 16)
    return lambda: x.mean(1)


@_case(None, "cross_entropy 2-d forward and backward", "aten.nll_loss_forward")
def _cross_entropy(m: _Maker) -> Thunk:
    target = m.randint(0, 1000, m.size(8192, 64))
    x = m.randn(target.numel(), 1000, grad=True)
    return m.grads(lambda x: F.cross_entropy(x, target), x, with_output=True)


@_case(None, "embedding forward", "aten.embedding")
def _embedding_forward(m: _Maker) -> Thunk:
    w, idx = m.randn(m.bins, 64), m.randint(0, m.bins, m.n // 16)
    return lambda: F.embedding(idx, w)


@_case(None, "gather forward", "aten.gather")
def _gather(m: _Maker) -> Thunk:
    x, idx = m.randn(m.bins, 8), m.randint(0, m.bins, m.n // 8, 8)
    return lambda: torch.gather(x, 0, idx)


@_case(None, "index_select forward", "aten.index_select")
def _index_select(m: _Maker) -> Thunk:
    x, idx = m.randn(m.bins, 16), m.randint(0, m.bins, m.n // 16)
    return lambda: torch.index_select(x, 0, idx)


@_case(None, "max_pool2d forward and backward", "aten.max_pool2d_with_indices_backward")
def _max_pool2d(m: _Maker) -> Thunk:
    s = m.size(64, 12)
    return m.grads(lambda x: F.max_pool2d(x, 3, stride=1), m.randn(8, 16, s, s, grad=True), with_output=True)


@_case(None, "relu", "aten.relu")
def _relu(m: _Maker) -> Thunk:
    x = m.randn(m.n)
    return lambda: F.relu(x)


@_case(None, "gelu", "aten.gelu")
def _gelu(m: _Maker) -> Thunk:
    x = m.randn(m.n)
    return lambda: F.gelu(x)


@_case(None, "sdpa forward (math)", "aten._scaled_dot_product_attention_math")
def _sdpa_math(m: _Maker) -> Thunk:
    return _sdpa(m, "MATH", backward=False)


@_case(None, "dropout (seeded)", "aten.native_dropout", note="the global RNG is seeded in a fork_rng")
def _dropout(m: _Maker) -> Thunk:
    x = m.randn(m.n)

    def thunk() -> Outputs:
        devices = [torch.cuda.current_device()] if x.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(1234)
            return F.dropout(x, 0.5, training=True)

    return thunk


@_case(
    "TR134",
    "nanmedian with dim (values and indices)",
    "aten.nanmedian.dim",
    note="not in torch's documentation; torch's CUDA median-with-indices kernel serves nanmedian too",
)
def _nanmedian_dim(m: _Maker) -> Thunk:
    x = _tied(m)
    return lambda: tuple(torch.nanmedian(x, dim=1))


# ---------------------------------------------------------------------------------------------
# Observing a case


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0][:300] if lines else ""


def _bits(out: Outputs) -> list[tuple[str, tuple[int, ...], Tensor]]:
    """Each output as (dtype, shape, its bytes on the CPU): compared bit for bit, NaNs included."""
    outs = out if isinstance(out, tuple) else (out,)
    return [
        (str(t.dtype), tuple(t.shape), t.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
        for t in outs
    ]


def _same_bits(
    a: list[tuple[str, tuple[int, ...], Tensor]], b: list[tuple[str, tuple[int, ...], Tensor]]
) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1] == y[1] and torch.equal(x[2], y[2]) for x, y in zip(a, b, strict=True)
    )


class _CaseError(Exception):
    """The case itself broke (not a determinism alert)."""


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _calls(
    case: Case, device: str, quick: bool, strict: bool, seen: list[str]
) -> tuple[str, str, bool | None]:
    """``CALLS`` calls of ``case`` with deterministic algorithms ``strict``: (outcome, message, equal bits).

    The outcome is ``raises`` (a determinism error on the first call; no bits then), ``warns`` (a
    warning about determinism) or ``runs``. Warnings are added to ``seen`` (first lines), never shown.
    """
    outputs: list[list[tuple[str, tuple[int, ...], Tensor]]] = []
    alert = ""
    seed = zlib.crc32(case.name.encode())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for call in range(CALLS):
                try:
                    thunk = case.build(_Maker(device, quick, seed))
                    _sync(device)
                except Exception as e:
                    raise _CaseError(f"building the inputs: {type(e).__name__}: {_first_line(str(e))}") from e
                torch.use_deterministic_algorithms(strict)
                try:
                    out = thunk()
                    _sync(device)
                except Exception as e:
                    if strict and call == 0 and _ALERT.search(str(e)):
                        alert = _first_line(str(e))
                        break
                    raise _CaseError(f"{type(e).__name__}: {_first_line(str(e))}") from e
                finally:
                    torch.use_deterministic_algorithms(False)
                outputs.append(_bits(out))
        finally:
            lines = [_first_line(str(w.message)) for w in caught]
            seen.extend(line for line in dict.fromkeys(lines) if line not in seen)
    if alert:
        return "raises", alert, None
    equal = all(_same_bits(outputs[0], o) for o in outputs[1:])
    warned = [line for line in lines if _ALERT.search(line)] if strict else []
    if warned:
        return "warns", warned[0], equal
    return "runs", "", equal


def observe(case: Case, device: str, quick: bool) -> dict[str, Any]:
    """One case's record (JSON values): strict mode's outcome and bits, and the bits with it off."""
    ran_on = "cpu" if case.cpu_only else device
    record: dict[str, Any] = {
        "code": case.code,
        "case": case.name,
        "op": case.op,
        "applies": case.applies,
        "direct": case.direct,
        "device": device,
        "ran_on": ran_on,
        "torch": torch.__version__,
        "outcome": "error",
        "message": "",
        "equal_bits": None,
        "equal_bits_off": None,
        "warnings": [],
        "calls": CALLS,
        "seconds": 0.0,
    }
    if case.note:
        record["note"] = case.note
    seen: list[str] = []
    start = time.perf_counter()
    try:
        outcome, message, equal = _calls(case, ran_on, quick, True, seen)
        _, _, equal_off = _calls(case, ran_on, quick, False, seen)
        record.update(outcome=outcome, message=message, equal_bits=equal, equal_bits_off=equal_off)
    except _CaseError as e:
        record["message"] = str(e)
    except Exception as e:  # anything else is this harness's fault, still only this case's row
        record["message"] = f"{type(e).__name__}: {_first_line(str(e))}"
    finally:
        torch.use_deterministic_algorithms(False)
    record["warnings"] = seen[:5]
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


# ---------------------------------------------------------------------------------------------
# Comparing with the table


@dataclasses.dataclass(frozen=True)
class Expectation:
    behaviour: str  # "raises" (strict mode raises), "deterministic" (runs, no warning, equal bits), or
    # "unguarded" (measured: runs under strict mode, bits may differ)
    why: str


# ops whose measured section a public function gets without calling the op ("via" in the table)
_MEASURED_VIA = {m["op"]: m["via"] for m in _table_data().get("measured", {}).get("ops", ()) if "via" in m}


def _entry_for(table: _OpTable, code: str, op: str) -> Entry | None:
    """The entry of ``code`` whose ops include ``op`` ("aten.name" or "aten.name.overload")."""
    parts = op.split(".")
    name, overload = ".".join(parts[:2]), (".".join(parts[2:]) or None)
    for entry in table.entries:
        if entry.code != code:
            continue
        for spec in entry.ops:
            if spec.name == name and (spec.overload is None or spec.overload == overload):
                return entry
    return None


def expectation(record: Mapping[str, Any], table: _OpTable) -> Expectation:
    """What the table claims for a recorded case under strict mode on CUDA."""
    code, op = record.get("code"), str(record.get("op"))
    if code is None:
        return Expectation("deterministic", "not in the op table: the audit reports nothing")
    if not record.get("applies", True):
        return Expectation("deterministic", f"{code}'s condition is not met: the audit reports nothing")
    via = _MEASURED_VIA.get(op)
    if record.get("direct") and via is not None:
        return Expectation("raises", f"the op itself ({via})")
    entry = _entry_for(table, str(code), op)
    if entry is None:
        return Expectation(
            "deterministic", f"{op} is not in {code}'s lists for this torch ({table.listed_in}): not reported"
        )
    if entry.section == "raises":
        return Expectation("raises", f"{code} is in the 'raises' list ({entry.listed_in})")
    if entry.section == "deterministic":
        return Expectation("deterministic", f"{code} is in the 'made deterministic' list ({entry.listed_in})")
    if entry.section == "unguarded":
        return Expectation("unguarded", f"{code}: strict mode does not stop it ({entry.listed_in})")
    return Expectation("deterministic", f"{code} (not in the documentation): {entry.why}")


@dataclasses.dataclass(frozen=True)
class Disagreement:
    code: str | None
    case: str
    op: str
    expected: str  # what the table claims: "raises" or "deterministic"
    observed: str  # "ran without raising", "raised", "warned", "unequal bits under strict mode"
    why: str  # where the expectation comes from
    torch: str
    message: str = ""  # the error or warning, first line

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return (
            f"{self.code or 'unflagged'} {self.case} ({self.op}): expected {self.expected} ({self.why}), "
            f"observed {self.observed} [torch {self.torch}]"
        )


def disagreements_of(record: Mapping[str, Any], table: _OpTable, torch_version: str) -> list[Disagreement]:
    """How one CUDA record disagrees with the table (empty: it agrees, or it was not comparable)."""
    outcome = record.get("outcome")
    if record.get("device") != "cuda" or outcome not in ("raises", "warns", "runs"):
        return []
    exp = expectation(record, table)
    observed: list[str] = []
    if exp.behaviour == "unguarded":  # runs under strict mode, bits may differ: only a raise disagrees
        if outcome == "raises":
            observed.append("raised (the table says strict mode does not stop it)")
    elif exp.behaviour == "raises":
        if outcome != "raises":
            bits = {True: "equal bits", False: "unequal bits", None: "bits not compared"}[
                record.get("equal_bits")
            ]
            observed.append(f"ran without raising{' (warned)' if outcome == 'warns' else ''}, {bits}")
    else:
        if outcome == "raises":
            observed.append("raised")
        elif outcome == "warns":
            observed.append("warned about determinism")
        if outcome != "raises" and record.get("equal_bits") is False:
            observed.append(f"unequal bits under strict mode ({record.get('calls', CALLS)} calls)")
    return [
        Disagreement(
            code=record.get("code"),
            case=str(record.get("case")),
            op=str(record.get("op")),
            expected=exp.behaviour,
            observed=o,
            why=exp.why,
            torch=torch_version,
            message=str(record.get("message", "")),
        )
        for o in observed
    ]


def compare(
    records: Iterable[Mapping[str, Any]], table: _OpTable, *, torch_version: str | None = None
) -> list[Disagreement]:
    """Every disagreement between ``table``'s claims and the CUDA records (pure; records as JSON).

    Compared: records of device ``cuda`` whose case ran or raised (``error`` records are the
    section's errors, not disagreements). An entry in ``raises`` that ran under strict mode; an
    entry strict mode makes deterministic, an unflagged op, or an entry's case whose condition is
    not met that raised, warned about determinism, or gave unequal bits under strict mode.
    ``torch_version`` defaults to each record's ``torch``, else the installed torch's.
    """
    out: list[Disagreement] = []
    for record in records:
        version = torch_version or str(record.get("torch") or torch.__version__)
        out += disagreements_of(record, table, version)
    return out


# ---------------------------------------------------------------------------------------------
# The section


def _describe(record: Mapping[str, Any], exp: Expectation) -> str:
    if record["outcome"] == "error":
        return f"the case broke: {record['message']}"
    bits = {True: "equal bits", False: "UNEQUAL bits", None: "-"}
    strict = record["outcome"] if record["outcome"] != "runs" else f"runs, {bits[record['equal_bits']]}"
    off = {True: "equal bits", False: "unequal bits (nondeterministic here)", None: "-"}[
        record["equal_bits_off"]
    ]
    where = f" (ran on {record['ran_on']})" if record["ran_on"] != record["device"] else ""
    return f"strict: {strict}; off: {off}; table: {exp.behaviour} ({exp.why}){where}"


def _ensure_cublas_config() -> dict[str, Any]:
    """Set ``CUBLAS_WORKSPACE_CONFIG`` if absent (strict mode needs it for cuBLAS on CUDA)."""
    value = os.environ.get(CUBLAS_VAR)
    if value is not None:
        return {"value": value, "set_by": "the environment"}
    late = cuda_started()
    os.environ[CUBLAS_VAR] = CUBLAS_VALUE
    info: dict[str, Any] = {"value": CUBLAS_VALUE, "set_by": "this section"}
    if late:
        info["warning"] = "set after CUDA was initialised: cuBLAS may already use its default workspace"
    return info


def run(ctx: Context) -> list[Row]:
    flags = DeterminismFlags.capture()
    try:
        cublas = _ensure_cublas_config()
        table = load_table()
        records = [observe(case, ctx.device, ctx.quick) for case in CASES]
    finally:
        flags.restore()  # every switch, and CUBLAS_WORKSPACE_CONFIG unset again if it was
    about = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if ctx.cuda else None,
        "cublas_workspace_config": cublas,
        "flags": flags.to_dict(),
        # what the table's lists were read from: --from-json works the verdicts out anew with it
        "documentation": torch.use_deterministic_algorithms.__doc__,
    }
    return rows_of(records, table, ctx.device, about)


def rows_of(
    records: Sequence[Mapping[str, Any]], table: _OpTable, device: str, about: Mapping[str, Any] | None = None
) -> list[Row]:
    """The section's rows for its records: one per case, then the summary (``about`` joins its data).

    On ``cuda`` a case row passes when it agrees with the table and fails when it does not; on
    another device it is ``info``, and the summary says ``skip``. A broken case is ``error``.
    """
    about = dict(about or {})
    version = str(about.setdefault("torch", torch.__version__))
    cuda = device == "cuda"
    rows: list[Row] = []
    for record in records:
        exp = expectation(record, table)
        found = disagreements_of(record, table, version)
        if record["outcome"] == "error":
            status = "error"
        elif not cuda:
            status = "info"
        else:
            status = "fail" if found else "pass"
        detail = _describe(record, exp)
        if found:
            detail += "; DISAGREES: " + "; ".join(d.observed for d in found)
        check = f"{record['code'] or 'unflagged'} {record['case']}"
        rows.append(Row(NAME, check, status, detail, {**record, "expected": exp.behaviour, "why": exp.why}))
    found_all = compare(records, table, torch_version=version)
    errors = sum(r["outcome"] == "error" for r in records)
    summary = {
        **about,
        "device": device,
        "table": table.listed_in,
        "table_read": table.read,
        "cases": len(records),
        "errors": errors,
        "disagreements": [d.to_json() for d in found_all],
        "seconds": round(sum(float(r.get("seconds", 0.0)) for r in records), 3),
    }
    check = "op table agrees with this GPU"
    if not cuda:
        reason = (
            f"the table's claims are about CUDA: on {device} the {len(records)} cases ran and are "
            "recorded (rows 'info'), not compared"
        )
        rows.append(Row(NAME, check, "skip", reason, summary))
        return rows
    detail = (
        f"{len(found_all)} disagreement(s) among {len(records) - errors} compared cases, torch {version}, "
        f"CUDA {about.get('cuda')}, table from {table.listed_in}"
        + (f"; {errors} case(s) broke and were not compared" if errors else "")
    )
    if found_all:
        detail += ": " + "; ".join(str(d) for d in found_all)
    rows.append(Row(NAME, check, "fail" if found_all else "pass", detail, summary))
    return rows


def recheck(rows: Sequence[Row]) -> list[Row]:
    """This section's rows of a saved run, their verdicts worked out anew against this checkout's table.

    The table is rebuilt for the torch that ran them, from its documentation as saved in the
    summary row (else from torchrepro's copy for that release); a case still defined here takes
    the entry this checkout assigns it (its name is the key). Rows of other sections, and a
    saved run without this section's summary, come back unchanged.
    """
    mine = [r for r in rows if r.section == NAME]
    summaries = [r for r in mine if r.check == "op table agrees with this GPU"]
    if not summaries:
        return list(rows)
    about = dict(summaries[-1].data)
    derived = ("device", "table", "table_read", "cases", "errors", "disagreements", "seconds")
    device = str(about.get("device", "cuda"))
    for key in derived:
        about.pop(key, None)
    version, doc = str(about.get("torch") or torch.__version__), about.get("documentation")
    table = load_table(version, doc if isinstance(doc, str) else None)
    records = [
        {k: v for k, v in r.data.items() if k not in ("expected", "why")} for r in mine if "case" in r.data
    ]
    # a case keeps its name; which entry it exercises is this checkout's (an op moved to a new entry)
    cases = {c.name: c for c in CASES}
    for record in records:
        case = cases.get(str(record["case"]))
        if case is not None:
            record.update(code=case.code, applies=case.applies, direct=case.direct)
    fresh = rows_of(records, table, device, about)
    out: list[Row] = []
    for r in rows:
        if r.section != NAME or not ("case" in r.data or r in summaries):
            out.append(r)
        elif fresh:  # the recomputed rows, where the first of those they replace was
            out.extend(fresh)
            fresh = []
    return out
