"""torchrun, with a failed rank reported in one line: ``python -m torchrepro._child.torchrun ARGS``.

Invariants: the arguments and behaviour are torchrun's (``torch.distributed.run``); when a rank
fails, instead of torchrun's multi-screen ``ChildFailedError`` traceback it prints one line
naming the first failed rank and its exit code (128+N for a signal N), and exits with that code.
The ranks' own output (their tracebacks) is above it, unchanged.
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str]) -> int:
    """Run torchrun with ``argv``; the exit code of the first failed rank, or 0."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = int(failure.exitcode)
        what = f"exit code {code}"
        if code < 0:
            try:
                what = f"signal {signal.Signals(-code).name} (exit code {128 - code})"
            except ValueError:
                what = f"signal {-code} (exit code {128 - code})"
            code = 128 - code
        print(
            f"torchrepro: rank {rank} failed with {what}; the ranks' output is above",
            file=sys.stderr,
        )
        return code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
