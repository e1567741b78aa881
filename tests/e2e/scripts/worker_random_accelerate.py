"""worker_random.py through accelerate: the loader is rebuilt by ``accelerator.prepare``."""

import torch
from accelerate import Accelerator
from torch import nn
from worker_random import Noisy  # the script's folder is sys.path[0], as under plain python

if __name__ == "__main__":
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(Noisy(), batch_size=4, num_workers=2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for xb in loader:
        opt.zero_grad()
        model(xb).pow(2).mean().backward()
        opt.step()
