"""Training whose bits do not depend on how a global batch is split across ranks and micro-batches.

Invariants:
- Every random draw of a training step is keyed by what it is for (the loader keys samples by
  (seed, epoch, index); forwards are keyed by (seed, epoch, global batch, micro-batch)), never by
  who computes it, and a global batch's micro-batch gradients are summed in one fixed tree over
  the global micro-batch index: the result is a function of (seed, data, global batch size,
  micro-batch size), the same bits for any world size that divides the micro-batch count.
- One module per job: ``module`` (``InvariantDataParallel``: keyed forwards, a micro-batch's
  gradient taken out after its backward, the reduction at the end of a global batch), ``tree``
  (the canonical tree, a rank's pieces of it, the exchange across ranks), ``norm`` (BatchNorm
  running statistics replayed in global order; buffers that must not move), ``clip``
  (``clip_grad_norm_``: a total gradient norm summed in one order for any sharding, FSDP2's
  included). Submodules load lazily on first use of a public name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrepro._lazy import lazy_exports

if TYPE_CHECKING:
    from torchrepro.invariant.clip import clip_grad_norm_
    from torchrepro.invariant.module import InvariantDataParallel

__all__ = ["InvariantDataParallel", "clip_grad_norm_"]

_WHERE = {"InvariantDataParallel": "module", "clip_grad_norm_": "clip"}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE, __all__)
