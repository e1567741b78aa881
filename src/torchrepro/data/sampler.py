"""The sampler of a ``SeededLoader``: the order of each epoch, this rank's shard, the position.

Invariants:
- The order of epoch ``e`` is a pure function of ``(seed, e)``, drawn from a ``torch.Generator``
  of its own seeded with ``derive_seed(seed, "order", e)``; every rank draws the same permutation
  and takes its own shard (padded like ``DistributedSampler``, or its uneven tail dropped).
  Nothing here draws from a global RNG.
- Rank and world size are read (``_runtime.process_group``) when each pass starts, unless fixed,
  so a loader built before the process group exists still shards.
- The sampler holds the position (epoch, batches received, whether the pass ended), so a
  framework that rebuilds a plain ``DataLoader`` from the loader's parts keeps it; such a pass
  advances the epoch by itself. A pass accelerate would shard a second time is refused.
- It yields ``keys.SampleKey`` tuples, which ``view.SeededDataset`` loads; other samplers
  (of micro-batches, of a streamed source) are sibling modules that yield the same keys.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

from torchrepro._runtime import process_group
from torchrepro.data.keys import KEY_MARK, SampleKey
from torchrepro.errors import LoaderConfigError
from torchrepro.seeding import derive_seed


class Position:
    """Where a loader is: the epoch of the current pass, the batches of it the training loop
    received, and whether the pass ended (its iterator was exhausted).

    ``pending`` means the next pass continues that position instead of starting the next epoch.
    A pass the loader itself began is *armed* (the loader chose where it starts and counts the
    batches it delivers); ``pass_id`` tells a pass's bookkeeping from a later pass's.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.batches = 0
        self.finished = False
        self.pending = True
        self.restored = False  # the position came from load_state_dict; no pass has started since
        self.restart = False  # set_epoch(current epoch) during a pass: the next pass restarts it
        self.armed = False
        self.pass_id: object = object()

    def restore(self, epoch: int, batches: int) -> None:
        """Continue at ``batches`` into ``epoch`` (``load_state_dict``)."""
        self.epoch, self.batches, self.finished = epoch, batches, False
        self.pending, self.restored, self.armed, self.pass_id = True, True, False, object()
        self.restart = False

    def begin_pass(self) -> int:
        """Start a pass: the next epoch unless a position is pending (or the current epoch again
        after ``set_epoch`` during a pass); returns its first batch."""
        if self.restart:
            self.batches, self.finished = 0, False
        elif not self.pending:
            self.epoch, self.batches, self.finished = self.epoch + 1, 0, False
        self.pending = self.restored = self.restart = False
        self.pass_id = object()
        return self.batches

    def end_pass(self) -> None:
        self.finished, self.restart = True, False

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch``, from its first batch. Two exceptions keep a position:
        a position ``load_state_dict`` restored inside epoch ``epoch`` (no pass started since) is
        continued, and a pass of epoch ``epoch`` under way goes on counting (frameworks call
        ``set_epoch`` after their first fetch); a pass started after it restarts the epoch."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}.")
        if epoch == self.epoch and not self.pending and not self.finished:
            self.restart = True  # under way: leave it; the next pass starts this epoch again
            return
        if not (self.restored and epoch == self.epoch):
            self.epoch, self.batches, self.finished = epoch, 0, False
            self.restored = False
        self.pending = True
        self.restart = False
        self.armed = False
        self.pass_id = object()


class FollowsGroup:
    """``DistributedSampler``'s ``rank`` and ``num_replicas``, read when asked: they follow the
    process group (or ``fixed_shard``, the ``rank``/``world_size`` a loader was given)."""

    fixed_shard: tuple[int, int] | None

    @property
    def rank(self) -> int:
        return process_group(self.fixed_shard)[0]

    @property
    def num_replicas(self) -> int:
        return process_group(self.fixed_shard)[1]


