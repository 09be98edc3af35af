"""The train stage's state as checkpoints hold it, and when they are written.

The state is a set of named parts that each save and load themselves (the Trainer lists them): the
model's own weights, optimizer, schedule, sampler, progress, loss scaler and every process's random
number generators. A resumption must be of the same run: its fingerprint says what may not change.
"""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

if TYPE_CHECKING:
    from stages.train import TrainParams


class Stateful(Protocol):
    """A named part of the training state: it saves and restores itself."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class RngStates:
    """Every process's random number generators, gathered (a collective: every process calls it) so
    that one file resumes them all."""

    def __init__(self, process_index: int) -> None:
        self.process_index = process_index

    def state_dict(self) -> list[dict[str, torch.Tensor]]:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return gather_object([rng])  # one per process, in rank order

    def validate(self, states: Any) -> None:
        """Refuse a damaged state before anything is loaded (tried on a generator of its own)."""
        try:
            torch.Generator().set_state(states[self.process_index]["cpu"])
        except (RuntimeError, TypeError, KeyError, IndexError) as e:
            raise ValueError(f"its random number generator state is damaged ({type(e).__name__}: {e})") from None

    def load_state_dict(self, states: list[dict[str, torch.Tensor]]) -> None:
        self.validate(states)
        rng = states[self.process_index]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


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
