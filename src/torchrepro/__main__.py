"""``python -m torchrepro``: the command line."""

from torchrepro.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
