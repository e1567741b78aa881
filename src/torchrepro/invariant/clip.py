"""``clip_grad_norm_``: gradient clipping whose total norm has the same bits for any sharding.

Invariants:
- The total is one function of the gradients' values, shapes and order: each gradient is viewed
  as rows along dim 0 (a 1-D tensor: one element a row; 0-dim: one row of one element); a row's
  sum of ``|g|^p`` is a fixed pairwise halving of elementwise adds (``pairwise``); a parameter's
  row sums, then the parameters' sums in the order given, are halved the same way; then
  ``^(1/p)``. Row sums run in float32 (float64 for float64 gradients), the sums above them in
  float32 (float64 when any gradient is); ``p = inf`` takes maxima instead of sums.
- Only elementwise ops touch the values, so no bit depends on the thread count, on how many rows
  a process holds, or on which process computes a row (``row_sums`` of a gradient's row blocks,
  concatenated, are its ``row_sums``). ``|g|^p`` is exact for ``p`` in 1, 2 and inf; any other
  ``p`` is one ``pow`` per element, run through torch's scalar kernel for every element (on a
  strided copy: a contiguous CPU ``pow`` computes a vector's tail with another kernel).
- A DTensor gradient placed ``Shard(0)`` on a 1-D mesh (FSDP2's ``fully_shard``) gives its local
  rows; the row sums of all such gradients travel in one all-gather with each rank's row counts
  (``_gather_rows``, the only collective), so every rank holds every parameter's full row sums
  and computes the same total. Plain tensors and ``Replicate()`` need none; others are refused.
- The scaling is torch's: ``clamp(max_norm / (total + 1e-6), max=1.0)`` in the dtype torch's
  total has, multiplied in place into each gradient (a DTensor's local shard) with
  ``torch._foreach_mul_`` per device and dtype, as ``torch.nn.utils.clip_grad_norm_`` does.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

import torch

from torchrepro.errors import InvariantTrainingError

__all__ = ["clip_grad_norm_", "pairwise", "row_sums"]

BLOCK = 1 << 22
"""Elements of ``|g|^p`` computed at once: a buffer reused block after block stays in cache."""

Combine = Callable[..., torch.Tensor]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the gradients' total norm like ``torch.nn.utils.clip_grad_norm_``, summed in one
    order that does not depend on sharding, world size or thread count.

    ``parameters`` is a tensor or an iterable of tensors (plain, or DTensors as FSDP2's
    ``fully_shard`` makes them); parameters whose ``.grad`` is None are skipped. Returns the
    ``norm_type`` norm of all gradients seen as one vector, a plain 0-dim tensor with the same
    bits on every rank, and scales every gradient in place by
    ``clamp(max_norm / (total + 1e-6), max=1.0)``. The total has the same bits for the same
    gradients held whole on one process, replicated (DDP) or sharded along dim 0 on any number of
    ranks; every rank must call it with the same parameters (one all-gather when some gradients
    are sharded).

    Each gradient's rows along dim 0 are summed (``|g|^p``, in float32, float64 for float64
    gradients) by a fixed pairwise halving of elementwise adds, then each parameter's row sums,
    then the parameters' sums in the order given; ``norm_type=float('inf')`` takes the maximum.

    >>> import torch
    >>> w = torch.zeros(3, 4, requires_grad=True)
    >>> w.grad = torch.full((3, 4), 2.0)
    >>> clip_grad_norm_([w], max_norm=1.0)
    tensor(6.9282)
    >>> round(float(torch.linalg.vector_norm(w.grad)), 4)
    1.0

    Raises ``InvariantTrainingError`` (a ``RuntimeError``) with ``error_if_nonfinite=True`` when
    the total is nan or inf, or when a DTensor gradient is placed other than ``Shard(0)`` on a
    1-D mesh or ``Replicate()``; ``ValueError``/``TypeError`` for a negative ``max_norm``, a
    ``norm_type`` that is not positive, and sparse or complex gradients.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    max_norm, p = _validated(max_norm, norm_type)
    grads = [(i, param.grad) for i, param in enumerate(params) if param.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    dtensor = sys.modules.get("torch.distributed.tensor")  # loaded wherever a DTensor exists
    entries = [_entry(i, grad, dtensor) for i, grad in grads]
    with torch.no_grad():
        sums = _parameter_sums(entries, p)
        total = _root(pairwise(sums.view(1, -1).clone(), _combiner(p))[0], p)
        total = total.to(reduce(torch.promote_types, (e.local.dtype for e in entries)))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            bad = torch.nonzero(~torch.isfinite(sums)).view(-1).tolist()
            where = (
                f"parameter {entries[bad[0]].index}'s gradient is the first" if bad else "the sum overflows"
            )
            raise InvariantTrainingError(
                f"clip_grad_norm_: the total norm of order {p} of the gradients is {total.item()} "
                f"({where}), so it cannot be clipped; pass error_if_nonfinite=False to scale the "
                "gradients by it anyway, or skip the step."
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        _scale([e.local for e in entries], coef)
    return total


@dataclass(frozen=True)
class _Entry:
    """A gradient as this process holds it: ``local`` rows of a tensor of ``rows`` rows, sharded
    along dim 0 on ``mesh`` (None: the whole tensor is here)."""

    index: int
    local: torch.Tensor
    rows: int
    mesh: Any = None


def _number(value: object, name: str, expected: str) -> float:
    """``float(value)``; its ``TypeError`` or ``ValueError`` (``float("fro")``) says what to pass."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as error:
        raise type(error)(f"clip_grad_norm_: {name} must be {expected}, got {value!r}.") from None


