"""The real WMT14 download code against a loopback HTTP server (127.0.0.1 only) serving archives
built at test time from ../shared/data in the official layouts."""
import gzip
import hashlib
import html
import io
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from corpora import shared as corpora_shared
from stages import download, multi30k, wmt14
from stages.params import DownloadParams, LocalSource, Multi30kSource, Wmt14Source
from stages.fetch import Archive, extract, fetch, is_verified
from stages.io import ParallelFiles, PipelineError, read_lines


class Server:
    """Serves files from a dict path -> bytes on 127.0.0.1, honouring Range unless told not to,
    and able to cut a transfer halfway or serve corrupted bytes."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.ignore_range = False
        self.cut_once: set[str] = set()  # paths whose next transfer stops at half
        self.corrupt: set[str] = set()
        self.requests: list[tuple[str, str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                server.requests.append((self.path, self.headers.get("Range")))
                data = server.files.get(self.path)
                if data is None:
                    self.send_error(404)
                    return
                if self.path in server.corrupt:
                    data = data[:100] + bytes([data[100] ^ 0xFF]) + data[101:]
                start = 0
                if (rng := self.headers.get("Range")) and not server.ignore_range:
                    start = int(rng.split("=")[1].split("-")[0])
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.path in server.cut_once:
                    server.cut_once.discard(self.path)
                    self.wfile.write(body[: len(data) // 2 - start])
                    self.wfile.flush()
                    self.connection.shutdown(2)  # the link drops halfway
                    return
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def archive(self, path: str, data: bytes, hash_name: str = "sha256") -> Archive:
        """Publish `data` at `path`; its official address is this server too, never the internet."""
        self.files[path] = data
        return Archive(self.base + path, len(data), hash_name, hashlib.new(hash_name, data).hexdigest())


@pytest.fixture
def server():
    s = Server()
    yield s
    s.httpd.shutdown()


def tgz(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture(scope="module")
def nc_archive(shared) -> bytes:
    sample = shared / "wmt14/train-sample/uedin-toy"
    return tgz({f"training/news-commentary-v9.de-en.{lang}": (sample / f"news-commentary.first10k.{lang}").read_bytes()
                for lang in ("en", "de")})


def test_a_transfer_cut_at_half_resumes_and_verifies(server, nc_archive, tmp_path):
    archive = server.archive("/wmt14/training-parallel-nc-v9.tgz", nc_archive)
    server.cut_once.add("/wmt14/training-parallel-nc-v9.tgz")
    path = fetch(archive, tmp_path, retries=2, backoff=0.01)
    assert path.read_bytes() == nc_archive
    ranges = [r for p, r in server.requests]
    assert ranges[0] is None and ranges[1] == f"bytes={len(nc_archive) // 2}-"  # resumed where it stopped
    assert not (tmp_path / (path.name + ".part")).exists()


def test_a_server_that_ignores_range_is_handled(server, nc_archive, tmp_path):
    archive = server.archive("/wmt14/training-parallel-nc-v9.tgz", nc_archive)
    server.cut_once.add("/wmt14/training-parallel-nc-v9.tgz")
    server.ignore_range = True
    assert fetch(archive, tmp_path, retries=2, backoff=0.01).read_bytes() == nc_archive


def test_a_corrupted_archive_is_caught_on_every_run(server, nc_archive, tmp_path):
    archive = server.archive("/wmt14/training-parallel-nc-v9.tgz", nc_archive)
    path = fetch(archive, tmp_path)
    assert is_verified(path, archive)
    corrupted = bytearray(path.read_bytes())
    corrupted[-10] ^= 0xFF  # same size, wrong content (the recorded hash no longer matches its mtime)
    path.write_bytes(bytes(corrupted))
    assert not is_verified(path, archive)
    path.write_bytes(nc_archive[:1000])  # truncated, as a killed run leaves it
    assert not is_verified(path, archive)
    assert fetch(archive, tmp_path).read_bytes() == nc_archive  # fetched again


def test_a_checksum_mismatch_on_every_mirror_is_an_error_with_url_and_hashes(server, nc_archive, tmp_path):
    archive = server.archive("/wmt14/training-parallel-nc-v9.tgz", nc_archive)
    server.corrupt.add("/wmt14/training-parallel-nc-v9.tgz")
    with pytest.raises(PipelineError, match=rf"{server.base}/wmt14/training-parallel-nc-v9.tgz: sha256 [0-9a-f]{{64}}, "
                                            rf"expected {archive.digest}"):
        fetch(archive, tmp_path)
    assert list(tmp_path.iterdir()) == []  # no partial file left behind


def test_mirrors_are_tried_in_order(server, nc_archive, tmp_path):
    archive = server.archive("/wmt14/training-parallel-nc-v9.tgz", nc_archive)
    server.files["/good/wmt14/training-parallel-nc-v9.tgz"] = nc_archive
    mirrors = (f"{server.base}/missing", f"{server.base}/good")
    assert fetch(archive, tmp_path, mirrors).read_bytes() == nc_archive
    assert [p for p, _ in server.requests] == ["/missing/wmt14/training-parallel-nc-v9.tgz",
                                               "/good/wmt14/training-parallel-nc-v9.tgz"]


def test_members_escaping_the_target_are_refused(tmp_path):
    for name in ("../evil.txt", "/etc/evil.txt", "training/../../evil.txt"):
        path = tmp_path / "bad.tgz"
        path.write_bytes(tgz({"fine.txt": b"ok", name: b"boo"}))
        with pytest.raises(PipelineError, match="would be written outside"):
            extract(path, tmp_path / "out", {"fine.txt"})
        assert not (tmp_path / "evil.txt").exists()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        link = tarfile.TarInfo("innocent")
        link.type, link.linkname = tarfile.SYMTYPE, "../../outside"
        tar.addfile(link)
    (tmp_path / "link.tgz").write_bytes(buffer.getvalue())
    with pytest.raises(PipelineError, match="link 'innocent' points outside"):
        extract(tmp_path / "link.tgz", tmp_path / "out", {"innocent"})


@pytest.mark.parametrize(("folder", "stem", "lines"), [
    ("newstest2014-full", "newstest2014-deen-src.en", 3003), ("newstest2014-full", "newstest2014-deen-ref.de", 3003),
    ("newstest2014-full", "newstest2014-fren-src.en", 3003), ("newstest2014-full", "newstest2014-fren-ref.fr", 3003),
    ("newstest2014-filtered", "newstest2014-deen-src.en", 2737),
    ("newstest2014-filtered", "newstest2014-deen-ref.de", 2737),
    ("newstest2014-filtered", "newstest2014-fren-ref.fr", 3003),
])
def test_newstest2014_sgml_parses_to_its_text_twin(shared, folder, stem, lines):
    segments = list(wmt14.sgml_segments(shared / f"wmt14/{folder}/sgm/{stem}.sgm"))
    assert len(segments) == lines
    assert segments == list(read_lines(shared / f"wmt14/{folder}/{stem}.txt"))


def _text_twin(sgm: Path) -> Path:
    folder, stem = sgm.parent.parent, sgm.name.rsplit(".", 1)[0]
    if folder.name == "newstest2013":  # newstest2013-src.en.sgm -> newstest2013.en
        return folder / f"newstest2013.{stem.rsplit('.', 1)[1]}"
    return folder / f"{stem}.txt"


def test_every_sgml_test_set_in_shared_parses_to_its_text_twin(shared):
    """Text twins keep entities as written (newstest2009-ref.de.xml has one, '&amp;'); we decode them."""
    sgms = sorted((shared / "wmt14").rglob("sgm/*"))
    assert len(sgms) >= 30
    decoded = 0
    for sgm in sgms:
        twin = list(read_lines(_text_twin(sgm)))
        expected = [html.unescape(line) if "&amp;" in line else line for line in twin]
        decoded += expected != twin
        assert list(wmt14.sgml_segments(sgm)) == expected, sgm
    assert decoded == 1


def test_the_download_stage_fetches_wmt14_in_the_official_layout(server, shared, tmp_path, monkeypatch):
    """Training archive, dev archive and SGML test archive, end to end through the stage."""
    sample = shared / "wmt14/train-sample/uedin-toy"
    train = server.archive("/wmt13/training-parallel-europarl-v7.tgz", tgz(
        {f"training/europarl-v7.de-en.{lang}": (sample / f"europarl-v7.first10k.{lang}").read_bytes()
         for lang in ("en", "de")}))
    dev = server.archive("/wmt19/translation-task/dev.tgz", tgz(
        {f"dev/newstest2013.{lang}": (shared / f"wmt14/newstest2013/newstest2013.{lang}").read_bytes()
         for lang in ("en", "de")}))
    sgm = shared / "wmt14/newstest2014-full/sgm"
    test = server.archive("/wmt14/test-full.tgz", tgz(
        {f"test-full/{name}": (sgm / name).read_bytes()
         for name in ("newstest2014-deen-src.en.sgm", "newstest2014-deen-ref.de.sgm")}), "md5")
    monkeypatch.setitem(wmt14.TRAINING_ARCHIVES, "europarl-v7", train)
    monkeypatch.setitem(wmt14.PUBLISHED_PAIRS, ("europarl-v7", "de"), 10_000)
    monkeypatch.setattr(wmt14, "DEV_ARCHIVE", dev)
    monkeypatch.setattr(wmt14, "test_set", lambda version, tgt: (
        test, ("test-full/newstest2014-deen-src.en.sgm", "test-full/newstest2014-deen-ref.de.sgm")))
    params = DownloadParams(source="wmt14", src_lang="en", tgt_lang="de",
                            wmt14=Wmt14Source(corpora=("europarl-v7",), test="full", mirrors=(),
                                              archive_dir=str(tmp_path / "archives")),
                            multi30k=Multi30kSource((), "."),
                            local=LocalSource(dir=".", train=(), dev=ParallelFiles("a", "b"),
                                              test=ParallelFiles("a", "b")))
    metrics = download.run(params, out_dir=tmp_path / "raw")
    assert (metrics["train_pairs"], metrics["dev_pairs"], metrics["test_pairs"]) == (10_000, 3000, 3003)
    assert metrics["train_corpora"] == {"europarl-v7": {"pairs": 10_000, "published": 10_000}}
    assert list(read_lines(tmp_path / "raw/test.de")) == \
        list(read_lines(shared / "wmt14/newstest2014-full/newstest2014-deen-ref.de.txt"))
    assert not list(tmp_path.glob(".download-*"))  # the extracted files are gone
    requests = len(server.requests)
    download.run(params, out_dir=tmp_path / "raw")  # a second run uses the verified archives on disk
    assert len(server.requests) == requests


def test_the_paper_test_set_comes_from_sacrebleus_catalogue():
    archive, (src, ref) = wmt14.test_set("full", "de")
    assert archive.url == "https://statmt.org/wmt14/test-full.tgz"
    assert archive.digest == "a8cd784e006feb32ac6f3d9ec7eb389a"
    assert (src, ref) == ("test-full/newstest2014-deen-src.en.sgm", "test-full/newstest2014-deen-ref.de.sgm")
    assert wmt14.test_set("filtered", "de")[0].digest == "84c597844c1542e29c2aff23aaee4310"


# -- Multi30k: gzipped files built at test time from ../shared/data/multi30k --------------------------------

@pytest.fixture
def multi30k_server(server, shared, monkeypatch):
    """The dataset's repository at `<server>/official`, its gzip files compressed here (so their bytes
    differ from upstream's: the checksums are of the text, and must still match)."""
    monkeypatch.setattr(multi30k, "BASE", f"{server.base}/official")
    for stem in multi30k.FILES.values():
        for lang in multi30k.LANGUAGES:
            text = (shared / f"multi30k/{stem}.{lang}").read_bytes()
            server.files[f"/official/{stem}.{lang}.gz"] = gzip.compress(text)
    return server


