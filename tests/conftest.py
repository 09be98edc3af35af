"""Shared fixtures: the real WMT14 data beside the checkout, a tracking store per test, and the
stages chained as the DAG chains them (download -> clean -> vocab -> encode -> train -> average) on
real text, each run once per session in a temporary directory."""
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.common import SHARED, clone
from stages import average, clean, download, encode, train, vocab
from stages.io import ParallelFiles
from stages.model_files import current_dir
from stages.params import DownloadParams, LocalSource, Multi30kSource, Wmt14Source
from transformer.config import TransformerConfig
from transformer.model import Transformer

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
if device := os.environ.get("TEST_DEVICE"):  # TEST_DEVICE=cuda: models and tensors made in tests go to that device
    torch.set_default_device(device)

TRAIN_LINES = 3000  # of each shared training sample, to keep the suite fast
CLEAN = clean.CleanParams(max_tokens=80, max_chars=1000, max_ratio=1.5, keep_copies=False, drop_duplicates=True,
                          normalize_punctuation=True, unicode_form="NFC", invalid_utf8="error", workers=2)
TINY = TransformerConfig(d_model=32, n_heads=4, d_ff=64, encoder_layers=1, decoder_layers=1, dropout=0.1,
                         attention_dropout=0.0, norm="post", positions="sinusoidal", max_positions=512)


PAD, BOS, EOS = 0, 2, 3  # the vocabulary's ids (stages/vocab.py)


def tiny_model(seed: int = 0, norm: str = "post", positions: str = "sinusoidal") -> Transformer:
    """A model of 23 tokens, small and opinionated, so different inputs give clearly different outputs."""
    torch.manual_seed(seed)
    config = TransformerConfig(d_model=32, n_heads=4, d_ff=64, encoder_layers=2, decoder_layers=2, dropout=0.0,
                               attention_dropout=0.0, norm=norm, positions=positions, max_positions=64)
    model = Transformer(config, vocab_size=23, pad_id=PAD).eval()
    with torch.no_grad():
        model.embed.weight.mul_(4)
    return model


def without_key_biases(name: str, weight: torch.Tensor) -> torch.Tensor:
    """A model weight with attention's key biases left out (d_k = d_v), as runs on other topologies are
    compared: their gradient is 0 (softmax ignores a shift common to all keys), so they hold rounding
    noise that Adam scales up to full-size steps."""
    if name.endswith("qkv_proj.bias"):
        q, _, v = weight.chunk(3)
        return torch.cat([q, v])
    return weight.chunk(2)[1] if name.endswith("kv_proj.bias") else weight


