"""The canonical tree under FSDP2: every gradient shard ends as the shard of the unsharded mean.

Invariants:
- FSDP2 (``fully_shard``) reduces each parameter group's unsharded gradient once per backward:
  it copies the group's gradients into one flat buffer, ``W`` equal chunks, chunk ``j`` holding
  rank ``j``'s (padded) shards, and reduce-scatters it. Through FSDP2's own extension points
  (``set_custom_reduce_scatter``, ``set_all_reduce_hook``, a divide factor of 1 and sum-only
  reductions) that reduce-scatter becomes an all-to-all: rank ``j`` receives chunk ``j`` of every
  rank's micro-batch gradient, the same bytes a reduce-scatter moves, and sums nothing yet.
- Rank ``j`` evaluates the canonical tree (``tree``) for its chunk only: one ``Accumulator`` per
  rank block, fed the leaf ``s * A + k`` from rank ``s`` at local micro-batch ``k`` (ranks run their
  micro-batches in lockstep: FSDP2's collectives pair them), and after the last micro-batch the
  nodes above the blocks (``schedule``), then the mean (``/ V``) written where FSDP2 takes the
  reduced shard from. Every operation is elementwise, so each element has the bits of the
  unsharded ``InvariantDataParallel`` (and of one process), on any ``W`` dividing ``V``.
- Before the last micro-batch the reduced shard is zeros, and the wrapper's post-accumulate hook
  drops the ``.grad`` FSDP2 attaches from it at once: nothing FSDP2 accumulates reaches the mean.
- The sum runs in FSDP2's ``reduce_dtype`` (a ``MixedPrecisionPolicy``'s, else the gradient's).
- Memory per rank: the partial sums of ``W`` blocks of one shard each (``log2(A) + 1`` at most per
  block), the size of one unsharded gradient per level; never a full gradient per micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchrepro.errors import InvariantTrainingError
from torchrepro.invariant.tree import Accumulator, blocks, children, schedule


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """The submodules ``fully_shard`` was applied to (``module`` first when it is one)."""
    cls = _fsdp_module_class()
    if cls is None:
        return []
    return [m for m in module.modules() if isinstance(m, cls)]


def _fsdp_module_class() -> Any:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 kept it here
        try:
            from torch.distributed._composable.fsdp import (  # type: ignore[attr-defined,no-redef,unused-ignore]
                FSDPModule,
            )
        except ImportError:
            return None
    return FSDPModule


_EXTENSION_POINTS = (
    "set_custom_reduce_scatter",
    "set_all_reduce_hook",
    "set_gradient_divide_factor",
    "set_force_sum_reduction_for_comms",
    "set_reduce_scatter_unused_params",
)
"""What ``ShardedReduction`` sets on every ``fully_shard`` module with parameters."""


class _Slot:
    """One FSDP2 parameter group's side of the reduction: its all-to-all and its trees."""

    def __init__(self, owner: ShardedReduction, name: str) -> None:
        self.owner = owner
        self.name = name
        self.pending: torch.Tensor | None = None  # what the all-to-all brought (W > 1)
        self.accs: list[Accumulator] = []
        self.arrived = -1  # the local micro-batch whose leaves came last

    # FSDP2's ``ReduceScatter`` interface (duck-typed: ``allocate`` and ``__call__``)

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> None:
        """Chunk ``j`` of this rank's flat gradient to rank ``j``; chunk (this rank) of every rank's
        here, in rank order. Summed later (``arrive``), never by the backend."""
        import torch.distributed as dist

        received = torch.zeros_like(input_tensor)  # zeros: the op tracer would take an
        # untouched buffer for uninitialised memory
        dist.all_to_all_single(received, input_tensor, group=group)
        self.pending = received

    # FSDP2's post-reduce hook: sees the reduced shard (reduce_dtype) before FSDP2 views it as .grad

    def arrive(self, reduce_output: torch.Tensor) -> None:
        received = self.pending if self.pending is not None else reduce_output.clone()  # W == 1
        self.pending = None
        if received.is_cuda:
            received.record_stream(torch.cuda.current_stream(received.device))
        self.owner.push(self, received, reduce_output)