def multi30k_params(tmp_path: Path, src: str = "en", tgt: str = "de", mirrors: tuple[str, ...] = ()) -> DownloadParams:
    return DownloadParams(source="multi30k", src_lang=src, tgt_lang=tgt,
                          wmt14=Wmt14Source(("europarl-v7",), "full", (), "."),
                          multi30k=Multi30kSource(mirrors, str(tmp_path / "archives")),
                          local=LocalSource(".", (), ParallelFiles("a", "b"), ParallelFiles("a", "b")))


@pytest.mark.parametrize(("src", "tgt"), [("en", "de"), ("en", "fr")])
def test_the_download_stage_fetches_multi30k(multi30k_server, shared, tmp_path, src, tgt):
    metrics = download.run(multi30k_params(tmp_path, src, tgt), out_dir=tmp_path / "raw")
    assert (metrics["train_pairs"], metrics["dev_pairs"], metrics["test_pairs"]) == (29_000, 1_014, 1_000)
    for split, stem in (("train", "train"), ("dev", "val"), ("test", "test_2016_flickr")):
        for lang in (src, tgt):
            assert (tmp_path / f"raw/{split}.{lang}").read_bytes() == (shared / f"multi30k/{stem}.{lang}").read_bytes()
    assert sorted(p.name for p in (tmp_path / "archives").glob("*.gz")) == sorted(
        f"{stem}.{lang}.gz" for stem in multi30k.FILES.values() for lang in (src, tgt))
    requests = len(multi30k_server.requests)
    download.run(multi30k_params(tmp_path, src, tgt), out_dir=tmp_path / "raw")  # verified files on disk are used
    assert len(multi30k_server.requests) == requests


