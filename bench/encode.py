"""Encoding throughput: the encode stage against sentencepiece's own encode of the same lines.

    python -m bench.encode

Learns a 8000-piece BPE model on the shared WMT14 training samples (40k pairs), then encodes their
English side four ways in one run: sentencepiece line by line (one core), sentencepiece's batch
encode on all cores, and the encode stage's writer (ids and offsets to .npy files) on one core and
on all cores. Prints sentences per second and each ratio to sentencepiece line by line.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import sentencepiece as spm

from stages.encode import encode_file
from bench.common import SHARED
from bench.results import record

STEMS = ["hf-europarl-20k/train", "uedin-toy/europarl-v7.first10k", "uedin-toy/news-commentary.first10k"]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "train.en"
        text.write_text("".join((SHARED / "wmt14/train-sample" / f"{s}.en").read_text(encoding="utf-8") for s in STEMS),
                        encoding="utf-8")
        spm.SentencePieceTrainer.train(input=str(text), model_prefix=f"{tmp}/spm", vocab_size=8000, model_type="bpe",
                                       minloglevel=2, num_threads=cores)
        sp = spm.SentencePieceProcessor(model_file=f"{tmp}/spm.model")
        lines = text.read_text(encoding="utf-8").splitlines()
        results = {
            "sentencepiece, line by line": timed(lambda: [sp.encode(line) for line in lines]),
            f"sentencepiece batch, {cores} cores": timed(lambda: sp.encode(lines, num_threads=cores)),
            "encode stage, 1 core": timed(lambda: encode_file(sp, text, Path(tmp) / "one", threads=1)),
            f"encode stage, {cores} cores": timed(lambda: encode_file(sp, text, Path(tmp) / "all", threads=cores)),
        }
    base = len(lines) / results["sentencepiece, line by line"]
    print(f"{len(lines)} English sentences of the WMT14 training samples")
    rows = []
    for name, seconds in results.items():
        rate = len(lines) / seconds
        print(f"{name:34}{rate:>12,.0f} sentences/s{rate / base:>8.2f}x")
        rows.append({"way": name, "sentences/s": round(rate), "against line by line": f"{rate / base:.2f}x"})
    record("encode", "wmt14 samples", f"Encoding {len(lines)} English sentences of the WMT14 training samples", rows,
           f"the encode stage on {cores} cores: {rows[-1]['against line by line']} sentencepiece line by line")


if __name__ == "__main__":
    main()
