"""The train stage's state as checkpoints hold it, and when they are written.

The state is a set of named parts that each save and load themselves (the Trainer lists them): the
model's own weights, optimizer, schedule, sampler, progress, loss scaler and the step's split over
processes. Random draws (dropout) are seeded by the micro-batch they are for, so there is no
generator state to keep. A resumption must be of the same run: its fingerprint says what may not
change.
"""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import torch
from accelerate import Accelerator

if TYPE_CHECKING:
    from stages.train import TrainParams


class Stateful(Protocol):
    """A named part of the training state: it saves and restores itself."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


def micro_batch_seed(seed: int, step: int, index: int) -> int:
    """The random seed of a step's `index`-th micro-batch over all processes (process r's a-th of W
    processes is a x W + r). Dropout is drawn from it, so the masks depend on which batch is trained,
    not on which process trains it: a run resumed on another split of the step draws the same ones,
    and no generator's state needs saving."""
    return int(np.random.SeedSequence([seed, step, index]).generate_state(1)[0])


class Topology:
    """How each step is split: processes x micro-batches on each. A run may resume on another split
    of the same product (the sampler's stream is global); the change is said where it happens."""

    def __init__(self, processes: int, grad_accum: int, say: Callable[[str], None]) -> None:
        self.processes, self.grad_accum, self.say = processes, grad_accum, say

    def state_dict(self) -> dict[str, int]:
        return {"processes": self.processes, "grad_accum": self.grad_accum}

    def refusal(self, saved: dict[str, int]) -> str:
        """Why a run split as `saved` cannot go on split as this one: the products differ."""
        self.validate(saved)
        was, now = saved["processes"] * saved["grad_accum"], self.processes * self.grad_accum
        return (f"{saved['processes']} processes x train.grad_accum {saved['grad_accum']} = {was} micro-batches a "
                f"step; this one has {self.processes} x {self.grad_accum} = {now}: resume it with processes x "
                f"train.grad_accum = {was}, or move or delete that directory to start afresh")

    def validate(self, state: Any) -> None:
        """Refuse a split that is not one, before anything is loaded."""
        if not (isinstance(state, dict) and state.keys() == {"processes", "grad_accum"}
                and all(isinstance(n, int) and n >= 1 for n in state.values())):
            raise ValueError(f"its topology {state!r} is not a number of processes and of micro-batches on each")

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.validate(state)
        if state != self.state_dict():
            self.say(f"topology changed: the run was trained on {state['processes']} processes x "
                     f"{state['grad_accum']} micro-batches a step and goes on on {self.processes} x {self.grad_accum}, "
                     f"the same {self.processes * self.grad_accum} micro-batches a step in the same order")


class UnwrappedModel:
    """The model's own weights, without what Accelerate (DDP, compile) wraps around it."""

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module) -> None:
        self.acc, self.model = accelerator, model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.acc.unwrap_model(self.model, keep_torch_compile=False).state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.acc.unwrap_model(self.model, keep_torch_compile=False).load_state_dict(state)


def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


class CheckpointSchedule:
    """When to save. A checkpoint every `checkpoint_every_steps` steps and at the last step: spaced in
    steps, as the paper's were (10 minutes on 8 P100s: 1,400 base or 600 big steps), so the last N
    span the same stretch of training on any hardware. A snapshot when `checkpoint_every_minutes`
    have passed since the last save by the main process's clock, which every process learns with the
    step's other agreed flags (so all save at the same step)."""

    def __init__(self, params: TrainParams, is_main: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.params, self.is_main, self.clock = params, is_main, clock
        self.last_save = clock()

    def late(self) -> bool:
        """This process's clock says a snapshot is due (only the main process's counts)."""
        minutes = self.params.checkpoint_every_minutes
        return self.is_main and minutes > 0 and self.clock() - self.last_save >= 60 * minutes

    def due(self, step: int, late: bool) -> Literal["checkpoint", "snapshot"] | None:
        p = self.params
        if (p.checkpoint_every_steps > 0 and step % p.checkpoint_every_steps == 0) or step == p.max_steps:
            return "checkpoint"
        return "snapshot" if late else None

    def saved(self) -> None:
        self.last_save = self.clock()


class StopRequest:
    """SIGTERM (Slurm, Kubernetes, spot instances), SIGINT (Ctrl-C) and SIGUSR1 (Slurm's --signal) ask
    the run to stop after the step in progress, never in the middle of it; a second Ctrl-C stops at
    once. Installed only in the main thread, where Python delivers signals."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signum = 0  # the first signal received, 0 while none
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
