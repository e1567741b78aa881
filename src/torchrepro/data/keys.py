"""The sample key: what a sampler yields and the seeding view (``loader.dataset``) loads.

Invariants:
- A key is ``(epoch, batch index within the epoch, dataset index, KEY_MARK)``: everything a
  sample's seeds are derived from, so a sample loads the same in any process or worker.
- It is a plain tuple (pickled to workers at a seventh of a tuple subclass's cost), told apart
  from a tuple the user indexes ``loader.dataset`` with by its length and its last element;
  anything ``is_key`` rejects goes to the user's dataset unchanged.
- Every sampler of this package yields these keys, and only the view reads them.
"""

from __future__ import annotations

from typing import Final

SampleKey = tuple[int, int, int, int]  # (epoch, batch index, dataset index, KEY_MARK)
KEY_MARK: Final = 0x7E5707D5EED


def is_key(key: object) -> bool:
    return type(key) is tuple and len(key) == 4 and key[3] == KEY_MARK
