"""The screenshots of docs/experiments.md, taken anew from live servers on 127.0.0.1 by headless Chromium:

    python docs/screenshots.py     # about 10 minutes on 2 cores; needs Chromium (Debian: apt install chromium)

In a scratch copy of this checkout (nothing of the checkout is touched but the three PNG files): a
Prefect server; a quickstart flow photographed while its train stage works (the flow run, then the train
task run); a second quickstart with another feed-forward width; and the MLflow UI comparing the two
train runs. Retake them whenever the UIs or the flow's output change.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the checkout's packages
from bench.common import clone  # noqa: E402 - after the path above
DOCS = ROOT / "docs"
SIZE = "1500,950"
STEPS = 600  # long enough to be photographed while it trains
PHOTO_AT = "step 150/"  # the flow's train stage a quarter done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], Any], seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if result := condition():
                return result
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"screenshots: timed out waiting for {what}")


def answers(url: str) -> bool:
    return urllib.request.urlopen(url, timeout=2).status == 200  # noqa: S310 - 127.0.0.1 only


def serve(command: list[str], health: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    server = subprocess.Popen(command, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    wait_for(lambda: answers(health) or server.poll() is not None, 180, health)
    if server.poll() is not None:
        raise SystemExit(f"screenshots: {command[2:5]} exited: {log.read_text()[-2000:]}")
    return server


def flow(project: Path, env: dict[str, str], *overrides: str) -> tuple[subprocess.Popen, list[str]]:
    """A quickstart run of the flow, its output lines collected as they come."""
    command = [sys.executable, "-m", "pipeline", "quickstart", "-S", f"train.max_steps={STEPS}",
               "-S", "train.log_every=25", *[a for o in overrides for a in ("-S", o)]]
    proc = subprocess.Popen(command, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines


def prefect_api(base: str, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(f"{base}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=10))  # noqa: S310 - 127.0.0.1 only


def photograph(chromium: str, url: str, out: Path) -> None:
    """The page once its scripts have run and its data has loaded (virtual time runs ahead of the clock)."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={profile}", f"--window-size={SIZE}", "--virtual-time-budget=60000",
                        f"--screenshot={out}", url], check=True, capture_output=True, timeout=120)
    print(f"wrote {out.relative_to(ROOT)} from {url}", flush=True)


def main() -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        raise SystemExit("screenshots: no Chromium found (Debian: apt install chromium)")
    with tempfile.TemporaryDirectory(prefix="screenshots-") as tmp:
        work = Path(tmp)
        project = clone(work / "project")
        prefect, mlflow = free_port(), free_port()
        api = f"http://127.0.0.1:{prefect}/api"
        env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "PREFECT_API_URL": api,
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONUNBUFFERED": "1"}
        env.pop("MLFLOW_TRACKING_URI", None)  # the copy's own store
        servers = [serve([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                          str(prefect)], f"{api}/health", env, work / "prefect.log")]
        try:
            first, lines = flow(project, env)
            wait_for(lambda: any(PHOTO_AT in line for line in lines) or first.poll() is not None, 1800,
                     "the train stage")
            [run] = prefect_api(api, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})
            [train] = prefect_api(api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}},
                                                             "task_runs": {"name": {"any_": ["train"]}}})
            base = api.removesuffix("/api")
            photograph(chromium, f"{base}/runs/flow-run/{run['id']}", DOCS / "prefect-ui.png")
            photograph(chromium, f"{base}/runs/task-run/{train['id']}", DOCS / "prefect-train-task.png")
            if first.wait() != 0:
                raise SystemExit("screenshots: the first flow failed:\n" + "".join(lines[-30:]))
            second, lines = flow(project, env, "train.max_steps=200", "model.d_ff=256")
            if second.wait() != 0:
                raise SystemExit("screenshots: the second flow failed:\n" + "".join(lines[-30:]))
            store = f"sqlite:///{project / 'mlflow.db'}"
            servers.append(serve([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store, "--host",
                                  "127.0.0.1", "--port", str(mlflow), "--workers", "1"],
                                 f"http://127.0.0.1:{mlflow}/health", env, work / "mlflow.log"))
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=store)
            experiment = client.get_experiment_by_name("transformer-en-de").experiment_id
            runs = client.search_runs([experiment], "tags.stage = 'train'", order_by=["attributes.start_time ASC"])
            ids = json.dumps([r.info.run_id for r in runs[-2:]])
            query = urllib.parse.urlencode({"runs": ids, "experiments": json.dumps([experiment])})
            photograph(chromium, f"http://127.0.0.1:{mlflow}/#/compare-runs?{query}", DOCS / "mlflow-compare.png")
        finally:
            for server in servers:
                os.killpg(server.pid, 9)


if __name__ == "__main__":
    main()
