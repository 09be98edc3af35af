"""How the model trains eager on a CPU: transforms the train stage applies to it from outside there
(Trainer; the model knows nothing of them). Compiled, inductor writes its own kernels; on GPUs torch's
fused ones serve.

Dropout masks drawn in bulk. torch draws a CPU dropout mask one element at a time from its Mersenne
twister, on one core: its parallel MKL draw is taken on Intel CPUs only. On 2 AMD EPYC cores that is
about 4 ms for one 117 x 16 x 256 activation, where the product that applies the mask takes under
0.1 ms, and 11-13% of a multi30k-amx step (`python -m bench.train --preset multi30k-amx --precision
bf16 --compile loss`, against `--torch-dropout`). Here a mask comes from numpy's PCG64 as raw 64-bit
words, each four 16-bit draws, on every CPU alike. Its seed is drawn from torch's generator, which the
train stage seeds for each micro-batch, so a run resumed, or trained on another split of its steps,
draws the same masks. The drop probability is kept to within 2^-17 (a multiple of 2^-16), and the kept
units are scaled by the inverse of the probability kept, as torch's dropout scales them.

Attention in bf16 as two products. scaled_dot_product_attention's CPU kernels compute bf16 attention
in fp32: the math kernel casts q, k and v up and its output down, and runs fp32 products on matrices
of a sentence's length; the fused kernel's bf16 backward is slower still. Written out
(attention_by_products), the products run in bf16 and only the softmax in fp32, as Hugging Face's
eager attention computes it: the multi30k-amx step at 1.05x on AVX512-BF16 and 1.09x on AMX (`python -m
bench.train --preset multi30k-amx --precision bf16 --compile loss`, against `--sdpa-attention`). In fp32
the fused kernel computes in the inputs' own precision, and stays.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor, nn

from translate.transforms import swap_class
from transformer.attention import MultiHeadAttention, attention_by_products

DRAWS = 1 << 16  # the values a 16-bit draw takes
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}  # a float dtype's bits, as an integer of its size


class BulkDropout(nn.Module):
    """nn.Dropout's function (zero each unit with probability p in training, scale the rest by
    1 / (1 - p), the identity in eval), its mask drawn by numpy in one call."""

    def __init__(self, p: float) -> None:
        super().__init__()
        dropped = round(p * DRAWS)
        self.p = dropped / DRAWS
        self.threshold = dropped - DRAWS // 2  # a signed 16-bit draw at or above it keeps its unit
        self.scale = DRAWS / (DRAWS - dropped)
        # The scale's bits in each float dtype, found once: a mask is built from them as integers
        self.scale_bits = {dtype: torch.tensor(self.scale, dtype=dtype).view(bits).item()
                           for dtype, bits in _BITS.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        n = x.numel()
        words = np.random.PCG64(self.seed()).random_raw(-(-n // 4))
        draws = torch.from_numpy(words.view(np.int16)[:n]).view(x.shape)
        # The mask in x's dtype, built as integers: a kept unit's bits are the scale's, a dropped one's zero
        # (0.0). Converting the comparison's bools to bf16 takes several times as long on CPUs.
        bits = _BITS[x.dtype]
        mask = draws.ge(self.threshold).view(torch.uint8).to(bits).mul_(self.scale_bits[x.dtype]).view(x.dtype)
        return x * mask  # the product torch's dropout applies: its backward keeps the mask alone

    @staticmethod
    def seed() -> int:
        """A mask's seed, the next draw of torch's generator: read from host memory, it waits on nothing."""
        return int(torch.randint(torch.iinfo(torch.int64).max, (), dtype=torch.int64))

    def extra_repr(self) -> str:
        return f"p={self.p}"


def bulk_dropout(model: nn.Module) -> int:
    """Replace every nn.Dropout of `model` that drops anything with a BulkDropout of its probability;
    returns how many were replaced. The weights and their names are untouched."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout and child.p > 0:
                setattr(parent, name, BulkDropout(child.p))
                replaced += 1
    return replaced


class ProductAttention(MultiHeadAttention):
    """MultiHeadAttention, its scaled dot-product attention as two products in the inputs' precision
    (attention_by_products), its weights' dropout drawn in bulk."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool) -> Tensor:
        dropout = _bulk(self.dropout) if self.training and self.dropout > 0 else None
        return attention_by_products(q, k, v, key_padding_mask, causal, dropout)


@functools.cache
def _bulk(p: float) -> BulkDropout:
    return BulkDropout(p)


def runs_eager_on_cpu(device: torch.device, compiled: bool | str) -> bool:
    """Whether a model trained on `device` with train.compile `compiled` (resolved: True, False, "layers" or
    "loss") runs eager on a CPU, where it takes this module's transforms; its layers compiled, inductor
    writes their dropout and attention."""
    return device.type == "cpu" and compiled in (False, "loss")


def for_eager_cpu(model: nn.Module, bf16: bool, dropout: bool = True, attention: bool = True) -> None:
    """This module's transforms, in place: dropout drawn in bulk (unless `dropout` is False) and, in bf16,
    attention as two bf16 products (unless `attention` is False; bench.train times each without it)."""
    if dropout:
        bulk_dropout(model)
    for module in model.modules() if bf16 and attention else ():
        if type(module) is MultiHeadAttention:
            swap_class(module, ProductAttention)
