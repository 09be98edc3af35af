"""A team's shared services, each on a free 127.0.0.1 port and torn down after, around the pipeline
in the slow tier's copy of the repository (this module runs after the other test_pipeline ones):
a DVC remote (pushed after a run; a second clone pulls, and `dvc repro` runs nothing), an MLflow
tracking server (a run's parent and nested runs, metrics, artifacts and registered model land
there), and a Prefect work pool (a run started through the API with parameters completes on a
worker of the pool)."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import SMALL, env_of, run_in, wait_for
from pipeline.presets import parse_override
from servers import free_port, in_state, poll, prefect_call, serving

pytestmark = pytest.mark.slow
DVC = [sys.executable, "-m", "dvc"]


@pytest.fixture(scope="module")
def completed(flow_output, repo):
    """The copy with the small quickstart complete, whatever the modules before it changed."""
    run_in(repo, sys.executable, "-m", "pipeline", "quickstart", *SMALL)
    return repo


def _files(root, folder: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / folder).rglob("*")) if p.is_file()}


def test_a_run_whose_prefect_server_does_not_answer_goes_on_without_it(completed, tmp_path):
    """A server that PREFECT_API_URL or the active profile names, down when a run starts, costs one line:
    the flow runs to its end on a temporary server of its own (Prefect's, as when none is named). The
    quickstart as the copy has it, so every stage is DVC's to skip."""
    url = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(f'active = "team"\n\n[profiles.team]\nPREFECT_API_URL = "{url}"\n', encoding="utf-8")
    env = {k: v for k, v in env_of(completed).items() if k != "PREFECT_API_URL"}
    for named in ({"PREFECT_API_URL": url}, {"PREFECT_PROFILES_PATH": str(profiles)}):
        proc = subprocess.run([sys.executable, "-m", "pipeline", "quickstart", *SMALL], cwd=completed,
                              env={**env, **named}, capture_output=True, text=True, timeout=600)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-4000:]
        assert f"warning: the Prefect server {url} does not answer (ConnectError" in output, output[-4000:]
        assert "Starting temporary server" in output and "test BLEU" in output, output[-4000:]
        assert "Traceback" not in output and "ERROR" not in output, output[-4000:]


def test_a_teammate_pulls_a_pushed_run_and_dvc_repro_has_nothing_to_do(completed, tmp_path):
    run_in(completed, *DVC, "remote", "add", "--default", "team", str(tmp_path / "remote"))  # as docs/scaling.md says
    run_in(completed, *DVC, "push")
    run_in(completed, "git", "add", "-A")
    run_in(completed, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "the run's lock")
    clone = tmp_path / "teammate"
    run_in(tmp_path, "git", "clone", "-q", str(completed), str(clone))
    run_in(clone, *DVC, "pull")
    for folder in ("models", "data/hyps", "data/encoded"):  # the checkpoints too: they are cached
        assert _files(clone, folder) == _files(completed, folder), folder
    assert any(name.endswith(".pt") for name in _files(clone, "models/checkpoints"))
    again = run_in(clone, *DVC, "repro")
    assert "Data and pipelines are up to date" in again and "Running stage" not in again, again


