"""Portable mode end to end: a CNN's bits are the same at 1 and 2 threads with ``--portable``, and
differ without it where the CPU's kernels split the CNN's work by thread (the negative control,
measured on each machine); where the script still depends on the thread count the check names the
op; records and ``compare`` say portability was on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import check_json as check
from helpers import torchrepro, user_env
from torchrepro.portable import CBWR_DEFAULT, portable_isa

SCRIPTS = Path(__file__).parent / "scripts"
CNN = str(SCRIPTS / "threads_cnn.py")
PORTABLE = {"MKL_CBWR": CBWR_DEFAULT, "ATEN_CPU_CAPABILITY": portable_isa(), "onednn": False}


@pytest.mark.slow
def test_a_cnn_is_the_same_at_one_and_two_threads_with_portable_and_differs_without(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, "--vary", "threads", "--portable", CNN)
    assert (code, verdict["reproducible"], verdict["varied"]) == (0, True, "1 vs 2 threads"), err
    assert verdict["portable"] == PORTABLE
    assert verdict["steps_compared"] == 3 and verdict["coverage"]["per_kind"]["final"] == 1
    # negative control: plain PyTorch, same script and seed, at 1 and 2 threads. Whether it differs
    # is the CPU's: oneMKL's GEMMs and oneDNN's convolution backward split their sums by thread for
    # some shapes on some CPUs only (on the AMD EPYC this was written on, only the Linear's weight
    # gradient does; with MKL_CBWR=AVX, another of oneMKL's code paths, nothing does). Where
    # nothing differs, the equal bits above show nothing and the test says so.
    code, verdict, err = check(tmp_path, "--vary", "threads", CNN)
    assert code in (0, 1) and verdict["portable"] is None, err
    if verdict["reproducible"]:
        pytest.skip(
            "no negative control on this CPU: plain PyTorch already gives the CNN the same bits at 1 "
            "and 2 threads (its oneMKL and oneDNN kernels split none of this CNN's sums by thread)"
        )
    assert (code, verdict["reproducible"]) == (1, False), err
    d = verdict["first_divergence"]
    assert (d["kind"], d["step"]) == ("compute", 0)
    # an op whose thread dependence --portable removes (else the portable run could not pass)
    assert d["op"].startswith(("aten.mm", "aten.addmm", "aten.convolution_backward")), d
    assert any(n.endswith("try the check again with --portable") for n in verdict["notes"]), verdict["notes"]


@pytest.mark.slow
def test_vary_threads_under_portable_names_the_op_that_still_depends_on_them(tmp_path: Path) -> None:
    code, verdict, err = check(
        tmp_path, "--vary", "threads", "--portable", str(SCRIPTS / "threads_layernorm.py")
    )
    assert (code, verdict["reproducible"]) == (1, False), err
    assert verdict["first_divergence"]["op"] == "aten.native_layer_norm_backward.default"
    (known,) = [n for n in verdict["notes"] if "is known to depend on the thread count" in n]
    assert "also under --portable (audit TR602" in known and "F.layer_norm(x, shape) * weight + bias" in known
    assert verdict["portable"] == PORTABLE


@pytest.mark.slow
def test_portable_runs_are_recorded_as_such_and_compare_equal_across_thread_counts(tmp_path: Path) -> None:
    """(How compare explains a portable run against a plain one: tests/test_compare.py.)"""
    for name, threads in (("a", "1"), ("b", "2")):
        proc = torchrepro(tmp_path, "run", "--portable", "--threads", threads, "--record", name, CNN)
        assert proc.returncode == 0, proc.stderr
    settings = json.loads((tmp_path / "a" / "settings.json").read_text())
    assert (settings["portable"], settings["MKL_CBWR"]) == (True, CBWR_DEFAULT)
    assert settings["ATEN_CPU_CAPABILITY"] == PORTABLE["ATEN_CPU_CAPABILITY"]
    env = json.loads((tmp_path / "a" / "env.json").read_text())
    assert env["determinism"]["mkldnn_enabled"] is False and env["env_vars"]["MKL_CBWR"] == CBWR_DEFAULT
    same = torchrepro(tmp_path, "compare", "a", "b")
    assert same.returncode == 0 and same.stdout.startswith("identical: 3 training steps"), same.stdout
    assert "started with different threads: 1 vs 2" in same.stdout


_RELAUNCHED = """
import json, os
import torchrepro
torchrepro.relaunch(0, portable=True)
import torch
print(json.dumps({
    "cbwr": os.environ.get("MKL_CBWR"), "isa": torch.backends.cpu.get_cpu_capability(),
    "onednn": torch.backends.mkldnn.enabled, "relaunched": "TORCHREPRO_RELAUNCHED" in os.environ,
}))
"""


def test_relaunch_portable_restarts_with_the_variables_and_turns_onednn_off(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_RELAUNCHED)
    env = user_env(drop=("MKL_CBWR", "ATEN_CPU_CAPABILITY", "PYTHONHASHSEED"))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert (got["cbwr"], got["onednn"], got["relaunched"]) == (CBWR_DEFAULT, False, True)
    isa = portable_isa()
    assert isa is None or got["isa"] == isa.upper()  # torch's kernels run on the pinned ISA
