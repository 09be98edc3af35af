"""Multi-head scaled dot-product attention (paper section 3.2) with an incremental key/value cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class KVCache:
    """One attention module's keys and values so far, each (B, n_heads, T, d_k or d_v); empty until
    the module's first call. Beam search moves its rows along B as it chooses beams."""

    k: Tensor | None = None
    v: Tensor | None = None

    def reorder(self, order: Tensor) -> None:
        """Row i becomes old row order[i]."""
        if self.k is not None and self.v is not None:
            self.k, self.v = self.k.index_select(0, order), self.v.index_select(0, order)


class MultiHeadAttention(nn.Module):
    """h heads, each projecting queries and keys to d_k and values to d_v (the paper: d_k = d_v =
    d_model / h = 64; Table 3 rows (A) and (B) vary them)."""

    def __init__(self, d_model: int, n_heads: int, d_k: int, d_v: int, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.d_k, self.d_v = n_heads, d_k, d_v
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, n_heads * d_k)
        self.k_proj = nn.Linear(d_model, n_heads * d_k)
        self.v_proj = nn.Linear(d_model, n_heads * d_v)
        self.out_proj = nn.Linear(n_heads * d_v, d_model)

    def _heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape  # (B, T, n_heads * d) -> (B, n_heads, T, d)
        return x.view(b, t, self.n_heads, -1).transpose(1, 2)

    def _keys_values(self, memory: Tensor, cache: KVCache | None, static_memory: bool) -> tuple[Tensor, Tensor]:
        if cache is not None and static_memory and cache.k is not None and cache.v is not None:
            return cache.k, cache.v  # encoder-decoder attention: the source's keys and values, computed once
        k, v = self._heads(self.k_proj(memory)), self._heads(self.v_proj(memory))
        if cache is not None:
            if not static_memory and cache.k is not None and cache.v is not None:  # self-attention: append
                k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
            cache.k, cache.v = k, v
        return k, v

    def forward(
        self,
        query: Tensor,
        memory: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        static_memory: bool = False,
    ) -> Tensor:
        """Attend from `query` (B, Tq, D) to `memory` (B, Tk, D).

        key_padding_mask: (B, Tk), True where the key is padding and must get no weight.
        causal: each query position sees only keys at or before it (decoder self-attention).
        cache: this module's keys and values. With static_memory (encoder-decoder attention) they
        are computed once from `memory`; otherwise (decoder self-attention, one new position per
        call) the new ones are appended.
        """
        q = self._heads(self.q_proj(query))
        k, v = self._keys_values(memory, cache, static_memory)
        mask = None
        if key_padding_mask is not None:
            mask = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, Tk): True = may attend
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            # With a cache the single new query already sees only the past.
            is_causal=causal and cache is None,
        )  # (B, n_heads, Tq, d_v)
        b, _, tq, _ = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(b, tq, self.n_heads * self.d_v))
