"""What a tracking server did not take: records sent from a thread so that the work never waits on
the network, and, when the server is lost, a note of what it missed that `python -m pipeline sync`
sends once it answers again.

A stage's own files are the record (metrics/<stage>.json, and the train stage's curves, plots/*.csv);
MLflow is a view of them. So metrics the server missed are replayed from those files, never kept a
second time; what the files do not hold (the run's parameters, tags, artifacts and final status) is
kept in the note itself, `.mlflow-unsent/<run id>.json`. System metrics sampled while the server was
away are lost.
"""
from __future__ import annotations

import collections
import csv
import hashlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import CHECKOUT
from stages.io import atomic_write

NOTES = Path(os.environ.get("PIPELINE_MLFLOW_NOTES", CHECKOUT / ".mlflow-unsent"))  # the notes of what runs missed
FLUSH_ENV = "PIPELINE_MLFLOW_FLUSH_SECONDS"  # how long a stage's end waits for the server (default 30)
METRIC_RECORDS = 10_000  # metric batches held while the server is away; more are left to the files
THREAD = "mlflow-sender"

# Each request fails fast, so the sender notices a lost server in seconds and retries on its own
# schedule; a user's settings win.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def flush_seconds() -> float:
    return float(os.environ.get(FLUSH_ENV, "30"))


@dataclass
class Record:
    """One call to the tracking server: metrics at a step, params, tags, an artifact, or the final status."""

    kind: str  # "metrics", "params", "tags", "artifact" or "status"
    payload: Any
    step: int = 0


class _QuietSender(logging.Filter):
    """urllib3's retry warnings and MLflow's own, from the sender's thread: the sender says it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != THREAD


for _name in ("urllib3.connectionpool", "mlflow.utils.rest_utils", "mlflow.utils.request_utils"):
    logging.getLogger(_name).addFilter(_QuietSender())


class Sender:
    """Sends one run's records in order from a thread of its own. A record the server does not take
    is tried again (1, 2, 4 ... 30 s apart) while later ones wait; metric records past
    METRIC_RECORDS are dropped and counted (their files hold them). Losing the server is said once,
    in one line, as is its return."""

    def __init__(self, client: Any, uri: str, run_id: str, say: Any = print) -> None:
        self.client, self.uri, self.run_id, self.say = client, uri, run_id, say
        self.queue: collections.deque[Record] = collections.deque()
        self.dropped = 0  # metric records not kept
        self.step = 0  # the newest step seen, to say where the server was lost
        self.lost_at: int | None = None  # the step where it was first lost
        self.answering = True
        self._cond = threading.Condition()
        self._deadline: float | None = None  # set by close()
        self._thread = threading.Thread(target=self._run, name=THREAD, daemon=True)
        self._thread.start()

    def put(self, record: Record) -> None:
        """Queue `record`; never waits."""
        with self._cond:
            self.step = max(self.step, record.step)
            if record.kind == "metrics" and sum(r.kind == "metrics" for r in self.queue) >= METRIC_RECORDS:
                self.dropped += 1
                return
            self.queue.append(record)
            self._cond.notify()

    def _over(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _run(self) -> None:
        wait = 1.0
        while True:
            with self._cond:
                while not self.queue and self._deadline is None:
                    self._cond.wait()
                if not self.queue or self._over():
                    return
                record = self.queue[0]
            try:
                send(self.client, self.run_id, record)
            except Exception as e:  # noqa: BLE001 - any failure of the server or the network: keep it, try later
                if self.lost_at is None:
                    self.lost_at = self.step
                    self.say(f"warning: mlflow: the tracking server {self.uri} stopped answering at step {self.step} "
                             f"({reason(e)}); the stage goes on, its records stay in its files: `python -m "
                             "pipeline sync` sends them once the server answers")
                self.answering = False
                with self._cond:
                    self._cond.wait(wait if self._deadline is None else min(wait, self._deadline - time.monotonic()))
                wait = min(wait * 2, 30.0)
                continue
            wait = 1.0
            with self._cond:
                if self.queue and self.queue[0] is record:  # not handed back by close() meanwhile
                    self.queue.popleft()
            if not self.answering:
                self.answering = True
                self.say(f"mlflow: the tracking server {self.uri} answers again (lost at step {self.lost_at})")

    def close(self, timeout: float) -> list[Record]:
        """Wait up to `timeout` seconds for the queue to drain; the records left unsent (the thread
        sends nothing more once they are handed back)."""
        with self._cond:
            self._deadline = time.monotonic() + timeout
            self._cond.notify_all()
        self._thread.join(timeout + 1)
        with self._cond:
            self._deadline = 0.0  # over, whatever the thread was doing
            left = list(self.queue)
            self.queue.clear()
        return left


def send(client: Any, run_id: str, record: Record) -> None:
    """One record, through MLflow's client."""
    from mlflow.entities import Metric, Param

    if record.kind == "metrics":
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, float(v), now, record.step) for k, v in record.payload.items()])
    elif record.kind == "params":
        items = [Param(k, v) for k, v in record.payload.items()]
        for i in range(0, len(items), 100):
            client.log_batch(run_id, params=items[i : i + 100])
    elif record.kind == "tags":
        for k, v in record.payload.items():
            client.set_tag(run_id, k, v)
    elif record.kind == "artifact":
        path, subdir = record.payload
        if Path(path).is_dir():
            client.log_artifacts(run_id, path, subdir or Path(path).name)
        elif Path(path).exists():
            client.log_artifact(run_id, path, subdir)
    elif record.kind == "status":
        client.set_terminated(run_id, record.payload)
    else:
        raise ValueError(f"no record of kind {record.kind}")


