"""Cleaning throughput on real WMT14 text: pairs per second on one core and on all cores.

    python -m bench.clean

Runs the clean stage (Moses punctuation normalisation, non-printing character removal, NFC,
length and ratio filters, duplicate removal) over the shared training samples (Europarl and News
Commentary as distributed, plus the 20k Europarl sample: 40k pairs), first with one worker, then
with one per core, and projects the time for WMT14 en-de's 4.5M pairs.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path

from stages import clean
from stages.io import write_manifest
from bench.common import SHARED, settings
from bench.results import record

SAMPLES = {"europarl-v7": "uedin-toy/europarl-v7.first10k", "news-commentary": "uedin-toy/news-commentary.first10k",
           "europarl-20k": "hf-europarl-20k/train"}
WMT14_EN_DE_PAIRS = 4_520_620  # Europarl v7 + Common Crawl + News Commentary v9, as distributed
PARAMS = settings({"clean.drop_duplicates": True, "clean.invalid_utf8": "drop", "clean.workers": 1}).clean


def sample_raw(raw: Path) -> dict[str, int]:
    """The shared training samples as one raw training split (dev and test one line each) in `raw`;
    returns the pairs of each sample."""
    raw.mkdir()
    counts = {}
    for lang in ("en", "de"):
        with open(raw / f"train.{lang}", "wb") as out:
            for name, stem in SAMPLES.items():
                data = (SHARED / "wmt14/train-sample" / f"{stem}.{lang}").read_bytes()
                out.write(data)
                counts[name] = data.count(b"\n")
        for split in ("dev", "test"):
            (raw / f"{split}.{lang}").write_text("x\n")
    write_manifest(raw, "en", "de", {"train": sum(counts.values()), "dev": 1, "test": 1}, corpora=counts)
    return counts


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw"
        pairs = sum(sample_raw(raw).values())
        print(f"{pairs} pairs of WMT14 training text, {os.cpu_count()} cores")
        rates = {}
        for workers in (1, os.cpu_count() or 1):
            start = time.perf_counter()
            clean.run(dataclasses.replace(PARAMS, workers=workers), raw_dir=raw, out_dir=Path(tmp) / f"clean{workers}")
            rates[workers] = pairs / (time.perf_counter() - start)
            print(f"{workers} worker(s): {rates[workers]:,.0f} pairs/s; 4.5M pairs in "
                  f"{WMT14_EN_DE_PAIRS / rates[workers] / 60:.1f} min")
        summary = f"all cores / one core: {rates[max(rates)] / rates[1]:.2f}x"
        print(summary)
    record("clean", "wmt14 samples", f"The clean stage on {pairs} pairs of WMT14 training text",
           [{"workers": w, "pairs/s": round(r), "4.5M pairs (min)": round(WMT14_EN_DE_PAIRS / r / 60, 1)}
            for w, r in rates.items()], summary)


if __name__ == "__main__":
    main()
