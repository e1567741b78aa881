"""DataLoader workers started with the spawn method: python children of the run that torch seeds
itself. Prints, per sample, whether the worker found strict switches on (it must not: the run
leaves workers alone) and a draw from the worker's seeded torch RNG."""

from __future__ import annotations

import json

import torch
from torch.utils.data import DataLoader, Dataset


class Probe(Dataset[list[float]]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> list[float]:
        return [float(torch.are_deterministic_algorithms_enabled()), torch.rand(1).item()]


if __name__ == "__main__":
    loader = DataLoader(Probe(), batch_size=2, num_workers=2, multiprocessing_context="spawn")
    rows = [row for batch in loader for row in torch.stack(batch, 1).tolist()]
    print(json.dumps({"main_strict": torch.are_deterministic_algorithms_enabled(), "rows": rows}))
