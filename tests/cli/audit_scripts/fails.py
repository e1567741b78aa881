"""A script that fails before training (audit fixture: the audit must exit 2 with the traceback tail)."""

import torch

model = torch.nn.Linear(2, 2)
raise RuntimeError("dataset path /nonexistent/train not found")
