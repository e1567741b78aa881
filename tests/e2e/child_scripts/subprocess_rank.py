"""The child ``subprocess_parent.py`` starts: trains like rank 0 (``--noisy``: with unseeded noise)."""

from __future__ import annotations

import os
import sys

from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Points, model, train

if __name__ == "__main__":
    train(model(), DataLoader(Points(noisy="--noisy" in sys.argv), batch_size=4, shuffle=True))
