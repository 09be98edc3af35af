"""The decoder's keys and values while it decodes one position at a time (step.py): each layer's attention
to the source computes them once, its self-attention adds one position a step. Beam search moves their
rows as it chooses beams (fairseq's `reorder_incremental_state`)."""
from __future__ import annotations

import torch
from torch import Tensor


class SourceKVCache:
    """Attention to the source: its keys and values, (B, n_heads, S, d), computed at the first step and
    kept per sentence, which the sentence's beams share."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def fill(self, k: Tensor, v: Tensor) -> None:
        """Keep the source's keys and values, contiguous, so that each step's products read them without a copy."""
        self.k, self.v = k.contiguous(), v.contiguous()

    def reorder(self, order: Tensor) -> None:
        """Row i becomes old row order[i]."""
        if self.k is not None and self.v is not None:
            self.k, self.v = self.k.index_select(0, order), self.v.index_select(0, order)


class GrowingKVCache:
    """Self-attention: the keys and values of every position so far, (N, n_heads, t, d) per hypothesis,
    one position longer each step. Reordering copies the rows into tensors with room for one more
    position, which the next step fills in place: one copy of the cache per step instead of two
    (reorder, then concatenate)."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.room: tuple[Tensor, Tensor] | None = None

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add this step's keys and values, (N, n_heads, T, d); return every position's."""
        if self.k is None or self.v is None:
            self.k, self.v = k, v
        elif self.room is not None and k.size(2) == 1:
            (room_k, room_v), self.room = self.room, None
            room_k[:, :, -1:], room_v[:, :, -1:] = k, v
            self.k, self.v = room_k, room_v
        else:
            self.k, self.v, self.room = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2), None
        return self.k, self.v

    def reorder(self, order: Tensor) -> None:
        """Row i becomes old row order[i]."""
        if self.k is None or self.v is None:
            return
        t = self.k.size(2)
        k, v = (x.new_empty(len(order), x.size(1), t + 1, x.size(3)) for x in (self.k, self.v))
        torch.index_select(self.k, 0, order, out=k[:, :, :t])
        torch.index_select(self.v, 0, order, out=v[:, :, :t])
        self.k, self.v, self.room = k[:, :, :t], v[:, :, :t], (k, v)


class DecoderCache(list[tuple[GrowingKVCache, SourceKVCache]]):
    """Every decoder layer's (self-attention, attention to the source) caches, as Transformer.decode
    takes them."""

    def __init__(self, layers: int) -> None:
        super().__init__((GrowingKVCache(), SourceKVCache()) for _ in range(layers))

    def reorder(self, order: Tensor, sentences: Tensor | None) -> None:
        """Keep hypothesis rows `order` (N,) as beam search chose them and, when some sentences left
        the batch, the source rows `sentences` of those that stay."""
        for self_attn, source in self:
            self_attn.reorder(order)
            if sentences is not None:
                source.reorder(sentences)
