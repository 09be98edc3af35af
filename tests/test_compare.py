"""`python -m pipeline compare`: the experiments in a 120-column terminal (real DVC experiments are
compared in tests/test_pipeline.py); the report's name of a run's test set, and its word when the
tracking store cannot be read."""
import pytest
from servers import free_port

from pipeline.compare import Experiment, table
from stages.io import PipelineError


def test_compare_fits_a_120_column_terminal_and_names_what_changed():
    base = {"train.warmup_steps": 300, "model.d_ff": 512, "decode.beam_size": 4, "model.dropout": 0.1}
    scores = {"score.test.bleu": 27.31, "score.test.bleu_tok": 28.02, "score.test.chrf": 57.4,
              "train.train_flops": 3.3e18, "train.accelerator_hours": 96.0}
    rows = [Experiment("workspace", base, scores, "done"),
            Experiment("warmup-150-with-a-name-longer-than-its-column", {**base, "train.warmup_steps": 150},
                       {**scores, "score.test.bleu": 26.5}, "done"),
            Experiment("table3-C-ff4096", {**base, "model.d_ff": 4096, "decode.beam_size": 8}, {}, "queued"),
            Experiment("abc1234", {**base, "model.dropout": 0.3}, {}, "done")]  # never scored: left out
    lines = table(rows).splitlines()
    assert all(len(line) <= 120 for line in lines) and len(lines) == 4
    assert lines[1].split()[:5] == ["workspace", "beam_size=4", "d_ff=512", "warmup_steps=300", "27.31"]
    assert "warmup_steps=150" in lines[2] and " 26.50 " in lines[2] and "3.30e+18" in lines[2]
    assert "d_ff=4096" in lines[3] and lines[3].rstrip().endswith("queued") and " - " in lines[3]


def test_the_report_names_a_local_test_set_by_its_path():
    from pipeline.report import test_set

    local = {"download.source": "local", "download.local.dir": "corpora/numbers"}
    assert test_set({**local, "download.local.test.src": "test.en"}) == "corpora/numbers/test.en"
    assert test_set({**local, "download.local.test.src": "/data/mine.en"}) == "/data/mine.en"  # not under the dir
    assert test_set({"download.source": "wmt14", "download.wmt14.test": "full"}) == "WMT14 newstest2014 (full)"


def test_the_report_says_in_a_line_that_the_tracking_server_does_not_answer(tmp_path, monkeypatch):
    from pipeline.report import write_report

    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", nobody)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(PipelineError, match=f"report reads the tracked runs, and MLflow's store {nobody} could not "
                                            r"be read \(connection refused\): start its server"):
        write_report(tmp_path)
    assert not (tmp_path / "report.md").exists()
