"""Stage 2, clean: drop training pairs that teach nothing or teach noise.

Training pairs are dropped when a side is empty, when a side has more than `max_tokens` words, or
when one side has more than `max_ratio` times the words of the other (a sign of misalignment).
Dev and test pairs pass through untouched apart from line endings: a test set is never filtered.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from stages.io import SPLITS, atomic_write, read_manifest, read_parallel, require_dir, split_path, write_manifest


@dataclass(frozen=True)
class CleanParams:
    max_tokens: int  # words (whitespace-separated) per side
    max_ratio: float  # longest side over shortest side, in words


def drop_reason(src: str, tgt: str, params: CleanParams) -> str | None:
    """Why a training pair is dropped, or None to keep it."""
    ns, nt = len(src.split()), len(tgt.split())
    if ns == 0 or nt == 0:
        return "empty"
    if max(ns, nt) > params.max_tokens:
        return "too_long"
    if max(ns, nt) > params.max_ratio * min(ns, nt):
        return "length_ratio"
    return None


def run(params: CleanParams, *, raw_dir: str | Path, out_dir: str | Path) -> dict[str, int]:
    raw_dir = require_dir(raw_dir, "raw text (download stage output)")
    src_lang, tgt_lang = read_manifest(raw_dir)
    counts: dict[str, int] = {}
    dropped: Counter[str] = Counter()
    for split in SPLITS:
        kept = 0
        pairs = read_parallel(split_path(raw_dir, split, src_lang), split_path(raw_dir, split, tgt_lang))
        with atomic_write(split_path(out_dir, split, src_lang)) as fs, \
                atomic_write(split_path(out_dir, split, tgt_lang)) as ft:
            for src, tgt in tqdm(pairs, desc=f"clean {split}", unit=" pairs", mininterval=2):
                src, tgt = src.strip(), tgt.strip()
                if split == "train" and (reason := drop_reason(src, tgt, params)):
                    dropped[reason] += 1
                    continue
                fs.write(src + "\n")
                ft.write(tgt + "\n")
                kept += 1
        counts[split] = kept
    write_manifest(out_dir, src_lang, tgt_lang, counts)
    metrics = {f"{split}_pairs": n for split, n in counts.items()}
    metrics.update({f"dropped_{reason}": dropped[reason] for reason in ("empty", "too_long", "length_ratio")})
    return metrics
