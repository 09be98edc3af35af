"""bench.gpu's curves part: the train stage itself in one precision, eager or captured, on the
prepared batches (bucketed, so that all three take the same batches); the driver compares the bf16
and the captured bf16 loss curves with fp32's."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import model_config, train_params
from bench.gpu import Sizes
from bench.gpu.throughput import SYSTEMS

BUCKETED = {"compile": False, "shapes": "buckets"}  # eager, but on the batches a captured step takes
CURVES = {"fp32": ("fp32", BUCKETED), "bf16": ("bf16", BUCKETED), "bf16-captured": ("bf16", SYSTEMS["captured"])}


def curve(sizes: Sizes, work: Path, name_of_curve: str) -> dict[str, Any]:
    """The train stage itself, base (tiny with --smoke) for the curve's steps, in the precision and
    with the step settings CURVES names."""

    from stages import train
    from stages.model_files import current_dir, list_checkpoints, read_checkpoint

    name = sizes.small_model
    precision, settings = CURVES[name_of_curve]
    params = train_params(batch_tokens=sizes.batch_tokens, max_steps=sizes.curve_steps, precision=precision,
                          log_every=sizes.curve_log_every, **settings)
    out = train.run(model_config(name), params, encoded_dir=work / "encoded", vocab_dir=work / "vocab",
                    checkpoint_dir=work / f"checkpoints-{name_of_curve}", plots_dir=work / f"plots-{name_of_curve}")
    newest = list_checkpoints(current_dir(work / f"checkpoints-{name_of_curve}"))[-1][1]
    history = read_checkpoint(newest).parts["progress"]["history"]
    return {"curve": name_of_curve, "precision": precision, "settings": settings, "model": name,
            "tgt_tokens_per_sec": out["mean_tgt_tokens_per_sec"],
            "steps": [r["step"] for r in history], "loss": [r["loss"] for r in history]}
