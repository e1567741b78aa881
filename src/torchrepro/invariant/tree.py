"""The fixed reduction tree over a global batch's micro-batches, and its evaluation across ranks.

Invariants:
- The tree over ``[0, V)`` is canonical: a node ``[lo, hi)`` with ``hi - lo > 1`` has the children
  ``[lo, mid)`` and ``[mid, hi)``, ``mid = (lo + hi) // 2``, and its value is always
  ``left + right`` (elementwise, so its bits do not depend on threads). Every node's value is
  therefore one function of the leaves, whoever computes it.
- Rank ``r`` of ``W`` holds the leaves of its block ``[r*A, (r+1)*A)``. The block splits into the
  few maximal canonical nodes inside it (``pieces``); a rank sums them from its leaves as they
  arrive (``Accumulator``: a stack, at most ``ceil(log2(V)) + 2`` partial sums at once).
- The nodes above the pieces (those spanning ranks) are evaluated chunk by chunk: every rank
  sends chunk ``j`` of each of its pieces to rank ``j`` (one all-to-all), rank ``j`` evaluates
  every node above the pieces for chunk ``j`` in ``schedule``'s order (post-order, each node
  ``left + right``: elementwise, so a chunk of a node is the node's chunk, whoever computes it),
  and a second all-to-all sends each rank's chunk of the root to every rank. Per rank that is
  about ``2(W-1)/W`` gradients sent and as many received, like a ring all-reduce, in two
  collectives every rank runs at once (``reduce_pieces``); the buffers they move are kept between
  calls (``_workspace``), and a rank's only piece is sent as it lies. ``splits`` is that plan
  (what each rank sends and receives), ``sent_elements`` its count against a ring's.
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


def chunks(n: int, w: int) -> list[tuple[int, int]]:
    """The element range of each of ``w`` ranks in a flat tensor of ``n`` elements: ``ceil(n/w)``
    each, the last ones shorter (or empty when ``n < w``)."""
    c = -(-n // w)
    return [(min(j * c, n), min((j + 1) * c, n)) for j in range(w)]


_WORKSPACES: dict[tuple[str, Any, Any, int], Any] = {}
_MAX_WORKSPACES = 8


def _workspace(name: str, like: Any, size: int) -> Any:
    """A flat buffer of ``size`` elements like ``like``, kept between calls: a fresh buffer of a
    gradient's size costs a page fault per page at its first touch (measured: an all-to-all into a
    fresh 50 MB tensor took 3x as long as into a reused one)."""
    key = (name, like.dtype, like.device, size)
    buffer = _WORKSPACES.pop(key, None)
    if buffer is None:
        buffer = like.new_zeros(size)  # not new_empty: the op tracer takes a copy into a slice of
        # uninitialised memory as leaving the rest uninitialised, and would not compare what it moves
        while len(_WORKSPACES) >= _MAX_WORKSPACES:
            _WORKSPACES.pop(next(iter(_WORKSPACES)))
    _WORKSPACES[key] = buffer  # most recently used last
    return buffer


def reduce_pieces(mine: dict[Node, Any], v: int, w: int, rank: int, group: Any = None) -> Any:
    """The root of the tree, on every rank, from each rank's pieces (flat tensors of one shape).

    Bandwidth-optimal, like a ring all-reduce, in two all-to-alls every rank runs at once: the
    first sends chunk ``j`` (``chunks``) of each piece to rank ``j``; rank ``j`` evaluates the nodes
    above the pieces for its chunk in ``schedule``'s order (``left.add_(right)``, elementwise, so a
    chunk's bits are the whole node's); the second sends each rank's chunk of the root to every
    rank (an all-gather; gloo runs an all-to-all of the same bytes faster than its own gather).
    Per rank, with one piece each (``V/W`` a power of two), about ``2(W-1)/W`` gradients are sent,
    not the ``log2(W)`` copies rank 0 received one after another along the tree. The root is
    written into one of ``mine``'s tensors (returned); ``mine`` is consumed.
    """
    if w == 1:
        (root,) = mine.values()
        return root
    import torch.distributed as dist

    own = [mine.pop(node) for node in pieces(blocks(v, w)[rank], v)]
    root = own[0]
    n = root.numel()
    parts = chunks(n, w)
    sizes = [hi - lo for lo, hi in parts]
    first, second = splits(n, v, w, rank)
    send = _workspace("send", root, max(len(own) * n, w * sizes[rank]))  # both all-to-alls' inputs
    if len(own) == 1:  # chunk j for rank j, left to right: the piece as it lies
        outgoing = root.view(-1)
    else:
        at = 0
        for lo, hi in parts:  # for rank j: chunk j of each of this rank's pieces, left to right
            for piece in own:
                send[at : at + hi - lo].copy_(piece.view(-1)[lo:hi])
                at += hi - lo
        outgoing = send[: len(own) * n]
    received = _workspace("received", root, sum(first[1]))
    dist.all_to_all_single(
        received, outgoing, output_split_sizes=first[1], input_split_sizes=first[0], group=group
    )
    values: dict[Node, Any] = {}
    at = 0
    for block in blocks(v, w):  # rank r's pieces, left to right: the order each rank sent them in
        for node in pieces(block, v):
            values[node] = received[at : at + sizes[rank]]
            at += sizes[rank]
    for node, _, _ in schedule(v, w):
        left, right = children(node)
        values[node] = values.pop(left).add_(values.pop(right))
    mine_root = values.pop((0, v))
    for j in range(w):  # this rank's chunk of the root, once for every rank
        send[j * sizes[rank] : (j + 1) * sizes[rank]].copy_(mine_root)
    flat = root.view(-1)
    dist.all_to_all_single(
        flat, send[: w * sizes[rank]], output_split_sizes=second[1], input_split_sizes=second[0], group=group
    )
    return root


Splits = tuple[list[int], list[int]]  # (elements sent to each rank, elements received from each)


def splits(n: int, v: int, w: int, rank: int) -> tuple[Splits, Splits]:
    """What ``reduce_pieces`` moves for a flat gradient of ``n`` elements, on ``rank``: the split
    sizes of its first all-to-all (chunk ``j`` of each piece to rank ``j``) and of its second (this
    rank's chunk of the root to every rank), in elements."""
    sizes = [hi - lo for lo, hi in chunks(n, w)]
    counts = [len(pieces(block, v)) for block in blocks(v, w)]  # pieces per rank, known to all
    first = ([counts[rank] * size for size in sizes], [k * sizes[rank] for k in counts])
    second = ([sizes[rank]] * w, sizes)
    return first, second


def sent_elements(n: int, v: int, w: int, rank: int) -> int:
    """The elements ``rank`` sends to other ranks in ``reduce_pieces`` (its two all-to-alls; what
    it sends itself is a local copy). A ring all-reduce sends ``2(W-1)/W n``."""
    first, second = splits(n, v, w, rank)
    return sum(first[0]) + sum(second[0]) - first[0][rank] - second[0][rank]


def _global(rank: int, group: Any) -> int:
    """The global rank of ``rank`` in ``group`` (send/recv/broadcast take global ranks)."""
    if group is None:
        return rank
    import torch.distributed as dist

    return int(dist.get_global_rank(group, rank))
