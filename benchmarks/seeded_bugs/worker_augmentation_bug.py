"""Bug: a plain DataLoader with random augmentation in its workers: PyTorch seeds worker w with
base_seed + w, so which worker loads a sample decides its noise, and that changes with
num_workers (shown by varying the workers)."""

import torch
from torch import nn


class Noisy(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((4,), float(i)) + torch.rand(4)  # torch's global RNG, per worker


if __name__ == "__main__":
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(Noisy(), batch_size=4, num_workers=2)  # the bug
    for xb in loader:
        opt.zero_grad()
        model(xb).pow(2).mean().backward()
        opt.step()
