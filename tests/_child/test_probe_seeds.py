"""The script's seeding as the audit's probe sees it (``_child.probe.seeds``): seeds drawn from
unseeded sources, constants, and ``torch.Generator`` replaced by a subclass."""

from __future__ import annotations

import sys

import pytest
import torch

from torchrepro._child.probe.seeds import SeedWatcher


def test_probe_tells_seeds_drawn_from_unseeded_sources() -> None:
    import time

    seeds = SeedWatcher()  # not installed: nothing is patched
    seeds.drawn_from("random.randint", int("1234567"), sys._getframe(), lambda v: [v], user_only=False)
    seeds.on_seed("torch", "torch.manual_seed", 1_234_567)  # the value, not the object returned
    seeds.on_seed("numpy", "np.random.seed", int(time.time() * 1000))
    seeds.on_seed("random", "random.seed", None)
    assert [(c["call"], c["source"]) for c in seeds.tainted_seeds] == [
        ("torch.manual_seed", "random.randint"),
        ("np.random.seed", "the current time"),
        ("random.seed", "OS entropy (called without a seed)"),
    ]
    assert seeds.seeded == {"torch": False, "numpy": False, "random": False}
    # constants no unseeded source returned are clean, and the last seeding decides
    for value in (0, 1_234_568, 2**31 - 1):
        seeds.on_seed("torch", "torch.manual_seed", value)
        assert seeds.seeded["torch"] is True
    assert len(seeds.tainted_seeds) == 3


def test_a_constant_seed_is_clean_whatever_an_unseeded_source_returned() -> None:
    seeds = SeedWatcher()  # not installed: nothing is patched
    here = sys._getframe()
    seeds.drawn_from("random.randint", 42, here, lambda v: [v], user_only=False)
    drawn = int("4821")  # an int object of its own, as randint returns
    seeds.drawn_from("random.randint", drawn, here, lambda v: [v], user_only=False)
    seeds.on_seed("torch", "torch.manual_seed", 42, sys._getframe())
    seeds.on_seed("torch", "torch.manual_seed", 4821, sys._getframe())
    assert seeds.tainted_seeds == [] and seeds.seeded["torch"] is True
    # the object the source returned is recognised by identity, however small its value
    seeds.on_seed("torch", "torch.manual_seed", drawn, sys._getframe())
    assert [(c["source"], c["rng"]) for c in seeds.tainted_seeds] == [("random.randint", "torch")]


def test_generators_keep_working_and_their_seeding_is_noted(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import pickle
    import time

    monkeypatch.setattr(torch, "Generator", torch.Generator)  # restored after the test
    seeds = SeedWatcher()
    seeds.watch_generators()
    clock = time.time_ns()
    seeds.drawn_from("time.time_ns", clock, sys._getframe(), None, user_only=False)
    g = torch.Generator().manual_seed(clock)
    fixed = torch.Generator().manual_seed(7)
    assert [(c["call"], c["rng"], c["source"]) for c in seeds.tainted_seeds] == [
        ("torch.Generator().manual_seed", "generator", "time.time_ns")
    ]
    assert seeds.seeded == {}  # a generator's seed is not a global RNG's
    # every generator is still a torch.Generator, and torch takes the new ones everywhere
    assert isinstance(g, torch.Generator) and isinstance(torch.default_generator, torch.Generator)
    assert issubclass(torch._C.Generator, torch.Generator)
    loader = torch.utils.data.DataLoader(list(range(8)), shuffle=True, generator=fixed)
    expected = torch.utils.data.DataLoader(
        list(range(8)), shuffle=True, generator=torch._C.Generator().manual_seed(7)
    )
    assert [b.tolist() for b in loader] == [b.tolist() for b in expected]
    # saved, it is a plain generator (loadable without torchrepro)
    buffer = io.BytesIO()
    torch.save(g, buffer)
    assert pickle.loads(pickle.dumps(g)).__class__ is torch._C.Generator
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False).initial_seed() == clock
