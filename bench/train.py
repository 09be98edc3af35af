"""Training throughput: our Transformer against the same architecture built from Hugging Face
transformers' MarianMT, on the same batches, in the same precision, in one run.

    python -m bench.train                      # CPU: base model, 3000-token batches
    python -m bench.train --batch-tokens 25000 --precision bf16   # a GPU: the paper's step

Both sides run one optimizer step exactly as a training loop does: forward, label-smoothed (0.1)
cross-entropy summed over target tokens, backward, Adam. Batch shapes come from the pipeline's own
token batching over the lengths of the shared WMT14 training samples (subword lengths estimated as
1.3 x words) with random token ids, so the padding is what training sees. The two models are timed
in alternation, and the figure is target tokens (padding excluded) per second. The warm-up steps take
the timed batches in turn, so with `--warmup` at least `--steps` every timed shape was met before, as
in training from its second epoch on (an epoch's batches are the next one's). Both run with the train
stage's settings (stages/devices.py): on CPUs glibc's allocator as it sets it (`--default-malloc`
leaves it as it comes) and oneDNN keeping the kernels of every shape, and everywhere its attention
kernels (`--torch-attention` leaves torch's choice), so two runs show what a setting is worth;
`--separate-projections` also times ours with attention's q, k and v as three products (slices of the
same weights), in the same alternation, `--torch-dropout` ours with torch's own dropout masks where
the train stage draws them in bulk (on CPUs, the model eager: stages/train_cpu.py), and `--sdpa-attention`
ours with scaled_dot_product_attention where the train stage writes bf16 attention as two products (the
same place, in bf16). `--compile step`
compiles both models' steps as train.compile true does, `--compile layers` each of their encoder and
decoder layers and their losses as train.compile layers does, `--compile loss` both losses alone as
train.compile loss does (`--compile` alone: step), and `--against-eager` also times ours eager with the
same weights, in the same alternation. `--profile N` then profiles N of ours' steps and records where
their time goes, with the matrix products' share and rate.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import resource
import statistics
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from stages import export
from stages.batching import collate, token_batches
from stages.devices import attention_kernels, default_device, keep_freed_host_memory, keep_generated_kernels
from stages.train import forward_loss
from stages.train_compile import Compiled, compile_seconds
from stages.train_cpu import for_eager_cpu, runs_eager_on_cpu
from stages.vocab import PAD_ID
from bench.common import CORPORA, MODELS, model_settings
from bench.results import record
from transformer.attention import MultiHeadAttention
from transformer.config import TransformerConfig
from transformer.model import Transformer


class RandomCorpus:
    """Pairs of the given lengths with random token ids, stored as the encode stage stores a corpus
    (ids end to end and offsets, per side), which collate reads."""

    def __init__(self, src_lengths: np.ndarray, tgt_lengths: np.ndarray, vocab_size: int) -> None:
        rng = np.random.default_rng(0)
        for side, lengths in (("src", src_lengths), ("tgt", tgt_lengths)):
            setattr(self, f"{side}_ids", rng.integers(4, vocab_size, int(lengths.sum())))
            setattr(self, f"{side}_offsets", np.concatenate([[0], np.cumsum(lengths)]))


def batches(batch_tokens: int, vocab_size: int, count: int,
            text: dict[str, str]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    words = [[len(line.split()) for line in open(text[lang], encoding="utf-8")] for lang in ("en", "de")]
    src_len, tgt_len = (np.maximum(1, np.round(np.array(w) * 1.3)).astype(np.int64) for w in words)
    chosen, _ = token_batches(src_len, tgt_len, batch_tokens, seed=1)
    corpus = RandomCorpus(src_len, tgt_len, vocab_size)
    return [collate(corpus, chosen[i]) for i in np.random.default_rng(0).permutation(len(chosen))[:count]]


def separately(attention: MultiHeadAttention, query: torch.Tensor,
               memory: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MultiHeadAttention.project as three products, one per slice of its stacked weights."""
    stacked = attention.qkv_proj if memory is None else attention.kv_proj
    sizes = attention.sizes if memory is None else attention.sizes[1:]
    parts = [F.linear(query if memory is None else memory, w, b)
             for w, b in zip(stacked.weight.split(sizes), stacked.bias.split(sizes), strict=True)]
    return (*parts,) if memory is None else (attention.q_proj(query), *parts)


