"""The DataLoaders the script makes: where, how their order is drawn, what their dataset draws.

Invariants:
- ``LoaderWatcher`` wraps ``DataLoader.__init__`` (subclasses included): after the original
  ran, it records the loader (its user line, the framework, workers, generator, the sampler
  given or made) and probes its dataset (``datasets.probe_dataset``) once per dataset object;
  a ``SeededLoader``'s dataset is not probed (it seeds every sample).
- A framework rebuilding a loader over the same dataset from the same user line (the HF
  Trainer, then accelerate's prepare) replaces the earlier record: one loader, one finding.
- The sampler facts are read again at each ``collect``: a framework may swap the sampler after
  creating the loader (accelerate's ``set_sampler``). Loaders are held weakly.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Mapping
from typing import Any

from torchrepro._child.probe.datasets import probe_dataset, random_hint
from torchrepro._frames import user_site

__all__ = ["LoaderWatcher", "sampler_facts"]


def sampler_facts(loader: Any, given: str | None) -> dict[str, Any]:
    """The sampler that draws the order (the one given, alone or inside a batch sampler, or the
    one DataLoader made from ``shuffle=``, which takes the loader's generator) and whether it is
    seeded: it holds a generator, or it is accelerate's ``SeedableRandomSampler`` (it seeds itself
    each pass from ``data_seed`` or torch's initial seed)."""
    import torch.utils.data as data_mod

    sampler = loader.sampler
    if given == "batch_sampler" or not isinstance(sampler, data_mod.RandomSampler):
        inner = getattr(loader.batch_sampler, "sampler", None)
        sampler = inner if inner is not None else sampler
    return {
        "shuffle": isinstance(sampler, data_mod.RandomSampler),
        "sampler": type(sampler).__name__,
        "sampler_generator": getattr(sampler, "generator", None) is not None
        or type(sampler).__name__ == "SeedableRandomSampler",
    }


class LoaderWatcher:
    """Records each DataLoader the script makes (``dataloaders``)."""

    def __init__(self) -> None:
        self._loaders: list[tuple[Any, dict[str, Any]]] = []  # (weakref to the loader, its record)
        self._probed: dict[int, tuple[Any, dict[str, Any]]] = {}  # id(dataset) -> (dataset, probe)

    def install(self) -> None:
        import torch.utils.data as data_mod

        watcher = self
        original_init = data_mod.DataLoader.__init__
        signature = inspect.signature(original_init)

        @functools.wraps(original_init)
        def init(loader: Any, *a: Any, **kw: Any) -> None:
            original_init(loader, *a, **kw)
            with contextlib.suppress(Exception):
                watcher.record(loader, signature.bind(loader, *a, **kw).arguments)

        data_mod.DataLoader.__init__ = init  # type: ignore[method-assign,assignment]

    def after_fork(self) -> None:
        self._loaders = []

    def collect(self) -> dict[str, Any]:
        return {"dataloaders": tuple(self.records())}

    def record(self, loader: Any, arguments: Mapping[str, Any]) -> None:
        """``loader`` was made with ``arguments`` (``DataLoader.__init__``'s, bound)."""
        import weakref

        seeded = any(
            c.__name__ == "SeededLoader" and c.__module__.startswith("torchrepro")
            for c in type(loader).__mro__
        )
        given = "batch_sampler" if arguments.get("batch_sampler") is not None else None
        given = "sampler" if arguments.get("sampler") is not None else given
        location, framework = user_site()
        dataset = loader.dataset
        probe: dict[str, Any] = {"ran": False, "reason": "a SeededLoader seeds every sample"}
        earlier = self._probed.get(id(dataset))
        if seeded:
            pass
        elif earlier is not None and earlier[0] is dataset:
            probe = earlier[1]
        else:
            probe = probe_dataset(dataset)
            self._probed[id(dataset)] = (dataset, probe)
        record = {
            "location": location,
            "framework": framework,
            "class": type(loader).__name__,
            "dataset": type(dataset).__name__,
            "seeded_loader": seeded,
            "num_workers": int(loader.num_workers),
            "worker_init_fn": loader.worker_init_fn is not None,
            "generator": loader.generator is not None,
            "sampler_given": given,
            **sampler_facts(loader, given),
            "probe": probe,
            "random_hint": random_hint(dataset),
        }
        # a framework rebuilding a loader over the same dataset from the same user line (the HF
        # Trainer, then accelerate's prepare) replaces the earlier record: one loader, one finding
        for i, (_, old) in enumerate(self._loaders):
            if old["location"] == location and old.get("_dataset") == id(dataset) and not seeded:
                del self._loaders[i]
                break
        record["_dataset"] = id(dataset)
        self._loaders.append((weakref.ref(loader), record))

    def records(self) -> list[dict[str, Any]]:
        """The loaders' records, their sampler facts read now: a framework may swap the sampler
        after creating the loader (accelerate's ``set_sampler``)."""
        out = []
        for ref, record in self._loaders:
            loader = ref()
            if loader is not None:
                with contextlib.suppress(Exception):
                    record.update(sampler_facts(loader, record["sampler_given"]))
            out.append({k: v for k, v in record.items() if not k.startswith("_")})
        return out
