"""``tree.reduce_pieces`` across real gloo processes: the root every rank ends with is, bit for bit,
the canonical tree evaluated in one process, for W = 3 and 4 (several pieces per rank), for flat
tensors whose length W does not divide and ones shorter than W, twice in a row (the buffers kept
between calls).

Negative control: the same leaves summed in a row (what a rank-by-rank reduction does) differ
from the canonical tree, so the equality above is not float addition being associative.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchrepro.invariant.tree import Accumulator, blocks, children, chunks, reduce_pieces

V = 12
LENGTHS = (1, 2, 7, 1001, 7)


def leaf(j: int, n: int) -> torch.Tensor:
    """Leaf ``j``: values of very different magnitudes, so the order of additions shows."""
    g = torch.Generator().manual_seed(1000 + j + n)
    return torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 7, (n,), generator=g)


def canonical(node: tuple[int, int], n: int) -> torch.Tensor:
    lo, hi = node
    if hi - lo == 1:
        return leaf(lo, n)
    left, right = children(node)
    return canonical(left, n).add_(canonical(right, n))


def _rank(rank: int, world: int, path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        roots = []
        for n in LENGTHS:
            block = blocks(V, world)[rank]
            acc = Accumulator(block, V)
            for j in range(*block):
                acc.push(j, leaf(j, n))
            roots.append(reduce_pieces(acc.done(), V, world, rank).clone())
        torch.save(roots, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_every_rank_ends_with_the_canonical_root(world: int, tmp_path: Path) -> None:
    fd, path = tempfile.mkstemp(dir=tmp_path)
    os.close(fd)
    os.unlink(path)
    out = str(tmp_path / "roots")
    mp.start_processes(_rank, args=(world, path, out), nprocs=world, start_method="spawn")
    expected = [canonical((0, V), n) for n in LENGTHS]
    for rank in range(world):
        got = torch.load(f"{out}.rank{rank}", weights_only=True)
        for n, a, b in zip(LENGTHS, got, expected, strict=True):
            assert a.shape == b.shape and torch.equal(a, b), (world, rank, n)


def test_chunks_tile_the_tensor() -> None:
    for n in range(30):
        for w in range(1, 9):
            parts = chunks(n, w)
            assert len(parts) == w and parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
            assert max(hi - lo for lo, hi in parts) == -(-n // w)


def test_negative_control_a_sum_in_a_row_is_not_the_tree() -> None:
    n = 1001
    in_a_row = leaf(0, n)
    for j in range(1, V):
        in_a_row.add_(leaf(j, n))
    assert not torch.equal(in_a_row, canonical((0, V), n))


@pytest.mark.parametrize("v", [8, 12])
def test_splits_match_between_ranks_and_send_what_a_ring_sends(v: int) -> None:
    from torchrepro.invariant.tree import pieces, sent_elements, splits

    for w in (w for w in range(1, v + 1) if v % w == 0):
        for n in (1, 7, 1001, 1200):
            plans = [splits(n, v, w, r) for r in range(w)]
            for r, j in itertools.product(range(w), range(w)):  # what r sends j, j receives from r
                assert plans[r][0][0][j] == plans[j][0][1][r] and plans[r][1][0][j] == plans[j][1][1][r]
            assert all(sum(plan[1][1]) == n for plan in plans)  # the whole root comes back
            if n % w == 0 and all(len(pieces(b, v)) == 1 for b in blocks(v, w)):
                assert all(sent_elements(n, v, w, r) == 2 * (w - 1) * n // w for r in range(w))
    if v == 12:  # W = 3: rank 0 holds the pieces [0, 3) and [3, 4); it sends 1.5x a ring
        assert sent_elements(1200, 12, 3, 0) == 2 * 2 * 400 + 2 * 400
