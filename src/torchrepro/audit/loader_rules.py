"""The data-loading rules: findings for each DataLoader the probe saw, and for seeds drawn from
unseeded sources (TR3xx).

Invariants:
- Pure functions of the probe's records (``ProbeSettings.dataloaders``, ``tainted_seeds``): the
  keys are read with defaults, so a record without one is judged on the rest.
- Data findings trust the probe's measurement (which global RNGs a dataset draws from) over the
  source heuristic, which decides only when the probe could not run. A dataset drawing from a
  global RNG is a finding only when that draw is unseeded where it runs: in the main process,
  the script's own seeding of that RNG; in workers (torch reseeds random, NumPy and torch from
  the base seed), the loader's ``generator=`` or the script's torch seed.
- A fix names the framework's own seeding setting when the loader (or seed) came through one.
- TR304 points at the line of ``__getitem__`` that draws (the probe's ``sites``), naming the
  loader's line in its message; at the loader's line when the probe could not trace the draw.
  The loader's other findings point at the loader.
- One finding per code and line (``dataloader_findings``): the loaders made at one line (each
  epoch, a helper called for training and validation, each process of a run) share a cause, and
  their findings are one, saying how many loaders it covers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torchrepro.audit.findings import Finding, settings_finding

__all__ = ["dataloader_findings", "loader_findings", "tainted_seed_finding"]


_RNG_NAMES = {
    "random": "Python's global random",
    "numpy": "NumPy's global RNG",
    "torch": "torch's global RNG",
    "generator": "a torch.Generator",
    "numpy_generator": "a NumPy Generator",
}
_RNG_SEEDS = {"random": "random.seed(0)", "numpy": "np.random.seed(0)", "torch": "torch.manual_seed(0)"}
_FRAMEWORK_FIX = {
    "lightning": "With Lightning: call lightning.seed_everything(0, workers=True) before trainer.fit "
    "(it seeds random, NumPy and torch, and gives the DataLoader workers a worker_init_fn); a DataModule's "
    "DataLoader takes generator=torch.Generator().manual_seed(0).",
    "pytorch_lightning": "With Lightning: call pytorch_lightning.seed_everything(0, workers=True) before "
    "trainer.fit; a DataModule's DataLoader takes generator=torch.Generator().manual_seed(0).",
    "transformers": "With the HF Trainer: TrainingArguments(seed=0) seeds random, NumPy and torch when the "
    "Trainer is created, and data_seed= seeds its sampler; seed nothing randomly after that.",
    "accelerate": "With accelerate: call accelerate.utils.set_seed(0) before accelerator.prepare(...); "
    "Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)) seeds the order.",
}


def _names(rngs: Sequence[str]) -> str:
    return " and ".join(_RNG_NAMES.get(r, r) for r in rngs)


def _with_framework(fix: str, loader: Mapping[str, Any]) -> str:
    extra = _FRAMEWORK_FIX.get(str(loader.get("framework")))
    return f"{fix} {extra}" if extra else fix


def loader_findings(loader: Mapping[str, Any], seeded: Mapping[str, Any] | None = None) -> list[Finding]:
    """Findings for one DataLoader the probe saw (``seeded``: which global RNGs the script seeded)."""
    if loader.get("seeded_loader"):
        return []
    seeded = seeded or {}
    out = []
    location = loader.get("location")
    workers = int(loader.get("num_workers") or 0)
    dataset = loader.get("dataset") or "the dataset"
    probe = loader.get("probe") if isinstance(loader.get("probe"), Mapping) else None
    measured = probe is not None and probe.get("ran") is True
    draws: list[str] = list(probe.get("draws") or ()) if measured and probe else []
    unstable = bool(measured and probe and probe.get("unstable"))
    hint = f"{dataset}.__getitem__ draws from {_names(draws)}" if draws else None
    if not measured:
        hint = loader.get("random_hint")
    fix_seed = (
        "or better, draw the randomness from torchrepro.sample_rng() inside __getitem__ and load with "
        "torchrepro.SeededLoader (the same samples for any num_workers)."
    )
    sites = probe.get("sites") if measured and probe and isinstance(probe.get("sites"), Mapping) else {}

    def drawn_at(rngs: Sequence[str]) -> tuple[str | None, str]:
        """Where TR304 points: the line of __getitem__ that draws (the loader's line when the
        probe could not trace the load), and the loader's line for the message."""
        site = next((sites[r] for r in rngs if isinstance(sites.get(r), str)), None)
        made = f"the DataLoader at {location}" if site and location else ""
        return (site or location), made

    if draws:
        if workers == 0:
            unseeded = [r for r in draws if not seeded.get(r, True)]
            if unseeded:
                where, made = drawn_at(unseeded)
                out.append(
                    settings_finding(
                        "TR304",
                        "warning",
                        f"{dataset}.__getitem__ (loaded in the main process, num_workers=0"
                        + (f", by {made}" if made else "")
                        + f") draws from {_names(unseeded)} here, which the script never seeds: its "
                        "samples differ every run (found by loading one sample twice under different "
                        "global RNG states).",
                        _with_framework(
                            f"Seed it before loading ({', '.join(_RNG_SEEDS[r] for r in unseeded)}, or "
                            f"torchrepro.seed_everything(0)), {fix_seed}",
                            loader,
                        ),
                        where,
                    )
                )
        elif not loader.get("generator") and not seeded.get("torch", True):
            where, made = drawn_at(draws)
            out.append(
                settings_finding(
                    "TR304",
                    "warning",
                    f"{dataset}.__getitem__ draws from {_names(draws)} here, in {workers} DataLoader workers"
                    + (f" of {made}" if made else "")
                    + ". "
                    "torch reseeds random, NumPy and torch in each worker from the loader's base seed, but "
                    "that base seed is drawn from torch's global RNG, which the script never seeds, and the "
                    "loader has no generator=: its samples differ every run (found by loading one sample "
                    "twice under different global RNG states).",
                    _with_framework(
                        "Seed torch before iterating (torch.manual_seed(0) or torchrepro.seed_everything(0)) "
                        f"or pass DataLoader(generator=torch.Generator().manual_seed(0)), {fix_seed}",
                        loader,
                    ),
                    where,
                )
            )
    if unstable:
        out.append(
            settings_finding(
                "TR306",
                "warning",
                f"{dataset}[0] differs between two loads under the same global RNG states: __getitem__ "
                "draws from something no global seed reaches (an unseeded np.random.default_rng() or "
                "torch.Generator, random.Random(), time, os.urandom), or it changes state as it loads.",
                "Draw per-sample randomness from torchrepro.sample_rng() inside __getitem__ (keyed by seed, "
                "epoch and index), or seed the generator the dataset holds.",
                location,
            )
        )
    if workers > 0 and hint:
        out.append(
            settings_finding(
                "TR301",
                "warning",
                f"A plain DataLoader with num_workers={workers} runs random augmentation ({hint}): each "
                "worker seeds itself with base_seed + worker_id, so which worker handles a sample, and so "
                "its augmentation, changes with num_workers (and with the base seed drawn from the global "
                "torch RNG).",
                _with_framework(
                    "Use torchrepro.SeededLoader (same batches for any num_workers) and draw augmentation "
                    "randomness from torchrepro.sample_rng() inside __getitem__.",
                    loader,
                ),
                location,
            )
        )
    elif workers > 0 and not measured:
        out.append(
            settings_finding(
                "TR302",
                "info",
                f"A plain DataLoader with num_workers={workers}: if __getitem__ draws random numbers, the "
                "result depends on num_workers (workers seed with base_seed + worker_id).",
                "Use torchrepro.SeededLoader, and torchrepro.sample_rng() for per-sample randomness.",
                location,
            )
        )
    sampler_generator = loader.get("sampler_generator", loader.get("generator"))
    if loader.get("shuffle") and not sampler_generator:
        given = loader.get("sampler_given")
        sampler = loader.get("sampler") or "RandomSampler"
        if given:
            ignored = (
                " The DataLoader's generator= does not reach it (it seeds only the workers' base seed)."
                if loader.get("generator")
                else ""
            )
            message = (
                f"The {sampler} given as {given}= has no generator: it draws the order from the global "
                "torch RNG, so any extra draw before it (a new layer, a validation pass) changes the "
                f"training batches.{ignored}"
            )
            fix = (
                f"Give the generator to the sampler: {sampler}(dataset, generator=torch.Generator()"
                ".manual_seed(seed)); DataLoader(generator=...) is not used by a sampler you pass."
            )
        else:
            message = (
                "A shuffling DataLoader without generator= draws its order from the global torch RNG: any "
                "extra draw before it (a new layer, a validation pass) changes the training batches."
            )
            fix = "Pass generator=torch.Generator().manual_seed(seed), or use torchrepro.SeededLoader."
        out.append(settings_finding("TR303", "info", message, _with_framework(fix, loader), location))
    return out


