"""The real text the tests and benches read: WMT14 test sets and training samples, and Multi30k, in the
layout of `../shared/data` (the folder CI keeps beside the checkout).

Where that folder is not there, `make test-data` fetches the same files from the public repositories
they come from, each pinned to a commit and checked by the sha256 of the file the tests read, with the
download stage's own code (resumed after a cut, retried, a bar with rate and ETA). The WMT14 files are
listed in `corpora/shared-data.tsv`; Multi30k's are the download stage's (`stages/multi30k.py`). A text
twin of an SGML test set is made here from its <seg> elements, as the shared folder's were.

    python -m corpora.shared --out .test-data     # what `make test-data` runs
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path


from stages import multi30k
from stages.fetch import Archive, fetch, open_member
from stages.io import PipelineError, atomic_write
from stages.progress import Bar
from stages.wmt14 import sgml_segments

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = Path(__file__).with_name("shared-data.tsv")
BESIDE = ROOT.parent / "shared" / "data"  # where CI keeps it
FETCHED = ROOT / ".test-data"  # where `make test-data` puts it
RAW = "https://raw.githubusercontent.com"  # a repository's file at a commit: RAW/owner/name/commit/path


def location() -> Path:
    """SHARED_DATA where set; else ../shared/data where it exists; else the checkout's .test-data."""
    if path := os.environ.get("SHARED_DATA"):
        return Path(path)
    return BESIDE if BESIDE.is_dir() else FETCHED


@dataclass(frozen=True)
class File:
    """One file of the layout: fetched (`source`), or the <seg> text of the layout's SGML file `segments_of`."""

    path: str
    sha256: str
    source: Archive | None = None
    segments_of: str | None = None


def _parse(line: str, number: int) -> File:
    fields = line.split("\t")
    if len(fields) != 3:
        raise PipelineError(f"{MANIFEST}:{number}: expected path, sha256 and source separated by tabs")
    path, sha256, source = fields
    if source.startswith("segments:"):
        return File(path, sha256, segments_of=source.removeprefix("segments:"))
    if source.startswith("github:"):  # github:owner/name@commit:path
        repo, _, rest = source.removeprefix("github:").partition("@")
        commit, _, inside = rest.partition(":")
        if len(commit) == 40 and inside:
            url = f"{RAW}/{repo}/{commit}/{inside}"
            return File(path, sha256, Archive(url, None, "sha256", sha256, gunzipped=inside.endswith(".gz")))
    raise PipelineError(f"{MANIFEST}:{number}: source {source!r} is neither github:OWNER/NAME@COMMIT:PATH nor "
                        "segments:PATH")


def files() -> list[File]:
    """Every file of the layout: the manifest's, then Multi30k's nine."""
    listed = [_parse(line, number) for number, line in enumerate(MANIFEST.read_text("utf-8").splitlines(), 1)
              if line.strip() and not line.startswith("#")]
    for split, stem in multi30k.FILES.items():
        for lang in multi30k.LANGUAGES:
            archive = multi30k.archive(split, lang)
            listed.append(File(f"multi30k/{stem}.{lang}", archive.digest, archive))
    return listed


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _make(file: File, out: Path, mirrors: tuple[str, ...]) -> None:
    """Write `file` into `out`, atomically, from its download (then removed) or its SGML file."""
    target = out / file.path
    if file.source is not None:
        downloads = out / ".downloads" / file.path  # a folder per file: sources share base names
        got = fetch(file.source, downloads, mirrors)  # resumes, retries, and checks the sha256 of the text
        with open_member(got) as src, atomic_write(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
        shutil.rmtree(downloads)
    else:
        with atomic_write(target) as dst:
            dst.writelines(f"{segment}\n" for segment in sgml_segments(out / file.segments_of, decode=False))
    if (actual := sha256(target)) != file.sha256:
        target.unlink()
        raise PipelineError(f"{target}: sha256 {actual}, expected {file.sha256}; removed")


def fetch_all(out: Path, mirrors: tuple[str, ...] = ()) -> dict[str, int]:
    """Fetch whatever of the layout `out` lacks (a file present with the right sha256 is kept).
    A failure names the file; the files done stay, so running again goes on from there."""
    todo = [f for f in files() if not ((out / f.path).is_file() and sha256(out / f.path) == f.sha256)]
    ordered = [f for f in todo if f.source is not None] + [f for f in todo if f.source is None]  # SGML first
    for file in Bar(ordered, desc="test data", unit=" files", mininterval=2):
        try:
            _make(file, out, mirrors)
        except PipelineError as e:
            raise PipelineError(f"{file.path}: {e}") from None
    shutil.rmtree(out / ".downloads", ignore_errors=True)
    return {"fetched": len(ordered), "present": len(files()) - len(ordered)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m corpora.shared", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=location(), help="the folder (default: where the tests look)")
    parser.add_argument("--mirror", action="append", default=[], metavar="URL",
                        help="a base address standing in for raw.githubusercontent.com, tried first")
    args = parser.parse_args(argv)
    try:
        counts = fetch_all(args.out, tuple(args.mirror))
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.out}: {counts['fetched']} files fetched, {counts['present']} already there and checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
