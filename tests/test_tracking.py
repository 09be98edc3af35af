"""MLflow records that never cost the work: the registry's `best` alias, tracking that goes on without
its server, and the replay of what a lost server missed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from mlflow.tracking import MlflowClient

from conftest import ROOT, train_command, train_params_file, wait_for
from servers import free_port, serving
from pipeline import registry, tracking, unsent


def test_the_best_alias_follows_the_highest_test_bleu(tmp_path):
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model("m")
    for bleu in ("30.1", "35.2", "20.0"):
        client.create_model_version("m", source=str(tmp_path / "model"), tags={"test_bleu": bleu})
    assert registry.point_best(client, "m") == "2"
    assert str(client.get_model_version_by_alias("m", "best").version) == "2"
    client.create_model_version("m", source=str(tmp_path / "model"), tags={"test_bleu": "35.3"})
    assert registry.point_best(client, "m") == "4"  # a better run takes the alias; a worse one leaves it
    client.create_model_version("m", source=str(tmp_path / "model"), tags={"test_bleu": "1.0"})
    assert registry.point_best(client, "m") == "4"


# -- a server that goes away: the sender, the stage's end, and the replay -------------------------------

class Flaky:
    """An MLflow client standing in for a server that answers, or not, as the test says; each call
    takes `delay` seconds, as a slow network would."""

    def __init__(self, delay: float = 0.0) -> None:
        self.up, self.delay, self.calls = True, delay, []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            time.sleep(self.delay)
            if not self.up:
                raise ConnectionError("Connection refused")
            self.calls.append((name, args, kwargs))
        return call


def test_a_record_never_waits_on_the_server_and_a_lost_one_is_said_once(monkeypatch):
    said = []
    client = Flaky(delay=0.5)
    sender = unsent.Sender(client, "http://127.0.0.1:1", "run", say=said.append)
    start = time.monotonic()
    for step in range(200):
        sender.put(unsent.Record("metrics", {"loss": 1.0 / (step + 1)}, step))
    assert time.monotonic() - start < 0.2  # 200 records queued while the first is still being sent
    client.delay, client.up = 0.0, False
    wait_for(lambda: said, 10, "the warning")
    time.sleep(1.5)  # a retry or two meanwhile
    assert len(said) == 1 and said[0].startswith("warning: mlflow: the tracking server http://127.0.0.1:1 stopped "
                                                 "answering at step 199 (connection refused); the stage goes on")
    client.up = True
    assert sender.close(10) == []  # all sent once it answers again, in order
    assert said[1] == "mlflow: the tracking server http://127.0.0.1:1 answers again (lost at step 199)"
    steps = [kwargs["metrics"][0].step for name, args, kwargs in client.calls if name == "log_batch"]
    assert steps == list(range(200))


def test_the_end_of_a_stage_waits_for_a_lost_server_only_the_flush_bound_and_notes_what_it_missed(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(unsent.FLUSH_ENV, "2")
    client = Flaky()
    client.up = False
    tracker = tracking.Tracker(client, "run1", "1", "http://127.0.0.1:1")
    tracker.log_params({"train.max_steps": 300})
    tracker.log_metrics({"loss": 2.5}, 10)
    summary, curves = tmp_path / "train.json", tmp_path / "train.csv"
    summary.write_text(json.dumps({"steps": 10, "loss": 2.5, "parameters": 1000}))
    curves.write_text("step,loss\n5,3.0\n10,2.5\n")
    start = time.monotonic()
    tracker.finish("FINISHED", "train", summary, (curves,))
    assert time.monotonic() - start < 4  # the flush bound, not MLflow's minutes of retries
    note = json.loads((unsent.NOTES / "run1.json").read_text())
    assert note["status"] == "FINISHED" and note["params"] == {"train.max_steps": "300"}
    assert note["curves"] == [str(curves.resolve())] and note["summary"] == str(summary.resolve())
    out = capsys.readouterr().out
    assert "warning: mlflow: 3 records of this train run did not reach http://127.0.0.1:1 within 2 s" in out


def test_sync_sends_what_the_server_missed_from_the_stage_files_once(tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("e"), run_name="train").info.run_id
    unsent.send(client, run, unsent.Record("metrics", {"loss": 3.0}, 5))  # what reached the server before it went
    summary, curves = tmp_path / "train.json", tmp_path / "train.csv"
    summary.write_text(json.dumps({"steps": 15, "loss": 2.0, "parameters": 1000, "valid": {"bleu": 1.5}}))
    curves.write_text("step,loss,lr\n5,3.0,0.1\n10,2.5,0.2\n15,2.0,0.3\n")
    unsent.write_note(uri, run, "train", [unsent.Record("params", {"a": "1"}), unsent.Record("status", "FINISHED")],
                      summary, [curves])
    assert unsent.sync() == 0
    assert [(m.step, m.value) for m in client.get_metric_history(run, "loss")] == [(5, 3.0), (10, 2.5), (15, 2.0)]
    assert [m.step for m in client.get_metric_history(run, "lr")] == [5, 10, 15]
    finished = client.get_run(run)
    assert finished.data.metrics["parameters"] == 1000 and finished.data.metrics["valid_bleu"] == 1.5
    assert finished.data.params == {"a": "1"} and finished.info.status == "FINISHED"
    assert "sent 8 metric values, 1 params, 0 tags, 0 artifacts, status FINISHED" in capsys.readouterr().out
    assert unsent.sync() == 0 and "nothing unsent" in capsys.readouterr().out  # the note is gone


def test_sync_keeps_a_note_while_its_server_is_away_and_refuses_files_a_later_run_rewrote(tmp_path, monkeypatch,
                                                                                           capsys):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    summary = tmp_path / "score.json"
    summary.write_text(json.dumps({"test": {"bleu": 30.0}}))
    unsent.write_note("http://127.0.0.1:9", "abc", "score", [], summary, [])
    assert unsent.sync() == 1 and "kept for the next sync" in capsys.readouterr().out
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("e")).info.run_id
    unsent.write_note(uri, run, "score", [unsent.Record("status", "FINISHED")], summary, [])
    (unsent.NOTES / "abc.json").unlink()
    summary.write_text(json.dumps({"test": {"bleu": 12.0}}))  # a later run's
    assert unsent.sync() == 0
    assert "changed since (a later run wrote them)" in capsys.readouterr().out
    assert client.get_run(run).data.metrics == {} and client.get_run(run).info.status == "FINISHED"


def test_sync_says_a_file_that_is_gone_is_gone_and_still_sends_the_rest(tmp_path, capsys):
    """A queued DVC experiment's stage files go with the copy DVC ran it in; its note stays in the checkout."""
    from mlflow.tracking import MlflowClient

    summary = tmp_path / "copy" / "score.json"
    summary.parent.mkdir()
    summary.write_text(json.dumps({"test": {"bleu": 30.0}}))
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("e")).info.run_id
    unsent.write_note(f"sqlite:///{tmp_path / 'mlflow.db'}", run, "score", [unsent.Record("status", "FINISHED")],
                      summary, [])
    summary.unlink()
    assert unsent.sync() == 0
    assert f"{summary} gone since (removed, or a queued experiment's copy" in capsys.readouterr().out
    assert client.get_run(run).data.metrics == {} and client.get_run(run).info.status == "FINISHED"


