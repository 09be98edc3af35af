"""fp32 decoding on CPUs, where the decode stage does not do as plain PyTorch does: each part against
PyTorch's own way, in one run.

    python -m bench.cpu_decoding                       # the parts alone, Multi30k's and WMT14's shapes
    python -m bench.cpu_decoding --model M --vocab-dir V --source S --limit 20   # and decoding with a model

The parts, at the row counts a decoding step has (beams x sentences), random weights, each pair timed
in turn (best of --repeats), with the ratio and the largest difference of their outputs:
- the pre-softmax projection d_model -> vocabulary: PackedPreSoftmax (oneDNN on weights packed once;
  above 32 MB of logits MKL into a buffer kept across steps) against MKL into that buffer (PreSoftmax),
  and the ratio oneDNN would give without the size limit;
- the decoder's linear layers (d_model -> d_model, -> d_ff, d_ff -> d_model): FewRowsLinear (oneDNN on
  packed weights up to its ROWS, MKL above) against nn.Linear (MKL);
- beam search's choice of each sentence's best 2K extensions from (sentences, 4 beams, vocabulary)
  log-probabilities: best_candidates (the best chunks first) against a full top-k.
--threads 1 shows what a second thread gives each.

With a model, four translators of it, each with one change more than the one before, translate the
first --limit lines of --source in one process, alternating for --rounds rounds: plain (the model as
trained: nn.Linear, PreSoftmax), + PackedPreSoftmax, + FewRowsLinear, + self-attention's q, k and v in
one product (fuse_projections: the decode stage's translator). It prints the medians (and each
one's range over the rounds: this machine drifts), each change's own ratio and how many lines all four
translate the same (they should all be). All search with best_candidates."""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from stages import vocab
from stages.decode import (
    DecodeParams, FewRowsLinear, PackedPreSoftmax, load_translator, read_transformer, replace_modules, translate)
from stages.devices import keep_freed_memory
from stages.io import PipelineError, read_lines
from transformer.beam_search import best_candidates
from transformer.model import PreSoftmax


def _best(work: Callable[[], object], repeats: int) -> float:
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def projection(shapes: list[tuple[int, int]], rows: list[int], repeats: int) -> None:
    keep_freed_memory()  # as the decode stage runs it
    torch.manual_seed(0)
    for d_model, vocab_size in shapes:
        weight = torch.randn(vocab_size, d_model) * d_model**-0.5
        plain, packed = PreSoftmax(), PackedPreSoftmax(weight)
        for n in rows:
            x, buffer = torch.randn(n, 1, d_model), torch.empty(n, 1, vocab_size)
            mkl = _best(lambda: plain(x, weight, buffer), repeats)
            ours = _best(lambda: packed(x, weight, buffer), repeats)
            onednn = _best(lambda: packed.linear(x), repeats)  # what the limit avoids: a fresh output each call
            error = float((packed(x, weight, buffer) - plain(x, weight, buffer)).abs().max())
            flops = 2 * n * d_model * vocab_size
            print(f"{d_model:>5} -> {vocab_size:<6} {n:>5} rows ({buffer.nbytes / 2**20:5.1f} MB of logits): "
                  f"MKL into a buffer {mkl * 1e3:7.2f} ms ({flops / mkl / 1e9:4.0f} GFLOP/s), PackedPreSoftmax "
                  f"{ours * 1e3:7.2f} ms ({flops / ours / 1e9:4.0f}): {mkl / ours:.2f}x; oneDNN at every size "
                  f"{mkl / onednn:.2f}x  (largest difference {error:.1e})")


def linear_layers(d_model: int, d_ff: int, rows: list[int], repeats: int) -> None:
    torch.manual_seed(0)
    for n_in, n_out in ((d_model, d_model), (d_model, d_ff), (d_ff, d_model)):
        plain = torch.nn.Linear(n_in, n_out)
        ours = FewRowsLinear(plain)
        for n in rows:
            x = torch.randn(n, 1, n_in)
            mkl, packed = _best(lambda: plain(x), repeats), _best(lambda: ours(x), repeats)
            error = float((ours(x) - plain(x)).abs().max())
            flops = 2 * n * n_in * n_out
            print(f"{n_in:>5} -> {n_out:<6} {n:>5} rows: nn.Linear {mkl * 1e6:7.0f} us ({flops / mkl / 1e9:4.0f} "
                  f"GFLOP/s), FewRowsLinear {packed * 1e6:7.0f} us ({flops / packed / 1e9:4.0f}): {mkl / packed:.2f}x"
                  f"  (largest difference {error:.1e})")


