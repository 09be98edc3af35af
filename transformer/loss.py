"""Label-smoothed cross-entropy (paper section 5.4, epsilon 0.1), fused over the vocabulary.

With a 37k vocabulary the logits are the largest tensor of a training step, and the textbook loss
(log_softmax, gather, mean, and their backward passes) reads and writes it about eight times. Here
the forward pass reads it once for its log-sum-exp and once for its mean, and the backward pass
writes the gradient once: softmax minus the smoothed target. Rows are processed in chunks, so fp32
temporaries stay small whatever the batch and the logits' precision. Compiled (torch.compile), it
is one chunk of elementwise work and reductions, which the compiler fuses into kernels that read the
logits in their own precision and write their gradient once, with no fp32 copy in between.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _chunk_rows(logits: Tensor) -> int:
    """Rows per chunk: a few MB on CPUs, so a chunk's passes hit the cache; far larger on GPUs, where
    each chunk costs kernel launches."""
    elements = 2**27 if logits.is_cuda else 2**20
    return max(1, elements // logits.size(-1))


def _chunks(logits: Tensor) -> list[slice]:
    """The rows of each chunk; all rows at once when compiled, where nothing between fused kernels is
    materialised (and a loop over a dynamic row count would fix that count)."""
    if torch.compiler.is_compiling():
        return [slice(None)]
    step = _chunk_rows(logits)
    return [slice(start, start + step) for start in range(0, logits.size(0), step)]


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Everything stays on the device: no value is read back to the host (no `.item()`, no boolean
    indexing), so a training step never waits on the accelerator here."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, epsilon: float, pad_id: int) -> tuple[Tensor, Tensor]:
        # logits (N, V) in any float precision, target (N,)
        lse = torch.empty(logits.size(0), dtype=torch.float32, device=logits.device)
        mean = torch.empty_like(lse)
        for rows in _chunks(logits):
            chunk = logits[rows].float()
            lse[rows] = torch.logsumexp(chunk, dim=-1)
            mean[rows] = chunk.mean(dim=-1)
        keep = target.ne(pad_id).float()
        nll = lse - logits.gather(-1, target[:, None]).squeeze(-1).float()  # -log p(reference)
        smooth = lse - mean  # -mean over the vocabulary of log p
        loss = (1.0 - epsilon) * nll + epsilon * smooth
        ctx.save_for_backward(logits, target, lse, keep)
        ctx.epsilon = epsilon
        ctx.set_materialize_grads(False)
        return (loss * keep).sum(), (nll * keep).sum()

    @staticmethod
    def backward(ctx, grad_loss: Tensor | None, grad_nll: Tensor | None) -> tuple[Tensor | None, ...]:
        logits, target, lse, keep = ctx.saved_tensors
        eps, vocab = ctx.epsilon, logits.size(-1)
        zero = torch.zeros((), device=logits.device)
        grad_loss = zero if grad_loss is None else grad_loss.float()
        grad_nll = zero if grad_nll is None else grad_nll.float()
        # d loss / d logits = softmax - (1 - eps) * onehot(target) - eps / V; d nll = softmax - onehot;
        # per row, scaled by keep (0 on padding rows, which get no gradient).
        on_softmax = (grad_loss + grad_nll) * keep  # (N,)
        on_target = ((1.0 - eps) * grad_loss + grad_nll) * keep
        uniform = (eps / vocab) * grad_loss * keep
        # a * exp(x - lse) = sign(a) * exp(x - lse + log|a|): the scale folds into the exponent (0 on padding)
        shift, sign = lse - on_softmax.abs().log(), on_softmax.sign()
        grad = torch.empty_like(logits)
        work = grad if grad.dtype == torch.float32 else None
        for rows in _chunks(logits):
            p = torch.sub(logits[rows].float(), shift[rows, None], out=work[rows] if work is not None else None).exp_()
            p = torch.addcmul(-uniform[rows, None], p, sign[rows, None], out=p)  # sign * p - uniform
            if torch.compiler.is_compiling():  # a comparison fuses into the kernel above; a scatter would not
                p.sub_((torch.arange(vocab, device=p.device) == target[rows, None]) * on_target[rows, None])
            else:
                p.scatter_add_(-1, target[rows, None], -on_target[rows, None])
            if work is None:
                grad[rows] = p
        return grad, None, None, None


def label_smoothed_nll_loss(logits: Tensor, target: Tensor, epsilon: float, pad_id: int) -> tuple[Tensor, Tensor]:
    """Summed over the non-padding target tokens: (smoothed loss, plain negative log-likelihood).

    Sums, not means, so the caller divides by the token count of the whole optimizer step and the
    result does not depend on how the step is split into micro-batches or processes.
    The smoothed target puts 1 - epsilon on the reference and epsilon spread uniformly over the vocabulary.
    logits (..., V), target (...).
    """
    return _SmoothedCrossEntropy.apply(logits.reshape(-1, logits.size(-1)), target.reshape(-1), epsilon, pad_id)
