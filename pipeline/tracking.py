"""MLflow records: one run per stage execution, nested under one parent run per pipeline execution.

The store is a SQLite file inside the working tree unless MLFLOW_TRACKING_URI says otherwise (a
team's `mlflow server`). Runs are driven through MlflowClient, never the fluent API, so a run's end
state is ours to set: FAILED when the stage raises, KILLED when it is interrupted or terminated, and
a stage killed outright (SIGKILL) is marked FAILED by the parent when its process is gone.

Tracking never stops or stalls the work: records go to the server from a thread (pipeline/unsent.py),
a server that cannot be reached at the start leaves the stage untracked with one warning, one lost
mid-run costs one warning line, and the stage's end waits for it at most PIPELINE_MLFLOW_FLUSH_SECONDS
(30) before noting what it missed for `python -m pipeline sync`. MLflow is imported lazily, so the
stages still run on machines without it (tracking is then skipped with a notice).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pipeline import unsent
from pipeline.unsent import flatten
from pipeline.config import CHECKOUT, ROOT
from stages.io import Stopped

PARENT_ENV = "PIPELINE_MLFLOW_PARENT_RUN_ID"
# MLflow 3 opens an experiment of this kind in its model-training view (runs, metrics, charts), not
# the GenAI view of traces and evaluations.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
PIPELINE_TAG = ("run_kind", "pipeline")  # the parent run of a whole pipeline execution
DEFAULT_DB = CHECKOUT / "mlflow.db"
ARTIFACTS = CHECKOUT / "mlartifacts"


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{DEFAULT_DB}"


def artifact_location(uri: str) -> str | None:
    """Artifacts of a SQLite store go beside its file (mlartifacts/), not into ./mlruns of whatever
    directory a stage runs in; other stores keep their own default."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / ARTIFACTS.name).as_uri()
    return None


def experiment_name(src_lang: str, tgt_lang: str) -> str:
    return f"transformer-{src_lang}-{tgt_lang}"


LOCK = ROOT / "requirements.lock"


@functools.cache
def environment_tags() -> dict[str, str]:
    """The environment a run ran in: requirements.lock's digest, whether the installed packages are
    the lock's (`make setup` installs them; anything else is named), and torch's build."""
    from importlib import metadata

    try:
        text = LOCK.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {"env.lock": "none"}
    differ = []
    for line in text.splitlines():
        name, sep, pinned = line.partition("==")
        if not sep or line.startswith("#"):
            continue
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = "missing"
        if installed != pinned:
            differ.append(f"{name} {installed} (lock {pinned})")
    return {"env.lock": hashlib.sha256(text.encode()).hexdigest()[:16],
            "env.matches_lock": "yes" if not differ else f"no: {len(differ)} differ, e.g. {', '.join(differ[:3])}",
            "env.torch": metadata.version("torch")}