def _validated(max_norm: float, norm_type: float) -> tuple[float, float]:
    p = _number(norm_type, "norm_type", "a positive number or float('inf') (2.0: the Euclidean norm)")
    if not p > 0:
        raise ValueError(
            f"clip_grad_norm_: norm_type must be positive (a p-norm, p > 0, or float('inf')), got {p}; "
            "use 2.0 for the Euclidean norm."
        )
    limit = _number(max_norm, "max_norm", "a number, the largest total gradient norm to allow (e.g. 1.0)")
    if not limit >= 0:
        raise ValueError(
            f"clip_grad_norm_: max_norm must be >= 0, got {limit}; pass the largest total gradient "
            "norm to allow, for example 1.0."
        )
    return limit, p


def _entry(index: int, grad: torch.Tensor, dtensor: Any) -> _Entry:
    """How parameter ``index``'s gradient is held (refusing layouts the canonical sum cannot take)."""
    if grad.layout != torch.strided:
        raise TypeError(
            f"clip_grad_norm_: parameter {index}'s gradient is {grad.layout} (a sparse gradient); it "
            "sums dense gradients only: build the layer with sparse=False (nn.Embedding) or clip "
            "grad.to_dense()."
        )
    if grad.is_complex() or not grad.is_floating_point():
        raise TypeError(
            f"clip_grad_norm_: parameter {index}'s gradient is {grad.dtype}; it sums real floating "
            "point gradients only (float16, bfloat16, float32, float64)."
        )
    if dtensor is None or not isinstance(grad, dtensor.DTensor):
        return _Entry(index, grad, _rows_and_width(grad)[0])
    mesh, placements = grad.device_mesh, tuple(grad.placements)
    local = grad.to_local()
    if all(isinstance(pl, dtensor.Replicate) for pl in placements):
        return _Entry(index, local, _rows_and_width(local)[0])
    if mesh.ndim == 1 and type(placements[0]) is dtensor.Shard and placements[0].dim == 0:
        return _Entry(index, local, int(grad.shape[0]), mesh)
    raise InvariantTrainingError(
        f"clip_grad_norm_: parameter {index}'s gradient is a DTensor placed {placements} on a "
        f"{mesh.ndim}-D mesh; the canonical sum takes Shard(0) on a 1-D mesh (FSDP2's fully_shard) "
        "or Replicate(): redistribute the gradient to one of these (grad.redistribute(mesh, "
        "[Replicate()]) after reducing a Partial one) before clipping."
    )


