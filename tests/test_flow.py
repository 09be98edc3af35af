"""What the Prefect flow shows of a stage while it works: each line as soon as it is printed, without
DVC's advice, training progress as a progress artifact and the stage's MLflow run as a link."""
import subprocess
import sys
import time

import pytest

from pipeline import config, flow, tracking
from stages.io import PipelineError
from stages.train_metrics import parse_progress, progress_line

STAGE = """
import time
for i in range(3):
    print(f"line {i} at {time.time()}", flush=True)
    time.sleep(1.5)
print("a bar without its newline", end="\\r", flush=True)
"""


def test_each_line_reaches_the_log_as_soon_as_it_is_printed():
    seen = []
    proc = subprocess.Popen([sys.executable, "-c", STAGE], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    flow._stream(proc, lambda line: seen.append((time.time(), line)))
    proc.wait()
    printed = [(arrived, float(line.rsplit(" ", 1)[1])) for arrived, line in seen if line.startswith("line")]
    assert len(printed) == 3 and max(arrived - at for arrived, at in printed) < 0.5  # not at the process's end
    assert seen[-1][1] == "a bar without its newline"


def test_dvc_advice_is_left_out_and_progress_and_the_run_become_artifacts(monkeypatch):
    logged, artifacts = [], []
    monkeypatch.setattr(flow, "create_link_artifact", lambda link, **k: artifacts.append(("link", link, k["key"])))
    monkeypatch.setattr(flow, "create_progress_artifact", lambda p, **k: artifacts.append(("progress", p, k)) or "id")
    monkeypatch.setattr(flow, "update_progress_artifact", lambda i, p, **k: artifacts.append(("update", p, k)))
    output = flow.StageOutput("train", type("Logger", (), {"info": lambda self, line: logged.append(line)})())
    lines = ["Running stage 'train':", f"{tracking.RUN_LINE}http://127.0.0.1:5000/#/experiments/1/runs/ab12",
             progress_line({"step": 20, "loss": 4.25, "tgt_tokens_per_sec": 12345.6}, 800),
             progress_line({"step": 40, "loss": 3.5, "tgt_tokens_per_sec": 13000.0}, 800),
             "Updating lock file 'dvc.lock'", "To track the changes with git, run:", "\tgit add dvc.lock",
             "To enable auto staging, run:", "\tdvc config core.autostage true",
             "Use `dvc push` to send your updates to remote storage."]
    for line in lines:
        output(line)
    assert logged == lines[:4] + ["Updating lock file 'dvc.lock'"]
    assert artifacts[0] == ("link", "http://127.0.0.1:5000/#/experiments/1/runs/ab12", "mlflow-train")
    assert artifacts[1][:2] == ("progress", 2.5) and artifacts[1][2]["key"] == "train-progress"
    assert artifacts[2][:2] == ("update", 5.0)
    assert artifacts[2][2]["description"] == "train: step 40 of 800, loss 3.500, 13,000 target tokens/s"


def test_the_progress_line_reads_back():
    line = progress_line({"step": 1400, "loss": 2.0625, "tgt_tokens_per_sec": 612345.4}, 100000)
    assert line == "step 1400/100000: loss 2.062, 612,345 target tokens/s"
    assert parse_progress(line) == (1400, 100000, 2.062, 612345.0)
    assert parse_progress("train: 10%|#| 1400/100000") is None and parse_progress("step 3/4 done") is None


def test_deploy_refuses_a_source_that_is_not_the_project_and_a_missing_server(tmp_path, monkeypatch):
    """Both before anything is registered: a worker could not run either deployment."""
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # never reached: refused first
    with pytest.raises(PipelineError, match=f"deploy --source {tmp_path}: neither a git URL nor a checkout"):
        flow.deploy("team", str(tmp_path))
    monkeypatch.delenv("PREFECT_API_URL")
    monkeypatch.setenv("PREFECT_PROFILES_PATH", str(tmp_path / "profiles.toml"))  # no profile's URL either
    with pytest.raises(PipelineError, match="deploy needs a Prefect server that outlives it"):
        flow.deploy("team", str(config.ROOT))
