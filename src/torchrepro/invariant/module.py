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
from torchrepro.invariant.norm import NormStats, refused_modules
from torchrepro.invariant.tree import Accumulator, blocks, reduce_pieces
from torchrepro.seeding import derive_seed

__all__ = ["InvariantDataParallel"]


class _Group:
    """The parameters of one (dtype, device): what travels between ranks as one flat buffer.

    A micro-batch's gradients and the partial sums of the tree are flat buffers of the group's
    size, taken from ``pool`` and given back once added into another (kept between steps: a
    fresh gradient-sized buffer costs a page fault per page at its first touch)."""

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

    def new_flat(self) -> torch.Tensor:
        """A flat buffer of the group's size, its contents stale (every slot is written before
        it is read). Zeroed when first made: the op tracer takes untouched memory for
        uninitialised and would not compare what a copy into a slice of it moves."""
        if self.pool:
            return self.pool.pop()
        return torch.zeros(self.total, dtype=self.dtype, device=self.device)

    def region(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s slot in ``flat``, shaped like it."""
        p = self.params[i]
        return flat[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [self.region(flat, i) for i in range(len(self.params))]


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
        keyed: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in params:
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
        self._outputs: dict[nn.Parameter, torch.Tensor] = {}  # where the global mean will go
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
        with torch.no_grad():
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
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
        with _KeyedRng(key if self._keyed else None, self._cuda_devices()):
            self._norms.active = True
            try:
                return self.module(*args, **kwargs)
            finally:
                self._norms.active = False

    def _cuda_devices(self) -> list[int]:
        return sorted({grp.device.index or 0 for grp in self._groups if grp.device.type == "cuda"})

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
            if self._acc is not None and not self._acc.complete():
                raise InvariantTrainingError(
                    "InvariantDataParallel: a global batch ended before all of this rank's "
                    f"{a} micro-batches had their backward; iterate every micro-batch of the loader."
                )
            rank, world = self._rank_world()
            v = self._loader.micro_batches
            block = blocks(v, world)[rank]
            self._acc = (
                _Sequential(block, self._add_flats)
                if self._plain_sum
                else Accumulator(block, v, self._add_flats)
            )
            self._present = [False] * sum(len(grp.params) for grp in self._groups)
            self._carry = {
                p: p.grad.detach() for grp in self._groups for p in grp.params if p.grad is not None
            }
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
        self._norms.begin_micro_batch(self._rank_world()[0] * a + k % a)

    # -- backward ---------------------------------------------------------------------------

    def _on_grad(self, param: torch.Tensor) -> None:
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
        assert self._current is not None and self._acc is not None
        a = self._loader.accumulation_steps
        rank, world = self._rank_world()
        k = self._current[1]
        j = rank * a + k % a
        # The leaf goes straight into the stack's top partial sum when it is that sum's right
        # sibling (``top.add_(leaf)`` parameter by parameter: elementwise, the bits of adding the
        # whole leaf afterwards), otherwise it is copied into flat buffers from the groups' pools.
        top = None if self._plain_sum else self._acc.top(j)
        leaf = top if top is not None else [grp.new_flat() for grp in self._groups]
        last = k % a == a - 1
        for grp, start, flat in zip(self._groups, self._starts, leaf, strict=True):
            self._take(grp, start, flat, into=top is not None, keep=self._outputs if last else None)
        self._norms.end_micro_batch()
        if top is not None:
            self._acc.pushed_into_top(j)
        else:
            self._acc.push(j, leaf)
        self.peak_buffers = max(self.peak_buffers, self._acc.peak)
        if k % a == a - 1:
            self._reduce(rank, world)

    def _take(
        self,
        grp: _Group,
        start: int,
        flat: torch.Tensor,
        *,
        into: bool,
        keep: dict[nn.Parameter, torch.Tensor] | None,
    ) -> None:
        """The group's gradients, taken out of ``.grad`` (left None) and copied into ``flat``, or
        added into it when ``into``; a parameter without a gradient counts as zeros (adding zeros
        is kept: ``-0.0 + 0.0`` is ``0.0``). ``self._present`` notes which had a gradient. With
        ``keep``, the tensors autograd made are kept there (their memory is touched already): the
        global mean is written into them (``_reduce``) instead of into fresh memory."""
        for i, p in enumerate(grp.params):
            region = grp.region(flat, i)
            grad = p.grad
            if grad is None:
                if into:
                    region.add_(torch.zeros_like(region))
                else:
                    region.zero_()
                continue
            if grad.is_sparse:
                raise InvariantTrainingError(
                    "InvariantDataParallel does not take sparse gradients (nn.Embedding(sparse=True) "
                    "and the like); use dense gradients."
                )
            grad = grad.detach()  # backward(create_graph=True): the values, not a graph through the pool
            if into:
                region.add_(grad)
            else:
                region.copy_(grad)
            if keep is not None and grad.layout == torch.strided and grad.dtype == p.dtype:
                keep[p] = grad
            self._present[start + i] = True
            p.grad = None

    def _add_flats(self, left: list[torch.Tensor], right: list[torch.Tensor]) -> list[torch.Tensor]:
        """``left + right`` into ``left`` (elementwise: the bits of adding parameter by parameter);
        ``right``'s buffers go back to their groups' pools."""
        torch._foreach_add_(left, right)
        for grp, flat in zip(self._groups, right, strict=True):
            grp.pool.append(flat)
        return left

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
        root: list[torch.Tensor] = []
        for g, grp in enumerate(self._groups):
            kept = [vals[g] for vals in pieces.values()]  # the pool's buffers, given back below
            if world == 1 and not self._plain_sum:
                (flat,) = kept
            else:
                mine = {node: _to_comm(vals[g], self._group) for node, vals in pieces.items()}
                if self._plain_sum:
                    flat = _all_reduce_sum(mine, world, self._group)
                else:
                    flat = reduce_pieces(mine, v, world, rank, self._group)
                flat = flat.to(grp.device)
            # The mean goes into tensors of its own (.grad outlives the step; the pool's buffers
            # are reused): those the rank's last backward made when there are, elementwise.
            if not any(flat is t for t in kept):  # a copy made for the backend: free to write
                root += grp.unflatten(flat.div_(v))
            else:
                for i, p in enumerate(grp.params):
                    out = self._outputs.get(p)
                    region = grp.region(flat, i)
                    root.append(torch.div(region, v) if out is None else torch.div(region, v, out=out))
            grp.pool.extend(kept)
        self._outputs = {}
        params = [p for grp in self._groups for p in grp.params]
        for n, (p, grad) in enumerate(zip(params, root, strict=True)):
            if present[n]:
                carried = self._carry.get(p)
                p.grad = grad if carried is None else carried + grad
        self._carry = {}
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
        self._acc = None


class _Sequential(Accumulator):
    """Negative control: the block's leaves summed one after another (not the canonical tree)."""

    def __init__(self, block: tuple[int, int], add: Any) -> None:
        super().__init__(block, block[1], add)

    def push(self, j: int, value: Any) -> None:
        if self._stack:
            self._stack[0] = (self.block, self._add(self._stack[0][1], value))
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