class SeededSampler(Position, FollowsGroup, DistributedSampler[SampleKey]):  # type: ignore[override]
    """Yields the sample keys of this rank's shard of one epoch, and holds the position.

    A ``DistributedSampler`` (frameworks that replace a loader's sampler with a distributed one,
    such as Lightning's ``use_distributed_sampler``, keep it: it already shards by rank, padded
    like ``DistributedSampler``). Rank and world size are read from ``torch.distributed`` when a
    pass starts (unless fixed), so a loader built before the process group exists still shards.

    The position is ``(epoch, batches, finished)``: the epoch of the current pass, the batches of
    it the training loop received, and whether the pass ended (its iterator was exhausted).
    ``pending`` means the next pass continues that position instead of starting the next epoch.
    A pass started by ``SeededLoader.__iter__`` is *armed* (the loader already chose where it
    starts, and counts received batches itself); any other pass (a framework that rebuilt a plain
    ``DataLoader`` from this sampler) advances the epoch by itself and counts the batches it
    handed out.
    """

    def __init__(
        self,
        *,
        seed: int,
        length: int,
        batch_size: int,
        shuffle: bool,
        drop_last: bool,
        shard: tuple[int, int] | None,
    ) -> None:
        # DistributedSampler.__init__ needs a process group or a fixed shard; neither is needed here.
        Sampler.__init__(self)
        self.seed = seed
        self.length = length
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.fixed_shard = shard
        Position.__init__(self)

    def _sizes(self, world_size: int) -> tuple[int, int]:
        """``(num_samples, total_size)`` for ``world_size`` ranks."""
        if self.drop_last and self.length % world_size:
            num_samples = self.length // world_size  # drop the tail so every rank gets as many
        else:
            num_samples = math.ceil(self.length / world_size)  # pad with the first indices
        return num_samples, num_samples * world_size

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        return self._sizes(self.num_replicas)[0]

    @property
    def total_size(self) -> int:  # type: ignore[override]
        return self._sizes(self.num_replicas)[1]

    def num_batches(self) -> int:
        samples = self.num_samples
        return samples // self.batch_size if self.drop_last else math.ceil(samples / self.batch_size)

    def order(self, epoch: int) -> list[int]:
        """The permutation of epoch ``epoch`` (the same on every rank), before sharding."""
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator()
        generator.manual_seed(derive_seed(self.seed, "order", epoch))
        return torch.randperm(self.length, generator=generator).tolist()

    def shard(self, epoch: int, rank: int | None = None, world_size: int | None = None) -> list[int]:
        """The dataset indices ``rank`` loads in epoch ``epoch``, in order (default: this rank)."""
        if rank is None or world_size is None:
            rank, world_size = process_group(self.fixed_shard)
        indices = self.order(epoch)
        if world_size == 1:
            return indices
        total_size = self._sizes(world_size)[1]
        padding = total_size - len(indices)
        if padding > 0 and indices:
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
        return indices[rank:total_size:world_size]

    def __iter__(self) -> Iterator[SampleKey]:
        if self.armed:  # SeededLoader.__iter__ began this pass and counts what it delivers
            self.armed = False
            own = True
        else:
            _refuse_resharding()
            self.begin_pass()
            own = False
        return self._keys(self.epoch, self.batches, self.pass_id, own)

    def _keys(self, epoch: int, start: int, pass_id: object, own: bool) -> Iterator[SampleKey]:
        batch_size = self.batch_size
        indices = self.shard(epoch)
        end = len(indices)
        if self.drop_last:
            end -= end % batch_size
        for pos in range(start * batch_size, end):
            batch = pos // batch_size
            if not own and (pos + 1) % batch_size == 0 and self.pass_id is pass_id:
                # A rebuilt loader's pass: the batches handed out whole (this key completes one,
                # which is loaded as soon as it is taken). Without workers that is what the loop
                # received; with workers it is ahead by what they prefetched.
                self.batches = batch + 1
            yield (epoch, batch, indices[pos], KEY_MARK)
        if not own and self.pass_id is pass_id:
            self.batches = self.num_batches()
            self.end_pass()

    def __len__(self) -> int:
        return self.num_samples


def _refuse_resharding() -> None:
    """Refuse a pass run by accelerate's ``BatchSamplerShard``: it would shard this rank's shard
    again, and every rank would silently train on a fraction of its data."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        cls = type(owner)
        if cls.__name__ == "BatchSamplerShard" and cls.__module__.startswith("accelerate"):
            raise LoaderConfigError(
                "A SeededLoader was prepared by accelerate with several processes: accelerate splits "
                "its batches across processes again, but a SeededLoader already gives each rank its "
                "own shard (rank and world size from torch.distributed), so every rank would train on "
                "a fraction of its data. Do not pass the SeededLoader to accelerator.prepare(); move "
                "each batch to accelerator.device yourself (with the HF Trainer, use "
                "torchrepro.integrations.transformers.TorchreproTrainer)."
            )
        frame = frame.f_back  # type: ignore[assignment]
