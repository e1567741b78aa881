"""A hand-written update loop: no optimizer, a step per backward() (audit fixture).

``python manual_update.py``: 5 steps of ``w -= lr * w.grad``. ``python manual_update.py infer``:
the same forward pass without backward (inference only: the control).
"""

import sys

import torch

torch.manual_seed(0)
torch.set_num_threads(1)
w = torch.randn(4, 1, requires_grad=True)
x = torch.randn(16, 4)
for _step in range(5):
    loss = (x @ w).pow(2).mean()
    if sys.argv[1:] == ["infer"]:
        continue
    loss.backward()
    with torch.no_grad():
        w -= 0.1 * w.grad
        w.grad.zero_()