def _rows_and_width(t: torch.Tensor) -> tuple[int, int]:
    """``t`` as rows along dim 0: (rows, elements per row); a 0-dim tensor is one row of one."""
    if t.dim() == 0:
        return 1, 1
    return int(t.shape[0]), math.prod(int(s) for s in t.shape[1:])


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def pairwise(x: torch.Tensor, combine: Combine = torch.add) -> torch.Tensor:
    """Reduce each row of ``x`` (rows, K) by the fixed pairwise halving; ``x`` is overwritten.

    While K > 1: ``h = K // 2``; the row becomes ``combine(x[:, :h], x[:, h:2h])`` followed, when
    K is odd, by ``x[:, 2h]``. Returns the (rows,) results, a view into ``x`` (zeros when K is 0).
    ``combine`` is an elementwise ``torch.add`` or ``torch.maximum`` (with ``out=``).
    """
    rows, k = x.shape
    if k == 0:
        return x.new_zeros(rows)
    while k > 1:
        h = k // 2
        left = x[:, :h]
        combine(left, x[:, h : 2 * h], out=left)
        if k % 2:
            x[:, h].copy_(x[:, 2 * h])
            k = h + 1
        else:
            k = h
        x = x[:, :k]
    return x[:, 0]


class _Scratch:
    """Buffers of one dtype and device reused block after block (their pages touched once)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._flat = torch.empty(0, dtype=dtype, device=device)
        self._wide = torch.empty(0, dtype=dtype, device=device)

    def rows(self, rows: int, k: int) -> torch.Tensor:
        if self._flat.numel() < rows * k:
            self._flat = torch.empty(rows * k, dtype=self.dtype, device=self.device)
        return self._flat[: rows * k].view(rows, k)

    def strided(self, rows: int, k: int) -> torch.Tensor:
        """A (rows, k) view with gaps: elementwise kernels take their scalar path on every element."""
        if self._wide.numel() < 2 * rows * k:
            self._wide = torch.empty(2 * rows * k, dtype=self.dtype, device=self.device)
        return self._wide[: 2 * rows * k : 2].view(rows, k)


def _powers(parts: list[torch.Tensor], out: torch.Tensor, p: float, scratch: _Scratch) -> None:
    """``|g|^p`` of ``parts`` (stacked along rows) into ``out`` (rows, K), the accumulation dtype."""
    exact = p in (1.0, 2.0, math.inf)
    if exact and len(parts) == 1 and parts[0].dtype == out.dtype:  # one pass, no copy
        (x,) = parts
        if p == 2:
            torch.mul(x, x, out=out)
        else:
            torch.abs(x, out=out)
        return
    if len(parts) == 1:
        out.copy_(parts[0])
    else:
        torch.cat(parts, out=out)
    if p == 2:
        out.mul_(out)
    elif exact:
        out.abs_()
    else:
        gapped = scratch.strided(*out.shape)
        torch.abs(out, out=gapped)
        torch.pow(gapped, p, out=out)


def _combiner(p: float) -> Combine:
    return torch.maximum if p == math.inf else torch.add


def _root(total: torch.Tensor, p: float) -> torch.Tensor:
    if p == 2:
        return total.sqrt()
    if p in (1.0, math.inf):
        return total.clone()
    return total.pow(1.0 / p)


def _reduced(parts: list[torch.Tensor], p: float, scratch: _Scratch) -> torch.Tensor:
    """The rows of ``parts`` (each (rows, K), one K) reduced: a fresh (rows,) tensor."""
    x = scratch.rows(sum(int(part.shape[0]) for part in parts), int(parts[0].shape[1]))
    _powers(parts, x, p, scratch)
    return pairwise(x, _combiner(p)).clone()


Segment = tuple[torch.Tensor, list[tuple[int, int]]]
"""Row sums of several tensors in one vector, and where each tensor's start: ``(i, start)``."""


