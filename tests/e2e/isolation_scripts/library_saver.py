"""A library's checkpoint saver: an output directory named after the current second, created
once (``exist_ok=False``), a checkpoint written to a temporary name, then renamed over the last."""

import os
import time

import torch

out = os.path.join("output", "train", time.strftime("%Y%m%d-%H%M%S"))
os.makedirs(out)
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(30):
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    tmp, last = os.path.join(out, "tmp.pth.tar"), os.path.join(out, "last.pth.tar")
    torch.save({"step": step, "model": model.state_dict()}, tmp)
    if os.path.exists(last):
        os.unlink(last)
    os.rename(tmp, last)
