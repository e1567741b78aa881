"""Write isolation of one run: a copy-on-write overlay of the working directory in a private mount
namespace, entered by the supervisor before it starts the script (``check`` only, never ``run``).

Invariants:
- ``enter`` runs in a single-threaded process (the supervisor) before anything is started: it
  unshares a mount namespace (as root; else a user namespace with the caller's own uid and gid
  mapped, so the script keeps its uid and loses the namespace's capabilities at ``exec``), makes
  every mount private (nothing mounted here is seen by the host, nothing the host mounts later is
  seen here), mounts an overlay on ``root`` (lower: ``root`` itself, read live, never copied;
  upper: ``<layer>/upper``, outside ``root``) and binds back, at their own paths, the mounts below
  ``root`` (the overlay would hide them) and the ``keep`` directories (the check's records, which
  the parent reads live): writes there reach the real files.
- Nothing is mounted in the caller's namespace: when the last process of the run ends, the
  namespace and its mounts are gone; the upper layer stays in ``layer`` for the parent to collect.
- It uses libc through ``ctypes`` (python 3.11 has no ``os.unshare``), not util-linux's ``unshare``
  and ``mount`` programs: no program has to be installed, the supervisor stays one process, and
  ``mount(8)`` refuses a user that is not uid 0 even where the kernel allows the mount.
- Standard library only (the supervisor imports it before anything else).
"""

from __future__ import annotations

import ctypes
import json
import os
from dataclasses import dataclass

__all__ = ["Overlay", "OverlayError", "below", "enter", "submounts"]

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 0x40000


class OverlayError(OSError):
    """The overlay could not be set up (the message says which step and why)."""


@dataclass(frozen=True)
class Overlay:
    """What ``enter`` sets up: ``root`` (absolute, symlinks resolved) overlaid with ``<layer>/upper``
    (``<layer>/work`` is overlayfs's work directory); ``keep``: directories below ``root`` that stay
    the real ones."""

    root: str
    layer: str
    keep: tuple[str, ...] = ()

    @property
    def upper(self) -> str:
        """Where the run's writes below ``root`` go."""
        return os.path.join(self.layer, "upper")

    @property
    def work(self) -> str:
        """overlayfs's work directory (same filesystem as ``upper``)."""
        return os.path.join(self.layer, "work")

    def to_arg(self) -> str:
        """One command-line argument (JSON)."""
        return json.dumps({"root": self.root, "layer": self.layer, "keep": list(self.keep)})

    @classmethod
    def from_arg(cls, text: str) -> Overlay:
        """Read ``to_arg``'s argument (``ValueError`` when malformed)."""
        d = json.loads(text)
        if not (isinstance(d, dict) and isinstance(d.get("root"), str) and isinstance(d.get("layer"), str)):
            raise ValueError(f"not an overlay description: {text!r}")
        keep = d.get("keep", [])
        if not (isinstance(keep, list) and all(isinstance(k, str) for k in keep)):
            raise ValueError(f"not an overlay description: {text!r}")
        return cls(root=d["root"], layer=d["layer"], keep=tuple(keep))


def below(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies below it (both absolute)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def _libc() -> ctypes.CDLL:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError as exc:  # pragma: no cover - no libc
        raise OverlayError(f"no C library to call unshare/mount through: {exc}") from None


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OverlayError(err, f"{what}: {os.strerror(err)}")


def _mount(
    libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    enc = os.fsencode
    result = libc.mount(
        None if source is None else enc(source),
        enc(target),
        None if fstype is None else enc(fstype),
        ctypes.c_ulong(flags),
        None if data is None else enc(data),
    )
    shown = f"mount {fstype or 'bind'} {source or ''} on {target}".replace("  ", " ")
    _check(result, shown)


def _unshare(libc: ctypes.CDLL) -> bool:
    """A private mount namespace; True when a user namespace was needed (not root)."""
    if os.geteuid() == 0 and libc.unshare(_CLONE_NEWNS) == 0:
        return False
    uid, gid = os.geteuid(), os.getegid()
    _check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS), "unshare(CLONE_NEWUSER|CLONE_NEWNS)")
    # the caller's own ids, mapped to themselves: the script keeps its uid; an unprivileged
    # process may map only its own ids, and gid_map needs setgroups denied first
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except FileNotFoundError:
            if name != "setgroups":  # kernels before 3.19 have no setgroups file
                raise
        except OSError as exc:
            raise OverlayError(exc.errno, f"writing /proc/self/{name}: {exc.strerror}") from None
    return True


def _unescape(field: str) -> str:
    """A path field of ``/proc/self/mountinfo`` (space, tab, newline, backslash are octal escapes)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def submounts(root: str) -> list[str]:
    """Mount points strictly below ``root`` (outermost first; nested ones are left out: a recursive
    bind of the outer one brings them)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            points = [_unescape(line.split()[4]) for line in f if len(line.split()) > 4]
    except OSError:
        return []
    prefix = root.rstrip("/") + "/"
    below = sorted({p for p in points if p.startswith(prefix)})
    outer: list[str] = []
    for p in below:
        if not any(p.startswith(o.rstrip("/") + "/") for o in outer):
            outer.append(p)
    return outer


def _escape_option(path: str) -> str:
    """A path as an overlayfs mount option value (``\\``, ``,`` and ``:`` escaped)."""
    return path.replace("\\", "\\\\").replace(",", "\\,").replace(":", "\\:")


def enter(overlay: Overlay) -> bool:
    """Enter a private mount namespace in which ``overlay.root`` is overlaid; chdir into the
    overlay when the current directory is below ``root``. Returns whether a user namespace was
    used. Raises ``OverlayError`` naming the step that failed (nothing is left mounted outside)."""
    libc = _libc()
    cwd = os.getcwd()
    userns = _unshare(libc)
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE, None)
    back = [*submounts(overlay.root), *overlay.keep]
    fds: list[tuple[int, str]] = []
    try:
        for path in back:  # opened before the overlay hides them
            fds.append((os.open(path, os.O_PATH | os.O_CLOEXEC), path))
        options = [
            f"lowerdir={_escape_option(overlay.root)}",
            f"upperdir={_escape_option(overlay.upper)}",
            f"workdir={_escape_option(overlay.work)}",
        ]
        # userxattr: the overlay's own marks in user.* xattrs (an unprivileged mount may not write
        # trusted.*); as root, redirect_dir lets a script rename a directory it did not create
        extra = ["userxattr"] if userns else ["redirect_dir=on"]
        try:
            _mount(libc, "overlay", overlay.root, "overlay", 0, ",".join(options + extra))
        except OverlayError:
            if userns:
                raise
            _mount(libc, "overlay", overlay.root, "overlay", 0, ",".join(options))
        for fd, path in fds:
            _mount(libc, f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC, None)
    finally:
        for fd, _ in fds:
            os.close(fd)
    if below(cwd, overlay.root):
        os.chdir(cwd)  # the old cwd is the directory below the overlay: enter the overlay
    return userns
