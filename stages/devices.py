"""Where the work runs: the accelerator when there is one, the precision it trains in, and its peak.

One place for these choices, so training, decoding, the translate command, the served model and the
benches all run on the same device with the same rules.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch


def default_device() -> torch.device:
    """The GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def use_fast_attention() -> None:
    """Leave cuDNN's fused attention out of scaled_dot_product_attention on GPUs: it builds a plan
    (with runtime-generated kernels) for each new (batch, length) shape, about 11 ms of host time a
    call in bench.gpu's profile, and token-bucketed batches bring new shapes at nearly every step.
    The flash and memory-efficient kernels serve every shape without that: base trained 5.9x faster
    on an H100 (`python -m bench.gpu --parts throughput`: 26,623 -> 158,370 target tokens/s)."""
    torch.backends.cuda.enable_cudnn_sdp(False)


HEAP_BLOCK_LIMIT = 32 << 20  # bytes: the largest block glibc can be told to serve from its heap


@functools.cache  # once a process: finding the C library runs ldconfig
def keep_freed_memory() -> None:
    """Make glibc serve blocks up to HEAP_BLOCK_LIMIT (32 MB) from its heap and keep what is freed there, instead of
    mapping fresh pages from the OS and returning them at each free. Beam search on CPUs allocates and
    frees tensors of a few MB every step (the self-attention cache grows), and with glibc's defaults
    many come as new pages, each zeroed by the kernel on first touch (system time). The process keeps
    its peak memory instead. No-op without glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is not None:
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        mallopt(m_mmap_threshold, HEAP_BLOCK_LIMIT)
        mallopt(m_trim_threshold, 1 << 30)


def mixed_precision(choice: str) -> str:
    """train.precision as Accelerate names it: auto is bf16 on GPUs that have it, else fp32 ("no")."""
    if choice == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    return {"fp32": "no"}.get(choice, choice)


# Dense bf16/fp16 tensor-core peaks (vendor datasheets, FLOP/s), for model FLOPs utilisation.
PEAK_FLOPS = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
              "A10G": 125e12, "L4": 121e12, "V100": 125e12}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The accelerator's peak for the precision trained in, or None (CPUs, fp32, unknown GPUs)."""
    if device.type != "cuda" or precision not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)
