"""The decoder's step while translating: one new position of every hypothesis through the embedding, each
decoder layer (keys and values of earlier positions from the cache, cache.py) and the pre-softmax
projection. It computes what the model's decode (transformer/model.py) computes for that position at
inference, with the modules as the backend left them, their products, attention and norms called
directly: the model's general path wraps them in about 80 module calls, closures and shape checks a
step (3+3 layers), which at one sentence's beams cost more than the arithmetic of many of them
(`python -m bench.decode --batch-tokens 1`: one sentence at a time). Dropout, which inference leaves
out, is not called. The tests hold it to the model's forward pass over whole prefixes."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from translate.cache import DecoderCache
from transformer.layers import DecoderLayer
from transformer.model import Transformer

Apply = Callable[[Tensor], Tensor]


def _direct(module: nn.Module) -> Apply:
    """The module's computation without the module call: a Sequential's children in turn, a LayerNorm
    as torch's function, anything else its forward."""
    if isinstance(module, nn.Sequential):
        parts = [_direct(child) for child in module]

        def in_turn(x: Tensor) -> Tensor:
            for part in parts:
                x = part(x)
            return x

        return in_turn
    if isinstance(module, nn.LayerNorm):
        shape, weight, bias, eps = module.normalized_shape, module.weight, module.bias, module.eps
        return lambda x: torch.layer_norm(x, shape, weight, bias, eps)
    if isinstance(module, nn.Identity):
        return lambda x: x
    return module.forward


class _LayerStep:
    """One decoder layer at one position: self-attention over the cache, attention to the source, the
    feed-forward, each a residual sub-layer normalised after (post) or before (pre)."""

    def __init__(self, layer: DecoderLayer, pre_norm: bool) -> None:
        self_attn, cross_attn = layer.self_attn, layer.cross_attn
        self.heads, (self.d_k, self.d_v) = self_attn.n_heads, (self_attn.d_k, self_attn.d_v)
        qkv, kv, sizes = _direct(self_attn.qkv_proj), _direct(cross_attn.kv_proj), self_attn.sizes
        self.qkv: Callable[[Tensor], list[Tensor]] = lambda x: qkv(x).split(sizes, -1)
        self.cross_kv: Callable[[Tensor], list[Tensor]] = lambda m: kv(m).split(sizes[1:], -1)
        self.self_attend, self.cross_attend = self_attn.attend, cross_attn.attend
        self.self_out, self.ffn = _direct(self_attn.out_proj), _direct(layer.ffn.net)
        self.cross_q, self.cross_out = _direct(cross_attn.q_proj), _direct(cross_attn.out_proj)
        self.norms = [_direct(block.norm) for block in (layer.self_block, layer.cross_block, layer.ffn_block)]
        self.pre_norm = pre_norm

    def _residual(self, i: int, x: Tensor, sublayer: Apply) -> Tensor:
        norm = self.norms[i]
        return x + sublayer(norm(x)) if self.pre_norm else norm(x + sublayer(x))

    def __call__(self, x: Tensor, memory: Tensor, src_pad: Tensor | None, cache: DecoderCache, i: int) -> Tensor:
        """x (N, 1, D), N = beams x B; memory (B, S, D); src_pad (B, S) or None."""
        n, b, h = x.size(0), memory.size(0), self.heads
        self_cache, source = cache[i]

        def self_attention(y: Tensor) -> Tensor:
            q, k, v = (p.view(n, 1, h, -1).transpose(1, 2) for p in self.qkv(y))  # (N, h, 1, d)
            k, v = self_cache.extend(k, v)  # (N, h, t, d)
            return self.self_out(self.self_attend(q, k, v, None, False).transpose(1, 2).reshape(n, 1, -1))

        def cross_attention(y: Tensor) -> Tensor:
            # A sentence's beams ask its source together: (B, h, beams, d_k) against (B, h, S, d).
            q = self.cross_q(y).view(b, n // b, h, self.d_k).transpose(1, 2)
            if source.k is None:
                s = memory.size(1)
                k, v = self.cross_kv(memory)
                source.fill(k.view(b, s, h, self.d_k).transpose(1, 2), v.view(b, s, h, self.d_v).transpose(1, 2))
            y = self.cross_attend(q, source.k, source.v, src_pad, False)  # (B, h, beams, d_v)
            return self.cross_out(y.transpose(1, 2).reshape(n, 1, h * self.d_v))

        x = self._residual(0, x, self_attention)
        x = self._residual(1, x, cross_attention)
        return self._residual(2, x, self.ffn)


class DecoderStep:
    """model.decode at inference for the one position after each hypothesis's prefix, with the cache.
    Built once the backend has transformed the model: it calls the modules the backend made."""

    def __init__(self, model: Transformer) -> None:
        c = model.config
        self.embed_positions = model.embed_positions
        self.layers = [_LayerStep(layer, c.norm == "pre") for layer in model.decoder]
        self.final_norm, self.output = _direct(model.decoder_norm), _direct(model.output)

    def __call__(self, tokens: Tensor, offset: int, memory: Tensor, src_pad: Tensor | None,
                 cache: DecoderCache) -> Tensor:
        """tokens (N, 1), each hypothesis's latest, at position `offset` -> logits (N, vocab)."""
        x = self.embed_positions(tokens, offset)
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, src_pad, cache, i)
        return self.output(self.final_norm(x))[:, 0]
