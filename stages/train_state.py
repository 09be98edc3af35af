"""The train stage's state as its checkpoints hold it: a part for each of the model's own weights, the
optimizer, the schedule, the loss scaler and the step's split over processes (stages/checkpoint.py's
Stateful parts; the sampler and the Trainer's progress are parts of their own), each of which says
what is wrong with a saved state before any is loaded. Random draws (dropout) are seeded by the
micro-batch they are for, so there is no generator state to keep. Also here: how a run is asked to
stop, and how its processes agree on each step without waiting on the device (Agreement).
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import torch

from stages.io import PipelineError, Stopped


def micro_batch_seed(seed: int, step: int, index: int) -> int:
    """The random seed of a step's `index`-th micro-batch over all processes (process r's a-th of W
    processes is a x W + r). Dropout is drawn from it, so the masks depend on which batch is trained,
    not on which process trains it: a run resumed on another split of the step draws the same ones,
    and no generator's state needs saving."""
    return int(np.random.SeedSequence([seed, step, index]).generate_state(1)[0])


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def check_tensors(saved: Any, live: Mapping[str, torch.Tensor], what: str) -> None:
    """ValueError unless `saved` has the tensors of `live`, each of its shape and dtype."""
    if not isinstance(saved, Mapping):
        raise ValueError(f"its {what} is not a mapping of names to tensors")
    if missing := sorted(live.keys() - saved.keys()):
        raise ValueError(f"its {what} lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    if extra := sorted(saved.keys() - live.keys()):
        raise ValueError(f"its {what} has {', '.join(extra[:3])}, which this run has not")
    for name, tensor in live.items():
        theirs = saved[name]
        if not isinstance(theirs, torch.Tensor) or theirs.shape != tensor.shape or theirs.dtype != tensor.dtype:
            shown = _describe(theirs) if isinstance(theirs, torch.Tensor) else type(theirs).__name__
            raise ValueError(f"its {what} {name} is {shown}, this run's {_describe(tensor)}")


class ModelState:
    """The model's own weights, whatever wraps it (DDP, compile): `unwrap` gives the model itself."""

    def __init__(self, unwrap: Callable[[], torch.nn.Module]) -> None:
        self.unwrap = unwrap

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.unwrap().state_dict()

    def check(self, state: Any, step: int) -> None:
        check_tensors(state, self.unwrap().state_dict(), "model weight")

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.unwrap().load_state_dict(state)


class OptimizerState:
    """The optimizer's moments, checked against the parameters they are for: a moment of another shape
    would be read out of bounds by the fused kernels."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def check(self, state: Any, step: int) -> None:
        groups = self.optimizer.param_groups
        if not (isinstance(state, dict) and isinstance(state.get("state"), dict)
                and isinstance(state.get("param_groups"), list) and len(state["param_groups"]) == len(groups)):
            raise ValueError(f"its optimizer state is not one of {len(groups)} parameter group(s)")
        params = [p for group in groups for p in group["params"]]
        ids = [i for group in state["param_groups"] if isinstance(group, dict) for i in group.get("params", ())]
        if ids != list(range(len(params))):
            raise ValueError(f"its optimizer state is for {len(ids)} parameters, this run has {len(params)}")
        for i, moments in state["state"].items():
            if not (isinstance(i, int) and 0 <= i < len(params) and isinstance(moments, dict)):
                raise ValueError(f"its optimizer state has an entry {i!r} for no parameter")
            for key, value in moments.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[i].shape:
                    raise ValueError(f"its optimizer's {key} of parameter {i} is {_describe(value)}, the "
                                     f"parameter {_describe(params[i])}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class SchedulerState:
    """The learning-rate schedule: its count of steps taken must be the checkpoint's step."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def check(self, state: Any, step: int) -> None:
        taken = state.get("last_epoch") if isinstance(state, dict) else None
        if taken != step:
            raise ValueError(f"its schedule says {taken!r} steps were taken, its file step {step}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


class ScalerState:
    """The fp16 loss scaler."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def check(self, state: Any, step: int) -> None:
        scale = state.get("scale") if isinstance(state, dict) else None
        if not (isinstance(scale, float) and scale > 0 and "_growth_tracker" in state):
            raise ValueError(f"its loss scaler state {state!r} has no positive scale")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state)


class Topology:
    """How each step is split: processes x micro-batches on each. A run may resume on another split
    of the same product (the sampler's stream is global); the change is said where it happens."""

    def __init__(self, processes: int, grad_accum: int, say: Callable[[str], None]) -> None:
        self.processes, self.grad_accum, self.say = processes, grad_accum, say

    def state_dict(self) -> dict[str, int]:
        return {"processes": self.processes, "grad_accum": self.grad_accum}

    def check(self, state: Any, step: int) -> None:
        """ValueError for a split that is not one; PipelineError for one of another product."""
        if not (isinstance(state, dict) and state.keys() == {"processes", "grad_accum"}
                and all(isinstance(n, int) and n >= 1 for n in state.values())):
            raise ValueError(f"its topology {state!r} is not a number of processes and of micro-batches on each")
        was, now = state["processes"] * state["grad_accum"], self.processes * self.grad_accum
        if was != now:
            raise PipelineError(
                f"the checkpoints hold a run of {state['processes']} processes x {state['grad_accum']} = {was} "
                f"micro-batches a step; this one has {self.processes} x {self.grad_accum} = {now}: resume it with "
                f"train.micro_batches {was} (or auto), or move or delete that directory to start afresh")

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state != self.state_dict():
            self.say(f"topology changed: the run was trained on {state['processes']} processes x "
                     f"{state['grad_accum']} micro-batches a step and goes on on {self.processes} x {self.grad_accum}, "
                     f"the same {self.processes * self.grad_accum} micro-batches a step in the same order")


class StopRequest:
    """SIGTERM (Slurm, Kubernetes, spot instances), SIGINT (Ctrl-C) and SIGUSR1 (Slurm's --signal) ask
    the run to stop after the step in progress, never in the middle of it; a second Ctrl-C stops at
    once. Installed only in the main thread, where Python delivers signals. Once a run has stopped
    and saved, SIGTERM and SIGUSR1 have nothing left to ask and stay ignored to the process's end:
    among several workers, the launcher sends SIGTERM to the others as soon as one exits 75, and
    their orderly exit (rank 0's MLflow run) must not become an interruption."""

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
            stopped = isinstance(error, Stopped) and s != signal.SIGINT
            signal.signal(s, signal.SIG_IGN if stopped else handler)


@dataclass(frozen=True)
class Agreed:
    """What every process learned of every process's step `step`."""

    step: int
    nonfinite: dict[int, float]  # process -> its loss, where it was not finite
    stop: int  # the signal any process was asked to stop by; 0: none
    late: bool  # any process's clock says a snapshot is due


class Agreement:
    """The one thing processes must agree on each step (was any loss not finite, was any asked to stop,
    is a snapshot due), reduced on the device and read back one step late, so that no step waits on
    the device: by the time step n + 1 is queued, step n's table has long been copied into pinned host
    memory. The update of a step whose loss was not finite anywhere is skipped on the device
    (`found_inf`), so the step it is read at has nothing to undo."""

    def __init__(self, device: torch.device, processes: int, rank: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.device, self.processes, self.rank, self.reduce = device, processes, rank, reduce
        on_gpu = device.type == "cuda"
        self._host = torch.zeros(processes, 4, pin_memory=on_gpu)  # per process: not finite, loss, stop, late
        self._rows = self._host.numpy()  # the same memory, read without asking torch
        self._copied = torch.cuda.Event() if on_gpu else None
        self._pending: int | None = None  # the step whose table is on its way

    def send(self, step: int, loss_sum: torch.Tensor, stop: int, late: bool) -> torch.Tensor:
        """Start agreeing on `step`; returns found_inf, 1.0 on the device where any process's loss was
        not finite. Whatever was pending must have been received."""
        assert self._pending is None, f"step {self._pending}'s agreement was never received"
        bad = torch.isfinite(loss_sum).logical_not().float()
        local = torch.stack([bad, loss_sum.float(), bad.new_full((), float(stop)), bad.new_full((), float(late))])
        table = bad.new_zeros(self.processes, 4)
        table[self.rank] = local  # filled on the device: no copy, no wait
        if self.processes > 1:
            table = self.reduce(table)
        self._host.copy_(table, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self._pending = step
        return table[:, 0].amax()

    def receive(self) -> Agreed | None:
        """The pending step's agreement (waiting for its copy, if it is still under way), or None."""
        if self._pending is None:
            return None
        if self._copied is not None:
            self._copied.synchronize()
        rows, step, self._pending = self._rows, self._pending, None
        return Agreed(step, {r: float(rows[r, 1]) for r in range(self.processes) if rows[r, 0]},
                      int(rows[:, 2].max()), bool(rows[:, 3].any()))
