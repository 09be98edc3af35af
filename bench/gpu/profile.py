"""bench.gpu's profile part: torch.profiler over the train stage's steps."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.common import model_config
from bench.gpu import Sizes
from bench.gpu.throughput import SYSTEMS, _ours, warmup_steps


def profile(sizes: Sizes, work: Path, system: str) -> dict[str, Any]:
    """torch.profiler over a few of the train stage's steps of base (tiny with --smoke), with the step
    settings of `system` (throughput.SYSTEMS): where the GPU's time goes, and whether it waits on the
    host: the kernels' time per step against the time of a step measured without the profiler (whose
    start-up, under it, takes seconds)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    name = sizes.small_model
    step, _, close = _ours(sizes, work, model_config(name), 1, SYSTEMS[system])
    on_gpu = torch.cuda.is_available()
    steps = 3

    def run_steps() -> float:
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(warmup_steps(sizes, system)):
        step()
    wall = run_steps()
    with profiler(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]) as prof:
        run_steps()
    close()
    events = prof.key_averages()
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6 / steps if on_gpu else None  # as the table's total
    return {"model": name, "system": system, "steps": steps, "step_seconds": wall / steps,
            "kernel_seconds_per_step": busy, "table": events.table(sort_by=key, row_limit=20, max_name_column_width=60)}
