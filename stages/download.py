"""Stage 1, download: gather the train, dev and test parallel text into one directory.

Source `local` reads a directory of parallel files the user already has (their own data, or no
network). Output: <out>/{train,dev,test}.{src_lang,tgt_lang} and a manifest with the counts.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from stages.io import ParallelFiles, PipelineError, atomic_write, read_parallel, split_path, write_manifest


@dataclass(frozen=True)
class DownloadParams:
    source: Literal["local"]
    src_lang: str
    tgt_lang: str
    local_dir: str  # the directory the files below are relative to
    train: tuple[ParallelFiles, ...]  # concatenated in this order
    dev: ParallelFiles
    test: ParallelFiles


def run(params: DownloadParams, *, out_dir: str | Path) -> dict[str, int]:
    root = Path(params.local_dir)
    if not root.is_dir():
        raise PipelineError(f"download.local_dir: {root} is not a directory")
    if params.src_lang == params.tgt_lang:
        raise PipelineError(f"download: src_lang and tgt_lang are both '{params.src_lang}'")
    corpora = {"train": params.train, "dev": (params.dev,), "test": (params.test,)}
    # Check every file pair before writing anything, so a bad one costs no partial output.
    for files in corpora.values():
        for pair in files:
            next(read_parallel(root / pair.src, root / pair.tgt), None)
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    counts: dict[str, int] = {}
    for split, files in corpora.items():
        n = 0
        with atomic_write(split_path(out_dir, split, params.src_lang)) as fs, \
                atomic_write(split_path(out_dir, split, params.tgt_lang)) as ft:
            for pair in files:
                for s, t in tqdm(read_parallel(root / pair.src, root / pair.tgt), desc=f"download {split}",
                                 unit=" pairs", mininterval=2):
                    fs.write(s + "\n")
                    ft.write(t + "\n")
                    n += 1
        counts[split] = n
    write_manifest(out_dir, params.src_lang, params.tgt_lang, counts)
    return {f"{split}_pairs": n for split, n in counts.items()}
