"""Claim: every CUDA claim torchrepro makes holds on a real GPU. One command checks them all.

Run: ``python benchmarks/gpu_validation.py [--json FILE] [--markdown FILE] [--sections A,B]``
(under 8 minutes on one H100; with no CUDA device it says so and exits 0).

Sections (``benchmarks/gpu_checks/``), each in a fresh process of its own:

- ``bitwise``: strict mode, two fresh processes training a small CNN and a small GPT (fp32 and
  bf16 autocast) end with equal bits; PyTorch's defaults and a "fast" setup measured beside it.
- ``optable``: every op of the audit's table (and ops it calls fine) run under
  ``use_deterministic_algorithms(True)``: raises, warns or runs, equal bits or not; every
  disagreement with ``ops_table.json`` for this torch is listed.
- ``cublas``: ``CUBLAS_WORKSPACE_CONFIG`` set too late is refused with the fix; under
  ``torchrepro run`` it is set in time; a matmul-heavy step's bits with and without it.
- ``integration``: SeededLoader with pinned memory, RngState and checkpoints with the CUDA
  generator, ``check`` and ``run --record`` on a CUDA script, a locate naming a CUDA op.
- ``tests``: the suite's ``requires_cuda`` tests (``tests/gpu`` and the rest), with
  ``--require-cuda`` so that none is skipped.
- ``costs``: step time of each switch, side by side in one process (run last and alone, so that
  no other section's processes share the GPU while it times).

Output: a table on stdout (one line per check: status, section, check, detail), and with
``--json`` every row with its data, plus the machine it ran on. ``--from-json FILE`` prints the
table of a saved result again, with the op table's disagreements worked out anew against this
checkout's ``ops_table.json`` (no GPU needed). Exit status: 0 when no check failed, 1 when one
failed or broke, 2 for bad arguments.

``--device cpu --quick`` runs the same harness on the CPU with tiny sizes: that is how the
CPU-side tests drive it; its rows are ``info`` or ``skip`` where only CUDA can decide.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_checks.common import ROOT, Row, child_env  # noqa: E402

SECTIONS = ("bitwise", "optable", "cublas", "integration", "tests", "costs")
ALONE = ("costs",)  # timed: runs after the others, with the GPU to itself
SECTION_TIMEOUT_S = {
    "bitwise": 240,
    "optable": 180,
    "cublas": 180,
    "integration": 300,
    "tests": 300,
    "costs": 400,
}


def _sections(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(SECTIONS)}"
        )
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpu_validation.py",
        description="Check torchrepro's CUDA claims on this machine's GPU (see the module docstring).",
    )
    p.add_argument(
        "--sections",
        type=_sections,
        default=list(SECTIONS),
        help=f"comma-separated, from {','.join(SECTIONS)}",
    )
    p.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="write every row, with its data, to FILE"
    )
    p.add_argument(
        "--markdown", type=Path, default=None, metavar="FILE", help="write the table as Markdown to FILE"
    )
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="cpu: the harness's self-test (default: cuda)"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (the self-test)")
    p.add_argument(
        "--from-json", type=Path, default=None, metavar="FILE", help="print a saved result's table again"
    )
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)  # internal: run one section here
    p.add_argument("--rows-out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("json", "markdown"):
        path = getattr(args, name)
        if path is not None and path.exists() and path.is_dir():
            p.error(f"--{name} {path} is a directory; give a file path")
        if path is not None and not path.parent.is_dir():
            p.error(f"--{name} {path}: folder {path.parent} does not exist; create it or give another path")
    if args.from_json is not None and not args.from_json.is_file():
        p.error(f"--from-json {args.from_json}: no such file")
    return args


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        info["cudnn"] = torch.backends.cudnn.version()
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            info["driver"] = out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    return info


def run_section_here(name: str, device: str, quick: bool, workdir: Path) -> list[Row]:
    import importlib

    from gpu_checks.common import Context

    module = importlib.import_module(f"gpu_checks.{name}")
    workdir.mkdir(parents=True, exist_ok=True)
    return list(module.run(Context(device=device, quick=quick, workdir=workdir)))


def run_section(name: str, device: str, quick: bool, scratch: Path) -> tuple[list[Row], float]:
    """Run one section in a fresh process; a crash or a timeout is an ``error`` row."""
    rows_out = scratch / f"{name}.rows.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--section",
        name,
        "--device",
        device,
        "--rows-out",
        str(rows_out),
        "--workdir",
        str(scratch / name),
    ] + (["--quick"] if quick else [])
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=SECTION_TIMEOUT_S[name]
        )
    except subprocess.TimeoutExpired:
        return [
            Row(name, "section", "error", f"timed out after {SECTION_TIMEOUT_S[name]} s")
        ], time.perf_counter() - start
    seconds = time.perf_counter() - start
    if proc.returncode != 0 or not rows_out.is_file():
        tail = (proc.stderr.strip() or proc.stdout.strip())[-1500:]
        return [Row(name, "section", "error", f"exit {proc.returncode}: {tail}")], seconds
    return [Row.from_json(d) for d in json.loads(rows_out.read_text())], seconds


def recheck(rows: list[Row]) -> list[Row]:
    """Work the op table's verdicts out anew against this checkout's table (``--from-json``)."""
    from gpu_checks import optable

    return optable.recheck(rows)


STATUS_MARK = {"pass": "PASS", "fail": "FAIL", "info": "info", "skip": "skip", "error": "ERROR"}


def table(rows: list[Row], *, markdown: bool = False, width: int = 110) -> str:
    if markdown:
        lines = ["| status | section | check | detail |", "|---|---|---|---|"]
        for r in rows:
            detail = r.detail.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {STATUS_MARK[r.status]} | {r.section} | {r.check} | {detail} |")
        return "\n".join(lines)
    lines = []
    for r in rows:
        head = f"{STATUS_MARK[r.status]:<5} {r.section:<11} {r.check}"
        lines.append(head)
        if r.detail:
            detail = " ".join(r.detail.split())
            while detail:
                lines.append("      " + detail[: width - 6])
                detail = detail[width - 6 :]
    return "\n".join(lines)


def summary(rows: list[Row]) -> dict[str, int]:
    counts = {s: 0 for s in STATUS_MARK}
    for r in rows:
        counts[r.status] += 1
    return counts


def report(result: dict[str, Any], args: argparse.Namespace) -> int:
    rows = [Row.from_json(d) for d in result["rows"]]
    counts = summary(rows)
    m = result["machine"]
    head = (
        f"GPU validation on {m.get('gpu', 'no GPU (' + result['device'] + ')')}: torch {m['torch']}, "
        f"CUDA {m.get('cuda')}, cuDNN {m.get('cudnn')}, driver {m.get('driver')}; "
        f"{result.get('seconds', 0):.0f} s"
    )
    print(head)
    print(table(rows))
    print(", ".join(f"{n} {s}" for s, n in counts.items() if n))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    if args.markdown is not None:
        args.markdown.write_text(f"{head}\n\n{table(rows, markdown=True)}\n", encoding="utf-8")
    return 1 if counts["fail"] or counts["error"] else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.section is not None:  # a section's own process
        rows = run_section_here(
            args.section, args.device or "cuda", args.quick, args.workdir or Path(tempfile.mkdtemp())
        )
        args.rows_out.write_text(json.dumps([r.to_json() for r in rows]), encoding="utf-8")
        return 0
    if args.from_json is not None:
        try:
            result = json.loads(args.from_json.read_text(encoding="utf-8"))
            result["rows"] = [r.to_json() for r in recheck([Row.from_json(d) for d in result["rows"]])]
        except (ValueError, KeyError, TypeError) as e:
            print(
                f"gpu_validation.py: {args.from_json} is not a result this script wrote ({e})",
                file=sys.stderr,
            )
            return 2
        return report(result, args)
    import torch

    device = args.device or "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        if args.device == "cuda":
            print("gpu_validation.py: --device cuda, but no CUDA device is visible", file=sys.stderr)
            return 2
        print(
            f"No CUDA device is visible (torch {torch.__version__}, CUDA build: {torch.version.cuda}): "
            "nothing to validate. Run this on a machine with an NVIDIA GPU; "
            "`--device cpu --quick` runs the harness's self-test here."
        )
        return 0
    start = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="gpu_validation-"))
    rows: list[Row] = []
    seconds: dict[str, float] = {}
    together = [s for s in args.sections if s not in ALONE]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(together))) as pool:
        futures = {s: pool.submit(run_section, s, device, args.quick, scratch) for s in together}
        for s in together:
            rows_s, seconds[s] = futures[s].result()
            rows.extend(rows_s)
    for s in args.sections:
        if s in ALONE:
            rows_s, seconds[s] = run_section(s, device, args.quick, scratch)
            rows.extend(rows_s)
    result = {
        "device": device,
        "quick": args.quick,
        "machine": machine(),
        "seconds": time.perf_counter() - start,
        "section_seconds": seconds,
        "rows": [r.to_json() for r in rows],
    }
    return report(result, args)


if __name__ == "__main__":
    sys.exit(main())