def selection(vocab_sizes: list[int], sentences: list[int], repeats: int, beams: int = 4) -> None:
    torch.manual_seed(0)
    for vocab_size in vocab_sizes:
        for n in sentences:
            lprobs, scores = torch.log_softmax(torch.randn(n, beams, vocab_size) * 3, -1), torch.randn(n, beams)
            buffer = lprobs.clone()  # both may overwrite their input, as beam search lets them

            def full() -> tuple[torch.Tensor, torch.Tensor]:
                return buffer.copy_(lprobs).add_(scores.unsqueeze(-1)).view(n, -1).topk(2 * beams, dim=1)

            def chunked() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                return best_candidates(buffer.copy_(lprobs), scores, 2 * beams)

            copy = _best(lambda: buffer.copy_(lprobs), repeats)  # taken out of both
            a, b = _best(full, repeats) - copy, _best(chunked, repeats) - copy
            same = torch.equal(full().values, chunked()[0])
            print(f"{vocab_size:>6} tokens x {beams} beams, {n:>4} sentences: full top-k {a * 1e3:6.2f} ms, "
                  f"best_candidates {b * 1e3:6.2f} ms: {a / b:.2f}x  (same sums: {same})")


@torch.inference_mode()
def decoding(model_path: Path, vocab_dir: Path, source: Path, limit: int, rounds: int, batch_tokens: int) -> None:
    stage = load_translator(model_path, torch.device("cpu"))
    if not isinstance(stage.pre_softmax, PackedPreSoftmax):
        raise SystemExit("this PyTorch has no oneDNN (torch.backends.mkldnn): the decode stage uses MKL alone")
    plain, projection, few_rows = (read_transformer(model_path).eval() for _ in range(3))
    for model in (projection, few_rows):
        model.pre_softmax = PackedPreSoftmax(model.embed.weight)
    replace_modules(few_rows.decoder, nn.Linear, FewRowsLinear)
    sp = vocab.load(vocab_dir)
    lines = list(read_lines(source))[:limit]
    params = DecodeParams(beam_size=4, length_penalty=0.6, length_penalty_formula="power", stop="finished",
                          max_length_extra=50, batch_tokens=batch_tokens)
    models = {"plain": plain, "+ PackedPreSoftmax": projection, "+ FewRowsLinear": few_rows,
              "+ fused q, k, v": stage}  # the last is the decode stage's translator
    times: dict[str, list[float]] = {name: [] for name in models}
    outputs: dict[str, list[str]] = {}
    for model in models.values():
        translate(model, sp, lines[:8], params, "warm-up")
    for _ in range(rounds):  # in turn, so a slow spell of the machine falls on both
        for name, model in models.items():
            start = time.perf_counter()
            outputs[name] = translate(model, sp, lines, params, name)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    same = sum(len(set(translations)) == 1 for translations in zip(*outputs.values(), strict=True)) / len(lines)
    print(f"{len(lines)} lines of {source.name}, beam 4, batches of {batch_tokens} source tokens, "
          f"{torch.get_num_threads()} threads, medians of {rounds}:")
    previous = medians["plain"]
    for name, median in medians.items():
        low, high = min(times[name]) * 1e3, max(times[name]) * 1e3
        print(f"  {name:<18} {median * 1e3:8.0f} ms  (rounds {low:.0f}-{high:.0f}; this change alone "
              f"{previous / median:.2f}x, plain / this {medians['plain'] / median:.2f}x)")
        previous = median
    print(f"  same translations: {same:.1%}")


def _pairs(text: str) -> list[tuple[int, int]]:
    """"256x8000,512x37000" -> [(256, 8000), (512, 37000)]; [] if one is not two numbers above 0."""
    pairs = [[int(n) for n in pair.split("x")] for pair in text.split(",")]
    return [(a, b) for a, b in pairs] if all(len(p) == 2 and min(p) > 0 for p in pairs) else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="256x8000,512x37000", help="d_model x vocabulary, comma-separated")
    ap.add_argument("--layers", default="256x1024,512x2048", help="d_model x d_ff, comma-separated")
    ap.add_argument("--sentences", default="1,5,20,80,250", help="sentences per step of the selection")
    ap.add_argument("--rows", default="8,20,80,320,1000", help="rows per step (beams x sentences), comma-separated")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
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
    except ValueError:
        shapes, layers, rows, sentences = [], [], [], []
    if not (shapes and layers and rows and sentences) or min(rows + sentences) < 1:
        ap.error(f"--shapes and --layers are pairs such as 256x8000, --rows and --sentences whole numbers above 0: "
                 f"{args.shapes!r}, {args.layers!r}, {args.rows!r}, {args.sentences!r}")
    if args.model and not (args.vocab_dir and args.source):
        ap.error("--model needs --vocab-dir and --source too")
    for name in ("repeats", "threads", "limit", "rounds", "batch_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    projection(shapes, rows, args.repeats)
    for d_model, d_ff in layers:
        linear_layers(d_model, d_ff, rows, args.repeats)
    selection(sorted({vocab_size for _, vocab_size in shapes}), sentences, args.repeats)
    if args.model:
        try:
            decoding(args.model, args.vocab_dir, args.source, args.limit, args.rounds, args.batch_tokens)
        except PipelineError as e:
            raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
