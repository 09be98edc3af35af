"""Padding and batch fill of the token-budget sampler against random batching, on the same real data,
and what padding to a few bucket shapes (train.shapes buckets, for CUDA graphs) costs on top; then the
time the sampler takes to build an epoch's batches at WMT14 en-de's scale against the same cut made
pair by pair, the batches checked identical.

    python -m bench.batching [--budgets 3125 2000 1000] [--vocab 8000] [--scale 4500000]

Encodes the shared WMT14 training samples (Europarl and News Commentary, 40k pairs) with a sentencepiece
BPE model learned on the spot, then builds batches both ways under the same budget (padded tokens per
side per batch) and prints, for each, the padding fraction of source and target, the batch fill
(real tokens of the side that binds the budget, over the budget) and the number of batch shapes.
The default budgets: the paper's 25k tokens per step split over its 8 GPUs (3125), and two smaller
ones, closer to the paper's batch-to-corpus ratio on this much smaller corpus.

At scale, the corpus is `--scale` pairs (WMT14 en-de's 4.5M by default) whose lengths are drawn, with
replacement, from the sample's encoded pairs; each train stage start builds the batches of the whole
corpus, on every process, before its first step, with the GPUs idle. The budgets there: the paper's
25k tokens a step on one GPU and over 8, with the bucket shapes CUDA graphs replay.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import sentencepiece as spm

from stages.batching import BIN_WIDTHS, bucket_shape, bucket_width, token_batches
from bench.common import SHARED
from bench.results import record


def random_batches(src: np.ndarray, tgt: np.ndarray, budget: int, seed: int) -> list[np.ndarray]:
    """The baseline: sentences in random order, a batch closed when the next would break the budget."""
    longest = np.maximum(src, tgt) + 1
    batches, current, width = [], [], 0
    for i in np.random.default_rng(seed).permutation(len(src)):
        if current and max(width, longest[i]) * (len(current) + 1) > budget:
            batches.append(np.array(current))
            current, width = [], 0
        current.append(i)
        width = max(width, longest[i])
    return batches + ([np.array(current)] if current else [])


def pairwise_batches(src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_tokens: int, seed: int | None,
                     keep: np.ndarray | None = None, bucketed: bool = False) -> tuple[list[np.ndarray], int]:
    """The reference: what token_batches documents, its cut made pair by pair as the sampler made it
    before (a three-key sort, then a loop that closes a batch at the pair that breaks the budget, and
    the padding counted batch by batch), so that the tests hold token_batches' array operations to it
    and this bench times both."""
    src_len, tgt_len = np.asarray(src_lengths, dtype=np.int64) + 1, np.asarray(tgt_lengths, dtype=np.int64) + 1
    order = np.arange(len(src_len)) if seed is None else np.random.default_rng(seed).permutation(len(src_len))
    longest = np.maximum(src_len, tgt_len)
    if bucketed:
        longest = np.array([bucket_width(int(n)) for n in longest], dtype=np.int64)
    if keep is not None:
        order = order[np.asarray(keep)[order]]
    kept = order[longest[order] <= max_tokens]
    best: tuple[int, list[np.ndarray]] | None = None
    for width in BIN_WIDTHS:
        bins = tgt_len[kept] // width
        ordered = kept[np.lexsort((tgt_len[kept], np.where(bins % 2 == 0, src_len[kept], -src_len[kept]), bins))]
        batches, start, widest = [], 0, 0
        for i, pair in enumerate(ordered):
            if max(widest, longest[pair]) * (i - start + 1) > max_tokens:
                batches.append(ordered[start:i])
                start, widest = i, 0
            widest = max(widest, longest[pair])
        batches += [ordered[start:]] if start < len(ordered) else []
        padded = 0
        for b in batches:
            if bucketed:
                rows, side = bucket_shape(int(max(src_len[b].max(), tgt_len[b].max())), max_tokens)
                slots = 2 * rows * side
            else:
                slots = len(b) * int(src_len[b].max() + tgt_len[b].max())
            padded += slots - int(src_len[b].sum() + tgt_len[b].sum())
        if best is None or padded < best[0]:
            best = padded, batches
    return (best[1] if best else []), len(order) - len(kept)


def at_scale(src: np.ndarray, tgt: np.ndarray, pairs: int,
             budgets: list[tuple[int, bool]]) -> tuple[list[dict[str, object]], str]:
    """Seconds to build the batches of `pairs` pairs drawn from (src, tgt): ours against pairwise_batches,
    for each (budget, bucketed), the batches checked identical. Returns the rows and their summary."""
    drawn = np.random.default_rng(0).integers(0, len(src), pairs)
    s, t = src[drawn], tgt[drawn]
    rows, summary = [], []
    for budget, bucketed in budgets:
        times = {}
        for name, build in (("ours (array operations)", token_batches), ("pair by pair", pairwise_batches)):
            start = time.perf_counter()
            times[name] = (build(s, t, budget, 1, None, bucketed)[0], time.perf_counter() - start)
        (ours, ours_s), (peer, peer_s) = times.values()
        if len(ours) != len(peer) or not all(np.array_equal(a, b) for a, b in zip(ours, peer)):
            raise SystemExit(f"budget {budget}: the batches differ from the pair-by-pair cut")
        shapes = "bucket shapes" if bucketed else "exact shapes"
        summary.append(f"budget {budget}, {shapes}: ours {ours_s:.2f} s, pair by pair {peer_s:.2f} s "
                       f"({peer_s / ours_s:.1f}x)")
        print(f"{pairs:,} pairs, {summary[-1]}; {len(ours):,} batches")
        rows += [{"budget": budget, "shapes": shapes, "batching": name, "batches": len(ours), "seconds": round(took, 2)}
                 for name, (_, took) in times.items()]
    return rows, "; ".join(summary)


def measure(batches: list[np.ndarray], src: np.ndarray, tgt: np.ndarray, budget: int,
            bucketed: bool = False) -> dict[str, float]:
    """Padding per side, fill and shapes, each batch padded to its longest pair per side or, bucketed,
    both sides to its bucket_shape."""
    def shapes(b: np.ndarray) -> tuple[tuple[int, int], tuple[int, int]]:
        if bucketed:
            shape = bucket_shape(int(max(src[b].max(), tgt[b].max())) + 1, budget)
            return shape, shape
        return (len(b), int(src[b].max() + 1)), (len(b), int(tgt[b].max() + 1))
    real_src = sum(int(src[b].sum() + len(b)) for b in batches)  # + EOS / BOS per sentence
    real_tgt = sum(int(tgt[b].sum() + len(b)) for b in batches)
    shaped = [shapes(b) for b in batches]
    padded_src = sum(rows * width for (rows, width), _ in shaped)
    padded_tgt = sum(rows * width for _, (rows, width) in shaped)
    binding = sum(max(int(src[b].sum()), int(tgt[b].sum())) + len(b) for b in batches)  # the side the budget binds
    return {"batches": len(batches), "src_padding": 1 - real_src / padded_src, "tgt_padding": 1 - real_tgt / padded_tgt,
            "fill": binding / (len(batches) * budget), "shapes": len(set(shaped))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[25000 // 8, 2000, 1000])
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--scale", type=int, default=4_500_000,
                        help="pairs to time the batching of, drawn from the sample's lengths (0: none)")
    args = parser.parse_args()
    if args.scale < 0 or min(args.budgets) < 1:
        parser.error("--scale must be 0 or more and --budgets at least 1")
    sample = SHARED / "wmt14/train-sample"
    stems = ["hf-europarl-20k/train", "uedin-toy/europarl-v7.first10k", "uedin-toy/news-commentary.first10k"]
    lines = {lang: [line.strip() for stem in stems for line in open(sample / f"{stem}.{lang}", encoding="utf-8")]
             for lang in ("en", "de")}
    keep_pairs = [i for i, (s, t) in enumerate(zip(lines["en"], lines["de"])) if s and t]  # as cleaning would
    with tempfile.TemporaryDirectory() as tmp:
        for lang in ("en", "de"):
            Path(tmp, f"text.{lang}").write_text("\n".join(lines[lang][i] for i in keep_pairs), encoding="utf-8")
        spm.SentencePieceTrainer.train(input=[f"{tmp}/text.en", f"{tmp}/text.de"],
                                       model_prefix=f"{tmp}/spm", vocab_size=args.vocab, model_type="bpe",
                                       minloglevel=2, num_threads=os.cpu_count())
        sp = spm.SentencePieceProcessor(model_file=f"{tmp}/spm.model")
    src, tgt = (np.array([len(x) for x in sp.encode([lines[lang][i] for i in keep_pairs])]) for lang in ("en", "de"))
    rows = []
    for budget in args.budgets:
        keep = np.maximum(src, tgt) < budget
        s, t = src[keep], tgt[keep]
        ours = measure(token_batches(s, t, budget, seed=1)[0], s, t, budget)
        shaped = measure(token_batches(s, t, budget, seed=1, bucketed=True)[0], s, t, budget, bucketed=True)
        peer = measure(random_batches(s, t, budget, seed=1), s, t, budget)
        print(f"\n{len(s)} pairs of the WMT14 training samples, budget {budget} tokens per side per batch")
        print(f"{'':30}{'batches':>9}{'src padding':>13}{'tgt padding':>13}{'fill':>8}{'shapes':>8}")
        kinds = (("token-bucketed (ours)", ours), ("ours, bucket shapes", shaped), ("random", peer))
        for name, m in kinds:
            print(f"{name:30}{m['batches']:>9}{m['src_padding']:>13.1%}{m['tgt_padding']:>13.1%}{m['fill']:>8.1%}"
                  f"{m['shapes']:>8}")
        print(f"ratio ours/random: batches {ours['batches'] / peer['batches']:.2f}x, "
              f"fill {ours['fill'] / peer['fill']:.2f}x")
        rows += [{"budget": budget, "batching": name, "batches": m["batches"],
                  "source padding": f"{m['src_padding']:.1%}", "target padding": f"{m['tgt_padding']:.1%}",
                  "fill": f"{m['fill']:.1%}", "shapes": m["shapes"]} for name, m in kinds]
    record("batching", f"vocab {args.vocab} budgets {' '.join(map(str, args.budgets))}",
           f"Batches of the WMT14 training samples ({len(src)} pairs), {args.vocab}-piece BPE", rows,
           "; ".join(f"budget {r['budget']}: ours {r['target padding']} target padding ({b['target padding']} "
                     f"in {b['shapes']} bucket shapes), random {q['target padding']}"
                     for r, b, q in zip(rows[::3], rows[1::3], rows[2::3])))
    if args.scale:
        timed, summary = at_scale(src, tgt, args.scale, [(25000, False), (25000 // 8, False), (25000 // 8, True)])
        record("batching", f"scale {args.scale}",
               f"Building an epoch's batches of {args.scale:,} pairs (lengths drawn from the WMT14 samples'), "
               f"{args.vocab}-piece BPE", timed, summary)

if __name__ == "__main__":
    main()
