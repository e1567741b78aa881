"""Seeded data loading: batches that depend only on (seed, epoch), never on how they are loaded.

Invariants:
- Nothing here draws from a global RNG for order or worker seeds, and every sample and batch is
  loaded with the global RNGs (and the dataset's RNG objects) seeded from its key: the batches of
  every epoch are bitwise identical for any ``num_workers``, ``persistent_workers``,
  ``prefetch_factor``, start method or ``pin_memory``, and loading in the main process never
  moves the training loop's RNG stream.
- The parts are self-sufficient: the sampler (a ``DistributedSampler``) holds the position and
  reads rank and world size when each pass starts; ``loader.dataset`` is a view of the user's
  dataset that does the seeding; ``collate_fn`` unwraps what it collated. A framework that
  rebuilds a plain ``DataLoader`` from these parts gets the same batches.
- One module per job: ``loader`` (``SeededLoader``, its passes, the ``DataLoader`` arguments it
  owns, its state), ``sampler`` (order, shards, position), ``keys`` (the sample key samplers yield
  and the view loads), ``view`` (the seeding dataset view, its collate wrapper, ``sample_rng``),
  ``watch`` (which global RNGs a dataset draws from, the RNG objects it holds), ``rawrng`` (global
  RNG states read and written in interpreter memory, ``set_raw_access``), ``micro`` (the sampler of
  global batches' micro-batches), ``sharded`` (``ShardedDataset``: shards read seeded per sample),
  ``formats`` (the Parquet, tar and JSONL readers of ``ShardedDataset.from_*``), ``shuffle`` (the
  keyed shuffle buffer and its replay), ``streaming`` (``SeededLoader`` over a ``ShardedDataset``).
  Submodules load lazily on first use of a public name: importing this package imports none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrepro._lazy import lazy_exports

if TYPE_CHECKING:
    from torchrepro.data.loader import STATE_VERSION, LoaderConfigError, SeededLoader, UnsupportedDatasetError
    from torchrepro.data.rawrng import raw_access, set_raw_access
    from torchrepro.data.sharded import ShardedDataset
    from torchrepro.data.streaming import StreamingLoader
    from torchrepro.data.view import sample_rng

__all__ = [
    "STATE_VERSION",
    "LoaderConfigError",
    "SeededLoader",
    "ShardedDataset",
    "StreamingLoader",
    "UnsupportedDatasetError",
    "raw_access",
    "sample_rng",
    "set_raw_access",
]

_WHERE = {
    "STATE_VERSION": "loader",
    "LoaderConfigError": "loader",
    "SeededLoader": "loader",
    "ShardedDataset": "streaming",  # importing it there makes SeededLoader stream it
    "StreamingLoader": "streaming",
    "UnsupportedDatasetError": "loader",
    "raw_access": "rawrng",
    "sample_rng": "view",
    "set_raw_access": "rawrng",
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE, __all__)
