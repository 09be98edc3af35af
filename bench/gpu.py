"""Everything measured on a GPU, by one command: training throughput against MarianMT, bf16 against
fp32, and beam-search decoding against transformers and CTranslate2. It writes one JSON and prints
(and writes beside it, as markdown) a readable table.

    python -m bench.gpu --out gpu.json     # on a GPU machine: under 9 minutes on an H100
    python -m bench.gpu --smoke            # tiny sizes, on a CPU too, end to end (CI runs it)

1. Data: the shared WMT14 Europarl sample (20k pairs) with a BPE vocabulary learned on it by the vocab
   stage (37k pieces, the paper's size; 800 with --smoke) and encoded by the encode stage.
2. Training throughput, Transformer base and big, bf16, the paper's 25k-token step (with gradient
   accumulation only when a step does not fit): the train stage's own step (`Trainer.train_step`:
   prefetched batches, fused loss, no host syncs) against MarianMT of the same shape and precision on
   the same batches with the same optimizer. Target tokens/s, model TFLOP/s, MFU, peak memory.
3. bf16 against fp32: 200 steps of base through the train stage on the same batches; the two loss
   curves must agree (the largest relative difference is reported).
4. Decoding: newstest2014 (3003 sentences), beam 4, with the base weights trained in 3: ours,
   transformers `generate` and CTranslate2, in fp32 and bf16, with the share of identical outputs and
   our BLEU.

Each measurement runs in a process of its own (a fresh Accelerate state and a clean peak-memory
count); one that runs out of memory is retried with twice the accumulation. It needs torch,
accelerate, transformers, sentencepiece, sacrebleu, safetensors and ctranslate2, and never imports
MLflow, Prefect or DVC (each part checks).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import SHARED

SAMPLE = SHARED / "wmt14/train-sample/hf-europarl-20k/train"
NEWSTEST2013 = SHARED / "wmt14/newstest2013/newstest2013"
NEWSTEST = SHARED / "wmt14/newstest2014-full/newstest2014-deen"
MULTI30K = SHARED / "multi30k"
# corpus -> split -> language -> file: what `prepare` reads (the first lines of each, as Sizes says)
CORPORA = {"europarl": {"train": {"en": f"{SAMPLE}.en", "de": f"{SAMPLE}.de"},
                        "dev": {"en": f"{NEWSTEST2013}.en", "de": f"{NEWSTEST2013}.de"},
                        "test": {"en": f"{NEWSTEST}-src.en.txt", "de": f"{NEWSTEST}-ref.de.txt"}},
           "multi30k": {"train": {"en": f"{MULTI30K}/train.en", "de": f"{MULTI30K}/train.de"},
                        "dev": {"en": f"{MULTI30K}/val.en", "de": f"{MULTI30K}/val.de"},
                        "test": {"en": f"{MULTI30K}/test_2016_flickr.en", "de": f"{MULTI30K}/test_2016_flickr.de"}}}
OUT_OF_MEMORY = 3  # a part's exit status when the GPU ran out of memory
ORCHESTRATION = ("mlflow", "prefect", "dvc")


@dataclasses.dataclass(frozen=True)
class Sizes:
    train_lines: int
    vocab_size: int
    batch_tokens: int
    models: tuple[str, ...]
    warmup_steps: int  # untimed steps before the timed ones
    timed_steps: int
    curve_steps: int
    curve_log_every: int
    decode_lines: int
    decode_precisions: tuple[str, ...]


FULL = Sizes(20000, 37000, 25000, ("base", "big"), 3, 10, 200, 10, 3003, ("fp32", "bf16"))
SMOKE = Sizes(2000, 800, 1200, ("tiny",), 1, 2, 12, 3, 16, ("fp32",))
MODELS = {"base": dict(d_model=512, n_heads=8, d_ff=2048, encoder_layers=6, decoder_layers=6, dropout=0.1),
          "big": dict(d_model=1024, n_heads=16, d_ff=4096, encoder_layers=6, decoder_layers=6, dropout=0.3),
          "tiny": dict(d_model=64, n_heads=4, d_ff=128, encoder_layers=2, decoder_layers=2, dropout=0.1)}


def model_config(name: str):
    from transformer import TransformerConfig

    return TransformerConfig(**MODELS[name], attention_dropout=0.0, norm="post", positions="sinusoidal",
                             max_positions=1024)


def train_params(sizes: Sizes, **changes):
    from stages.train import TrainParams

    values = dict(max_steps=10**9, batch_tokens=sizes.batch_tokens, grad_accum=1, warmup_steps=4000, lr_scale=1.0,
                  adam_betas=(0.9, 0.98), adam_eps=1e-9, label_smoothing=0.1, clip_norm=0.0, precision="bf16",
                  compile=False, seed=1, log_every=10**9, validate_every=10**9, checkpoint_every_steps=0,
                  checkpoint_every_minutes=0.0, keep_checkpoints=1)
    return TrainParams(**{**values, **changes})


# -- the parts, each in its own process ---------------------------------------------------------------

def prepare(sizes: Sizes, work: Path, corpus: str = "europarl") -> dict[str, Any]:
    """Text, vocabulary and encoded corpus, by the pipeline's own vocab and encode stages."""
    from stages import encode, vocab
    from stages.io import write_manifest

    text = work / "text"
    text.mkdir(parents=True, exist_ok=True)  # a preparation cut short is done again
    limits = {"train": sizes.train_lines, "dev": 500, "test": sizes.decode_lines}
    counts = {}
    for split, paths in CORPORA[corpus].items():
        for lang, path in paths.items():
            lines = Path(path).read_text(encoding="utf-8").splitlines()[: limits[split]]
            (text / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
            counts[split] = len(lines)
    write_manifest(text, "en", "de", counts)
    start = time.perf_counter()
    vocab.run(vocab.VocabParams(model_type="bpe", vocab_size=sizes.vocab_size, character_coverage=1.0,
                                input_sentence_size=0, seed=1), clean_dir=text, out_dir=work / "vocab")
    encode.run(clean_dir=text, vocab_dir=work / "vocab", out_dir=work / "encoded")
    return {"pairs": counts, "vocab_size": sizes.vocab_size, "seconds": time.perf_counter() - start}


def throughput(sizes: Sizes, work: Path, model: str, system: str, accum: int) -> dict[str, Any]:
    """Timed optimizer steps of ours (the train stage's step) or of MarianMT on the same batches."""
    import torch

    from stages.devices import default_device, peak_flops

    device = default_device()
    step, parameters, close = (_ours if system == "ours" else _marian)(sizes, work, model_config(model), accum)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens = flops = 0
    seconds = 0.0
    for i in range(sizes.warmup_steps + sizes.timed_steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        report = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= sizes.warmup_steps:
            seconds += time.perf_counter() - start
            tokens, flops = tokens + report["tokens"], flops + report["flops"]
    close()
    peak = peak_flops(device, "bf16")
    return {"model": model, "system": system, "grad_accum": accum, "parameters": parameters,
            "tgt_tokens_per_sec": tokens / seconds, "tflops": flops / seconds / 1e12,
            "mfu": flops / seconds / peak if peak else None,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}


def _ours(sizes: Sizes, work: Path, config, accum: int):
    """The train stage's own optimizer step."""
    import torch
    from accelerate import Accelerator

    from stages import train

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="bf16")
    trainer = train.Trainer(config, train_params(sizes, grad_accum=accum), encoded_dir=work / "encoded",
                            vocab_dir=work / "vocab", accelerator=accelerator)
    return trainer.train_step, trainer.n_parameters, trainer.close


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

    def step() -> dict[str, float]:
        prepared = inputs.prepare(sampler)
        for batch in prepared.micro:
            src, tgt_in, tgt_out = (x.to(device, non_blocking=True) for x in batch)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_fn(src, tgt_in, tgt_out)
            (loss / prepared.global_tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return prepared.report

    return step, sum(p.numel() for p in model.parameters()), lambda: None


def curve(sizes: Sizes, work: Path, precision: str) -> dict[str, Any]:
    """The train stage itself, base (tiny with --smoke) for the curve's steps in one precision."""
    from stages import train
    from stages.model_files import current_dir, list_checkpoints, read_checkpoint

    name = "tiny" if "tiny" in sizes.models else "base"
    params = train_params(sizes, max_steps=sizes.curve_steps, precision=precision, log_every=sizes.curve_log_every)
    out = train.run(model_config(name), params, encoded_dir=work / "encoded", vocab_dir=work / "vocab",
                    checkpoint_dir=work / f"checkpoints-{precision}", plots_dir=work / f"plots-{precision}")
    newest = list_checkpoints(current_dir(work / f"checkpoints-{precision}"))[-1][1]
    history = read_checkpoint(newest).parts["progress"]["history"]
    return {"precision": precision, "model": name, "tgt_tokens_per_sec": out["mean_tgt_tokens_per_sec"],
            "steps": [r["step"] for r in history], "loss": [r["loss"] for r in history]}


def decode(sizes: Sizes, work: Path) -> dict[str, Any]:
    """The bf16-trained weights (fp32 with --smoke) decoded by every system at every precision."""
    import sacrebleu

    from bench.decode import decode_all, report
    from stages.model_files import current_dir, list_checkpoints

    trained = "fp32" if sizes.decode_precisions == ("fp32",) else "bf16"
    model_path = list_checkpoints(current_dir(work / f"checkpoints-{trained}"))[-1][1]
    lines = (work / "text/test.en").read_text(encoding="utf-8").splitlines()
    refs = (work / "text/test.de").read_text(encoding="utf-8").splitlines()
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        results = decode_all(model_path, work / "vocab", lines, 4, 8000, sizes.decode_precisions, Path(tmp))
    ours = {r.precision: r for r in results if r.system.startswith("ours")}
    return {"sentences": len(lines), "weights": f"{trained}-trained, {model_path.name}", "table": report(results),
            "systems": [{"system": r.system, "precision": r.precision, "tgt_tokens_per_sec": r.rate,
                         "seconds": r.seconds, "tokens": r.tokens,
                         "same_as_ours": sum(a == b for a, b in zip(ours[r.precision].lines, r.lines, strict=True))
                         / len(lines), "bleu": sacrebleu.corpus_bleu(r.lines, [refs]).score} for r in results]}


def run_part(sizes: Sizes, work: Path, part: str, accum: int) -> dict[str, Any]:
    import torch

    kind, *args = part.split(":")
    try:
        if kind == "prepare":
            result = prepare(sizes, work)
        elif kind == "throughput":
            result = throughput(sizes, work, args[0], args[1], accum)
        elif kind == "curve":
            result = curve(sizes, work, args[0])
        else:
            result = decode(sizes, work)
    except torch.cuda.OutOfMemoryError:
        sys.exit(OUT_OF_MEMORY)
    loaded = [m for m in ORCHESTRATION if m in sys.modules]
    assert not loaded, f"bench.gpu must run without the orchestration layer, but imported {loaded}"
    return result


# -- the whole run ------------------------------------------------------------------------------------

def spawn(part: str, args: argparse.Namespace, work: Path, accum: int = 1) -> dict[str, Any]:
    """Run one part in a fresh process; on running out of memory, again with twice the accumulation."""
    out = work / f"{part.replace(':', '-')}.json"
    command = [sys.executable, "-m", "bench.gpu", "--part", part, "--work", str(work), "--accum", str(accum),
               "--part-out", str(out), *(["--smoke"] if args.smoke else [])]
    start = time.perf_counter()
    proc = subprocess.run(command)
    if proc.returncode == OUT_OF_MEMORY and accum < 16:
        print(f"{part}: out of memory with accumulation {accum}; again with {accum * 2}", flush=True)
        return spawn(part, args, work, accum * 2)
    if proc.returncode != 0:
        raise SystemExit(f"bench.gpu: part {part} failed (exit status {proc.returncode})")
    result = json.loads(out.read_text())
    result["wall_seconds"] = time.perf_counter() - start
    return result


def table(results: dict[str, Any]) -> str:
    lines = [f"# bench.gpu on {results['device']}{' (smoke sizes)' if results['smoke'] else ''}", "",
             f"Training, bf16, {results['batch_tokens']} target tokens a step "
             "(the train stage's step against MarianMT of the same shape, on the same batches):", "",
             "| model | system | accumulation | target tokens/s | TFLOP/s | MFU | peak memory (GB) |",
             "|---|---|---|---|---|---|---|"]
    for r in results["throughput"]:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        memory = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-"
        lines.append(f"| {r['model']} | {r['system']} | {r['grad_accum']} | {r['tgt_tokens_per_sec']:,.0f} | "
                     f"{r['tflops']:.3g} | {mfu} | {memory} |")
    for model, ratio in results["ours_over_marian"].items():
        lines.append(f"\nours / MarianMT, {model}: {ratio:.2f}x")
    c = results["curves"]
    lines += ["", f"bf16 against fp32, {c['model']}, {c['steps']} steps: loss curves agree within "
                  f"{c['max_relative_difference']:.3%} (limit {c['limit']:.0%}): {'yes' if c['agree'] else 'NO'}; "
                  f"final loss fp32 {c['final']['fp32']:.3f}, bf16 {c['final']['bf16']:.3f}", "",
              f"Decoding, beam 4, {results['decode']['sentences']} sentences of newstest2014, "
              f"{results['decode']['weights']}:", "", *results["decode"]["table"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for a CPU")
    ap.add_argument("--out", type=Path, default=Path("gpu-bench.json"), help="the JSON; the table goes beside (.md)")
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--accum", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = SMOKE if args.smoke else FULL
    if args.part:
        args.part_out.write_text(json.dumps(run_part(sizes, args.work, args.part, args.accum)))
        return
    import torch

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        work = Path(tmp)
        results: dict[str, Any] = {
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "smoke": args.smoke,
            "batch_tokens": sizes.batch_tokens, "torch": torch.__version__, "prepare": spawn("prepare", args, work)}
        results["throughput"] = [spawn(f"throughput:{m}:{system}", args, work)
                                 for m in sizes.models for system in ("ours", "marian")]
        rate = {(r["model"], r["system"]): r["tgt_tokens_per_sec"] for r in results["throughput"]}
        results["ours_over_marian"] = {m: rate[m, "ours"] / rate[m, "marian"] for m in sizes.models}
        curves = {p: spawn(f"curve:{p}", args, work) for p in ("fp32", "bf16")}
        differences = [abs(a - b) / a for a, b in zip(curves["fp32"]["loss"], curves["bf16"]["loss"], strict=True)]
        results["curves"] = {"model": curves["fp32"]["model"], "steps": sizes.curve_steps, "runs": curves,
                             "max_relative_difference": max(differences), "limit": 0.03,
                             "agree": max(differences) <= 0.03,
                             "final": {p: c["loss"][-1] for p, c in curves.items()}}
        results["decode"] = spawn("decode", args, work)
    results["wall_seconds"] = time.perf_counter() - start
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    text = table(results) + f"\n{results['wall_seconds'] / 60:.1f} minutes in all\n"
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
