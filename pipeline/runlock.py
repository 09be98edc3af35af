"""One pipeline run at a time in a checkout. A run writes its presets and overrides into params.yaml and
each stage reads it when it starts, so a second run started beside the first would change the first's
later stages, and DVC would record the first's outputs under the second's parameters. The commands
that write params.yaml (`run`, `quickstart`, `preset`, a deployment's flow run) hold this lock while
they work; another refuses at once, naming the holder. DVC's own commands (`dvc repro`, `dvc exp run`)
do not know of it.

The lock is an flock on .dvc/tmp/pipeline-run.lock: the system releases it when the holder ends,
however it ends, so a killed run leaves nothing to clean up."""
from __future__ import annotations

import fcntl
import os
import shlex
import sys
import time
from typing import IO

from pipeline.config import ROOT
from stages.io import PipelineError

LOCK = ROOT / ".dvc" / "tmp" / "pipeline-run.lock"
_held: IO[str] | None = None  # this process's hold, for the rest of its life


def hold() -> None:
    """Hold the checkout's run lock until this process ends (a second call does nothing), or refuse, naming
    what holds it."""
    global _held
    if _held is not None:
        return
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    f = open(LOCK, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the process's life
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process"
        f.close()
        raise PipelineError(f"another pipeline run is working in this checkout ({holder}): two at once would change "
                            "each other's params.yaml. Wait for it to end or stop it (Ctrl-C); for experiments side "
                            "by side, queue them (dvc exp run --queue, docs/experiments.md)") from None
    f.seek(0)
    f.truncate()
    command = ["python", "-m", "pipeline", *sys.argv[1:]] if sys.argv[0].endswith("__main__.py") else sys.argv
    f.write(f"pid {os.getpid()}, `{shlex.join(command)}`, since {time.strftime('%H:%M:%S')}\n")
    f.flush()
    _held = f
