"""Write isolation of a check's runs, the parent's half: where each run's writes go, whether the
kernel allows it, what the runs wrote on top of each other where it could not.

Invariants:
- A check's runs never write into the user's working directory: each run's supervisor mounts a
  copy-on-write overlay of it (``_child.overlay``) whose upper layer lives in a directory of the
  check's own outside that directory (overlayfs refuses an upper layer inside its lower one); when
  the run has ended, the layer is moved to ``<run record>/FILES_DIR`` (what the run wrote below the
  working directory, as it left it) and ``FILES_DELETED`` (what it deleted there), and the
  layer's directory is removed. Nothing is copied before or during a run.
- Whether the kernel allows the overlay is tried once per check, with the supervisor itself; when
  it does not (or with ``--no-isolate``) the runs share the working directory, and the check says so
  (``Isolation.mode == "none"`` with the reason).
- Paths outside what is isolated (absolute paths elsewhere, ``/tmp``, mounts below the working
  directory) are watched (``_child.writes``): the paths two runs running at the same time both
  wrote are ``shared_writes``, named in the verdict.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from torchrepro._child.overlay import Overlay, below, submounts
from torchrepro._child.writes import read_writes
from torchrepro.launch import spawn
from torchrepro.results import Isolation
from torchrepro.runrecord import FILES_DELETED, FILES_DIR

__all__ = ["Layers", "describe_shared", "probe", "shared_writes"]


def _layer_base(root: str) -> str | None:
    """A directory outside ``root`` for the upper layers: on ``root``'s filesystem when possible
    (the layers are then moved into the records, not copied)."""
    candidates = []
    for c in (tempfile.gettempdir(), "/var/tmp", "/tmp"):
        real = os.path.realpath(c)
        if (
            os.path.isdir(real)
            and os.access(real, os.W_OK)
            and not below(real, root)
            and real not in candidates
        ):
            candidates.append(real)
    try:
        dev = os.stat(root).st_dev
        same = [c for c in candidates if os.stat(c).st_dev == dev]
    except OSError:
        same = []
    return (same or candidates or [None])[0]  # type: ignore[list-item]


def _rmtree(path: str) -> None:
    """Remove ``path``; overlayfs leaves a mode-000 ``work/work`` directory behind."""

    def retry(func: Any, p: str, exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
        with contextlib.suppress(OSError):
            func(p)

    shutil.rmtree(path, onerror=retry)


class Layers:
    """The upper layers of a check's runs, in one directory of the check's own (outside ``root``)."""

    def __init__(self, base: str, root: str, check_dir: Path) -> None:
        self.base = base
        self.root = root
        self.check_dir = os.path.realpath(check_dir)
        self.made: dict[str, Overlay] = {}

    @classmethod
    def create(cls, check_dir: Path, root: str) -> Layers | None:
        """Layers for a check whose records are ``check_dir`` (None: no place outside ``root``)."""
        base_dir = _layer_base(root)
        if base_dir is None:
            return None
        base = tempfile.mkdtemp(prefix=f"torchrepro-check-{check_dir.name}-", dir=base_dir)
        return cls(base, root, check_dir)

    def _name(self, record_dir: Path) -> str:
        return os.path.relpath(os.path.realpath(record_dir), self.check_dir).replace(os.sep, "-")

    def overlay(self, record_dir: Path) -> Overlay:
        """A fresh layer (empty upper and work directories) for the run recorded in ``record_dir``
        (below the check's directory, which stays the real one in every run: ``keep``)."""
        name = self._name(record_dir)
        layer = os.path.join(self.base, name)
        for sub in ("upper", "work"):
            os.makedirs(os.path.join(layer, sub))
        self.made[name] = overlay = Overlay(root=self.root, layer=layer, keep=(self.check_dir,))
        return overlay

    def hand_over(self, record_dir: Path, to: Path) -> Overlay:
        """The layer of the run recorded in ``record_dir`` (every process of it ended), given to the
        run recorded in ``to``: that run starts in the files the first one left (``check --vary
        resume``), and what both wrote is collected into ``to``."""
        overlay = self.made.pop(self._name(record_dir))
        self.made[self._name(to)] = overlay
        return overlay

    def discard(self, record_dir: Path) -> Overlay | None:
        """Forget the layer of the run recorded in ``record_dir`` and return it (None: none)."""
        return self.made.pop(self._name(record_dir), None)

    def collect(self, record_dir: Path) -> None:
        """Move the writes of the run recorded in ``record_dir`` into it (``FILES_DIR``,
        ``FILES_DELETED``); call when every process of the run has ended."""
        overlay = self.discard(record_dir)
        if overlay is None or not os.path.isdir(overlay.upper):
            return
        deleted: list[str] = []
        for dirpath, dirnames, filenames in os.walk(overlay.upper):
            for entry in [*dirnames, *filenames]:
                path = os.path.join(dirpath, entry)
                with contextlib.suppress(OSError):
                    st = os.lstat(path)
                    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # an overlayfs whiteout
                        os.unlink(path)
                        deleted.append(os.path.relpath(path, overlay.upper))
        if deleted:
            (record_dir / FILES_DELETED).write_text(
                "".join(p + "\n" for p in sorted(deleted)), encoding="utf-8"
            )
        if os.listdir(overlay.upper):
            shutil.move(overlay.upper, record_dir / FILES_DIR)
        _rmtree(overlay.layer)

    def close(self) -> None:
        """Remove the layers' directory (what was not collected is lost)."""
        _rmtree(self.base)


def probe(layers: Layers) -> tuple[bool, str | None]:
    """Whether a run can be isolated here: the supervisor enters a throwaway overlay and starts
    ``true``. Returns (whether a user namespace is needed, None) or (False, why it cannot)."""
    probe_dir = Path(layers.check_dir) / "probe"
    overlay = layers.overlay(probe_dir)
    try:
        proc = spawn(
            ["true"],
            env=os.environ,
            overlay=overlay,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        _, err = proc.communicate(timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"the isolation probe failed: {exc}"
    finally:
        layers.discard(probe_dir)
        _rmtree(overlay.layer)
    if proc.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        return False, (lines[-1] if lines else f"the isolation probe exited with {proc.returncode}")
    return os.geteuid() != 0, None


_IGNORED = ("/dev/", "/proc/", "/sys/")


def _ignored(path: str) -> bool:
    """Paths no run's result depends on: devices and kernel files, caches built to be shared."""
    caches = [os.path.expanduser("~/.cache/"), os.path.expanduser("~/.triton/")]
    caches.append(os.path.join(os.path.realpath(tempfile.gettempdir()), "torchinductor_"))
    return path.startswith((*_IGNORED, *caches))


def shared_writes(
    records: Sequence[Path],
    together: Iterable[Sequence[int]],
    *,
    isolation: Isolation,
    check_dir: Path,
    least: int = 2,
) -> list[str]:
    """The paths at least ``least`` runs that ran at the same time (each group of ``together``,
    indices into ``records``) wrote, outside what isolation kept apart, sorted (``least=1``: the
    paths any of them wrote there, which the others may have read)."""
    check = os.path.realpath(check_dir)
    isolated = isolation.mode == "overlay"
    mounts = submounts(isolation.root) if isolated else []
    writes = [read_writes(r) for r in records]
    shared: set[str] = set()
    for group in together:
        seen: dict[str, int] = {}
        for i in group:
            for path in set(writes[i]):
                if below(path, check) or _ignored(path):
                    continue
                if isolated and below(path, isolation.root) and not any(below(path, m) for m in mounts):
                    continue
                seen[path] = seen.get(path, 0) + 1
                if seen[path] >= least:
                    shared.add(path)
    return sorted(shared)


def describe_shared(paths: Sequence[str], *, isolation: Isolation, limit: int = 3) -> str:
    """One line: the paths the runs wrote on top of each other, and the ways out."""
    shown = ", ".join(paths[:limit]) + (f" and {len(paths) - limit} more" if len(paths) > limit else "")
    if isolation.mode == "overlay":
        where = f"outside the working directory {isolation.root}, which is all a check isolates"
    else:
        where = f"the runs were not isolated: {isolation.reason}"
    return (
        f"the runs wrote the same path(s) at the same time: {shown} ({where}); run the check with "
        "--serial (one run at a time), or give each run its own output path (e.g. an --output "
        "argument of the script)"
    )
