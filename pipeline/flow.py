"""The Prefect flow: the DAG of dvc.yaml, one task per stage, in dependency order.

Each task runs `dvc repro --single-item <stage>`, so DVC decides whether the stage is stale and
remains the only cache: the flow never caches, and a stage DVC finds unchanged is reported as
skipped. The stages' output streams into the task's log, visible in the Prefect UI. Only the
download retries (networks fail; a training run that failed would fail again). A finished run
leaves a markdown artifact with its scores and a link to its MLflow run, and registers the model.

    python -m pipeline serve                # a deployment the Prefect UI can start, served from here
    python -m pipeline deploy --pool gpus   # a deployment of a work pool: a worker anywhere runs it
"""
from __future__ import annotations

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # offline by default; before Prefect loads
# The temporary server a run starts without PREFECT_API_URL creates its database first: on a slow or
# busy machine that takes longer than Prefect's default 20 s.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

import codecs
import contextlib
import contextvars
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from itertools import takewhile
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_progress_artifact, \
    update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.states import Failed, State

from pipeline import config, dag, registry, runlock, tracking, unsent
from pipeline import presets as presets_module  # the flow's parameter is named presets
from stages.io import PipelineError, read_json
from stages.train_metrics import parse_progress

METRICS_DIR = config.ROOT / dag.paths()["metrics"]
DEPLOYMENT = "transformer-pipeline"
RETRIES = {"download": 3}  # stage -> retries; the others fail for reasons a retry does not fix


def _stream(proc: subprocess.Popen, on_line: Callable[[str], None]) -> None:
    """Hand each line of a process's output to `on_line` as soon as it is printed (reading whatever
    the pipe holds, never waiting for a block to fill); progress bars' carriage returns end a line."""
    assert proc.stdout is not None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    while chunk := os.read(proc.stdout.fileno(), 1 << 16):
        *lines, pending = re.split(r"[\r\n]", pending + decoder.decode(chunk))
        for line in filter(str.strip, lines):
            on_line(line)
    pending += decoder.decode(b"", final=True)
    if pending.strip():
        on_line(pending)


# DVC's advice after a stage, which the flow's log can do without; its own messages stay.
DVC_ADVICE = re.compile(r"^\s*(To track the changes with git, run:|git add |To enable auto staging, run:|"
                        r"dvc config core\.autostage|Use `dvc push` to send your updates)")


class Artifacts:
    """A task's Prefect artifacts, created and updated from a thread of their own: the stage's output is
    read on without waiting for the Prefect server (were it not, a stalled server would fill the pipe and
    stall the stage), only the newest of each is sent, and a server that does not answer costs one
    warning, never the task."""

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self.latest: dict[str, Callable[[], Any]] = {}  # key -> the newest call for it
        self.cond = threading.Condition()
        self.closed = self.warned = False
        context = contextvars.copy_context()  # the task run's, so artifacts attach to it
        self.thread = threading.Thread(target=context.run, args=(self._run,), name="prefect-artifacts", daemon=True)
        self.thread.start()

    def submit(self, key: str, call: Callable[[], Any]) -> None:
        with self.cond:
            self.latest[key] = call
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.latest and not self.closed:
                    self.cond.wait()
                if not self.latest:
                    return
                key = next(iter(self.latest))
                call = self.latest.pop(key)
            try:
                call()
            except Exception as e:  # noqa: BLE001 - the Prefect server away: the stage's work goes on
                if not self.warned:
                    self.warned = True
                    self.logger.warning(f"the Prefect server did not take an artifact ({e}); the stage goes on")

    def close(self, timeout: float = 10.0) -> None:
        """Send what is pending, waiting at most `timeout` seconds."""
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(timeout)


