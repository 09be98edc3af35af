"""bench.gpu's profile part: torch.profiler over the train stage's steps."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.common import model_config
from bench.gpu import Sizes
from bench.gpu.throughput import SYSTEMS, _ours, warmup_steps

# A GPU kernel's kind: the first whose words its name holds (lowercased). Attention comes before the
# products, as the memory-efficient kernels' names hold CUTLASS's; cuBLAS names its Hopper kernels nvjet.
KINDS = (("attention", ("flash", "fmha", "attention")),
         ("matrix products", ("gemm", "xmma", "cutlass", "cublas", "nvjet", "splitk")),
         ("inductor's generated kernels", ("triton",)),
         ("optimizer and clipping", ("multi_tensor_apply", "adam")),
         ("copies and casts", ("memcpy", "memset", "copy")),
         ("communication", ("nccl",)))
OTHER = "other kernels (elementwise, reductions)"


def kernel_kinds(kernels: list[tuple[str, float]], steps: int) -> list[dict[str, Any]]:
    """`kernels`' time by kind (KINDS), the largest first: milliseconds a step and share of the kernels'
    time. kernels: (name, self device microseconds) over `steps` steps."""
    spent: dict[str, float] = {}
    for name, microseconds in kernels:
        kind = next((kind for kind, words in KINDS if any(w in name.lower() for w in words)), OTHER)
        spent[kind] = spent.get(kind, 0.0) + microseconds
    total = sum(spent.values()) or 1.0
    return [{"kind": kind, "ms a step": round(us / steps / 1e3, 2), "share": f"{us / total:.1%}"}
            for kind, us in sorted(spent.items(), key=lambda item: item[1], reverse=True)]


def profile(sizes: Sizes, work: Path, system: str) -> dict[str, Any]:
    """torch.profiler over a few of the train stage's steps of base (tiny with --smoke), with the step
    settings of `system` (throughput.SYSTEMS): where the GPU's time goes, by kernel and by kind of kernel,
    and whether it waits on the host: the kernels' time per step against the time of a step measured
    without the profiler (whose start-up, under it, takes seconds)."""
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
            "kernel_seconds_per_step": busy, "table": events.table(sort_by=key, row_limit=20, max_name_column_width=60),
            "kinds": kernel_kinds([(e.key, e.self_device_time_total) for e in kernels], steps),
            "kernels": [{"kernel": e.key[:100], "calls a step": round(e.count / steps),
                         "ms a step": round(e.self_device_time_total / steps / 1e3, 2)}
                        for e in sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:15]]}
