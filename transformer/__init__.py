"""The Transformer of "Attention Is All You Need" in plain PyTorch.

Nothing here knows about files, tracking or distributed training: those belong to the stages.
"""
from transformer.beam_search import Hypothesis, beam_search
from transformer.loss import label_smoothed_nll_loss
from transformer.config import TransformerConfig
from transformer.model import IncrementalDecoder, Transformer
from transformer.schedule import inverse_sqrt_rate

__all__ = [
    "Hypothesis",
    "IncrementalDecoder",
    "Transformer",
    "TransformerConfig",
    "beam_search",
    "inverse_sqrt_rate",
    "label_smoothed_nll_loss",
]
