"""What the running process has started (``torchrepro._runtime``): asked, never started."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from helpers import free_port
from torchrepro._runtime import cuda_started, env_rank, group_rank, process_group


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({}, None),
        ({"RANK": ""}, None),
        ({"RANK": "0"}, 0),
        ({"RANK": "3", "LOCAL_RANK": "1"}, 3),  # the global rank wins
        ({"LOCAL_RANK": "2"}, 2),  # Lightning's launcher sets only LOCAL_RANK on node 0
        ({"LOCAL_RANK": "2", "NODE_RANK": "0"}, 2),
        ({"LOCAL_RANK": "2", "NODE_RANK": "1"}, None),  # on another node LOCAL_RANK is not the rank
        ({"LOCAL_RANK": "2", "GROUP_RANK": "1"}, None),
        ({"RANK": "x"}, None),
    ],
)
def test_env_rank(env: dict[str, str], rank: int | None) -> None:
    assert env_rank(env) == rank


def test_process_group_is_the_fixed_one_else_the_group_else_rank_0_of_1() -> None:
    assert process_group() == (0, 1) and group_rank() is None  # no group: rank 0 of 1, no group rank
    assert process_group((2, 4)) == (2, 4)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert process_group() == (0, 1) and dist.is_initialized() and group_rank() == 0
        assert process_group((1, 3)) == (1, 3)
    finally:
        dist.destroy_process_group()


def test_asking_starts_nothing() -> None:
    """Neither question imports torch (or torch.distributed) in a process that has not."""
    code = (
        "import sys; from torchrepro._runtime import cuda_started, process_group; "
        "print(cuda_started(), process_group(), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "(0,", "1)", "False"]
    # in this process: what torch says (an earlier test may have started CUDA on a GPU machine)
    assert cuda_started() is torch.cuda.is_initialized()
