"""fp32 decoding on CPUs, where translate/cpu.py does not do as plain PyTorch does: each part against
PyTorch's own way, in one run.

    python -m bench.cpu_decoding                       # the parts alone, Multi30k's and WMT14's shapes
    python -m bench.cpu_decoding --model M --vocab-dir V --source S --limit 20   # and decoding with a model

The parts, at the row counts a decoding step has (beams x sentences), random weights, each pair timed
in turn (best of --repeats), with the ratio and the largest difference of their outputs:
- the pre-softmax projection d_model -> vocabulary: PackedOutput (oneDNN on weights packed once; above
  32 MB of logits MKL into a buffer kept across steps) against MKL into that buffer, and the ratio
  oneDNN would give without the size limit;
- a step's linear layers of a --decoder-layers deep decoder, in the order a step runs them (so each
  weight comes from memory, as in decoding): PackedLinear (oneDNN on weights packed once, the
  feed-forward's ReLU in its first product; small products through MKL on Intel CPUs) against
  nn.Linear (MKL) and a ReLU of its own and against oneDNN alone (small_by_mkl off), and fbgemm's
  product of the weights in fp16 (HalfWeights.narrow, decode.precision fp16) against PackedLinear: where
  it stops paying is HalfWeights' FEW_ROWS;
- a step's attention at --keys keys, self-attention (one query per matrix) and attention to the source
  (4 beams per matrix): scaled_dot_product_attention against two batched products, and which the
  CPU backend takes (fused_attention_is_faster);
- beam search's choice of each sentence's best 2K extensions from (sentences, 4 beams, vocabulary)
  log-probabilities: best_candidates (the best chunks first) against a full top-k.
--threads 1 shows what a second thread gives each.

With a model, five translators of it, each with one transform more than the one before, translate the
first --limit lines of --source in one process, alternating for --rounds rounds: plain (the model as
trained), + decoding's attention (DecodingAttention), + PackedOutput, + PackedLinear on oneDNN alone
(every linear layer, the ReLU fused), then + PackedLinear as the backend runs it (small products
through MKL where it is fast: the CPU backend's whole fp32 set, as the decode stage runs it). All search
with best_candidates and step with translate/step.py. It prints the medians (and each one's range over
the rounds, as machines drift), each one's ratio to the one before and to plain, and how many lines all
five translate the same (they should all be)."""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.results import record
from stages import vocab
from stages.decode import read_transformer, translate
from stages.io import PipelineError, read_lines
from stages.params import DecodeParams
from translate import cpu
from translate.translator import Translator
from translate.beam_search import top_k
from transformer.attention import MultiHeadAttention, attention_by_products
from transformer.model import Transformer


def _best(work: Callable[[], object], repeats: int) -> float:
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


Rows = list[dict[str, Any]]


def _spread(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}x" if len(ratios) == 1 else f"{min(ratios):.2f}-{max(ratios):.2f}x"


def projection(shapes: list[tuple[int, int]], rows: list[int], repeats: int) -> Rows:
    table = []
    cpu.keep_freed_memory()  # as the CPU backend runs it
    torch.manual_seed(0)
    for d_model, vocab_size in shapes:
        weight = torch.randn(vocab_size, d_model) * d_model**-0.5
        packed = cpu.PackedOutput(weight)
        for n in rows:
            x, buffer = torch.randn(n, 1, d_model), torch.empty(n, 1, vocab_size)
            mkl = _best(lambda: torch.matmul(x, weight.t(), out=buffer), repeats)
            ours = _best(lambda: packed(x), repeats)
            onednn = _best(lambda: packed.packed(x), repeats)  # what the limit avoids: a fresh output each call
            error = float((packed(x) - torch.matmul(x, weight.t())).abs().max())
            flops = 2 * n * d_model * vocab_size
            print(f"{d_model:>5} -> {vocab_size:<6} {n:>5} rows ({buffer.nbytes / 2**20:5.1f} MB of logits): "
                  f"MKL into a buffer {mkl * 1e3:7.2f} ms ({flops / mkl / 1e9:4.0f} GFLOP/s), PackedOutput "
                  f"{ours * 1e3:7.2f} ms ({flops / ours / 1e9:4.0f}): {mkl / ours:.2f}x; oneDNN at every size "
                  f"{mkl / onednn:.2f}x  (largest difference {error:.1e})")
            table.append({"d_model -> vocabulary": f"{d_model} -> {vocab_size}", "rows": n,
                          "MKL into a buffer (GFLOP/s)": round(flops / mkl / 1e9), "PackedOutput (GFLOP/s)":
                          round(flops / ours / 1e9), "PackedOutput / MKL": f"{mkl / ours:.2f}x"})
    return table


