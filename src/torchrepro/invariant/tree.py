"""The fixed reduction tree over a global batch's micro-batches, and its evaluation across ranks.

Invariants:
- The tree over ``[0, V)`` is canonical: a node ``[lo, hi)`` with ``hi - lo > 1`` has the children
  ``[lo, mid)`` and ``[mid, hi)``, ``mid = (lo + hi) // 2``, and its value is always
  ``left + right`` (elementwise, so its bits do not depend on threads). Every node's value is
  therefore one function of the leaves, whoever computes it.
- Rank ``r`` of ``W`` holds the leaves of its block ``[r*A, (r+1)*A)``. The block splits into the
  few maximal canonical nodes inside it (``pieces``); a rank sums them from its leaves as they
  arrive (``Accumulator``: a stack, at most ``ceil(log2(V)) + 2`` partial sums at once).
- The nodes above the pieces (those spanning ranks) are evaluated by a reduce along the tree:
  a node's value is computed by the rank owning its first leaf, which receives its right
  child's value from the rank owning that child's first leaf (``schedule``: the same list, in
  post-order, on every rank; each step involves two ranks, and every rank takes its steps in
  that one order, so the point-to-point exchanges cannot deadlock). Rank 0 ends with the root
  and broadcasts it. A rank sends each of its pieces at most once and receives at most one
  value per tree level: bandwidth per rank is a few gradient copies, not the ``W`` copies an
  all-gather of every piece would cost. With two ranks each holds one child of the root: they
  exchange them (one all-gather) and both add, one transfer instead of a send and a broadcast.
- Pure index arithmetic lives here; only ``reduce_pieces`` talks to ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

Node = tuple[int, int]


def children(node: Node) -> tuple[Node, Node]:
    lo, hi = node
    mid = (lo + hi) // 2
    return (lo, mid), (mid, hi)


def blocks(v: int, w: int) -> list[Node]:
    """The block of leaves each of ``w`` ranks holds (``w`` divides ``v``)."""
    a = v // w
    return [(r * a, (r + 1) * a) for r in range(w)]


def pieces(block: Node, v: int) -> list[Node]:
    """The maximal canonical nodes of the tree over ``[0, v)`` inside ``block``, left to right."""
    lo, hi = block
    out: list[Node] = []

    def walk(node: Node) -> None:
        a, b = node
        if b <= lo or a >= hi:
            return
        if lo <= a and b <= hi:
            out.append(node)
            return
        left, right = children(node)
        walk(left)
        walk(right)

    walk((0, v))
    return out


@lru_cache(maxsize=64)
def schedule(v: int, w: int) -> tuple[tuple[Node, int, int], ...]:
    """The nodes above the ranks' pieces, in post-order, each with the ranks owning its left and
    right child: ``(node, left owner, right owner)``. The root ``(0, v)`` comes last (when
    ``w > 1``); with ``w == 1`` the list is empty (the only piece is the root)."""
    a = v // w
    owned = {p: r for r, block in enumerate(blocks(v, w)) for p in pieces(block, v)}
    steps: list[tuple[Node, int, int]] = []

    def owner(node: Node) -> int:
        return node[0] // a

    def walk(node: Node) -> None:
        if node in owned:
            return
        left, right = children(node)
        walk(left)
        walk(right)
        steps.append((node, owner(left), owner(right)))

    walk((0, v))
    return tuple(steps)


class Accumulator:
    """Sums the leaves of one rank's block into its pieces as the leaves arrive, in order.

    ``push(j, value)`` adds leaf ``j`` (the next of the block); two adjacent partial sums that are
    the children of a canonical node inside the block become that node (``left.add_(right)``).
    ``add`` is how two values combine (an in-place add by default). ``done()`` gives
    ``{piece: value}`` when the block is complete.
    """

    def __init__(self, block: Node, v: int, add: Callable[[Any, Any], Any] | None = None) -> None:
        self.block = block
        self.v = v
        self._expected = block[0]
        self._stack: list[tuple[Node, Any]] = []
        self._parents = _parents(v)
        self._add = add or (lambda left, right: left.add_(right))
        self.peak = 0  # the most partial sums held at once

    def push(self, j: int, value: Any) -> None:
        if j != self._expected:
            raise ValueError(f"leaf {j} arrived, expected leaf {self._expected} of block {self.block}")
        self._expected += 1
        stack = self._stack
        stack.append(((j, j + 1), value))
        self.peak = max(self.peak, len(stack))
        lo, hi = self.block
        while len(stack) >= 2:
            (a, m), left = stack[-2]
            (m2, b), right = stack[-1]
            if m != m2 or self._parents.get((a, b)) != m or a < lo or b > hi:
                break
            stack[-2:] = [((a, b), self._add(left, right))]

    def complete(self) -> bool:
        return self._expected == self.block[1]

    def done(self) -> dict[Node, Any]:
        if not self.complete():
            raise ValueError(f"block {self.block} is not complete: next leaf {self._expected}")
        return dict(self._stack)


@lru_cache(maxsize=64)
def _parents(v: int) -> dict[Node, int]:
    """Every internal canonical node of the tree over ``[0, v)`` and where it splits."""
    out: dict[Node, int] = {}
    todo = [(0, v)]
    while todo:
        node = todo.pop()
        if node[1] - node[0] > 1:
            left, right = children(node)
            out[node] = left[1]
            todo += [left, right]
    return out


def reduce_pieces(mine: dict[Node, Any], v: int, w: int, rank: int, group: Any = None) -> Any:
    """The root of the tree, on every rank, from each rank's pieces (flat tensors of one shape).

    Walks ``schedule(v, w)``: the right child's owner sends it to the left child's owner, which
    adds it in place; rank 0 then broadcasts the root. ``mine`` is consumed.
    """
    if w == 1:
        (root,) = mine.values()
        return root
    import torch.distributed as dist

    if w == 2:  # each rank holds one child of the root: exchange them, both add (one transfer)
        (value,) = mine.values()
        halves = [value.new_empty(value.shape) for _ in range(2)]
        dist.all_gather(halves, value, group=group)
        return halves[0].add_(halves[1])
    values = dict(mine)
    template = next(iter(values.values()))
    for node, left_owner, right_owner in schedule(v, w):
        left, right = children(node)
        if left_owner == right_owner:
            if rank == left_owner:
                values[node] = values.pop(left).add_(values.pop(right))
            continue
        if rank == right_owner:
            dist.send(values.pop(right), dst=_global(left_owner, group), group=group)
        elif rank == left_owner:
            buffer = template.new_empty(template.shape)
            dist.recv(buffer, src=_global(right_owner, group), group=group)
            values[node] = values.pop(left).add_(buffer)
    root = values.pop((0, v)) if rank == 0 else template
    dist.broadcast(root, src=_global(0, group), group=group)
    return root


def _global(rank: int, group: Any) -> int:
    """The global rank of ``rank`` in ``group`` (send/recv/broadcast take global ranks)."""
    if group is None:
        return rank
    import torch.distributed as dist

    return int(dist.get_global_rank(group, rank))