def dataloader_findings(
    loaders: Iterable[Mapping[str, Any]], seeded: Mapping[str, Any] | None = None
) -> list[Finding]:
    """Findings for every DataLoader the probe saw, one per code and line: those of the loaders
    made at one line are one finding (the first loader's), which says how many loaders, and which
    datasets when they differ, it covers. A loader's own ``seeded`` (one of another process than
    the judged one) is used over ``seeded``.
    """
    groups: dict[tuple[str, str | None], list[tuple[Finding, Mapping[str, Any]]]] = {}
    for loader in loaders:
        for f in loader_findings(loader, loader.get("seeded", seeded)):
            groups.setdefault((f.code, f.location), []).append((f, loader))
    out = []
    for group in groups.values():
        first = group[0][0]
        if len(group) > 1:
            made = list(
                dict.fromkeys(str(loader.get("location") or "an unknown line") for _, loader in group)
            )
            datasets = list(dict.fromkeys(str(loader.get("dataset") or "?") for _, loader in group))
            note = f" This finding covers the {len(group)} DataLoaders created at {', '.join(made)}"
            note += f" (datasets {', '.join(datasets)})." if len(datasets) > 1 else "."
            first = dataclasses.replace(first, message=first.message + note)
        out.append(first)
    return out


def tainted_seed_finding(call: Mapping[str, Any]) -> Finding:
    """TR305: a seeding call whose value came from an unseeded source (the probe's record of it)."""
    what = call.get("call") or "a seeding call"
    source = call.get("source") or "an unseeded source"
    if source.startswith("OS entropy"):
        origin = "OS entropy (no seed given)"
    elif source == "the current time":
        origin = "the current time"
    elif source.startswith("time."):
        origin = f"the current time ({source})"
    elif source == "os.getpid":
        origin = "the process id (os.getpid: another one every run)"
    elif source.startswith(("random.", "np.random.")):
        origin = f"a value drawn from {source} before anything seeded that RNG"
    else:
        origin = f"a value from {source}, which no seed reaches"
    message = (
        f"{what} seeds {_RNG_NAMES.get(str(call.get('rng')), 'an RNG')} from {origin}: the seed, and "
        "everything it seeds, changes every run."
    )
    fix = (
        "Seed with a fixed value (e.g. 0), or take it from the command line or config and log it; "
        "torchrepro run --seed N seeds everything."
    )
    extra = _FRAMEWORK_FIX.get(str(call.get("framework")))
    return settings_finding(
        "TR305", "warning", message, f"{fix} {extra}" if extra else fix, call.get("location")
    )
