"""Progress on a terminal is tqdm's live bar; in a log (the Prefect flow's, CI's, Slurm's) it is lines."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from stages import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    """Seconds that pass only when the test says so, for the bar's rate limit and tqdm's own times."""
    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    monkeypatch.setattr("tqdm.std.time", lambda: now[0])
    return now


def test_in_a_log_a_part_is_a_line_at_its_start_its_end_and_every_tenth_or_30_seconds(clock):
    log = io.StringIO()
    with progress.Bar(total=1000, desc="clean train", unit=" pairs", file=log, mininterval=0) as bar:
        for _ in range(1000):
            clock[0] += 0.05  # 50 s in all: a tenth of the way every 5 s
            bar.update(1)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and log.getvalue().endswith("\n")
    assert lines[0] == "clean train: started, 1000 pairs"
    assert lines[-1].startswith("clean train: done, 1000 pairs in 00:")
    tenths = [f"clean train: {n}/1000 pairs" for n in range(100, 1000, 100)]
    assert [line.split(" (")[0] for line in lines[1:-1]] == tenths


def test_in_a_log_a_slow_part_says_where_it_is_every_30_seconds_and_a_fast_one_only_starts_and_ends(clock):
    log = io.StringIO()
    with progress.Bar(desc="download", unit=" lines", file=log, mininterval=0) as bar:  # no total
        for _ in range(10):
            clock[0] += 10
            bar.update(5)
    lines = log.getvalue().splitlines()
    assert [line.split(" [")[0] for line in lines] == ["download: started", "download: 15 lines", "download: 30 lines",
                                                       "download: 45 lines", "download: done, 50 lines in 01:40 "
                                                       "( 2.00s/ lines)"]
    log = io.StringIO()
    for _ in progress.Bar(range(100), desc="quick", file=log, mininterval=0):
        pass  # no time passes: under 2 s between tenths, so no line between start and end
    assert len(log.getvalue().splitlines()) == 2


def test_on_a_terminal_the_bar_redraws_in_place(clock):
    screen = Terminal()
    with progress.Bar(total=10, desc="train", file=screen, mininterval=0) as bar:
        for _ in range(10):
            clock[0] += 1
            bar.update(1)
    assert screen.getvalue().count("\r") >= 10 and "train: 100%|" in screen.getvalue()


def test_the_libraries_bars_stay_out_of_a_log_and_on_a_terminal(monkeypatch):
    """MLflow's and Hugging Face's own bars: switched off where output is a log (a subprocess that then
    imports transformers has them off), left alone on a terminal or where the user chose."""
    code = ("from stages import progress; progress.library_bars_as_lines(); import transformers; "
            "from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR as m; "
            "print(transformers.utils.logging.is_progress_bar_enabled(), m.get())")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS",
                                                            "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")}
    said = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert said.stdout.split() == ["False", "False"]
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(progress.sys, "stderr", Terminal())
    progress.library_bars_as_lines()
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ and "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR" not in os.environ
