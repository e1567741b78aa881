"""The DataLoaders the audit's probe records (``_child.probe.loaders``): the sampler that draws
the order, and whether it is seeded."""

from __future__ import annotations

import torch

from torchrepro._child.probe.loaders import sampler_facts


class Doubles(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i * 2


def test_sampler_facts_name_the_sampler_that_draws_the_order() -> None:
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    data = Doubles()
    seeded = torch.Generator().manual_seed(0)
    cases = [
        (DataLoader(data, shuffle=True), None, ("RandomSampler", False)),
        (DataLoader(data, shuffle=True, generator=seeded), None, ("RandomSampler", True)),
        (
            DataLoader(data, sampler=RandomSampler(data), generator=seeded),
            "sampler",
            ("RandomSampler", False),
        ),
        (
            DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data, generator=seeded), 2, False)),
            "batch_sampler",
            ("RandomSampler", True),
        ),
        (DataLoader(data), None, ("SequentialSampler", False)),
    ]
    for loader, given, (sampler, has_generator) in cases:
        facts = sampler_facts(loader, given)
        assert (facts["sampler"], facts["sampler_generator"]) == (sampler, has_generator)
        assert facts["shuffle"] == (sampler == "RandomSampler")
