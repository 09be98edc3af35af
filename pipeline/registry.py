"""The model registry: each finished pipeline run's averaged model, logged as an MLflow pyfunc that
translates (pipeline/serving.py) and registered as `transformer-<src>-<tgt>`, with the alias `best`
on the version of highest test BLEU."""
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
    run, register it as `transformer-<src>-<tgt>`, and point that model's alias `best` at the
    version with the highest test BLEU. Returns the new version, or None when not tracked."""
    if parent.run_id is None:
        return None
    import mlflow
    import torch

    paths = dag.paths()
    name = experiment_name(params.download.src_lang, params.download.tgt_lang)
    mlflow.set_tracking_uri(tracking_uri())
    with tempfile.TemporaryDirectory() as tmp, mlflow.start_run(run_id=parent.run_id):
        # decoding parameters as a file the model carries (a model_config would also become unprefixed run params)
        decode_file = Path(tmp) / "decode.json"
        decode_file.write_text(json.dumps(dataclasses.asdict(params.decode)), encoding="utf-8")
        info = mlflow.pyfunc.log_model(
            name="translator", python_model=str(ROOT / "pipeline/serving.py"),
            artifacts={"model": str(ROOT / paths["model"]), "vocab": str(ROOT / paths["vocab"]),
                       "decode": str(decode_file)},
            code_paths=[str(ROOT / package) for package in ("stages", "translate", "transformer")],
            registered_model_name=name,
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "sentencepiece", "safetensors", "numpy",
                              "tqdm"])
    version = str(info.registered_model_version)
    parent.client.set_model_version_tag(name, version, "test_bleu", f"{test_bleu:.4f}")
    point_best(parent.client, name)
    return version


def point_best(client: Any, name: str) -> str:
    """Point the model's alias `best` at its version of highest test BLEU (its `test_bleu` tag); returns it."""
    best = max(client.search_model_versions(f"name = '{name}'"),
               key=lambda v: float(v.tags.get("test_bleu", "-inf")))
    client.set_registered_model_alias(name, "best", best.version)
    return str(best.version)
