"""bench.gpu's curves part: the train stage itself in one precision, on the prepared batches; the
driver compares the bf16 and fp32 loss curves."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import model_config, train_params
from bench.gpu import Sizes


def curve(sizes: Sizes, work: Path, precision: str) -> dict[str, Any]:
    """The train stage itself, base (tiny with --smoke) for the curve's steps in one precision."""
    from stages import train
    from stages.model_files import current_dir, list_checkpoints, read_checkpoint

    name = sizes.small_model
    params = train_params(batch_tokens=sizes.batch_tokens, max_steps=sizes.curve_steps, precision=precision,
                          log_every=sizes.curve_log_every)
    out = train.run(model_config(name), params, encoded_dir=work / "encoded", vocab_dir=work / "vocab",
                    checkpoint_dir=work / f"checkpoints-{precision}", plots_dir=work / f"plots-{precision}")
    newest = list_checkpoints(current_dir(work / f"checkpoints-{precision}"))[-1][1]
    history = read_checkpoint(newest).parts["progress"]["history"]
    return {"precision": precision, "model": name, "tgt_tokens_per_sec": out["mean_tgt_tokens_per_sec"],
            "steps": [r["step"] for r in history], "loss": [r["loss"] for r in history]}
