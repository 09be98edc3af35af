"""Transforms a backend applies to the model from outside, as torchtitan applies parallelism (every
decoding backend; the train stage on CPUs, stages/train_cpu.py): modules replaced in place, the
model's own code untouched."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


def replace_modules(root: nn.Module, kind: type[nn.Module], make: Callable[[Any], nn.Module]) -> None:
    """Every module of type `kind` under `root` becomes make(it), in place."""
    for module in list(root.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, kind):
                setattr(module, name, make(child))


def swap_class(module: nn.Module, cls: type[nn.Module]) -> None:
    """Give `module` the behaviour of `cls`, a subclass of its class that adds no state (as PyTorch's
    fully_shard does), so its weights and place in the model stay as they are."""
    assert issubclass(cls, type(module)), f"{cls.__name__} is not a {type(module).__name__}"
    module.__class__ = cls