def linear_layers(d_model: int, d_ff: int, layers: int, rows: list[int], repeats: int) -> Rows:
    """A decoding step's linear layers in the decoder's order, each weight read once, as a step reads them
    (from memory, not from cache: the products at a few rows are bound by that)."""
    torch.manual_seed(0)
    per_layer = [(d_model, 3 * d_model), (d_model, d_model),  # self-attention: stacked q, k, v; output
                 (d_model, d_model), (d_model, d_model),  # attention to the source: query; output
                 (d_model, d_ff), (d_ff, d_model)]  # feed-forward: the first with a ReLU
    relu = [n_out == d_ff for _, n_out in per_layer] * layers
    plain = [nn.Linear(n_in, n_out) for n_in, n_out in per_layer * layers]
    ours = [cpu.PackedLinear(linear.weight, linear.bias, relu=r) for linear, r in zip(plain, relu, strict=True)]
    onednn = [cpu.PackedLinear(linear.weight, linear.bias, relu=r, small_by_mkl=False)
              for linear, r in zip(plain, relu, strict=True)]  # what the small products through MKL replace
    half = ([cpu.half_weights(linear.weight, linear.bias, relu=r).narrow for linear, r in zip(plain, relu, strict=True)]
            if cpu.has_fp16_products() else None)  # fbgemm: x86 builds only
    megabytes = sum(linear.weight.nbytes for linear in plain) / 2**20
    table = []
    for n in rows:
        inputs = {width: torch.randn(n, 1, width) for width in (d_model, d_ff)}

        def step(modules: list[nn.Module], fused: bool) -> list[torch.Tensor]:
            outputs = [module(inputs[linear.in_features]) for module, linear in zip(modules, plain, strict=True)]
            return outputs if fused else [y.relu() if r else y for y, r in zip(outputs, relu, strict=True)]

        mkl, packed = _best(lambda: step(plain, False), repeats), _best(lambda: step(ours, True), repeats)
        alone = _best(lambda: step(onednn, True), repeats)
        error = max(float((a - b).abs().max()) for a, b in zip(step(ours, True), step(plain, False), strict=True))
        row = {"d_model, d_ff": f"{d_model}, {d_ff}", "rows": n, "nn.Linear and ReLU (ms)": round(mkl * 1e3, 3),
               "oneDNN alone (ms)": round(alone * 1e3, 3), "PackedLinear (ms)": round(packed * 1e3, 3),
               "PackedLinear / nn.Linear": f"{mkl / packed:.2f}x", "PackedLinear / oneDNN alone":
               f"{alone / packed:.2f}x"}
        fp16 = ""
        if half is not None:
            seconds = _best(lambda: step(half, True), repeats)
            fp16 = f"; fp16 weights {seconds * 1e3:7.2f} ms: {packed / seconds:.2f}x PackedLinear"
            row |= {"fp16 weights (ms)": round(seconds * 1e3, 3),
                    "PackedLinear / fp16 weights": f"{packed / seconds:.2f}x"}
        print(f"{layers} layers of d_model {d_model}, d_ff {d_ff} ({megabytes:.0f} MB of weights), {n:>5} rows: "
              f"nn.Linear and ReLU {mkl * 1e3:7.2f} ms, oneDNN alone {alone * 1e3:7.2f} ms, PackedLinear "
              f"{packed * 1e3:7.2f} ms: {mkl / packed:.2f}x and {alone / packed:.2f}x"
              f"  (largest difference {error:.1e}){fp16}")
        table.append(row)
    return table


