"""The whole pipeline in a copy of the repository: the Prefect flow over dvc.yaml, MLflow's records
and registered model, DVC's caching (a second run does nothing; `dvc exp run -S` of a decode
parameter reruns decode and score only), the report, the README's examples, and a stage that fails
or a parameter that is wrong. The copy and its first quickstart are conftest's (session-wide)."""
import hashlib
import json
import re
import subprocess
import sys
import urllib.request
import warnings

import pytest

from conftest import env_of, newest_runs, run_in
from servers import free_port, serving
from pipeline import dag

STAGES = ["download", "clean", "vocab", "encode", "train", "average", "decode", "score", "export"]


def test_the_flow_follows_the_dag_of_dvc_yaml(monkeypatch):
    assert dag.stage_order() == STAGES
    assert set(dag.stage_descriptions()) == set(STAGES)
    monkeypatch.chdir(dag.ROOT / "docs")  # a run started from a folder of the checkout runs the same stages
    assert dag.stage_order() == STAGES


@pytest.mark.slow
def test_flow_runs_one_task_per_stage(flow_output, repo):
    for stage in STAGES:
        assert re.search(rf"Task run '{stage}'.*Finished in state Completed", flow_output), stage
    assert re.search(r"Flow run '.*' - Finished in state Completed", flow_output)
    assert (repo / "metrics/score.json").is_file()
    # a stage's progress reaches the log as lines (a part started, its progress, done), never a bar's refreshes
    for part in ("clean train", "encode train.en", "train"):
        said = re.findall(rf"' - {part}: (started|done|\d)", flow_output)
        assert said[0] == "started" and said[-1] == "done" and len(said) <= 13, (part, said)
    assert "█" not in flow_output and "?" + " lines/s" not in flow_output
    assert "mlflow/pyfunc" not in flow_output  # registering the model draws no warning from MLflow


@pytest.mark.slow
def test_mlflow_holds_a_parent_run_with_a_nested_run_per_stage(flow_output, repo):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("transformer-en-de")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # MLflow's training view
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("run_kind") == "pipeline"]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.run_name.startswith("quickstart max_steps=30 warmup_steps=30 checkpoint_every_steps=10")
    assert parent.info.status == "FINISHED" and "test_bleu" in parent.data.metrics
    assert parent.data.tags["presets"] == "quickstart" and len(parent.data.tags["git_commit"]) >= 40
    lock = hashlib.sha256((repo / "requirements.lock").read_bytes()).hexdigest()[:16]
    assert all(r.data.tags["env.lock"] == lock for r in runs)  # the environment each result came from
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
    losses = client.get_metric_history(by_stage["train"].info.run_id, "loss")
    assert sorted(m.step for m in losses) == [10, 20, 30]  # no summary point at step 0 on the curve
    assert all("." in key for key in parent.data.params)  # every parameter under its stage's prefix


@pytest.mark.slow
def test_the_model_is_registered_as_a_translator_with_the_best_alias(flow_output, repo):
    import mlflow
    import pandas as pd

    uri = f"sqlite:///{repo / 'mlflow.db'}"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    version = client.get_model_version_by_alias("transformer-en-de-numbers", "best")
    scores = [float(v.tags["test_bleu"]) for v in client.search_model_versions("name = 'transformer-en-de-numbers'")]
    assert float(version.tags["test_bleu"]) == max(scores)  # the 30-step model's may be 0
    mlflow.set_tracking_uri(uri)
    lines = (repo / "data/clean/test.en").read_text(encoding="utf-8").splitlines()[:3]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = mlflow.pyfunc.load_model("models:/transformer-en-de-numbers@best")
    assert not [w for w in caught if "predict function" in str(w.message)]  # its type hint is one MLflow takes
    expected = (repo / "data/hyps/test.de").read_text(encoding="utf-8").splitlines()[:3]
    assert model.predict(lines) == expected  # the logged model decodes as the decode stage did
    assert model.predict([line.replace("-", "\u2013") for line in lines]) == expected  # en dashes, normalised
    assert model.predict(pd.DataFrame({"text": lines})) == expected  # one column, as mlflow.evaluate passes
    assert model.metadata.signature.inputs.to_dict() == [{"type": "string", "required": True}]
    with pytest.raises(mlflow.exceptions.MlflowException, match=r"list\[str\]"):
        model.predict([1, 2])
    # served over REST as the README shows: `mlflow models serve`, sentences as {"inputs": [...]}
    port = free_port()
    serve = [sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/transformer-en-de-numbers@best",
             "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)]
    with serving(serve, f"http://127.0.0.1:{port}/ping", repo, {**env_of(repo), "MLFLOW_TRACKING_URI": uri},
                 "mlflow models serve"):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", json.dumps({"inputs": lines}).encode(),
                                         {"Content-Type": "application/json"})
        assert json.load(urllib.request.urlopen(request, timeout=120))["predictions"] == expected


