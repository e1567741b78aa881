"""Updates weights by hand, as classic word-language-model examples do: no torch.optim anywhere.

With ``--optim`` the same loop uses ``torch.optim.SGD`` (the control that check can compare)."""

import sys

import torch

torch.manual_seed(int.from_bytes(__import__("os").urandom(2), "little") if "--unseeded" in sys.argv else 0)
model = torch.nn.Linear(4, 1)
x = torch.randn(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1) if "--optim" in sys.argv else None
for _ in range(5):
    model.zero_grad()
    (model(x) ** 2).mean().backward()
    if opt is not None:
        opt.step()
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.1)
