"""Decoding on GPUs: the model in the precision asked for, attention on the flash and memory-efficient
kernels, candidates by a plain top-k."""
from __future__ import annotations

import torch

from translate.beam_search import Select, top_k
from transformer.model import Transformer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def prepare(model: Transformer, device: torch.device, precision: str) -> Select:
    """Move `model` to `device` in `precision`; return the beam's candidate selection to use with it.

    cuDNN's fused attention is left out of scaled_dot_product_attention: it builds a plan for each new
    (batch, length) shape, and every decoding step brings a new key length (`python -m bench.gpu`'s
    profile measures the same cost in training)."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    model.to(device=device, dtype=DTYPES[precision])
    return top_k
