"""SeededLoaders built before torch.distributed is initialised, iterated after: which samples each rank gets.

    python rank_at_pass_start.py OUT_DIR

Forks two ranks (gloo, a FileStore in OUT_DIR, world size 2). Each rank builds its loaders first
(``num_workers`` 0 and 2, neither given ``rank=``/``world_size=``), then joins the process group,
then runs one epoch of each, and one epoch of a loader built with ``rank=``/``world_size=`` given
explicitly. Writes ``rank<R>.json``: the dataset indices of each, and the loaders' state dicts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import torchrepro

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import forking

N, BATCH, SEED, WORLD = 12, 4, 5, 2


def rank_main(rank: int, out_dir: Path) -> None:
    early = {
        workers: torchrepro.SeededLoader(
            list(range(N)),
            batch_size=BATCH,
            seed=SEED,
            num_workers=workers,
            **({"multiprocessing_context": "fork"} if workers else {}),
        )
        for workers in (0, 2)
    }
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(out_dir / "store"), WORLD), rank=rank, world_size=WORLD
    )
    try:
        explicit = torchrepro.SeededLoader(
            list(range(N)), batch_size=BATCH, seed=SEED, rank=rank, world_size=WORLD
        )
        result = {
            "early_w0": [int(i) for batch in early[0] for i in batch],
            "early_w2": [int(i) for batch in early[2] for i in batch],
            "explicit": [int(i) for batch in explicit for i in batch],
            "states": {"early_w0": early[0].state_dict(), "explicit": explicit.state_dict()},
        }
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> int:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    pids = [forking.start(lambda rank=rank: rank_main(rank, out_dir)) for rank in range(WORLD)]
    codes = [forking.wait(pid) for pid in pids]
    return max(codes, key=abs)


if __name__ == "__main__":
    sys.exit(main())