def test_a_run_tracked_by_a_shared_server_leaves_everything_there(completed, tmp_path):
    """`mlflow server` with a database and an artifact store; a run that reruns decode and score."""
    from mlflow.tracking import MlflowClient

    port = free_port()
    store = tmp_path / "server"
    store.mkdir()
    uri = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
               "--artifacts-destination", str(store / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]
    with serving(command, f"{uri}/health", store, {**os.environ}, "the MLflow server"):
        env = {**env_of(completed), "MLFLOW_TRACKING_URI": uri}
        proc = subprocess.run([sys.executable, "-m", "pipeline", "quickstart", *SMALL, "-S", "decode.beam_size=3"],
                              cwd=completed, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name("transformer-en-de").experiment_id
        [parent] = client.search_runs([experiment], "tags.run_kind = 'pipeline'")
        children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        assert sorted(r.data.tags["stage"] for r in children) == ["decode", "score"]  # what the change reran
        assert {r.info.status for r in [parent, *children]} == {"FINISHED"}
        score = next(r for r in children if r.data.tags["stage"] == "score")
        assert score.data.metrics["test_bleu"] == parent.data.metrics["test_bleu"]  # the small model's may be 0
        assert parent.data.params["decode.beam_size"] == "3"
        assert "score.json" in {a.path for a in client.list_artifacts(parent.info.run_id)}
        best = client.get_model_version_by_alias("transformer-en-de-numbers", "best")
        assert best.run_id == parent.info.run_id
    stored = [p.name for p in (store / "artifacts").rglob("*") if p.is_file()]
    assert "score.json" in stored and "averaged.safetensors" in stored  # uploaded to the server's store


def test_a_worker_of_the_pool_runs_a_deployed_run_started_with_parameters(completed, prefect_api, tmp_path):
    env = {**env_of(completed), "PREFECT_API_URL": prefect_api, "PREFECT_WORKER_QUERY_SECONDS": "1"}
    said = subprocess.run([sys.executable, "-m", "pipeline", "deploy", "--pool", "team"], cwd=completed, env=env,
                          capture_output=True, text=True, timeout=300)
    assert said.returncode == 0 and "deployed transformer-pipeline/transformer-pipeline to the work pool team" \
        in said.stdout, said.stdout + said.stderr
    log = tmp_path / "worker.log"
    with log.open("w") as out:  # started elsewhere than the checkout, as on another machine
        worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "team", "--name",
                                   "teammate"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    overrides = dict(parse_override(o) for o in SMALL[1::2])
    try:
        async def start_and_wait(client):
            deployment = await client.read_deployment_by_name("transformer-pipeline/transformer-pipeline")
            run = await client.create_flow_run_from_deployment(
                deployment.id, parameters={"presets": ["quickstart"], "overrides": overrides})
            return await poll(lambda: in_state(client, run.id, ("COMPLETED", "FAILED", "CRASHED")), 600)

        done = prefect_call(prefect_api, start_and_wait)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
    assert done.state_type.value == "COMPLETED", (done.state.message, log.read_text()[-3000:])
    assert done.work_pool_name == "team" and done.parameters == {"presets": ["quickstart"], "overrides": overrides}
    assert str(done.id) in log.read_text()  # the worker took it


def test_a_flow_outlives_its_prefect_server(completed, tmp_path):
    """The server stopped while the train stage works: the stage is not stopped, the flow runs its
    stages to the end (Prefect 3 runs tasks on without its server), and ends with one line saying the
    server was lost and the pipeline finished; DVC's record is whole (`dvc repro` has nothing to do).
    The small quickstart in the shared copy (its data stages have nothing to do), with a seed of this
    test's own: the train stage starts a run from step 0, not one that earlier tests left stopped."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    home = tmp_path / "prefect"
    home.mkdir()
    server_env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": url}
    # Prefect's client retries a lost server 5 times by default, minutes in all; none here, as the end is the same
    env = {**env_of(completed), "PREFECT_API_URL": url, "PREFECT_CLIENT_MAX_RETRIES": "0", "PYTHONUNBUFFERED": "1"}
    steps = ["-S", "train.seed=50", "-S", "train.max_steps=40", "-S", "train.checkpoint_every_steps=10",
             "-S", "train.log_every=10"]
    with serving([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                 f"{url}/health", home, server_env, "the Prefect server"):
        flow = subprocess.Popen([sys.executable, "-m", "pipeline", "quickstart", *SMALL, *steps], cwd=completed,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(flow.stdout), daemon=True)
        reader.start()
        wait_for(lambda: any("step 10/40" in line for line in lines) or flow.poll() is not None, 600,
                 "the train stage at step 10")
        assert flow.poll() is None and "resumed from" not in "".join(lines), "".join(lines)[-4000:]
    start = time.monotonic()  # the server is gone from here
    assert flow.wait(timeout=900) == 0, "".join(lines)[-4000:]
    reader.join(timeout=10)
    print(f"the flow ended {time.monotonic() - start:.0f} s after its server was stopped at train step 10")
    assert lines[-1].startswith(f"warning: the Prefect server {url} was lost (") and \
        "the pipeline finished (test BLEU" in lines[-1], lines[-1]
    output = "".join(lines)
    assert "step 40/40" in output and "stopped:" not in output  # the stage ran to its end
    assert "Still processing items" not in output, output[-4000:]  # its end did not wait on undeliverable events
    assert list((completed / "models/checkpoints").rglob("checkpoint-00000040.pt"))
    again = run_in(completed, *DVC, "status")
    assert "Data and pipelines are up to date" in again, again
