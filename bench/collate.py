"""Collating a step's batches on the host: ours (array operations over the flat ids, stages/batching.py)
against the per-sentence loop a data loader usually runs (allocate a padded tensor, copy each sentence
into its row, as fairseq's collate_tokens does), on the same batches, outputs checked identical.

    python -m bench.collate [--budgets 3125 25000] [--repeats 3]

The batches are the pipeline's own token batches over the lengths of the shared WMT14 Europarl sample
(subword lengths estimated as 1.3 x words) with random ids, padded to multiples of 8 as on a GPU. The
collating thread shares the GIL with the one that launches the step's kernels, so its time is time the
launching thread may lose.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench.common import SAMPLE
from bench.results import record
from bench.train import RandomCorpus
from stages.batching import collate, token_batches
from stages.vocab import BOS_ID, EOS_ID, PAD_ID


def per_sentence(corpus: RandomCorpus, indices: np.ndarray, multiple: int) -> tuple[torch.Tensor, ...]:
    """The peer: one padded tensor per side, each sentence copied into its row in a Python loop."""
    def side(ids: np.ndarray, offsets: np.ndarray, before: list[int], after: list[int]) -> torch.Tensor:
        rows = [np.concatenate([before, ids[offsets[i] : offsets[i + 1]], after]).astype(np.int64) for i in indices]
        width = -(-max(map(len, rows)) // multiple) * multiple
        out = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
        for r, row in enumerate(rows):
            out[r, : len(row)] = torch.from_numpy(row)
        return out
    c = corpus
    return (side(c.src_ids, c.src_offsets, [], [EOS_ID]), side(c.tgt_ids, c.tgt_offsets, [BOS_ID], []),
            side(c.tgt_ids, c.tgt_offsets, [], [EOS_ID]))


def timed(collate_one, batches: list[np.ndarray], repeats: int) -> float:
    """Seconds a batch, the best of `repeats` passes over all of them."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for b in batches:
            collate_one(b)
        best = min(best, time.perf_counter() - start)
    return best / len(batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[25000 // 8, 25000],
                    help="tokens per side per batch (default: the paper's step over 8 GPUs, and on one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab-size", type=int, default=37000)
    args = ap.parse_args()
    if args.repeats < 1 or min(args.budgets) < 1:
        ap.error("--repeats and --budgets must be at least 1")
    words = [[len(line.split()) for line in open(f"{SAMPLE}.{lang}", encoding="utf-8")] for lang in ("en", "de")]
    src, tgt = (np.maximum(1, np.round(np.array(w) * 1.3)).astype(np.int64) for w in words)
    corpus = RandomCorpus(src, tgt, args.vocab_size)
    rows = []
    for budget in args.budgets:
        batches, _ = token_batches(src, tgt, budget, seed=1)
        for b in batches:  # the same work: identical tensors
            for ours, theirs in zip(collate(corpus, b, 8), per_sentence(corpus, b, 8), strict=True):
                assert torch.equal(ours, theirs), "the two collations disagree"
        seconds = {"ours (array operations)": timed(lambda b: collate(corpus, b, 8), batches, args.repeats),
                   "per-sentence loop": timed(lambda b: per_sentence(corpus, b, 8), batches, args.repeats)}
        ratio = seconds["per-sentence loop"] / seconds["ours (array operations)"]
        print(f"budget {budget} tokens a side, {len(batches)} batches (identical tensors both ways):")
        for name, s in seconds.items():
            print(f"  {name:26}{s * 1e3:>9.2f} ms a batch")
        print(f"  per-sentence loop / ours: {ratio:.1f}x")
        rows += [{"budget": budget, "collation": name, "ms a batch": round(s * 1e3, 2)} for name, s in seconds.items()]
    record("collate", f"budgets {' '.join(map(str, args.budgets))}",
           "Collating token batches of the WMT14 Europarl sample (lengths 1.3 x words, random ids, padded to 8)",
           rows, "; ".join(f"budget {r['budget']}: per-sentence loop / ours "
                           f"{q['ms a batch'] / r['ms a batch']:.1f}x" for r, q in zip(rows[::2], rows[1::2])))


if __name__ == "__main__":
    main()
