"""Each rank of a torchrun launch streams the generated shards (2 workers per rank); rank 0 writes
every rank's batches of one epoch, and of the rest of an epoch resumed from STATE.json.

python -m torch.distributed.run --nproc-per-node N ranks.py OUT.json STATE.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import torchrepro

LENGTHS = [7, 23, 5, 0, 50, 12, 31, 9]


def read_shard(shard: int):
    for offset in range(LENGTHS[shard]):
        yield {
            "id": shard * 1000 + offset,
            "torch": torch.rand(()).item(),
            "keyed": float(torchrepro.sample_rng().random()),
        }


def loader(**kwargs) -> torchrepro.SeededLoader:
    ds = torchrepro.ShardedDataset(range(len(LENGTHS)), read_shard)
    return torchrepro.SeededLoader(ds, batch_size=4, seed=7, shuffle_buffer=16, **kwargs)


def rows(batch) -> list[list[float]]:
    return [[float(batch[k][i]) for k in sorted(batch)] for i in range(len(batch["id"]))]


def main() -> None:
    out, state = sys.argv[1], sys.argv[2]
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    whole = [rows(b) for b in loader(num_workers=2)]
    resumed = loader(num_workers=2)
    resumed.load_state_dict(json.loads(Path(state).read_text()))
    rest = [rows(b) for b in resumed]
    result = {"whole": [whole], "rest": [rest]}
    if dist.is_initialized():
        for key in result:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result[key][0])
            result[key] = gathered
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
