"""A report comparing pipeline runs with the paper: markdown plus PNG plots, from the MLflow records
(each pipeline run's scores, its train stage's cost and curves) and DVC's experiments.

    python -m pipeline report --out reports    # reports/report.md, bleu.png, cost.png, loss.png

The paper's rows are its Table 2 (BLEU, training FLOPs) and Table 3 (parameters); its GPU-hours are
12 h and 3.5 days on 8 P100s.
"""
from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import compare, tracking, unsent
from stages.io import PipelineError, atomic_write

PAPER = [  # name, test BLEU en-de (tokenised), en-fr, parameters, training FLOPs, GPU-hours (P100)
    ("paper: Transformer base", 27.3, 38.1, 65e6, 3.3e18, 12 * 8),
    ("paper: Transformer big", 28.4, 41.8, 213e6, 2.3e19, 3.5 * 24 * 8),
]


@dataclass
class Run:
    name: str
    pair: str
    test_set: str
    bleu: float
    bleu_tok: float
    chrf: float
    parameters: float = float("nan")
    flops: float = float("nan")
    hours: float = float("nan")
    loss: list[tuple[int, float]] = field(default_factory=list)
    valid_loss: list[tuple[int, float]] = field(default_factory=list)


def mlflow_runs() -> list[Run]:
    """Every finished pipeline run of every language pair's experiment, oldest first."""
    from mlflow.tracking import MlflowClient

    uri = tracking.tracking_uri()
    client = MlflowClient(tracking_uri=uri)
    try:
        experiments = client.search_experiments(filter_string="name LIKE 'transformer-%'")
    except Exception as e:  # noqa: BLE001 - whatever keeps the store from being read: said in a line
        raise PipelineError(f"report reads the tracked runs, and MLflow's store {uri} could not be read "
                            f"({unsent.reason(e)}): start its server, or unset MLFLOW_TRACKING_URI to read this "
                            "checkout's own") from None
    runs = []
    for exp in experiments:
        key, value = tracking.PIPELINE_TAG
        parents = client.search_runs([exp.experiment_id], f"tags.{key} = '{value}' and attributes.status = 'FINISHED'",
                                     order_by=["attributes.start_time ASC"])
        for parent in parents:
            m = parent.data.metrics
            if "test_bleu" not in m:
                continue
            pair = exp.name.removeprefix("transformer-")
            run = Run(f"{pair} {parent.info.run_name} ({parent.info.run_id[:6]})", pair, test_set(parent.data.params),
                      m["test_bleu"], m.get("test_bleu_tok", float("nan")), m.get("test_chrf", float("nan")))
            train = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}' "
                                       "and attributes.run_name = 'train'")
            if train:
                tm, run_id = train[0].data.metrics, train[0].info.run_id
                run.parameters = tm.get("parameters", float("nan"))
                run.flops, run.hours = tm.get("train_flops", float("nan")), tm.get("accelerator_hours", float("nan"))
                for key, target in (("loss", run.loss), ("valid_loss", run.valid_loss)):
                    target.extend((p.step, p.value) for p in client.get_metric_history(run_id, key) if p.step > 0)
            runs.append(run)
    return runs


def test_set(params: dict[str, str]) -> str:
    """What a run was tested on, from its parameters: only newstest2014 compares with the paper."""
    if params.get("download.source") == "wmt14":
        return f"WMT14 newstest2014 ({params.get('download.wmt14.test', 'full')})"
    if params.get("download.source") == "multi30k":
        return "Multi30k test_2016_flickr"
    # the test file relative to the corpus folder, or an absolute path of its own
    return str(Path(params.get("download.local.dir", "?")) / params.get("download.local.test.src", "?"))


