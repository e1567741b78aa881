"""torchrun, with a failed rank reported in one line: ``python -m torchrepro._child.torchrun ARGS``.

Invariants: the arguments and behaviour are torchrun's (``torch.distributed.run``); when a rank
fails, instead of torchrun's multi-screen ``ChildFailedError`` traceback it prints one line
naming the first failed rank and its exit code (128+N for a signal N), and exits with that code.
The ranks' own output (their tracebacks) is above it, unchanged. A rendezvous that times out
(a node of ``--nnodes`` never joined) is one line too, naming the rendezvous, exit code 2.
"""

from __future__ import annotations

import re
import signal
import sys


def main(argv: list[str]) -> int:
    """Run torchrun with ``argv``; the exit code of the first failed rank, or 0."""
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.run import main as torchrun_main

    flags = dict(a.lstrip("-").split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    where = f"the rendezvous at {flags.get('rdzv-endpoint', '?')} (id {flags.get('rdzv-id', '?')})"
    wait = flags.get("rdzv-conf", "").partition("timeout=")[2] or "600"
    expected = f"--nnodes {flags.get('nnodes', '?')} nodes were expected"
    never_joined = (
        f"torchrepro: not every node joined {where} within {wait} s: {{}}; start torchrepro with the same "
        "flags on every node (--join-timeout sets the wait)"
    )
    lost = (
        f"torchrepro: this node lost {where}: the node serving it is gone or unreachable; the run ended "
        "here and every rank of this node was stopped"
    )
    try:
        torchrun_main(argv)
    except RendezvousTimeoutError:
        print(never_joined.format(expected), file=sys.stderr)
        return 2
    except RendezvousConnectionError:
        print(lost, file=sys.stderr)
        return 2
    except DistStoreError as exc:  # the static backend's store
        joined = re.search(r"(\d+)/(\d+) clients joined", str(exc))
        if joined is None:
            print(lost, file=sys.stderr)
        else:
            print(never_joined.format(f"{joined[1]} of {joined[2]} nodes joined"), file=sys.stderr)
        return 2
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
