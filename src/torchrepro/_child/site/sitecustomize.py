"""torchrepro's ``sitecustomize``: first on ``PYTHONPATH`` in a recorded run's environment.

Every python the run's script starts (ranks, multiprocessing children, ``subprocess`` of
``sys.executable``) imports it at start-up. It runs the ``sitecustomize`` the interpreter would
otherwise have found (the user's, if any, first), then lets ``torchrepro._child.children.adopt``
configure the process when it belongs to the run. Outside a run it imports neither torch nor
anything beyond the protocol's names.
"""

from __future__ import annotations

import os
import sys


def _chain() -> None:
    """Import the next ``sitecustomize`` on the path, as site would have without this one."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401  (the next one)
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        sys.path[:] = saved


def _adopt() -> None:
    try:
        from torchrepro.protocol import in_run
    except ImportError:  # this python cannot import torchrepro: nothing to configure
        return
    if in_run():
        from torchrepro._child.children import adopt

        adopt()


_chain()
_adopt()
