"""What the train stage measures and keeps: a row of loss, speed and batching cost per log interval
(MetricsWindow), the run's progress and curves (Progress, checkpointed with the rest of the training
state), the curves as CSV for `dvc plots`, and the run's summary for metrics/train.json."""
from __future__ import annotations

import csv
import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.io import atomic_write

# What a window sums of its steps: losses and tokens (real and padded), the tokens of the side that
# binds the batch budget, model FLOPs, and seconds spent waiting for data.
SUMMED = ("loss_sum", "nll_sum", "tokens", "src_tokens", "src_slots", "tgt_slots", "binding", "flops", "data_wait")


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step's figures on this process. The losses and the gradient norm are device
    tensors, read back only when a window closes."""

    loss_sum: torch.Tensor | float
    nll_sum: torch.Tensor | float
    tokens: int  # target tokens
    src_tokens: int
    src_slots: int  # padded, per side
    tgt_slots: int
    binding: int  # real tokens of the side that binds the batch budget
    flops: float
    data_wait: float  # seconds
    lr: float
    grad_norm: torch.Tensor | float


@dataclass
class Progress:
    """How far the run has come and what it has cost, over resumptions: the step, total FLOPs and
    seconds, and the logged training and validation curves."""

    step: int = 0
    total_flops: float = 0.0
    total_seconds: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)
    valid_history: list[dict[str, float]] = field(default_factory=list)

    def record(self, row: dict[str, float], flops: float, seconds: float) -> None:
        self.total_flops += flops
        self.total_seconds += seconds
        self.history.append({**row, "train_flops": self.total_flops})

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check(self, state: Any, step: int) -> None:
        """ValueError unless `state` is a progress of `step` steps."""
        fields = [f.name for f in dataclasses.fields(self)]
        if not isinstance(state, dict) or (missing := [name for name in fields if name not in state]):
            raise ValueError(f"its progress lacks {', '.join(missing) if isinstance(state, dict) else 'everything'}")
        if state["step"] != step:
            raise ValueError(f"its progress says step {state['step']!r}, its file step {step}")
        if not (isinstance(state["history"], list) and isinstance(state["valid_history"], list)
                and all(isinstance(state[k], int | float) for k in ("total_flops", "total_seconds"))):
            raise ValueError("its progress's totals or curves are not numbers and lists")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.total_flops, self.total_seconds = int(state["step"]), float(state["total_flops"]), \
            float(state["total_seconds"])
        self.history, self.valid_history = list(state["history"]), list(state["valid_history"])


class MetricsWindow:
    """The steps since the last log row: this process's sums of each step's counts, and their time."""

    def __init__(self, micro_tokens: int, grad_accum: int, num_processes: int, peak: float | None) -> None:
        self.micro_tokens, self.grad_accum, self.num_processes, self.peak = \
            micro_tokens, grad_accum, num_processes, peak
        self._reset()

    def _reset(self) -> None:
        self.sums = dict.fromkeys(SUMMED, 0.0)
        self.seconds, self.steps = 0.0, 0

    def add(self, step: StepMetrics, seconds: float) -> None:
        for key in SUMMED:
            self.sums[key] += getattr(step, key)
        self.seconds += seconds
        self.steps += 1

    def close(self, step: int, last: StepMetrics,
              reduce: Callable[[torch.Tensor], torch.Tensor]) -> tuple[dict[str, float], float, float]:
        """(row, FLOPs, seconds) of the window, summed over processes by `reduce`; then start afresh.
        `last` is the newest step's report, whose learning rate and gradient norm the row shows."""
        local = torch.tensor([float(self.sums[k]) for k in SUMMED], dtype=torch.float64)
        sums = dict(zip(SUMMED, reduce(local).tolist()))
        tokens, seconds = sums["tokens"], max(self.seconds, 1e-9)
        micro_batches = self.steps * self.grad_accum * self.num_processes
        row = {"step": step, "loss": sums["loss_sum"] / tokens, "nll": sums["nll_sum"] / tokens,
               "ppl": math.exp(min(sums["nll_sum"] / tokens, 50.0)), "lr": last.lr,
               "grad_norm": float(last.grad_norm),
               "tgt_tokens_per_step": tokens / self.steps, "tgt_tokens_per_sec": tokens / seconds,
               "src_tokens_per_sec": sums["src_tokens"] / seconds,
               "src_padding": 1 - sums["src_tokens"] / sums["src_slots"],
               "tgt_padding": 1 - tokens / sums["tgt_slots"],
               "batch_fill": sums["binding"] / (micro_batches * self.micro_tokens),
               "tflops": sums["flops"] / seconds / 1e12,
               "data_wait_fraction": sums["data_wait"] / (seconds * self.num_processes)}
        if self.peak:  # model FLOPs utilisation of all the processes' accelerators
            row["mfu"] = sums["flops"] / seconds / (self.peak * self.num_processes)
        out = (row, sums["flops"], self.seconds)
        self._reset()
        return out


CURVE_FILES = ("train.csv", "valid.csv")  # what the train stage writes in its plots folder


def write_curves(plots_dir: str | Path, progress: Progress) -> None:
    """<plots_dir>/train.csv and valid.csv, one row per logged step, for `dvc plots`."""
    for name, rows in zip(CURVE_FILES, (progress.history, progress.valid_history), strict=True):
        with atomic_write(Path(plots_dir) / name) as f:
            if rows:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)


def summary(progress: Progress, parameters: int, num_processes: int, peak: float | None) -> dict[str, float]:
    """The run's figures for metrics/train.json: where it ended, its mean speed and its total cost."""
    final = progress.history[-1] if progress.history else {}
    valid = {k: v for k, v in (progress.valid_history[-1] if progress.valid_history else {}).items() if k != "step"}

    def mean(key: str) -> float:
        return float(np.mean([r[key] for r in progress.history if key in r] or [float("nan")]))

    # means are named apart from the curves they summarise, so that a run's curve of tokens/s does not
    # end in a point of its mean
    out = {"steps": progress.step, "parameters": parameters,
           "loss": final.get("loss", float("nan")), "nll": final.get("nll", float("nan")),
           "mean_tgt_tokens_per_sec": mean("tgt_tokens_per_sec"), "mean_tflops": mean("tflops"),
           "train_flops": progress.total_flops, "train_hours": progress.total_seconds / 3600,
           "accelerator_hours": progress.total_seconds / 3600 * num_processes, **valid}
    if peak:
        out["mean_mfu"] = mean("mfu")
    return out


# The line the train stage prints at each log row, which the Prefect flow turns into its progress
# artifact: written and read here only.
_PROGRESS = re.compile(r"^step (\d+)/(\d+): loss ([\d.]+|nan|inf), ([\d,.]+) target tokens/s$")


def progress_line(row: dict[str, float], max_steps: int) -> str:
    rate = row["tgt_tokens_per_sec"]
    return f"step {int(row['step'])}/{max_steps}: loss {row['loss']:.3f}, {rate:,.0f} target tokens/s"


def parse_progress(line: str) -> tuple[int, int, float, float] | None:
    """(step, max_steps, loss, target tokens/s) of a progress line, or None for any other line."""
    if m := _PROGRESS.match(line.strip()):
        return int(m[1]), int(m[2]), float(m[3]), float(m[4].replace(",", ""))
    return None
