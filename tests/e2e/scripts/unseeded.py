"""No seeding at all: reproducible only when torchrepro seeds it."""

import torch
from torch import nn

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 8), torch.randn(32, 1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)
for xb, yb in loader:
    opt.zero_grad()
    ((model(xb) - yb) ** 2).mean().backward()
    opt.step()
