"""A script whose settings break reproducibility: no seed, cuDNN benchmark, TF32, strict mode
without CUBLAS_WORKSPACE_CONFIG, an op that raises under strict mode even on the CPU, a plain
DataLoader with random augmentation in two workers, and a torch.compile call (audit fixture)."""

import random

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Noisy(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = torch.arange(4.0) + i
        if random.random() < 0.5:  # a random flip, drawn in whichever worker loads the sample
            x = x.flip(0)
        return x, i % 2


torch.backends.cudnn.benchmark = True
torch.backends.cuda.matmul.allow_tf32 = True
torch.use_deterministic_algorithms(True)
model = nn.Linear(4, 2)
compiled = torch.compile(model)  # never called here: the audit only needs to see the call
loader = DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
hits = torch.zeros(8)
for x, y in loader:
    hits.put_(y, torch.ones(len(y)))  # put_(accumulate=False) raises under strict mode, CPU too
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
