"""How the train step's forward and backward run: as written (eager), compiled by torch.compile (the
whole step, or its loss alone), or compiled and replayed as CUDA graphs (captured). A transform the train
stage applies to the step from outside (train.compile_step, from train.compile and train.cuda_graphs); the
model, its loss and the step's accumulate, clip and update know nothing of it.

Compiled, one graph with dynamic shapes serves every batch shape. Its loss alone compiled, the model runs
as written and the loss's graph takes the logits in their own precision. Captured, each batch shape gets
a graph and a CUDA graph of its own (a CUDA graph replays fixed shapes and addresses), which bucket shapes
bound to a few; the step's gradients then live in tensors of their own that every replay adds into,
never in a graph's memory that the next replay overwrites.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Literal

import torch

from transformer.loss import label_smoothed_nll_loss

LossFunction = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (model, src, tgt_in, tgt_out, epsilon, loss=)

# Graphs a captured step may record, one per (shape, training or eval): bucketed batches come in at most
# 16 shapes (tests/test_train.py: test_an_epoch_of_bucketed_steps_takes_few_shapes_and_every_pair_once),
# where torch's default limit of 8 recompilations would send the rest to eager.
CAPTURED_GRAPHS = 64


def compile_seconds() -> float:
    """Seconds this process has spent compiling graphs (forward and backward) and recording CUDA
    graphs, by torch's own accounting."""
    from torch._dynamo import utils

    recorded = sum(utils.compilation_time_metrics.get("CUDAGraphNode.record", ()))
    return utils.calculate_time_spent().get("total_wall_time", 0.0) + recorded


class Compiled:
    """`eager` compiled: `part` "step", all of it; "loss", the loss it takes as `loss=` (train.forward_loss's).
    `captured`: the step also replayed as CUDA graphs, one per batch shape."""

    def __init__(self, eager: LossFunction, captured: bool = False, part: Literal["step", "loss"] = "step") -> None:
        if captured and part != "step":
            raise ValueError("a captured step is compiled whole: CUDA graphs replay the step, not its loss alone")
        self.eager, self.captured, self.part = eager, captured, part
        if part == "loss":
            self.compiled = functools.partial(eager, loss=torch.compile(label_smoothed_nll_loss, dynamic=True))
            return
        # Captured, shapes are static: torch 2.11's CUDA graphs of a dynamic-shape backward segfault on an
        # H100 where static ones replay eager's gradients (tests/test_train.py: test_captured_steps_update_
        # with_the_eager_steps_gradients, run by bench/gpu/check.sh speed).
        self.compiled = torch.compile(eager, dynamic=not captured, mode="reduce-overhead" if captured else None)

    def __call__(self, *args) -> tuple[torch.Tensor, torch.Tensor]:
        limit = (torch._dynamo.config.patch(recompile_limit=CAPTURED_GRAPHS) if self.captured
                 else contextlib.nullcontext())
        with limit:
            return self.compiled(*args)

    def __str__(self) -> str:
        if self.part == "loss":
            return "loss-compiled (the model eager)"
        return "captured (compiled, replayed as CUDA graphs)" if self.captured else "compiled"


def persistent_gradients(parameters: list[torch.nn.Parameter]) -> None:
    """Give each parameter a gradient tensor of its own, which backward adds into and zero_grad
    (set_to_none=False) clears in place: a replayed backward's output is then copied, never kept as
    `.grad` (which the next micro-batch's replay would overwrite)."""
    for p in parameters:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
