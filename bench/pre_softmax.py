"""The pre-softmax projection of fp32 decoding on CPUs: the decode stage's PackedPreSoftmax (oneDNN on
weights packed once) against PyTorch's own product (MKL's sgemm, into a buffer kept across steps, as
PreSoftmax does), in one run.

    python -m bench.pre_softmax                       # the projection alone, Multi30k's and WMT14's shapes
    python -m bench.pre_softmax --model M --vocab-dir V --source S --limit 20   # and decoding with a model

The projection alone: d_model -> vocabulary at the row counts a decoding step has (beams x sentences),
random weights, the two timed in turn (best of --repeats), with the ratio, the ratio oneDNN would
give without PackedPreSoftmax's size limit (above 32 MB of logits it uses MKL), and the largest
difference of their outputs. --threads 1 shows what a second thread gives each.

With a model: the decode stage translates the first --limit lines of --source in one process, with
PackedPreSoftmax and with PreSoftmax, alternating for --rounds rounds; it prints the medians, their
ratio and how many translations are the same (they should all be)."""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from stages import vocab
from stages.decode import DecodeParams, PackedPreSoftmax, load_translator, translate
from stages.devices import keep_freed_memory
from stages.io import PipelineError, read_lines
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


@torch.inference_mode()
def decoding(model_path: Path, vocab_dir: Path, source: Path, limit: int, rounds: int, batch_tokens: int) -> None:
    packed = load_translator(model_path, torch.device("cpu"))
    if not isinstance(packed.pre_softmax, PackedPreSoftmax):
        raise SystemExit("this PyTorch has no oneDNN (torch.backends.mkldnn): the decode stage uses MKL alone")
    plain = load_translator(model_path, torch.device("cpu"))
    plain.pre_softmax = PreSoftmax()
    sp = vocab.load(vocab_dir)
    lines = list(read_lines(source))[:limit]
    params = DecodeParams(beam_size=4, length_penalty=0.6, length_penalty_formula="power", stop="finished",
                          max_length_extra=50, batch_tokens=batch_tokens)
    models = {"PreSoftmax (MKL)": plain, "PackedPreSoftmax": packed}
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
    same = sum(a == b for a, b in zip(*outputs.values(), strict=True)) / len(lines)
    print(f"{len(lines)} lines of {source.name}, beam 4, batches of {batch_tokens} source tokens, "
          f"{torch.get_num_threads()} threads, medians of {rounds}:")
    for name, median in medians.items():
        print(f"  {name:<18} {median * 1e3:8.0f} ms")
    print(f"  PreSoftmax / PackedPreSoftmax: {medians['PreSoftmax (MKL)'] / medians['PackedPreSoftmax']:.2f}x, "
          f"same translations: {same:.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="256x8000,512x37000", help="d_model x vocabulary, comma-separated")
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
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
        rows = [int(n) for n in args.rows.split(",")]
    except ValueError:
        ap.error(f"--shapes is D x V pairs such as 256x8000 and --rows whole numbers: {args.shapes!r}, {args.rows!r}")
    if any(len(shape) != 2 for shape in shapes) or min(n for shape in shapes for n in shape) < 1 or min(rows) < 1:
        ap.error(f"--shapes is D x V pairs such as 256x8000, --rows numbers above 0: {args.shapes!r}, {args.rows!r}")
    if args.model and not (args.vocab_dir and args.source):
        ap.error("--model needs --vocab-dir and --source too")
    for name in ("repeats", "threads", "limit", "rounds", "batch_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    projection(shapes, rows, args.repeats)
    if args.model:
        try:
            decoding(args.model, args.vocab_dir, args.source, args.limit, args.rounds, args.batch_tokens)
        except PipelineError as e:
            raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
