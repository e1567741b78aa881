"""``check --report`` and ``compare --report`` from a real check, opened in a real headless Chromium.

One check is shared by the tests of this module, ``check --vary hashseed``: a script whose runs part
by a few ulps at step 3 (as many as a string's hash says: 5 and 3 under the hash seeds the check
derives from seed 0, fixed values) that spread afterwards. The page is loaded by Playwright driving
the system's Chromium (``make install`` installs both; ``TORCHREPRO_CHROMIUM`` names another
binary): it must render with no error and no request beyond the file itself, plot a point per step,
show the named line, and look right in a screenshot (the plot's pixels carry the series colour).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import marked_line, torchrepro

pytestmark = pytest.mark.slow

STEPS = 14
PARTS_AT = 3

SCRIPT = f"""\
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.3)
x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
for step in range({STEPS}):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    if step == {PARTS_AT}:  # a bug: a few ulps, as many as the string hash says (PYTHONHASHSEED)
        ulps = hash("torchrepro") % 5 + 1
        with torch.no_grad():
            model[0].bias.view(torch.int32)[0] += ulps  # PARTS HERE
    opt.step()
"""

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str:
    path = (
        os.environ.get("TORCHREPRO_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    )
    assert path, "no Chromium found: `make install` installs Debian's chromium, or set TORCHREPRO_CHROMIUM"
    return path


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cwd = tmp_path_factory.mktemp("report")
    script = cwd / "parts.py"
    script.write_text(SCRIPT, encoding="utf-8")
    proc = torchrepro(cwd, "check", "--vary", "hashseed", "--json", "--report", "out.html", "parts.py")
    assert proc.returncode == 1, proc.stderr
    verdict = json.loads(proc.stdout)
    runs = Path(cwd, proc.stderr.split("records in ")[1].split()[0])
    compared = torchrepro(cwd, "compare", "--report", "cmp.html", str(runs / "run0"), str(runs / "run1"))
    assert compared.returncode == 1, compared.stderr
    return {"cwd": cwd, "script": script, "verdict": verdict, "stderr": proc.stderr, "runs": runs}


def _differing_per_step(runs: Path) -> list[int]:
    """Per optimizer step, the tensors whose digests differ between the two runs' raw events (every
    event since the previous step's update, this step's update included)."""

    def events(run: str) -> list[dict[str, Any]]:
        with open(runs / run / "events.rank0.jsonl", encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    counts, pending = [], 0
    for a, b in zip(events("run0"), events("run1"), strict=True):
        pending += sum(x["fp"] != y["fp"] for x, y in zip(a.get("t", []), b.get("t", []), strict=True))
        if a["kind"] == "compute" and a["key"] == "optimizer0":
            counts.append(pending)
            pending = 0
    return counts


class Page:
    """A report loaded in Chromium: its console errors, requests, and the page itself."""

    def __init__(self, page: Any, errors: list[str], requests: list[str]) -> None:
        self.page, self.errors, self.requests = page, errors, requests


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        yield b
        b.close()


def open_page(browser: Any, path: Path) -> Page:
    errors: list[str] = []
    requests: list[str] = []
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.as_uri(), wait_until="load")
    return Page(page, errors, requests)


def test_the_check_report_renders_with_a_point_per_step_and_the_named_line(
    checked: dict[str, Any], browser: Any
) -> None:
    cwd, verdict = checked["cwd"], checked["verdict"]
    assert "report in out.html" in checked["stderr"]
    assert verdict["first_divergence"]["step"] == PARTS_AT
    view = open_page(browser, cwd / "out.html")
    page = view.page
    assert view.errors == [] and view.requests == [(cwd / "out.html").as_uri()]
    assert page.locator("#status").inner_text() == "NOT REPRODUCIBLE"
    # the runs went on after the divergence (up to the script's end): a point per step
    steps = [int(s) for s in page.locator("circle.point").evaluate_all("els => els.map(e => e.dataset.step)")]
    assert steps == list(range(STEPS))
    classes = page.locator("circle.point").evaluate_all("els => els.map(e => e.getAttribute('class'))")
    assert classes[:PARTS_AT] == ["point equal"] * PARTS_AT
    assert "point equal" not in classes[PARTS_AT:]
    data = json.loads(page.locator("#torchrepro-data").inner_text())
    points = data["series"][0]["points"]
    assert all(p["largest"] > 0 for p in points[PARTS_AT:])  # measured from the recorded values
    # how many tensors differ at each step, as the records say (how far a few ulps spread, and when,
    # depends on the CPU's kernels: counted here, never pinned)
    differing = [p["differing"] for p in points]
    assert differing == _differing_per_step(checked["runs"])
    assert differing[:PARTS_AT] == [0] * PARTS_AT and all(n > 0 for n in differing[PARTS_AT:])
    # the divergence names the line of the offset, and the page shows it, highlighted, with context
    line = marked_line(checked["script"], "PARTS HERE")
    assert verdict["first_divergence"]["location"] == f"parts.py:{line}"
    hit = page.locator("#source .hit")
    assert hit.count() == 1 and hit.inner_text().split(None, 1) == [
        str(line),
        SCRIPT.splitlines()[line - 1].strip(),
    ]
    assert page.locator("#source div").count() >= 7
    assert page.locator("#distance-plot").bounding_box()["width"] > 600  # laid out, not collapsed


def test_the_compare_report_of_the_same_runs(checked: dict[str, Any], browser: Any) -> None:
    view = open_page(browser, checked["cwd"] / "cmp.html")
    page = view.page
    assert view.errors == []
    assert page.locator("#status").inner_text() == "NOT IDENTICAL"
    steps = page.locator("circle.point").evaluate_all("els => els.map(e => +e.dataset.step)")
    assert steps == list(range(STEPS))
    # records without op traces: the divergence is the tensor and step, with no op or line to show
    shown = page.locator("#divergence").inner_text()
    assert f"compute at step {PARTS_AT}" in shown and "0.bias" in shown
    assert page.locator("#source").count() == 0
    assert "PYTHONHASHSEED" in page.locator("#environment").inner_text()


def test_a_screenshot_of_the_plot_shows_the_series(
    checked: dict[str, Any], browser: Any, tmp_path: Path
) -> None:
    view = open_page(browser, checked["cwd"] / "out.html")
    shot = tmp_path / "plot.png"
    view.page.locator("#distance-plot").screenshot(path=str(shot))
    keep = os.environ.get("TORCHREPRO_SCREENSHOTS")
    if keep:  # a person can look at it
        shutil.copy(shot, Path(keep) / "report-plot.png")
    width, height, pixels = read_png(shot.read_bytes())
    assert width >= 600 and height >= 250
    red = sum(1 for p in pixels if abs(p[0] - 0xC0) < 24 and abs(p[1] - 0x39) < 40 and abs(p[2] - 0x2B) < 40)
    white = sum(1 for p in pixels if p[:3] == (255, 255, 255))
    assert red > 300  # the points, the line and the bars of the series are drawn
    assert white > len(pixels) // 2  # and the rest of the plot is the white page, not a blank or black box
    # the series is drawn where the page says: every point inside the picture
    box = view.page.locator("#distance-plot").bounding_box()
    for circle in view.page.locator("circle.point").all():
        b = circle.bounding_box()
        assert (
            box["x"] <= b["x"] <= box["x"] + box["width"] and box["y"] <= b["y"] <= box["y"] + box["height"]
        )


def read_png(data: bytes) -> tuple[int, int, list[tuple[int, ...]]]:
    """Decode an 8-bit RGB or RGBA PNG (what Chromium writes) into a list of pixels."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    height = depth = color = 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunk = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", chunk[:10])
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    assert depth == 8 and color in (2, 6), (depth, color)
    channels = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytearray] = []
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(line)
        prev = line
    pixels = [tuple(row[x * channels : x * channels + 3]) for row in rows for x in range(width)]
    return width, height, pixels
