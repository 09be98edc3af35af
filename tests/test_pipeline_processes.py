"""Training on several processes from the DAG itself (train.processes), in the copy the quickstart ran
in (after test_pipeline and test_pipeline_experiments; its params.yaml is given back afterwards): `dvc
repro` trains on two workers as torchrun does, bit for bit, and resumes on one with the same batches;
a launcher's training is recorded by `dvc commit -f train`; the Prefect flow trains on two with one
MLflow run and its progress artifact, and SIGTERM stops both workers after the same step, saved once."""
import re
import subprocess
import sys

import pytest
import torch

from conftest import env_of, newest_runs, run_in, without_key_biases
from test_pipeline_stops import _saved, sigterm_a_long_flow

pytestmark = pytest.mark.slow
SAME = ("loss", "nll", "lr", "grad_norm", "tgt_tokens_per_step")  # what a step computed, not how fast


@pytest.fixture(scope="module")
def own_params(flow_output, repo):
    """These tests train a run of their own (another seed); the modules after them find params.yaml as it was."""
    saved = (repo / "params.yaml").read_text(encoding="utf-8")
    yield repo
    (repo / "params.yaml").write_text(saved, encoding="utf-8")


def _set(repo, **values) -> None:
    run_in(repo, sys.executable, "-m", "pipeline", "preset",
           *(f"-S{key.replace('__', '.')}={value}" for key, value in values.items()))


def _env(repo) -> dict[str, str]:
    return {**env_of(repo), "OMP_NUM_THREADS": "1"}  # the thread count changes how products round