class ShardedReduction:
    """The reduction of ``InvariantDataParallel`` over an FSDP2 model (see the module docstring)."""

    def __init__(self, module: nn.Module, world: int, group: Any) -> None:
        roots = fsdp_modules(module)
        if not roots or roots[0] is not module:
            raise InvariantTrainingError(
                "InvariantDataParallel over FSDP2 needs fully_shard applied at the root too (after "
                "the blocks): fully_shard(block) for each block, then fully_shard(model), then "
                "InvariantDataParallel(model, loader)."
            )
        _check_meshes(module, world, group)
        self.world = world
        self.slots: list[_Slot] = []
        for fsdp in roots:
            if not _own_parameters(fsdp, roots):
                continue
            missing = [name for name in _EXTENSION_POINTS if not hasattr(fsdp, name)]
            if missing:
                raise InvariantTrainingError(
                    f"InvariantDataParallel over FSDP2 needs FSDPModule.{', .'.join(missing)}, which torch "
                    f"{torch.__version__} lacks: upgrade torch, or wrap the unsharded model."
                )
            slot = _Slot(self, _name_of(module, fsdp))
            points: Any = fsdp  # an FSDPModule (nn.Module's typing knows no methods of it)
            points.set_custom_reduce_scatter(slot)
            points.set_all_reduce_hook(slot.arrive)
            points.set_gradient_divide_factor(1.0)
            points.set_force_sum_reduction_for_comms(True)
            points.set_reduce_scatter_unused_params(True, recurse=False)  # a fixed flat layout
            self.slots.append(slot)
        self.v = 0
        self.a = 0
        self.k = 0
        self.peak = 0

    def begin_global_batch(self, v: int, a: int) -> None:
        self.v, self.a = v, a
        for slot in self.slots:
            slot.accs = [Accumulator(block, v) for block in blocks(v, self.world)]
            slot.arrived = -1

    def incomplete(self) -> bool:
        """A global batch began and not every group has its mean yet."""
        return any(slot.accs for slot in self.slots)

    def begin_micro_batch(self, k: int) -> None:
        self.k = k

    def push(self, slot: _Slot, received: torch.Tensor, reduce_output: torch.Tensor) -> None:
        if not slot.accs:
            raise InvariantTrainingError(
                f"InvariantDataParallel: FSDP2 reduced the gradients of {slot.name} outside a "
                "micro-batch of the wrapper; call the wrapper, not the FSDP module, in training."
            )
        if slot.arrived == self.k:
            raise InvariantTrainingError(
                f"InvariantDataParallel: the gradients of {slot.name} were reduced twice in micro-batch "
                f"{self.k}; each micro-batch needs exactly one backward (sum the losses)."
            )
        slot.arrived = self.k
        size = reduce_output.numel()
        for s, acc in enumerate(slot.accs):
            acc.push(s * self.a + self.k, received[s * size : (s + 1) * size])
        self.peak = max(self.peak, sum(len(acc._stack) for acc in slot.accs))
        if self.k < self.a - 1:
            reduce_output.zero_()
            return
        values: dict[tuple[int, int], torch.Tensor] = {}
        for acc in slot.accs:
            values.update(acc.done())
        for node, _, _ in schedule(self.v, self.world):
            left, right = children(node)
            values[node] = values.pop(left).add_(values.pop(right))
        torch.div(values.pop((0, self.v)), self.v, out=reduce_output)
        slot.accs = []

    def end_micro_batch(self) -> None:
        """After a micro-batch's backward: every group's leaves arrived (else the error names it)."""
        missing = [slot.name for slot in self.slots if slot.arrived != self.k]
        if missing:
            raise InvariantTrainingError(
                "InvariantDataParallel: FSDP2 reduced no gradient for "
                + ", ".join(missing)
                + f" in micro-batch {self.k}: every fully_shard module with parameters must take part "
                "in every micro-batch's forward and backward (FSDP2 pairs the ranks' collectives)."
            )


def _own_parameters(fsdp: nn.Module, roots: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters ``fsdp`` manages itself (not those of a nested ``fully_shard`` module)."""
    nested = {id(m) for m in roots if m is not fsdp}
    out: list[nn.Parameter] = []
    todo = [fsdp]
    while todo:
        m = todo.pop()
        out += [p for p in m.parameters(recurse=False) if p.requires_grad]
        todo += [c for c in m.children() if id(c) not in nested]
    return out


def _name_of(root: nn.Module, sub: nn.Module) -> str:
    for name, m in root.named_modules():
        if m is sub:
            return repr(name or "<root>")
    return type(sub).__name__


def _check_meshes(module: nn.Module, world: int, group: Any) -> None:
    """Every parameter a DTensor sharded ``Shard(0)`` over one mesh dimension, whose group is ours."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for name, p in module.named_parameters():
        if not isinstance(p, DTensor):
            raise InvariantTrainingError(
                f"InvariantDataParallel over FSDP2: parameter {name!r} is not sharded (not a DTensor); "
                "apply fully_shard to every block and to the root before wrapping."
            )
        mesh = p.device_mesh
        if mesh.ndim != 1:
            raise InvariantTrainingError(
                f"InvariantDataParallel over FSDP2: parameter {name!r} lives on a {mesh.ndim}-D mesh "
                f"({p.placements}); HSDP and tensor parallelism are not supported: shard over one "
                "mesh dimension (init_device_mesh(device, (world_size,)))."
            )
        ranks = list(dist.get_process_group_ranks(mesh.get_group()))
        ours = list(range(world)) if group is None else list(dist.get_process_group_ranks(group))
        if ranks != ours:
            raise InvariantTrainingError(
                f"InvariantDataParallel over FSDP2: parameter {name!r} is sharded over ranks {ranks}, "
                f"but the wrapper reduces over ranks {ours}; pass process_group= the group of the "
                "FSDP2 mesh."
            )
