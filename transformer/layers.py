"""Encoder and decoder layers (paper section 3.1): attention and feed-forward sub-layers, each
wrapped as LayerNorm(x + Dropout(Sublayer(x))) (post-norm, the paper) or x + Dropout(Sublayer(LayerNorm(x)))."""
from __future__ import annotations

from torch import Tensor, nn

from transformer.attention import KVCache, MultiHeadAttention


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2, applied to each position alike (section 3.3)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Linear(d_ff, d_model))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Residual(nn.Module):
    """One residual sub-layer connection, post- or pre-LayerNorm."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.pre_norm = pre_norm

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, attention_dropout: float,
                 pre_norm: bool, name: str) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, attention_dropout, f"{name}.self")
        self.ffn = FeedForward(d_model, d_ff)
        self.attn_block = Residual(d_model, dropout, pre_norm)
        self.ffn_block = Residual(d_model, dropout, pre_norm)

    def forward(self, x: Tensor, src_pad: Tensor) -> Tensor:
        x = self.attn_block(x, lambda h: self.self_attn(h, h, key_padding_mask=src_pad))
        return self.ffn_block(x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, attention_dropout: float,
                 pre_norm: bool, name: str) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, attention_dropout, f"{name}.self")
        self.cross_attn = MultiHeadAttention(d_model, n_heads, attention_dropout, f"{name}.cross")
        self.ffn = FeedForward(d_model, d_ff)
        self.self_block = Residual(d_model, dropout, pre_norm)
        self.cross_block = Residual(d_model, dropout, pre_norm)
        self.ffn_block = Residual(d_model, dropout, pre_norm)

    def forward(self, x: Tensor, memory: Tensor, src_pad: Tensor, cache: KVCache | None = None) -> Tensor:
        x = self.self_block(x, lambda h: self.self_attn(h, h, causal=True, cache=cache))
        x = self.cross_block(
            x, lambda h: self.cross_attn(h, memory, key_padding_mask=src_pad, cache=cache, static_memory=True)
        )
        return self.ffn_block(x, self.ffn)
