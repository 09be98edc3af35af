"""The learning rate of paper section 5.3."""
from __future__ import annotations


def inverse_sqrt_rate(step: int, d_model: int, warmup_steps: int) -> float:
    """lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), for steps counted from 1:
    linear warm-up for `warmup_steps`, then decay with the inverse square root of the step."""
    step = max(step, 1)
    return d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)
