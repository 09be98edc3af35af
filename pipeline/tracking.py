"""MLflow records: one run per stage execution, nested under one parent run per pipeline execution.

The store is a SQLite file inside the working tree unless MLFLOW_TRACKING_URI says otherwise. Runs
are driven through MlflowClient, never the fluent API, so a run's end state is ours to set: FAILED
when the stage raises, KILLED when it is interrupted or terminated, and a stage killed outright
(SIGKILL) is marked FAILED by the parent when its process is gone. MLflow is imported lazily, so the
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
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pipeline.config import ROOT
from stages.io import Stopped

PARENT_ENV = "PIPELINE_MLFLOW_PARENT_RUN_ID"
# MLflow 3 opens an experiment of this kind in its model-training view (runs, metrics, charts), not
# the GenAI view of traces and evaluations.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
PIPELINE_TAG = ("run_kind", "pipeline")  # the parent run of a whole pipeline execution
DEFAULT_DB = ROOT / "mlflow.db"
ARTIFACTS = ROOT / "mlartifacts"


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


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'test': {'bleu': 30.1}} -> {'test_bleu': 30.1}."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}_"))
        else:
            out[f"{prefix}{k}"] = v
    return out


class Tracker:
    """Logs into one MLflow run; a no-op where MLflow is not installed."""

    def __init__(self, client: Any, run_id: str | None, experiment_id: str | None = None) -> None:
        self.client, self.run_id, self.experiment_id = client, run_id, experiment_id
        self.outcome = "FINISHED"  # the status the run ends with when nothing is raised
        self.logged: set[str] = set()  # metric names logged so far

    def log_metrics(self, metrics: dict[str, Any], step: int = 0) -> None:
        if self.run_id is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in flatten(metrics).items()
                 if isinstance(v, int | float) and not isinstance(v, bool)]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)
            self.logged.update(m.key for m in batch)

    def log_params(self, params: dict[str, Any]) -> None:
        if self.run_id is None:
            return
        from mlflow.entities import Param

        items = [Param(k, json.dumps(v) if isinstance(v, list | tuple | dict) else str(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.run_id is not None:
            for k, v in tags.items():
                self.client.set_tag(self.run_id, k, v)

    def log_artifact(self, path: str | Path, subdir: str | None = None) -> None:
        path = Path(path)
        if self.run_id is None or not path.exists():
            return
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), subdir or path.name)
        else:
            self.client.log_artifact(self.run_id, str(path), subdir)


def is_main_process() -> bool:
    """Under torchrun or accelerate launch only rank 0 tracks and writes; RANK is how they say it."""
    return int(os.environ.get("RANK", "0")) == 0


def _client_and_experiment(experiment: str) -> tuple[Any, str] | None:
    if not is_main_process():
        return None
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        print("note: mlflow is not installed; this run is not tracked")
        return None
    from filelock import FileLock
    from mlflow.exceptions import MlflowException

    uri = tracking_uri()
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
def _terminated_on_exit(client: Any, run_id: str, outcome: Callable[[], str] = lambda: "FINISHED") -> Iterator[None]:
    """FINISHED on success, KILLED on Ctrl-C or SIGTERM (or a stage that stopped on one, its work
    saved), FAILED on any other error. A handler the stage set meanwhile (a stopped run's, which
    ignores SIGTERM to its end) is left in place."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except (KeyboardInterrupt, Stopped):
        client.set_terminated(run_id, "KILLED")
        raise
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    else:
        client.set_terminated(run_id, outcome())
    finally:
        if signal.getsignal(signal.SIGTERM) is on_term:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _system_metrics(run_id: str) -> Iterator[None]:
    """CPU, memory, disk, network (and GPU, where pynvml is installed) every 10 s, as MLflow's
    system/* metrics of the run."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, sampling_interval=10, tracking_uri=tracking_uri())
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()
        # MLflow publishes at the end of each interval: publish the last, partial one too, so that a stage
        # shorter than one interval still records its use
        if last := monitor.aggregate_metrics():
            monitor.publish_metrics(last)
            monitor.mlflow_logger.flush()


@contextlib.contextmanager
def stage_run(stage: str, experiment: str, params: dict[str, Any], tags: dict[str, str],
              system_metrics: bool = False) -> Iterator[Tracker]:
    """An MLflow run for one stage, nested under the pipeline's parent run when there is one."""
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
    run = client.create_run(experiment_id, run_name=stage, tags=all_tags)
    tracker = Tracker(client, run.info.run_id, experiment_id)
    print(f"{RUN_LINE}{run_url(tracker)}", flush=True)
    monitor = _system_metrics(run.info.run_id) if system_metrics else contextlib.nullcontext()
    with _terminated_on_exit(client, run.info.run_id), monitor:
        tracker.log_params(params)
        yield tracker


@contextlib.contextmanager
def pipeline_run(experiment: str, name: str, params: dict[str, Any], tags: dict[str, str]) -> Iterator[Tracker]:
    """The parent run of one pipeline execution, named e.g. 'quickstart warmup_steps=150'; stage
    processes started inside nest under it."""
    found = _client_and_experiment(experiment)
    if found is None:
        yield Tracker(None, None)
        return
    client, experiment_id = found
    run = client.create_run(experiment_id, run_name=name,
                            tags={"git_commit": git_commit(), **environment_tags(), PIPELINE_TAG[0]: PIPELINE_TAG[1],
                                  **tags})
    run_id = run.info.run_id
    tracker = Tracker(client, run_id, experiment_id)
    os.environ[PARENT_ENV] = run_id
    try:
        with _terminated_on_exit(client, run_id, lambda: tracker.outcome):
            tracker.log_params(params)
            yield tracker
    finally:
        os.environ.pop(PARENT_ENV, None)
        fail_orphans(client, experiment_id, run_id)


def fail_orphans(client: Any, experiment_id: str, parent_run_id: str) -> None:
    """Stage runs still RUNNING once the pipeline is over lost their process (e.g. SIGKILL): FAILED."""
    for child in client.search_runs([experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}' "
                                                     "and attributes.status = 'RUNNING'"):
        client.set_terminated(child.info.run_id, "FAILED")


RUN_LINE = "mlflow run: "  # what a stage prints first: where its live run is, for the flow to link


def run_url_in(line: str) -> str | None:
    """The MLflow run address a stage announced in this line of its output, if it is that line."""
    return line.strip().removeprefix(RUN_LINE) if line.strip().startswith(RUN_LINE) else None


def run_url(tracker: Tracker) -> str | None:
    """Where the MLflow UI (`mlflow ui`, 127.0.0.1:5000 unless MLFLOW_UI_URL says otherwise) shows this run."""
    if tracker.run_id is None:
        return None
    ui = os.environ.get("MLFLOW_UI_URL", "http://127.0.0.1:5000").rstrip("/")
    return f"{ui}/#/experiments/{tracker.experiment_id}/runs/{tracker.run_id}"