def test_a_multi30k_transfer_cut_at_half_resumes(multi30k_server, tmp_path):
    path = "/official/train.de.gz"
    multi30k_server.cut_once.add(path)
    download.run(multi30k_params(tmp_path), out_dir=tmp_path / "raw")
    ranges = [r for p, r in multi30k_server.requests if p == path]
    assert ranges == [None, f"bytes={len(multi30k_server.files[path]) // 2}-"]


def test_multi30k_text_with_a_wrong_checksum_is_refused_and_nothing_is_written(multi30k_server, shared, tmp_path):
    """A well-formed gzip of changed text (one caption edited) is caught after decompression, as is
    a damaged gzip stream."""
    text = (shared / "multi30k/val.de").read_bytes().replace(b"Ein ", b"Eine ", 1)
    multi30k_server.files["/official/val.de.gz"] = gzip.compress(text)
    multi30k_server.corrupt.add("/official/val.en.gz")
    with pytest.raises(PipelineError, match=r"val.en.gz: sha256 \(not a whole gzip stream: .*\), expected"):
        download.run(multi30k_params(tmp_path), out_dir=tmp_path / "raw")
    assert not (tmp_path / "raw").exists() and not list((tmp_path / "archives").glob("val.*"))
    multi30k_server.files["/official/val.en.gz"] = gzip.compress((shared / "multi30k/val.en").read_bytes())
    multi30k_server.corrupt.clear()
    with pytest.raises(PipelineError, match=rf"val.de.gz: sha256 {hashlib.sha256(text).hexdigest()}, expected "
                                            rf"{multi30k.TEXT_SHA256[('dev', 'de')]}"):
        download.run(multi30k_params(tmp_path), out_dir=tmp_path / "raw")