def separate_projections(state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """A model's weights as files from before attention's products were stacked hold them: q_proj,
    k_proj and v_proj apart."""
    d_k, d_v = config.head_dims
    sizes = {"qkv": (config.n_heads * d_k, config.n_heads * d_k, config.n_heads * d_v),
             "kv": (config.n_heads * d_k, config.n_heads * d_v)}
    separate = {}
    for name, weight in state.items():
        stacked = name.rsplit(".", 2)[-2]
        if stacked in ("qkv_proj", "kv_proj"):
            parts = stacked.removesuffix("_proj")
            for part, value in zip(parts, weight.split(sizes[parts]), strict=True):
                separate[name.replace(stacked, f"{part}_proj")] = value
        else:
            separate[name] = weight
    return separate


def wait_for(condition, timeout: float, what: str):
    """Poll `condition` until it gives something true (returned), or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def another_vocabulary(clean_dir: Path, vocab_dir: Path, out_dir: Path) -> Path:
    """A vocabulary of as many pieces as `vocab_dir`'s, from the same text, but unigram: the same size,
    other ids (as another corpus's, or the other language pair's, would be)."""
    size = vocab.load(vocab_dir).get_piece_size()
    vocab.run(vocab.VocabParams(model_type="unigram", vocab_size=size, character_coverage=1.0, input_sentence_size=0,
                                seed=1), clean_dir=clean_dir, out_dir=out_dir)
    assert vocab.identity(out_dir) != vocab.identity(vocab_dir)
    return out_dir


def train_params(**changes) -> train.TrainParams:
    p = dict(max_steps=6, batch_tokens=1500, processes=1, micro_batches="auto", warmup_steps=4, schedule="inverse_sqrt",
             lr_scale=1.0, adam_betas=(0.9, 0.98), adam_eps=1e-9, label_smoothing=0.1, clip_norm=0.0, precision="fp32",
             compile=False, cuda_graphs=False, shapes="exact",
             seed=1, log_every=2, validate_every=3, checkpoint_every_steps=2, checkpoint_every_minutes=0.0,
             keep_checkpoints=20)
    p.update(changes)
    return train.TrainParams(**p)


def train_params_file(tmp_path: Path, **overrides) -> Path:
    """A params.yaml of the quickstart preset for the train stage run as a command, with `overrides`: in fp32,
    whose rounding the tests' bounds are (auto is bf16 on CPUs with AMX; test_train tests bf16 steps)."""
    from pipeline.presets import apply_overrides, committed_params, load_preset

    path = tmp_path / "params.yaml"
    path.write_text(committed_params()[1])
    apply_overrides({**load_preset("quickstart"), "train.batch_tokens": 1500, "train.log_every": 5,
                     "train.validate_every": 1000, "train.checkpoint_every_steps": 5, "train.precision": "fp32",
                     **overrides}, path)
    return path


def train_command(params: Path, encoded: Path, vocab_dir: Path, out: Path) -> list[str]:
    return ["-m", "pipeline.stage", "train", "--params", str(params), "--encoded-dir", str(encoded),
            "--vocab-dir", str(vocab_dir), "--checkpoint-dir", str(out / "ckpt"), "--plots-dir", str(out / "plots"),
            "--metrics", str(out / "train.json")]


FREED_BYTES_KEPT = """
import ctypes, sys, torch
{prepare}
x = torch.ones({block_mb} << 18)  # by glibc's default a block of its own, mapped from the OS and unmapped at free
del x
libc = ctypes.CDLL("libc.so.6")
new = hasattr(libc, "mallinfo2")  # glibc 2.33 on; before it mallinfo, the same fields in ints
class MallInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t if new else ctypes.c_int)
                for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
mallinfo = libc.mallinfo2 if new else libc.mallinfo
mallinfo.restype = MallInfo
print(mallinfo().fordblks)
"""


def freed_bytes_kept(prepare: str, block_mb: int, *args: str | Path) -> int:
    """The free bytes glibc's heap holds once a fresh process has run `prepare` (Python, its arguments
    `args`) and then made and freed a tensor of `block_mb` MB: the block's size or more where it was
    kept for reuse. Skips where there is no glibc (the setting and its statistics are glibc's)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallinfo
    except (OSError, AttributeError):
        pytest.skip("no glibc here, where the allocator's settings do nothing")
    script = FREED_BYTES_KEPT.format(prepare=prepare, block_mb=block_mb)
    return int(subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.splitlines()[-1])


def download_params(shared: Path, work: Path, **changes) -> DownloadParams:
    local = dict(dir=str(work / "corpus"),
                 train=(ParallelFiles("europarl-v7.first10k.en", "europarl-v7.first10k.de"),
                        ParallelFiles("news-commentary.first10k.en", "news-commentary.first10k.de")),
                 dev=ParallelFiles(str(shared / "wmt14/newstest2013/newstest2013.en"),
                                   str(shared / "wmt14/newstest2013/newstest2013.de")),
                 test=ParallelFiles(str(shared / "wmt14/newstest2014-full/newstest2014-deen-src.en.txt"),
                                    str(shared / "wmt14/newstest2014-full/newstest2014-deen-ref.de.txt")))
    local.update(changes)
    wmt = Wmt14Source(corpora=("europarl-v7",), test="full", mirrors=(), archive_dir=str(work / "archives"))
    return DownloadParams(source="local", src_lang="en", tgt_lang="de", wmt14=wmt,
                          multi30k=Multi30kSource((), str(work / "archives/multi30k")), local=LocalSource(**local))


def pytest_sessionstart(session: pytest.Session) -> None:
    """The stage tests need the real text: without it, one line says how to get it, and nothing runs."""
    if not (SHARED / "wmt14").is_dir():
        pytest.exit(f"the tests read real WMT14 and Multi30k text, not found at {SHARED}: `make test-data` fetches "
                    "it (about 50 MB, pinned and checked), or SHARED_DATA names a copy", returncode=4)


@pytest.fixture(scope="session")
def shared() -> Path:
    """The real WMT14 and Multi30k text: ../shared/data beside the checkout, or `make test-data`'s copy."""
    return SHARED


@pytest.fixture(autouse=True)
def _no_tracking_in_the_working_tree(tmp_path, monkeypatch):
    """Stages called through the command line track into a store of the test's own, and note what a
    lost server missed in a folder of the test's own."""
    from pipeline import unsent

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("PIPELINE_MLFLOW_NOTES", str(tmp_path / "mlflow-unsent"))
    monkeypatch.setattr(unsent, "NOTES", tmp_path / "mlflow-unsent")


@pytest.fixture(scope="session")
def work(tmp_path_factory, shared):
    """A corpus directory of real WMT14 text: Europarl and News Commentary samples (with their blank
    lines and carriage returns), newstest2013 as dev and newstest2014 (full) as test."""
    root = tmp_path_factory.mktemp("stages")
    corpus = root / "corpus"
    corpus.mkdir()
    sample = shared / "wmt14/train-sample/uedin-toy"
    for name in ("europarl-v7.first10k", "news-commentary.first10k"):
        for lang in ("en", "de"):
            with open(sample / f"{name}.{lang}", "rb") as f:
                head = b"".join(line for _, line in zip(range(TRAIN_LINES), f))
            (corpus / f"{name}.{lang}").write_bytes(head)
    return root


@pytest.fixture(scope="session")
def raw(shared, work):
    metrics = download.run(download_params(shared, work), out_dir=work / "raw")
    return work / "raw", metrics


@pytest.fixture(scope="session")
def cleaned(raw, work):
    metrics = clean.run(CLEAN, raw_dir=raw[0], out_dir=work / "clean")
    return work / "clean", metrics


@pytest.fixture(scope="session")
def vocab_dir(cleaned, work):
    params = vocab.VocabParams(model_type="bpe", vocab_size=1000, character_coverage=1.0,
                               input_sentence_size=100000, seed=1)
    metrics = vocab.run(params, clean_dir=cleaned[0], out_dir=work / "vocab")
    assert metrics == {"vocab_size": 1000}
    return work / "vocab"


@pytest.fixture(scope="session")
def encoded(cleaned, vocab_dir, work):
    metrics = encode.run(clean_dir=cleaned[0], vocab_dir=vocab_dir, out_dir=work / "encoded")
    return work / "encoded", metrics


@pytest.fixture(scope="session")
def trained(encoded, vocab_dir, work):
    metrics = train.run(TINY, train_params(), encoded_dir=encoded[0], vocab_dir=vocab_dir,
                        checkpoint_dir=work / "checkpoints", plots_dir=work / "plots")
    return current_dir(work / "checkpoints"), metrics  # the run's own folder


@pytest.fixture(scope="session")
def averaged(trained, work):
    metrics = average.run(average.AverageParams(last=2), checkpoint_dir=trained[0].parent, out_path=work / "model.st")
    return work / "model.st", metrics


# -- the whole pipeline in a copy of the repository, shared by the slow tier's modules -----------------

ROOT = Path(__file__).resolve().parents[1]
# 30 steps, all of them warm-up: 30 of the preset's 300 leave a model whose every translation is empty, and a change
# to decoding then changes no output for the tests to see rerun
SMALL = ["-S", "train.max_steps=30", "-S", "train.warmup_steps=30", "-S", "train.checkpoint_every_steps=10",
         "-S", "train.log_every=10", "-S", "train.validate_every=10", "-S", "decode.max_length_extra=5",
         "-S", "average.last=2"]


def copy_project(tmp_path_factory) -> Path:
    """A fresh copy of the project (bench.common.clone: as a clone would have it) in a git repository of its own."""
    return clone(tmp_path_factory.mktemp("clone") / "project")


def env_of(repo: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the default: inside the tree
    env.update(PREFECT_HOME=str(repo.parent / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", PYTHONPATH=str(repo))
    return env


def run_in(repo: Path, *args: str) -> str:
    proc = subprocess.run(args, cwd=repo, env=env_of(repo), capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def newest_runs(repo: Path) -> dict:
    """The newest train-stage run and the newest pipeline run in the copy's MLflow store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("transformer-en-de")
    return {kind: client.search_runs([experiment.experiment_id], f"tags.{kind} = '{value}'",
                                     order_by=["attributes.start_time DESC"])[0]
            for kind, value in (("stage", "train"), ("run_kind", "pipeline"))}


@pytest.fixture(scope="session")
def repo(tmp_path_factory) -> Path:
    """One copy for the test_pipeline*.py modules, which run in name order in one process (`make test`'s
    CHAIN): test_pipeline (a first quickstart and what it leaves), then each module after the one before."""
    return copy_project(tmp_path_factory)


@pytest.fixture(scope="session")
def flow_output(repo) -> str:
    return run_in(repo, sys.executable, "-m", "pipeline", "quickstart", *SMALL)


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory) -> Iterator[str]:
    """A Prefect server of the module's own, on a free loopback port."""
    from servers import free_port, serving

    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    home = tmp_path_factory.mktemp("prefect-server")
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    with serving([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                 f"{url}/health", home, env, "the Prefect server"):
        yield url
