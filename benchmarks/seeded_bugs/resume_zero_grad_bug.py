"""Bug: the loop never calls optimizer.zero_grad(), so gradients pile up across steps; that is
the same in every uninterrupted run, but a checkpoint holds no gradients, so a run resumed from
one trains other bits (shown by comparing train() with train(resume_at=3)).

``resume_at``: at that step, save a checkpoint and restore from it as a restarted process would:
the model and optimizer states come back from the file, the gradients are gone."""

import os
import tempfile

import torch
from torch import nn

STEPS = 6


def train(resume_at=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = torch.randn(STEPS, 32, 8, generator=torch.Generator().manual_seed(1))
    for step in range(STEPS):
        if step == resume_at:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "checkpoint.pt")
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
                state = torch.load(path, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            for p in model.parameters():
                p.grad = None  # a restarted process has no gradients
        model(data[step]).pow(2).mean().backward()  # the bug: no opt.zero_grad() before this
        opt.step()


if __name__ == "__main__":
    train()
