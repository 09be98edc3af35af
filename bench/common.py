"""What the benches share: the real WMT14 and Multi30k text beside the checkout, their settings built
by the pipeline's own loader from params.yaml and presets (never restated here), and the preparation
of a corpus by the pipeline's own vocab and encode stages. Imports no torch, MLflow, Prefect or DVC."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from corpora.shared import location
from pipeline.config import Params
from pipeline.presets import collect_overrides, committed_params, layered

ROOT = Path(__file__).resolve().parents[1]

SHARED = location()  # the real text the tests read too: ../shared/data, or `make test-data`'s copy
SAMPLE = SHARED / "wmt14/train-sample/hf-europarl-20k/train"
NEWSTEST2013 = SHARED / "wmt14/newstest2013/newstest2013"
NEWSTEST = SHARED / "wmt14/newstest2014-full/newstest2014-deen"
MULTI30K = SHARED / "multi30k"
# corpus -> split -> language -> file: what `prepare_corpora` reads
CORPORA = {"europarl": {"train": {"en": f"{SAMPLE}.en", "de": f"{SAMPLE}.de"},
                        "dev": {"en": f"{NEWSTEST2013}.en", "de": f"{NEWSTEST2013}.de"},
                        "test": {"en": f"{NEWSTEST}-src.en.txt", "de": f"{NEWSTEST}-ref.de.txt"}},
           "multi30k": {"train": {"en": f"{MULTI30K}/train.en", "de": f"{MULTI30K}/train.de"},
                        "dev": {"en": f"{MULTI30K}/val.en", "de": f"{MULTI30K}/val.de"},
                        "test": {"en": f"{MULTI30K}/test_2016_flickr.en", "de": f"{MULTI30K}/test_2016_flickr.de"}}}
# A model small enough for a smoke run on any CPU, as overrides of params.yaml's
TINY = {"model.d_model": 64, "model.n_heads": 4, "model.d_ff": 128, "model.encoder_layers": 2,
        "model.decoder_layers": 2}


def settings(overrides: dict[str, Any] | None = None, presets: tuple[str, ...] = ()) -> Params:
    """params.yaml as committed with `presets`, then `overrides` (dotted keys), layered on as the pipeline
    does."""
    name, text = committed_params()
    return layered({**collect_overrides(list(presets), []), **(overrides or {})}, name, text)


MODELS = ("base", "big", "tiny", "multi30k", "multi30k-amx")


def model_settings(name: str) -> Params:
    """The settings of a model's name: base (params.yaml as committed: the paper's), big or multi30k (the
    presets on it), multi30k-amx (that preset layered after multi30k, as it runs), or tiny."""
    return {"base": lambda: settings(), "big": lambda: settings(presets=("big",)),
            "multi30k": lambda: settings(presets=("multi30k",)),
            "multi30k-amx": lambda: settings(presets=("multi30k", "multi30k-amx")),
            "tiny": lambda: settings(TINY)}[name]()


def model_config(name: str):
    """The model of a name (`model_settings`)."""
    return model_settings(name).model


def train_params(**changes: Any):
    """The train section for a bench's own steps: params.yaml's, in bf16, no logging, validation or
    checkpoints but the last, with `changes`."""
    quiet = {"max_steps": 10**9, "precision": "bf16", "log_every": 10**9, "validate_every": 10**9,
             "checkpoint_every_steps": 0, "checkpoint_every_minutes": 0}
    return settings({f"train.{key}": value for key, value in {**quiet, **changes}.items()}).train


def prepare_corpora(work: Path, corpora: tuple[str, ...], vocab_size: int,
                    limits: dict[str, int | None]) -> dict[str, Any]:
    """Each corpus's text and encoded text (one corpus: in `work`, several: in `work`/<corpus>), the
    first `limits[split]` lines of each split, with one vocabulary (BPE, `vocab_size` pieces) learned
    by the vocab stage on all their training text, so a model trained on one can go on with another."""
    from stages import encode, vocab
    from stages.io import write_manifest

    start = time.perf_counter()
    homes = {corpus: work if len(corpora) == 1 else work / corpus for corpus in corpora}
    counts: dict[str, dict[str, int]] = {}
    for corpus, home in homes.items():
        text = home / "text"
        text.mkdir(parents=True, exist_ok=True)  # a preparation cut short is done again
        counts[corpus] = {}
        for split, paths in CORPORA[corpus].items():
            for lang, path in paths.items():
                lines = Path(path).read_text(encoding="utf-8").splitlines()[: limits[split]]
                (text / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
                counts[corpus][split] = len(lines)
        write_manifest(text, "en", "de", counts[corpus])
    learn_from = homes[corpora[0]] / "text"
    if len(corpora) > 1:  # the vocab stage learns from one folder's train split: all corpora's, joined
        learn_from = work / "text"
        learn_from.mkdir(parents=True, exist_ok=True)
        for lang in ("en", "de"):
            joined = "".join((home / "text" / f"train.{lang}").read_text(encoding="utf-8") for home in homes.values())
            (learn_from / f"train.{lang}").write_text(joined, encoding="utf-8")
        write_manifest(learn_from, "en", "de", {"train": sum(c["train"] for c in counts.values())})
    vocab_params = settings({"vocab.vocab_size": vocab_size, "vocab.input_sentence_size": 0}).vocab
    vocab.run(vocab_params, clean_dir=learn_from, out_dir=work / "vocab")
    for home in homes.values():
        encode.run(clean_dir=home / "text", vocab_dir=work / "vocab", out_dir=home / "encoded")
    pairs = counts[corpora[0]] if len(corpora) == 1 else counts
    return {"pairs": pairs, "vocab_size": vocab_size, "seconds": time.perf_counter() - start}


def clone(dest: Path) -> Path:
    """The checkout's files as a fresh clone would have them, in a git repository of its own: the files git
    tracks, as they stand (uncommitted edits included), and none of a run's outputs (dvc.lock, metrics/,
    plots/: untracked, not ignored); params.yaml as committed (committed_params: not what the last run wrote
    into it, which a preset run in the clone would otherwise start from); and the page template set-up
    writes. What the benches that time a user's run and the tests of whole runs use."""
    listed = subprocess.run(["git", "ls-files", "--cached"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split("\n")
    for name in [*filter(None, listed), ".dvc/offline-plots.html"]:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    (dest / "params.yaml").write_text(committed_params()[1], encoding="utf-8")
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.name=bench", "-c", "user.email=bench@localhost",
                                                   "commit", "-qm", "bench clone"]):
        subprocess.run(["git", *args], cwd=dest, check=True)
    return dest


def timed_pipeline(project: Path, args: list[str], splits: dict[str, str]) -> tuple[float, list[dict[str, Any]], int]:
    """`python -m pipeline ARGS` in `project` as a user runs it (the Prefect flow over dvc.yaml, MLflow and all,
    reaching no server of this shell's): (minutes end to end, a row of scores for each split of metrics/score.json
    under its name in `splits`, training steps)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=project, env=env)
    minutes = (time.perf_counter() - start) / 60
    if proc.returncode != 0:
        raise SystemExit(f"`python -m pipeline {args[0]}` in {project} failed (exit status {proc.returncode}, its "
                         f"error above) after {minutes:.1f} minutes")
    scores = json.loads((project / "metrics/score.json").read_text(encoding="utf-8"))
    steps = json.loads((project / "metrics/train.json").read_text(encoding="utf-8"))["steps"]
    rows = [{"split": name, "sacreBLEU": round(scores[split]["bleu"], 2),
             "lowercased tokenised BLEU": round(scores[split]["bleu_lc_tok"], 2),
             "chrF": round(scores[split]["chrf"], 2)} for split, name in splits.items()]
    return minutes, rows, steps