def git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Tracker:
    """Logs into one MLflow run without waiting on the server (a no-op where there is no run)."""

    def __init__(self, client: Any, run_id: str | None, experiment_id: str | None = None, uri: str = "") -> None:
        self.client, self.run_id, self.experiment_id, self.uri = client, run_id, experiment_id, uri
        self.outcome = "FINISHED"  # the status the run ends with when nothing is raised
        self.logged: set[str] = set()  # metric names logged so far
        self.sender = unsent.Sender(client, uri, run_id) if run_id is not None else None

    def log_metrics(self, metrics: dict[str, Any], step: int = 0) -> None:
        numbers = {k: v for k, v in flatten(metrics).items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if self.sender is not None and numbers:
            self.sender.put(unsent.Record("metrics", numbers, step))
            self.logged.update(numbers)

    def log_params(self, params: dict[str, Any]) -> None:
        if self.sender is not None:
            self.sender.put(unsent.Record("params", {k: json.dumps(v) if isinstance(v, list | tuple | dict) else str(v)
                                                     for k, v in params.items()}))

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.sender is not None:
            self.sender.put(unsent.Record("tags", dict(tags)))

    def log_artifact(self, path: str | Path, subdir: str | None = None) -> None:
        if self.sender is not None and Path(path).exists():
            self.sender.put(unsent.Record("artifact", (str(path), subdir)))

    def finish(self, status: str, stage: str, summary: Path | None = None, curves: tuple[Path, ...] = ()) -> None:
        """Set the run's final status and wait for the server at most the flush bound. Metrics it missed
        while away are replayed from the stage's files if it answers again in time; whatever is still
        unsent is noted for `python -m pipeline sync`, in one line."""
        if self.sender is None:
            return
        sender = self.sender
        self.sender = None
        sender.put(unsent.Record("status", status))
        start = time.monotonic()
        left = sender.close(unsent.flush_seconds())
        complete = not left and not sender.dropped
        if not left and sender.dropped and time.monotonic() - start < unsent.flush_seconds():
            try:  # the server came back: the metrics not kept while it was away, from the files, now
                unsent.replay(self.client, self.run_id, summary, list(curves))
                complete = True
            except Exception:  # noqa: BLE001 - lost again: the note below says so
                pass
        if not complete:
            note = unsent.write_note(self.uri, self.run_id, stage, left, summary, list(curves))
            print(f"warning: mlflow: {len(left)} records of this {stage} run did not reach {self.uri} within "
                  f"{unsent.flush_seconds():.0f} s (lost at step {sender.lost_at}); `python -m pipeline sync` sends "
                  f"them, with the metrics of its files, once it answers (noted in {unsent.NOTES.name}/{note.name})",
                  flush=True)


def is_main_process() -> bool:
    """Under torchrun or accelerate launch only rank 0 tracks and writes; RANK is how they say it."""
    return int(os.environ.get("RANK", "0")) == 0


def _client_and_experiment(experiment: str) -> tuple[Any, str] | None:
    if not is_main_process():
        return None
    try:
        import mlflow  # noqa: F401
    except ImportError:
        print("note: mlflow is not installed; this run is not tracked")
        return None

    uri = tracking_uri()
    for key, value in unsent.HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        return _experiment(uri, experiment)
    except Exception as e:  # noqa: BLE001 - an unreachable or failing server costs the tracking, not the work
        print(f"warning: mlflow: the tracking server {uri} did not answer ({unsent.reason(e)}); this run goes on "
              "untracked, its results in its own files", flush=True)
        return None


def _experiment(uri: str, experiment: str) -> tuple[Any, str]:
    from filelock import FileLock
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    # Stages started at once against a store that does not exist yet (dvc queue start -j 4, several
    # training processes) would all create its schema, and the experiment, together: one at a time.
    with FileLock(_lock_file(uri), timeout=600):
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            try:
                return client, client.create_experiment(experiment, artifact_location=artifact_location(uri),
                                                        tags=dict([EXPERIMENT_KIND]))
            except MlflowException:  # created meanwhile by a process on another machine (a shared server)
                found = client.get_experiment_by_name(experiment)
                if found is None:
                    raise
        if found.tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:  # made by an earlier version
            client.set_experiment_tag(found.experiment_id, *EXPERIMENT_KIND)
    return client, found.experiment_id


def _lock_file(uri: str) -> Path:
    """Beside a SQLite store; for any other store, a file of this machine's named by its address."""
    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///"))
        db.parent.mkdir(parents=True, exist_ok=True)
        return db.with_name(db.name + ".lock")
    return Path(tempfile.gettempdir()) / f"mlflow-{hashlib.md5(uri.encode()).hexdigest()}.lock"


@contextlib.contextmanager
def _terminated_on_exit(tracker: Tracker, stage: str, summary: Path | None = None, curves_dir: Path | None = None,
                        outcome: Callable[[], str] = lambda: "FINISHED") -> Iterator[None]:
    """FINISHED on success, KILLED on Ctrl-C or SIGTERM (or a stage that stopped on one, its work
    saved), FAILED on any other error; then the tracker's records are flushed (within its bound). A
    handler the stage set meanwhile (a stopped run's, which ignores SIGTERM to its end) is left in place."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    status = "FAILED"
    try:
        yield
        status = outcome()
    except (KeyboardInterrupt, Stopped):
        status = "KILLED"
        raise
    finally:
        if signal.getsignal(signal.SIGTERM) is on_term:
            signal.signal(signal.SIGTERM, previous)
        curves = tuple(sorted(curves_dir.glob("*.csv"))) if curves_dir is not None and curves_dir.is_dir() else ()
        tracker.finish(status, stage, summary, curves)


class _SystemMetrics:
    """CPU, memory, disk, network (and GPU, where pynvml is installed) sampled every `interval`
    seconds by MLflow's own monitors, logged as the run's system/* metrics through the tracker's queue
    (MLflow's monitor thread would call the server itself, and stop or stall with it)."""

    def __init__(self, tracker: Tracker, interval: float = 10.0) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.tracker, self.interval, self.step = tracker, interval, 0
        self.sampler = SystemMetricsMonitor(tracker.run_id, sampling_interval=interval, tracking_uri=tracker.uri)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="system-metrics", daemon=True)

    def _publish(self) -> None:
        if metrics := self.sampler.aggregate_metrics():
            self.tracker.log_metrics({f"system/{k}": v for k, v in metrics.items()}, self.step)
            self.step += 1
        for monitor in self.sampler.monitors:
            monitor.clear_metrics()

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            self.sampler.collect_metrics()
            self._publish()

    def __enter__(self) -> _SystemMetrics:
        self.sampler.collect_metrics()
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()
        self.sampler.collect_metrics()  # the last, partial interval: a short stage still records its use
        self._publish()


def _run(client: Any, experiment_id: str, name: str, tags: dict[str, str]) -> Tracker:
    """A new run's tracker, or an untracked one where the server does not take the run."""
    uri = tracking_uri()
    try:
        run = client.create_run(experiment_id, run_name=name, tags=tags)
    except Exception as e:  # noqa: BLE001 - the server lost since the experiment was read
        print(f"warning: mlflow: the tracking server {uri} did not take the run ({unsent.reason(e)}); it goes on "
              "untracked, its results in its own files", flush=True)
        return Tracker(None, None)
    return Tracker(client, run.info.run_id, experiment_id, uri)


@contextlib.contextmanager
def stage_run(stage: str, experiment: str, params: dict[str, Any], tags: dict[str, str],
              system_metrics: bool = False, summary: Path | None = None,
              curves_dir: Path | None = None) -> Iterator[Tracker]:
    """An MLflow run for one stage, nested under the pipeline's parent run when there is one.
    `summary` (metrics/<stage>.json) and the CSV files of `curves_dir` are the stage's own record of
    its metrics, from which what the server misses is replayed."""
    found = _client_and_experiment(experiment)
    if found is None:
        yield Tracker(None, None)
        return
    client, experiment_id = found
    all_tags = {"stage": stage, "git_commit": git_commit(), **environment_tags(), **tags}
    if parent := os.environ.get(PARENT_ENV):
        all_tags["mlflow.parentRunId"] = parent
    if experiment_run := os.environ.get("DVC_EXP_NAME"):  # run as a DVC experiment (dvc exp run, the queue)
        all_tags["dvc_experiment"] = experiment_run
    tracker = _run(client, experiment_id, stage, all_tags)
    if tracker.run_id is None:
        yield tracker
        return
    print(f"{RUN_LINE}{run_url(tracker)}{served_by(tracker)}", flush=True)
    with _terminated_on_exit(tracker, stage, summary, curves_dir):
        tracker.log_params(params)
        with _SystemMetrics(tracker) if system_metrics else contextlib.nullcontext():
            yield tracker


@contextlib.contextmanager
def pipeline_run(experiment: str, name: str, params: dict[str, Any], tags: dict[str, str],
                 summary: Path | None = None) -> Iterator[Tracker]:
    """The parent run of one pipeline execution, named e.g. 'quickstart warmup_steps=150'; stage
    processes started inside nest under it."""
    found = _client_and_experiment(experiment)
    tracker = Tracker(None, None) if found is None else _run(
        found[0], found[1], name, {"git_commit": git_commit(), **environment_tags(), PIPELINE_TAG[0]: PIPELINE_TAG[1],
                                   **tags})
    if tracker.run_id is None:
        yield tracker
        return
    os.environ[PARENT_ENV] = tracker.run_id
    try:
        with _terminated_on_exit(tracker, "pipeline", summary, outcome=lambda: tracker.outcome):
            tracker.log_params(params)
            yield tracker
    finally:
        os.environ.pop(PARENT_ENV, None)
        fail_orphans(tracker)


def fail_orphans(parent: Tracker) -> None:
    """Stage runs still RUNNING once the pipeline is over lost their process (e.g. SIGKILL): FAILED.
    A stage whose end could not reach the server is left as it is, for `python -m pipeline sync`."""
    noted = {p.stem for p in unsent.NOTES.glob("*.json")} if unsent.NOTES.is_dir() else set()
    try:
        for child in parent.client.search_runs([parent.experiment_id],
                                               f"tags.mlflow.parentRunId = '{parent.run_id}' "
                                               "and attributes.status = 'RUNNING'"):
            if child.info.run_id not in noted:
                parent.client.set_terminated(child.info.run_id, "FAILED")
    except Exception as e:  # noqa: BLE001 - the server away: they stay RUNNING until it answers
        print(f"warning: mlflow: could not check the stage runs on {parent.uri} ({unsent.reason(e)})", flush=True)


RUN_LINE = "mlflow run: "  # what a stage prints first: where its live run is, for the flow to link


def run_url_in(line: str) -> str | None:
    """The MLflow run address a stage announced in this line of its output, if it is that line."""
    line = line.strip()
    return line.removeprefix(RUN_LINE).split(" ", 1)[0] if line.startswith(RUN_LINE) else None


def run_url(tracker: Tracker) -> str | None:
    """Where this run is seen: on the tracking server itself for an http(s) store (or MLFLOW_UI_URL),
    else on the `mlflow ui` that serves the store (`served_by` says how to start it)."""
    if tracker.run_id is None:
        return None
    ui = os.environ.get("MLFLOW_UI_URL") or (tracker.uri if tracker.uri.startswith(("http://", "https://")) else
                                            "http://127.0.0.1:5000")
    return f"{ui.rstrip('/')}/#/experiments/{tracker.experiment_id}/runs/{tracker.run_id}"


def served_by(tracker: Tracker) -> str:
    """' (served by: mlflow ui ...)' where the run's address is a UI to start, not a server's."""
    if os.environ.get("MLFLOW_UI_URL") or tracker.uri.startswith(("http://", "https://")):
        return ""
    return f" (served by: mlflow ui --backend-store-uri {tracker.uri})"
