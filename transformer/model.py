"""The encoder-decoder Transformer (paper section 3) with one embedding matrix shared by the source,
the target and the pre-softmax projection (section 3.4), as the joint vocabulary allows."""
from __future__ import annotations

import math
import torch
from torch import Tensor, nn

from transformer.config import TransformerConfig
from transformer.attention import Packing
from transformer.layers import DecoderLayer, EncoderLayer, LayerCache


def sinusoidal_positions(n: int, d_model: int) -> Tensor:
    """sin(pos / 10000^(2i/d)) and cos(...) for i < d/2 (section 3.5); (n, d_model).

    The paper interleaves them (dimensions 2i and 2i+1); its code, tensor2tensor, and Marian (so
    the exported model) put the sines in the first half and the cosines in the second: the same
    features in another order, which a learned model cannot tell apart. We use the code's order."""
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    return torch.cat([torch.sin(pos * inv_freq), torch.cos(pos * inv_freq)], dim=1)


class PreSoftmax(nn.Module):
    """The pre-softmax linear transformation (section 3.4) with the shared embedding matrix, given at
    each call: it holds no weights, so another implementation (int8 decoding) can take its place."""

    def forward(self, x: Tensor, weight: Tensor, out: Tensor | None = None) -> Tensor:
        """x (N, T, d_model), weight (vocab, d_model) -> logits (N, T, vocab), written into `out` if
        given (another implementation may return a tensor of its own instead)."""
        if out is None:
            return nn.functional.linear(x, weight)
        return torch.matmul(x, weight.t(), out=out)


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
        self.pre_softmax = PreSoftmax()
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

    def encode(self, src: Tensor, unpadded: bool = False) -> tuple[Tensor, Tensor]:
        """src (B, S) -> memory (B, S, d_model) and its padding mask (B, S), True at padding.
        unpadded: every position-wise product runs on the real tokens only (see Packing), for
        batches of mixed lengths; memory is zero at padding."""
        src_pad = src.eq(self.pad_id)
        x = self._embed(src)
        packing = Packing.of(src_pad) if unpadded else None
        if packing is not None:
            x = packing.pack(x)  # (n, d_model)
        for layer in self.encoder:
            x = layer(x, src_pad, packing)
        x = self.encoder_norm(x)
        return (x if packing is None else packing.unpack(x)), src_pad

    def decode(self, tgt_in: Tensor, memory: Tensor, src_pad: Tensor, cache: DecoderCache | None = None,
               offset: int = 0, out: Tensor | None = None) -> Tensor:
        """tgt_in (N, T) -> logits (N, T, vocab); N may be beams x B (see MultiHeadAttention). With a
        cache, tgt_in holds only the positions from `offset` on and keys and values of earlier positions
        come from the cache. `out` (N, T, vocab), when given, is a buffer the logits may be written into."""
        x = self._embed(tgt_in, offset)
        for i, layer in enumerate(self.decoder):
            x = layer(x, memory, src_pad, cache.layers[i] if cache is not None else None)
        return self.pre_softmax(self.decoder_norm(x), self.embed.weight, out)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        memory, src_pad = self.encode(src)
        return self.decode(tgt_in, memory, src_pad)

    def fuse_projections(self) -> None:
        """Every self-attention's queries, keys and values in one product, for inference (see
        MultiHeadAttention.fuse_projections); the state dict then has qkv_proj in their place."""
        for layer in (*self.encoder, *self.decoder):
            layer.self_attn.fuse_projections()


class DecoderCache:
    """Every decoder layer's keys and values while decoding: the self-attention's per hypothesis
    (row), the cross-attention's per source sentence."""

    def __init__(self, layers: int) -> None:
        self.layers = [LayerCache() for _ in range(layers)]

    def reorder(self, order: Tensor, sentences: Tensor | None) -> None:
        """Keep hypothesis rows `order` (N,) as beam search chose them and, when some sentences left
        the batch, the source rows `sentences` of those that stay."""
        for layer in self.layers:
            layer.self_attn.reorder(order)
            if sentences is not None:
                layer.cross_attn.reorder(sentences)


class IncrementalDecoder:
    """The beam-search view of a model over one batch of sources: next-token log-probabilities for
    each prefix, with a key/value cache (or a full forward pass each step, for testing). The beams of
    a sentence share its encoder output and cross-attention keys and values (one row per sentence, not
    per beam). The tokens in `never` (padding, and the caller's BOS) get no probability at all: they
    are taken out before the softmax, so neither the search nor the other tokens' probabilities depend
    on their rows of the shared embedding."""

    def __init__(self, model: Transformer, src: Tensor, use_cache: bool = True, never: tuple[int, ...] = ()) -> None:
        self.model = model
        self.memory, self.src_pad = model.encode(src, unpadded=True)  # (B, S, d_model), (B, S)
        self.cache = DecoderCache(len(model.decoder)) if use_cache else None
        self.never = torch.tensor(sorted({model.pad_id, *never}), device=src.device)
        # Logits are written into this, the largest tensor of a step: on CPUs a fresh one each step
        # costs about as much as the output projection (new pages from the OS).
        self._logits: Tensor | None = None

    def _buffer(self, n: int) -> Tensor:
        if self._logits is None or self._logits.size(0) < n:
            self._logits = self.model.embed.weight.new_empty(n, 1, self.model.vocab_size)
        return self._logits[:n]

    def step(self, tokens: Tensor) -> Tensor:
        """tokens (N, t), every prefix so far, N = beams x B -> log-probabilities of the next token (N,
        vocab), in a tensor the next step overwrites."""
        if self.cache is None:
            logits = self.model.decode(tokens, self.memory, self.src_pad)[:, -1]
            return torch.log_softmax(logits.float().index_fill_(-1, self.never, float("-inf")), dim=-1)
        t = tokens.size(1)
        logits = self.model.decode(tokens[:, -1:], self.memory, self.src_pad, self.cache, offset=t - 1,
                                   out=self._buffer(tokens.size(0)))
        x = logits[:, 0].float().index_fill_(-1, self.never, float("-inf"))
        return torch.log_softmax(x, -1, out=x)  # in place: each row is read whole before it is written

    def reorder(self, order: Tensor, sentences: Tensor | None = None) -> None:
        """Keep the hypothesis rows `order` (N,) as beam search chose them, and the sentences'
        rows `sentences` when some left the batch."""
        if sentences is not None:
            self.memory = self.memory.index_select(0, sentences)
            self.src_pad = self.src_pad.index_select(0, sentences)
        if self.cache is not None:
            self.cache.reorder(order, sentences)


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