def test_the_run_link_names_the_server_the_run_was_logged_to(monkeypatch):
    monkeypatch.delenv("MLFLOW_UI_URL", raising=False)
    served = tracking.Tracker(None, None, "3", "http://10.0.0.7:5050")
    served.run_id = "r1"
    assert tracking.run_url(served) == "http://10.0.0.7:5050/#/experiments/3/runs/r1"
    assert tracking.served_by(served) == ""
    local = tracking.Tracker(None, None, "3", "sqlite:///work/mlflow.db")
    local.run_id = "r1"
    line = f"{tracking.RUN_LINE}{tracking.run_url(local)}{tracking.served_by(local)}"
    assert line.endswith("/#/experiments/3/runs/r1 (served by: mlflow ui --backend-store-uri sqlite:///work/mlflow.db)")
    assert tracking.run_url_in(line) == "http://127.0.0.1:5000/#/experiments/3/runs/r1"



def test_a_queued_experiments_records_go_to_the_repository_it_was_queued_from(tmp_path):
    from pipeline.config import checkout_of

    repo = tmp_path / "repo"
    copy = repo / ".dvc/tmp/exps/tmpab12cd"  # where `dvc queue start` runs an experiment, deleted afterwards
    assert checkout_of(copy, str(repo)) == repo
    assert checkout_of(copy / "project", str(repo)) == repo / "project"  # the project in a folder of the repository
    assert checkout_of(repo, str(repo)) == repo  # dvc repro, dvc exp run in the workspace
    assert checkout_of(repo / "project", str(repo)) == repo / "project"
    assert checkout_of(copy, None) == copy  # not run by DVC
    alone = repo / ".dvc/tmp/exps/standalone/tmpef34gh"  # where `dvc exp run --temp` runs one
    assert checkout_of(alone, str(repo)) == repo and checkout_of(alone / "project", str(repo)) == repo / "project"

