"""The model registry: each finished pipeline run's averaged model, logged as an MLflow pyfunc that
translates (pipeline/serving.py) and registered as `transformer-<src>-<tgt>-<test set>`, with the
alias `best` on the version of highest test BLEU. The test set is in the name because BLEU compares
only on one: the quickstart's 99 on its number phrases would otherwise outrank every WMT14 model."""
from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from pipeline import dag
from pipeline.config import ROOT, Params
from pipeline.tracking import Tracker, experiment_name, tracking_uri


def register_model(parent: Tracker, params: Params, test_bleu: float) -> str | None:
    """Log the averaged model as a pyfunc that translates (pipeline/serving.py) into the pipeline's
    run, register it as model_name(params), and point that model's alias `best` at the
    version with the highest test BLEU. Returns the new version's URI, or None when not tracked."""
    if parent.run_id is None:
        return None
    import mlflow
    import torch

    paths = dag.paths()
    name = model_name(params)
    mlflow.set_tracking_uri(tracking_uri())
    with tempfile.TemporaryDirectory() as tmp, mlflow.start_run(run_id=parent.run_id):
        # decoding parameters and the input's normalisation as files the model carries (a model_config would
        # also become unprefixed run params)
        files = {}
        for kind, content in (("decode", dataclasses.asdict(params.decode)),
                              ("clean", {"lang": params.download.src_lang, **dataclasses.asdict(params.clean)})):
            files[kind] = str(Path(tmp) / f"{kind}.json")
            Path(files[kind]).write_text(json.dumps(content), encoding="utf-8")
        info = mlflow.pyfunc.log_model(
            name="translator", python_model=str(ROOT / "pipeline/serving.py"),
            artifacts={"model": str(ROOT / paths["model"]), "vocab": str(ROOT / paths["vocab"]),
                       **files},
            code_paths=[str(ROOT / package) for package in ("stages", "translate", "transformer")],
            registered_model_name=name,
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "sentencepiece", "sacremoses", "safetensors",
                              "numpy", "tqdm"])
    version = str(info.registered_model_version)
    parent.client.set_model_version_tag(name, version, "test_bleu", f"{test_bleu:.4f}")
    point_best(parent.client, name)
    return f"models:/{name}/{version}"


def model_name(params: Params) -> str:
    """transformer-en-de-newstest2014, transformer-en-de-numbers (the quickstart's): the model's
    languages and the test set that its versions' BLEU is measured on."""
    download = params.download
    return f"{experiment_name(download.src_lang, download.tgt_lang)}-{download.test_set}"


def point_best(client: Any, name: str) -> str:
    """Point the model's alias `best` at its version of highest test BLEU (its `test_bleu` tag); returns it."""
    best = max(client.search_model_versions(f"name = '{name}'"),
               key=lambda v: float(v.tags.get("test_bleu", "-inf")))
    client.set_registered_model_alias(name, "best", best.version)
    return str(best.version)
