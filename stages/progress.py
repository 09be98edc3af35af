"""Progress of long work: tqdm's live bar (rate and ETA) on a terminal; anywhere else (the Prefect
flow's log, CI, a Slurm job's file) lines a log can hold: one when the part starts, one when it ends,
and between them one every 30 seconds or tenth of the way (not closer than 2 seconds), never a line
per refresh."""
from __future__ import annotations

import os
import sys
import time
from typing import Any

from tqdm import tqdm

EVERY_SECONDS = 30.0
EVERY_FRACTION = 0.1


class Bar(tqdm):
    """tqdm, whose output to a file or pipe is lines (above) instead of a bar redrawn in place."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        file = kwargs.get("file") or sys.stderr  # tqdm's default
        self.as_lines = not (file is not None and hasattr(file, "isatty") and file.isatty())
        self.printed_at: float | None = None  # when the last line was written, and how far it had come
        self.printed_n = 0
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if not self.as_lines:
            return super().display(msg, pos)
        closing = self.disable  # tqdm's close() marks the bar disabled before its last display
        now = time.monotonic()
        if self.printed_at is None:
            line = "{desc}: started" + (", {total_fmt}{unit}" if self.total else "")
        elif closing:
            line = "{desc}: done, {n_fmt}{unit} in {elapsed} ({rate_fmt}{postfix})"
        elif (self.total is None or self.n < self.total) and (now - self.printed_at >= EVERY_SECONDS or (
                self.total and self.n - self.printed_n >= EVERY_FRACTION * self.total and now - self.printed_at >= 2)):
            line = ("{desc}: {n_fmt}/{total_fmt}{unit} ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
                    if self.total else "{desc}: {n_fmt}{unit} [{elapsed}, {rate_fmt}{postfix}]")
        else:
            return True
        self.fp.write(self.format_meter(**{**self.format_dict, "bar_format": line}) + "\n")
        self.fp.flush()
        self.printed_at, self.printed_n = now, self.n
        return False  # nothing for close() to clear

    def close(self) -> None:
        if self.as_lines:
            self.leave = False  # its last line is written; a terminal's closing newline is not wanted
        super().close()


def library_bars_as_lines() -> None:
    """Where output is not a terminal, the libraries' own bars (MLflow's artifact transfers, Hugging Face's
    weight loading) stay out of it: a log gets the lines above, never a bar's refreshes. Called before
    those libraries are imported, as they read the switches then."""
    if not sys.stderr.isatty():
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
