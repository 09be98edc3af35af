"""Where the work runs: the accelerator when there is one, the precision it trains in, and its peak.

One place for these choices, so training, decoding, the translate command, the served model and the
benches all run on the same device with the same rules; how decoding runs there is translate/'s.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable, Iterator

import torch

from stages.io import PipelineError


def default_device() -> torch.device:
    """The GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def processes(setting: int | str) -> int:
    """train.processes as a number: auto is every GPU this process sees (CUDA_VISIBLE_DEVICES says
    which), or one without a GPU; more than the GPUs seen is refused, naming them. On CPUs any number
    trains (gloo), each process on its share of the cores."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if setting == "auto":
        return max(gpus, 1)
    assert isinstance(setting, int)
    if gpus and setting > gpus:
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus))
        raise PipelineError(f"train.processes is {setting}, but {gpus} GPU{'s' if gpus > 1 else ''} can be seen "
                            f"({names}): set it to at most {gpus}, or auto")
    return setting


def memory_held(device: torch.device) -> str:
    """The GPU, its memory and the most of it this process held, as a clause of an error."""
    gib = 2**30
    total = torch.cuda.get_device_properties(device).total_memory
    return (f"{torch.cuda.get_device_name(device)}: {total / gib:.1f} GiB, this process held at most "
            f"{torch.cuda.max_memory_reserved(device) / gib:.1f}")


@contextlib.contextmanager
def out_of_memory_stops(device: torch.device, what: Callable[[], str], fix: Callable[[], str]) -> Iterator[None]:
    """Within it, the GPU running out of memory stops the stage with one line: `what()` ran out, the
    device's memory and this process's peak, and `fix()`, the setting that asks for less at a time. torch's
    own error comes from deep in the step and names no setting."""
    try:
        yield
    except torch.OutOfMemoryError:
        held = f" ({memory_held(device)})" if device.type == "cuda" else ""
        raise PipelineError(f"{what()} ran out of GPU memory{held}: {fix()}") from None


def attention_kernels(device: torch.device, precision: str = "no") -> contextlib.AbstractContextManager:
    """Within it, scaled_dot_product_attention runs the kernels measured fastest for training where the
    step runs (`precision` as Accelerate names it). A context, not a process-wide switch: whatever else
    the process runs keeps torch's choice.

    - GPUs: cuDNN's fused attention is left out. It builds a plan (with runtime-generated kernels) for
      each new (batch, length) shape, and token-bucketed batches padded to their longest pair bring new
      shapes at nearly every step; the flash and memory-efficient kernels serve every shape without
      that (`python -m bench.gpu --parts throughput,profile`).
    - CPUs in bf16: the math kernel (two products and a softmax, which torch computes in fp32). The
      fused CPU kernel's bf16 backward runs several times slower than its fp32 one, and slower than
      the math kernel (`python -m bench.train --preset multi30k --precision bf16`, against
      `--torch-attention`). In fp32 torch's choice is the fastest. (The train stage's own model, eager
      on a CPU in bf16, attends by two bf16 products instead and calls neither: stages/train_cpu.py.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type == "cuda":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    if precision == "bf16":
        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


@functools.cache
def keep_freed_host_memory() -> None:
    """Training on CPUs: glibc serves every block from its heap and keeps what is freed there. By
    default a block over 32 MB (a step's logits and their gradient, whatever the model) is fresh pages
    mapped from the OS at every step, each zeroed by the kernel on first touch, and unmapped at its
    free: 29,000 page faults a step of the multi30k preset, none with this (`python -m bench.train
    --preset multi30k --batch-tokens 2000`, with and without --default-malloc), and the preset ran in
    28.0 minutes rather than 30.1 to the same scores (`python -m bench.multi30k`). The process keeps its
    peak memory instead. No-op without glibc."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the process's own symbols: the C library's
    if mallopt is not None:
        m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
        mallopt(m_mmap_max, 0)
        mallopt(m_trim_threshold, 1 << 30)


@functools.cache
def keep_generated_kernels(capacity: int = 16384) -> None:
    """Training on CPUs: oneDNN keeps the kernels it generates for up to `capacity` product shapes, not
    its default 1,024. It generates a bf16 product's kernel for the product's exact shape (about 9 ms
    on AMX, several times the product itself), and exact-shape batches of Multi30k bring about 170
    shapes an epoch, some 30 products each; an epoch's batches are the next epoch's, so from the
    second epoch on every kernel is found again (`python -m bench.train --preset multi30k --precision
    bf16`, whose warm-up meets every timed shape, as training's first epoch does). oneDNN reads the
    setting when it first generates a kernel: set after that, it changes nothing."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))


def fast_bf16_products() -> bool:
    """Whether this CPU multiplies bf16 matrices faster than fp32 ones, so that a bf16 training step runs
    faster than an fp32 one: with tiles of its own (Intel AMX), where the multi30k preset's step runs at
    1.75x fp32's, or with AVX512-BF16's dot products (as AMD EPYC 4th generation has), at 1.87x (`python
    -m bench.train --preset multi30k --precision bf16`, against `fp32`). On AVX-512 or AVX2 cores
    without either, bf16 trained no faster (docs/multi30k.md)."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def mixed_precision(choice: str) -> str:
    """train.precision as Accelerate names it: auto is bf16 on GPUs that have it and on CPUs whose bf16
    products run faster than fp32 ones (fast_bf16_products), else fp32 ("no")."""
    if choice == "auto":
        if torch.cuda.is_available():
            return "bf16" if torch.cuda.is_bf16_supported() else "no"
        return "bf16" if fast_bf16_products() else "no"
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
