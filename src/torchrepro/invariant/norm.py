"""BatchNorm running statistics updated in global micro-batch order, and buffers that may not move.

Invariants:
- In training, each micro-batch normalises with its own statistics (the module's forward is
  untouched), and those depend only on the micro-batch, which is the same on every world size.
- The running statistics do not move during a global batch: each micro-batch's forward updates
  scratch buffers that start at zero (swapped in by a pre-hook; the buffers are never changed in
  place while a graph may hold them), so the kernel leaves in them exactly this micro-batch's
  share of the update (``momentum * mean``, ``momentum * unbiased var``); a hook notes the shares
  and puts the buffers back. When the global batch ends, every rank has every micro-batch's
  shares (gathered in global micro-batch order) and replays ``running = (1 - momentum) * running
  + share`` (the cumulative average when ``momentum is None``) in that order: the buffers are the
  same bits on every rank and every world size.
- Any other buffer must not change during training: its version counter is checked at the end of
  each global batch, and a module whose buffer changed is refused by name. ``SyncBatchNorm`` (its
  statistics span ranks) and instance norms tracking running statistics are refused up front.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchrepro.errors import InvariantTrainingError

_STAT_DTYPE = torch.float64  # shares travel in float64: float32 and bfloat16 round-trip exactly


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

    def begin_micro_batch(self, index: int) -> None:
        """Micro-batch ``index`` (of its global batch, ``0 <= index < V``) begins."""
        if self._norms:
            self._row: list[torch.Tensor] = []
            self._index = index

    def end_micro_batch(self) -> None:
        """Close this micro-batch's row: every tracked BatchNorm must have run once in it."""
        if not self._norms:
            return
        row = self._row
        if len(row) != 2 * len(self._norms):
            raise InvariantTrainingError(
                "InvariantDataParallel: the BatchNorm modules ran "
                f"{len(row) // 2} times in one micro-batch, for {len(self._norms)} modules; each "
                "BatchNorm must run exactly once per micro-batch in training (its running statistics "
                "are replayed in global order). Call a shared BatchNorm once, or put it in eval mode."
            )
        self._rows.append(torch.cat([t.to(_STAT_DTYPE).reshape(-1).cpu() for t in row]))

    def _before(self, sub: nn.Module, args: Any) -> None:
        if not (self.active and sub.training):
            return
        assert isinstance(sub, nn.modules.batchnorm._BatchNorm)
        # The forward updates scratch buffers that start at zero: it leaves in them exactly its
        # own share of the update (``momentum * mean``, ``momentum * unbiased var``), computed by
        # the BatchNorm kernel itself. The buffers are put back untouched after the forward (and
        # never changed in place while a graph may hold them). ``num_batches_tracked`` starts at
        # the count this micro-batch has in global order, so ``momentum=None`` (the cumulative
        # average) weighs it as a sequential run would.
        rm, rv, tracked = sub.running_mean, sub.running_var, sub.num_batches_tracked
        assert rm is not None and rv is not None
        originals = {"running_mean": rm, "running_var": rv}
        sub.running_mean, sub.running_var = torch.zeros_like(rm), torch.zeros_like(rv)
        if tracked is not None:
            originals["num_batches_tracked"] = tracked
            sub.num_batches_tracked = tracked.detach() + self._index
        self._saved[id(sub)] = originals

    def _after(self, sub: nn.Module, args: Any, output: Any) -> None:
        originals = self._saved.pop(id(sub), None)
        if originals is None:
            return
        assert isinstance(sub, nn.modules.batchnorm._BatchNorm)
        shares = sub.running_mean, sub.running_var
        assert shares[0] is not None and shares[1] is not None
        self._row += [shares[0].detach(), shares[1].detach()]
        for name, buf in originals.items():
            setattr(sub, name, buf)

    # -- at the end of a global batch -------------------------------------------------------

    def local_rows(self) -> torch.Tensor:
        """This rank's rows, ``[A, width]``."""
        if not self._rows:
            return torch.empty(0, self.width, dtype=_STAT_DTYPE)
        return torch.stack(self._rows)

    def replay(self, rows: torch.Tensor) -> None:
        """Apply the updates of every micro-batch of the global batch (``rows``: ``[V, width]``
        in global micro-batch order) to the running statistics, in that order:
        ``running = (1 - momentum) * running + share``, the kernel's own update."""
        with torch.no_grad():
            for row in rows:
                offset = 0
                for _, sub in self._norms:
                    c = sub.num_features
                    rm, rv = sub.running_mean, sub.running_var
                    assert rm is not None and rv is not None
                    mean_share = row[offset : offset + c].to(rm.dtype).to(rm.device)
                    var_share = row[offset + c : offset + 2 * c].to(rv.dtype).to(rv.device)
                    offset += 2 * c
                    if sub.num_batches_tracked is not None:
                        sub.num_batches_tracked.add_(1)
                    if sub.momentum is None:
                        keep = 1.0 - 1.0 / float(sub.num_batches_tracked)  # type: ignore[arg-type]
                    else:
                        keep = 1.0 - float(sub.momentum)
                    rm.mul_(keep).add_(mean_share)
                    rv.mul_(keep).add_(var_share)

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
