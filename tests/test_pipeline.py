"""The whole pipeline in a copy of the repository: the Prefect flow over dvc.yaml, MLflow's records,
and DVC's caching (a second run does nothing; a decode parameter reruns decode and score only)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import cli, flow
ROOT = Path(__file__).resolve().parents[1]

STAGES = ["download", "clean", "vocab", "encode", "train", "average", "decode", "score"]
SMALL = ["-S", "train.max_steps=30", "-S", "train.checkpoint_every_steps=10", "-S", "train.log_every=10",
         "-S", "train.validate_every=10", "-S", "decode.max_length_extra=5", "-S", "average.last=2"]


def test_the_flow_follows_the_dag_of_dvc_yaml():
    assert flow.dvc_stages() == STAGES


def test_the_command_line_has_every_stage_of_dvc_yaml():
    assert set(cli.STAGES) == set(STAGES)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
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


@pytest.mark.slow
def test_dvc_reruns_only_what_changed(flow_output, repo):
    dvc = [sys.executable, "-m", "dvc"]
    again = _run(repo, *dvc, "repro")
    assert "Running stage" not in again and "Data and pipelines are up to date" in again
    _run(repo, sys.executable, "-m", "pipeline", "preset", "-S", "decode.beam_size=2")
    changed = _run(repo, *dvc, "repro")
    assert re.findall(r"Running stage '(\w+)'", changed) == ["decode", "score"]


@pytest.mark.slow
def test_a_failed_stage_is_recorded_as_failed_and_keeps_earlier_outputs(flow_output, repo):
    _run(repo, sys.executable, "-m", "pipeline", "preset", "-S", "decode.beam_size=0")
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=_env(repo), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0 and "decode.beam_size must be at least 1" in proc.stdout + proc.stderr
    assert (repo / "models/averaged.safetensors").is_file()  # finished stages keep their outputs
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("transformer-en-de")
    decode_runs = client.search_runs([experiment.experiment_id], "tags.stage = 'decode'",
                                     order_by=["attributes.start_time DESC"])
    assert decode_runs[0].info.status == "FAILED"