def reason(e: BaseException) -> str:
    text = str(e)
    for known in ("Connection refused", "timed out", "Name or service not known", "Max retries exceeded"):
        if known in text:
            return known.lower()
    return text.splitlines()[0][:120] if text else type(e).__name__


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'test': {'bleu': 30.1}} -> {'test_bleu': 30.1}."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}_"))
        else:
            out[f"{prefix}{k}"] = v
    return out


# -- the note of what a run missed, and its replay -------------------------------------------------

def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_note(uri: str, run_id: str, stage: str, left: list[Record], summary: Path | None,
               curves: list[Path]) -> Path:
    """What the run missed beyond its files (params, tags, artifacts, status), and which files (with their
    digests, so a later run that rewrites them is noticed) hold its metrics."""
    merged: dict[str, Any] = {"params": {}, "tags": {}, "artifacts": [], "status": None}
    for r in left:
        if r.kind in ("params", "tags"):
            merged[r.kind].update(r.payload)
        elif r.kind == "artifact":
            merged["artifacts"].append([str(Path(r.payload[0]).resolve()), r.payload[1]])
        elif r.kind == "status":
            merged["status"] = r.payload
    files = [p for p in ([summary] if summary else []) + curves if p.is_file()]
    note = {"tracking_uri": uri, "run_id": run_id, "stage": stage, **merged,
            "summary": str(summary.resolve()) if summary and summary.is_file() else None,
            "curves": [str(p.resolve()) for p in curves if p.is_file()],
            "digests": {str(p.resolve()): digest(p) for p in files}}
    path = NOTES / f"{run_id}.json"
    with atomic_write(path) as f:
        json.dump(note, f, indent=1)
    return path


def metrics_in_files(summary: Path | None, curves: list[Path]) -> Iterator[tuple[str, float, int]]:
    """(key, value, step) of every metric the files hold: each curve row at its step; the summary's
    numbers (flattened) at its `steps`, but those the curves hold."""
    columns: set[str] = set()
    for path in curves:
        with open(path, encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                step = int(float(row.pop("step")))
                columns.update(row)
                for k, v in row.items():
                    if v not in ("", None):
                        yield k, float(v), step
    if summary is not None:
        data = json.loads(summary.read_text(encoding="utf-8"))
        for k, v in flatten(data).items():
            if k not in columns and isinstance(v, int | float) and not isinstance(v, bool):
                yield k, float(v), int(data.get("steps", 0))


def replay(client: Any, run_id: str, summary: Path | None, curves: list[Path]) -> int:
    """Log into the run every metric of the files it lacks (by key and step); returns how many."""
    from mlflow.entities import Metric

    have: dict[str, set[int]] = {}
    missing = []
    now = int(time.time() * 1000)
    for key, value, step in metrics_in_files(summary, curves):
        if key not in have:
            have[key] = {m.step for m in client.get_metric_history(run_id, key)}
        if step not in have[key] and not math.isnan(value):
            missing.append(Metric(key, value, now, step))
    for i in range(0, len(missing), 1000):
        client.log_batch(run_id, metrics=missing[i : i + 1000])
    return len(missing)


def sync(say: Any = print) -> int:
    """Send every note's missing records to its server: metrics from the files, then what the note
    keeps; a note is removed once all of it is sent. Returns the notes left."""
    from mlflow.tracking import MlflowClient

    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    notes = sorted(NOTES.glob("*.json")) if NOTES.is_dir() else []
    if not notes:
        say("sync: nothing unsent")
    left = 0
    for path in notes:
        note = json.loads(path.read_text(encoding="utf-8"))
        name = f"{note['stage']} run {note['run_id']} on {note['tracking_uri']}"
        gone = [p for p in note["digests"] if not Path(p).is_file()]
        changed = [p for p, d in note["digests"].items() if p not in gone and digest(Path(p)) != d]
        client = MlflowClient(tracking_uri=note["tracking_uri"])
        try:
            client.get_run(note["run_id"])
        except Exception as e:  # noqa: BLE001 - the server still away (or the run gone): kept for later
            say(f"sync: {name}: {reason(e)}; kept for the next sync")
            left += 1
            continue
        sent = 0
        if gone:  # a queued DVC experiment's files went with the copy DVC ran it in
            say(f"sync: {name}: {', '.join(gone)} gone since (removed, or a queued experiment's copy, which DVC "
                "deletes): its metrics are not sent from them")
        if changed:
            say(f"sync: {name}: {', '.join(changed)} changed since (a later run wrote them): its metrics are not "
                "sent from them")
        if not gone and not changed:
            summary = Path(note["summary"]) if note["summary"] else None
            sent = replay(client, note["run_id"], summary, [Path(p) for p in note["curves"]])
        for kind in ("params", "tags"):
            if note[kind]:
                send(client, note["run_id"], Record(kind, note[kind]))
        for artifact in note["artifacts"]:
            send(client, note["run_id"], Record("artifact", tuple(artifact)))
        status = note["status"]
        if status and client.get_run(note["run_id"]).info.status == "RUNNING":
            send(client, note["run_id"], Record("status", status))
        path.unlink()
        say(f"sync: {name}: sent {sent} metric values, {len(note['params'])} params, {len(note['tags'])} tags, "
            f"{len(note['artifacts'])} artifacts" + (f", status {status}" if status else ""))
    return left
