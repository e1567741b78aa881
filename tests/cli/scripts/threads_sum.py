"""A full-tensor sum of 2**17 float32 values: on the CPU it is split by the thread count.

With 1 and 2 threads the sum, and so the gradient it scales, differ in their last bits at step 0;
with the same thread count the runs are bitwise equal."""

import torch

w = torch.nn.Parameter(torch.randn(2**17))
opt = torch.optim.SGD([w], lr=1e-3)
x = torch.randn(2**17)
for _ in range(2):
    opt.zero_grad()
    (w * x).sum().pow(2).backward()  # sum
    opt.step()
