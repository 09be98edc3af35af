"""Stage 6, average: the mean of the last N checkpoints' weights (paper section 6.1: the last 5 for
base, 20 for big), as one weights-only model that decoding loads and nobody resumes training from."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from stages.io import PipelineError, atomic_write, require_dir
from stages.train import checkpoints, load_checkpoint


@dataclass(frozen=True)
class AverageParams:
    last: int  # how many of the newest checkpoints to average


def average_state_dicts(states: list[dict[str, torch.Tensor]], names: list[str]) -> dict[str, torch.Tensor]:
    """Element-wise mean, accumulated in fp32 whatever the stored precision; keys and shapes must agree."""
    reference = states[0]
    total = {k: v.detach().to(torch.float32).clone() for k, v in reference.items()}
    for state, name in zip(states[1:], names[1:], strict=True):
        if state.keys() != reference.keys():
            raise PipelineError(f"{name}: its parameters differ from {names[0]}'s "
                                f"({sorted(state.keys() ^ reference.keys())[:3]}...)")
        for k, v in state.items():
            if v.shape != reference[k].shape:
                raise PipelineError(f"{name}: parameter {k} has shape {tuple(v.shape)}, "
                                    f"{names[0]} has {tuple(reference[k].shape)}")
            total[k] += v.to(torch.float32)
    return {k: (v / len(states)).to(reference[k].dtype) for k, v in total.items()}


def run(params: AverageParams, *, checkpoint_dir: str | Path, out_path: str | Path) -> dict[str, float]:
    checkpoint_dir = require_dir(checkpoint_dir, "checkpoint (train stage output)")
    found = checkpoints(checkpoint_dir)
    if not found:
        raise PipelineError(f"{checkpoint_dir}: no complete checkpoint to average")
    chosen = found[-params.last :]
    loaded = [load_checkpoint(path) for _, path in chosen]
    averaged = average_state_dicts([c["model"] for c in loaded], [str(p) for _, p in chosen])
    newest = loaded[-1]
    save_model(out_path, averaged, {"model_config": newest["model_config"], "vocab_size": newest["vocab_size"],
                                    "averaged_steps": [step for step, _ in chosen]})
    return {"averaged": len(chosen), "first_step": chosen[0][0], "last_step": chosen[-1][0]}


def save_model(path: str | Path, weights: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Weights as safetensors (no pickle, so loading runs no code), with the config as metadata."""
    with atomic_write(path, "wb") as f:
        f.write(save({k: v.contiguous() for k, v in weights.items()}, metadata={"meta": json.dumps(meta)}))


def load_model(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(weights, metadata) of a model the average stage wrote."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"{path}: model file not found (has the average stage run?)")
    try:
        with safe_open(path, framework="pt") as f:
            meta = json.loads((f.metadata() or {})["meta"])
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    except (SafetensorError, KeyError, ValueError) as e:
        raise PipelineError(f"{path}: not a model written by this pipeline's average stage ({e})") from None
