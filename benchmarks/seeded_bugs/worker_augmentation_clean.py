"""Clean twin: the same augmentation through torchrepro.SeededLoader, which seeds every sample
from (seed, epoch, index): the noise no longer depends on the worker."""

import torch
from torch import nn

import torchrepro


class Noisy(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((4,), float(i)) + torch.rand(4)  # torch's global RNG, per worker


if __name__ == "__main__":
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torchrepro.SeededLoader(Noisy(), batch_size=4, num_workers=2, shuffle=False, seed=0)  # the fix
    for xb in loader:
        opt.zero_grad()
        model(xb).pow(2).mean().backward()
        opt.step()