SEPARATE, EAGER, TORCH_DROPOUT, SDPA = ("ours, q k v apart", "ours, eager", "ours, torch's dropout",
                                       "ours, scaled_dot_product_attention")
VARIANTS = (SEPARATE, EAGER, TORCH_DROPOUT, SDPA)  # ours, with the same weights, each computed another way
COMPILED = {"none": "", "step": ", compiled", "layers": ", layers compiled",
            "loss": ", loss compiled"}  # as a result's case names it


def ours(config: TransformerConfig, vocab_size: int, separate_projections: bool = False, compiled: str = "none",
         eager_cpu: dict[str, bool] | None = None):
    """The train stage's own micro-batch: its model and loss as one function, `compiled` ("step", "layers",
    "loss" or "none") as train.compile_step compiles it; `eager_cpu`: train_cpu.for_eager_cpu's arguments,
    where the Trainer applies it (on a CPU, the model eager)."""
    model = Transformer(config, vocab_size, PAD_ID)
    if eager_cpu is not None:
        for_eager_cpu(model, **eager_cpu)
    for module in model.modules() if separate_projections else ():
        if isinstance(module, MultiHeadAttention):
            module.project = functools.partial(separately, module)
    step = (forward_loss if compiled == "none"
            else Compiled(forward_loss, part=compiled, model=model if compiled == "layers" else None))

    def loss(src, tgt_in, tgt_out):
        return step(model, src, tgt_in, tgt_out, 0.1)[0]
    return model, loss


def _marian_loss(logits: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), tgt_out.flatten(), ignore_index=PAD_ID,
                           label_smoothing=0.1, reduction="sum")


def marian(config: TransformerConfig, vocab_size: int, compiled: str = "none"):
    """MarianMT's micro-batch, `compiled` as ours: the whole of it, its layers and loss (torch's), its loss
    alone, or none."""
    from transformers import MarianMTModel

    model = MarianMTModel(export.marian_config(config, vocab_size))
    cross_entropy = torch.compile(_marian_loss, dynamic=True) if compiled in ("layers", "loss") else _marian_loss
    if compiled == "layers":
        for layer in (*model.model.encoder.layers, *model.model.decoder.layers):
            layer.compile(dynamic=True)

    def loss(src, tgt_in, tgt_out):
        logits = model(input_ids=src, attention_mask=src.ne(PAD_ID), decoder_input_ids=tgt_in,
                       decoder_attention_mask=tgt_in.ne(PAD_ID)).logits
        return cross_entropy(logits, tgt_out)
    return (model, torch.compile(loss, dynamic=True)) if compiled == "step" else (model, loss)


PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")  # matrix products, by the profiler's names


