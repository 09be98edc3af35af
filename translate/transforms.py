"""Transforms every decoding backend may apply to a trained model from outside, as torchtitan applies
parallelism: modules replaced in place, the model's own code untouched."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from transformer.attention import MultiHeadAttention
from transformer.model import Transformer


def replace_modules(root: nn.Module, kind: type[nn.Module], make: Callable[[Any], nn.Module]) -> None:
    """Every module of type `kind` under `root` becomes make(it), in place."""
    for module in list(root.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, kind):
                setattr(module, name, make(child))


def swap_class(module: nn.Module, cls: type[nn.Module]) -> None:
    """Give `module` the behaviour of `cls`, a subclass of its class that adds no state (as PyTorch's
    fully_shard does), so its weights and place in the model stay as they are."""
    assert issubclass(cls, type(module)), f"{cls.__name__} is not a {type(module).__name__}"
    module.__class__ = cls


class FusedProjections(nn.Module):
    """The query, key and value projections of one input (self-attention) as one product of 3x the
    width: the first of the three calls on a new input computes all three, the other two take their
    part. Decoding a few sentences, each product's fixed cost outweighs its work."""

    def __init__(self, attention: MultiHeadAttention) -> None:
        super().__init__()
        parts = (attention.q_proj, attention.k_proj, attention.v_proj)
        self.sizes = [p.out_features for p in parts]
        self.linear = nn.Linear(parts[0].in_features, sum(self.sizes),
                                device=parts[0].weight.device, dtype=parts[0].weight.dtype)
        with torch.no_grad():
            self.linear.weight.copy_(torch.cat([p.weight for p in parts]))
            self.linear.bias.copy_(torch.cat([p.bias for p in parts]))
        self._input: Tensor | None = None
        self._parts: list[Tensor | None] = [None, None, None]

    def part(self, i: int, x: Tensor) -> Tensor:
        if x is not self._input or self._parts[i] is None:
            self._input, self._parts = x, list(self.linear(x).split(self.sizes, -1))
        out, self._parts[i] = self._parts[i], None
        if all(p is None for p in self._parts):
            self._input = None  # all three taken: hold nothing between calls
        return out


class _Part(nn.Module):
    """One of the three projections, read from the attention module's FusedProjections."""

    def __init__(self, fused: FusedProjections, i: int) -> None:
        super().__init__()
        self.fused, self.i = [fused], i  # in a list: the fused module is its attention module's child, once

    def forward(self, x: Tensor) -> Tensor:
        return self.fused[0].part(self.i, x)


def fuse_self_attention(model: Transformer) -> None:
    """Every self-attention's q, k and v projections in one product (FusedProjections), in place; the
    fused weights replace the three. A second call changes nothing."""
    for layer in (*model.encoder, *model.decoder):
        attention = layer.self_attn
        if isinstance(attention.q_proj, _Part):
            continue
        attention.qkv_proj = FusedProjections(attention)
        attention.q_proj, attention.k_proj, attention.v_proj = (_Part(attention.qkv_proj, i) for i in range(3))
