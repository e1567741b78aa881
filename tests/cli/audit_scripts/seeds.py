"""Seeds drawn from unseeded sources, whatever their size, and constants that are not (audit fixture).

``python seeds.py``: every seed with a "tainted" comment comes from the clock, the process id, OS
entropy or a global RNG nothing seeded (TR305 at that line); the constants are clean even where
an unseeded source happened to return the same number. ``python seeds.py seeded``: Python's and
NumPy's global RNGs are seeded first, and nothing comes from the clock: no TR305 at all.
"""

import os
import random
import secrets
import sys
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

seeded = sys.argv[1:] == ["seeded"]
if seeded:
    random.seed(0)
    np.random.seed(0)
else:
    clock_ns = torch.Generator().manual_seed(time.time_ns())  # tainted
    clock_s = torch.Generator().manual_seed(int(time.time()))  # tainted
    pid = torch.Generator().manual_seed(os.getpid())  # tainted
    entropy = torch.Generator().manual_seed(secrets.randbelow(1000))  # tainted
    small_bytes = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))  # tainted
seed = random.randint(1, 10000)
torch.manual_seed(seed)  # tainted
np.random.seed(np.random.randint(1, 100))  # tainted

# constants, although unseeded sources returned the same numbers
lucky = random.randint(42, 42) + random.randint(4821, 4821)
torch.manual_seed(42)
fixed = torch.Generator().manual_seed(4821)
assert isinstance(fixed, torch.Generator) and isinstance(torch.default_generator, torch.Generator)
order = [int(i) for batch in DataLoader(range(8), shuffle=True, generator=fixed) for i in batch]
torch.set_num_threads(1)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(2, 4)).sum().backward()
opt.step()