def test_multi30k_mirrors_are_tried_in_order_before_the_repository(multi30k_server, tmp_path):
    for path, data in list(multi30k_server.files.items()):
        multi30k_server.files["/good" + path] = data
    mirrors = (f"{multi30k_server.base}/missing", f"{multi30k_server.base}/good")
    download.run(multi30k_params(tmp_path, mirrors=mirrors), out_dir=tmp_path / "raw")
    first = [p for p, _ in multi30k_server.requests[:2]]
    assert first == ["/missing/official/train.en.gz", "/good/official/train.en.gz"]
    assert not any(p.startswith("/official/") for p, _ in multi30k_server.requests)


def test_multi30k_has_three_languages():
    with pytest.raises(ValueError, match="multi30k has en, de, fr, not cs"):
        multi30k_params(Path("."), "en", "cs")


# -- make test-data: the shared folder's files from their repositories, served here from ../shared/data ---------

@pytest.fixture
def repositories(server, shared, monkeypatch):
    """Every source file of the test data at its repository address on the loopback server (Multi30k's
    gzipped here); the official addresses point there, so nothing leaves 127.0.0.1."""
    monkeypatch.setattr(multi30k, "BASE", multi30k.BASE.replace(corpora_shared.RAW, f"{server.base}/raw"))
    monkeypatch.setattr(corpora_shared, "RAW", f"{server.base}/raw")
    for file in corpora_shared.files():
        if file.source is not None:
            text = (shared / file.path).read_bytes()
            path = file.source.url.removeprefix(server.base)
            server.files[path] = gzip.compress(text) if path.endswith(".gz") else text
    return server


def test_make_test_data_fetches_the_shared_layout_byte_for_byte(repositories, shared, tmp_path):
    out = tmp_path / "data"
    assert corpora_shared.fetch_all(out) == {"fetched": 94, "present": 0}
    made = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert made == sorted(f.path for f in corpora_shared.files())  # nothing left over: no .part, no downloads
    for path in made:
        assert (out / path).read_bytes() == (shared / path).read_bytes(), path
    requests = len(repositories.requests)
    assert corpora_shared.fetch_all(out) == {"fetched": 0, "present": 94}  # checked by hash, not fetched again
    assert len(repositories.requests) == requests


def test_make_test_data_names_a_file_that_fails_and_keeps_the_rest(repositories, tmp_path):
    out = tmp_path / "data"
    bad = next(f for f in corpora_shared.files() if f.path.endswith("newstest2014-deen-src.en.sgm"))
    repositories.corrupt.add(bad.source.url.removeprefix(repositories.base))
    with pytest.raises(PipelineError, match=rf"^{bad.path}: could not fetch a valid newstest2014-deen-src.en.sgm"):
        corpora_shared.fetch_all(out)
    assert not (out / bad.path).exists()
    done = [p for p in out.rglob("*") if p.is_file() and ".downloads" not in p.parts]
    assert done  # the files before it stay; the next run fetches only the rest
    repositories.corrupt.clear()
    assert corpora_shared.fetch_all(out)["present"] == len(done)


def test_the_test_data_manifest_refuses_a_bad_line(tmp_path, monkeypatch):
    manifest = tmp_path / "m.tsv"
    manifest.write_text("# a comment\nwmt14/x.txt\tabc\tgithub:owner/name@short:path\n")
    monkeypatch.setattr(corpora_shared, "MANIFEST", manifest)
    with pytest.raises(PipelineError, match=r"m.tsv:2: source 'github:owner/name@short:path' is neither"):
        corpora_shared.files()
