"""Determinism switches set only on CUDA: invisible to a CPU run, read from the source (audit fixture).

``python cuda_branch.py``: the branch under ``torch.cuda.is_available()`` is not taken on a CPU
machine (TR203/TR204 at its lines), and a module of the script's own directory lowers the matmul
precision under a flag that is off (reported one step lower). ``python cuda_branch.py everywhere``:
the same lines run, and each setting is reported once, as it ran.
"""

import sys

import cuda_branch_setup
import torch

everywhere = sys.argv[1:] == ["everywhere"]
torch.manual_seed(0)
torch.set_num_threads(1)
if torch.cuda.is_available() or everywhere:
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
cuda_branch_setup.configure(fast=everywhere)

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(8, 4)).pow(2).mean().backward()
opt.step()
