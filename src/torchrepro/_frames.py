"""The user's line in a stack of frames: the one walker that op tracing and the child's hooks use.

Invariants:
- A frame is *library* when its file lies in torch (once loaded), torchrepro (the whole package)
  or the standard library, or its file name is not a path (``<frozen ...>``, ``<string>`` of
  code that dataclasses, namedtuples or ``torch.fx`` generate): never the user's line.
- A frame is *framework* when its file lies in a loaded package of ``FRAMEWORKS`` (Lightning,
  transformers, accelerate). With ``skip_frameworks=True`` (what tracing and the audit both use)
  such a frame is passed like a library frame: a user who trains with Lightning wants their own
  line (their ``training_step``, or the ``trainer.fit(...)`` call that made Lightning act), not a
  line inside Lightning. The framework passed on the way is reported, so findings can name its
  settings. With ``skip_frameworks=False`` framework code counts as the user's.
- Every other frame is the user's. The kind of a code object is decided once and cached by code
  object (code objects live as long as their functions, in practice for the whole process), so
  a walk costs one dict lookup per frame: tracing walks once per aten op.
- A location is ``file:line``, the path relative to the walker's directory (the current directory
  when the ``Walker`` was made: where torchrepro was started, also after the script changes
  directory) when the file is below it, else absolute.
- ``user_site`` is the child's hooks' and probe's walker, made when this module is first imported
  (in the child: before the script runs, so its locations are relative to where it was started).
- Standard library only; torch is looked up in ``sys.modules``, never imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection, Mapping
from types import CodeType, FrameType
from typing import Final

__all__ = ["FRAMEWORKS", "Walker", "is_user", "shown", "user_frame", "user_site"]

FRAMEWORKS: Final[Mapping[str, str]] = {
    "lightning": "lightning",
    "lightning_fabric": "lightning",
    "lightning_utilities": "lightning",
    "pytorch_lightning": "pytorch_lightning",
    "transformers": "transformers",
    "accelerate": "accelerate",
}
"""Top-level packages whose frames are the framework's, not the user's -> the framework's name."""

USER: Final = 0
LIBRARY: Final = 1
FRAMEWORK: Final = 2
STOP: Final = 3
MARK: Final = 4
"""Kinds of code a walk tells apart (``STOP`` and ``MARK`` only for a walker given such codes)."""

