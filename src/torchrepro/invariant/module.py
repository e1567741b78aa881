"""``InvariantDataParallel``: training whose bits do not depend on how the global batch is split.

Invariants:
- The result is a function of (seed, data, global batch size, micro-batch size): the same bits
  for any world size ``W`` dividing the micro-batch count ``V`` (``loader.micro_batches``),
  because nothing a rank computes depends on ``W``:
  - a micro-batch (the same samples on every ``W``, from ``SeededLoader(global_batch_size=...)``)
    runs forward with the global torch RNGs (CPU, and the CUDA devices holding parameters) seeded
    from ``derive_seed(seed, "forward", epoch, global batch, micro-batch, call)`` and put back
    afterwards: dropout is keyed by what it is for, never by a stream position;
  - its gradient is computed alone (``.grad`` is empty when its backward starts) and taken out of
    ``.grad`` when that backward ends (no copy: the tensors autograd made become the leaf);
  - the ``V`` gradients are summed in the canonical tree over the global micro-batch index
    (``tree``), within a rank and across ranks, then divided by ``V``: after a rank's last
    micro-batch of a global batch, ``.grad`` holds the global mean, the same bits on every rank
    and every ``W``;
  - only copies and elementwise ops stand between those sums and ``.grad``: a finished piece is
    copied into a flat buffer of its (dtype, device) group, from a pool kept between steps; the
    mean is written into the first piece's own tensors, never into a pooled buffer (``.grad``
    outlives the step);
  - BatchNorm running statistics are replayed in global micro-batch order (``norm``).
- A parameter that got no gradient in any micro-batch of the global batch (on any rank) keeps
  ``.grad`` None. Gradients left in ``.grad`` from before a global batch (no ``zero_grad``) are
  carried and added to its mean, the same way on every ``W``.
- Each micro-batch takes exactly one backward; forwards outside training (``eval()`` or
  ``torch.no_grad()``) are the module's own, unkeyed and unrecorded.
- Parameters and buffers are broadcast from rank 0 when the wrapper is built (as DDP does).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from torchrepro._runtime import process_group
from torchrepro.errors import InvariantTrainingError
from torchrepro.invariant.fsdp import ShardedReduction, fsdp_modules
from torchrepro.invariant.norm import NormStats, refused_modules
from torchrepro.invariant.tree import Accumulator, blocks, reduce_pieces
from torchrepro.seeding import derive_seed

__all__ = ["InvariantDataParallel"]


class _Group:
    """The parameters of one (dtype, device): what travels between ranks as one flat buffer.

    The flat buffers come from ``pool`` and go back to it after the reduction (kept between
    steps: a fresh gradient-sized buffer costs a page fault per page at its first touch)."""

    __slots__ = ("device", "dtype", "offsets", "params", "pool", "total")

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.offsets = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.total = total
        self.pool: list[torch.Tensor] = []

    def take(self, present: list[bool], start: int) -> list[torch.Tensor]:
        """The parameters' gradients, taken out of ``.grad`` (left None); zeros where None.
        ``present[start + i]`` notes which parameters had a gradient."""
        out = []
        for i, p in enumerate(self.params):
            grad = p.grad
            if grad is None:
                out.append(torch.zeros_like(p, memory_format=torch.contiguous_format))
                continue
            if grad.is_sparse:
                raise InvariantTrainingError(
                    "InvariantDataParallel does not take sparse gradients (nn.Embedding(sparse=True) "
                    "and the like); use dense gradients."
                )
            out.append(grad.detach())  # backward(create_graph=True): the values, not a graph
            present[start + i] = True
            p.grad = None
        return out

    def flatten(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """One flat buffer of ``grads`` (this group's), to send as one message: one of the pool's
        (zeroed when first made: the op tracer takes untouched memory for uninitialised)."""
        flat = self.pool.pop() if self.pool else torch.zeros(self.total, dtype=self.dtype, device=self.device)
        return torch.cat([g.reshape(-1) for g in grads], out=flat)

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [
            flat[offset : offset + p.numel()].view_as(p)
            for p, offset in zip(self.params, self.offsets, strict=True)
        ]


class InvariantDataParallel(nn.Module):
    """Data parallel training whose bits do not depend on the world size: use it instead of DDP.

    ``loader`` is the ``SeededLoader(..., global_batch_size=G)`` the training loop iterates; each
    rank gets its contiguous block of ``loader.accumulation_steps`` micro-batches of every global
    batch. Call the wrapper on each micro-batch, take the micro-batch's mean loss and call
    ``backward()`` once; after the rank's last micro-batch of a global batch, every parameter's
    ``.grad`` holds the mean gradient of the whole global batch, the same bits on every rank and
    for every world size dividing ``loader.micro_batches``::

        loader = torchrepro.SeededLoader(ds, batch_size=8, global_batch_size=96, seed=0)
        model = torchrepro.InvariantDataParallel(net, loader)
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                loss_fn(model(x), y).backward()
                if (i + 1) % loader.accumulation_steps == 0:
                    opt.step(); opt.zero_grad()

    Works without a process group (world size 1) and with any ``torch.distributed`` backend;
    ``process_group`` picks a group other than the default one. Forward randomness is keyed by
    (seed, epoch, global batch, micro-batch) on the global torch RNGs (draw it there: dropout
    does); the global RNG states are put back after each forward. Checkpoints taken at a global
    batch boundary (after the optimizer step) resume on another world size.
    """

    # Negative controls for the tests (never set them in training): forwards drawing from the
    # global RNG streams instead of keyed ones; a rank-sequential sum and an all-reduce instead of
    # the canonical tree.
    _keyed = True
    _plain_sum = False

    def __init__(self, module: nn.Module, loader: Any, *, process_group: Any = None) -> None:
        super().__init__()
        from torchrepro.data.loader import SeededLoader

        if not isinstance(module, nn.Module):
            raise TypeError(f"InvariantDataParallel wraps an nn.Module, got {type(module).__name__}.")
        if not isinstance(loader, SeededLoader) or loader.global_batch_size is None:
            raise InvariantTrainingError(
                "InvariantDataParallel needs the loader the training loop iterates, a "
                "torchrepro.SeededLoader built with global_batch_size= (batch_size is then the "
                f"micro-batch size); got {type(loader).__name__}"
                + (" without global_batch_size" if isinstance(loader, SeededLoader) else "")
                + "."
            )
        refused = refused_modules(module)
        if refused:
            raise InvariantTrainingError(
                "InvariantDataParallel cannot order the state of these modules by global micro-batch, "
                "so the result would depend on the world size: " + "; ".join(refused) + "."
            )
        self.module = module
        self._loader = loader
        self._group = process_group
        rank, world = self._rank_world()
        loader_rank, loader_world = process_group_of(loader)
        if (loader_rank, loader_world) != (rank, world):
            raise InvariantTrainingError(
                f"The loader shards for rank {loader_rank} of {loader_world}, but this process is rank "
                f"{rank} of {world}"
                + (" (no process group is initialised)" if world == 1 else "")
                + ": build the loader without rank=/world_size= (it reads torch.distributed), after "
                "init_process_group."
            )
        loader.accumulation_steps  # noqa: B018 - raises naming the world sizes that work
        params = [p for p in module.parameters() if p.requires_grad]
        self._params = params
        self._devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
        # FSDP2: the reduction runs inside FSDP2's own (``fsdp``); otherwise over flat groups
        self._sharded = ShardedReduction(module, world, process_group) if fsdp_modules(module) else None
        keyed: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in params if self._sharded is None else []:
            keyed.setdefault((p.dtype, p.device), []).append(p)
        self._groups = [_Group(ps) for ps in keyed.values()]
        self._starts = list(itertools.accumulate([len(g.params) for g in self._groups], initial=0))[:-1]
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
            for p in params
        ]
        self._norms = NormStats(module)
        self._current: tuple[int, int] | None = None  # (epoch, local micro-batch) of the last forward
        self._calls = 0
        self._backward_done = True
        self._queued = False
        self._acc: Accumulator | None = None
        self._present: list[bool] = []
        self._carry: dict[nn.Parameter, torch.Tensor] = {}
        self.peak_buffers = 0  # the most partial-sum buffers held at once (memory report)
        if world > 1:
            self._broadcast_state()

    # -- shape ------------------------------------------------------------------------------

    def _rank_world(self) -> tuple[int, int]:
        if self._group is None:
            return process_group()
        import torch.distributed as dist

        return int(dist.get_rank(self._group)), int(dist.get_world_size(self._group))

    def _broadcast_state(self) -> None:
        import torch.distributed as dist

        from torchrepro.invariant.tree import _global

        src = _global(0, self._group)
        # FSDP2 shards each rank's own parameters (seed their construction alike): buffers only
        params = [] if self._sharded is not None else list(self.module.parameters())
        with torch.no_grad():
            for tensor in [*params, *self.module.buffers()]:
                comm = _to_comm(tensor, self._group)
                dist.broadcast(comm, src=src, group=self._group)
                if comm is not tensor:
                    tensor.copy_(comm)

    # -- forward ----------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.module(*args, **kwargs)
        sampler = self._loader._seeded_sampler
        epoch, received = sampler.epoch, sampler.batches
        if received < 1:
            raise InvariantTrainingError(
                "InvariantDataParallel was called in training before its loader delivered a micro-batch: "
                "call it on the batches of the loader it was built with, inside the loop over it."
            )
        position = (epoch, received - 1)
        if position != self._current:
            self._begin_micro_batch(position)
        rank = self._rank_world()[0]
        a = self._loader.accumulation_steps
        g, within = divmod(position[1], a)
        key = derive_seed(self._loader.seed, "forward", epoch, g, rank * a + within, self._calls)
        self._calls += 1
        with _KeyedRng(key if self._keyed else None, self._devices):
            self._norms.active = True
            try:
                return self.module(*args, **kwargs)
            finally:
                self._norms.active = False

    def _begin_micro_batch(self, position: tuple[int, int]) -> None:
        a = self._loader.accumulation_steps
        k = position[1]
        first = k % a == 0
        if not self._backward_done and self._current is not None:
            raise InvariantTrainingError(
                f"InvariantDataParallel: micro-batch {self._current[1]} of epoch {self._current[0]} had a "
                "forward but no backward before the next micro-batch; each micro-batch needs exactly one "
                "backward (its gradient is one leaf of the global batch's sum)."
            )
        if first:
            incomplete = self._sharded.incomplete() if self._sharded is not None else None
            if incomplete or (self._acc is not None and not self._acc.complete()):
                raise InvariantTrainingError(
                    "InvariantDataParallel: a global batch ended before all of this rank's "
                    f"{a} micro-batches had their backward; iterate every micro-batch of the loader."
                )
            rank, world = self._rank_world()
            v = self._loader.micro_batches
            block = blocks(v, world)[rank]
            if self._sharded is not None:
                self._sharded.begin_global_batch(v, a)
            else:
                self._acc = _Sequential(block) if self._plain_sum else Accumulator(block, v, _add_lists)
            self._present = [False] * sum(len(grp.params) for grp in self._groups)
            self._carry = {p: p.grad.detach() for p in self._params if p.grad is not None}
            for p in self._carry:
                p.grad = None
            self._norms.begin_global_batch()
        elif self._current is None or position != (self._current[0], self._current[1] + 1):
            raise InvariantTrainingError(
                f"InvariantDataParallel: micro-batch {k} of epoch {position[0]} follows "
                + ("no earlier micro-batch" if self._current is None else f"micro-batch {self._current[1]}")
                + " of its global batch; the rank's micro-batches of a global batch must each have a "
                "forward and backward, in order (resume only at a global batch boundary)."
            )
        self._current = position
        self._calls = 0
        self._backward_done = False
        if self._sharded is not None:
            self._sharded.begin_micro_batch(k % a)
        self._norms.begin_micro_batch(self._rank_world()[0] * a + k % a)

    # -- backward ---------------------------------------------------------------------------

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._sharded is not None and self._sharded.k < self._loader.accumulation_steps - 1:
            param.grad = None  # the zeros FSDP2 attached before the last micro-batch: freed now
        if self._queued:
            return
        if self._current is None or self._backward_done:
            raise InvariantTrainingError(
                "InvariantDataParallel: a backward ran with no micro-batch forward waiting for it"
                + (
                    " (a second backward for one micro-batch: sum the losses and call backward once)"
                    if self._current is not None
                    else " (call the wrapper, not the wrapped module, on each micro-batch)"
                )
                + "."
            )
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._queued = False
        self._backward_done = True
        assert self._current is not None
        a = self._loader.accumulation_steps
        rank, world = self._rank_world()
        k = self._current[1]
        if self._sharded is not None:  # FSDP2 ran the reduction; .grad holds the mean after the last
            self._sharded.end_micro_batch()
            self.peak_buffers = max(self.peak_buffers, self._sharded.peak)
            self._norms.end_micro_batch()
            if k % a == a - 1:  # before, _on_grad dropped the zeros FSDP2 attached
                for p, carried in self._carry.items():
                    p.grad = carried if p.grad is None else carried + p.grad
                self._carry = {}
                self._finish_norms(world)
            return
        assert self._acc is not None
        j = rank * a + k % a
        leaf: list[torch.Tensor] = []
        for grp, start in zip(self._groups, self._starts, strict=True):
            leaf += grp.take(self._present, start)
        self._norms.end_micro_batch()
        self._acc.push(j, leaf)
        self.peak_buffers = max(self.peak_buffers, self._acc.peak)
        if k % a == a - 1:
            self._reduce(rank, world)

    def _reduce(self, rank: int, world: int) -> None:
        assert self._acc is not None
        v = self._loader.micro_batches
        pieces = self._acc.done()
        present = torch.tensor(self._present, dtype=torch.uint8)
        if world > 1:
            import torch.distributed as dist

            comm = _to_comm(present, self._group)
            dist.all_reduce(comm, op=dist.ReduceOp.MAX, group=self._group)
            present = comm.cpu()
        if world == 1 and not self._plain_sum:
            (root,) = pieces.values()
            torch._foreach_div_(root, v)
        else:
            root = []
            for grp, start in zip(self._groups, self._starts, strict=True):
                end = start + len(grp.params)
                kept = {node: grp.flatten(vals[start:end]) for node, vals in pieces.items()}
                mine = {node: _to_comm(flat, self._group) for node, flat in kept.items()}
                if self._plain_sum:
                    flat = _all_reduce_sum(mine, world, self._group)
                else:
                    flat = reduce_pieces(mine, v, world, rank, self._group)
                flat = flat.to(grp.device)
                if any(flat is t for t in kept.values()):  # the pool's: the mean goes elsewhere
                    # into the first piece's tensors, free once flattened (autograd made them:
                    # their memory is touched already), elementwise
                    outs = next(iter(pieces.values()))[start:end]
                    root += [
                        _div(region, v, out) for region, out in zip(grp.unflatten(flat), outs, strict=True)
                    ]
                else:  # a copy the backend needed: free to write
                    root += grp.unflatten(flat.div_(v))
                grp.pool.extend(kept.values())
        params = [p for grp in self._groups for p in grp.params]
        for n, (p, grad) in enumerate(zip(params, root, strict=True)):
            if present[n]:
                carried = self._carry.get(p)
                p.grad = grad if carried is None else carried + grad
        self._carry = {}
        self._finish_norms(world)
        self._acc = None

    def _finish_norms(self, world: int) -> None:
        """The global batch's BatchNorm statistics replayed in global order; other buffers still."""
        if self._norms:
            rows = self._norms.local_rows()
            if world > 1:
                import torch.distributed as dist

                comm = _to_comm(rows, self._group)
                gathered = [torch.empty_like(comm) for _ in range(world)]
                dist.all_gather(gathered, comm, group=self._group)
                rows = torch.cat([t.cpu() for t in gathered])
            self._norms.replay(rows)
        self._norms.check_still()


class _Sequential(Accumulator):
    """Negative control: the block's leaves summed one after another (not the canonical tree)."""

    def __init__(self, block: tuple[int, int]) -> None:
        super().__init__(block, block[1], _add_lists)

    def push(self, j: int, value: Any) -> None:
        if self._stack:
            self._stack[0] = (self.block, _add_lists(self._stack[0][1], value))
        else:
            self._stack.append((self.block, value))
        self._expected += 1
        self.peak = 1


def _all_reduce_sum(mine: dict[Any, torch.Tensor], world: int, group: Any) -> torch.Tensor:
    """Negative control: each rank's sum, all-reduced by the backend in its own order."""
    (total,) = mine.values()
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(total, group=group)
    return total


def process_group_of(loader: Any) -> tuple[int, int]:
    """The ``(rank, world size)`` the loader shards for now."""
    return process_group(loader._seeded_sampler.fixed_shard)


def _add_lists(left: list[torch.Tensor], right: list[torch.Tensor]) -> list[torch.Tensor]:
    torch._foreach_add_(left, right)  # elementwise, one kernel per tensor: the bits of left + right
    return left


def _div(flat: torch.Tensor, v: int, out: torch.Tensor) -> torch.Tensor:
    """``flat / v`` into ``out`` when it can hold it, else into a new tensor (the same bits)."""
    if out.dtype == flat.dtype and out.layout == torch.strided and out.device == flat.device:
        return torch.div(flat, v, out=out)
    return torch.div(flat, v)


def _to_comm(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` on the device the group's backend communicates from (NCCL: the current CUDA
    device; otherwise where it is, CUDA tensors going through the CPU for gloo)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return tensor
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        return tensor if tensor.is_cuda else tensor.cuda()
    return tensor.cpu() if tensor.is_cuda else tensor


class _KeyedRng:
    """Seeds the global torch RNGs (CPU and the given CUDA devices) with ``key``; puts them back."""

    def __init__(self, key: int | None, cuda_devices: list[int]) -> None:
        self.key = key
        self.devices = cuda_devices
        self.saved: list[tuple[torch.Generator, torch.Tensor]] = []

    def __enter__(self) -> None:
        if self.key is None:
            return
        generators = [torch.default_generator]
        if self.devices:
            generators += [torch.cuda.default_generators[d] for d in self.devices]
        for gen in generators:
            self.saved.append((gen, gen.get_state()))
            gen.manual_seed(self.key)

    def __exit__(self, *exc: object) -> None:
        for gen, state in self.saved:
            gen.set_state(state)
        self.saved = []
