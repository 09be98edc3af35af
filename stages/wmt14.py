"""The WMT14 data as the paper used it: which archives, which files inside them, and how many pairs
each must hold.

Training: Europarl v7, Common Crawl and News Commentary v9 for en-de (about 4.5M pairs), plus the
UN corpus and the 10^9 French-English corpus for en-fr (about 40.8M before cleaning). Dev:
newstest2013. Test: newstest2014, "full" (3003 sentences, what the paper's BLEU is reported on) or
"filtered" (2737 for en-de), as sacreBLEU names them (`wmt14/full`, `wmt14`).
"""
from __future__ import annotations

import html
import re
from collections.abc import Iterator
from pathlib import Path

from sacrebleu.dataset import DATASETS

from stages.fetch import Archive
from stages.io import PipelineError

# Sizes and sha256 as published in TensorFlow Datasets' checksum lists (url_checksums/wmt14_translate.txt,
# wmt15_translate.txt) for the archives statmt.org serves.
TRAINING_ARCHIVES = {
    "europarl-v7": Archive("http://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz", 657632379, "sha256",
                           "0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7"),
    "commoncrawl": Archive("http://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz", 918311367, "sha256",
                           "c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5"),
    "news-commentary-v9": Archive("http://www.statmt.org/wmt14/training-parallel-nc-v9.tgz", 80418416, "sha256",
                                  "cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485"),
    "un": Archive("http://www.statmt.org/wmt13/training-parallel-un.tgz", 2365634246, "sha256",
                  "29141b5c1eba149a94f7a59d3b1a834b2e47fe0f8758d68dcd77a3d3f497ee47"),
    "giga-fren": Archive("http://www.statmt.org/wmt10/training-giga-fren.tar", 2595102720, "sha256",
                         "3ff8319f6919393520559bfbc7ad6a747ec81b3abc7be9993b338d4b017b4d9a"),
}
DEV_ARCHIVE = Archive("http://data.statmt.org/wmt19/translation-task/dev.tgz", 38654961, "sha256",
                      "7a7deccf82ebb05ba508dba5eb21356492224e8f630ec4f992132b029b4b25e7")

# The paper's corpora per target language.
PAPER_CORPORA = {"de": ("europarl-v7", "commoncrawl", "news-commentary-v9"),
                 "fr": ("europarl-v7", "commoncrawl", "news-commentary-v9", "un", "giga-fren")}


def training_members(corpus: str, tgt: str) -> tuple[str, str]:
    """(English file, other-language file) inside the corpus's archive."""
    pair = f"{tgt}-en"
    return {
        "europarl-v7": (f"training/europarl-v7.{pair}.en", f"training/europarl-v7.{pair}.{tgt}"),
        "commoncrawl": (f"commoncrawl.{pair}.en", f"commoncrawl.{pair}.{tgt}"),
        "news-commentary-v9": (f"training/news-commentary-v9.{pair}.en", f"training/news-commentary-v9.{pair}.{tgt}"),
        "un": ("un/undoc.2000.fr-en.en", "un/undoc.2000.fr-en.fr"),
        "giga-fren": ("giga-fren.release2.fixed.en.gz", "giga-fren.release2.fixed.fr.gz"),
    }[corpus]


# Line counts of the training files as distributed, from the WMT14 translation task's corpus
# statistics (statmt.org/wmt14/translation-task.html); a mismatch is reported, not fatal.
PUBLISHED_PAIRS = {
    ("europarl-v7", "de"): 1_920_209, ("commoncrawl", "de"): 2_399_123, ("news-commentary-v9", "de"): 201_288,
    ("europarl-v7", "fr"): 2_007_723, ("commoncrawl", "fr"): 3_244_152, ("news-commentary-v9", "fr"): 183_251,
    ("un", "fr"): 12_886_831, ("giga-fren", "fr"): 22_520_376,
}
DEV_PAIRS = 3000  # newstest2013
TEST_PAIRS = {("full", "de"): 3003, ("full", "fr"): 3003, ("filtered", "de"): 2737, ("filtered", "fr"): 3003}


def dev_members(tgt: str) -> tuple[str, str]:
    return "dev/newstest2013.en", f"dev/newstest2013.{tgt}"


def test_set(version: str, tgt: str) -> tuple[Archive, tuple[str, str]]:
    """newstest2014's archive (address and md5 as sacreBLEU knows them) and its (source, reference) SGML files."""
    dataset = DATASETS["wmt14/full" if version == "full" else "wmt14"]
    src, ref = dataset.langpairs[f"en-{tgt}"]
    return Archive(dataset.data[0], None, "md5", dataset.md5[0]), (src, ref)


ASCII_SPACE = " \t\n\r\x0b\x0c"  # only these: a segment may end in U+0085 and keep it
_SEGMENT = re.compile(r"<seg[^>]*>(.*)</seg>", re.IGNORECASE)
_ENTITY = re.compile(r"&(#[0-9]+|#[xX][0-9a-fA-F]+|[a-zA-Z][a-zA-Z0-9]*);")


def sgml_segments(path: Path, decode: bool = True) -> Iterator[str]:
    """The text of every <seg> of an SGML (or XML) test set, in document order, surrounding ASCII
    whitespace stripped, entities decoded (or, without `decode`, left as written)."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if "<seg" not in line.lower():
                continue
            match = _SEGMENT.search(line)
            if match is None:
                raise PipelineError(f"{path}:{number}: a <seg> without its closing </seg> on the same line")
            text = match.group(1)
            yield (_ENTITY.sub(lambda m: html.unescape(m.group(0)), text) if decode else text).strip(ASCII_SPACE)
