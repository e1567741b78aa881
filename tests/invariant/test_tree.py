"""The canonical tree: every split of [0, V) across W ranks evaluates the same expression.

Exhaustive over V <= 40 and every W dividing V: the ranks' pieces (summed as the leaves arrive,
at most about log2(V) partial sums at once) and the schedule across ranks build, symbolically,
the one expression of the tree over [0, V).
Negative control: summing each rank's leaves in a row and then the ranks' sums does not.
"""

from __future__ import annotations

import itertools
import math

import pytest

from torchrepro.invariant.tree import Accumulator, blocks, children, pieces, schedule


def add(a: str, b: str) -> str:
    return f"({a}+{b})"


def canonical(node: tuple[int, int]) -> str:
    lo, hi = node
    if hi - lo == 1:
        return str(lo)
    left, right = children(node)
    return add(canonical(left), canonical(right))


def evaluate(v: int, w: int) -> tuple[str, int]:
    """The root as every rank would compute it, and the most partial sums a rank held at once."""
    values: dict[tuple[int, int], str] = {}
    peak = 0
    for block in blocks(v, w):
        acc = Accumulator(block, v, add)
        for j in range(*block):
            acc.push(j, str(j))
        done = acc.done()
        assert list(done) == pieces(block, v)
        values.update(done)
        peak = max(peak, acc.peak)
    owners = {node: node[0] // (v // w) for node in values}
    for node, left_owner, right_owner in schedule(v, w):
        left, right = children(node)
        assert (owners[left], owners[right]) == (left_owner, right_owner)
        values[node] = add(values.pop(left), values.pop(right))
        owners[node] = left_owner
    assert list(values) == [(0, v)] and owners[(0, v)] == 0
    return values[(0, v)], peak


@pytest.mark.parametrize("v", range(1, 41))
def test_every_world_size_dividing_v_builds_the_canonical_expression(v: int) -> None:
    expected = canonical((0, v))
    for w in (d for d in range(1, v + 1) if v % d == 0):
        root, peak = evaluate(v, w)
        assert root == expected, (v, w)
        assert peak <= math.ceil(math.log2(v)) + 2, (v, w, peak)  # about log2(V) partial sums held


def test_pieces_tile_each_block_and_schedule_ends_at_the_root() -> None:
    for v, w in [(12, 3), (96, 6), (7, 7), (16, 4)]:
        for block in blocks(v, w):
            parts = pieces(block, v)
            assert parts[0][0] == block[0] and parts[-1][1] == block[1]
            assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
        steps = schedule(v, w)
        assert (not steps and w == 1) or steps[-1][0] == (0, v)


def test_negative_control_a_rank_sequential_sum_depends_on_the_world_size() -> None:
    def sequential(v: int, w: int) -> str:
        sums = []
        for lo, hi in blocks(v, w):
            total = str(lo)
            for j in range(lo + 1, hi):
                total = add(total, str(j))
            sums.append(total)
        root = sums[0]
        for s in sums[1:]:
            root = add(root, s)
        return root

    assert len({sequential(12, w) for w in (1, 2, 3, 4)}) == 4
    assert len({evaluate(12, w)[0] for w in (1, 2, 3, 4)}) == 1


def test_accumulator_refuses_leaves_out_of_order() -> None:
    acc = Accumulator((0, 4), 4, add)
    acc.push(0, "0")
    with pytest.raises(ValueError, match="leaf 2 arrived, expected leaf 1"):
        acc.push(2, "2")
    with pytest.raises(ValueError, match="not complete"):
        acc.done()
