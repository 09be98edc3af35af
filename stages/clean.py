"""Stage 2, clean: normalise every line, and drop training pairs that teach nothing or teach noise.

Every line: Moses punctuation normalisation and removal of non-printing characters (sacremoses, as
fairseq's WMT14 recipe runs normalize-punctuation.perl and remove-non-printing-char.perl), Unicode
normalisation, whitespace trimmed (line endings, CRLF and stray carriage returns included). Control
characters (a tab between words, say) become spaces, as remove-non-printing-char.perl makes them, where
sacremoses would join the words; invisible format characters (soft hyphens, zero-width spaces, direction
marks) go, where the perl script would split the word at them (Europarl's German has soft hyphens).
Training pairs are then dropped when a side is empty, longer than `max_tokens` words or
`max_chars` characters (a megabyte line without a space is one "word"), more than `max_ratio` times
the other side's length (a sign of misalignment), a copy of its source (untranslated text, common in
crawled corpora; `keep_copies` keeps them), or (optionally) an exact repeat of an earlier pair. Dev
and test sets are normalised but never filtered. The drops are counted per corpus and reason. Every
split's line counts are checked before anything is written, and the outputs replace the old ones
only once every split is clean. Work is spread over the cores in chunks, output kept in order.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
import unicodedata
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from sacremoses import MosesPunctNormalizer

from stages.io import SPLITS, InputPath, OutputPath, PipelineError, chunks, count_pairs, read_manifest, \
    read_train_corpora, require_dir, split_path, write_manifest
from stages.params import CleanParams
from stages.progress import Bar

REASONS = ("invalid_utf8", "empty", "too_long", "too_many_characters", "length_ratio", "source_equals_target",
           "duplicate")
CHUNK = 20_000  # pairs per task handed to a worker


def drop_reason(src: str, tgt: str, params: CleanParams) -> str | None:
    """Why a training pair is dropped by its length or content, or None to keep it."""
    ns, nt = len(src.split()), len(tgt.split())
    if ns == 0 or nt == 0:
        return "empty"
    if max(ns, nt) > params.max_tokens:
        return "too_long"
    if max(len(src), len(tgt)) > params.max_chars:
        return "too_many_characters"
    if max(ns, nt) > params.max_ratio * min(ns, nt):
        return "length_ratio"
    if src == tgt and not params.keep_copies:
        return "source_equals_target"
    return None


CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # Unicode's category Cc


# The printable ASCII characters Moses punctuation normalisation rewrites or needs beside what it
# rewrites, and "''"; its rules' other characters are non-ASCII, runs of spaces or non-printing.
MOSES_ASCII = "()%:;`\""


class Normalizer:
    """The per-line normalisation for one language.

    Moses punctuation normalisation runs some forty regular expressions over a line and leaves most
    lines as they were but for their spaces: a printable line with none of the characters its rules
    match skips it (`python -m bench.clean` times both ways on the same lines,
    outputs checked equal; tests/test_data_stages.py holds the two to each other)."""

    def __init__(self, lang: str, params: CleanParams) -> None:
        self.moses = MosesPunctNormalizer(lang=lang, post_remove_control_chars=True) \
            if params.normalize_punctuation else None
        self.form = None if params.unicode_form == "none" else params.unicode_form
        self.lowercase = params.lowercase
        if self.moses:
            others = sorted({c for pattern, _ in self.moses.substitutions for c in pattern if ord(c) > 127})
            self.moses_matches = re.compile(f"[{re.escape(MOSES_ASCII + ''.join(others))}]|''")

    def __call__(self, line: str) -> str:
        """The line normalised (and lowercased, where clean.lowercase says so)."""
        line = self._normalized(line)
        return line.lower() if self.lowercase else line

    def _normalized(self, line: str) -> str:
        """The line normalised; it may end in its line ending, which the rules see as a space as the
        clean stage has always given it them (`."` at the end of a line becomes `".` then)."""
        if self.form:
            line = unicodedata.normalize(self.form, line)
        if self.moses and line.rstrip("\r\n").isprintable() and not self.moses_matches.search(line):
            return " ".join(line.split())
        if not line.isprintable():  # a quick scan first: most lines have no control character
            line = CONTROL.sub(" ", line)
        if self.moses:
            line = self.moses.normalize(line)
        return " ".join(line.split())


# A chunk of raw pairs: (line number, byte offset in source, source bytes, byte offset in target, target bytes)
RawPair = tuple[int, int, bytes, int, bytes]
_normalizers: tuple[Normalizer, Normalizer] | None = None


def _init_worker(src_lang: str, tgt_lang: str, params: CleanParams) -> None:
    global _normalizers
    _normalizers = (Normalizer(src_lang, params), Normalizer(tgt_lang, params))


def _process(chunk: list[RawPair], params: CleanParams, filtering: bool) -> list[tuple[str, str, str | None]]:
    """Normalise (and judge) a chunk: (source, target, drop reason or None) per pair. A pair that is
    not valid UTF-8 comes back as ('', '', 'invalid_utf8:<side>:<line>:<offset>')."""
    assert _normalizers is not None
    out = []
    for number, src_offset, src_raw, tgt_offset, tgt_raw in chunk:
        texts = []
        for side, raw, offset in (("src", src_raw, src_offset), ("tgt", tgt_raw, tgt_offset)):
            try:
                texts.append(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                out.append(("", "", f"invalid_utf8:{side}:{number}:{offset + e.start}"))
                break
        else:
            src, tgt = _normalizers[0](texts[0]), _normalizers[1](texts[1])
            out.append((src, tgt, drop_reason(src, tgt, params) if filtering else None))
    return out


def _raw_pairs(src: Path, tgt: Path) -> Iterator[RawPair]:
    with open(src, "rb") as fs, open(tgt, "rb") as ft:
        src_offset = tgt_offset = 0
        for number, (s, t) in enumerate(zip(fs, ft, strict=True), start=1):
            yield number, src_offset, s, tgt_offset, t
            src_offset += len(s)
            tgt_offset += len(t)


def run(params: CleanParams, *, raw_dir: InputPath, out_dir: OutputPath) -> dict[str, object]:
    raw_dir, out_dir = require_dir(raw_dir, "raw text (download stage output)"), Path(out_dir)
    src_lang, tgt_lang = read_manifest(raw_dir)
    corpora = read_train_corpora(raw_dir)
    paths = {split: (split_path(raw_dir, split, src_lang), split_path(raw_dir, split, tgt_lang)) for split in SPLITS}
    totals = {split: count_pairs(*pair) for split, pair in paths.items()}  # every split, before any work
    workers = params.workers or os.cpu_count() or 1
    dropped: dict[str, Counter[str]] = {name: Counter() for name in corpora}
    counts: dict[str, int] = {}
    seen: set[bytes] = set()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(workers, get_context("spawn"), _init_worker, (src_lang, tgt_lang, params)) as pool, \
            tempfile.TemporaryDirectory(prefix=f".{out_dir.name}-", dir=out_dir.parent) as staging:
        for split in SPLITS:
            # which corpus each training line belongs to: corpora are concatenated in manifest order
            bounds = _corpus_bounds(corpora) if split == "train" else [(totals[split], split)]
            with open(split_path(staging, split, src_lang), "w", encoding="utf-8") as fs, \
                    open(split_path(staging, split, tgt_lang), "w", encoding="utf-8") as ft:
                pairs = _clean_split(pool, workers, params, split, paths[split], totals[split], lambda line, reason: (
                    dropped[_corpus_of(bounds, line)].update([reason])), seen)
                kept = 0
                for src, tgt in pairs:
                    fs.write(src + "\n")
                    ft.write(tgt + "\n")
                    kept += 1
            counts[split] = kept
        if counts["train"] == 0:
            reasons = Counter(sum(dropped.values(), Counter()))
            raise PipelineError(f"clean: no training pair is left of {sum(corpora.values())} "
                                f"({', '.join(f'{n} {r}' for r, n in reasons.items()) or 'the corpus is empty'}); "
                                f"check the corpus or clean.max_tokens, clean.max_chars and clean.max_ratio")
        out_dir.mkdir(exist_ok=True)
        for split in SPLITS:  # every split is clean: only now do the old outputs go
            for lang in (src_lang, tgt_lang):
                os.replace(split_path(staging, split, lang), split_path(out_dir, split, lang))
    kept_per_corpus = {name: n - sum(dropped[name].values()) for name, n in corpora.items()}
    write_manifest(out_dir, src_lang, tgt_lang, counts, corpora=kept_per_corpus)
    metrics: dict[str, object] = {f"{split}_pairs": n for split, n in counts.items()}
    metrics.update({f"dropped_{r}": sum(d[r] for d in dropped.values()) for r in REASONS})
    metrics["corpora"] = {name: {"pairs": corpora[name], "kept": kept_per_corpus[name],
                                 **{f"dropped_{r}": dropped[name][r] for r in REASONS}} for name in corpora}
    return metrics


def _in_order(pool: Executor, work: Callable[[Any], Any], items: Iterable[Any], window: int) -> Iterator[Any]:
    """work(item) for each item, run by the pool, in order, with at most `window` items handed out
    at a time, so a corpus is never all in memory. A worker that dies (killed, or unable to start)
    stops it with an error rather than a wait forever."""
    pending: deque = deque()
    try:
        for item in items:
            pending.append(pool.submit(work, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise PipelineError(
            "clean: a worker process ended before its work was done (its own error, if any, is above). Its "
            "workers are spawned processes, which first import the script that called the stage: from a "
            "script of your own, call it under `if __name__ == \"__main__\":`") from None
    finally:
        for future in pending:
            future.cancel()


def _clean_split(pool: Executor, workers: int, params: CleanParams, split: str, paths: tuple[Path, Path],
                 total: int, drop: Callable[[int, str], None], seen: set[bytes]) -> Iterator[tuple[str, str]]:
    """The split's pairs to keep, normalised, in order; `drop(line, reason)` is told of the others.
    Invalid UTF-8 stops it, naming file, line and byte, unless training pairs may be dropped for it."""
    src_path, tgt_path = paths
    results = _in_order(pool, partial(_process, params=params, filtering=split == "train"),
                        chunks(_raw_pairs(src_path, tgt_path), CHUNK), window=2 * workers)
    line = 0
    with Bar(total=total, desc=f"clean {split}", unit=" pairs", mininterval=2) as bar:
        for chunk in results:
            for src, tgt, reason in chunk:
                line += 1
                if reason is not None and reason.startswith("invalid_utf8"):
                    _, side, number, offset = reason.split(":")
                    if params.invalid_utf8 == "error" or split != "train":  # a test set is never filtered
                        path = src_path if side == "src" else tgt_path
                        raise PipelineError(f"{path}:{number}: invalid UTF-8 at byte {offset} of the file"
                                            + (" (clean.invalid_utf8: drop drops such training pairs)"
                                               if split == "train" else ""))
                    reason = "invalid_utf8"
                if reason is None and split == "train" and params.drop_duplicates:
                    key = hashlib.blake2b(f"{src}\t{tgt}".encode(), digest_size=12).digest()
                    reason = "duplicate" if key in seen else None
                    seen.add(key)
                if reason is not None:
                    drop(line, reason)
                else:
                    yield src, tgt
            bar.update(len(chunk))


def _corpus_bounds(corpora: dict[str, int]) -> list[tuple[int, str]]:
    bounds, end = [], 0
    for name, n in corpora.items():
        end += n
        bounds.append((end, name))
    return bounds


def _corpus_of(bounds: list[tuple[int, str]], line: int) -> str:
    return next(name for end, name in bounds if line <= end)
