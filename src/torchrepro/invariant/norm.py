"""BatchNorm running statistics updated in global micro-batch order, and buffers that may not move.

Invariants:
- In training, each micro-batch normalises with its own statistics (the module's forward is
  untouched), and those depend only on the micro-batch, which is the same on every world size.
- The running statistics do not move during a global batch: each micro-batch's forward updates
  scratch copies of them (swapped in by a pre-hook; the buffers are never changed in place while
  a graph may hold them), and a hook notes that micro-batch's statistics (mean and unbiased
  variance over every dimension but the channel, computed here from the input) and puts the
  buffers back. When the
  global batch ends, every rank has every micro-batch's statistics (gathered in global
  micro-batch order) and replays the updates ``running = (1 - m) * running + m * stat`` (or the
  cumulative average when ``momentum is None``) in that order: the buffers are the same bits on
  every rank and every world size.
- Any other buffer must not change during training: its version counter is checked at the end of
  each global batch, and a module whose buffer changed is refused by name. ``SyncBatchNorm`` (its
  statistics span ranks) and instance norms tracking running statistics are refused up front.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchrepro.errors import InvariantTrainingError

_STAT_DTYPE = torch.float64  # statistics travel and are kept in float64: float32 round-trips exactly


def refused_modules(module: nn.Module) -> list[str]:
    """``name (type): why`` for each submodule whose buffers cannot be updated in global order."""
    out = []
    for name, sub in module.named_modules():
        label = f"{name or '<root>'} ({type(sub).__name__})"
        if isinstance(sub, nn.SyncBatchNorm):
            out.append(f"{label}: its statistics are reduced across ranks, which depends on the world size")
        elif isinstance(sub, nn.modules.instancenorm._InstanceNorm) and sub.track_running_stats:
            out.append(f"{label}: running statistics of instance norm are not ordered per micro-batch")
        elif isinstance(sub, nn.modules.lazy.LazyModuleMixin) and sub.has_uninitialized_params():  # type: ignore[misc]
            out.append(f"{label}: a lazy module must be initialised (run one forward) before wrapping")
    return out


def _tracked(module: nn.Module) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    return [
        (name, sub)
        for name, sub in module.named_modules()
        if isinstance(sub, nn.modules.batchnorm._BatchNorm)
        and not isinstance(sub, nn.SyncBatchNorm)
        and sub.track_running_stats
        and sub.running_mean is not None
    ]


class NormStats:
    """Notes each micro-batch's BatchNorm statistics and replays them in global order."""

    def __init__(self, module: nn.Module) -> None:
        self._norms = _tracked(module)
        tracked = {id(sub) for _, sub in self._norms}
        self._still: list[tuple[str, torch.Tensor]] = [
            (f"{name}.{b}" if name else b, buf)
            for name, sub in module.named_modules()
            if id(sub) not in tracked
            for b, buf in sub.named_buffers(recurse=False)
            if buf is not None
        ]
        self._versions: list[int] = []
        self._rows: list[torch.Tensor] = []  # one per micro-batch of this rank, in order
        self._saved: dict[int, dict[str, torch.Tensor]] = {}
        self.active = False
        self._handles = []
        for _, sub in self._norms:
            self._handles.append(sub.register_forward_pre_hook(self._before))
            self._handles.append(sub.register_forward_hook(self._after))
        self.width = sum(2 * sub.num_features for _, sub in self._norms)

    def __bool__(self) -> bool:
        return bool(self._norms)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    # -- during a global batch --------------------------------------------------------------

    def begin_global_batch(self) -> None:
        self._rows = []
        self._versions = [buf._version for _, buf in self._still]

    def begin_micro_batch(self) -> None:
        if self._norms:
            self._row: list[torch.Tensor] = []

    def end_micro_batch(self) -> None:
        """Close this micro-batch's row: every tracked BatchNorm must have run once in it."""
        if not self._norms:
            return
        row = self._row
        if len(row) != len(self._norms):
            raise InvariantTrainingError(
                "InvariantDataParallel: a BatchNorm module ran "
                f"{len(row)} times for {len(self._norms)} tracked modules in one micro-batch; each "
                "BatchNorm must run exactly once per micro-batch in training (its running statistics "
                "are replayed in global order). Call a shared BatchNorm once, or put it in eval mode."
            )
        self._rows.append(torch.cat(row))

    def _before(self, sub: nn.Module, args: Any) -> None:
        if not (self.active and sub.training):
            return
        # The forward updates scratch copies (which its backward may keep); the buffers are put
        # back untouched after it, so no tensor a graph saved is ever changed in place.
        originals = {}
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            buf = getattr(sub, name)
            if buf is not None:
                originals[name] = buf
                setattr(sub, name, buf.detach().clone())
        self._saved[id(sub)] = originals

    def _after(self, sub: nn.Module, args: Any, output: Any) -> None:
        originals = self._saved.pop(id(sub), None)
        if originals is None:
            return
        for name, buf in originals.items():
            setattr(sub, name, buf)
        x = args[0].detach()
        dims = [d for d in range(x.dim()) if d != 1]
        with torch.no_grad():
            xs = x.to(_STAT_DTYPE)
            mean = xs.mean(dim=dims)
            var = xs.var(dim=dims, unbiased=True)
        self._row.append(torch.cat([mean.reshape(-1).cpu(), var.reshape(-1).cpu()]))

    # -- at the end of a global batch -------------------------------------------------------

    def local_rows(self) -> torch.Tensor:
        """This rank's rows, ``[A, width]``."""
        if not self._rows:
            return torch.empty(0, self.width, dtype=_STAT_DTYPE)
        return torch.stack(self._rows)

    def replay(self, rows: torch.Tensor) -> None:
        """Apply the updates of every micro-batch of the global batch (``rows``: ``[V, width]``
        in global micro-batch order) to the running statistics, in that order."""
        with torch.no_grad():
            for row in rows:
                offset = 0
                for _, sub in self._norms:
                    c = sub.num_features
                    mean, var = row[offset : offset + c], row[offset + c : offset + 2 * c]
                    offset += 2 * c
                    rm, rv = sub.running_mean, sub.running_var
                    assert rm is not None and rv is not None
                    if sub.num_batches_tracked is not None:
                        sub.num_batches_tracked.add_(1)
                    if sub.momentum is None:
                        factor = 1.0 / float(sub.num_batches_tracked)  # type: ignore[arg-type]
                    else:
                        factor = float(sub.momentum)
                    new_mean = rm.to(_STAT_DTYPE) * (1.0 - factor) + mean.to(rm.device) * factor
                    new_var = rv.to(_STAT_DTYPE) * (1.0 - factor) + var.to(rv.device) * factor
                    rm.copy_(new_mean)
                    rv.copy_(new_var)

    def check_still(self) -> None:
        """Refuse a buffer (not a BatchNorm's running statistics) that changed this global batch."""
        versions = zip(self._still, self._versions, strict=True)
        moved = [name for (name, buf), v in versions if buf._version != v]
        if moved:
            raise InvariantTrainingError(
                "InvariantDataParallel: the buffers "
                + ", ".join(moved)
                + " changed during training. Their updates would depend on which rank computes which "
                "micro-batch, so the result would change with the world size; only BatchNorm running "
                "statistics are replayed in global micro-batch order. Keep these buffers constant in "
                "training (or register them with persistent state outside the module)."
            )
