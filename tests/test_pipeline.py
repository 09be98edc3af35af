"""The whole pipeline in a copy of the repository: the Prefect flow over dvc.yaml, MLflow's records
and registered model, DVC's caching and experiments (a second run does nothing; `dvc exp run -S` of
a decode parameter reruns decode and score only), and the report."""
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import wait_for
from pipeline import dag, flow, tracking

ROOT = Path(__file__).resolve().parents[1]

STAGES = ["download", "clean", "vocab", "encode", "train", "average", "decode", "score", "export"]
SMALL = ["-S", "train.max_steps=30", "-S", "train.checkpoint_every_steps=10", "-S", "train.log_every=10",
         "-S", "train.validate_every=10", "-S", "decode.max_length_extra=5", "-S", "average.last=2"]


def test_the_flow_follows_the_dag_of_dvc_yaml():
    assert dag.stage_order() == STAGES
    assert set(dag.stage_descriptions()) == set(STAGES)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return _copy_project(tmp_path_factory)


def _copy_project(tmp_path_factory) -> Path:
    """A fresh copy of the project's files (as a clone would have them) in a git repository of its own."""
    root = tmp_path_factory.mktemp("clone") / "project"
    files = subprocess.run(["git", "ls-files", "--cached"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, root / name)
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", *args], cwd=root, check=True)
    return root


def _env(repo: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the default: inside the tree
    env.update(PREFECT_HOME=str(repo.parent / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", PYTHONPATH=str(repo))
    return env


def _run(repo: Path, *args: str) -> str:
    proc = subprocess.run(args, cwd=repo, env=_env(repo), capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def flow_output(repo) -> str:
    return _run(repo, sys.executable, "-m", "pipeline", "quickstart", *SMALL)


@pytest.mark.slow
def test_flow_runs_one_task_per_stage(flow_output, repo):
    for stage in STAGES:
        assert re.search(rf"Task run '{stage}'.*Finished in state Completed", flow_output), stage
    assert re.search(r"Flow run '.*' - Finished in state Completed", flow_output)
    assert (repo / "metrics/score.json").is_file()


@pytest.mark.slow
def test_mlflow_holds_a_parent_run_with_a_nested_run_per_stage(flow_output, repo):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("transformer-en-de")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.info.run_name == "pipeline"]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED" and "test_bleu" in parent.data.metrics
    assert parent.data.tags["presets"] == "quickstart" and len(parent.data.tags["git_commit"]) >= 40
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.info.run_name for r in children) == sorted(STAGES)
    assert all(r.info.status == "FINISHED" for r in children)
    by_stage = {r.info.run_name: r for r in children}
    assert "data.raw_dir" in by_stage["clean"].data.tags and "data.source" in by_stage["download"].data.tags
    assert by_stage["train"].data.params["model.d_model"] == "128"
    assert "loss" in by_stage["train"].data.metrics and "test_bleu" in by_stage["score"].data.metrics
    artifacts = [a.path for a in client.list_artifacts(by_stage["vocab"].info.run_id, "vocab")]
    assert "vocab/spm.model" in artifacts  # the vocabulary, logged beside the store in the tree
    assert (repo / "mlartifacts").is_dir() and not (repo / "mlruns").exists()
    assert any(k.startswith("system/cpu_utilization") for k in by_stage["train"].data.metrics)
    assert all("." in key for key in parent.data.params)  # every parameter under its stage's prefix


@pytest.mark.slow
def test_the_model_is_registered_as_a_translator_with_the_best_alias(flow_output, repo):
    import mlflow

    uri = f"sqlite:///{repo / 'mlflow.db'}"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    version = client.get_model_version_by_alias("transformer-en-de", "best")
    assert float(version.tags["test_bleu"]) >= 0
    mlflow.set_tracking_uri(uri)
    lines = (repo / "data/clean/test.en").read_text(encoding="utf-8").splitlines()[:3]
    translated = mlflow.pyfunc.load_model("models:/transformer-en-de@best").predict(lines)
    expected = (repo / "data/hyps/test.de").read_text(encoding="utf-8").splitlines()[:3]
    assert translated == expected  # the logged model decodes as the decode stage did


@pytest.mark.slow
def test_dvc_reruns_only_what_changed(flow_output, repo):
    dvc = [sys.executable, "-m", "dvc"]
    again = _run(repo, *dvc, "repro")
    assert "Running stage" not in again and "Data and pipelines are up to date" in again
    changed = _run(repo, *dvc, "exp", "run", "-S", "decode.beam_size=2")
    assert re.findall(r"Running stage '(\w+)'", changed) == ["decode", "score"]
    shown = _run(repo, *dvc, "exp", "show", "--md")
    assert "test.bleu_tok" in shown and "train_flops" in shown  # all three BLEU variants and the cost


@pytest.mark.slow
def test_report_compares_the_runs_with_the_paper(flow_output, repo):
    _run(repo, sys.executable, "-m", "pipeline", "report", "--out", "reports")
    text = (repo / "reports/report.md").read_text(encoding="utf-8")
    assert "paper: Transformer base" in text and "en-de quickstart" in text
    for image in ("bleu.png", "cost.png", "loss.png"):
        assert (repo / "reports" / image).read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_the_readmes_examples_run_as_written(flow_output, repo):
    """Every Python block of the README, and the shell block that runs stages alone, after a quickstart."""
    text = (repo / "README.md").read_text(encoding="utf-8")
    python_blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(python_blocks) >= 2
    for block in python_blocks:
        _run(repo, sys.executable, "-c", block)
    section = text.split("## One stage alone", 1)[1].split("\n## ", 1)[0]
    shell = re.findall(r"```\n(.*?)```", section, re.S)[0]
    commands = [line.split("  #")[0].strip() for line in shell.splitlines() if line.strip()]
    assert commands and all(c.startswith("python -m pipeline") for c in commands)
    for command in commands:
        _run(repo, sys.executable, *command.split()[1:])
    assert (repo / "my/clean/train.de").is_file() and (repo / "my/vocab/spm.model").is_file()


@pytest.mark.slow
def test_a_failed_stage_is_recorded_as_failed_and_keeps_earlier_outputs(flow_output, repo):
    # a budget no training pair fits: a valid value, so only the train stage itself can find it out
    _run(repo, sys.executable, "-m", "pipeline", "preset", "-S", "train.batch_tokens=1")
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=_env(repo), capture_output=True,
                          text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "longer than the batch budget of 1 tokens per micro-batch" in output
    assert (repo / "models/averaged.safetensors").is_file()  # finished stages keep their outputs
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("transformer-en-de")
    train_runs = client.search_runs([experiment.experiment_id], "tags.stage = 'train'",
                                    order_by=["attributes.start_time DESC"])
    assert train_runs[0].info.status == "FAILED"


@pytest.mark.slow
def test_a_bad_parameter_stops_every_stage_at_its_line_before_it_works(flow_output, repo):
    params = repo / "params.yaml"
    saved = params.read_text(encoding="utf-8")
    try:
        params.write_text(re.sub(r"  beam_size: \d+", "  beam_size: 0", saved), encoding="utf-8")  # by hand
        line = next(i for i, text in enumerate(params.read_text().splitlines(), 1) if "beam_size: 0" in text)
        proc = subprocess.run([sys.executable, "-m", "pipeline", "clean", "--raw-dir", "data/raw", "--out-dir",
                               "elsewhere"], cwd=repo, env=_env(repo), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1
        assert proc.stderr.strip().endswith(
            f"params.yaml:{line}: decode.beam_size: must be at least 1 (1: greedy), not 0")
        assert not (repo / "elsewhere").exists()
    finally:
        params.write_text(saved, encoding="utf-8")


def _saved(repo: Path) -> int:
    from stages.model_files import list_checkpoints

    return max((step for step, _ in list_checkpoints(repo / "models/checkpoints", snapshots=True)), default=0)


def _processes_in(repo: Path) -> list:
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.cwd() == str(repo) and p.pid != os.getpid():
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.mark.slow
def test_dvc_repro_stops_promptly_when_its_job_is_signalled(flow_output, repo):
    """SIGTERM to the job's processes, as Slurm and a terminal's kill of a job send it: DVC goes at
    once, the train stage after the step in progress, which it saves."""
    _run(repo, sys.executable, "-m", "pipeline", "preset", "-S", "train.batch_tokens=3000", "-S",
         "train.max_steps=100000")
    before = _saved(repo)
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "train"], cwd=repo, env=_env(repo),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for(lambda: _saved(repo) >= before + 10, 180, "training to go on")
    os.killpg(proc.pid, signal.SIGTERM)
    sent = time.monotonic()
    wait_for(lambda: not _processes_in(repo), 60, "dvc and the stage to stop")
    assert time.monotonic() - sent < 30
    proc.communicate(timeout=10)
    step = _saved(repo)
    assert step > before + 10
    assert subprocess.run([sys.executable, "-c", "import torch; from stages.model_files import list_checkpoints, "
                           "read_checkpoint; print(read_checkpoint(list_checkpoints('models/checkpoints', True)[-1][1])"
                           ".parts['progress']['step'])"], cwd=repo, env=_env(repo), capture_output=True, text=True,
                          check=True).stdout.strip() == str(step)


@pytest.mark.slow
def test_the_flow_stops_promptly_on_sigterm_and_its_stage_saves(flow_output, repo):
    """SIGTERM to the flow's process only (as Kubernetes sends it to a container's first process):
    the flow passes it on, the train stage saves the step it was on, and the runs are KILLED."""
    before = _saved(repo)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "run", "-S", "train.max_steps=200000"], cwd=repo,
                            env=_env(repo), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: _saved(repo) >= before + 10, 300, "the flow's training to go on")
        os.kill(proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        output, _ = proc.communicate(timeout=120)
        assert time.monotonic() - sent < 60, output[-3000:]
        assert "stopped by SIGINT after step" in output  # the flow passed it on as Ctrl-C
        assert not _processes_in(repo)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the flow's temporary Prefect server, if it outlived it
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("transformer-en-de")
    newest = {stage: client.search_runs([experiment.experiment_id], f"attributes.run_name = '{stage}'",
                                        order_by=["attributes.start_time DESC"])[0] for stage in ("pipeline", "train")}
    assert {stage: run.info.status for stage, run in newest.items()} == {"pipeline": "KILLED", "train": "KILLED"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """A Prefect server of the tests' own, on a free loopback port."""
    import urllib.request

    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    home = tmp_path_factory.mktemp("prefect-server")
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], cwd=home, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: _healthy(f"{url}/health", urllib.request), 120, "the Prefect server")
        yield url
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def _api(url: str, work):
    """Run `work(client)` (a coroutine function) against the Prefect server at `url`."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def run():
        async with get_client() as client:
            return await work(client)

    with temporary_settings(updates={PREFECT_API_URL: url}):
        return asyncio.run(run())


@pytest.mark.slow
def test_a_run_is_watchable_live_and_ends_crashed_when_stopped(flow_output, repo, prefect_api):
    """While the train stage works, the flow's log has its lines within seconds, without DVC's advice,
    with a progress artifact and a link to the stage's MLflow run; SIGTERM to the flow ends it, and
    its running task, Crashed or Cancelled, and its MLflow run KILLED."""
    from mlflow.tracking import MlflowClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, \
        LogFilterFlowRunId

    env = {**_env(repo), "PREFECT_API_URL": prefect_api}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "run", "-S", "train.max_steps=400000"], cwd=repo,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)

    async def progress(client):
        runs = await client.read_flow_runs()
        if not runs:
            return None
        run = runs[0]
        artifacts = await client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
        by_key = {a.key: a for a in artifacts}
        if "train-progress" not in by_key or "mlflow-train" not in by_key:
            return None
        logs, page = [], True
        while page:  # every log of the run, a page at a time
            page = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])),
                                          limit=200, offset=len(logs))
            logs += page
        if not any(re.match(r"step \d+/400000: loss", log.message) for log in logs):
            return None  # logs reach the server in batches, every two seconds
        return run, by_key, logs

    try:
        run, artifacts, logs = wait_for(lambda: _api(prefect_api, progress), 300, "the train stage's progress")
        bar = artifacts["train-progress"]
        assert 0 < bar.data < 100 and "of 400,000, loss" in bar.description
        messages = [log.message for log in logs]
        assert not any("To track the changes with git" in m or "dvc push" in m for m in messages)
        # a stage's first line names its MLflow run (the train stage's is the newest): from the run's
        # creation to the line in the flow's log, seconds at most
        announced = [log for log in logs if log.message.startswith(tracking.RUN_LINE)][-1]
        assert announced.message.removeprefix(tracking.RUN_LINE) in artifacts["mlflow-train"].data
        run_id = announced.message.rsplit("/", 1)[-1]
        started = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}").get_run(run_id).info.start_time / 1000
        delay = announced.timestamp.timestamp() - started
        print(f"from a stage's first print to the flow's log: {delay:.2f} s")
        assert delay < 5
        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    async def states(client):
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        flow_run = await client.read_flow_run(run.id)
        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        return flow_run.state_type.value, {t.name: t.state_type.value for t in tasks}

    flow_state, task_states = _api(prefect_api, states)
    assert flow_state in ("CRASHED", "CANCELLED") and task_states["train"] in ("CRASHED", "CANCELLED")
    assert all(state == "COMPLETED" for name, state in task_states.items() if name != "train")


@pytest.mark.slow
def test_the_served_deployment_starts_a_run_with_a_preset_and_overrides(tmp_path_factory, prefect_api):
    """A Prefect server on a free loopback port, the flow served as a deployment, a run started as
    the UI's Run button starts one: the run carries the parameters and the served tree applies them."""
    root = _copy_project(tmp_path_factory)  # a copy of its own: this run changes its params.yaml
    env = {**_env(root), "PREFECT_API_URL": prefect_api, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    served = subprocess.Popen([sys.executable, "-m", "pipeline", "serve"], cwd=root, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        from prefect.states import Cancelling

        async def start_and_watch(client):
            name = f"{flow.pipeline.name}/{flow.DEPLOYMENT}"
            deployment = await _poll(lambda: client.read_deployment_by_name(name), 90)
            run = await client.create_flow_run_from_deployment(
                deployment.id, parameters={"presets": ["quickstart"], "overrides": {"train.max_steps": 7}})
            running = await _poll(lambda: _in_state(client, run.id, ("RUNNING", "COMPLETED")), 120)
            text = wait_for(lambda: "max_steps: 7" in (p := (root / "params.yaml").read_text()) and p, 60,
                            "params.yaml to change")
            await client.set_flow_run_state(run.id, Cancelling(), force=True)
            return running, text

        running, text = _api(prefect_api, start_and_watch)
        assert running.parameters == {"presets": ["quickstart"], "overrides": {"train.max_steps": 7}}
        assert "d_model: 128" in text  # the quickstart preset, then the override, applied in the served tree
    finally:
        os.killpg(served.pid, signal.SIGKILL)  # with whatever it started (the run, its dvc and stage processes)
        served.wait(timeout=30)


def _healthy(url: str, request) -> bool:
    try:
        return request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False


async def _poll(fetch, timeout: float):
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if result := await fetch():
                return result
        except Exception:  # noqa: BLE001 - not there yet (e.g. ObjectNotFound while serve registers)
            pass
        await asyncio.sleep(1)
    raise AssertionError("timed out waiting on the Prefect server")


async def _in_state(client, run_id, states):
    run = await client.read_flow_run(run_id)
    return run if run.state_type.value in states else None