class StageOutput:
    """What a stage prints, as the flow shows it: each line in the task's log as it comes (DVC's
    advice left out); the train stage's progress as a progress artifact (step / max_steps, loss,
    tokens/s); the stage's live MLflow run as a link artifact."""

    def __init__(self, stage: str, logger: Any) -> None:
        self.stage, self.logger = stage, logger
        self.lines: list[str] = []
        self.progress_id: Any = None
        self.artifacts = Artifacts(logger)

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        if DVC_ADVICE.match(line):
            return
        self.logger.info(line)
        if url := tracking.run_url_in(line):
            self.artifacts.submit("link", lambda: create_link_artifact(
                url, link_text=f"MLflow run of the {self.stage} stage", key=f"mlflow-{self.stage}",
                description=f"The {self.stage} stage's MLflow run, live while it works"))
        elif (progress := parse_progress(line)) is not None:
            step, max_steps, loss, rate = progress
            description = f"{self.stage}: step {step:,} of {max_steps:,}, loss {loss:.3f}, {rate:,.0f} target tokens/s"
            self.artifacts.submit("progress", lambda: self._progress(100 * step / max_steps, description))

    def _progress(self, percent: float, description: str) -> None:
        if self.progress_id is None:
            self.progress_id = create_progress_artifact(percent, key=f"{self.stage}-progress", description=description)
        else:
            update_progress_artifact(self.progress_id, percent, description=description)


@task(cache_policy=NO_CACHE, task_run_name="{stage}")
def run_stage(stage: str) -> str | State:
    """`dvc repro` one stage; returns 'ran' or 'skipped' (DVC found it unchanged), or a Failed state
    whose message is the stage's own last word (no traceback: the stage's error says what is wrong)."""
    logger = get_run_logger()
    env = {**config.stages_env(), "PYTHONUNBUFFERED": "1"}  # the stage's lines reach the Prefect log as printed
    # its own process group, so that a signal to the flow reaches the stage only as the flow passes it on
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "--single-item", stage], cwd=config.ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    output = StageOutput(stage, logger)
    try:
        _stream(proc, output)
    except BaseException:  # Ctrl-C, or SIGTERM (which the tracking turns into KeyboardInterrupt)
        _stop(proc, output)
        raise
    finally:
        output.artifacts.close()
    lines = output.lines
    if proc.wait() != 0:
        return Failed(message=failure(stage, lines))
    return "skipped" if any("didn't change, skipping" in line for line in lines) else "ran"


def failure(stage: str, lines: list[str]) -> str:
    """Why a stage failed, in its own words (its last `error:`, `stopped:` or `interrupted:` line, and
    the indented lines that go on with it, on one line; else the exception it ended in) rather than
    DVC's wrapper around them."""
    own = [i for i, line in enumerate(lines) if line.startswith(("error:", "stopped:", "interrupted:"))]
    # else an exception it did not expect (the traceback's last line), else DVC's own error (the stage not run)
    raised = [i for i, line in enumerate(lines) if re.match(r"[\w.]+(Error|Exception|Interrupt): ", line)]
    dvc = [i for i, line in enumerate(lines) if line.startswith("ERROR:")]
    if not (chosen := own or raised or dvc):
        return f"stage '{stage}' failed: see its log (the stages before it keep their outputs)"
    more = takewhile(lambda line: line.startswith((" ", "\t")), lines[chosen[-1] + 1:])
    said = " ".join([lines[chosen[-1]].removeprefix("error: "), "; ".join(line.strip() for line in more)]).strip()
    return f"stage '{stage}' failed: {said} (the stages before it keep their outputs)"


def _stop(proc: subprocess.Popen, on_line: Callable[[str], None], grace: float = 600) -> None:
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
        _stream(proc, on_line)
        proc.wait()
    finally:
        deadline.cancel()


# What the newest flow run in this process achieved, kept for when its server is lost before the
# run's end reaches it: the work done still counts.
FINISHED: dict[str, Any] = {}


