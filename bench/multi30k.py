"""The multi30k preset as a user runs it, timed: `python -m pipeline run --preset multi30k` (the Prefect
flow over dvc.yaml, MLflow tracking and all), from nothing to its scores, in a scratch clone of this
checkout, reading Multi30k from the shared copy (the download stage's local source).

    python -m bench.multi30k                          # en-de: about half an hour on 2 cores
    python -m bench.multi30k --tgt fr                 # en-fr
    python -m bench.multi30k -S train.max_steps=300   # a try: any override after the preset
    python -m bench.multi30k --preset multi30k-amx    # a preset layered after multi30k

It records the minutes end to end and test2016 and val BLEU (sacreBLEU cased, and BLEU on lowercased
Moses-tokenised text, the figure published Multi30k results quote) in bench/results/, and prints them.
Run it alone: another job on the machine costs it minutes.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import MULTI30K, clone, timed_pipeline
from bench.results import record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tgt", choices=("de", "fr"), default="de")
    ap.add_argument("--preset", dest="presets", action="append", default=[], metavar="NAME",
                    help="a preset layered after multi30k, as `python -m pipeline run --preset multi30k --preset NAME`")
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="an override after the preset, as `python -m pipeline run -S`")
    ap.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temporary one)")
    args = ap.parse_args()
    tgt = args.tgt
    local = ["-S", "download.source=local", "-S", f"download.local.dir={MULTI30K}", "-S", f"download.tgt_lang={tgt}",
             "-S", f"download.local.train=[{{src: train.en, tgt: train.{tgt}}}]",
             "-S", f"download.local.dev={{src: val.en, tgt: val.{args.tgt}}}",
             "-S", f"download.local.test={{src: test_2016_flickr.en, tgt: test_2016_flickr.{args.tgt}}}"]
    with tempfile.TemporaryDirectory(prefix="bench-multi30k-") as tmp:
        project = clone((args.keep or Path(tmp)) / "project")
        layered = [a for name in args.presets for a in ("--preset", name)]
        minutes, rows, steps = timed_pipeline(
            project, ["run", "--preset", "multi30k", *layered, *local, *[a for o in args.overrides for a in ("-S", o)]],
            {"test": "test2016", "dev": "val"})
    for row in rows:
        print(row)
    changes = " ".join(args.overrides)
    summary = f"{minutes:.1f} minutes end to end, {steps} steps"
    print(summary)
    argv = [*(["--tgt", tgt] if tgt != "de" else []), *layered,
            *[a for o in args.overrides for a in ("-S", o)]]  # not --keep
    name = " + ".join(["multi30k", *args.presets])
    record("multi30k", " ".join(filter(None, (f"en-{args.tgt}", *args.presets, changes))),
           f"The {name} preset{'s' if args.presets else ''}, en-{args.tgt}{', ' + changes if changes else ''}: "
           "the whole pipeline as a user runs it", rows, summary, argv=argv)


if __name__ == "__main__":
    main()
