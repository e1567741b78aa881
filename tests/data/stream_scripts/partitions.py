"""Each rank of a torchrun launch streams partitioned data, reading only its own partitions: rank 0
writes every rank's micro-batches of two epochs, rank 0's loader state at every global-batch
boundary, and the weights of a model trained two epochs on the packed stream under
InvariantDataParallel (each process notes the shards it reads in READS_DIR).

TR_TEST_READS=DIR python -m torch.distributed.run --nproc-per-node W partitions.py OUT.json NUM_WORKERS

The datasets are defined here and imported by tests/data/test_data_partitions.py, which computes the
one-process sequence in process and compares.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import default_collate

import torchrepro

LENGTHS = [7, 23, 5, 0, 50, 12, 31, 9, 14, 3, 22, 8, 17, 1, 26, 11]  # unequal, one empty
PARTITIONS = 4
BATCH = 2
GLOBAL = 8  # 4 micro-batches: world sizes 1, 2 and 4 divide it and PARTITIONS
READS = os.environ.get("TR_TEST_READS")  # a directory: each process notes the shards it reads


def read_doc(shard: int):
    """Documents of varying length (some empty) with per-sample draws."""
    return _docs(shard, 0)


def read_doc_from(shard: int, start: int = 0):
    """``read_doc`` opened at a document: a resume asks for the shard from ``start``."""
    return _docs(shard, start)


def _docs(shard: int, start: int):
    if READS:
        with open(Path(READS) / f"rank{os.environ.get('RANK', '0')}-{os.getpid()}", "a") as f:
            f.write(f"{shard} {LENGTHS[shard] - start}\n")
    for offset in range(start, LENGTHS[shard]):
        n = int(torch.randint(0, 9, ()).item())
        yield {
            "id": shard * 1000 + offset,
            "input_ids": [shard * 100 + offset] * n,
            "r": torch.rand(()).item(),
        }


def read_code(shard: int):
    if READS:
        with open(Path(READS) / f"rank{os.environ.get('RANK', '0')}-{os.getpid()}", "a") as f:
            f.write(f"{100 + shard} {shard % 9 + 2}\n")
    for offset in range(shard % 9 + 2):
        yield {
            "id": 100_000 + shard * 1000 + offset,
            "input_ids": [7] * (offset % 4),
            "r": torch.rand(()).item(),
        }


def keep(sample: dict[str, Any]) -> bool:
    """Drops about a fifth, by a draw keyed to the sample."""
    return float(torchrepro.sample_rng().random()) < 0.8


def datasets() -> dict[str, torchrepro.ShardedDataset]:
    docs = torchrepro.ShardedDataset(range(len(LENGTHS)), read_doc)
    code = torchrepro.ShardedDataset(range(8), read_code)
    return {
        "filtered": docs.filter(keep),
        "packed": docs.filter(keep).pack(6),
        "mixed": torchrepro.ShardedDataset.mix([docs.filter(keep), code], weights=[0.7, 0.3]),
    }


def collate(samples: list[dict[str, Any]]) -> list[Any]:
    if "position_ids" in samples[0]:
        return [
            [s["input_ids"].tolist(), s["position_ids"].tolist(), s["document_ids"].tolist()] for s in samples
        ]
    return [[s["id"], s["input_ids"], s["r"]] for s in samples]


def loader(ds: torchrepro.ShardedDataset, **kwargs: Any) -> torchrepro.SeededLoader:
    options: dict[str, Any] = {
        "batch_size": BATCH,
        "global_batch_size": GLOBAL,
        "drop_last": True,
        "shuffle_buffer": 6,
        "partitions": PARTITIONS,
        "seed": 11,
        "collate_fn": collate,
    }
    return torchrepro.SeededLoader(ds, **{**options, **kwargs})


def train(ds: torchrepro.ShardedDataset, **kwargs: Any) -> list[float]:
    """Two epochs of a tiny model with dropout under InvariantDataParallel; its final weights."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(4096, 4), nn.Dropout(0.2), nn.Flatten(), nn.Linear(24, 1))
    stream = loader(ds, collate_fn=default_collate, **kwargs)
    model = torchrepro.InvariantDataParallel(net, stream)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for i, batch in enumerate(stream):
            model(batch["input_ids"] % 4096).pow(2).mean().backward()
            if (i + 1) % stream.accumulation_steps == 0:
                opt.step()
                opt.zero_grad()
    return [float(v) for p in net.parameters() for v in p.detach().flatten()]


def main() -> None:
    out, num_workers = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    result: dict[str, Any] = {}
    for name, ds in datasets().items():
        stream = loader(ds, num_workers=num_workers)
        per_rank = stream.accumulation_steps
        batches, states = [], [stream.state_dict()]
        for _ in range(2):
            for i, batch in enumerate(stream, 1):
                batches.append(batch)
                if i % per_rank == 0:
                    states.append(stream.state_dict())
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, batches)
        result[name] = {"batches": gathered, "states": states}
    global READS
    READS = None  # the reads noted are the loaders' above
    result["trained"] = train(datasets()["packed"], num_workers=num_workers)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
