"""Saves and reloads a checkpoint in the working directory, many times: concurrent runs sharing
the directory tear each other's ``model.pt`` (a load reads a file another run is writing)."""

import torch

model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
for _ in range(300):
    torch.save(model.state_dict(), "model.pt")
    model.load_state_dict(torch.load("model.pt"))
