"""A training run's checkpoints, with one owner: which run they belong to (its identity and the folder
it names), when they are written, writing and pruning them, and resuming from the newest sound one.

The training state is a set of named parts that save and load themselves (Stateful) and say what is
wrong with a saved state before anything is loaded (`check`). A resumption reads the newest file,
checks its run and every part, and only then loads them all; a file that does not read, or a part
that is damaged, is skipped with a warning naming file and part for the one before, and the damaged
file is moved aside, so a run that went back in steps never writes over a sound checkpoint and
averaging never takes a damaged one. The file formats are stages/model_files.py's.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from stages.io import PipelineError
from stages.model_files import Checkpoint, ModelMeta, checkpoint_path, list_checkpoints, make_current, \
    read_checkpoint, read_setup, remove_unfinished, write_checkpoint

SPLIT = "micro_batches_per_step"  # in the fingerprint beside the identity: what the topology part checks


class Stateful(Protocol):
    """A named part of the training state."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...

    def check(self, state: Any, step: int) -> None:
        """Raise ValueError saying what is wrong with `state`, this part as a checkpoint of step `step`
        saved it, if it would not load or would not be that step's; PipelineError if it is sound but
        this run cannot go on from it. Called for every part before any is loaded."""


@dataclass(frozen=True)
class Processes:
    """What the checkpoints need of the processes that train together."""

    is_main: bool
    say: Callable[[str], None]  # printed once, by the main process
    barrier: Callable[[], None]
    gather: Callable[[Any], list[Any]]  # every process's value, in rank order


@dataclass(frozen=True)
class Schedule:
    """When to save. A checkpoint every `every_steps` steps and at `last_step`: spaced in steps, as the
    paper's were (10 minutes on 8 P100s: 1,400 base or 600 big steps), so the last N span the same
    stretch of training on any hardware. A snapshot, for crash safety only, once `every_minutes` have
    passed since the last save by the main process's clock; `keep` checkpoints are kept."""

    every_steps: int
    every_minutes: float
    keep: int
    last_step: int