def _table(runs: list[Run], experiments: list[compare.Experiment]) -> str:
    lines = ["| run | test set | test BLEU tokenised (paper's) | sacreBLEU | chrF | parameters | training FLOPs | "
             "accelerator-hours |", "|---|---|---|---|---|---|---|---|"]
    for name, de, fr, params, flops, hours in PAPER:
        lines.append(f"| {name} | WMT14 newstest2014 (full) | {de} (en-de), {fr} (en-fr) | | | {params / 1e6:.0f}M | "
                     f"{flops:.1e} | {hours:.0f} (P100) |")
    for r in runs:
        lines.append(f"| {r.name} | {r.test_set} | {r.bleu_tok:.2f} | {r.bleu:.2f} | {r.chrf:.2f} | "
                     f"{r.parameters / 1e6:.1f}M | {r.flops:.2e} | {r.hours:.3f} |")
    out = "\n".join(lines)
    if experiments:
        out += "\n\nDVC experiments (`python -m pipeline compare`):\n\n```\n" + compare.table(experiments) + "\n```"
    return out


def _save(fig: Any, path: Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    with atomic_write(path, "wb") as f:
        f.write(buffer.getvalue())


def _plots(runs: list[Run], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name, *_ in PAPER] + [r.name for r in runs]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.5))
    ax.barh(names, [de for _, de, *_ in PAPER] + [r.bleu_tok for r in runs],
            color=["grey"] * len(PAPER) + ["C0"] * len(runs))
    ax.set_xlabel("test BLEU, tokenised and compound-split (the paper's measure)")
    ax.invert_yaxis()
    _save(fig, out_dir / "bleu.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    # the paper's two points sit close: one label below and right, the other above and left
    for (name, de, _, _, flops, _), (dx, dy, side) in zip(PAPER, ((6, -14, "left"), (-6, 8, "right")), strict=True):
        ax.scatter(flops, de, color="grey", marker="s")
        ax.annotate(name.removeprefix("paper: "), (flops, de), textcoords="offset points", xytext=(dx, dy),
                    ha=side, fontsize=8)
    for i, r in enumerate(runs):  # runs of similar cost sit close: a legend, not labels that overlap
        ax.scatter(r.flops, r.bleu_tok, color=f"C{i % 10}", label=textwrap.fill(r.name, 42))
    if runs:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    ax.margins(y=0.15)
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs (ours: counted model FLOPs; the paper's: GPU time x sustained rate)")
    ax.set_ylabel("test BLEU (tokenised)")
    _save(fig, out_dir / "cost.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(runs):
        if r.loss:
            ax.plot(*zip(*r.loss), color=f"C{i}", label=f"{r.name} train")
        if r.valid_loss:
            ax.plot(*zip(*r.valid_loss), color=f"C{i}", linestyle="--", label=f"{r.name} valid")
    ax.set_xlabel("step")
    ax.set_ylabel("label-smoothed loss per target token")
    if runs:
        ax.legend(fontsize=7)
    _save(fig, out_dir / "loss.png")
    plt.close(fig)
    return ["bleu.png", "cost.png", "loss.png"]


def write_report(out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    runs, experiments = mlflow_runs(), compare.experiments()
    images = _plots(runs, out_dir)
    text = "\n".join([
        "# Runs compared with the paper", "",
        f"{len(runs)} finished pipeline run{'' if len(runs) == 1 else 's'} in MLflow ({tracking.tracking_uri()}), "
        "newest last.", "",
        _table(runs, experiments), "",
        "The paper's BLEU is tokenised and compound-split; compare it with ours in the same column, not "
        "with sacreBLEU. Its training cost is an estimate from GPU time, ours counts the model's FLOPs.",
        "Only a run tested on WMT14 newstest2014 compares with the paper's rows: a run on another corpus (the "
        "quickstart's number phrases, say) shows that the pipeline learns, and its BLEU is not a rival to 27.3.", "",
        *[f"![{name}]({name})" for name in images], "",
    ])
    with atomic_write(out_dir / "report.md") as f:
        f.write(text)
    return out_dir / "report.md"
