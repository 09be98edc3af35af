"""Multi-head scaled dot-product attention (paper section 3.2) with an incremental key/value cache."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# One entry per attention module that decodes incrementally: its keys and values so far,
# each (B, n_heads, T, d_k or d_v). Beam search reorders every entry along B as beams are chosen.
KVCache = dict[str, tuple[Tensor, Tensor]]


class MultiHeadAttention(nn.Module):
    """h heads, each projecting queries and keys to d_k and values to d_v (the paper: d_k = d_v =
    d_model / h = 64; Table 3 rows (A) and (B) vary them)."""

    def __init__(self, d_model: int, n_heads: int, d_k: int, d_v: int, dropout: float, cache_key: str) -> None:
        super().__init__()
        self.n_heads, self.d_k, self.d_v = n_heads, d_k, d_v
        self.dropout = dropout
        self.cache_key = cache_key
        self.q_proj = nn.Linear(d_model, n_heads * d_k)
        self.k_proj = nn.Linear(d_model, n_heads * d_k)
        self.v_proj = nn.Linear(d_model, n_heads * d_v)
        self.out_proj = nn.Linear(n_heads * d_v, d_model)

    def _heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape  # (B, T, n_heads * d) -> (B, n_heads, T, d)
        return x.view(b, t, self.n_heads, -1).transpose(1, 2)

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
        cache: when given, keys and values are kept under this module's key. With static_memory
        (encoder-decoder attention) they are computed once from `memory`; otherwise (decoder
        self-attention, one new position per call) the new ones are appended.
        """
        q = self._heads(self.q_proj(query))
        if cache is not None and static_memory and self.cache_key in cache:
            k, v = cache[self.cache_key]
        else:
            k, v = self._heads(self.k_proj(memory)), self._heads(self.v_proj(memory))
            if cache is not None:
                if not static_memory and self.cache_key in cache:
                    past_k, past_v = cache[self.cache_key]
                    k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
                cache[self.cache_key] = (k, v)
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
