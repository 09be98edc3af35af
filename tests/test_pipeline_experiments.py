"""Experiments that compare, in the copy the quickstart ran in (after tests/test_pipeline.py): a changed
training parameter trains a run of its own and going back retrains nothing, two Table 3 rows queue, and
run back to back (their MLflow records in the repository's store, not the deleted copies DVC ran them in),
`python -m pipeline compare` lists them, `dvc plots show` needs no network."""
import re
import sys

import pytest
from mlflow.tracking import MlflowClient

from conftest import run_in


@pytest.mark.slow
def test_a_changed_training_parameter_starts_its_own_run_and_going_back_retrains_nothing(flow_output, repo):
    from stages.model_files import current_dir

    dvc = [sys.executable, "-m", "dvc"]
    first = current_dir(repo / "models/checkpoints")
    files = {p.name: p.stat().st_mtime_ns for p in first.glob("*.pt")}
    changed = run_in(repo, *dvc, "exp", "run", "-n", "warmup-150", "-S", "train.warmup_steps=150")
    assert "Running stage 'train'" in changed and "holds a" not in changed
    assert current_dir(repo / "models/checkpoints") != first
    assert {p.name: p.stat().st_mtime_ns for p in first.glob("*.pt")} == files  # the first run untouched
    back = run_in(repo, *dvc, "exp", "run", "-n", "warmup-30", "-S", "train.warmup_steps=30")  # conftest.SMALL's
    assert current_dir(repo / "models/checkpoints") == first
    assert f"{first.name}/checkpoint-00000030.pt at step 30" in back
    assert {p.name: p.stat().st_mtime_ns for p in first.glob("*.pt")} == files  # nothing retrained
    table = run_in(repo, sys.executable, "-m", "pipeline", "compare")
    lines = [line for line in table.splitlines() if line.strip()]
    assert all(len(line) <= 120 for line in lines) and lines[0].split()[:3] == ["experiment", "changed", "BLEU"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert "warmup_steps=150" in rows["warmup-150"] and "warmup_steps=30 " in rows["warmup-30"]
    assert re.search(r"warmup_steps=30 .* \d+\.\d\d +\d+\.\d\d +\d+\.\d\d +\d\.\d\de\+\d\d", rows["warmup-30"])


@pytest.mark.slow
def test_two_table3_rows_queue_and_run_back_to_back(flow_output, repo):
    (repo / "experiments/table3.yaml").write_text(  # two tiny rows of the same shape as the paper's, 10 steps each
        "common:\n  average.last: 1\n  train.max_steps: 10\nrows:\n  T-ff256: {model.d_ff: 256}\n"
        "  T-ff64: {model.d_ff: 64}\n")
    run_in(repo, sys.executable, "-m", "pipeline", "table3", "--queue", "T-ff64")
    queued = run_in(repo, sys.executable, "-m", "dvc", "queue", "status")
    assert re.search(r"table3-T-ff64 .*Queued", queued), queued
    run_in(repo, sys.executable, "-m", "dvc", "queue", "remove", "--queued")
    ran = run_in(repo, sys.executable, "-m", "pipeline", "table3", "--run")
    assert "holds a" not in ran and "table3-T-ff64 (2 of 2): dvc exp run --temp -n table3-T-ff64" in ran
    table = run_in(repo, sys.executable, "-m", "pipeline", "compare")
    rows = {line.split()[0]: line for line in table.splitlines()[1:] if line.strip()}
    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")  # the repository's, not the run's copy
    experiment = client.get_experiment_by_name("transformer-en-de").experiment_id
    for name, d_ff in (("table3-T-ff256", 256), ("table3-T-ff64", 64)):
        assert f"d_ff={d_ff}" in rows[name] and rows[name].rstrip().endswith("done"), table
        assert re.search(r" \d+\.\d\d ", rows[name]), rows[name]  # scored
        runs = {r.data.tags["stage"]: r for r in client.search_runs([experiment], f"tags.dvc_experiment = '{name}'")}
        assert runs["train"].data.params["model.d_ff"] == str(d_ff) and "decode" in runs, sorted(runs)


@pytest.mark.slow
def test_dvc_plots_show_needs_no_network(flow_output, repo):
    assert (repo / ".dvc/offline-plots.html").is_file(), "run `make setup` (python -m pipeline offline-plots) first"
    run_in(repo, sys.executable, "-m", "dvc", "plots", "show", "--out", "dvc_plots")
    page = (repo / "dvc_plots/index.html").read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page) and "cdn.jsdelivr" not in page
    assert page.count("vegaEmbed(") >= 3  # the loss, learning-rate and throughput plots
    first_loss = (repo / "plots/train.csv").read_text().splitlines()[1].split(",")[1]
    assert first_loss[:6] in page  # the data is in the page
