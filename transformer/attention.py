"""Multi-head scaled dot-product attention (paper section 3.2) with an incremental key/value cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a padded (B, S) batch lie, so that position-wise work (projections,
    feed-forward, LayerNorm) runs on those n tokens only, (n, D), and attention on the padded (B, S, D).
    A batch of sentences of mixed length is often half padding (CTranslate2 removes it as well)."""

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


@dataclass
class GrowingKVCache(KVCache):
    """Decoder self-attention's keys and values, one position longer each step. Reordering copies the
    rows into tensors with room for one more position, which the next append fills in place: one copy
    of the cache per step instead of two (reorder, then concatenate)."""

    room: tuple[Tensor, Tensor] | None = None

    def reorder(self, order: Tensor) -> None:
        if self.k is None or self.v is None:
            return
        t = self.k.size(2)
        k, v = (x.new_empty(len(order), x.size(1), t + 1, x.size(3)) for x in (self.k, self.v))
        torch.index_select(self.k, 0, order, out=k[:, :, :t])
        torch.index_select(self.v, 0, order, out=v[:, :, :t])
        self.k, self.v, self.room = k[:, :, :t], v[:, :, :t], (k, v)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add positions k, v (N, n_heads, T, d); return all keys and values so far."""
        if self.k is None or self.v is None:
            self.k, self.v = k, v
        elif self.room is not None and k.size(2) == 1:
            (room_k, room_v), self.room = self.room, None
            room_k[:, :, -1:], room_v[:, :, -1:] = k, v
            self.k, self.v = room_k, room_v
        else:
            self.k, self.v, self.room = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2), None
        return self.k, self.v


def attend(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, *, fused: bool = True,
           causal: bool = False, dropout: float = 0.0) -> Tensor:
    """softmax(q k^T / sqrt(d_k)) v: q (B, n_heads, Tq, d_k), k (B, n_heads, Tk, d_k), v (B, n_heads, Tk, d_v)
    -> (B, n_heads, Tq, d_v); key_padding_mask (B, Tk), True where a key must get no weight. Fused: one
    call of scaled_dot_product_attention. Otherwise two batched products, for decoding (no causal mask,
    no dropout), which are faster on CPUs at large batches (see fused_decoding_is_faster)."""
    if fused:
        mask = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]  # True = may attend
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
    assert not causal and dropout == 0.0, "the two products serve decoding only"
    scores = q @ k.transpose(-1, -2) * q.size(-1) ** -0.5  # (B, n_heads, Tq, Tk)
    if key_padding_mask is not None:
        scores.masked_fill_(key_padding_mask[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def fused_decoding_is_faster(queries: int, per_matrix: int, keys: int) -> bool:
    """Whether a decoding step attends faster on CPUs with the fused kernel than with two batched
    products: `queries` in all (rows x heads), `per_matrix` of them to each set of `keys` (1 in
    self-attention, where each row has its own keys; the beams in attention to the source, which they
    share). The fused kernel is one call where the products take four or five, which decides up to
    about 128 queries (32 rows of 4 heads, 16 of 8); above, the products were up to 3x faster, except
    in self-attention against fewer than 8 keys (the first steps), which MKL's batched product runs at
    a fraction of its speed (`python -m bench.cpu_decoding`, README "Speed")."""
    return queries <= 128 or (per_matrix == 1 and keys < 8)


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
        self.qkv_proj: nn.Module | None = None  # q, k and v of self-attention in one: fuse_projections

    def fuse_projections(self) -> None:
        """Project queries, keys and values of self-attention (query is memory) in one product of
        3x the width, for inference: decoding a few sentences, each product's fixed cost outweighs its
        work. The three layers are removed, so the state dict is no longer the checkpoint format: the
        decode stage fuses a model it read, and saves nothing of it. A second call does nothing."""
        if self.qkv_proj is not None:
            return
        projections = (self.q_proj, self.k_proj, self.v_proj)
        fused = nn.Linear(self.q_proj.in_features, sum(p.out_features for p in projections),
                          device=self.q_proj.weight.device, dtype=self.q_proj.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([p.weight for p in projections]))
            fused.bias.copy_(torch.cat([p.bias for p in projections]))
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj

    def _heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape  # (B, T, n_heads * d) -> (B, n_heads, T, d)
        return x.view(b, t, self.n_heads, -1).transpose(1, 2)

    def _projections(self, query: Tensor, memory: Tensor, cached_memory: bool) -> tuple[Tensor, ...]:
        """q (N, Tq, n_heads * d_k), k and v (B, Tk, n_heads * d), or q alone when the cache holds them."""
        if self.qkv_proj is not None:
            assert memory is query, "fused projections serve self-attention only"
            return self.qkv_proj(query).split([self.n_heads * self.d_k] * 2 + [self.n_heads * self.d_v], -1)
        if cached_memory:
            return (self.q_proj(query),)
        return self.q_proj(query), self.k_proj(memory), self.v_proj(memory)

    def _keys_values(self, kv: tuple[Tensor, ...], cache: KVCache | None) -> tuple[Tensor, Tensor]:
        if not kv:
            assert cache is not None and cache.k is not None and cache.v is not None
            return cache.k, cache.v  # encoder-decoder attention: the source's keys and values, computed once
        k, v = (self._heads(x) for x in kv)
        if isinstance(cache, GrowingKVCache):  # self-attention: append
            return cache.append(k, v)
        if cache is not None:  # contiguous, so that each step's products read them without a copy
            cache.k, cache.v = k.contiguous(), v.contiguous()
            return cache.k, cache.v
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
        packing: Packing | None = None,
    ) -> Tensor:
        """Attend from `query` (N, Tq, D) to `memory` (B, Tk, D), N = beams x B: rows b x beams ..
        (b + 1) x beams - 1 of the query (a sentence's beams in beam search) share memory row b.

        key_padding_mask: (B, Tk), True where the key is padding and must get no weight.
        causal: each query position sees only keys at or before it (decoder self-attention).
        cache: this module's keys and values. With static_memory (encoder-decoder attention) they
        are computed once from `memory`; otherwise (decoder self-attention, one new position per
        call) the new ones are appended.
        packing: query and memory are the same tokens without padding, (n, D) (self-attention
        without a cache); the result is (n, D) too.
        """
        cached_memory = static_memory and cache is not None and cache.k is not None
        q, *kv = self._projections(query, memory, cached_memory)
        if packing is not None:
            q, k, v = (self._heads(packing.unpack(x)) for x in (q, *kv))
        else:
            q = self._heads(q)  # (N, n_heads, Tq, d_k)
            k, v = self._keys_values(tuple(kv), cache)  # (B, n_heads, Tk, d)
        n, _, tq, _ = q.shape
        b = k.size(0)
        beams = n // b
        if beams > 1:  # the beams of a sentence ask one source together: (B, n_heads, beams * Tq, d_k)
            q = q.view(b, beams, self.n_heads, tq, -1).transpose(1, 2).reshape(b, self.n_heads, beams * tq, -1)
        # Decoding (a cache): the new queries see every key so far (the self-attention's see only the
        # past), so no causal mask.
        fused = cache is None or fused_decoding_is_faster(q.numel() // q.size(-1), q.size(2), k.size(2))
        y = attend(q, k, v, key_padding_mask, fused=fused, causal=causal and cache is None,
                   dropout=self.dropout if self.training else 0.0)  # (B, n_heads, beams * Tq, d_v)
        y = y.view(b, self.n_heads, beams, tq, self.d_v).permute(0, 2, 3, 1, 4)  # (B, beams, Tq, n_heads, d_v)
        y = y.reshape(n, tq, self.n_heads * self.d_v)
        return self.out_proj(y if packing is None else packing.pack(y))