def _row_segments(tensors: Sequence[torch.Tensor], p: float) -> list[Segment]:
    """The row sums of ``tensors`` (see ``row_sums``), as few vectors as possible."""
    out: list[Segment] = []
    groups: dict[tuple[int, torch.dtype, torch.device], list[int]] = {}
    scratches: dict[tuple[torch.dtype, torch.device], _Scratch] = {}
    for i, t in enumerate(tensors):
        rows, k = _rows_and_width(t)
        if rows == 0 or k == 0:
            out.append((torch.zeros(rows, dtype=_accumulation(t.dtype), device=t.device), [(i, 0)]))
        else:
            groups.setdefault((k, t.dtype, t.device), []).append(i)
    for (k, dtype, device), members in groups.items():
        acc = _accumulation(dtype)
        scratch = scratches.get((acc, device)) or scratches.setdefault((acc, device), _Scratch(acc, device))
        per_block = max(1, BLOCK // k)
        batch: list[torch.Tensor] = []
        starts: list[tuple[int, int]] = []
        filled = 0
        for i in members:
            x = tensors[i].reshape(-1, k)
            rows = int(x.shape[0])
            if rows >= per_block:  # alone, block by block
                blocks = [_reduced([x[a : a + per_block]], p, scratch) for a in range(0, rows, per_block)]
                out.append((torch.cat(blocks) if len(blocks) > 1 else blocks[0], [(i, 0)]))
                continue
            if filled + rows > per_block:
                out.append((_reduced(batch, p, scratch), starts))
                batch, starts, filled = [], [], 0
            batch.append(x)
            starts.append((i, filled))
            filled += rows
        if batch:
            out.append((_reduced(batch, p, scratch), starts))
    return out


def row_sums(tensors: Sequence[torch.Tensor], p: float) -> list[torch.Tensor]:
    """Each tensor's rows along dim 0 reduced: the sum of ``|g|^p`` (the maximum of ``|g|`` for
    ``p = inf``) by ``pairwise``, in the accumulation dtype, on the tensor's device.

    Rows are independent: the row sums of a tensor's row blocks, concatenated, are the tensor's
    row sums, bit for bit. Small tensors of one row width, dtype and device are reduced together
    (up to ``BLOCK`` elements at once); a large one alone, ``BLOCK`` elements at a time.
    """
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for vector, starts in _row_segments(tensors, p):
        for i, start in starts:
            out[i] = vector[start : start + _rows_and_width(tensors[i])[0]]
    return out


def _parameter_sums(entries: list[_Entry], p: float) -> torch.Tensor:
    """Each parameter's reduction: its full row sums halved as (1, R); one vector, in float32
    (float64 when a gradient is float64), on the first gradient's device.

    All row sums lie in one vector (``rows``, each parameter's at ``offsets[j]``); parameters with
    as many rows are halved together, their rows picked from it by one index."""
    device = entries[0].local.device
    dtype = torch.float64 if any(e.local.dtype == torch.float64 for e in entries) else torch.float32
    segments = _row_segments([e.local for e in entries], p)
    offsets = [0] * len(entries)
    base = 0
    for vector, starts in segments:
        for j, start in starts:
            offsets[j] = base + start
        base += vector.numel()
    rows = torch.cat([vector.to(device=device, dtype=dtype) for vector, _ in segments])
    sharded = [j for j, e in enumerate(entries) if e.mesh is not None]
    if sharded:
        local = [rows[offsets[j] : offsets[j] + int(entries[j].local.shape[0])] for j in sharded]
        gathered = _gather_rows([entries[j] for j in sharded], local)
        for j, full in zip(sharded, gathered, strict=True):
            offsets[j] = base
            base += full.numel()
        rows = torch.cat([rows, *(full.to(device=device, dtype=dtype) for full in gathered)])
    by_length: dict[int, list[int]] = {}
    for j, e in enumerate(entries):
        by_length.setdefault(e.rows, []).append(j)
    out = torch.empty(len(entries), dtype=dtype, device=device)
    for length, members in by_length.items():
        if len(members) == 1:
            (j,) = members
            block = rows[offsets[j] : offsets[j] + length].view(1, length).clone()
        else:
            first = torch.tensor([offsets[j] for j in members], device=device)
            index = (first.view(-1, 1) + torch.arange(length, device=device)).view(-1)
            block = rows.index_select(0, index).view(len(members), length)
        out[torch.tensor(members, device=device)] = pairwise(block, _combiner(p))
    return out


def _gather_rows(entries: list[_Entry], local: list[torch.Tensor]) -> list[torch.Tensor]:
    """The full row sums of parameters sharded along dim 0, from every rank's rows: one all-gather.

    Each rank sends, as float64 (exact for the float32 sums), its mesh coordinate, its row count of
    each parameter, then its row sums, padded to the parameters' total rows (a bound known to every
    rank); the counts are read, not assumed, and must add up to each parameter's rows.
    """
    import torch.distributed as dist

    mesh = entries[0].mesh
    for e in entries[1:]:
        if e.mesh != mesh:
            raise InvariantTrainingError(
                f"clip_grad_norm_: parameters {entries[0].index} and {e.index} are sharded on different "
                f"device meshes ({mesh} and {e.mesh}); the canonical sum gathers every sharded gradient's "
                "rows in one collective, on one mesh: shard all parameters on the same mesh."
            )
    n = len(entries)
    width = 1 + n + sum(e.rows for e in entries)
    kind = mesh.device_type
    device = (
        torch.device("cpu")
        if kind == "cpu"
        else torch.device(kind, torch.get_device_module(kind).current_device())
    )
    send = torch.zeros(width, dtype=torch.float64, device=device)
    send[0] = float(mesh.get_local_rank())
    send[1 : 1 + n] = torch.tensor([float(s.numel()) for s in local], dtype=torch.float64)
    values = sum(s.numel() for s in local)
    if values:
        torch.cat([s.to(device=device, dtype=torch.float64) for s in local], out=send[1 + n : 1 + n + values])
    world = mesh.size()
    received = torch.empty(world * width, dtype=torch.float64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in 2.13
    gather(received, send, group=mesh.get_group())
    table = received.view(world, width)
    head = table[:, : 1 + n].cpu().tolist()
    order = sorted(range(world), key=lambda r: head[r][0])
    if [int(head[r][0]) for r in order] != list(range(world)):
        raise InvariantTrainingError(
            f"clip_grad_norm_: the ranks of the mesh reported coordinates {[h[0] for h in head]}, not "
            f"0..{world - 1}; every rank of the mesh must call clip_grad_norm_ with the same parameters."
        )
    counts = [[int(c) for c in head[r][1:]] for r in order]  # [rank in mesh order][parameter]
    starts = [list(itertools.accumulate(row[:-1], initial=1 + n)) for row in counts]
    full: list[torch.Tensor] = []
    for j, e in enumerate(entries):
        if sum(row[j] for row in counts) != e.rows:
            raise InvariantTrainingError(
                f"clip_grad_norm_: parameter {e.index}'s gradient has {e.rows} rows, but the ranks hold "
                f"{[row[j] for row in counts]} of them (in mesh order); its shards must split dim 0 in "
                "contiguous blocks."
            )
        pieces = [table[r, starts[i][j] : starts[i][j] + counts[i][j]] for i, r in enumerate(order)]
        full.append(torch.cat(pieces).to(device=local[j].device, dtype=local[j].dtype))
    return full


def _scale(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """``grad *= coef`` in place, per (device, dtype) with ``torch._foreach_mul_`` as torch does."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), members in groups.items():
        factor = coef.to(device)
        if device.type in ("cpu", "cuda"):
            torch._foreach_mul_(members, factor)
        else:
            for g in members:
                g.mul_(factor)
