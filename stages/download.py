"""Stage 1, download: gather the train, dev and test parallel text into one directory.

Source `wmt14` fetches the official archives (verified, resumable, from mirrors in order), extracts
the paper's corpora safely and parses the SGML test set. Source `multi30k` fetches Multi30k task 1
through the same fetcher (a small real benchmark). Source `local` reads parallel files the user
already has (their own data, or no network). Output: <out>/{train,dev,test}.{src,tgt} and a
manifest with the languages, the training corpora in order and every count.
"""
from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


from stages import multi30k, wmt14
from stages.fetch import extract, fetch, open_member
from stages.io import OutputPath, PipelineError, atomic_write, count_pairs, file_digest, \
    split_path, write_manifest
from stages.params import DownloadParams, LocalSource
from stages.progress import Bar


@dataclass(frozen=True)
class Corpus:
    """One parallel corpus to copy into the output: a name and its two files."""

    name: str
    src: Path
    tgt: Path
    expected: int | None = None  # published pair count, where there is one


def run(params: DownloadParams, *, out_dir: OutputPath) -> dict[str, object]:
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=out_dir.parent) as tmp:  # beside the output: same disk
        if params.source == "wmt14":
            splits = _wmt14(params, Path(tmp))
        elif params.source == "multi30k":
            splits = _multi30k(params, Path(tmp))
        else:
            splits = _local(params.local)
        # Check every pair of files before writing anything, so a bad one costs no partial output.
        counts = {c.name: count_pairs(c.src, c.tgt) for corpora in splits.values() for c in corpora}
        for split, (corpus,) in ((s, c) for s, c in splits.items() if s != "train"):
            if corpus.expected is not None and counts[corpus.name] != corpus.expected:
                raise PipelineError(f"{corpus.src}: {counts[corpus.name]} {split} pairs, expected {corpus.expected}")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        for split, corpora in splits.items():
            _concatenate(corpora, out_dir, split, params.src_lang, params.tgt_lang)
    train = splits["train"]
    write_manifest(out_dir, params.src_lang, params.tgt_lang,
                   {split: sum(counts[c.name] for c in corpora) for split, corpora in splits.items()},
                   corpora={c.name: counts[c.name] for c in train})
    metrics: dict[str, object] = {f"{split}_pairs": sum(counts[c.name] for c in cs) for split, cs in splits.items()}
    metrics["train_corpora"] = {c.name: {"pairs": counts[c.name], "published": c.expected} for c in train}
    mismatched = [c.name for c in train if c.expected is not None and counts[c.name] != c.expected]
    for name in mismatched:
        print(f"warning: {name} has {counts[name]} pairs; {dict((c.name, c.expected) for c in train)[name]} published")
    return metrics


def source_digest(params: DownloadParams) -> str:
    """md5 identifying what the stage reads: the local files' contents, or the WMT14 archives'
    published checksums (which pin their contents without reading gigabytes)."""
    h = hashlib.md5()
    if params.source == "local":
        root = Path(params.local.dir)
        for f in (*params.local.train, params.local.dev, params.local.test):
            for name in (f.src, f.tgt):
                h.update(file_digest(root / name).encode() if (root / name).is_file() else b"missing")
    elif params.source == "multi30k":
        for split in multi30k.FILES:
            for lang in (params.src_lang, params.tgt_lang):
                h.update(multi30k.archive(split, lang).digest.encode())
    else:
        archives = [wmt14.TRAINING_ARCHIVES[c] for c in params.wmt14.corpora]
        for archive in (*archives, wmt14.DEV_ARCHIVE, wmt14.test_set(params.wmt14.test, params.tgt_lang)[0]):
            h.update(archive.digest.encode())
    return h.hexdigest()


def _concatenate(corpora: list[Corpus], out_dir: Path, split: str, src_lang: str, tgt_lang: str) -> None:
    """Copy the corpora's bytes as they are (cleaning decodes and normalises), one after another."""
    for lang, side in ((src_lang, "src"), (tgt_lang, "tgt")):
        with atomic_write(split_path(out_dir, split, lang), "wb") as out:
            for corpus in corpora:
                with open(getattr(corpus, side), "rb") as f:
                    for line in Bar(f, desc=f"{split} {corpus.name}.{lang}", unit=" lines", mininterval=2,
                                    total=corpus.expected):
                        out.write(line if line.endswith(b"\n") else line + b"\n")


def _local(p: LocalSource) -> dict[str, list[Corpus]]:
    root = Path(p.dir)
    if not root.is_dir():
        raise PipelineError(f"download.local.dir: {root} is not a directory")
    as_corpus = lambda f: Corpus(Path(f.src).name.rsplit(".", 1)[0], root / f.src, root / f.tgt)  # noqa: E731
    train = [as_corpus(f) for f in p.train]
    names = [c.name for c in train]
    if len(set(names)) != len(names):
        train = [Corpus(f"{c.name}#{i}", c.src, c.tgt) for i, c in enumerate(train)]
    return {"train": train, "dev": [Corpus("dev", root / p.dev.src, root / p.dev.tgt)],
            "test": [Corpus("test", root / p.test.src, root / p.test.tgt)]}


def _wmt14(params: DownloadParams, tmp: Path) -> dict[str, list[Corpus]]:
    p, tgt = params.wmt14, params.tgt_lang
    archives = Path(p.archive_dir)
    train = []
    for name in p.corpora:
        members = wmt14.training_members(name, tgt)
        found = extract(fetch(wmt14.TRAINING_ARCHIVES[name], archives, p.mirrors), tmp / name, set(members))
        src, ref = (_decompressed(found[m], tmp / name) for m in members)
        train.append(Corpus(name, src, ref, wmt14.PUBLISHED_PAIRS.get((name, tgt))))
    members = wmt14.dev_members(tgt)
    found = extract(fetch(wmt14.DEV_ARCHIVE, archives, p.mirrors), tmp / "dev", set(members))
    dev = Corpus("newstest2013", found[members[0]], found[members[1]], wmt14.DEV_PAIRS)
    archive, members = wmt14.test_set(p.test, tgt)
    found = extract(fetch(archive, archives, p.mirrors), tmp / "test", set(members))
    test_files = []
    for member in members:
        text = tmp / "test" / (member + ".txt")
        with atomic_write(text) as f:
            f.writelines(segment + "\n" for segment in wmt14.sgml_segments(found[member]))
        test_files.append(text)
    test = Corpus(f"newstest2014-{p.test}", *test_files, wmt14.TEST_PAIRS[(p.test, tgt)])
    return {"train": train, "dev": [dev], "test": [test]}


def _multi30k(params: DownloadParams, tmp: Path) -> dict[str, list[Corpus]]:
    archives, mirrors = Path(params.multi30k.archive_dir), params.multi30k.mirrors
    splits = {}
    for split, stem in multi30k.FILES.items():
        src, tgt = (_decompressed(fetch(multi30k.archive(split, lang), archives, mirrors), tmp, keep=True)
                    for lang in (params.src_lang, params.tgt_lang))
        splits[split] = [Corpus(f"multi30k-{stem}", src, tgt, multi30k.PAIRS[split])]
    return splits


def _decompressed(path: Path, directory: Path, keep: bool = False) -> Path:
    """The gunzipped copy of `path` in `directory` (`path` itself when not compressed), the
    compressed file removed unless kept (a verified download is kept for the next run)."""
    if path.suffix != ".gz":
        return path
    out = directory / path.name[:-3]
    with open_member(path) as f, open(out, "wb") as o:
        shutil.copyfileobj(f, o, 1 << 20)
    if not keep:
        path.unlink()
    return out

