"""What the Prefect flow shows of a stage while it works: each line as soon as it is printed, without
DVC's advice, training progress as a progress artifact and the stage's MLflow run as a link; one run
at a time in a checkout; what cannot start (outside git; deploy or serve without a server) said in a line."""
import shutil
import subprocess
import sys
import time

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from conftest import copy_project, env_of
from servers import free_port
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
    output.artifacts.close()
    assert logged == lines[:4] + ["Updating lock file 'dvc.lock'"]
    assert ("link", "http://127.0.0.1:5000/#/experiments/1/runs/ab12", "mlflow-train") in artifacts
    progress = [a for a in artifacts if a[0] != "link"]  # the newest only, where the thread was behind
    assert progress[0][0] == "progress" and progress[0][2]["key"] == "train-progress"
    assert progress[-1][1] == 5.0
    assert progress[-1][2]["description"] == "train: step 40 of 800, loss 3.500, 13,000 target tokens/s"


def test_a_prefect_server_that_stalls_or_fails_never_holds_up_the_stage_output(monkeypatch):
    warned = []

    def stalled(*args, **kwargs):
        time.sleep(3)
        raise ConnectionError("All connection attempts failed")

    for name in ("create_link_artifact", "create_progress_artifact", "update_progress_artifact"):
        monkeypatch.setattr(flow, name, stalled)
    logger = type("Logger", (), {"info": lambda self, line: None, "warning": lambda self, text: warned.append(text)})()
    output = flow.StageOutput("train", logger)
    start = time.monotonic()
    output(f"{tracking.RUN_LINE}http://127.0.0.1:5000/#/experiments/1/runs/ab12")
    for step in range(1, 1001):
        output(progress_line({"step": step, "loss": 4.0, "tgt_tokens_per_sec": 1000.0}, 1000))
    assert time.monotonic() - start < 1  # read on at once, whatever the server does
    output.artifacts.close(timeout=10)  # the link and only the newest progress: two calls, not a thousand
    assert len(warned) == 1 and "the Prefect server did not take an artifact" in warned[0]


def test_a_failed_stage_is_told_in_its_own_words_with_the_lines_that_go_on_with_them():
    lines = ["Running stage 'download':", "error: could not fetch a valid train.en.gz:",
             "  https://127.0.0.1:1/a/train.en.gz: gave up after 4 attempts: refused",
             "  https://127.0.0.1:1/b/train.en.gz: sha256 differs",
             "ERROR: failed to reproduce 'download': failed to run: python -m pipeline.stage download"]
    assert flow.failure("download", lines) == (
        "stage 'download' failed: could not fetch a valid train.en.gz: https://127.0.0.1:1/a/train.en.gz: gave up "
        "after 4 attempts: refused; https://127.0.0.1:1/b/train.en.gz: sha256 differs (the stages before it keep "
        "their outputs)")
    assert flow.failure("train", ["error: no training pair fits", "ERROR: failed"]).endswith(
        "failed: no training pair fits (the stages before it keep their outputs)")
    traceback = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
                 "torch.OutOfMemoryError: CUDA out of memory.", "ERROR: failed to reproduce 'train'"]
    assert flow.failure("train", traceback) == (
        "stage 'train' failed: torch.OutOfMemoryError: CUDA out of memory. (the stages before it keep their outputs)")
    assert flow.failure("train", ["ERROR: failed to reproduce 'train'"]) == (
        "stage 'train' failed: ERROR: failed to reproduce 'train' (the stages before it keep their outputs)")
    busy = ["ERROR: failed to reproduce 'vocab': 'metrics/vocab.json' is busy, it is being blocked by:",  # DVC's lock
            "  (PID 4039): dvc repro --single-item train", "",
            "If there are no processes with such PIDs, you can manually remove '.dvc/tmp/rwlock' and try again."]
    assert flow.failure("vocab", busy) == (
        "stage 'vocab' failed: ERROR: failed to reproduce 'vocab': 'metrics/vocab.json' is busy, it is being blocked "
        "by: (PID 4039): dvc repro --single-item train (the stages before it keep their outputs)")