# -- a real `mlflow server`, stopped while the train stage works, then started again --------------------

def _train(params, encoded, vocab_dir, out, env) -> tuple[subprocess.Popen, list[str], float]:
    """The train stage as a command; its output lines as they come (a thread collects them)."""
    proc = subprocess.Popen([sys.executable, *train_command(params, encoded, vocab_dir, out)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines, time.monotonic()


@pytest.mark.slow
def test_training_outlives_its_tracking_server_and_sync_sends_what_it_missed(encoded, vocab_dir, tmp_path):
    """40 steps of the quickstart's model, a row every 5 and a checkpoint every 20: once with the server
    up, once with it stopped after step 10; then the server again, and `python -m pipeline sync`."""
    from mlflow.tracking import MlflowClient

    port, store = free_port(), tmp_path / "server"
    store.mkdir()
    uri = f"http://127.0.0.1:{port}"
    server = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
              "--artifacts-destination", str(store / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
              "--workers", "1"]
    params = train_params_file(tmp_path, **{"train.max_steps": 40, "train.checkpoint_every_steps": 20})
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PIPELINE_MLFLOW_FLUSH_SECONDS": "10", "PYTHONUNBUFFERED": "1"}
    seconds = {}
    with serving(server, f"{uri}/health", store, {**os.environ}, "the MLflow server"):
        proc, lines, start = _train(params, encoded[0], vocab_dir, tmp_path / "up", env)
        assert proc.wait(timeout=600) == 0, "".join(lines)[-3000:]
        seconds["up"] = time.monotonic() - start
        proc, lines, start = _train(params, encoded[0], vocab_dir, tmp_path / "down", env)
        wait_for(lambda: any(line.startswith("step 10/40") for line in lines), 300, "step 10")
    # the server is gone (killed with its process group) from here
    assert proc.wait(timeout=600) == 0, "".join(lines)[-3000:]
    seconds["down"] = time.monotonic() - start
    output = "".join(lines)
    print(f"train stage, 40 steps: {seconds['up']:.1f} s with the server up, {seconds['down']:.1f} s with it "
          "stopped after step 10")
    assert seconds["down"] <= 2 * seconds["up"] + 10
    assert "Traceback" not in output and any((tmp_path / "down/ckpt").rglob("checkpoint-00000040.pt"))
    lost = [line for line in lines if "stopped answering" in line]
    assert len(lost) == 1 and lost[0].startswith(f"warning: mlflow: the tracking server {uri} stopped answering at "
                                                 "step ")
    assert int(lost[0].split(" at step ")[1].split(" ")[0]) < 40
    assert f"did not reach {uri} within 10 s" in output
    link = tracking.run_url_in(next(line for line in lines if line.startswith(tracking.RUN_LINE)))
    assert link.startswith(f"{uri}/#/experiments/")  # the server the run was logged to, not a default port
    run_id = link.rsplit("/", 1)[1]
    with serving(server, f"{uri}/health", store, {**os.environ}, "the MLflow server, again"):
        sync = subprocess.run([sys.executable, "-m", "pipeline", "sync"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert sync.returncode == 0, sync.stdout + sync.stderr
        client = MlflowClient(tracking_uri=uri)
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.data.params["train.max_steps"] == "40"
        assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(5, 41, 5))
        assert "valid_loss" in run.data.metrics and "mean_tgt_tokens_per_sec" in run.data.metrics
    print(sync.stdout.strip())
