"""The Prefect flow: the DAG of dvc.yaml, one task per stage, in dependency order.

Each task runs `dvc repro --single-item <stage>`, so DVC decides whether the stage is stale and
remains the only cache: the flow never caches, and a stage DVC finds unchanged is reported as
skipped. The stages' output streams into the task's log, visible in the Prefect UI. Only the
download retries (networks fail; a training run that failed would fail again). A finished run
leaves a markdown artifact with its scores and a link to its MLflow run, and registers the model.

    python -m pipeline serve     # a deployment the Prefect UI can start, with presets and overrides
"""
from __future__ import annotations

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # offline by default; before Prefect loads
# The temporary server a run starts without PREFECT_API_URL creates its database first: on a slow or
# busy machine that takes longer than Prefect's default 20 s.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

import contextlib
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from pipeline import config, dag, registry, tracking
from pipeline import presets as presets_module  # the flow's parameter is named presets
from stages.io import PipelineError, read_json

METRICS_DIR = config.ROOT / dag.paths()["metrics"]
DEPLOYMENT = "transformer-pipeline"
RETRIES = {"download": 3}  # stage -> retries; the others fail for reasons a retry does not fix


def _stream(proc: subprocess.Popen, logger: Any) -> list[str]:
    """Forward a process's output line by line; progress bars' carriage returns end a line too."""
    lines, pending = [], ""
    assert proc.stdout is not None
    for chunk in iter(lambda: proc.stdout.read(4096), ""):
        parts = re.split(r"[\r\n]", pending + chunk)
        pending = parts.pop()
        for line in filter(str.strip, parts):
            logger.info(line)
            lines.append(line)
    if pending.strip():
        logger.info(pending)
        lines.append(pending)
    return lines


@task(cache_policy=NO_CACHE, task_run_name="{stage}")
def run_stage(stage: str) -> str:
    """`dvc repro` one stage; returns 'ran' or 'skipped' (DVC found it unchanged)."""
    logger = get_run_logger()
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the stages' python
    env.setdefault("TQDM_MININTERVAL", "10")
    env["PYTHONUNBUFFERED"] = "1"  # the stage's lines reach the Prefect log as they are printed
    # its own process group, so that a signal to the flow reaches the stage only as the flow passes it on
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "--single-item", stage], cwd=config.ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        lines = _stream(proc, logger)
    except BaseException:  # Ctrl-C, or SIGTERM (which the tracking turns into KeyboardInterrupt)
        _stop(proc, logger)
        raise
    if proc.wait() != 0:
        reason = next((line for line in reversed(lines) if line.startswith(("error:", "ERROR:"))), "see its log")
        raise PipelineError(f"stage '{stage}' failed ({reason}); the stages before it keep their outputs")
    return "skipped" if any("didn't change, skipping" in line for line in lines) else "ran"


def _stop(proc: subprocess.Popen, logger: Any, grace: float = 600) -> None:
    """Stop `dvc repro` and its stage as Ctrl-C would, with SIGINT to its group: DVC waits for the
    stage, the train stage finishes its step and saves it (exit status 75), any other stage stops at
    once. What they print meanwhile still reaches the log; after `grace` seconds the rest is killed."""
    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    deadline = threading.Timer(grace, kill)
    deadline.start()
    try:
        _stream(proc, logger)
        proc.wait()
    finally:
        deadline.cancel()


@flow(name="transformer-pipeline", log_prints=True)
def pipeline(presets: list[str] | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Apply presets and overrides to params.yaml, then run every stage of dvc.yaml in order."""
    merged = {**presets_module.collect_overrides(presets or [], []), **(overrides or {})}
    params = presets_module.apply_overrides(merged) if merged else config.load_params()
    experiment = tracking.experiment_name(params.download.src_lang, params.download.tgt_lang)
    tags = {"presets": ",".join(presets or []) or "none", "prefect_flow_run_id": str(flow_run.get_id())}
    with tracking.pipeline_run(experiment, config.as_flat_dict(params), tags) as parent:
        states = {}
        for stage in dag.stage_order():
            retries = RETRIES.get(stage, 0)
            states[stage] = run_stage.with_options(retries=retries, retry_delay_seconds=30)(stage)
            parent.set_tags({f"stage.{stage}": states[stage]})
        scores = read_json(METRICS_DIR / "score.json")
        parent.log_metrics(scores)
        parent.log_artifact(METRICS_DIR / "score.json")
        version = registry.register_model(parent, params, scores["test"]["bleu"])
        create_markdown_artifact(key="bleu", markdown=report_markdown(scores, parent, version, presets or []),
                                 description="BLEU of this pipeline run")
    print(f"test BLEU {scores['test']['bleu']:.2f} ({scores['test']['bleu_signature']})")
    return {"stages": states, "scores": scores}


def report_markdown(scores: dict[str, Any], parent: tracking.Tracker, version: str | None, presets: list[str]) -> str:
    rows = ["| split | sacreBLEU | tokenised BLEU (paper's) | chrF |", "|---|---|---|---|"]
    for split in ("dev", "test"):
        s = scores[split]
        rows.append(f"| {split} | {s['bleu']:.2f} | {s['bleu_tok']:.2f} | {s['chrf']:.2f} |")
    link = tracking.run_url(parent)
    return "\n".join([
        f"# BLEU, presets: {', '.join(presets) or 'none (params.yaml as it is)'}", "", *rows, "",
        f"- sacreBLEU: `{scores['test']['bleu_signature']}`",
        f"- tokenised BLEU: `{scores['test']['bleu_tok_signature']}` (compare with the paper's 27.3 base / 28.4 big)",
        f"- chrF: `{scores['test']['chrf_signature']}`",
        f"- MLflow run: [{parent.run_id}]({link})" if link else "- MLflow: not tracked",
        f"- registered model version: {version}" if version else "",
    ])


def serve() -> None:
    """Serve the flow as a deployment: the Prefect UI's "Run" takes presets and overrides."""
    pipeline.serve(name=DEPLOYMENT, parameters={"presets": [], "overrides": {}},
                   description="The Transformer pipeline of dvc.yaml; presets: " + ", ".join(presets_module.preset_names()))
