"""What every stage shares: clear errors, atomic writes, and reading parallel text safely."""
from __future__ import annotations

import codecs
import contextlib
import errno
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import IO, Annotated, Any, TypeVar

T = TypeVar("T")

# A stage's `run` names the paths it reads and writes with these annotations: its contract, from which
# the command line builds its flags and which dvc.yaml's deps and outs are checked against.
InputPath = Annotated[str | Path, "input"]
OutputPath = Annotated[str | Path, "output"]


class PipelineError(Exception):
    """A problem with the user's input or setup: its message is shown without a traceback."""


# sysexits.h's EX_TEMPFAIL: a stage asked to stop by a signal stopped cleanly with its work saved; run it
# again to go on from there (what a scheduler that requeues preempted jobs should do).
EXIT_STOPPED = 75


class Stopped(Exception):
    """A stage stopped on request (SIGTERM, SIGINT, SIGUSR1) after saving what it had done."""


# A write that failed for want of room (a full disk, a quota, a file-size limit): the user's to fix.
NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Write to a temporary file beside `path`, then rename: readers see the old file or the new, never
    half. Without room to write, the temporary file goes and a PipelineError names `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with open(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if isinstance(e, OSError) and e.errno in NO_ROOM:
            raise PipelineError(f"{path}: could not be written: {e.strerror}; what was there before is "
                                f"left as it was") from None
        raise


def check(ok: bool, key: str, message: str) -> None:
    """A check of a params class's value: ValueError(key, message), which the params loader reports at
    that key's line of params.yaml."""
    if not ok:
        raise ValueError(key, message)


def chunks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Consecutive lists of `size` items (the last may be shorter), so memory stays flat over a corpus."""
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk


def write_json(path: str | Path, data: Any) -> None:
    with atomic_write(path) as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def read_json(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"{path}: not found (has the stage that writes it run?)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:  # damaged, or not the file the stage wrote
        raise PipelineError(f"{path}:{e.lineno}: not valid JSON ({e.msg}): run the stage that writes it "
                            "again") from None
    except UnicodeDecodeError as e:
        raise PipelineError(f"{path}: not UTF-8 text (byte {e.start}): run the stage that writes it again") from None


def require_dir(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise PipelineError(f"{path}: {what} directory does not exist")
    return path


def count_lines(path: str | Path) -> int:
    n = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            n += block.count(b"\n")
        if f.tell() and not _ends_with_newline(f):
            n += 1  # a last line without its newline still counts
    return n


def _ends_with_newline(f: IO[bytes]) -> bool:
    f.seek(-1, os.SEEK_END)
    return f.read(1) == b"\n"


def read_lines(path: str | Path) -> Iterator[str]:
    """Lines of a UTF-8 file without their line ending; invalid UTF-8 names the file, line and byte offset."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"{path}: file not found")
    with open(path, "rb") as f:
        yield from decode_lines(f, str(path), "file")


def decode_lines(stream: IO[bytes], name: str, what: str = "input") -> Iterator[str]:
    """Lines of a UTF-8 stream (a file, standard input) without their line ending (LF or CRLF) and without
    the byte-order mark Windows editors put first, which marks the encoding and is no text (a reference
    line would keep it, and miss its n-grams); invalid UTF-8 names the stream, line and byte offset."""
    offset = 0
    for number, raw in enumerate(stream, start=1):
        start = len(codecs.BOM_UTF8) if number == 1 and raw.startswith(codecs.BOM_UTF8) else 0
        try:
            line = raw[start:].decode("utf-8")
        except UnicodeDecodeError as e:
            at = offset + start + e.start
            raise PipelineError(f"{name}:{number}: invalid UTF-8 at byte {at} of the {what} ({e.reason})") from None
        offset += len(raw)
        yield line.rstrip("\n").rstrip("\r")


@dataclass(frozen=True)
class ParallelFiles:
    """One parallel corpus: a source file and a target file, line by line translations."""

    src: str
    tgt: str


def count_pairs(src: str | Path, tgt: str | Path) -> int:
    """Pairs in a parallel corpus; missing files or files of different lengths are refused by name."""
    for path in (src, tgt):
        if not Path(path).is_file():
            raise PipelineError(f"{path}: file not found")
    n_src, n_tgt = count_lines(src), count_lines(tgt)
    if n_src != n_tgt:
        raise PipelineError(f"parallel files differ in length: {src} has {n_src} lines, {tgt} has {n_tgt}")
    return n_src


def split_path(directory: str | Path, split: str, lang: str) -> Path:
    """Where a split of one language lives inside a stage's text directory: <dir>/<split>.<lang>."""
    return Path(directory) / f"{split}.{lang}"


def file_digest(*paths: str | Path) -> str:
    """md5 of the files' contents in turn; a directory's files in name order, with their names (as DVC
    fingerprints its inputs)."""
    h = hashlib.md5()
    for path in map(Path, paths):
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for p in files:
            if path.is_dir():
                h.update(str(p.relative_to(path)).encode())
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


SPLITS = ("train", "dev", "test")
MANIFEST = "manifest.json"


def write_manifest(directory: str | Path, src_lang: str, tgt_lang: str, counts: dict[str, int],
                   corpora: dict[str, int] | None = None, vocab: str | None = None) -> None:
    """Each text directory says which languages and how many pairs per split it holds, and which
    training corpora (in order, with their pair counts) make up its training split; encoded ids say
    which vocabulary (its identity) made them."""
    write_json(Path(directory) / MANIFEST, {"src_lang": src_lang, "tgt_lang": tgt_lang, "pairs": counts,
                                            "train_corpora": corpora or {"train": counts["train"]},
                                            **({"vocab": vocab} if vocab is not None else {})})


def read_manifest(directory: str | Path) -> tuple[str, str]:
    """(source language, target language) of a text directory written by download or clean."""
    data = read_json(Path(directory) / MANIFEST)
    return data["src_lang"], data["tgt_lang"]


def read_train_corpora(directory: str | Path) -> dict[str, int]:
    """The training corpora of a text directory, in order, with their pair counts."""
    return read_json(Path(directory) / MANIFEST)["train_corpora"]
