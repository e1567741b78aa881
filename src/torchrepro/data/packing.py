"""Packing: documents' tokens concatenated and cut into blocks of exactly ``seq_len``.

Invariants:
- A block is a pure function of the document sequence it is cut from and where it starts in it:
  block ``b`` of a stream holds its tokens ``[b*seq_len, (b+1)*seq_len)``. A resume that starts
  ``skip`` tokens into a shard's documents cuts the same blocks from there.
- ``position_ids`` is each token's position in its document (so a document continued from the
  previous block keeps counting), ``document_ids`` numbers a block's documents from 0. Empty
  documents add nothing; tokens are int64.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from torchrepro.errors import ShardReadError

POSITIONS = "position_ids"
DOCUMENTS = "document_ids"


def tokens_of(sample: Any, key: str, index: int | None = None, offset: int | None = None) -> torch.Tensor:
    """The 1-D int64 token ids under ``key`` of a document; a clear error for anything else."""
    where = "" if index is None else f" (shard {index}, sample {offset})"
    if not isinstance(sample, Mapping) or key not in sample:
        fields = sorted(map(str, sample)) if isinstance(sample, Mapping) else type(sample).__name__
        raise ShardReadError(
            f"pack(key={key!r}) needs each sample to be a mapping with {key!r}; a sample{where} has "
            f"{fields}. Pass key= the field that holds the token ids."
        )
    value = sample[key]
    tokens = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if tokens.dim() == 1 and tokens.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)  # an empty list reads as float32
    if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype is torch.bool:
        raise ShardReadError(
            f"pack(key={key!r}) needs a 1-D sequence of integer token ids; a sample{where} holds a "
            f"{tokens.dtype} tensor of shape {tuple(tokens.shape)}."
        )
    return tokens.to(torch.int64)


class Packer:
    """Cuts the documents it is given into blocks; ``skip`` tokens dropped from the start."""

    def __init__(self, seq_len: int, key: str, skip: int = 0) -> None:
        self.seq_len = seq_len
        self.key = key
        self.skip = skip
        self.pending: deque[list[Any]] = deque()  # [tokens, next offset in the document]
        self.available = 0

    def add(self, tokens: torch.Tensor) -> None:
        n = len(tokens)
        start = 0
        if self.skip:
            start = min(self.skip, n)
            self.skip -= start
        if start < n:
            self.pending.append([tokens, start])
            self.available += n - start

    def blocks(self) -> Iterator[dict[str, torch.Tensor]]:
        """The whole blocks the documents added so far complete."""
        seq_len = self.seq_len
        while self.available >= seq_len:
            parts: list[torch.Tensor] = []
            positions: list[int] = []
            documents: list[int] = []
            need = seq_len
            while need:
                piece = self.pending[0]
                tokens, start = piece
                take = min(need, len(tokens) - start)
                parts.append(tokens[start : start + take])
                positions.extend(range(start, start + take))
                documents.extend([len(parts) - 1] * take)
                need -= take
                if start + take == len(tokens):
                    self.pending.popleft()
                else:
                    piece[1] = start + take
            self.available -= seq_len
            # The ids as Python lists, one tensor each: a torch op per piece (or repeat_interleave,
            # about 50 us a call here) cost more than the block's tokens.
            yield {
                self.key: parts[0] if len(parts) == 1 else torch.cat(parts),
                POSITIONS: torch.tensor(positions, dtype=torch.int64),
                DOCUMENTS: torch.tensor(documents, dtype=torch.int64),
            }
