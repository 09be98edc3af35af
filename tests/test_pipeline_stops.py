"""Stopping and watching a run, in the copy the quickstart ran in (after test_pipeline and
test_pipeline_experiments; test_pipeline_team, last, finishes the runs this module leaves stopped):
`dvc repro` and the Prefect flow stop promptly on a signal and the train stage saves its step; a
flow's progress and logs can be watched live through a Prefect server; a served deployment starts a
run with a preset and overrides."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import copy_project, env_of, newest_runs, run_in, wait_for
from servers import in_state, poll, prefect_call
from pipeline import flow, tracking


def _saved(repo: Path) -> int:
    from stages.model_files import current_dir, list_checkpoints

    folder = current_dir(repo / "models/checkpoints")
    return max((step for step, _ in list_checkpoints(folder, snapshots=True)), default=0)


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
    run_in(repo, sys.executable, "-m", "pipeline", "preset", "-S", "train.batch_tokens=3000", "-S",
         "train.max_steps=100000")
    before = _saved(repo)
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "train"], cwd=repo, env=env_of(repo),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for(lambda: _saved(repo) >= before + 10, 180, "training to go on")
    os.killpg(proc.pid, signal.SIGTERM)
    sent = time.monotonic()
    wait_for(lambda: not _processes_in(repo), 60, "dvc and the stage to stop")
    assert time.monotonic() - sent < 30
    proc.communicate(timeout=10)
    step = _saved(repo)
    assert step > before + 10
    from stages.model_files import current_dir, list_checkpoints, read_checkpoint

    newest = list_checkpoints(current_dir(repo / "models/checkpoints"), snapshots=True)[-1][1]
    assert read_checkpoint(newest).parts["progress"]["step"] == step


def sigterm_a_long_flow(repo: Path, env: dict[str, str], steps_first: int, limit: float) -> str:
    """`python -m pipeline run` on a long schedule in `repo`; once it has saved `steps_first` more
    steps, SIGTERM to its process only (as Kubernetes sends it to a container's first process). Its
    output, once it has ended within `limit` seconds of the signal leaving no process of the project
    behind; whatever happens, its process group is killed (a temporary Prefect server that outlived it)."""
    before = _saved(repo)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "run", "-S", "train.max_steps=200000"], cwd=repo,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: _saved(repo) >= before + steps_first, 300, "the flow's training to go on")
        os.kill(proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        output, _ = proc.communicate(timeout=2 * limit)
        assert time.monotonic() - sent < limit, output[-3000:]
        assert not _processes_in(repo)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return output


@pytest.mark.slow
def test_the_flow_stops_promptly_on_sigterm_and_its_stage_saves(flow_output, repo):
    """The flow passes SIGTERM on, the train stage saves the step it was on, and the runs are KILLED."""
    output = sigterm_a_long_flow(repo, env_of(repo), steps_first=10, limit=60)
    assert "stopped by SIGINT after step" in output  # the flow passed it on as Ctrl-C
    assert output.strip().splitlines()[-1].startswith("stopped: the run was interrupted")  # one line ...
    assert "Traceback" not in output  # ... not forty
    newest = newest_runs(repo)
    assert {kind: run.info.status for kind, run in newest.items()} == {"stage": "KILLED", "run_kind": "KILLED"}


@pytest.mark.slow
def test_a_run_is_watchable_live_and_ends_crashed_when_stopped(flow_output, repo, prefect_api):
    """While the train stage works, the flow's log has its lines within seconds, without DVC's advice,
    with a progress artifact and a link to the stage's MLflow run; SIGTERM to the flow ends it, and
    its running task, Crashed or Cancelled, and its MLflow run KILLED."""
    from mlflow.tracking import MlflowClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, \
        LogFilterFlowRunId

    env = {**env_of(repo), "PREFECT_API_URL": prefect_api}
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
        run, artifacts, logs = wait_for(lambda: prefect_call(prefect_api, progress), 300, "the train stage's progress")
        bar = artifacts["train-progress"]
        assert 0 < bar.data < 100 and "of 400,000, loss" in bar.description
        messages = [log.message for log in logs]
        assert not any("To track the changes with git" in m or "dvc push" in m for m in messages)
        # a stage's first line names its MLflow run (the train stage's is the newest): from the run's
        # creation to the line in the flow's log, seconds at most
        announced = [log for log in logs if log.message.startswith(tracking.RUN_LINE)][-1]
        assert f"({tracking.run_url_in(announced.message)})" in artifacts["mlflow-train"].data
        run_id = tracking.run_url_in(announced.message).rsplit("/", 1)[-1]
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

    flow_state, task_states = prefect_call(prefect_api, states)
    assert flow_state in ("CRASHED", "CANCELLED") and task_states["train"] in ("CRASHED", "CANCELLED")
    assert all(state == "COMPLETED" for name, state in task_states.items() if name != "train")


@pytest.mark.slow
def test_the_served_deployment_starts_a_run_with_a_preset_and_overrides(tmp_path_factory, prefect_api):
    """A Prefect server on a free loopback port, the flow served as a deployment, a run started as
    the UI's Run button starts one: the run carries the parameters and the served tree applies them."""
    root = copy_project(tmp_path_factory)  # a copy of its own: this run changes its params.yaml
    env = {**env_of(root), "PREFECT_API_URL": prefect_api, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    served = subprocess.Popen([sys.executable, "-m", "pipeline", "serve"], cwd=root, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        from prefect.states import Cancelling

        async def start_and_watch(client):
            name = f"{flow.pipeline.name}/{flow.DEPLOYMENT}"
            deployment = await poll(lambda: client.read_deployment_by_name(name), 90)
            run = await client.create_flow_run_from_deployment(
                deployment.id, parameters={"presets": ["quickstart"], "overrides": {"train.max_steps": 7}})
            running = await poll(lambda: in_state(client, run.id, ("RUNNING", "COMPLETED")), 120)
            text = wait_for(lambda: "max_steps: 7" in (p := (root / "params.yaml").read_text()) and p, 60,
                            "params.yaml to change")
            await client.set_flow_run_state(run.id, Cancelling(), force=True)
            return running, text

        running, text = prefect_call(prefect_api, start_and_watch)
        assert running.parameters == {"presets": ["quickstart"], "overrides": {"train.max_steps": 7}}
        assert "d_model: 128" in text  # the quickstart preset, then the override, applied in the served tree
    finally:
        os.killpg(served.pid, signal.SIGKILL)  # with whatever it started (the run, its dvc and stage processes)
        served.wait(timeout=30)
