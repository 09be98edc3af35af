"""What a stage command costs around its work: the score stage on the first --lines lines of
newstest2013 and newstest2014 (their references scored against themselves), run as dvc.yaml runs it
(`python -m pipeline.stage score`: cycle collection off while it imports, its objects frozen after
that and before exit) against the same stage's `main` called from an import of pipeline.stage
(Python's collector as it comes, as the command ran before). Each in a fresh process, alternating,
MLflow tracking into a store of its own:

    python -m bench.stage_startup --rounds 5 --lines 200

Prints each one's median wall time (and range: this machine drifts), the ratio, and whether the two
wrote the same metrics (if not, it exits with an error: the times would not compare)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import SHARED
from bench.results import record
from stages.io import write_manifest

ROOT = Path(__file__).resolve().parents[1]
REFERENCES = {"dev": "wmt14/newstest2013/newstest2013.de",
              "test": "wmt14/newstest2014-full/newstest2014-deen-ref.de.txt"}
SCORE = ["score", "--hyp-dir", "{work}/hyps", "--ref-dir", "{work}/refs", "--metrics", "{work}/{name}.json"]
WAYS = {"python -m pipeline.stage": [sys.executable, "-m", "pipeline.stage"],
        "pipeline.stage.main, imported": [sys.executable, "-c",
                                          "import sys; from pipeline.stage import main; sys.exit(main(sys.argv[1:]))"]}


def texts(work: Path, lines: int) -> None:
    """References (download's output: text and manifest) and the same lines as the translations."""
    for name in ("refs", "hyps"):
        (work / name).mkdir()
        counts = {"train": 0}
        for split, path in REFERENCES.items():
            if not (SHARED / path).is_file():
                sys.exit(f"error: {SHARED / path}: not found (set SHARED_DATA to the shared data folder)")
            kept = (SHARED / path).read_bytes().splitlines(keepends=True)[:lines]
            (work / name / f"{split}.de").write_bytes(b"".join(kept))
            counts[split] = len(kept)
        write_manifest(work / name, "en", "de", counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="runs of each, alternating")
    ap.add_argument("--lines", type=int, default=200, help="lines of each test set (the stage's work)")
    args = ap.parse_args()
    for name in ("rounds", "lines"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        work = Path(tmp)
        texts(work, args.lines)
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "PYTHONPATH": str(ROOT)}
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for _ in range(args.rounds + 1):  # the first round makes the store and warms the disk cache: not counted
            for i, (way, command) in enumerate(WAYS.items()):
                argv = command + [a.format(work=work, name=f"way{i}") for a in SCORE]
                start = time.perf_counter()
                proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
                elapsed = time.perf_counter() - start
                if proc.returncode != 0:
                    sys.exit(f"error: {way} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
                times[way].append(elapsed)
        metrics = [json.loads((work / f"way{i}.json").read_text()) for i in range(len(WAYS))]
    medians = {way: statistics.median(t[1:]) for way, t in times.items()}
    print(f"the score stage on {args.lines} lines of newstest2013 and of newstest2014 (German references), "
          f"a fresh process each, median of {args.rounds}:")
    for way, t in times.items():
        print(f"  {way:32s} {medians[way]:6.2f} s  (runs {min(t[1:]):.2f}-{max(t[1:]):.2f})")
    now, before = medians.values()
    summary = f"command / imported main: {before / now:.2f}x faster"
    print(f"  {summary}; the same metrics: {metrics[0] == metrics[1]}")
    if metrics[0] != metrics[1]:
        sys.exit(f"error: the two ways wrote different metrics, so their times do not compare:\n{metrics}")
    record("stage_startup", f"{args.lines} lines", f"A stage's command: the score stage on {args.lines} lines of "
           "newstest2013 and 2014, a fresh process each", [{"way": way, "median seconds": round(medians[way], 2),
                                                            "runs": len(t) - 1} for way, t in times.items()], summary)


if __name__ == "__main__":
    main()
