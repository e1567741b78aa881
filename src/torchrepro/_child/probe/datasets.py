"""Which global RNGs a DataLoader's dataset draws from, measured by loading its index 0.

Invariants:
- ``probe_dataset`` loads index 0 a few times (at most ``_PROBE_BUDGET_S`` in all) under global
  RNG states of its own, then restores every global RNG state (Python, NumPy, torch CPU), with
  op tracing paused: the script's draws are unchanged. Side effects of ``__getitem__`` itself (a
  cache, a counter) cannot be undone. It never raises: what it cannot tell it says why.
- ``random_hint`` only reads (types, attribute names, the source of ``__getitem__``): a
  heuristic shown beside the measurement, never instead of it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchrepro import recorder as _recorder
from torchrepro._child.probe.watcher import GLOBAL_RNGS, optional_numpy
from torchrepro._frames import is_user, shown

__all__ = ["probe_dataset", "random_hint"]

_PROBE_SLOW_S = 0.5  # one load slower than this: no further loads (the heuristic decides)
_PROBE_BUDGET_S = 2.0  # all the probe's loads of one dataset
_PROBE_STATES = 8  # other global RNG states tried before deciding a sample does not depend on them


def _sample_key(obj: Any, depth: int = 0) -> Any:
    """A hashable, comparable summary of a loaded sample (tensors, arrays, images, containers)."""
    if depth > 20:
        return "..."
    if obj is None or isinstance(obj, (bool, int, str, bytes)):
        return obj
    if isinstance(obj, float):
        return repr(obj)  # NaN equals itself
    if isinstance(obj, torch.Tensor):
        import hashlib

        t = obj.detach().cpu()
        if t.layout != torch.strided:
            t = t.to_dense()
        flat = t.contiguous().reshape(-1)
        data = flat.view(torch.uint8) if flat.numel() and flat.dtype != torch.bool else flat.to(torch.uint8)
        return ("tensor", str(t.dtype), tuple(t.shape), hashlib.sha1(data.numpy().tobytes()).hexdigest())
    if isinstance(obj, Mapping):
        return ("map", tuple(sorted((repr(k), _sample_key(v, depth + 1)) for k, v in obj.items())))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_sample_key(v, depth + 1) for v in obj))
    tobytes = getattr(obj, "tobytes", None)  # NumPy arrays and scalars, PIL images
    if callable(tobytes):
        return (type(obj).__name__, str(getattr(obj, "shape", getattr(obj, "size", ""))), tobytes())
    fields = getattr(obj, "__dict__", None)
    if isinstance(fields, dict):
        return (type(obj).__name__, _sample_key(fields, depth + 1))
    return (type(obj).__name__, repr(obj))


def _rng_states(numpy: Any) -> dict[str, Any]:
    import random

    return {
        "random": random.getstate(),
        "numpy": numpy.random.get_state() if numpy is not None else None,
        "torch": torch.get_rng_state(),
    }


def _set_rng_states(states: Mapping[str, Any], numpy: Any) -> None:
    import random

    random.setstate(states["random"])
    if numpy is not None and states["numpy"] is not None:
        numpy.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])


def probe_dataset(dataset: Any) -> dict[str, Any]:
    """Decide empirically which global RNGs ``dataset[0]`` draws from.

    Loads index 0 under fixed global RNG states, again under the same states (a sample that
    differs then draws from something no global seed reaches: ``unstable``), then with every
    global RNG set to other states, and if that differs, with each changed alone. A draw may not
    show in one change (a coin flip lands the same way half the time), so each comparison tries
    up to ``_PROBE_STATES`` other states and stops at the first difference. Every global RNG
    state is restored afterwards and op tracing is paused, so the script computes what it would
    have. A dataset that seeds itself per index (torchvision's ``FakeData``) draws nothing.
    When it draws, one more load under the first states, traced line by line, finds the line
    that draws from each (``sites``: RNG -> ``file:line``, where the findings point).
    Returns ``{"ran": False, "reason": ...}`` when it cannot tell (no ``__len__``, an
    ``IterableDataset``, a load that raises, one slow load or ``_PROBE_BUDGET_S`` in all).
    """
    import random
    import time

    import torch.utils.data as data_mod

    if isinstance(dataset, data_mod.IterableDataset):
        return {"ran": False, "reason": "an IterableDataset has no index to load twice"}
    try:
        size = len(dataset)
    except Exception:
        return {"ran": False, "reason": "the dataset has no len()"}
    if size < 1:
        return {"ran": False, "reason": "the dataset is empty"}
    numpy = optional_numpy()
    names = [n for n in GLOBAL_RNGS if n != "numpy" or numpy is not None]
    fixed = {
        seed: {
            "random": random.Random(seed).getstate(),
            "numpy": numpy.random.RandomState(seed).get_state() if numpy is not None else None,
            "torch": torch.Generator().manual_seed(seed).get_state(),
        }
        for seed in range(1, _PROBE_STATES + 2)
    }
    start = time.perf_counter()

    def load(changed: Sequence[str] = (), seed: int = 1) -> Any:
        if time.perf_counter() - start > _PROBE_BUDGET_S:
            raise TimeoutError
        _set_rng_states({n: fixed[seed if n in changed else 1][n] for n in GLOBAL_RNGS}, numpy)
        return _sample_key(dataset[0])

    def differs(changed: Sequence[str], base: Any) -> bool:
        return any(load(changed, seed) != base for seed in range(2, _PROBE_STATES + 2))

    saved = _rng_states(numpy)
    sites: dict[str, str] = {}
    try:
        with _recorder.paused():
            base = load()
            if time.perf_counter() - start > _PROBE_SLOW_S:
                return {"ran": False, "reason": f"loading one sample takes over {_PROBE_SLOW_S} s"}
            unstable = load() != base
            draws = []
            if not unstable and differs(names, base):
                draws = [n for n in names if differs((n,), base)] or names  # only together: all
            if draws:
                _set_rng_states(fixed[1], numpy)
                with contextlib.suppress(Exception):
                    sites = _draw_sites(dataset, draws, numpy)
    except TimeoutError:
        return {"ran": False, "reason": f"loading index 0 again and again took over {_PROBE_BUDGET_S} s"}
    except Exception as exc:
        return {"ran": False, "reason": f"loading index 0 raised {type(exc).__name__}"}
    finally:
        _set_rng_states(saved, numpy)
    out: dict[str, Any] = {"ran": True, "draws": draws, "unstable": unstable}
    if sites:
        out["sites"] = sites
    return out


def _rng_reader(name: str, numpy: Any) -> Any:
    """A cheap comparable snapshot of one global RNG's state."""
    import random

    if name == "random":
        return random.getstate
    if name == "numpy":
        return lambda: (lambda st: (st[1].tobytes(), st[2], st[3], st[4]))(numpy.random.get_state())
    return lambda: torch.get_rng_state().numpy().tobytes()


def _draw_sites(dataset: Any, draws: Sequence[str], numpy: Any) -> dict[str, str]:
    """The user's line where loading ``dataset[0]`` first draws from each global RNG of
    ``draws``: one load traced line by line in the user's own files (not in installed packages,
    torch or the standard library: a draw inside a torchvision transform is the user's line that
    calls it), the RNG states compared after every line. Nothing when something else traces
    (a debugger, coverage): its tracing is left alone."""
    if sys.gettrace() is not None:
        return {}
    readers = {name: _rng_reader(name, numpy) for name in draws}
    before = {name: read() for name, read in readers.items()}
    sites: dict[str, str] = {}
    last: list[tuple[str, int] | None] = [None]

    def check() -> None:
        for name, read in readers.items():
            if name in sites:
                continue
            now = read()
            if now != before[name]:
                before[name] = now
                if last[0] is not None:
                    sites[name] = f"{shown(last[0][0])}:{last[0][1]}"

    def own(code: Any) -> bool:
        parts = code.co_filename.split(os.sep)
        return "site-packages" not in parts and "dist-packages" not in parts

    def local(frame: Any, event: str, arg: Any) -> Any:
        check()
        if event == "line":
            last[0] = (frame.f_code.co_filename, frame.f_lineno)
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        if event != "call" or not is_user(frame) or not own(frame.f_code):
            return None
        check()
        return local

    sys.settrace(calls)
    try:
        dataset[0]
    finally:
        sys.settrace(None)
    check()
    return sites


_RANDOM_SOURCE = re.compile(
    r"\b(random\.\w+\(|np\.random\.|numpy\.random\.|torch\.(rand|randn|randint|randperm|bernoulli|normal|"
    r"multinomial)\b|\.(uniform_|normal_|random_|bernoulli_)\(|default_rng\()"
)


def random_hint(dataset: Any) -> str | None:
    """A short reason to think ``dataset`` draws random numbers per sample, else None (a heuristic)."""
    stack: list[Any] = [dataset]
    seen: set[int] = set()
    names: list[str] = []
    while stack and len(seen) < 50:
        obj = stack.pop()
        if id(obj) in seen or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            stack.extend(obj)
            continue
        cls = type(obj).__name__
        if cls.startswith("Random") or cls in (
            "ColorJitter",
            "AutoAugment",
            "RandAugment",
            "TrivialAugmentWide",
        ):
            names.append(cls)
        for attr in (
            "transform",
            "transforms",
            "target_transform",
            "augment",
            "augmentation",
            "dataset",
            "datasets",
        ):
            with contextlib.suppress(Exception):
                stack.append(getattr(obj, attr, None))
    if names:
        return "transforms " + ", ".join(sorted(set(names)))
    getitem = getattr(type(dataset), "__getitem__", None)
    try:
        source = inspect.getsource(getitem) if getitem is not None else ""
    except (OSError, TypeError):
        source = ""
    m = _RANDOM_SOURCE.search(source)
    if m:
        return f"{type(dataset).__name__}.__getitem__ calls {m.group(0).rstrip('(')}"
    return None
