"""The encoder-decoder Transformer (paper section 3) with one embedding matrix shared by the source,
the target and the pre-softmax projection (section 3.4), as the joint vocabulary allows."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from transformer.attention import KVCache
from transformer.layers import DecoderLayer, EncoderLayer


@dataclass(frozen=True)
class TransformerConfig:
    """The architecture; the paper's base model is 512 / 8 / 2048 / 6+6 / 0.1."""

    d_model: int
    n_heads: int
    d_ff: int
    encoder_layers: int
    decoder_layers: int
    dropout: float  # on embeddings and on every sub-layer's output (section 5.4)
    attention_dropout: float  # on attention weights; the paper uses none
    norm: Literal["post", "pre"]  # post: the paper's LayerNorm(x + Sublayer(x))
    positions: Literal["sinusoidal", "learned"]
    max_positions: int  # longest sequence the position encoding covers


def sinusoidal_positions(n: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)  (section 3.5); (n, d_model)."""
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(n, d_model)
    pe[:, 0::2] = torch.sin(pos * inv_freq)
    pe[:, 1::2] = torch.cos(pos * inv_freq)
    return pe


class Transformer(nn.Module):
    def __init__(self, config: TransformerConfig, vocab_size: int, pad_id: int) -> None:
        super().__init__()
        c = self.config = config
        self.vocab_size, self.pad_id = vocab_size, pad_id
        self.embed = nn.Embedding(vocab_size, c.d_model, padding_idx=pad_id)
        if c.positions == "learned":
            self.learned_positions = nn.Embedding(c.max_positions, c.d_model)
        else:
            self.register_buffer("sinusoids", sinusoidal_positions(c.max_positions, c.d_model), persistent=False)
        self.embed_dropout = nn.Dropout(c.dropout)
        pre = c.norm == "pre"
        self.encoder = nn.ModuleList(
            EncoderLayer(c.d_model, c.n_heads, c.d_ff, c.dropout, c.attention_dropout, pre, f"enc{i}")
            for i in range(c.encoder_layers)
        )
        self.decoder = nn.ModuleList(
            DecoderLayer(c.d_model, c.n_heads, c.d_ff, c.dropout, c.attention_dropout, pre, f"dec{i}")
            for i in range(c.decoder_layers)
        )
        # Pre-norm stacks end in a LayerNorm of their own; post-norm layers already end in one.
        self.encoder_norm = nn.LayerNorm(c.d_model) if pre else nn.Identity()
        self.decoder_norm = nn.LayerNorm(c.d_model) if pre else nn.Identity()
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() > 1 and "embed" not in name and "positions" not in name:
                nn.init.xavier_uniform_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
        # Scaled by sqrt(d_model) on the way in, so the embeddings start at unit variance.
        nn.init.normal_(self.embed.weight, std=self.config.d_model**-0.5)
        nn.init.zeros_(self.embed.weight[self.pad_id])

    def _embed(self, tokens: Tensor, offset: int = 0) -> Tensor:
        t = tokens.size(1)  # tokens (B, T) -> (B, T, d_model)
        if offset + t > self.config.max_positions:
            raise ValueError(f"sequence of {offset + t} positions exceeds max_positions {self.config.max_positions}")
        if self.config.positions == "learned":
            pos = self.learned_positions.weight[offset : offset + t]
        else:
            pos = self.sinusoids[offset : offset + t]
        return self.embed_dropout(self.embed(tokens) * math.sqrt(self.config.d_model) + pos)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) -> memory (B, S, d_model) and its padding mask (B, S), True at padding."""
        src_pad = src.eq(self.pad_id)
        x = self._embed(src)
        for layer in self.encoder:
            x = layer(x, src_pad)
        return self.encoder_norm(x), src_pad

    def decode(self, tgt_in: Tensor, memory: Tensor, src_pad: Tensor,
               cache: KVCache | None = None, offset: int = 0) -> Tensor:
        """tgt_in (B, T) -> logits (B, T, vocab). With a cache, tgt_in holds only the positions from
        `offset` on and keys and values of earlier positions come from the cache."""
        x = self._embed(tgt_in, offset)
        for layer in self.decoder:
            x = layer(x, memory, src_pad, cache)
        return nn.functional.linear(self.decoder_norm(x), self.embed.weight)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        memory, src_pad = self.encode(src)
        return self.decode(tgt_in, memory, src_pad)


class IncrementalDecoder:
    """The beam-search view of a model over one batch of sources: next-token log-probabilities for
    each prefix, with a key/value cache (or a full forward pass each step, for testing)."""

    def __init__(self, model: Transformer, src: Tensor, beam_size: int, use_cache: bool = True) -> None:
        self.model = model
        memory, src_pad = model.encode(src)
        # Every beam of a sentence shares its encoder output: (B * beam, S, d_model).
        self.memory = memory.repeat_interleave(beam_size, dim=0)
        self.src_pad = src_pad.repeat_interleave(beam_size, dim=0)
        self.cache: KVCache | None = {} if use_cache else None

    def step(self, tokens: Tensor) -> Tensor:
        """tokens (N, t), every prefix so far -> log-probabilities of the next token (N, vocab)."""
        if self.cache is None:
            logits = self.model.decode(tokens, self.memory, self.src_pad)[:, -1]
        else:
            t = tokens.size(1)
            logits = self.model.decode(tokens[:, -1:], self.memory, self.src_pad, self.cache, offset=t - 1)[:, 0]
        return torch.log_softmax(logits.float(), dim=-1)

    def reorder(self, order: Tensor) -> None:
        """Keep the rows `order` (N,) of every per-hypothesis state, as beam search chose them."""
        self.memory = self.memory.index_select(0, order)
        self.src_pad = self.src_pad.index_select(0, order)
        if self.cache is not None:
            for key, (k, v) in self.cache.items():
                self.cache[key] = (k.index_select(0, order), v.index_select(0, order))
