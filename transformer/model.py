"""The encoder-decoder Transformer (paper section 3) with one embedding matrix shared by the source,
the target and the pre-softmax projection (section 3.4), as the joint vocabulary allows."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from transformer.attention import MultiHeadAttention, Packing
from transformer.config import TransformerConfig
from transformer.layers import DecoderLayer, EncoderLayer


def sinusoidal_positions(n: int, d_model: int) -> Tensor:
    """sin(pos / 10000^(2i/d)) and cos(...) for i < d/2 (section 3.5); (n, d_model).

    The paper interleaves them (dimensions 2i and 2i+1); its code, tensor2tensor, and Marian (so
    the exported model) put the sines in the first half and the cosines in the second: the same
    features in another order, which a learned model cannot tell apart. We use the code's order."""
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    return torch.cat([torch.sin(pos * inv_freq), torch.cos(pos * inv_freq)], dim=1)


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
        self.encoder = nn.ModuleList(EncoderLayer(c) for _ in range(c.encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(c) for _ in range(c.decoder_layers))
        # Pre-norm stacks end in a LayerNorm of their own; post-norm layers already end in one.
        self.encoder_norm = nn.LayerNorm(c.d_model) if pre else nn.Identity()
        self.decoder_norm = nn.LayerNorm(c.d_model) if pre else nn.Identity()
        # The pre-softmax projection is the embedding matrix (section 3.4); made on the meta device, so
        # its own weight, replaced at once, costs neither memory nor random draws.
        self.output = nn.Linear(c.d_model, vocab_size, bias=False, device="meta")
        self.output.weight = self.embed.weight
        # State dicts hold the shared matrix once, as embed.weight.
        self.register_state_dict_post_hook(_drop_tied_output)
        self.register_load_state_dict_pre_hook(_tie_output)
        self._init_weights()

    def _init_weights(self) -> None:
        # A stacked projection's W^Q, W^K and W^V are initialised each as a matrix of its own.
        stacked = {f"{name}.{proj}.weight": sizes for name, m in self.named_modules()
                   if isinstance(m, MultiHeadAttention) for proj, sizes in m.stacked().items()}
        for name, p in self.named_parameters():
            if p.dim() > 1 and "embed" not in name and "positions" not in name:
                for part in p.split(stacked.get(name, p.size(0))):
                    nn.init.xavier_uniform_(part)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
        # Scaled by sqrt(d_model) on the way in, so the embeddings start at unit variance.
        nn.init.normal_(self.embed.weight, std=self.config.d_model**-0.5)
        nn.init.zeros_(self.embed.weight[self.pad_id])

    def embed_positions(self, tokens: Tensor, offset: int = 0) -> Tensor:
        """The first layer's input: tokens (B, T) at positions offset .. offset + T - 1 -> their embeddings
        times sqrt(d_model) plus the positions' encodings (sections 3.4, 3.5), (B, T, d_model)."""
        t = tokens.size(1)
        if offset + t > self.config.max_positions:
            raise ValueError(f"sequence of {offset + t} positions exceeds max_positions {self.config.max_positions}")
        if self.config.positions == "learned":
            pos = self.learned_positions.weight[offset : offset + t]
        else:
            pos = self.sinusoids[offset : offset + t]
        return self.embed_dropout(self.embed(tokens) * math.sqrt(self.config.d_model) + pos)

    def encode(self, src: Tensor, unpadded: bool = False) -> tuple[Tensor, Tensor]:
        """src (B, S) -> memory (B, S, d_model) and its padding mask (B, S), True at padding.
        unpadded: every position-wise product runs on the real tokens only (see Packing), for
        batches of mixed lengths; memory is zero at padding."""
        src_pad = src.eq(self.pad_id)
        x = self.embed_positions(src)
        packing = Packing.of(src_pad) if unpadded else None
        if packing is not None:
            x = packing.pack(x)  # (n, d_model)
        for layer in self.encoder:
            x = layer(x, src_pad, packing)
        x = self.encoder_norm(x)
        return (x if packing is None else packing.unpack(x)), src_pad

    def decode(self, tgt_in: Tensor, memory: Tensor, src_pad: Tensor | None) -> Tensor:
        """tgt_in (N, T) -> logits (N, T, vocab); N may be beams x B (see MultiHeadAttention); src_pad
        None: no source position is padding."""
        x = self.embed_positions(tgt_in)
        for layer in self.decoder:
            x = layer(x, memory, src_pad)
        return self.output(self.decoder_norm(x))

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        memory, src_pad = self.encode(src)
        return self.decode(tgt_in, memory, src_pad)


def _drop_tied_output(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    state.pop(prefix + "output.weight", None)


def _tie_output(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
    if prefix + "embed.weight" in state:
        state[prefix + "output.weight"] = state[prefix + "embed.weight"]


def training_flops(config: TransformerConfig, vocab_size: int, src_lengths: Tensor, tgt_lengths: Tensor) -> float:
    """Model FLOPs of one training step on these sentence pairs (no padding, no recomputation): the
    matrix products of the forward pass, 2 per multiply-add, times 3 for the backward pass. The basis of
    model FLOPs utilisation; each decoder position attends to itself and the positions before it.
    src_lengths, tgt_lengths (B,): tokens per sentence, EOS (and BOS) included."""
    c = config
    d_k, d_v = c.head_dims
    qk, v = c.n_heads * d_k, c.n_heads * d_v
    s, t = src_lengths.double(), tgt_lengths.double()
    n_src, n_tgt = s.sum(), t.sum()
    projections = 2 * c.d_model * (2 * qk + v) + 2 * v * c.d_model  # q, k, v and output, per token
    ffn = 4 * c.d_model * c.d_ff
    encoder = c.encoder_layers * ((projections + ffn) * n_src + 2 * (qk + v) * (s * s).sum())
    decoder = c.decoder_layers * (
        (2 * projections + ffn) * n_tgt - 2 * c.d_model * (qk + v) * n_tgt  # cross-attention keys/values come from
        + 2 * c.d_model * (qk + v) * n_src  # the source, once per source token
        + 2 * (qk + v) * (t * (t + 1) / 2).sum()  # causal self-attention
        + 2 * (qk + v) * (s * t).sum()  # attention to the source
    )
    output = 2 * c.d_model * vocab_size * n_tgt
    return float(3 * (encoder + decoder + output))
