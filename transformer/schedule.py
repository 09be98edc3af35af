"""The learning rate of paper section 5.3, and its linear-decay variant for a run of a fixed, short budget."""
from __future__ import annotations


def inverse_sqrt_rate(step: int, d_model: int, warmup_steps: int) -> float:
    """lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), for steps counted from 1:
    linear warm-up for `warmup_steps`, then decay with the inverse square root of the step."""
    step = max(step, 1)
    return d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def linear_decay_rate(step: int, d_model: int, warmup_steps: int, total_steps: int) -> float:
    """The same warm-up to the same peak, then a straight line down to zero after step `total_steps`:
    a run whose length is fixed ends annealed, which within a short budget trains further than the
    inverse square root's long tail (Li et al. 2020, "Budgeted training")."""
    step = max(step, 1)
    peak = d_model**-0.5 * warmup_steps**-0.5
    if step <= warmup_steps:
        return peak * step / warmup_steps
    return peak * max(0.0, (total_steps + 1 - step) / (total_steps + 1 - warmup_steps))
