"""Bug: class ids come from iterating a set of class names, whose order follows PYTHONHASHSEED:
the same image gets another label in another process (shown by varying the hash seed)."""

import torch
from torch import nn

names = ["cat", "dog", "bird", "fish", "frog", "cat", "dog", "bird"]  # one label per sample
classes = list(set(names))  # the bug: a set's order
ids = torch.tensor([classes.index(n) for n in names])
x = torch.linspace(-1, 1, 8 * 6).reshape(8, 6)
model = nn.Linear(6, 5)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for xb, yb in torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, ids), batch_size=4):
    opt.zero_grad()
    nn.functional.cross_entropy(model(xb), yb).backward()
    opt.step()