@flow(name="transformer-pipeline", log_prints=True)
def pipeline(presets: list[str] | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any] | State:
    """Apply presets and overrides to params.yaml, then run every stage of dvc.yaml in order."""
    runlock.hold()  # a deployment's run as well as the command's
    FINISHED.clear()
    params = presets_module.apply(presets or [], overrides or {}) if presets or overrides else config.load_params()
    experiment = tracking.experiment_name(params.download.src_lang, params.download.tgt_lang)
    tags = {"presets": ",".join(presets or []) or "none", "prefect_flow_run_id": str(flow_run.get_id())}
    with tracking.pipeline_run(experiment, run_name(presets or [], overrides or {}), config.as_flat_dict(params),
                               tags, summary=METRICS_DIR / "score.json") as parent:
        states = {}
        for stage in dag.stage_order():
            retries = RETRIES.get(stage, 0)
            state = run_stage.with_options(retries=retries, retry_delay_seconds=30)(stage, return_state=True)
            if not state.is_completed():
                parent.outcome = "FAILED"
                return Failed(message=state.message)
            states[stage] = state.result()
            parent.set_tags({f"stage.{stage}": states[stage]})
        scores = read_json(METRICS_DIR / "score.json")
        parent.log_metrics(scores)
        parent.log_artifact(METRICS_DIR / "score.json")
        try:
            model = registry.register_model(parent, params, scores["test"]["bleu"])
        except Exception as e:  # noqa: BLE001 - a lost tracking server costs the registration, not the run
            print(f"warning: mlflow: the model was not registered ({unsent.reason(e)}); `python -m pipeline "
                  "run` again registers it once the server answers (every stage is cached)")
            model = None
        FINISHED.update(stages=states, scores=scores)
        try:
            create_markdown_artifact(key="bleu", markdown=report_markdown(scores, parent, model, presets or []),
                                     description="BLEU of this pipeline run")
        except Exception as e:  # noqa: BLE001 - the Prefect server away: the scores are in metrics/score.json
            print(f"warning: the Prefect server did not take the BLEU artifact ({e})")
    print(f"test BLEU {scores['test']['bleu']:.2f} ({scores['test']['bleu_signature']})")
    return {"stages": states, "scores": scores}


def quiet_if_the_server_is_lost() -> None:
    """A Prefect server that stops answering costs the command one warning line, and no waiting.

    Prefect's events client retries each event 10 times, pausing a second from the fourth, and the
    process drains its queue at exit: with the server gone, a flow's end waited about 7 s an event
    (a minute in tests/test_pipeline_team.py's lost server). Two quick reconnections still ride out a
    dropped websocket; Prefect Cloud and the temporary server Prefect starts itself keep the defaults.
    Prefect's API log worker writes each failed batch's error to stderr, unless logging is told not to
    (with no newline, so it ran into the command's own last line); the command says it once.
    """
    import logging

    from prefect.events.clients import PrefectEventsClient
    from prefect.events.worker import EventsWorker, emit_events_to_cloud, should_emit_events_to_running_server

    if should_emit_events_to_running_server() and not emit_events_to_cloud():
        EventsWorker.set_client_override(PrefectEventsClient, reconnection_attempts=2)
    logging.raiseExceptions = False


SERVER_TIMEOUT = 10.0  # seconds the Prefect server has to answer before a run goes on without it, as MLflow's


def unanswered() -> tuple[str, str] | None:
    """(address, why) where the Prefect server the settings name (PREFECT_API_URL, or the profile's) does not
    answer within SERVER_TIMEOUT; None where it answers (any answer: Prefect Cloud's 401 too) or none is named."""
    import httpx
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    try:
        if url:
            httpx.get(f"{url.rstrip('/')}/health", timeout=SERVER_TIMEOUT)
    except httpx.TransportError as e:
        return url, f"{type(e).__name__}: {e}"
    return None


def use_a_server_that_answers() -> None:
    """Where the Prefect server the settings name does not answer, say so in one line and have this process's
    flow run on a temporary server that Prefect starts itself, as when none is named: a monitoring server
    away costs the run its place in that server's UI, not the run (DVC and MLflow record it either way)."""
    from prefect.context import refresh_global_settings_context
    from prefect.settings import get_current_settings

    if (away := unanswered()) is None:
        return
    print(f"warning: the Prefect server {away[0]} does not answer ({away[1]}); this run's flow goes to a temporary "
          "server of its own, not to that one's UI (DVC and MLflow record the run as ever)", file=sys.stderr)
    os.environ.pop("PREFECT_API_URL", None)
    refresh_global_settings_context()  # the settings every thread of Prefect's reads, from the environment
    if get_current_settings().api.url:  # the profile names it: Prefect's own profile of a temporary server
        os.environ["PREFECT_PROFILE"] = "ephemeral"
        refresh_global_settings_context()


def require_an_answering_server(command: str) -> None:
    """Stop `command`, which registers the flow with the Prefect server the settings name for runs started
    elsewhere, where none is named (a temporary server would end with the command) or it does not answer."""
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        raise PipelineError(f"{command} needs a Prefect server that outlives it: start one (prefect server start) "
                            "and point PREFECT_API_URL at it (prefect config set PREFECT_API_URL=http://HOST:4200/api)")
    if (away := unanswered()) is not None:
        raise PipelineError(f"{command} needs the Prefect server {away[0]}, which does not answer ({away[1]}): "
                            "start it (prefect server start), or point PREFECT_API_URL at one that runs")


