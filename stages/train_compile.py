"""How the train step's forward and backward run: as written (eager), compiled by torch.compile (the
whole step, its layers and loss, or its loss alone), or compiled and replayed as CUDA graphs (captured). A
transform the train stage applies to the step from outside (train.compile_step, from train.compile and
train.cuda_graphs); the model, its loss and the step's accumulate, clip and update know nothing of it.

Compiled, one graph with dynamic shapes serves every batch shape. Its loss alone compiled, the model runs
as written and the loss's graph takes the logits in their own precision. Its layers compiled (regional
compilation, as torchtitan compiles a model block by block), each encoder and decoder layer runs one
graph that every layer of its kind shares, and the loss another; the embeddings and the pre-softmax
product run as written. One layer of each kind is traced and compiled where the whole step traces them
all, so it compiles in a fraction of the time (bench.train --compile layers, against --compile step).
Captured, each batch shape gets
a graph and a CUDA graph of its own (a CUDA graph replays fixed shapes and addresses), which bucket shapes
bound to a few; the step's gradients then live in tensors of their own that every replay adds into,
never in a graph's memory that the next replay overwrites.
"""
from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from transformer.loss import label_smoothed_nll_loss

LossFunction = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (model, src, tgt_in, tgt_out, epsilon, loss=)
Part = Literal["step", "layers", "loss"]

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
    """`eager` compiled: `part` "step", all of it; "layers", `model`'s encoder and decoder layers and the
    loss it takes as `loss=` (train.forward_loss's); "loss", that loss alone. `captured`: the step also
    replayed as CUDA graphs, one per batch shape."""

    def __init__(self, eager: LossFunction, captured: bool = False, part: Part = "step",
                 model: nn.Module | None = None) -> None:
        if captured and part != "step":
            raise ValueError("a captured step is compiled whole: CUDA graphs replay the step, not its parts")
        if (part == "layers") != (model is not None):
            raise ValueError("the model is given where its layers are compiled, and only there")
        self.eager, self.captured, self.part = eager, captured, part
        self.layers = compile_layers(model) if model is not None else []
        if part != "step":
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

    def undo(self) -> LossFunction:
        """The step as written: the model's layers run as written again, and the eager function is returned."""
        for layer in self.layers:
            del layer.forward  # the class's own again
        self.layers = []
        return self.eager

    def __str__(self) -> str:
        return {"loss": "loss-compiled (the model eager)", "layers": "layer-compiled (each layer and the loss)",
                "step": "captured (compiled, replayed as CUDA graphs)" if self.captured else "compiled"}[self.part]


def compile_layers(model: nn.Module) -> list[nn.Module]:
    """Each of the Transformer `model`'s encoder and decoder layers made to run its kind's forward compiled
    (dynamic shapes): one compiled function a kind, so the first layer's call compiles a graph that the
    others, the same code on weights of their own, reuse. Returns the layers."""
    layers = [*model.encoder, *model.decoder]
    compiled = {kind: torch.compile(kind.forward, dynamic=True) for kind in {type(layer) for layer in layers}}
    for layer in layers:
        layer.forward = types.MethodType(compiled[type(layer)], layer)
    return layers


def persistent_gradients(parameters: list[torch.nn.Parameter]) -> None:
    """Give each parameter a gradient tensor of its own, which backward adds into and zero_grad
    (set_to_none=False) clears in place: a replayed backward's output is then copied, never kept as
    `.grad` (which the next micro-batch's replay would overwrite)."""
    for p in parameters:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
