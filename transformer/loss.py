"""Label-smoothed cross-entropy (paper section 5.4, epsilon 0.1)."""
from __future__ import annotations

import torch
from torch import Tensor


def label_smoothed_nll_loss(logits: Tensor, target: Tensor, epsilon: float, pad_id: int) -> tuple[Tensor, Tensor]:
    """Summed over the non-padding target tokens: (smoothed loss, plain negative log-likelihood).

    Sums, not means, so the caller divides by the token count of the whole optimizer step and the
    result does not depend on how the step is split into micro-batches or processes.
    The smoothed target puts 1 - epsilon on the reference and epsilon spread uniformly over the vocabulary.
    """
    lprobs = torch.log_softmax(logits.float(), dim=-1)  # (..., V), in fp32 whatever the compute type
    keep = target.ne(pad_id)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    smooth = -lprobs.mean(dim=-1)
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    return loss[keep].sum(), nll[keep].sum()
