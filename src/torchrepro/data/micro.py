"""The sampler of a ``SeededLoader`` with ``global_batch_size``: micro-batches of global batches.

Invariants:
- The order of an epoch is the plain loader's (``derive_seed(seed, "order", e)``), cut into
  global batches of ``G`` samples, each cut into ``V = G // m`` micro-batches of ``m`` samples
  (``m`` is ``batch_size``). Global batch ``g`` holds samples ``order[g*G:(g+1)*G]``, its
  micro-batch ``j`` samples ``order[g*G + j*m:g*G + (j+1)*m]``: neither depends on the world size.
- Rank ``r`` of ``W`` (``W`` divides ``V``) yields, of every global batch, the contiguous block of
  micro-batches ``[r*A, (r+1)*A)`` with ``A = V // W`` (``accumulation_steps``), in order. An
  epoch holds only whole global batches: an incomplete last one is dropped with ``drop_last``,
  refused without it (its mean would have another denominator and shape).
- The key of a sample names its *global* micro-batch index (``g*V + j``), so ``collate_fn``'s
  seed, like each sample's, is the same on every world size.
- The position (``batches``) counts the micro-batches this rank's loop received; at a global
  batch boundary it converts to another world size (``global_position`` / ``local_position``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchrepro._runtime import process_group
from torchrepro.data.keys import KEY_MARK, SampleKey
from torchrepro.data.sampler import SeededSampler
from torchrepro.errors import LoaderConfigError


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_batches_per_rank(global_batch_size: int, batch_size: int, world_size: int) -> int:
    """``V // W``, the micro-batches each of ``world_size`` ranks computes of a global batch;
    ``LoaderConfigError`` naming the world sizes that work when ``W`` does not divide ``V``."""
    v = global_batch_size // batch_size
    if v % world_size:
        fits = ", ".join(str(d) for d in divisors(v))
        raise LoaderConfigError(
            f"SeededLoader(global_batch_size={global_batch_size}, batch_size={batch_size}) "
            f"has {v} micro-batches per global batch, which {world_size} processes cannot share "
            f"evenly: the world size must divide {v}. World sizes that work: {fits}; or choose a "
            "global_batch_size whose micro-batch count this world size divides."
        )
    return v // world_size


def check_global_batch_size(global_batch_size: Any, batch_size: int) -> None:
    """Refuse a ``global_batch_size`` that is not a positive whole number of micro-batches."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive int, got {global_batch_size!r}.")
    if global_batch_size % batch_size:
        below = global_batch_size - global_batch_size % batch_size
        raise LoaderConfigError(
            f"global_batch_size={global_batch_size} is not a multiple of batch_size={batch_size} (the "
            f"micro-batch size): a global batch is a whole number of micro-batches. Use "
            f"global_batch_size={below or batch_size} or {below + batch_size}, or another batch_size."
        )


class MicroBatchSampler(SeededSampler):
    """Yields this rank's micro-batches of every global batch of an epoch, and holds the position."""

    def __init__(self, *, global_batch_size: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.global_batch_size = global_batch_size
        self.micro_batches = global_batch_size // self.batch_size  # V

    # -- shape ------------------------------------------------------------------------------

    def accumulation_steps(self, world_size: int | None = None) -> int:
        """``A = V // W``: the micro-batches a rank computes of each global batch."""
        if world_size is None:
            world_size = process_group(self.fixed_shard)[1]
        return micro_batches_per_rank(self.global_batch_size, self.batch_size, world_size)

    def global_batches(self) -> int:
        """Whole global batches in an epoch."""
        return self.length // self.global_batch_size

    def _sizes(self, world_size: int) -> tuple[int, int]:
        per_rank = self.global_batches() * self.accumulation_steps(world_size) * self.batch_size
        return per_rank, per_rank * world_size

    def num_batches(self) -> int:
        return self.global_batches() * self.accumulation_steps()

    # -- order ------------------------------------------------------------------------------

    def micro_batch_keys(self, epoch: int, rank: int, world_size: int) -> list[tuple[int, list[int]]]:
        """``(global micro-batch index, dataset indices)`` of each micro-batch ``rank`` loads in
        ``epoch``, in order."""
        order = self.order(epoch)
        m, v = self.batch_size, self.micro_batches
        a = self.accumulation_steps(world_size)
        out = []
        for g in range(self.global_batches()):
            for j in range(rank * a, (rank + 1) * a):
                start = g * self.global_batch_size + j * m
                out.append((g * v + j, order[start : start + m]))
        return out

    def shard(self, epoch: int, rank: int | None = None, world_size: int | None = None) -> list[int]:
        if rank is None or world_size is None:
            rank, world_size = process_group(self.fixed_shard)
        return [i for _, indices in self.micro_batch_keys(epoch, rank, world_size) for i in indices]

    def _keys(self, epoch: int, start: int, pass_id: object, own: bool) -> Iterator[SampleKey]:
        rank, world_size = process_group(self.fixed_shard)
        micro = self.micro_batch_keys(epoch, rank, world_size)
        for local in range(start, len(micro)):
            key_batch, indices = micro[local]
            for n, index in enumerate(indices):
                if not own and n == len(indices) - 1 and self.pass_id is pass_id:
                    self.batches = local + 1  # a rebuilt loader's pass: see SeededSampler._keys
                yield (epoch, key_batch, index, KEY_MARK)
        if not own and self.pass_id is pass_id:
            self.batches = len(micro)
            self.end_pass()

    # -- position across world sizes --------------------------------------------------------

    def global_position(self, batches: int, world_size: int) -> tuple[int, int]:
        """``(whole global batches, micro-batches into the next)`` for ``batches`` received by a
        rank of ``world_size``."""
        return divmod(batches, self.accumulation_steps(world_size))
