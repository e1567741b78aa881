"""A module of the script's own directory that ``cuda_branch.py`` imports (audit fixture)."""

import torch


def configure(fast: bool) -> None:
    if fast:
        torch.set_float32_matmul_precision("medium")
