"""Multi-head scaled dot-product attention (paper section 3.2)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a padded (B, S) batch lie, so that position-wise work (projections,
    feed-forward, LayerNorm) runs on those n tokens only, (n, D), and attention on the padded (B, S, D).
    A batch of sentences of mixed length is often half padding."""

    index: Tensor  # (n,): flat positions b * S + s of the real tokens
    batch: int
    length: int

    @staticmethod
    def of(padding: Tensor) -> Packing:
        """padding (B, S), True at padding."""
        return Packing(padding.logical_not().view(-1).nonzero().squeeze(1), *padding.shape)

    def pack(self, x: Tensor) -> Tensor:
        """(B, S, ...) -> (n, ...)"""
        return x.reshape(self.batch * self.length, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """(n, ...) -> (B, S, ...), zeros at padding."""
        out = x.new_zeros(self.batch * self.length, *x.shape[1:])
        return out.index_copy_(0, self.index, x).view(self.batch, self.length, *x.shape[1:])


def attention_by_products(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None,
                          causal: bool = False, dropout: nn.Module | None = None) -> Tensor:
    """Scaled dot-product attention written out, as two batched products and a softmax: what
    MultiHeadAttention.attend computes (its shapes), for the transforms that run it so. The softmax
    runs in fp32 at least, whatever the products' precision; `dropout`, if any, applies to its weights."""
    scores = (q * q.size(-1) ** -0.5) @ k.transpose(-1, -2)  # (B, n_heads, Tq, Tk)
    if causal:  # query i sees keys 0..i, as scaled_dot_product_attention's is_causal
        scores.masked_fill_(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if key_padding_mask is not None:
        scores.masked_fill_(key_padding_mask[:, None, None, :], float("-inf"))
    weights = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(v.dtype)
    return (weights if dropout is None else dropout(weights)) @ v


class MultiHeadAttention(nn.Module):
    """h heads, each projecting queries and keys to d_k and values to d_v (the paper: d_k = d_v =
    d_model / h = 64; Table 3 rows (A) and (B) vary them).

    The projections of one input run as one product: self-attention's W^Q, W^K and W^V stacked
    (qkv_proj), attention to another sequence's W^K and W^V (kv_proj, beside q_proj). One product of
    three times the width reads its input once and launches once where three products would each do
    both (`python -m bench.train`, against `--separate-projections`)."""

    def __init__(self, d_model: int, n_heads: int, d_k: int, d_v: int, dropout: float, self_attention: bool) -> None:
        super().__init__()
        self.n_heads, self.d_k, self.d_v = n_heads, d_k, d_v
        self.dropout = dropout
        self.sizes = (n_heads * d_k, n_heads * d_k, n_heads * d_v)  # the rows of W^Q, W^K, W^V
        if self_attention:
            self.qkv_proj = nn.Linear(d_model, sum(self.sizes))
        else:
            self.q_proj = nn.Linear(d_model, self.sizes[0])
            self.kv_proj = nn.Linear(d_model, sum(self.sizes[1:]))
        self.out_proj = nn.Linear(n_heads * d_v, d_model)

    @property
    def self_attention(self) -> bool:
        return hasattr(self, "qkv_proj")

    def stacked(self) -> dict[str, tuple[int, ...]]:
        """Each projection's name and the sizes of the products stacked in it, in order (q, k, v)."""
        if self.self_attention:
            return {"qkv_proj": self.sizes}
        return {"q_proj": self.sizes[:1], "kv_proj": self.sizes[1:]}

    def project(self, query: Tensor, memory: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries of `query` (..., D), keys and values of `memory` (..., D), or of `query` itself when
        memory is None (self-attention): (..., n_heads * d_k) twice and (..., n_heads * d_v)."""
        if memory is None:
            q, k, v = self.qkv_proj(query).split(self.sizes, -1)
            return q, k, v
        k, v = self.kv_proj(memory).split(self.sizes[1:], -1)
        return self.q_proj(query), k, v

    def _heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape  # (B, T, n_heads * d) -> (B, n_heads, T, d)
        return x.view(b, t, self.n_heads, -1).transpose(1, 2)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool) -> Tensor:
        """Scaled dot-product attention (section 3.2.1), softmax(q k^T / sqrt(d_k)) v: q (B, n_heads, Tq, d_k),
        k (B, n_heads, Tk, d_k), v (B, n_heads, Tk, d_v) -> (B, n_heads, Tq, d_v); key_padding_mask (B, Tk),
        True where a key must get no weight."""
        mask = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]  # True = may attend
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              dropout_p=self.dropout if self.training else 0.0)

    def forward(
        self,
        query: Tensor,
        memory: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        packing: Packing | None = None,
    ) -> Tensor:
        """Attend from `query` (N, Tq, D) to `memory` (B, Tk, D), N = beams x B: rows b x beams ..
        (b + 1) x beams - 1 of the query (a sentence's beams in beam search) share memory row b.
        memory None: self-attention, from `query` to itself (the module's qkv_proj).

        key_padding_mask: (B, Tk), True where the key is padding and must get no weight.
        causal: each query position sees only keys at or before it (decoder self-attention).
        packing: self-attention over tokens without padding, (n, D) (the encoder's); the result is
        (n, D) too.
        """
        q, k, v = self.project(query, memory)
        if packing is not None:
            q, k, v = (packing.unpack(x) for x in (q, k, v))
        q, k, v = self._heads(q), self._heads(k), self._heads(v)  # (N or B, n_heads, T, d)
        n, _, tq, _ = q.shape
        b = k.size(0)
        beams = n // b
        if beams > 1:  # the beams of a sentence ask one source together: (B, n_heads, beams * Tq, d_k)
            q = q.view(b, beams, self.n_heads, tq, -1).transpose(1, 2).reshape(b, self.n_heads, beams * tq, -1)
        y = self.attend(q, k, v, key_padding_mask, causal)  # (B, n_heads, beams * Tq, d_v)
        y = y.view(b, self.n_heads, beams, tq, self.d_v).permute(0, 2, 3, 1, 4)  # (B, beams, Tq, n_heads, d_v)
        y = y.reshape(n, tq, self.n_heads * self.d_v)
        return self.out_proj(y if packing is None else packing.pack(y))


def with_stacked_projections(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """`state` in `model`'s names: any attention's products saved apart (q_proj, k_proj, v_proj, as files
    from before they were one product hold them) stacked, so that it loads."""
    state = dict(state)
    for prefix, module in model.named_modules():
        if not isinstance(module, MultiHeadAttention):
            continue
        at = f"{prefix}." if prefix else ""
        name, parts = ("qkv_proj", "qkv") if module.self_attention else ("kv_proj", "kv")
        for leaf in ("weight", "bias"):
            keys = [f"{at}{part}_proj.{leaf}" for part in parts]
            if all(key in state for key in keys):
                state[f"{at}{name}.{leaf}"] = torch.cat([state.pop(key) for key in keys])
    return state
