"""The shuffle buffer of a stream, keyed by (seed, epoch, output position), and its replay.

Invariants:
- The buffer holds up to ``capacity`` items of the stream. While it fills, nothing is emitted;
  then each new item takes the slot of the item emitted at output position ``k``, the slot
  ``key(k) % capacity``; at the end of the stream the rest is emitted the same way from a
  shrinking buffer (the emitted slot takes the last item). ``key(k)`` is
  ``derive_seed(seed, "shuffle", epoch, k)``: the order is a function of (seed, epoch, the
  stream), never of who reads the stream or how fast.
- The buffer works on whatever it is given: the loader feeds it sample ids ``(shard position,
  offset)`` and keeps the samples beside it, so a resume replays it on ids alone (from the shard
  lengths a checkpoint records) and loads only the samples still buffered: a checkpoint holds a
  position, never the buffer's contents.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torchrepro.seeding import Deriver

Id = tuple[int, int]  # (shard position in the epoch's order, offset in the shard)


class ShuffleBuffer:
    """The state of the shuffle: the buffered items and how many were emitted."""

    def __init__(self, seed: int, epoch: int, capacity: int, partition: int | None = None) -> None:
        self.capacity = max(int(capacity), 1)
        self.items: list[Any] = []
        self.emitted = 0
        # A partitioned stream's partition p keys its buffer by (seed, "shuffle", epoch, p, k).
        where = ("shuffle", epoch) if partition is None else ("shuffle", epoch, partition)
        self._key = Deriver(seed, where, len(where) + 1)
        self._keys: list[int] = []
        self._keys_from = 0

    def _slot(self, k: int) -> int:
        """``key(k)``, derived 256 at a time."""
        at = k - self._keys_from
        if not 0 <= at < len(self._keys):
            self._keys_from, self._keys = k, self._key.many(range(k, k + 256))
            at = 0
        return self._keys[at]

    def push(self, item: Any) -> Any | None:
        """Add the stream's next item; the item emitted in exchange, or None while filling."""
        items = self.items
        if len(items) < self.capacity:
            items.append(item)
            return None
        slot = self._slot(self.emitted) % self.capacity
        out = items[slot]
        items[slot] = item
        self.emitted += 1
        return out

    def drain(self) -> Iterator[Any]:
        """The rest, once the stream has ended."""
        items = self.items
        while items:
            slot = self._slot(self.emitted) % len(items)
            out = items[slot]
            items[slot] = items[-1]
            items.pop()
            self.emitted += 1
            yield out


def id_stream(lengths: Iterable[int], start: Id = (0, 0)) -> Iterator[Id]:
    """The ids of a stream of shards of these lengths (in epoch order), from ``start``."""
    first_shard, first_offset = start
    for p, length in enumerate(lengths):
        if p < first_shard:
            continue
        for o in range(first_offset if p == first_shard else 0, length):
            yield (p, o)


def replay(
    seed: int, epoch: int, capacity: int, lengths: list[int], emitted: int, *, complete: bool
) -> tuple[ShuffleBuffer, Id]:
    """The buffer after ``emitted`` outputs of the stream of shards of ``lengths`` (those read so
    far, in epoch order; ``complete``: every shard of the epoch), and the next id to read from the
    stream (``(len(lengths), 0)``: the shard after the last one known, from its start).

    Raises ``ValueError`` when the known shards cannot account for ``emitted`` outputs.
    """
    buffer = ShuffleBuffer(seed, epoch, capacity)
    frontier: Id = (len(lengths), 0)
    for ident in id_stream(lengths):
        if buffer.emitted == emitted:
            frontier = ident
            break
        buffer.push(ident)
    if buffer.emitted < emitted and complete:  # the stream ended: the rest came from the drain
        for _ in buffer.drain():
            if buffer.emitted == emitted:
                break
    if buffer.emitted < emitted:
        raise ValueError(
            f"{len(lengths)} shards of {sum(lengths)} samples account for {buffer.emitted} outputs, "
            f"not {emitted}"
        )
    return buffer, frontier
