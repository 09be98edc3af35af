"""`python -m pipeline compare`: the experiments side by side in a 120-column terminal: what each
changed, its scores (sacreBLEU, the paper's tokenised BLEU, chrF, on the test set) and what its
training cost.

The rows are DVC's experiments (`dvc exp show --json`): the workspace, the commit it is on, and every
experiment run from it (`dvc exp run -S ...`, Table 3's queue), each with its params.yaml and the
metrics files its stages wrote. Rows without scores (a commit whose pipeline never ran) are left
out, but for experiments still queued or running. A parameter is shown, as `key=value`, where the
rows listed differ in it.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import ROOT
from stages.io import PipelineError


@dataclass(frozen=True)
class Experiment:
    name: str
    params: dict[str, Any]  # "train.warmup_steps": 150
    metrics: dict[str, Any]  # "score.test.bleu": 27.3, "train.train_flops": ...
    state: str  # done, queued, running, failed


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): data}


def _experiment(name: str, data: dict[str, Any], state: str) -> Experiment:
    params = _flat((data.get("params") or {}).get("params.yaml", {}).get("data", {}))
    metrics = {}
    for path, content in (data.get("metrics") or {}).items():
        metrics.update(_flat(content.get("data", {}), f"{Path(path).stem}."))
    return Experiment(name, params, metrics, state)


def experiments(root: Path = ROOT) -> list[Experiment]:
    """The commit (and the workspace, where it differs), then its experiments, oldest first."""
    proc = subprocess.run([sys.executable, "-m", "dvc", "exp", "show", "--json"], cwd=root, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise PipelineError(f"dvc exp show failed: {proc.stderr.strip().splitlines()[-1:]}")
    rows = []
    for commit in json.loads(proc.stdout):
        name = "workspace" if commit["rev"] == "workspace" else commit.get("name") or commit["rev"][:7]
        rows.append(_experiment(name, commit.get("data") or {}, "done"))
        for exp in reversed(commit.get("experiments") or []):
            for rev in exp.get("revs") or []:
                state = (rev.get("data") or {}).get("status") or (exp.get("executor") or {}).get("state") or "done"
                rows.append(_experiment(exp.get("name") or rev.get("name") or rev["rev"][:7], rev.get("data") or {},
                                        str(state).lower().replace("success", "done")))
    return rows


def _number(value: Any, form: str) -> str:
    return format(value, form) if isinstance(value, int | float) else "-"


def table(rows: list[Experiment], width: int = 120) -> str:
    """One line per experiment, within `width` columns."""
    rows = [r for r in rows if "score.test.bleu" in r.metrics or r.state != "done"]
    if not rows:
        return "no experiment has scores yet: run the pipeline (python -m pipeline run, dvc exp run)"
    varying = sorted({k for r in rows for k in r.params if r.params.get(k) != rows[0].params.get(k)}
                     | {k for k in rows[0].params if any(k not in r.params for r in rows)})
    short = {k: k.rsplit(".", 1)[-1] for k in varying}
    if len(set(short.values())) < len(short):  # the same leaf in two sections: keep the section
        short = {k: k for k in varying}
    fixed = [("BLEU", 6, "score.test.bleu", ".2f"), ("BLEU tok", 8, "score.test.bleu_tok", ".2f"),
             ("chrF", 6, "score.test.chrf", ".2f"), ("train FLOPs", 11, "train.train_flops", ".2e"),
             ("acc. h", 7, "train.accelerator_hours", ".3f")]
    name_width = min(20, max(10, *(len(r.name) for r in rows)))
    changes_width = width - name_width - sum(w for _, w, _, _ in fixed) - 8 - 2 * (len(fixed) + 2)
    lines = ["  ".join([f"{'experiment':{name_width}}", f"{'changed':{changes_width}}",
                        *(f"{title:>{w}}" for title, w, _, _ in fixed), f"{'state':8}"])]
    for r in rows:
        changed = " ".join(f"{short[k]}={r.params.get(k)}" for k in varying)
        changed = changed if len(changed) <= changes_width else changed[: changes_width - 1] + "…"
        lines.append("  ".join([f"{r.name[:name_width]:{name_width}}", f"{changed or '-':{changes_width}}",
                                *(f"{_number(r.metrics.get(key), form):>{w}}" for _, w, key, form in fixed),
                                f"{r.state[:8]:8}"]))
    return "\n".join(lines)