def where_time_goes(events: list, steps: int, top: int = 12) -> tuple[list[dict], str]:
    """A profile's operations by self CPU time (a step's milliseconds, their share), the largest `top`,
    and one line of the matrix products' share and rate (the profiler's count of their FLOPs)."""
    def gflops(flops: float, microseconds: float) -> float:
        return flops / microseconds / 1e3 if microseconds else 0.0

    by_name: dict[str, list[float]] = {}  # calls, self microseconds, FLOPs
    for e in events:  # inductor's graphs named as one, not by their hashes
        name = "inductor's compiled graphs" if e.key.startswith("## Call CompiledFxGraph") else e.key
        calls, spent, flops = by_name.setdefault(name, [0, 0.0, 0.0])
        by_name[name] = [calls + e.count, spent + e.self_cpu_time_total, flops + e.flops]
    total = sum(spent for _, spent, _ in by_name.values()) or 1
    rows = [{"operation": name, "calls a step": round(calls / steps), "self ms a step": round(spent / steps / 1e3, 2),
             "share": f"{spent / total:.1%}", "GFLOP/s": round(gflops(flops, spent)) if name in PRODUCTS else ""}
            for name, (calls, spent, flops) in sorted(by_name.items(), key=lambda kv: kv[1][1], reverse=True)[:top]]
    products = [e for e in events if e.key in PRODUCTS]
    spent = sum(e.self_cpu_time_total for e in products)
    rate = gflops(sum(e.flops for e in products), spent)
    return rows, f"matrix products {spent / total:.0%} of ours' profiled step time, at {rate:,.0f} GFLOP/s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=MODELS, default="base",
                    help="the model (multi30k, multi30k-amx: the preset's, on Multi30k's lengths; the others on "
                         "WMT14's)")
    ap.add_argument("--vocab-size", type=int, help="default: the preset's")
    ap.add_argument("--batch-tokens", type=int, default=3000, help="per side per step")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per model")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--compile", nargs="?", const="step", default="none", choices=list(COMPILED),
                    help="torch.compile both models' steps (step, the default of the bare flag), their layers and "
                         "losses, or their losses alone")
    ap.add_argument("--against-eager", action="store_true",
                    help="also time ours eager, with the same weights (with --compile)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="then profile this many of ours' steps and print where their time goes")
    ap.add_argument("--default-malloc", action="store_true",
                    help="CPUs: leave glibc's allocator as it comes, not as the train stage sets it")
    ap.add_argument("--torch-attention", action="store_true",
                    help="leave scaled_dot_product_attention's kernel to torch, not as the train stage picks it")
    ap.add_argument("--separate-projections", action="store_true",
                    help="also time ours with attention's q, k and v as three products, not one of the stacked weights")
    ap.add_argument("--torch-dropout", action="store_true",
                    help="also time ours with torch's dropout, where the train stage draws its masks in bulk")
    ap.add_argument("--sdpa-attention", action="store_true",
                    help="also time ours with scaled_dot_product_attention, where the train stage writes bf16 "
                         "attention as two products")
    args = ap.parse_args()

    device = default_device()
    if device.type == "cpu":
        keep_generated_kernels()  # as the train stage does, before any product
        if not args.default_malloc:
            keep_freed_host_memory()  # as the train stage does: both models' steps run under it
    torch.manual_seed(0)
    chosen = model_settings(args.preset)
    config, args.vocab_size = chosen.model, args.vocab_size or chosen.vocab.vocab_size
    text = CORPORA["multi30k" if args.preset.startswith("multi30k") else "europarl"]["train"]
    data = batches(args.batch_tokens, args.vocab_size, args.steps, text)
    runs = {}
    if args.against_eager and args.compile == "none":
        ap.error("--against-eager times ours eager beside ours compiled: give --compile step, layers or loss")
    as_train_compile = {"none": False, "step": True}.get(args.compile, args.compile)
    eager_cpu = runs_eager_on_cpu(device, as_train_compile)  # as the Trainer decides
    cpu = {"bf16": args.precision == "bf16"} if eager_cpu else None  # for_eager_cpu's arguments there
    if args.torch_dropout and not (eager_cpu and config.dropout > 0):
        ap.error("--torch-dropout: the train stage draws dropout in bulk only on CPUs with the model eager "
                 "(--compile none or loss), and this model's dropout is 0 (--preset multi30k-amx has 0.1)"
                 if eager_cpu else
                 "--torch-dropout: the train stage keeps torch's dropout here (a GPU, or --compile step or layers)")
    if args.sdpa_attention and not (eager_cpu and args.precision == "bf16"):
        ap.error("--sdpa-attention: the train stage writes attention as two products only on CPUs in bf16 with the "
                 "model eager (--precision bf16, --compile none or loss)")
    builds = [("ours", functools.partial(ours, compiled=args.compile, eager_cpu=cpu)),
              ("MarianMT (transformers)", functools.partial(marian, compiled=args.compile))]
    if args.separate_projections:
        builds.append((SEPARATE, functools.partial(ours, separate_projections=True, compiled=args.compile,
                                                   eager_cpu=cpu)))
    if args.against_eager:
        builds.append((EAGER, functools.partial(ours, eager_cpu=cpu)))
    left_out = ((args.torch_dropout, TORCH_DROPOUT, "dropout"), (args.sdpa_attention, SDPA, "attention"))
    for flag, variant, without in left_out:
        if flag:  # ours with one of the train stage's CPU transforms left out
            builds.append((variant, functools.partial(ours, compiled=args.compile, eager_cpu={**cpu, without: False})))
    for name, build in builds:
        model, step_fn = build(config, args.vocab_size)
        if name in VARIANTS:
            model.load_state_dict(runs["ours"][0].state_dict())  # the same weights, computed apart or eager
        model.to(device).train()
        runs[name] = (model, step_fn, torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9,
                                                        fused=True))
    times: dict[str, list[float]] = {name: [] for name in runs}
    faults: dict[str, list[int]] = {name: [] for name in runs}  # pages the OS mapped in, zeroed, for the step
    compiling = dict.fromkeys(runs, 0.0)  # seconds each spent compiling, by torch's accounting

    @contextlib.contextmanager
    def counted(name: str) -> Iterator[None]:
        before = compile_seconds()
        yield
        compiling[name] += compile_seconds() - before
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    precision = {"fp32": "no"}.get(args.precision, args.precision)  # as Accelerate names it

    def step(name: str, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> tuple[float, int]:
        model, step_fn, optimizer = runs[name]
        if device.type == "cuda":
            torch.cuda.synchronize()
        mapped = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=args.precision != "fp32"), counted(name):
            loss = step_fn(src, tgt_in, tgt_out)
        (loss / tgt_out.ne(PAD_ID).sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - mapped

    data = [tuple(x.to(device) for x in batch) for batch in data]
    def kernels() -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if args.torch_attention else attention_kernels(device, precision)

    for variant in VARIANTS:  # the same weights compute ours' function, before either trains
        if variant not in runs:
            continue
        losses = []
        for name in ("ours", variant):
            model, step_fn, _ = runs[name]
            model.eval()  # no dropout: the same function of the same weights
            with torch.no_grad(), kernels(), counted(name):
                losses.append(step_fn(*data[0]))
            model.train()
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=0)
    with kernels():
        for i in range(args.warmup):
            for name in runs:
                step(name, *data[i % len(data)])
        for batch in data:
            for name in runs:  # alternate, so drift hits both alike
                seconds, pages = step(name, *batch)
                times[name].append(seconds)
                faults[name].append(pages)
    tokens = sum(int(t.ne(PAD_ID).sum()) for _, _, t in data)
    params = {name: sum(p.numel() for p in m.parameters()) for name, (m, _, _) in runs.items()}
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"{args.preset} model, {device.type} ({where}), "
          f"{args.precision}{COMPILED[args.compile]}, batches of {args.batch_tokens} tokens per side, "
          f"{args.steps} timed steps ({tokens} target tokens) after {args.warmup} warm-up")
    rate = {name: tokens / sum(t) for name, t in times.items()}
    rows = []
    for name in runs:
        spread = statistics.pstdev(times[name]) / statistics.mean(times[name])
        pages = round(statistics.mean(faults[name]))
        compiled = f", compiled in {compiling[name]:.1f} s" if compiling[name] else ""
        print(f"{name:26}{rate[name]:>12,.0f} target tokens/s  ({params[name] / 1e6:.1f}M parameters, "
              f"step time varies {spread:.0%}, {pages:,} page faults a step{compiled})")
        rows.append({"system": name, "target tokens/s": round(rate[name]), "parameters": params[name],
                     "step time varies": f"{spread:.0%}", "page faults a step": pages,
                     **({"compile s": round(compiling[name], 1)} if args.compile != "none" else {})})
    summary = f"ours / MarianMT: {rate['ours'] / rate['MarianMT (transformers)']:.2f}x"
    for variant in VARIANTS:
        if variant in rate:
            summary += f"; ours / {variant}: {rate['ours'] / rate[variant]:.2f}x"
    print(summary)
    tables = {}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof, kernels():
            for batch in data[: args.profile]:
                step("ours", *batch)
        print(f"Where {args.profile} of ours' steps spend their time (self CPU time, the largest first):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        profiled, products = where_time_goes(list(prof.key_averages()), min(args.profile, len(data)))
        print(products)
        summary += f"; {products}"
        tables[f"Where {args.profile} of ours' steps spend their time (self CPU time, the largest first)"] = profiled
    how = (COMPILED[args.compile] + (", default malloc" if args.default_malloc else "")
           + (", torch's attention" if args.torch_attention else "")
           + (", with q k v apart" if args.separate_projections else "")
           + (", against torch's dropout" if args.torch_dropout else "")
           + (", against scaled_dot_product_attention" if args.sdpa_attention else "")
           + (", against eager" if args.against_eager else ""))
    record("train", f"{args.preset} {args.precision} {args.batch_tokens}{how}",
           f"Training steps, {args.preset} model, {args.precision}{how}, {args.batch_tokens} tokens a side",
           rows, summary, tables=tables)


if __name__ == "__main__":
    main()
