"""Stage 6, average: the mean of the last N checkpoints' weights (paper section 6.1: the last 5 for
base, 20 for big) of the setup trained last, as one weights-only model that decoding loads and
nobody resumes training from.
Checkpoints are spaced in steps (train.checkpoint_every_steps, the paper's 10 minutes on 8 P100s:
1,400 base or 600 big steps), whatever the hardware; snapshots written on a clock are not averaged."""
from __future__ import annotations

from dataclasses import replace

import torch

from stages.io import InputPath, OutputPath, PipelineError, require_dir
from stages.params import AverageParams
from stages.model_files import Weights, current_dir, list_checkpoints, read_checkpoint, write_model


def average_state_dicts(states: list[Weights], names: list[str]) -> Weights:
    """Element-wise mean, accumulated in fp64 whatever the stored precision (so N copies of one
    checkpoint average to it exactly); keys and shapes must agree."""
    reference = states[0]
    total = {k: v.detach().to(torch.float64).clone() for k, v in reference.items()}
    for state, name in zip(states[1:], names[1:], strict=True):
        if state.keys() != reference.keys():
            raise PipelineError(f"{name}: its parameters differ from {names[0]}'s "
                                f"({sorted(state.keys() ^ reference.keys())[:3]}...)")
        for k, v in state.items():
            if v.shape != reference[k].shape:
                raise PipelineError(f"{name}: parameter {k} has shape {tuple(v.shape)}, "
                                    f"{names[0]} has {tuple(reference[k].shape)}")
            total[k] += v.to(torch.float64)
    return {k: (v / len(states)).to(reference[k].dtype) for k, v in total.items()}


def run(params: AverageParams, *, checkpoint_dir: InputPath, out_path: OutputPath) -> dict[str, float]:
    checkpoint_dir = current_dir(require_dir(checkpoint_dir, "checkpoint (train stage output)"))
    found = list_checkpoints(checkpoint_dir)
    if not found:
        raise PipelineError(f"{checkpoint_dir}: no complete checkpoint to average (snapshots, written on a clock "
                            f"for crash safety, are never averaged)")
    chosen = found[-params.last :]
    print(f"average: the last {len(chosen)} of {len(found)} checkpoints in {checkpoint_dir}, steps "
          f"{', '.join(str(step) for step, _ in chosen)}", flush=True)
    loaded = [read_checkpoint(path) for _, path in chosen]
    averaged = average_state_dicts([c.parts["model"] for c in loaded], [str(p) for _, p in chosen])
    write_model(out_path, averaged, replace(loaded[-1].meta, steps=tuple(c.step for c in loaded)))
    print(f"average: wrote {out_path}", flush=True)
    return {"averaged": len(chosen), "first_step": chosen[0][0], "last_step": chosen[-1][0]}
