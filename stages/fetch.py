"""Fetching archives users can trust over a slow or broken link, and unpacking them safely.

A download goes to `<name>.part`, resumes with an HTTP Range request after an interruption (and
starts over when a server ignores Range), retries with backoff, tries each mirror in order, shows
a progress bar with rate and ETA, checks free disk space first, and is renamed to its final name
only after its checksum matches. An archive already on disk is checked by size on every run and
by hash once (the verified hash is recorded beside it), so a file truncated by a killed run is
never used. Extraction refuses members that would land outside the target directory.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import tarfile
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO


from stages.io import PipelineError
from stages.progress import Bar

BLOCK = 1 << 20


@dataclass(frozen=True)
class Archive:
    """One file to fetch: where it is published, how big it is and what its hash must be."""

    url: str  # the official address
    size: int | None  # bytes, where published
    hash_name: str  # "sha256" or "md5"
    digest: str
    gunzipped: bool = False  # the digest is of the gunzipped content, not of the bytes served

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    def urls(self, mirrors: tuple[str, ...]) -> list[str]:
        """Each mirror (a base address standing in for the official host) in order, then the official address."""
        path = self.url.split("://", 1)[1].split("/", 1)[1]
        return [f"{m.rstrip('/')}/{path}" for m in mirrors] + [self.url]


def file_hash(path: Path, hash_name: str, gunzipped: bool = False) -> str:
    """The file's digest (of its gunzipped content with `gunzipped`; a damaged gzip stream gives
    a description of the damage, which matches no digest)."""
    h = hashlib.new(hash_name)
    try:
        with gzip.open(path, "rb") if gunzipped else open(path, "rb") as f:
            for block in iter(lambda: f.read(BLOCK), b""):
                h.update(block)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        return f"(not a whole gzip stream: {e})"
    return h.hexdigest()


def _verified_record(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def is_verified(path: Path, archive: Archive) -> bool:
    """An archive on disk is usable when its size is right (checked every time) and its hash was
    checked once for exactly this size and modification time."""
    if not path.is_file():
        return False
    stat = path.stat()
    if archive.size is not None and stat.st_size != archive.size:
        return False
    record = _verified_record(path)
    if record.is_file():
        try:
            seen = json.loads(record.read_text())
            if seen == {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, archive.hash_name: archive.digest}:
                return True
        except ValueError:
            pass
    if file_hash(path, archive.hash_name, archive.gunzipped) != archive.digest:
        return False
    record.write_text(json.dumps({"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                  archive.hash_name: archive.digest}))
    return True


def fetch(archive: Archive, directory: Path, mirrors: tuple[str, ...] = (), *, retries: int = 3,
          backoff: float = 1.0, timeout: float = 60.0) -> Path:
    """The verified archive in `directory`, downloaded (or resumed) if it is not there already."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / archive.name
    if is_verified(final, archive):
        return final
    if final.exists():
        print(f"{final}: size or checksum wrong; fetching it again")
        final.unlink()
        _verified_record(final).unlink(missing_ok=True)
    part = final.with_name(final.name + ".part")
    if archive.size is not None:
        have = part.stat().st_size if part.exists() else 0
        free = shutil.disk_usage(directory).free
        if free < archive.size - have:
            raise PipelineError(f"{directory}: {free / 1e9:.1f} GB free, {archive.name} needs "
                                f"{(archive.size - have) / 1e9:.1f} GB more")
    failures = []
    for url in archive.urls(mirrors):
        try:
            _download(url, part, archive.size, retries=retries, backoff=backoff, timeout=timeout)
        except (OSError, urllib.error.URLError) as e:
            failures.append(f"{url}: {e}")
            continue
        actual = file_hash(part, archive.hash_name, archive.gunzipped)
        if actual == archive.digest:
            part.replace(final)
            is_verified(final, archive)  # records the verified hash
            return final
        failures.append(f"{url}: {archive.hash_name} {actual}, expected {archive.digest}")
        part.unlink()
    part.unlink(missing_ok=True)
    raise PipelineError(f"could not fetch a valid {archive.name}:\n  " + "\n  ".join(failures))


def _download(url: str, part: Path, size: int | None, *, retries: int, backoff: float, timeout: float) -> None:
    """Fill `part` from `url`, resuming what is there; network errors are retried with backoff."""
    for attempt in range(retries + 1):
        try:
            _transfer(url, part, size, timeout)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError, _ShortRead) as e:
            if isinstance(e, urllib.error.HTTPError) and e.code < 500 and e.code != 416:
                raise  # 404 and the like: this mirror does not have it
            if attempt == retries:
                raise OSError(f"gave up after {retries + 1} attempts: {e}") from None
            wait = backoff * 2**attempt
            print(f"{url}: {e}; retrying in {wait:.0f}s")
            time.sleep(wait)


class _ShortRead(Exception):
    pass


def _transfer(url: str, part: Path, size: int | None, timeout: float) -> None:
    have = part.stat().st_size if part.exists() else 0
    if size is not None and have > size:
        part.unlink()  # longer than the archive: not a prefix of it
        have = 0
    if size is not None and have == size:
        return
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)  # noqa: S310 - http(s) addresses from params
    except urllib.error.HTTPError as e:
        if e.code == 416:  # nothing left to send from there: start over
            part.unlink(missing_ok=True)
        raise
    with response:
        if have and response.status != 206:
            have = 0  # the server ignored Range and sends the whole file: start over
        total = size or (int(response.headers.get("Content-Length", 0)) + have) or None
        with open(part, "ab" if have else "wb") as out, Bar(total=total, initial=have, unit="B", unit_scale=True,
                                                            desc=part.name[:-5], mininterval=2) as bar:
            for block in iter(lambda: response.read(BLOCK), b""):
                out.write(block)
                bar.update(len(block))
    got = part.stat().st_size
    if total is not None and got < total:
        raise _ShortRead(f"connection closed at {got} of {total} bytes")


def safe_members(tar: tarfile.TarFile, target: Path) -> Iterator[tarfile.TarInfo]:
    """Every member, refusing any whose path or link would leave `target`."""
    root = target.resolve()
    for member in tar:
        dest = (root / member.name).resolve()
        if member.name.startswith("/") or not dest.is_relative_to(root):
            raise PipelineError(f"{tar.name}: member {member.name!r} would be written outside {target}; refused")
        if member.issym() or member.islnk():
            link = (dest.parent / member.linkname).resolve() if member.issym() else (root / member.linkname).resolve()
            if not link.is_relative_to(root):
                raise PipelineError(f"{tar.name}: link {member.name!r} points outside {target} "
                                    f"({member.linkname!r}); refused")
        yield member


def extract(archive: Path, target: Path, wanted: set[str]) -> dict[str, Path]:
    """Extract the members named in `wanted` (all are required) into `target`, safely."""
    found: dict[str, Path] = {}
    with tarfile.open(archive) as tar:
        for member in safe_members(tar, target):
            if member.name in wanted and member.isfile():
                tar.extract(member, target, filter="data")
                found[member.name] = target / member.name
    missing = wanted - set(found)
    if missing:
        raise PipelineError(f"{archive}: expected members missing: {', '.join(sorted(missing))}")
    return found


def open_member(path: Path) -> IO[bytes]:
    """An extracted file, gunzipped on the fly when it is compressed (giga-fren ships .gz files)."""
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")