def setup_dir(root: str | Path, identity: dict[str, Any]) -> Path:
    """The folder of a run's checkpoints, named by a hash of what identifies the run."""
    return Path(root) / hashlib.md5(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def recorded_split(folder: Path) -> int | None:
    """The micro-batches a step of the run in `folder`, if it has a checkpoint to resume from."""
    setup = read_setup(folder) if list_checkpoints(folder, snapshots=True) else None
    return setup.get(SPLIT) if setup else None


def prune(directory: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints, and no snapshot older than the newest file of either kind.
    Snapshots never count towards `keep`, so they never push out a checkpoint that averaging needs."""
    for _, old in list_checkpoints(directory)[:-keep]:
        old.unlink()
    everything = list_checkpoints(directory, snapshots=True)
    for step, path in everything:
        if path.name.startswith("snapshot") and step < everything[-1][0]:
            path.unlink()


def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


class Checkpointer:
    """The checkpoints of one run: `identity` (what may not change between a run and its resumption)
    names its folder under `root`; `split` (micro-batches a step) is recorded beside it."""

    def __init__(self, root: str | Path, identity: dict[str, Any], split: int, parts: dict[str, Stateful],
                 schedule: Schedule, meta: ModelMeta, processes: Processes,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.identity, self.parts, self.schedule, self.meta = identity, parts, schedule, meta
        self.fingerprint = {**identity, SPLIT: split}
        self.folder = setup_dir(root, identity)
        self.processes, self.clock = processes, clock
        self.last_save = clock()

    # -- when ------------------------------------------------------------------------------------
    def late(self) -> bool:
        """This process's clock says a snapshot is due (only the main process's counts)."""
        minutes = self.schedule.every_minutes
        return self.processes.is_main and minutes > 0 and self.clock() - self.last_save >= 60 * minutes

    def due(self, step: int, late: bool) -> Literal["checkpoint", "snapshot"] | None:
        s = self.schedule
        if (s.every_steps > 0 and step % s.every_steps == 0) or step == s.last_step:
            return "checkpoint"
        return "snapshot" if late else None

    # -- writing ---------------------------------------------------------------------------------
    def save(self, step: int, snapshot: bool = False) -> Path:
        """A checkpoint (averaged later) or a snapshot (crash safety only) of every part; every process
        calls it, the main one writes."""
        states = {name: part.state_dict() for name, part in self.parts.items()}
        path = checkpoint_path(self.folder, step, snapshot)
        if self.processes.is_main:
            meta = replace(self.meta, steps=(step,))
            write_checkpoint(self.folder, Checkpoint(step, meta, self.fingerprint, states), snapshot)
            prune(self.folder, self.schedule.keep)
        self.processes.barrier()
        self.last_save = self.clock()
        return path

    def has_checkpoint(self) -> bool:
        return bool(list_checkpoints(self.folder))

    # -- resuming --------------------------------------------------------------------------------
    def start(self) -> int:
        """Make this run's folder the current one, clear what a killed save left, and resume from the
        newest sound checkpoint or snapshot, if any: the step to go on from (0: from the start). Every
        process must find the same one: on several nodes the folder is one that all of them read."""
        p = self.processes
        if p.is_main:
            for stale in remove_unfinished(self.folder):
                p.say(f"removed {stale}, left by a save that was cut short")
        p.say(f"checkpoints of this setup: {self.folder}")
        p.barrier()
        step, damaged = self._resume()
        steps = p.gather(step)
        if len(set(steps)) > 1:
            raise PipelineError(f"the processes found different checkpoints in {self.folder} (steps {steps}, by "
                                f"process): on several nodes it must be one folder all read, on a shared filesystem")
        if p.is_main:
            make_current(self.folder.parent, self.folder, self.fingerprint)  # the run, and its split
            for path in damaged:
                aside = path.with_name(path.name + ".damaged")
                os.replace(path, aside)
                p.say(f"moved {path} aside to {aside.name}, so that nothing takes it for a checkpoint")
        p.barrier()
        return step

    def _resume(self) -> tuple[int, list[Path]]:
        damaged = []
        for step, path in reversed(list_checkpoints(self.folder, snapshots=True)):
            try:
                checkpoint = read_checkpoint(path)
            except PipelineError as e:  # e.g. cut short by a full disk
                self.processes.say(f"warning: skipping {e}")
                damaged.append(path)
                continue
            try:
                self._check(checkpoint, step, path)
            except Damaged as e:
                self.processes.say(f"warning: skipping {path}: {e}")
                damaged.append(path)
                continue
            for name, part in self.parts.items():
                part.load_state_dict(checkpoint.parts[name])
            self.processes.say(f"resumed from {path} at step {step}")
            return step, damaged
        return 0, damaged

    def _check(self, checkpoint: Checkpoint, step: int, path: Path) -> None:
        """Refuse another run's checkpoint (PipelineError); find damage before anything is loaded (Damaged)."""
        theirs = {k: v for k, v in checkpoint.fingerprint.items() if k != SPLIT}
        if theirs != self.identity:
            raise PipelineError(
                f"{self.folder} holds a run of this setup with {', '.join(differences(theirs, self.identity))} "
                f"changed, which cannot be resumed so; move or delete that directory to start afresh")
        if checkpoint.step != step:
            raise Damaged(f"it says it is of step {checkpoint.step}")
        if checkpoint.parts.keys() != self.parts.keys():
            raise PipelineError(f"{path}: holds the parts "
                                f"{sorted(checkpoint.parts)}, this run has {sorted(self.parts)}")
        for name, part in self.parts.items():
            try:
                part.check(checkpoint.parts[name], step)
            except ValueError as e:
                raise Damaged(str(e)) from None
            except PipelineError as e:  # sound, but this run cannot go on from it
                raise PipelineError(f"{self.folder}: {e}") from None


class Damaged(Exception):
    """A checkpoint that does not read, or a part of it that would not load or is not of its step."""
