"""Dropout masks drawn in bulk on CPUs: a transform the train stage applies to the model's nn.Dropout
modules from outside where the model runs eager on a CPU (Trainer; the model knows nothing of it).

torch draws a CPU dropout mask one element at a time from its Mersenne twister, on one core: its
parallel MKL draw is taken on Intel CPUs only. On 2 AMD EPYC cores that is about 4 ms for one
117 x 16 x 256 activation, where the product that applies the mask takes under 0.1 ms, and 11-13% of
a multi30k-amx step (`python -m bench.train --preset multi30k-amx --precision bf16 --compile loss`,
against `--torch-dropout`). Here a mask comes from numpy's PCG64 as raw 64-bit words, each four 16-bit
draws, on every CPU alike. Its seed is drawn from torch's generator, which the train stage seeds for
each micro-batch, so a run resumed, or trained on another split of its steps, draws the same masks.
The drop probability is kept to within 2^-17 (a multiple of 2^-16), and the kept units are scaled by
the inverse of the probability kept, as torch's dropout scales them.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

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


def draws_in_bulk(device: torch.device, compiled: bool | str) -> bool:
    """Whether a model trained on `device` with train.compile `compiled` (resolved: True, False or "loss")
    runs eager on a CPU, where its dropout is drawn in bulk; compiled, inductor draws its own masks."""
    return device.type == "cpu" and compiled is not True


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