def _run(repo, *command: str) -> str:
    proc = subprocess.run(command, cwd=repo, env=_env(repo), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def _parts(folder, step: int) -> dict:
    from stages.model_files import read_checkpoint

    return read_checkpoint(folder / f"checkpoint-{step:08d}.pt").parts


def _rows(parts: dict) -> list[tuple]:
    return [tuple(row[key] for key in SAME) for row in parts["progress"]["history"]]


def test_dvc_repro_trains_on_two_workers_as_torchrun_does_and_resumes_on_one(own_params, tmp_path):
    from pipeline.presets import apply_overrides
    from stages.model_files import current_dir

    repo = own_params
    _set(repo, train__processes=2, train__seed=7, train__max_steps=6, train__checkpoint_every_steps=3,
         train__log_every=1, train__validate_every=100, train__precision="fp32")  # the bounds below are fp32's
    output = _run(repo, sys.executable, "-m", "dvc", "repro", "train")
    assert "process 0 of 2" in output and "[rank1] process 1 of 2" in output  # two workers, each saying so
    ours = current_dir(repo / "models/checkpoints")

    params = tmp_path / "params.yaml"  # the same settings, to step 9, by torchrun in a folder of its own
    params.write_text((repo / "params.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    apply_overrides({"train.max_steps": 9}, params)
    _run(repo, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
         "pipeline.stage", "train", "--params", str(params), "--encoded-dir", "data/encoded", "--vocab-dir",
         "data/vocab", "--checkpoint-dir", str(tmp_path / "ckpt"), "--plots-dir", str(tmp_path / "plots"),
         "--metrics", str(tmp_path / "train.json"))
    theirs = current_dir(tmp_path / "ckpt")
    a, b = _parts(ours, 6), _parts(theirs, 6)
    assert a["topology"] == b["topology"] == {"processes": 2, "grad_accum": 1}
    assert a["sampler"] == b["sampler"] and _rows(a) == _rows(b)
    for name, weight in b["model"].items():
        assert torch.equal(a["model"][name], weight), name  # bit for bit

    _set(repo, train__processes=1, train__max_steps=9)  # the same run on one process: dvc repro alone
    output = _run(repo, sys.executable, "-m", "dvc", "repro", "train")
    assert f"{ours.name}/checkpoint-00000006.pt at step 6" in output
    assert "topology changed: the run was trained on 2 processes x 1 micro-batches a step and goes on on 1 x 2" \
        in output
    a, b = _parts(ours, 9), _parts(theirs, 9)
    assert a["sampler"] == b["sampler"]
    assert [row[-1] for row in _rows(a)] == [row[-1] for row in _rows(b)]  # the same batches at every step
    torch.testing.assert_close([row[0] for row in _rows(a)], [row[0] for row in _rows(b)], rtol=1e-5, atol=0)
    for name, weight in b["model"].items():  # fp32 sums in another order
        ours, theirs = without_key_biases(name, a["model"][name]), without_key_biases(name, weight)
        assert (ours - theirs).norm() <= 1e-3 * theirs.norm(), name


def test_a_launchers_training_is_recorded_by_dvc_commit_as_scaling_md_says(own_params):
    """docs/scaling.md: under a launcher of one's own (torchrun, srun) the train stage's command trains, and
    `dvc commit -f train` records it: its parameters changed since DVC last ran it, which plain `dvc commit`
    refuses. `dvc repro` then finds the stage up to date and goes on from its outputs."""
    from pipeline import dag

    repo, paths = own_params, dag.paths()
    _set(repo, train__seed=8, train__max_steps=3)  # a run of its own: the test after goes on with seed 7's
    output = _run(repo, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m",
                  "pipeline.stage", "train", "--encoded-dir", paths["encoded"], "--vocab-dir", paths["vocab"],
                  "--checkpoint-dir", paths["checkpoints"], "--plots-dir", paths["plots"],
                  "--metrics", f"{paths['metrics']}/train.json")
    assert "step 3/3" in output, output[-3000:]
    _run(repo, sys.executable, "-m", "dvc", "commit", "-f", "train")
    status = _run(repo, sys.executable, "-m", "dvc", "status", "train")
    assert "up to date" in status, status


def test_the_flow_trains_on_two_workers_and_sigterm_stops_both_after_one_step(own_params, prefect_api):
    from mlflow.tracking import MlflowClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    repo = own_params
    env = {**_env(repo), "PREFECT_API_URL": prefect_api}
    finished = subprocess.run([sys.executable, "-m", "pipeline", "run", "-S", "train.processes=2", "-S", "train.seed=7",
                               "-S", "train.max_steps=12"], cwd=repo, env=env, capture_output=True, text=True,
                              timeout=900)  # the run of the test before, or a new one
    assert finished.returncode == 0, (finished.stdout + finished.stderr)[-4000:]
    runs = newest_runs(repo)
    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    trains = client.search_runs([runs["stage"].info.experiment_id], "tags.stage = 'train' and "
                                f"tags.mlflow.parentRunId = '{runs['run_kind'].info.run_id}'")
    assert len(trains) == 1 and trains[0].info.status == "FINISHED"  # rank 0's, with the machine's use
    assert any(key.startswith("system/") for key in trains[0].data.metrics)

    async def progress(client):
        flow_run = (await client.read_flow_runs())[0]
        artifacts = await client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])))
        return {a.key: a for a in artifacts}

    from servers import prefect_call

    artifacts = prefect_call(prefect_api, progress)
    assert artifacts["train-progress"].data == 100 and "of 12, loss" in artifacts["train-progress"].description
    assert "mlflow-train" in artifacts

    output = sigterm_a_long_flow(repo, _env(repo), steps_first=6, limit=90)
    stops = set(re.findall(r"(\[rank1\] )?stopped: stopped by SIGINT after step (\d+),", output))  # each worker's
    steps = {step for _, step in stops}
    assert {rank for rank, _ in stops} == {"", "[rank1] "} and len(steps) == 1, output[-3000:]
    from stages.model_files import current_dir, list_checkpoints

    step = int(steps.pop())
    saved = [path for s, path in list_checkpoints(current_dir(repo / "models/checkpoints"), snapshots=True)
             if s == step]
    assert len(saved) == 1 and _saved(repo) == step  # saved once, the newest
    assert "stopped: every worker stopped after the same step and saved it" in output
    assert {kind: run.info.status for kind, run in newest_runs(repo).items()} == {"stage": "KILLED",
                                                                                    "run_kind": "KILLED"}