def attention_kernels(d_model: int, heads: int, rows: list[int], keys: list[int], repeats: int,
                      beams: int = 4) -> Rows:
    """A decoding step's attention, scaled_dot_product_attention against two batched products:
    self-attention (one query per matrix, each row its own keys) and attention to the source (a
    sentence's beams against its keys, the last two padding), and which of the two the CPU backend takes;
    for attention to the source, also the time of that one without a padding mask (no source padded)."""
    torch.manual_seed(0)
    d = d_model // heads
    sdpa = MultiHeadAttention(d_model, heads, d, d, 0.0, self_attention=True).eval()
    table = []
    for n in rows:
        for t in keys:
            sentences = max(n // beams, 1)
            self_qkv = [torch.randn(n, heads, 1, d)] + [torch.randn(n, heads, t, d) for _ in range(2)]
            source_qkv = [torch.randn(sentences, heads, beams, d)] + [torch.randn(sentences, heads, t, d)
                                                                      for _ in range(2)]
            padding = torch.zeros(sentences, t, dtype=torch.bool)
            padding[:, max(t - 2, 1):] = True
            cells = []
            for name, (q, k, v), mask in (("self", self_qkv, None), ("source", source_qkv, padding)):
                products = _best(lambda: attention_by_products(q, k, v, mask), repeats)
                fused = _best(lambda: sdpa.attend(q, k, v, mask, causal=False), repeats)
                error = float((attention_by_products(q, k, v, mask) - sdpa.attend(q, k, v, mask, False)).abs().max())
                pick = cpu.fused_attention_is_faster(q.numel() // d, q.size(2), t)
                row = {"d_model, heads": f"{d_model}, {heads}", "rows": n, "keys": t, "attention": name,
                       "products (us)": round(products * 1e6), "fused (us)": round(fused * 1e6),
                       "products / fused": f"{products / fused:.2f}x", "taken": "fused" if pick else "products",
                       "without a mask (us)": ""}  # self-attention while decoding has none
                unmasked = ""
                if mask is not None:  # where no source is padded there is no mask (ModelSteps)
                    taken = fused if pick else products
                    bare = _best(lambda: sdpa.attend(q, k, v, None, False) if pick else
                                 attention_by_products(q, k, v, None), repeats)
                    row["without a mask (us)"] = round(bare * 1e6)
                    unmasked = f", taken without a mask {bare * 1e6:.0f} us ({taken / bare:.2f}x)"
                cells.append(f"{name}: products {products * 1e6:6.0f} us, fused {fused * 1e6:6.0f} us "
                             f"({products / fused:.2f}x, takes {'fused' if pick else 'products'}; "
                             f"difference {error:.0e}){unmasked}")
                table.append(row)
            print(f"{n:>5} rows, {t:>3} keys: " + "; ".join(cells))
    return table


def selection(vocab_sizes: list[int], sentences: list[int], repeats: int, beams: int = 4) -> Rows:
    torch.manual_seed(0)
    table = []
    for vocab_size in vocab_sizes:
        for n in sentences:
            lprobs, scores = torch.log_softmax(torch.randn(n, beams, vocab_size) * 3, -1), torch.randn(n, beams)
            buffer = lprobs.clone()  # both may overwrite their input, as beam search lets them

            def full() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                return top_k(buffer.copy_(lprobs), scores, 2 * beams)

            def chunked() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                return cpu.best_candidates(buffer.copy_(lprobs), scores, 2 * beams)

            copy = _best(lambda: buffer.copy_(lprobs), repeats)  # taken out of both
            a, b = _best(full, repeats) - copy, _best(chunked, repeats) - copy
            same = torch.equal(full()[0], chunked()[0])
            print(f"{vocab_size:>6} tokens x {beams} beams, {n:>4} sentences: full top-k {a * 1e3:6.2f} ms, "
                  f"best_candidates {b * 1e3:6.2f} ms: {a / b:.2f}x  (same sums: {same})")
            table.append({"vocabulary": vocab_size, "sentences": n, "full top-k (ms)": round(a * 1e3, 3),
                          "best_candidates (ms)": round(b * 1e3, 3), "top-k / best_candidates": f"{a / b:.2f}x",
                          "same sums": same})
    return table


def _onednn_alone(model: Transformer) -> None:
    cpu.pack_linear_layers(model, functools.partial(cpu.PackedLinear, small_by_mkl=False))


# The CPU backend's fp32 transforms in the order it applies them, each translator one more; the linear layers'
# on oneDNN alone, then as the backend packs them.
_BEFORE_LINEAR = (cpu.attend_for_decoding, cpu.pack_output)
VARIANTS = {"plain": (), "+ decoding's attention": _BEFORE_LINEAR[:1], "+ PackedOutput": _BEFORE_LINEAR,
            "+ PackedLinear, oneDNN alone": (*_BEFORE_LINEAR, _onednn_alone),
            "+ PackedLinear": (*_BEFORE_LINEAR, cpu.pack_linear_layers)}


def _translator(model_path: Path, transforms: tuple[Callable[[Transformer], None], ...]) -> Translator:
    def backend(model: Transformer):
        cpu.keep_freed_memory()
        for transform in transforms:
            transform(model)
        return cpu.best_candidates

    return Translator(read_transformer(model_path), "cpu", bos_id=vocab.BOS_ID, eos_id=vocab.EOS_ID, backend=backend)


def decoding(model_path: Path, vocab_dir: Path, source: Path, limit: int, rounds: int, batch_tokens: int) -> Rows:
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this PyTorch has no oneDNN (torch.backends.mkldnn): the CPU backend uses MKL alone")
    translators = {name: _translator(model_path, transforms) for name, transforms in VARIANTS.items()}
    sp = vocab.load(vocab_dir)
    lines = list(read_lines(source))[:limit]
    params = DecodeParams(beam_size=4, length_penalty=0.6, length_penalty_formula="power", stop="finished",
                          max_length_extra=50, batch_tokens=batch_tokens)
    times: dict[str, list[float]] = {name: [] for name in translators}
    outputs: dict[str, list[str]] = {}
    for translator in translators.values():
        translate(translator, sp, lines[:8], params, "warm-up")
    for _ in range(rounds):  # in turn, so a slow spell of the machine falls on all
        for name, translator in translators.items():
            start = time.perf_counter()
            outputs[name] = translate(translator, sp, lines, params, name)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    same = sum(len(set(translations)) == 1 for translations in zip(*outputs.values(), strict=True)) / len(lines)
    print(f"{len(lines)} lines of {source.name}, beam 4, batches of {batch_tokens} source tokens, "
          f"{torch.get_num_threads()} threads, medians of {rounds}:")
    previous, table = medians["plain"], []
    for name, median in medians.items():
        low, high = min(times[name]) * 1e3, max(times[name]) * 1e3
        print(f"  {name:<30} {median * 1e3:8.0f} ms  (rounds {low:.0f}-{high:.0f}; this transform alone "
              f"{previous / median:.2f}x, plain / this {medians['plain'] / median:.2f}x)")
        table.append({"translator": name, "median ms": round(median * 1e3), "this transform alone":
                      f"{previous / median:.2f}x", "plain / this": f"{medians['plain'] / median:.2f}x",
                      "same translations": f"{same:.1%}"})
        previous = median
    print(f"  same translations: {same:.1%}")
    return table


def _pairs(text: str) -> list[tuple[int, int]]:
    """"256x8000,512x37000" -> [(256, 8000), (512, 37000)]; [] if one is not two numbers above 0."""
    pairs = [[int(n) for n in pair.split("x")] for pair in text.split(",")]
    return [(a, b) for a, b in pairs] if all(len(p) == 2 and min(p) > 0 for p in pairs) else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="256x8000,512x37000", help="d_model x vocabulary, comma-separated")
    ap.add_argument("--layers", default="256x1024,512x2048", help="d_model x d_ff, comma-separated")
    ap.add_argument("--sentences", default="1,5,20,80,250", help="sentences per step of the selection")
    ap.add_argument("--rows", default="4,8,16,32,80,320,1000",
                    help="rows per step (beams x sentences), comma-separated")
    ap.add_argument("--keys", default="4,15,40", help="keys per attention matrix (positions so far, or the "
                    "source's), comma-separated")
    ap.add_argument("--decoder-layers", type=int, default=6, help="decoder layers whose linear layers a step runs")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads (default: "
                    "torch's own count, every core); a record at another count is kept beside the default's")
    ap.add_argument("--model", type=Path, help="a model (.safetensors or .pt) to decode with as well")
    ap.add_argument("--vocab-dir", type=Path)
    ap.add_argument("--source", type=Path)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch-tokens", type=int, default=4000)
    args = ap.parse_args()
    try:
        shapes, layers = _pairs(args.shapes), _pairs(args.layers)
        rows, sentences = [int(n) for n in args.rows.split(",")], [int(n) for n in args.sentences.split(",")]
        keys = [int(n) for n in args.keys.split(",")]
    except ValueError:
        shapes, layers, rows, sentences, keys = [], [], [], [], []
    if not (shapes and layers and rows and sentences and keys) or min(rows + sentences + keys) < 1:
        ap.error(f"--shapes and --layers are pairs such as 256x8000, --rows, --sentences and --keys whole numbers "
                 f"above 0: {args.shapes!r}, {args.layers!r}, {args.rows!r}, {args.sentences!r}, {args.keys!r}")
    if args.model and not (args.vocab_dir and args.source):
        ap.error("--model needs --vocab-dir and --source too")
    if args.model:  # before the parts run, not minutes later
        for flag, path, is_there in (("--model", args.model, Path.is_file),
                                     ("--vocab-dir", args.vocab_dir, Path.is_dir),
                                     ("--source", args.source, Path.is_file)):
            if not is_there(path):
                ap.error(f"{flag} {path}: not found")
    for name in ("repeats", "threads", "limit", "rounds", "batch_tokens", "decoder_layers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    plural = "s" * (args.threads > 1)
    threads = f"{args.threads} thread{plural}, best of {args.repeats}"
    other = "" if args.threads == ap.get_default("threads") else f" {args.threads} thread{plural}"  # in each case
    table = projection(shapes, rows, args.repeats)
    record("cpu_decoding", f"projection {args.shapes} rows {args.rows}{other}",
           f"The pre-softmax projection, {threads}", table, "PackedOutput against MKL into a buffer: "
           f"{_spread([float(r['PackedOutput / MKL'][:-1]) for r in table])}")
    table = [row for d_model, d_ff in layers for row in linear_layers(d_model, d_ff, args.decoder_layers, rows,
                                                                      args.repeats)]
    record("cpu_decoding", f"linear layers {args.layers} rows {args.rows}{other}", f"A decoding step's linear layers "
           f"({args.decoder_layers} decoder layers, weights from memory), {threads}", table, "PackedLinear against "
           f"nn.Linear: {_spread([float(r['PackedLinear / nn.Linear'][:-1]) for r in table])}, against oneDNN "
           f"alone: {_spread([float(r['PackedLinear / oneDNN alone'][:-1]) for r in table])}" + (
               "; fp16 weights against PackedLinear: " + ", ".join(
                   f"{_spread([float(r['PackedLinear / fp16 weights'][:-1]) for r in table if r['rows'] == n])} "
                   f"at {n} rows" for n in rows) if cpu.has_fp16_products() else ""))
    table = [row for d_model, _ in layers  # heads of 64, as the paper's
             for row in attention_kernels(d_model, max(d_model // 64, 1), rows, keys, args.repeats)]
    chosen = [float(r["products / fused"][:-1]) ** (1 if r["taken"] == "fused" else -1) for r in table]
    record("cpu_decoding", f"attention {args.layers} rows {args.rows} keys {args.keys}{other}", "Decoding's attention: "
           f"the fused kernel against two batched products, {threads}", table,
           f"the kernel fused_attention_is_faster takes, against the other: {_spread(chosen)}")
    table = selection(sorted({vocab_size for _, vocab_size in shapes}), sentences, args.repeats)
    record("cpu_decoding", f"selection {args.shapes} sentences {args.sentences}{other}",
           f"Choosing each sentence's best 2K extensions, {threads}", table, "best_candidates against a full top-k: "
           f"{_spread([float(r['top-k / best_candidates'][:-1]) for r in table])}")
    if args.model:
        try:
            table = decoding(args.model, args.vocab_dir, args.source, args.limit, args.rounds, args.batch_tokens)
        except PipelineError as e:
            raise SystemExit(f"error: {e}") from None
        record("cpu_decoding", f"decoding {args.model.name} {args.limit} lines {args.batch_tokens}{other}",
               f"Decoding {args.limit} lines of {args.source.name}, each CPU transform added in turn, "
               f"{args.threads} thread{plural}",
               table, f"the CPU backend against the plain model: {table[-1]['plain / this']}")


if __name__ == "__main__":
    main()