_TORCHREPRO_DIR: Final = os.path.normcase(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR: Final = os.path.normcase(os.path.dirname(os.path.abspath(os.__file__))) + os.sep

# Code object -> (USER | LIBRARY | FRAMEWORK, the framework's name): shared by every walker.
_BASE: dict[CodeType, tuple[int, str | None]] = {}
# A walker's configuration -> code object -> its kind: shared by the walkers made alike.
_KINDS: dict[tuple[bool, frozenset[CodeType], tuple[str, ...]], dict[CodeType, int]] = {}


def _package_dir(name: str) -> str | None:
    """The directory (normalised, with a trailing separator) of the loaded package ``name``."""
    path = getattr(sys.modules.get(name), "__file__", None)
    if not isinstance(path, str) or not path:
        return None
    return os.path.normcase(os.path.dirname(os.path.abspath(path))) + os.sep


def _base_kind(code: CodeType) -> tuple[int, str | None]:
    kind = _BASE.get(code)
    if kind is None:
        filename = code.co_filename
        if filename.startswith("<"):
            kind = (LIBRARY, None)
        else:
            path = os.path.normcase(os.path.abspath(filename))
            torch_dir = _package_dir("torch")
            if path.startswith((_TORCHREPRO_DIR, _STDLIB_DIR)) or (torch_dir and path.startswith(torch_dir)):
                kind = (LIBRARY, None)
            else:
                kind = (USER, None)
                for package, framework in FRAMEWORKS.items():
                    directory = _package_dir(package)
                    if directory is not None and path.startswith(directory):
                        kind = (FRAMEWORK, framework)
                        break
        _BASE[code] = kind
    return kind


class Walker:
    """Finds the user's frame in a stack and shows its line.

    ``stop``: code objects at which a walk ends without a user line (tracing: autograd's engine
    entry); ``mark``: directories (normalised, ending in a separator) whose frames are passed like
    library frames but noted (tracing: torch's data loading code). Walkers made alike share one
    cache of kinds; each keeps its directory and the paths it has shown.
    """

    def __init__(
        self,
        *,
        skip_frameworks: bool = True,
        stop: Collection[CodeType] = (),
        mark: tuple[str, ...] = (),
    ) -> None:
        self.skip_frameworks = skip_frameworks
        self._stop = frozenset(stop)
        self._mark = mark
        self._kinds = _KINDS.setdefault((skip_frameworks, self._stop, mark), {})
        self._shown: dict[str, str] = {}
        self._cwd = os.path.normcase(os.getcwd())

    def kind(self, code: CodeType) -> int:
        """The kind of ``code`` for this walker (cached)."""
        kind = self._kinds.get(code)
        if kind is None:
            if code in self._stop:
                kind = STOP
            elif self._mark and os.path.normcase(os.path.abspath(code.co_filename)).startswith(self._mark):
                kind = MARK
            else:
                kind = _base_kind(code)[0]
                if kind == FRAMEWORK and not self.skip_frameworks:
                    kind = USER
            self._kinds[code] = kind
        return kind

    def show(self, filename: str) -> str:
        """``filename`` as a location shows it: relative to the walker's directory when below it."""
        shown = self._shown.get(filename)
        if shown is None:
            path = os.path.abspath(filename)
            below = os.path.normcase(path).startswith(self._cwd + os.sep)
            shown = os.path.relpath(path, self._cwd) if below else path
            self._shown[filename] = shown
        return shown

    def walk(
        self, frame: FrameType | None, *, outer: bool = False
    ) -> tuple[str | None, str | None, bool, bool]:
        """``(location, framework, stopped, marked)`` for the stack that ``frame`` starts.

        ``location``: ``file:line`` of the innermost user frame (None if none, or a ``stop`` code
        came first: then ``stopped``); ``marked``: a ``mark`` frame was passed before it;
        ``framework``: the framework nearest the user's line: one whose frames were passed on the
        way to it, else (``outer=True`` only) the first one further out (a loader the user's
        ``train_dataloader`` builds while ``trainer.fit`` runs).
        """
        kinds = self._kinds
        marked = False
        framework: str | None = None
        while frame is not None:
            code = frame.f_code
            kind = kinds.get(code)
            if kind is None:
                kind = self.kind(code)
            if kind == LIBRARY:  # most frames: checked first
                frame = frame.f_back
                continue
            if kind == USER:
                location = f"{self.show(code.co_filename)}:{frame.f_lineno}"
                if framework is None and outer:
                    framework = self._outer_framework(frame.f_back)
                return location, framework, False, marked
            if kind == STOP:
                return None, framework, True, marked
            if kind == MARK:
                marked = True
            elif kind == FRAMEWORK:
                framework = _base_kind(code)[1]  # the last one passed: nearest the user's line
            frame = frame.f_back
        return None, framework, False, marked

    def frame(self, frame: FrameType | None) -> FrameType | None:
        """The innermost user frame of the stack ``frame`` starts (None: none, or a ``stop`` code first)."""
        while frame is not None:
            kind = self.kind(frame.f_code)
            if kind == USER:
                return frame
            if kind == STOP:
                return None
            frame = frame.f_back
        return None

    def _outer_framework(self, frame: FrameType | None) -> str | None:
        while frame is not None:
            if self.kind(frame.f_code) == FRAMEWORK:
                return _base_kind(frame.f_code)[1]
            frame = frame.f_back
        return None


_CHILD = Walker()


def user_site(frame: FrameType | None = None, *, outer: bool = True) -> tuple[str | None, str | None]:
    """``file:line`` of the user's line in the stack ``frame`` starts (default: the caller's) and
    the framework nearest it, as the child's hooks and probe report them (see :meth:`Walker.walk`)."""
    location, framework, _, _ = _CHILD.walk(frame or sys._getframe(1), outer=outer)
    return location, framework


def user_frame(frame: FrameType | None = None) -> FrameType | None:
    """The user's frame in the stack ``frame`` starts (default: the caller's), as ``user_site``
    finds its line; None when the stack holds none."""
    return _CHILD.frame(frame or sys._getframe(1))


def is_user(frame: FrameType) -> bool:
    """Whether ``frame`` runs the user's code (what ``user_frame`` would stop at), in one lookup."""
    return _CHILD.kind(frame.f_code) == USER


def shown(filename: str) -> str:
    """``filename`` as ``user_site`` shows it in a location."""
    return _CHILD.show(filename)
