"""bench.gpu's throughput part: the train stage's own optimizer step (`Trainer.train_step`), as it
runs by default and with the step settings of SYSTEMS, against MarianMT of the same shape and
precision with the same optimizer. MarianMT takes the default's batches (each padded to its longest
pair: its least padding); the bucketed systems take batches of the same budget padded to bucket
shapes, and all count real target tokens, so the rates compare the work done."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.common import model_config, train_params
from bench.gpu import Sizes
from stages.train_inputs import BatchCounts

# The train stage's step settings measured, by name; "marian" is MarianMT's step. Exact shapes: each batch
# padded to its longest pair (on a GPU, to a multiple of 8).
SYSTEMS = {"ours": {},  # as params.yaml has it: on a GPU, compiled whole, on exact shapes
           "eager": {"compile": False, "shapes": "exact"},
           "layers": {"compile": "layers", "shapes": "exact"},  # each layer compiled, a graph a kind, and the loss
           "compiled": {"compile": True, "shapes": "buckets"},
           "captured": {"compile": True, "shapes": "buckets", "cuda_graphs": True}}
# Steps before timing where the step is compiled: a dynamic-shape graph's first calls compile it, and
# each new bucket shape's first calls record its CUDA graph (a 25k-token step has about a dozen).
COMPILED_WARMUP = 30


def throughput(sizes: Sizes, work: Path, model: str, system: str, accum: int) -> dict[str, Any]:
    """Timed optimizer steps of ours (the train stage's step) or of MarianMT on the same batches."""
    import torch

    from stages.devices import attention_kernels, default_device, peak_flops
    from stages.train_compile import compile_seconds

    device = default_device()
    if system == "marian":
        step, parameters, close = _marian(sizes, work, model_config(model), accum)
    else:
        step, parameters, close = _ours(sizes, work, model_config(model), accum, SYSTEMS[system])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens = flops = 0
    seconds = 0.0
    warmup = warmup_steps(sizes, system)
    with attention_kernels(device):  # for MarianMT too, which also calls scaled_dot_product_attention
        for i in range(warmup + sizes.timed_steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            counts = step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                seconds += time.perf_counter() - start
                tokens, flops = tokens + counts.tokens, flops + counts.flops
    close()
    compiling = compile_seconds()  # this part's process has compiled nothing else
    peak = peak_flops(device, "bf16")
    return {"model": model, "system": system, "grad_accum": accum, "parameters": parameters,
            "tgt_tokens_per_sec": tokens / seconds, "compile_seconds": compiling, "tflops": flops / seconds / 1e12,
            "mfu": flops / seconds / peak if peak else None,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}


def warmup_steps(sizes: Sizes, system: str) -> int:
    """Untimed steps before timing `system`: more where its model is compiled (here, as params.yaml and
    the system's settings resolve), whole or layer by layer; a loss compiled alone compiles once, in the first."""
    import torch

    compiled = system in SYSTEMS and train_params(**SYSTEMS[system]).resolved(gpu=torch.cuda.is_available()).compile
    return max(sizes.warmup_steps, COMPILED_WARMUP) if compiled in (True, "layers") else sizes.warmup_steps


def _ours(sizes: Sizes, work: Path, config, accum: int, settings: dict[str, Any]):
    """The train stage's own optimizer step, with the train settings `settings`."""
    import torch
    from accelerate import Accelerator

    from stages import train

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="bf16")
    trainer = train.Trainer(config, train_params(batch_tokens=sizes.batch_tokens, micro_batches=accum, **settings),
                            encoded_dir=work / "encoded", vocab_dir=work / "vocab", accelerator=accelerator)
    train.compile_step(trainer)
    return lambda: trainer.train_step().metrics, trainer.n_parameters, trainer.close


def _marian(sizes: Sizes, work: Path, config, accum: int):
    """MarianMT of our shape through the batches the train stage would take (same sampler, same
    collation), in bf16 autocast, with the same fused Adam and the loss summed over target tokens
    divided by the step's token count."""
    import torch

    from bench.train import marian
    from stages import vocab
    from stages.devices import default_device
    from stages.encode import ParallelIds
    from stages.train_inputs import StepInputs, training_sampler

    device = default_device()
    corpus = ParallelIds(work / "encoded", "train")
    sampler, _, _ = training_sampler(corpus, sizes.batch_tokens, accum, seed=1, world=1, rank=0,
                                     max_positions=config.max_positions)
    vocab_size = vocab.load(work / "vocab").get_piece_size()
    inputs = StepInputs(corpus, config, vocab_size, accum, rank=0, pad_multiple=8 if device.type == "cuda" else 1,
                        pin=device.type == "cuda")
    model, loss_fn = marian(config, vocab_size)
    model.to(device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)

    def step() -> BatchCounts:
        prepared = inputs.prepare(sampler)
        for batch in prepared.micro:
            src, tgt_in, tgt_out = (x.to(device, non_blocking=True) for x in batch)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_fn(src, tgt_in, tgt_out)
            (loss / prepared.global_tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return prepared.counts

    return step, sum(p.numel() for p in model.parameters()), lambda: None