def server_lost(error: BaseException | str) -> str | None:
    """'the Prefect server ... was lost' when the flow ended because its server stopped answering (an
    exception out of the flow, or a task's failure message); None for any other ending."""
    import httpx

    seen: BaseException | None = error if isinstance(error, BaseException) else None
    while seen is not None and not isinstance(seen, httpx.TransportError):
        seen = seen.__cause__ or seen.__context__
    text = str(error)
    if seen is None and not (isinstance(error, str) and ("ConnectError" in text or "ConnectTimeout" in text)):
        return None
    from prefect.settings import get_current_settings

    return f"the Prefect server {get_current_settings().api.url} was lost ({seen or text.rsplit(': ', 1)[-1]})"


def run_name(presets: list[str], overrides: dict[str, Any]) -> str:
    """'quickstart warmup_steps=150': the presets, then each override by its last key."""
    changes = [f"{key.rsplit('.', 1)[-1]}={value}" for key, value in overrides.items()]
    return " ".join([*presets, *changes]) or "params.yaml"


def report_markdown(scores: dict[str, Any], parent: tracking.Tracker, model: str | None, presets: list[str]) -> str:
    rows = ["| split | sacreBLEU | tokenised BLEU (paper's) | lowercased tokenised BLEU | chrF |",
            "|---|---|---|---|---|"]
    for split in ("dev", "test"):
        s = scores[split]
        rows.append(f"| {split} | {s['bleu']:.2f} | {s['bleu_tok']:.2f} | {s['bleu_lc_tok']:.2f} | {s['chrf']:.2f} |")
    link = tracking.run_url(parent)
    return "\n".join([
        f"# BLEU, presets: {', '.join(presets) or 'none (params.yaml as it is)'}", "", *rows, "",
        f"- sacreBLEU: `{scores['test']['bleu_signature']}`",
        f"- tokenised BLEU: `{scores['test']['bleu_tok_signature']}` (compare with the paper's 27.3 base / 28.4 big)",
        f"- lowercased tokenised BLEU: `{scores['test']['bleu_lc_tok_signature']}` (what Multi30k results quote)",
        f"- chrF: `{scores['test']['chrf_signature']}`",
        f"- MLflow run: [{parent.run_id}]({link})" if link else "- MLflow: not tracked",
        f"- registered model: `{model}` (its best version: `{model.rsplit('/', 1)[0]}@best`)" if model else "",
    ])


def serve() -> None:
    """Serve the flow as a deployment: the Prefect UI's "Run" takes presets and overrides."""
    require_an_answering_server("serve")
    names = ", ".join(presets_module.preset_names())
    pipeline.serve(name=DEPLOYMENT, parameters={"presets": [], "overrides": {}},
                   description=f"The Transformer pipeline of dvc.yaml; presets: {names}")


ENTRYPOINT_FILE = "pipeline/flow.py"  # where a worker finds the flow, inside the deployment's source


def deploy(pool: str, source: str) -> str:
    """Register the flow as a deployment of the process work pool `pool` (made if missing), which any
    `prefect worker start --pool <pool>` runs: from `source`, a folder the worker sees at that path (a
    checkout on a shared filesystem), or a git URL it clones for each run. Returns its name."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    if "://" not in source and not source.startswith("git@") and not (Path(source) / ENTRYPOINT_FILE).is_file():
        raise PipelineError(f"deploy --source {source}: neither a git URL nor a checkout of this project "
                            f"(no {ENTRYPOINT_FILE} there)")
    require_an_answering_server("deploy")
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=pool, type=ProcessWorker.type,
                                                   base_job_template=ProcessWorker.get_default_base_job_template()))
    names = ", ".join(presets_module.preset_names())
    pipeline.from_source(source=source, entrypoint=f"{ENTRYPOINT_FILE}:pipeline").deploy(
        name=DEPLOYMENT, work_pool_name=pool, parameters={"presets": [], "overrides": {}}, print_next_steps=False,
        description=f"The Transformer pipeline of dvc.yaml, run by a worker of the pool {pool}; presets: {names}")
    return f"{pipeline.name}/{DEPLOYMENT}"
