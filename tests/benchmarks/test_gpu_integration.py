"""The ``integration`` section of the GPU validation, run on the CPU as the harness's self-test.

The section runs once (quick) for the module; the tests then assert, row by row, that every claim
with a CPU equivalent passes here, that each negative control came out as it must (else the
passing rows would prove nothing), and that the rows that only mean something on CUDA are
``skip`` with a reason naming CUDA.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_checks import integration
from gpu_checks.common import Context, Row

CPU_PASSES = {
    "seeded_loader_pin_memory",
    "rng_state_cuda",
    "fork_rng_cuda",
    "checkpoint_resume_cuda",
    "check_reproducible",
    "check_divergence",
    "locate_cuda_op",
    "run_record_compare",
    "audit_on_device",
}
CUDA_ONLY = {"run_record_env_gpu", "invariant_data_parallel_nccl", "invariant_fsdp_cuda"}


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Row]:
    ctx = Context(device="cpu", quick=True, workdir=tmp_path_factory.mktemp("integration"))
    result = integration.run(ctx)
    assert all(row.section == integration.NAME == "integration" for row in result)
    by_check = {row.check: row for row in result}
    assert len(by_check) == len(result), [row.check for row in result]
    return by_check


@pytest.mark.slow
def test_every_row_is_reported_once_and_in_order(rows: dict[str, Row]) -> None:
    assert list(rows) == [
        "seeded_loader_pin_memory",
        "plain_loader_workers",
        "rng_state_cuda",
        "fork_rng_cuda",
        "checkpoint_resume_cuda",
        "check_reproducible",
        "check_divergence",
        "locate_cuda_op",
        "run_record_compare",
        "run_record_env_gpu",
        "audit_on_device",
        "invariant_data_parallel",
        "invariant_data_parallel_nccl",
        "invariant_fsdp_cuda",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("check", sorted(CPU_PASSES))
def test_the_cpu_equivalent_passes(rows: dict[str, Row], check: str) -> None:
    row = rows[check]
    assert row.status == "pass", row
    assert row.data["device"] == "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("check", sorted(CUDA_ONLY))
def test_cuda_only_rows_skip_naming_cuda(rows: dict[str, Row], check: str) -> None:
    row = rows[check]
    assert row.status == "skip" and "CUDA" in row.detail, row


@pytest.mark.slow
def test_negative_controls_differ(rows: dict[str, Row]) -> None:
    plain = rows["plain_loader_workers"]
    assert (plain.status, plain.data["differs"]) == ("info", True), plain
    loader = rows["seeded_loader_pin_memory"].data
    assert loader["epochs_differ"] and loader["pinned"] is None  # nothing is pinned without CUDA
    rng = rows["rng_state_cuda"].data
    assert rng["unrestored_differs"] and rng["cuda_devices_captured"] == []
    fork = rows["fork_rng_cuda"].data
    assert fork["unforked_block_moves"] and fork["fork_other_seed_differs"]
    checkpoint = rows["checkpoint_resume_cuda"].data
    assert checkpoint["no_rng_differs"] and checkpoint["resumed_equal"]
    fingerprints = checkpoint["fingerprints"]
    assert fingerprints["resume"] == fingerprints["full"] != fingerprints["no_rng"]
    assert checkpoint["cuda_rng_devices"] == [] and "rng" in checkpoint["weights_only_keys"]


@pytest.mark.slow
def test_the_broken_script_parts_at_step_2_and_is_located_at_the_draw(rows: dict[str, Row]) -> None:
    first = rows["check_divergence"].data["first_divergence"]
    assert rows["check_divergence"].data["returncode"] == 1
    assert (first["step"], first["kind"], first["op"], first["module"]) == (
        2,
        "compute",
        "aten.randn.generator",
        "noise",
    )
    line = integration.TRAIN_SCRIPT.splitlines()[int(first["location"].split(":")[1]) - 1]
    assert "torch.randn(" in line and line.endswith(integration.NOISE_MARKER)
    assert rows["check_reproducible"].data["returncode"] == 0


@pytest.mark.slow
def test_invariant_data_parallel_gives_the_same_bits_on_1_and_2_processes(rows: dict[str, Row]) -> None:
    row = rows["invariant_data_parallel"]
    assert row.status == "pass", row.detail
    runs = row.data["fingerprints"]
    assert set(runs) == {"1 process", "1 process again", "2 processes"} and len(runs["2 processes"]) == 2


def test_a_check_that_raises_becomes_an_error_row_and_the_others_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(ctx: Context) -> list[Row]:
        raise RuntimeError("boom")

    def fine(ctx: Context) -> list[Row]:
        return [Row("integration", "fine", "pass")]

    monkeypatch.setattr(integration, "CHECKS", [("broken_check", broken), ("fine", fine)])
    got = integration.run(Context(device="cpu", quick=True, workdir=tmp_path / "w"))
    assert [(r.check, r.status, r.detail) for r in got] == [
        ("broken_check", "error", "RuntimeError: boom"),
        ("fine", "pass", ""),
    ]
