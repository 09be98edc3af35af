"""Cleaning throughput on real WMT14 text: the stage's line normalisation against Moses' rules run on
every line, then the stage's pairs per second on one core and on all cores.

    python -m bench.clean

First normalises each side of the shared training samples (Europarl and News Commentary as
distributed, plus the 20k Europarl sample: 40k pairs) on one core twice, with the stage's Normalizer
(which leaves out Moses punctuation normalisation where a line has none of its rules' characters) and
with the rules run on every line (sacremoses after NFC, control characters as spaces), and checks the
outputs equal. Then runs the clean stage (normalisation, length and ratio filters, duplicate removal)
over them, with one worker and with one per core, and projects the time for WMT14 en-de's 4.5M pairs.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time
import unicodedata
from collections.abc import Callable
from pathlib import Path

from sacremoses import MosesPunctNormalizer

from stages import clean
from stages.io import write_manifest
from bench.common import SHARED, settings
from bench.results import record

SAMPLES = {"europarl-v7": "uedin-toy/europarl-v7.first10k", "news-commentary": "uedin-toy/news-commentary.first10k",
           "europarl-20k": "hf-europarl-20k/train"}
WMT14_EN_DE_PAIRS = 4_520_620  # Europarl v7 + Common Crawl + News Commentary v9, as distributed
PARAMS = settings({"clean.drop_duplicates": True, "clean.invalid_utf8": "drop", "clean.workers": 1}).clean


def moses_everywhere(lang: str) -> Callable[[str], str]:
    """The Normalizer's reference: NFC, control characters as spaces, then Moses punctuation normalisation
    and non-printing character removal on every line, spaces collapsed."""
    moses = MosesPunctNormalizer(lang=lang, post_remove_control_chars=True)
    return lambda line: " ".join(moses.normalize(clean.CONTROL.sub(" ", unicodedata.normalize("NFC", line))).split())


def normalising(lines: list[str], lang: str) -> tuple[float, float]:
    """Lines per second of the Normalizer and of its reference over `lines`, the outputs checked equal."""
    rates, outputs = [], []
    for normalize in (clean.Normalizer(lang, PARAMS), moses_everywhere(lang)):
        start = time.perf_counter()
        outputs.append([normalize(line) for line in lines])
        rates.append(len(lines) / (time.perf_counter() - start))
    if outputs[0] != outputs[1]:
        raise SystemExit(f"{lang}: the Normalizer's lines differ from Moses' rules run on every line")
    return rates[0], rates[1]


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
        lines_rows, lines_summary = [], []
        for lang in ("en", "de"):
            lines = (raw / f"train.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)  # as the stage reads
            ours, rules = normalising(lines, lang)
            print(f"normalising {len(lines)} {lang} lines on one core: ours {ours:,.0f} lines/s, Moses' rules on "
                  f"every line {rules:,.0f} ({ours / rules:.2f}x)")
            lines_rows += [{"side": lang, "normaliser": "ours (the rules where a line has their characters)",
                            "lines/s": round(ours)},
                           {"side": lang, "normaliser": "Moses' rules on every line", "lines/s": round(rules)}]
            lines_summary.append(f"{lang}: ours / Moses' rules on every line: {ours / rules:.2f}x")
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
            for w, r in rates.items()], f"{summary}; " + "; ".join(lines_summary),
           tables={"Normalising each side's lines on one core, outputs checked equal": lines_rows})


if __name__ == "__main__":
    main()
