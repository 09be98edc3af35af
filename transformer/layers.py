"""Encoder and decoder layers (paper section 3.1): attention and feed-forward sub-layers, each
wrapped as LayerNorm(x + Dropout(Sublayer(x))) (post-norm, the paper) or x + Dropout(Sublayer(LayerNorm(x)))."""
from __future__ import annotations

from torch import Tensor, nn

from transformer.attention import MultiHeadAttention, Packing
from transformer.config import TransformerConfig


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


def _attention(c: TransformerConfig, self_attention: bool) -> MultiHeadAttention:
    return MultiHeadAttention(c.d_model, c.n_heads, *c.head_dims, c.attention_dropout, self_attention)


class EncoderLayer(nn.Module):
    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        pre_norm = c.norm == "pre"
        self.self_attn = _attention(c, self_attention=True)
        self.ffn = FeedForward(c.d_model, c.d_ff)
        self.attn_block = Residual(c.d_model, c.dropout, pre_norm)
        self.ffn_block = Residual(c.d_model, c.dropout, pre_norm)

    def forward(self, x: Tensor, src_pad: Tensor, packing: Packing | None = None) -> Tensor:
        """x (B, S, D), or its real tokens (n, D) with their `packing`."""
        x = self.attn_block(x, lambda h: self.self_attn(h, key_padding_mask=src_pad, packing=packing))
        return self.ffn_block(x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        pre_norm = c.norm == "pre"
        self.self_attn = _attention(c, self_attention=True)
        self.cross_attn = _attention(c, self_attention=False)
        self.ffn = FeedForward(c.d_model, c.d_ff)
        self.self_block = Residual(c.d_model, c.dropout, pre_norm)
        self.cross_block = Residual(c.d_model, c.dropout, pre_norm)
        self.ffn_block = Residual(c.d_model, c.dropout, pre_norm)

    def forward(self, x: Tensor, memory: Tensor, src_pad: Tensor | None) -> Tensor:
        """x (N, T, D); memory (B, S, D), N = beams x B."""
        x = self.self_block(x, lambda h: self.self_attn(h, causal=True))
        x = self.cross_block(x, lambda h: self.cross_attn(h, memory, key_padding_mask=src_pad))
        return self.ffn_block(x, self.ffn)
