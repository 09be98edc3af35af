"""Stage 4, encode: sentencepiece token ids for every split, stored flat so training never tokenises.

Per split and language: <split>.<lang>.ids.npy, all sentences' ids end to end (uint16 when the
vocabulary fits), and <split>.<lang>.offsets.npy, where sentence i is ids[offsets[i]:offsets[i+1]].
Both are memory-mapped when read. No BOS or EOS is stored; the model adds them.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from stages import vocab
from stages.io import MANIFEST, SPLITS, InputPath, OutputPath, PipelineError, atomic_write, chunks, count_lines, \
    read_json, read_lines, read_manifest, require_dir, split_path, write_manifest
from stages.progress import Bar

CHUNK = 50_000  # lines encoded per call, so memory stays flat whatever the corpus size


def encode_file(sp, text_path: Path, out_prefix: Path, threads: int | None = None) -> tuple[np.ndarray, int]:
    """Encode one text file (on `threads` cores, all by default); return its sentence lengths in
    tokens and its count of unknown tokens."""
    dtype = np.uint16 if sp.get_piece_size() <= np.iinfo(np.uint16).max + 1 else np.int32
    lengths: list[int] = []
    unknown = 0
    tmp_ids = out_prefix.with_name(out_prefix.name + ".ids.tmp")
    with open(tmp_ids, "wb") as f:
        bar = Bar(total=count_lines(text_path), desc=f"encode {text_path.name}", unit=" lines", mininterval=2)
        for chunk in chunks(read_lines(text_path), CHUNK):
            encoded = sp.encode(chunk, num_threads=threads or os.cpu_count() or 1)
            lengths.extend(len(ids) for ids in encoded)
            flat = np.fromiter((i for ids in encoded for i in ids), dtype=dtype)
            unknown += int(np.count_nonzero(flat == vocab.UNK_ID))
            f.write(flat.tobytes())
            bar.update(len(chunk))
        bar.close()
    ids = np.fromfile(tmp_ids, dtype=dtype)
    tmp_ids.unlink()
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    for suffix, array in (("ids", ids), ("offsets", offsets)):
        with atomic_write(out_prefix.with_name(f"{out_prefix.name}.{suffix}.npy"), "wb") as f:
            np.save(f, array)
    return np.asarray(lengths), unknown


def run(*, clean_dir: InputPath, vocab_dir: InputPath, out_dir: OutputPath) -> dict[str, float]:
    clean_dir = require_dir(clean_dir, "clean text (clean stage output)")
    src_lang, tgt_lang = read_manifest(clean_dir)
    sp = vocab.load(vocab_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, float] = {}
    counts: dict[str, int] = {}
    for split in SPLITS:
        for lang in (src_lang, tgt_lang):
            lengths, unknown = encode_file(sp, split_path(clean_dir, split, lang), split_path(out_dir, split, lang))
            metrics[f"{split}_{lang}_tokens"] = int(lengths.sum())
            metrics[f"{split}_{lang}_unk_rate"] = unknown / max(int(lengths.sum()), 1)
            counts[split] = len(lengths)
    write_manifest(out_dir, src_lang, tgt_lang, counts, vocab=vocab.identity(sp))
    return metrics


def check_encoded_with(encoded_dir: str | Path, vocab_dir: str | Path) -> None:
    """Refuse ids encoded with another vocabulary than `vocab_dir`'s: a model would learn other pieces
    under each id (ids encoded before the manifest named their vocabulary pass)."""
    encoded_with = read_json(Path(encoded_dir) / MANIFEST).get("vocab")
    if encoded_with is not None and encoded_with != vocab.identity(vocab_dir):
        raise PipelineError(f"{encoded_dir} was encoded with another vocabulary than "
                            f"{Path(vocab_dir) / vocab.MODEL_FILE}: encode the text with it "
                            f"(python -m pipeline encode --vocab-dir {vocab_dir} ...)")


def load_ids(directory: str | Path, split: str, lang: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, offsets) of one encoded split and language, memory-mapped."""
    prefix = split_path(directory, split, lang)
    paths = [prefix.with_name(f"{prefix.name}.{s}.npy") for s in ("ids", "offsets")]
    for p in paths:
        if not p.is_file():
            raise PipelineError(f"{p}: not found (has the encode stage run?)")
    return np.load(paths[0], mmap_mode="r"), np.load(paths[1], mmap_mode="r")


class ParallelIds:
    """One encoded split as pairs of id arrays, read lazily from the memory-mapped files."""

    def __init__(self, directory: str | Path, split: str) -> None:
        src_lang, tgt_lang = read_manifest(directory)
        self.src_ids, self.src_offsets = load_ids(directory, split, src_lang)
        self.tgt_ids, self.tgt_offsets = load_ids(directory, split, tgt_lang)
        if len(self.src_offsets) != len(self.tgt_offsets):
            raise PipelineError(f"{directory}: {split} has {len(self.src_offsets) - 1} source sentences "
                                f"but {len(self.tgt_offsets) - 1} target sentences")
        self.src_lengths = np.diff(self.src_offsets)
        self.tgt_lengths = np.diff(self.tgt_offsets)

    def __len__(self) -> int:
        return len(self.src_lengths)

    def src(self, i: int) -> np.ndarray:
        return self.src_ids[self.src_offsets[i] : self.src_offsets[i + 1]]

    def tgt(self, i: int) -> np.ndarray:
        return self.tgt_ids[self.tgt_offsets[i] : self.tgt_offsets[i + 1]]
