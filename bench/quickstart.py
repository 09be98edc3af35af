"""The quickstart as a user runs it, timed: `make quickstart` (`python -m pipeline quickstart`: the Prefect flow
over dvc.yaml on the bundled corpus of number phrases, MLflow tracking and all), from nothing to its scores, in a
scratch clone of this checkout. The README's quickstart row is this record.

    python -m bench.quickstart                           # a few minutes on 2 cores
    python -m bench.quickstart -S train.max_steps=20     # a smoke run: any override after the preset

It records the minutes end to end and the test and dev BLEU in bench/results/ and prints them. Run it alone:
another job on the machine costs it minutes.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import clone, timed_pipeline
from bench.results import record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="an override after the preset, as `python -m pipeline quickstart -S`")
    args = ap.parse_args()
    sets = [a for o in args.overrides for a in ("-S", o)]
    with tempfile.TemporaryDirectory(prefix="bench-quickstart-") as tmp:
        minutes, rows, steps = timed_pipeline(clone(Path(tmp) / "project"), ["quickstart", *sets],
                                              {"test": "test", "dev": "dev"})
    for row in rows:
        print(row)
    summary = f"{minutes:.1f} minutes end to end, {steps} steps"
    print(summary)
    changes = " ".join(args.overrides)
    record("quickstart", changes or "as committed",
           f"`make quickstart`{', ' + changes if changes else ''}: the whole pipeline on corpora/numbers as a user "
           "runs it", rows, summary)


if __name__ == "__main__":
    main()
