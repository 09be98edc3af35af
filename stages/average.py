"""Stage 6, average: the mean of the last N checkpoints' weights (paper section 6.1: the last 5 for
base, 20 for big) of the setup trained last, as one weights-only model that decoding loads and
nobody resumes training from.
Checkpoints are spaced in steps (train.checkpoint_every_steps, the paper's 10 minutes on 8 P100s:
1,400 base or 600 big steps), whatever the hardware; snapshots written on a clock are not averaged."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from stages.io import InputPath, OutputPath, PipelineError, require_dir
from stages.params import AverageParams
from stages.model_files import ModelMeta, Weights, current_dir, list_checkpoints, read_checkpoint, write_model


def average_state_dicts(weights: Iterable[tuple[str, Weights]]) -> Weights:
    """Element-wise mean of the (name, weights) given, accumulated in fp64 whatever the stored precision
    (so N copies of one checkpoint average to it exactly); keys and shapes must agree. They are taken one
    at a time, so only the sums and the weights in hand are held: big's 20 checkpoints are 20 models."""
    total: dict[str, torch.Tensor] = {}
    first, count = "", 0
    for name, state in weights:
        if not count:
            first, dtypes = name, {k: v.dtype for k, v in state.items()}
            total = {k: v.detach().to(torch.float64).clone() for k, v in state.items()}
        else:
            if state.keys() != total.keys():
                raise PipelineError(f"{name}: its parameters differ from {first}'s "
                                    f"({sorted(state.keys() ^ total.keys())[:3]}...)")
            for k, v in state.items():
                if v.shape != total[k].shape:
                    raise PipelineError(f"{name}: parameter {k} has shape {tuple(v.shape)}, "
                                        f"{first} has {tuple(total[k].shape)}")
                total[k] += v.to(torch.float64)
        count += 1
    return {k: (v / count).to(dtypes[k]) for k, v in total.items()}


def run(params: AverageParams, *, checkpoint_dir: InputPath, out_path: OutputPath) -> dict[str, float]:
    checkpoint_dir = current_dir(require_dir(checkpoint_dir, "checkpoint (train stage output)"))
    found = list_checkpoints(checkpoint_dir)
    if not found:
        raise PipelineError(f"{checkpoint_dir}: no complete checkpoint to average (snapshots, written on a clock "
                            f"for crash safety, are never averaged)")
    chosen = found[-params.last :]
    print(f"average: the last {len(chosen)} of {len(found)} checkpoints in {checkpoint_dir}, steps "
          f"{', '.join(str(step) for step, _ in chosen)}", flush=True)
    read: list[tuple[int, ModelMeta]] = []  # each checkpoint's step and metadata, as it is read

    def models() -> Iterator[tuple[str, Weights]]:
        """Each checkpoint's model, its file mapped: the rest of the checkpoint (the optimizer's moments,
        twice the model) is never read from disk."""
        for _, path in chosen:
            checkpoint = read_checkpoint(path, mapped=True)
            read.append((checkpoint.step, checkpoint.meta))
            yield str(path), checkpoint.parts["model"]

    averaged = average_state_dicts(models())
    write_model(out_path, averaged, replace(read[-1][1], steps=tuple(step for step, _ in read)))
    print(f"average: wrote {out_path}", flush=True)
    return {"averaged": len(chosen), "first_step": chosen[0][0], "last_step": chosen[-1][0]}
