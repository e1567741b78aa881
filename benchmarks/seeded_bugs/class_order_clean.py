"""Clean twin: class ids come from the sorted class names."""

import torch
from torch import nn

names = ["cat", "dog", "bird", "fish", "frog", "cat", "dog", "bird"]  # one label per sample
classes = sorted(set(names))  # the fix: a sorted order
ids = torch.tensor([classes.index(n) for n in names])
x = torch.linspace(-1, 1, 8 * 6).reshape(8, 6)
model = nn.Linear(6, 5)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for xb, yb in torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, ids), batch_size=4):
    opt.zero_grad()
    nn.functional.cross_entropy(model(xb), yb).backward()
    opt.step()