def test_the_progress_line_reads_back():
    line = progress_line({"step": 1400, "loss": 2.0625, "tgt_tokens_per_sec": 612345.4}, 100000)
    assert line == "step 1400/100000: loss 2.062, 612,345 target tokens/s"
    assert parse_progress(line) == (1400, 100000, 2.062, 612345.0)
    assert parse_progress("train: 10%|#| 1400/100000") is None and parse_progress("step 3/4 done") is None


def test_deploy_and_serve_refuse_a_source_that_is_not_the_project_and_a_missing_server(tmp_path, monkeypatch):
    """Each before anything is registered: a worker could not run the deployment; and a server named but
    not answering stops deploy and serve with a line saying so, not a traceback."""
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # never reached: refused first
    with pytest.raises(PipelineError, match=f"deploy --source {tmp_path}: neither a git URL nor a checkout"):
        flow.deploy("team", str(tmp_path))
    monkeypatch.delenv("PREFECT_API_URL")
    monkeypatch.setenv("PREFECT_PROFILES_PATH", str(tmp_path / "profiles.toml"))  # no profile's URL either
    with pytest.raises(PipelineError, match="deploy needs a Prefect server that outlives it"):
        flow.deploy("team", str(config.ROOT))
    with pytest.raises(PipelineError, match="serve needs a Prefect server that outlives it"):
        flow.serve()  # on a temporary server, no one else could start its runs
    nobody = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    for command, call in (("deploy", lambda: flow.deploy("team", str(config.ROOT))), ("serve", flow.serve)):
        with temporary_settings(updates={PREFECT_API_URL: nobody}), \
                pytest.raises(PipelineError, match=f"{command} needs the Prefect server {nobody}, which does not "
                                                   r"answer \(ConnectError"):
            call()


def test_a_second_run_in_the_checkout_is_refused_before_it_touches_params_yaml(tmp_path_factory):
    """A run writes params.yaml and its stages read it as they start: a second run beside it would change
    the first's later stages (and DVC would record them under the second's parameters)."""
    repo = copy_project(tmp_path_factory)
    env = env_of(repo)
    holder = subprocess.Popen([sys.executable, "-c", "from pipeline import runlock; runlock.hold(); print('held', "
                               "flush=True); import time; time.sleep(300)"], cwd=repo, env=env, stdout=subprocess.PIPE,
                              text=True)
    before = (repo / "params.yaml").read_bytes()
    try:
        assert holder.stdout.readline().strip() == "held"
        for args in (["run", "-S", "train.max_steps=3"], ["quickstart"], ["preset", "quickstart"]):
            proc = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=repo, env=env, capture_output=True,
                                  text=True, timeout=120)
            said = f"error: another pipeline run is working in this checkout (pid {holder.pid}, "
            assert proc.returncode == 1 and said in proc.stderr and "prefect" not in proc.stderr.lower(), proc.stderr
        assert (repo / "params.yaml").read_bytes() == before
    finally:
        holder.kill()
        holder.wait()
    proc = subprocess.run([sys.executable, "-m", "pipeline", "preset", "quickstart"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)  # a killed holder leaves no lock behind
    assert proc.returncode == 0 and (repo / "params.yaml").read_bytes() != before, proc.stderr


def test_a_run_outside_git_is_refused_in_a_line_before_it_starts(tmp_path_factory):
    """A source archive unpacked rather than cloned: DVC, which records the runs in git, failed inside the
    flow with a traceback; the command says so before Prefect starts, and what to do."""
    repo = copy_project(tmp_path_factory)
    shutil.rmtree(repo / ".git")
    before = (repo / "params.yaml").read_bytes()
    proc = subprocess.run([sys.executable, "-m", "pipeline", "quickstart"], cwd=repo, env=env_of(repo),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"error: {repo} is not a git repository" in proc.stderr and "git init" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "prefect" not in proc.stderr.lower(), proc.stderr[-3000:]
    assert (repo / "params.yaml").read_bytes() == before
