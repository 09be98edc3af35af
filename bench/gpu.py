"""Everything measured on a GPU, by one command: training throughput against MarianMT, a profile
of one step, bf16 against fp32, beam-search decoding against transformers and CTranslate2, and the
Multi30k GPU preset end to end. It writes one JSON (after every part, so a run cut short keeps what
it measured) and prints (and writes beside it, as markdown) a readable table.

    python -m bench.gpu --out gpu.json                       # on a GPU machine: every part
    python -m bench.gpu --parts throughput,profile,curves    # some parts only
    python -m bench.gpu --smoke                              # tiny sizes, on a CPU too, end to end (CI runs it)
    python -m bench.gpu --parts decode --work W              # keeps decode's model: bench.decode --model it on the CPU

1. Data: the shared WMT14 Europarl sample (20k pairs) with a BPE vocabulary learned on it by the vocab
   stage (37k pieces, the paper's size; 800 with --smoke) and encoded by the encode stage.
2. throughput: Transformer base and big, bf16, the paper's 25k-token step (with gradient
   accumulation only when a step does not fit): the train stage's own step (`Trainer.train_step`:
   prefetched batches, fused loss, no host syncs) against MarianMT of the same shape and precision
   on the same batches with the same optimizer. Target tokens/s, model TFLOP/s, MFU, peak memory.
3. profile: torch.profiler over steps of base: the operators taking the most GPU time, and the
   kernels' time per step against a step's time without the profiler (how busy the GPU is).
4. curves: bf16 against fp32, 200 steps of base through the train stage on the same batches; the two
   loss curves must agree (the largest relative difference is reported).
5. decode: base trained here for a short while (1,000 steps of 25k tokens in bf16, at the paper's
   peak rate), then newstest2014 (3003 sentences), beam 4: ours, transformers `generate` and
   CTranslate2, in fp32 and bf16, with the share of identical outputs and our BLEU. (CTranslate2's
   wheel is built for CUDA 12; where only CUDA 13's cuBLAS is installed it is reported as not run.)
6. multi30k: the pipeline's stages in DAG order (download from the shared copy, clean, vocab, encode,
   train, average, decode, score) with the presets multi30k and multi30k-gpu: the time of each and
   test2016 BLEU.

On an H100 (README, "Speed"): throughput and profile took 1.9 minutes, curves 2 more; multi30k ran
past its 5-minute limit before cuDNN's attention was switched off and has not run since. On an H200,
decode took 3.8 minutes, preparation included.

Each measurement runs in a process of its own (a fresh Accelerate state and a clean peak-memory
count); one that runs out of memory is retried with twice the accumulation, one that runs past
--part-timeout is reported so and the rest go on. It needs torch, accelerate, transformers,
sentencepiece, sacremoses, sacrebleu, safetensors and ctranslate2, and never imports MLflow, Prefect
or DVC (each part checks).
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
    decode_train_steps: int  # of the weights decoded, at the paper's rate peaking at the last step
    multi30k: dict[str, Any]  # overrides after the presets multi30k and multi30k-gpu
    multi30k_lines: int | None  # of each Multi30k file (None: all)


FULL = Sizes(20000, 37000, 25000, ("base", "big"), 3, 10, 200, 10, 3003, ("fp32", "bf16"), 1000, {}, None)
SMOKE = Sizes(2000, 800, 1200, ("tiny",), 1, 2, 12, 3, 16, ("fp32",), 12,
              {"model.d_model": 64, "model.n_heads": 4, "model.d_ff": 128, "model.encoder_layers": 2,
               "model.decoder_layers": 2, "vocab.vocab_size": 800, "train.batch_tokens": 1200, "train.max_steps": 4,
               "train.checkpoint_every_steps": 2, "train.validate_every": 2, "average.last": 2,
               "decode.max_length_extra": 5}, 1000)
PARTS = ("throughput", "profile", "curves", "decode", "multi30k")
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
    return prepare_corpora(sizes, work, (corpus,))


def prepare_corpora(sizes: Sizes, work: Path, corpora: tuple[str, ...]) -> dict[str, Any]:
    """Each corpus's text and encoded text (one corpus: in `work`, several: in `work`/<corpus>), with one
    vocabulary learned on all their training text, so a model trained on one can go on with another."""
    from stages import encode, vocab
    from stages.io import write_manifest

    start = time.perf_counter()
    limits = {"train": sizes.train_lines, "dev": 500, "test": sizes.decode_lines}
    homes = {corpus: work if len(corpora) == 1 else work / corpus for corpus in corpora}
    counts: dict[str, dict[str, int]] = {}
    for corpus, home in homes.items():
        text = home / "text"
        text.mkdir(parents=True, exist_ok=True)  # a preparation cut short is done again
        counts[corpus] = {}
        for split, paths in CORPORA[corpus].items():
            for lang, path in paths.items():
                lines = Path(path).read_text(encoding="utf-8").splitlines()[: limits[split]]
                (text / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
                counts[corpus][split] = len(lines)
        write_manifest(text, "en", "de", counts[corpus])
    learn_from = homes[corpora[0]] / "text"
    if len(corpora) > 1:  # the vocab stage learns from one folder's train split: all corpora's, joined
        learn_from = work / "text"
        learn_from.mkdir(parents=True, exist_ok=True)
        for lang in ("en", "de"):
            joined = "".join((home / "text" / f"train.{lang}").read_text(encoding="utf-8") for home in homes.values())
            (learn_from / f"train.{lang}").write_text(joined, encoding="utf-8")
        write_manifest(learn_from, "en", "de", {"train": sum(c["train"] for c in counts.values())})
    vocab.run(vocab.VocabParams(model_type="bpe", vocab_size=sizes.vocab_size, character_coverage=1.0,
                                input_sentence_size=0, seed=1), clean_dir=learn_from, out_dir=work / "vocab")
    for home in homes.values():
        encode.run(clean_dir=home / "text", vocab_dir=work / "vocab", out_dir=home / "encoded")
    pairs = counts[corpora[0]] if len(corpora) == 1 else counts
    return {"pairs": pairs, "vocab_size": sizes.vocab_size, "seconds": time.perf_counter() - start}


def throughput(sizes: Sizes, work: Path, model: str, system: str, accum: int) -> dict[str, Any]:
    """Timed optimizer steps of ours (the train stage's step) or of MarianMT on the same batches."""
    import torch

    from stages.devices import default_device, peak_flops, use_fast_attention

    device = default_device()
    if device.type == "cuda":
        use_fast_attention()  # for MarianMT too, which also calls scaled_dot_product_attention
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
    trainer = train.Trainer(config, train_params(sizes, grad_accum=accum),
                            encoded_dir=work / "encoded", vocab_dir=work / "vocab", accelerator=accelerator)
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


def profile(sizes: Sizes, work: Path) -> dict[str, Any]:
    """torch.profiler over a few of the train stage's steps of base (tiny with --smoke): where the
    GPU's time goes, and whether it waits on the host: the kernels' time per step against the time of
    a step measured without the profiler (whose start-up, under it, takes seconds)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    name = "tiny" if "tiny" in sizes.models else "base"
    step, _, close = _ours(sizes, work, model_config(name), 1)
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

    for _ in range(sizes.warmup_steps):
        step()
    wall = run_steps()
    with profiler(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]) as prof:
        run_steps()
    close()
    events = prof.key_averages()
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6 / steps if on_gpu else None  # as the table's total
    return {"model": name, "steps": steps, "step_seconds": wall / steps, "kernel_seconds_per_step": busy,
            "table": events.table(sort_by=key, row_limit=20, max_name_column_width=60)}


def decode_weights(sizes: Sizes, work: Path) -> tuple[Path, str, dict[str, Any]]:
    """Base (tiny with --smoke) trained by the train stage in bf16 for a short while on the prepared
    sample, so that it ends its sentences rather than running to the length limit as random weights
    do: its last checkpoint, its name and the train stage's metrics. Also what the CPU bench decodes
    (`bench.decode --model` it, after `--parts decode --work W`, or after this alone)."""
    from stages import train
    from stages.model_files import current_dir, list_checkpoints

    name = "tiny" if "tiny" in sizes.models else "base"
    steps = sizes.decode_train_steps
    # The paper's rate with the warm-up as long as the run, scaled so that it peaks where the paper's does.
    params = train_params(sizes, max_steps=steps, warmup_steps=steps, lr_scale=(steps / 4000) ** 0.5,
                          log_every=max(steps // 10, 1))
    trained = train.run(model_config(name), params, encoded_dir=work / "encoded", vocab_dir=work / "vocab",
                        checkpoint_dir=work / "checkpoints-decode", plots_dir=work / "plots-decode")
    return list_checkpoints(current_dir(work / "checkpoints-decode"))[-1][1], name, trained


def decode(sizes: Sizes, work: Path) -> dict[str, Any]:
    """decode_weights' model decoded by every system at every precision (the share of identical outputs
    shows whether it ends its sentences)."""
    import sacrebleu

    from bench.decode import decode_all, report

    model_path, name, trained = decode_weights(sizes, work)
    steps = sizes.decode_train_steps
    lines = (work / "text/test.en").read_text(encoding="utf-8").splitlines()
    refs = (work / "text/test.de").read_text(encoding="utf-8").splitlines()
    results, unavailable = [], {}
    for precision in sizes.decode_precisions:  # each printed as it ends: a run cut short keeps the first in its log
        with tempfile.TemporaryDirectory(dir=work) as tmp:
            done, why = decode_all(model_path, work / "vocab", lines, 4, (8000,), (precision,), Path(tmp))
        print("\n".join(report(done)), flush=True)
        results, unavailable = results + done, unavailable | why
    ours = {r.precision: r for r in results if r.system.startswith("ours")}
    mfu = f", {trained['mean_mfu']:.1%} MFU" if trained.get("mean_mfu") is not None else ""
    return {"sentences": len(lines), "weights": f"{name}, {steps} steps of bf16 training (loss {trained['loss']:.2f}; "
                                                f"{trained['mean_tgt_tokens_per_sec']:,.0f} target tokens/s{mfu})",
            "model": str(model_path),
            "table": report(results),
            "unavailable": unavailable,
            "systems": [{"system": r.system, "precision": r.precision, "tgt_tokens_per_sec": r.rate,
                         "seconds": r.seconds, "tokens": r.tokens,
                         "same_as_ours": sum(a == b for a, b in zip(ours[r.precision].lines, r.lines, strict=True))
                         / len(lines), "bleu": sacrebleu.corpus_bleu(r.lines, [refs]).score} for r in results]}


def multi30k(sizes: Sizes, work: Path) -> dict[str, Any]:
    """The pipeline's stages, in dvc.yaml's order, with the presets multi30k and multi30k-gpu, on the
    shared Multi30k copy (the download stage's local source): each stage's time and the BLEU."""
    from pipeline.presets import collect_overrides, layered
    from stages import average, clean, download, encode, score, train, vocab
    from stages import decode as decode_stage

    source = work / "multi30k-source"
    source.mkdir(parents=True, exist_ok=True)
    files = {"train": "train", "dev": "val", "test": "test_2016_flickr"}
    for stem in files.values():
        for lang in ("en", "de"):
            lines = (MULTI30K / f"{stem}.{lang}").read_text(encoding="utf-8").splitlines()
            (source / f"{stem}.{lang}").write_text("\n".join(lines[: sizes.multi30k_lines]) + "\n", encoding="utf-8")
    overrides = collect_overrides(["multi30k", "multi30k-gpu"], [])
    overrides.update({"download.source": "local", "download.local.dir": str(source),
                      "download.local.train": [{"src": "train.en", "tgt": "train.de"}],
                      "download.local.dev": {"src": "val.en", "tgt": "val.de"},
                      "download.local.test": {"src": "test_2016_flickr.en", "tgt": "test_2016_flickr.de"},
                      **sizes.multi30k})
    params = layered(overrides)
    out = work / "multi30k"
    paths = {name: out / name for name in ("raw", "clean", "vocab", "encoded", "checkpoints", "plots", "hyps")}
    model = out / "averaged.safetensors"
    stages = {
        "download": lambda: download.run(params.download, out_dir=paths["raw"]),
        "clean": lambda: clean.run(params.clean, raw_dir=paths["raw"], out_dir=paths["clean"]),
        "vocab": lambda: vocab.run(params.vocab, clean_dir=paths["clean"], out_dir=paths["vocab"]),
        "encode": lambda: encode.run(clean_dir=paths["clean"], vocab_dir=paths["vocab"], out_dir=paths["encoded"]),
        "train": lambda: train.run(params.model, params.train, encoded_dir=paths["encoded"], vocab_dir=paths["vocab"],
                                   checkpoint_dir=paths["checkpoints"], plots_dir=paths["plots"]),
        "average": lambda: average.run(params.average, checkpoint_dir=paths["checkpoints"], out_path=model),
        "decode": lambda: decode_stage.run(params.decode, model_path=model, vocab_dir=paths["vocab"],
                                           clean_dir=paths["clean"], out_dir=paths["hyps"]),
        "score": lambda: score.run(params.score, hyp_dir=paths["hyps"], ref_dir=paths["raw"]),
    }
    seconds, metrics = {}, {}
    for name, run in stages.items():
        start = time.perf_counter()
        metrics[name] = run()
        seconds[name] = time.perf_counter() - start
        print(f"multi30k: {name} done in {seconds[name]:.0f} s", flush=True)
    return {"seconds": seconds, "total_seconds": sum(seconds.values()), "steps": params.train.max_steps,
            "train": metrics["train"], "bleu": {split: metrics["score"][split]["bleu"] for split in ("dev", "test")}}


def run_part(sizes: Sizes, work: Path, part: str, accum: int) -> dict[str, Any]:
    import torch

    kind, *args = part.split(":")
    try:
        if kind == "prepare":
            result = prepare(sizes, work)
        elif kind == "throughput":
            result = throughput(sizes, work, args[0], args[1], accum)
        elif kind == "profile":
            result = profile(sizes, work)
        elif kind == "curve":
            result = curve(sizes, work, args[0])
        elif kind == "multi30k":
            result = multi30k(sizes, work)
        else:
            result = decode(sizes, work)
    except torch.cuda.OutOfMemoryError:
        sys.exit(OUT_OF_MEMORY)
    loaded = [m for m in ORCHESTRATION if m in sys.modules]
    assert not loaded, f"bench.gpu must run without the orchestration layer, but imported {loaded}"
    return result


# -- the whole run ------------------------------------------------------------------------------------

def spawn(part: str, args: argparse.Namespace, work: Path, accum: int = 1) -> dict[str, Any]:
    """Run one part in a fresh process; on running out of memory, again with twice the accumulation.
    A part that fails or runs past --part-timeout gives {"error": why}, and the run goes on."""
    out = work / f"{part.replace(':', '-')}.json"
    command = [sys.executable, "-m", "bench.gpu", "--part", part, "--work", str(work), "--accum", str(accum),
               "--part-out", str(out), *(["--smoke"] if args.smoke else [])]
    start = time.perf_counter()
    print(f"== {part}", flush=True)
    try:
        proc = subprocess.run(command, timeout=args.part_timeout or None)
    except subprocess.TimeoutExpired:
        return {"error": f"ran past --part-timeout ({args.part_timeout:.0f} s)"}
    if proc.returncode == OUT_OF_MEMORY and accum < 16:
        print(f"{part}: out of memory with accumulation {accum}; again with {accum * 2}", flush=True)
        return spawn(part, args, work, accum * 2)
    if proc.returncode != 0:
        return {"error": f"failed (exit status {proc.returncode}; its output above)"}
    result = json.loads(out.read_text())
    result["wall_seconds"] = time.perf_counter() - start
    print(f"{part}: {result['wall_seconds']:.0f} s", flush=True)
    return result


def table(results: dict[str, Any]) -> str:
    """The markdown report of whichever parts ran."""
    lines = [f"# bench.gpu on {results['device']}{' (smoke sizes)' if results['smoke'] else ''}", ""]
    errors = [f"- {name}: {why}" for name, why in results.get("errors", {}).items()]
    if errors:
        lines += ["Parts that did not finish:", *errors, ""]
    if throughput := results.get("throughput"):
        lines += [f"Training, bf16, {results['batch_tokens']} target tokens a step (the train stage's step "
                  "against MarianMT of the same shape, on the same batches):", "",
                  "| model | system | accumulation | target tokens/s | TFLOP/s | MFU | peak memory (GB) |",
                  "|---|---|---|---|---|---|---|"]
        for r in throughput:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
            memory = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-"
            lines.append(f"| {r['model']} | {r['system']} | {r['grad_accum']} | {r['tgt_tokens_per_sec']:,.0f} | "
                         f"{r['tflops']:.3g} | {mfu} | {memory} |")
        lines += [f"\nours / MarianMT, {m}: {ratio:.2f}x" for m, ratio in results["ours_over_marian"].items()]
        lines.append("")
    if r := results.get("profile"):
        busy = r["kernel_seconds_per_step"]
        busy = f", its kernels {busy:.3f} s (the GPU busy {busy / r['step_seconds']:.0%})" if busy is not None else ""
        lines += [f"Profile, {r['model']}: a step takes {r['step_seconds']:.3f} s without the profiler{busy}; "
                  f"{r['steps']} steps under it:", "", "```", r["table"], "```", ""]
    if c := results.get("curves"):
        lines += [f"bf16 against fp32, {c['model']}, {c['steps']} steps: loss curves agree within "
                  f"{c['max_relative_difference']:.3%} (limit {c['limit']:.0%}): {'yes' if c['agree'] else 'NO'}; "
                  f"final loss fp32 {c['final']['fp32']:.3f}, bf16 {c['final']['bf16']:.3f}", ""]
    if d := results.get("decode"):
        lines += [f"Decoding, beam 4, {d['sentences']} sentences of newstest2014, weights: {d['weights']}:", "",
                  *d["table"], *[f"{system}: not measured ({why})" for system, why in d["unavailable"].items()],
                  *[f"BLEU of {s['system']} {s['precision']}: {s['bleu']:.1f}" for s in d["systems"]], ""]
    if m := results.get("multi30k"):
        times = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in m["seconds"].items())
        lines += [f"Multi30k, presets multi30k + multi30k-gpu ({m['steps']} steps): test2016 BLEU "
                  f"{m['bleu']['test']:.1f} (dev {m['bleu']['dev']:.1f}) in {m['total_seconds'] / 60:.1f} minutes: "
                  f"{times}", ""]
    return "\n".join(lines)


def write(path: Path, text: str) -> None:
    from stages.io import atomic_write

    with atomic_write(path) as f:
        f.write(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for a CPU")
    ap.add_argument("--out", type=Path, default=Path("gpu-bench.json"), help="the JSON; the table goes beside (.md)")
    ap.add_argument("--parts", type=lambda text: text.split(","), default=list(PARTS),
                    help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
    ap.add_argument("--part-timeout", type=float, default=0.0,
                    help="seconds each measurement may take before it is stopped and reported so (0: no limit)")
    ap.add_argument("--work", type=Path, help="keep the prepared data and the trained models here, e.g. to decode "
                    "decode's model on the CPU afterwards (default: a temporary folder, removed at the end)")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--accum", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.work is not None and args.work.exists() and not args.work.is_dir():
        ap.error(f"--work {args.work}: not a folder (it is where the data and models are kept)")
    if args.part_timeout < 0:
        ap.error(f"--part-timeout must be 0 (no limit) or more seconds, not {args.part_timeout}")
    if unknown := set(args.parts) - set(PARTS):
        ap.error(f"--parts: unknown {', '.join(sorted(unknown))} (known: {', '.join(PARTS)})")
    sizes = SMOKE if args.smoke else FULL
    if args.part:
        write(args.part_out, json.dumps(run_part(sizes, args.work, args.part, args.accum)))
        return
    import torch

    start = time.perf_counter()
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                               "smoke": args.smoke, "batch_tokens": sizes.batch_tokens, "torch": torch.__version__,
                               "errors": {}}

    def measured(key: str, part: str) -> dict[str, Any] | None:
        """A part's result, or None with its error recorded; the JSON rewritten either way."""
        result = spawn(part, args, work)
        if "error" in result:
            results["errors"][part] = result["error"]
        write(args.out, json.dumps(results, indent=2) + "\n")
        return None if "error" in result else result

    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if set(args.parts) - {"multi30k"}:  # every other part reads the prepared Europarl sample
            results["prepare"] = measured("prepare", "prepare")
            if results["prepare"] is None:
                raise SystemExit(f"bench.gpu: preparing the data failed: {results['errors']['prepare']}")
        if "throughput" in args.parts:
            results["throughput"], results["ours_over_marian"] = [], {}
            for m in sizes.models:
                for system in ("ours", "marian"):
                    if r := measured("throughput", f"throughput:{m}:{system}"):
                        results["throughput"].append(r)
                        print(f"{m} {system}: {r['tgt_tokens_per_sec']:,.0f} target tokens/s, {r['tflops']:.3g} "
                              f"TFLOP/s, MFU {r['mfu']}, peak {r['peak_memory_gb']} GB", flush=True)
                rate = {r["system"]: r["tgt_tokens_per_sec"] for r in results["throughput"] if r["model"] == m}
                if len(rate) == 2:
                    results["ours_over_marian"][m] = rate["ours"] / rate["marian"]
        if "profile" in args.parts and (r := measured("profile", "profile")):
            results["profile"] = r
            print(r["table"], flush=True)
        if "curves" in args.parts:
            curves = {p: measured("curves", f"curve:{p}") for p in ("fp32", "bf16")}
            if all(curves.values()):
                differences = [abs(a - b) / a for a, b in zip(curves["fp32"]["loss"], curves["bf16"]["loss"],
                                                                strict=True)]
                results["curves"] = {"model": curves["fp32"]["model"], "steps": sizes.curve_steps, "runs": curves,
                                     "max_relative_difference": max(differences), "limit": 0.03,
                                     "agree": max(differences) <= 0.03,
                                     "final": {p: c["loss"][-1] for p, c in curves.items()}}
                print(f"bf16 against fp32: largest relative difference {max(differences):.3%}", flush=True)
        for part in ("decode", "multi30k"):
            if part in args.parts:
                results[part] = measured(part, part)
    results["wall_seconds"] = time.perf_counter() - start
    write(args.out, json.dumps(results, indent=2) + "\n")
    text = table(results) + f"\n{results['wall_seconds'] / 60:.1f} minutes in all\n"
    write(args.out.with_suffix(".md"), text)
    print(text)
    if results["errors"]:
        raise SystemExit(f"bench.gpu: {len(results['errors'])} part(s) did not finish: {', '.join(results['errors'])}")


if __name__ == "__main__":
    main()
