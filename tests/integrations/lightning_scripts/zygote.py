"""Fork server: imports torch, Lightning and ``train.py`` once, then forks one child per run.

Reads JSON lines on stdin: ``{"op": "run", "argv": [...], "env": {...}, "log": path}`` forks a
child that runs ``train.main(argv)`` with ``env`` added and its output in ``log``, and answers
its pid; ``{"op": "wait", "pid": N}`` answers its exit code (``-9`` for SIGKILL). Each child is a
new process that starts from nothing but its arguments and files: the zygote only saves the
import time (about 6 s of CPU for Lightning).
"""

import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.dirname(os.path.dirname(here))]
import train  # noqa: E402

import forking  # noqa: E402

forking.serve(train.main, argv0=train.__file__)