@pytest.mark.slow
def test_dvc_reruns_only_what_changed(flow_output, repo):
    dvc = [sys.executable, "-m", "dvc"]
    again = run_in(repo, *dvc, "repro")
    assert "Running stage" not in again and "Data and pipelines are up to date" in again
    changed = run_in(repo, *dvc, "exp", "run", "-S", "decode.beam_size=2")
    assert re.findall(r"Running stage '(\w+)'", changed) == ["decode", "score"]
    shown = run_in(repo, *dvc, "exp", "show", "--md")
    assert "test.bleu_tok" in shown and "train_flops" in shown  # all three BLEU variants and the cost


@pytest.mark.slow
def test_report_compares_the_runs_with_the_paper(flow_output, repo):
    run_in(repo, sys.executable, "-m", "pipeline", "report", "--out", "reports")
    text = (repo / "reports/report.md").read_text(encoding="utf-8")
    assert "paper: Transformer base" in text and "en-de quickstart" in text
    for image in ("bleu.png", "cost.png", "loss.png"):
        assert (repo / "reports" / image).read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_the_readmes_examples_run_as_written(flow_output, repo, tmp_path):
    """Every Python block of the README, saved as a script and run (as a user runs it: a stage whose
    workers import the calling script runs differently under `-c`), and the shell block that runs
    stages alone, after a quickstart."""
    text = (repo / "README.md").read_text(encoding="utf-8")
    python_blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(python_blocks) >= 2
    for number, block in enumerate(python_blocks):
        script = tmp_path / f"example_{number}.py"
        script.write_text(block, encoding="utf-8")
        run_in(repo, sys.executable, str(script))
    section = text.split("## One stage alone", 1)[1].split("\n## ", 1)[0]
    shell = re.findall(r"```\n# run by tests/test_pipeline.py\n(.*?)```", section, re.S)[0]
    commands = [line.split("  #")[0].strip() for line in shell.splitlines() if line.strip()]
    assert commands and all(c.startswith("python -m pipeline") for c in commands)
    for command in commands:
        run_in(repo, sys.executable, *command.split()[1:])
    assert (repo / "my/clean/train.de").is_file() and (repo / "my/vocab/spm.model").is_file()
    assert (repo / "my/clean-from-python/train.de").is_file()


@pytest.mark.slow
def test_a_failed_stage_ends_the_run_with_its_own_error_and_keeps_earlier_outputs(flow_output, repo):
    # a budget no training pair fits: a valid value, so only the train stage itself can find it out
    params = repo / "params.yaml"
    saved = params.read_text(encoding="utf-8")
    try:  # -S writes params.yaml; the modules after this one find it as the quickstart left it
        proc = subprocess.run([sys.executable, "-m", "pipeline", "run", "-S", "train.batch_tokens=1"], cwd=repo,
                              env=env_of(repo), capture_output=True, text=True, timeout=600)
    finally:
        params.write_text(saved, encoding="utf-8")
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 1 and "Traceback" not in output
    assert output.splitlines()[-1].startswith("error: stage 'train' failed: no training pair fits: ")
    assert "longer than the batch budget of 1 tokens per micro-batch" in output.splitlines()[-1]
    assert (repo / "models/averaged.safetensors").is_file()  # finished stages keep their outputs
    newest = newest_runs(repo)
    assert {kind: run.info.status for kind, run in newest.items()} == {"stage": "FAILED", "run_kind": "FAILED"}
    assert newest["run_kind"].info.run_name == "batch_tokens=1"


@pytest.mark.slow
def test_a_bad_parameter_stops_every_stage_at_its_line_before_it_works(flow_output, repo):
    params = repo / "params.yaml"
    saved = params.read_text(encoding="utf-8")
    try:
        params.write_text(re.sub(r"  beam_size: \d+", "  beam_size: 0", saved), encoding="utf-8")  # by hand
        line = next(i for i, text in enumerate(params.read_text().splitlines(), 1) if "beam_size: 0" in text)
        proc = subprocess.run([sys.executable, "-m", "pipeline", "clean", "--raw-dir", "data/raw", "--out-dir",
                               "elsewhere"], cwd=repo, env=env_of(repo), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1
        assert proc.stderr.strip().endswith(
            f"params.yaml:{line}: decode.beam_size: must be at least 1 (1: greedy), not 0")
        assert not (repo / "elsewhere").exists()
    finally:
        params.write_text(saved, encoding="utf-8")
