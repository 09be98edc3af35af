"""The train stage's command on several processes of this machine: its workers started by torch's
elastic launcher (the library under torchrun), each the same command with its rank, the exit status
theirs. `python -m pipeline.stage train` comes here when train.processes is more than one and it is
not a worker itself, so `dvc repro`, the Prefect flow and a deployment train on every GPU alike.

- Rank 0 writes to this command's output as one process does (its progress lines, its MLflow run);
  the others' lines come through prefixed `[rank<N>] ` and are kept for an error.
- SIGTERM, SIGINT and SIGUSR1 to this command (or its process group) go on to every worker, which
  stop after the same step, save it once and exit 75; a second Ctrl-C reaches them too and stops
  them at once (130). The launcher's own handlers are left to the signals it ends at once (SIGHUP,
  SIGQUIT), which it passes on and waits for.
- A worker that fails ends the others (the launcher stops them, killing what does not stop within
  SHUTDOWN seconds) and this command with its rank, exit status and last lines.
- A worker whose launcher is killed outright is sent SIGTERM (Linux's parent-death signal), so that
  it saves and stops rather than train on alone.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

LAUNCHED = "PIPELINE_LAUNCHER_PID"  # set in each worker's environment: the launcher's process id
SHUTDOWN = 120  # seconds a worker has to stop after the launcher asks, before it is killed
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
EXIT_STOPPED, EXIT_INTERRUPTED = 75, 130


def is_worker() -> bool:
    """Whether this process is one a launcher started (ours, torchrun or accelerate launch)."""
    return LAUNCHED in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def follow_launcher() -> None:
    """In a worker of ours: be sent SIGTERM if the launcher dies (Linux), and exit if it already has."""
    launcher = int(os.environ.get(LAUNCHED, "0"))
    if not launcher or not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != launcher:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def run_workers(processes: int, argv: list[str]) -> int:
    """`python -m pipeline.stage <argv>` on `processes` workers of this machine: the command's exit status."""
    import psutil
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    received: list[int] = []

    def relay(signum: int, frame: Any) -> None:
        received.append(signum)
        for worker in psutil.Process().children():
            try:
                os.kill(worker.pid, signum)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, relay) for s in RELAYED}
    os.environ[LAUNCHED] = str(os.getpid())
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))  # cores shared out
    quiet = logging.getLogger("torch.distributed.elastic")  # its log of a failure: this command says it below
    level, quiet.level = quiet.level, logging.CRITICAL
    logs = tempfile.TemporaryDirectory(prefix="pipeline-workers-")
    try:
        settings = dict(  # torchrun --standalone's, but for the signals this command passes on itself
            min_nodes=1, max_nodes=1, nproc_per_node=processes, run_id=str(uuid.uuid4()), rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
            log_line_prefix_template="[rank${rank}] ",
            logs_specs=DefaultLogsSpecs(log_dir=logs.name, tee={rank: Std.ALL for rank in range(1, processes)}),
            signals_to_handle="SIGHUP,SIGQUIT", shutdown_timeout=SHUTDOWN)
        known = {f.name for f in dataclasses.fields(LaunchConfig)}  # older torch: fewer settings
        config = LaunchConfig(**{key: value for key, value in settings.items() if key in known})
        elastic_launch(config, entrypoint=sys.executable)("-m", "pipeline.stage", *argv)
        return 0
    except ChildFailedError as e:
        return _outcome(e, received, Path(logs.name))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.environ.pop(LAUNCHED, None)
        quiet.level = level
        logs.cleanup()


def _outcome(error: Any, received: list[int], logs: Path) -> int:
    """The command's exit status when a worker did not end with 0, and its last line."""
    codes = {failure.exitcode for failure in error.failures.values()}
    asked = f", asked by {signal.Signals(received[0]).name}" if received else ""
    if codes == {EXIT_STOPPED}:
        print(f"stopped: every worker stopped after the same step and saved it{asked}; run the stage again to go on "
              f"from there", file=sys.stderr)
        return EXIT_STOPPED
    if codes <= {EXIT_STOPPED, EXIT_INTERRUPTED}:
        print(f"interrupted: the workers stopped at once{asked}; nothing of the step in progress is kept",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    rank, failure = error.get_first_failure()
    code = failure.exitcode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    print(f"error: worker {rank} of the train stage failed ({how}); {_last_lines(rank, logs)}", file=sys.stderr)
    return 1


def _last_lines(rank: int, logs: Path, count: int = 5) -> str:
    if rank == 0:
        return "its output is above"
    found = sorted(logs.rglob(f"attempt_*/{rank}/stderr.log"))
    lines = [line for line in found[-1].read_text(errors="replace").splitlines() if line.strip()] if found else []
    return "its last lines:\n" + "\n".join(lines[-count:]) if lines else "it printed nothing"
