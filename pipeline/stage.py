"""One stage, run the way DVC, the Prefect flow, the tests and a user at the shell all run it:

    python -m pipeline.stage clean --raw-dir data/raw --out-dir data/clean --metrics metrics/clean.json

A stage is the module stages/<name>.py, and its `run` function's signature is its contract: the
params.yaml sections it reads are the classes of its positional parameters, and its paths are its
keyword parameters annotated InputPath (read) or OutputPath (written). The command line's flags come
from that signature alone. dvc.yaml declares the same for DVC; tests/test_contracts.py checks that
the two agree and that each stage's code dependencies in dvc.yaml are the files it imports.

A stage module may also say how many processes its command runs on (`workers`: the train stage's
train.processes); with more than one, the command starts that many workers of itself through torch's
elastic launcher (pipeline/launch.py) and ends with their outcome.

Here a stage's params are loaded (all of params.yaml, so any bad value stops it before it works),
its run is tracked in MLflow (parameters of its sections, md5s of its inputs, its metrics and chosen
outputs as artifacts), and its metrics are written as JSON.
"""
from __future__ import annotations

import gc

if __name__ == "__main__":  # a command: no cycle collections while the stage and MLflow import
    gc.disable()

import argparse
import importlib
import inspect
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import config, launch, tracking
from pipeline.config import Params
from stages import progress
from stages.io import EXIT_STOPPED, InputPath, OutputPath, PipelineError, Stopped, file_digest, write_json

# Outputs each stage logs to MLflow as artifacts, and the stages whose CPU/GPU use MLflow samples.
ARTIFACTS = {"vocab": ("out_dir",), "train": ("plots_dir",), "average": ("out_path",), "decode": ("out_dir",),
             "export": ("marian_dir",)}
SYSTEM_METRICS = {"train"}
CURVES = {"train": "plots_dir"}  # an output folder whose CSV files are the stage's curves (a step column)


@dataclass(frozen=True)
class Contract:
    """What a stage's `run` reads and writes, from its signature."""

    name: str
    run: Callable[..., dict[str, Any]]
    sections: tuple[str, ...]  # params.yaml sections, in the order run takes them
    inputs: tuple[str, ...]  # path parameters it reads
    outputs: tuple[str, ...]  # path parameters it writes
    takes_log: bool  # run(log=...) takes a metrics logger
    source_digest: Callable[..., str] | None  # identifies inputs named by params rather than paths
    workers: Callable[..., int] | None  # the processes its command runs on, if it may run on several

    @property
    def paths(self) -> tuple[str, ...]:
        return self.inputs + self.outputs


def contract(name: str) -> Contract:
    try:
        module = importlib.import_module(f"stages.{name}")
    except ModuleNotFoundError:
        module = None
    run = getattr(module, "run", None)
    if run is None:
        raise PipelineError(f"no stage '{name}' (`python -m pipeline --help` lists them)")
    hints = typing.get_type_hints(run, include_extras=True)
    section_of = {hint: section for section, hint in typing.get_type_hints(Params).items()}
    sections, inputs, outputs, takes_log = [], [], [], False
    for arg in inspect.signature(run).parameters.values():
        hint = hints.get(arg.name)
        if arg.kind is arg.POSITIONAL_OR_KEYWORD and hint in section_of:
            sections.append(section_of[hint])
        elif hint == InputPath:
            inputs.append(arg.name)
        elif hint == OutputPath:
            outputs.append(arg.name)
        elif arg.name == "log":
            takes_log = True
        elif arg.default is inspect.Parameter.empty:
            raise TypeError(f"stages.{name}.run: parameter {arg.name} is neither a params section nor a path")
    return Contract(name, run, tuple(sections), tuple(inputs), tuple(outputs), takes_log,
                    getattr(module, "source_digest", None), getattr(module, "workers", None))


def run_stage(name: str, paths: dict[str, Path], metrics_path: Path | None,
              params_path: Path = config.PARAMS_FILE) -> dict[str, Any]:
    """Load params, track, run, record."""
    c = contract(name)
    params = config.load_params(params_path)
    sections = [getattr(params, s) for s in c.sections]
    flat = {f"{s}.{k}": v for s in c.sections for k, v in config.as_flat_dict(getattr(params, s)).items()}
    hashed = {f"data.{k}": file_digest(paths[k]) for k in c.inputs if Path(paths[k]).exists()}
    if c.source_digest is not None:
        hashed["data.source"] = c.source_digest(*sections)
    experiment = tracking.experiment_name(params.download.src_lang, params.download.tgt_lang)
    curves = Path(paths[CURVES[name]]) if name in CURVES else None
    with tracking.stage_run(name, experiment, flat, hashed, name in SYSTEM_METRICS, metrics_path, curves) as tracker:
        metrics = c.run(*sections, **paths, **({"log": tracker.log_metrics} if c.takes_log else {}))
        # the summary, but what the stage already logged as a curve (whose last point it would repeat)
        summary = {k: v for k, v in tracking.flatten(metrics).items() if k not in tracker.logged}
        tracker.log_metrics(summary, step=int(metrics.get("steps", 0)))
        if metrics_path is not None and tracking.is_main_process():
            write_json(metrics_path, metrics)
            tracker.log_artifact(metrics_path)
        for out in ARTIFACTS.get(name, ()):
            tracker.log_artifact(paths[out])
    return metrics


def option(path_name: str) -> str:
    """out_dir -> --out-dir"""
    return "--" + path_name.replace("_", "-")


def parser(c: Contract, prog: str) -> argparse.ArgumentParser:
    doc = inspect.getmodule(c.run).__doc__ or ""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for arg in c.inputs:
        p.add_argument(option(arg), dest=arg, type=Path, required=True, help="a path the stage reads")
    for arg in c.outputs:
        p.add_argument(option(arg), dest=arg, type=Path, required=True, help="a path the stage writes")
    p.add_argument("--metrics", type=Path, help="write the stage's metrics here (JSON)")
    p.add_argument("--params", type=Path, default=config.PARAMS_FILE, help="parameters file (params.yaml)")
    return p


def main(argv: list[str], prog: str = "python -m pipeline.stage") -> int:
    """`<stage> --flag path ...`: run one stage; errors in the input are one line, not a traceback.
    Exit status: 0 done, 1 an error, 75 stopped by a signal with its work saved (run it again to go
    on), 130 interrupted with nothing saved."""
    progress.library_bars_as_lines()
    try:
        if not argv or argv[0].startswith("-"):
            raise PipelineError(f"usage: {prog} <stage> --<path> PATH ... (`python -m pipeline --help` lists them)")
        c = contract(argv[0])
        args = parser(c, f"{prog} {c.name}").parse_args(argv[1:])
        paths = {k: getattr(args, k) for k in c.paths}
        if launch.is_worker():
            launch.follow_launcher()
        elif c.workers is not None:  # on several processes, each a worker running this command
            params = config.load_params(args.params)
            if (n := c.workers(*(getattr(params, s) for s in c.sections), **paths)) > 1:
                return launch.run_workers(n, argv)
        run_stage(c.name, paths, args.metrics, args.params)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Stopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        return EXIT_STOPPED
    except KeyboardInterrupt:
        print("interrupted: nothing of this stage's work is kept; run it again", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    # What the imports made lives to the end: frozen, the collector never walks it again, nor at exit
    # (`python -m bench.stage_startup` measures the command against its main imported without this).
    gc.enable()
    gc.freeze()
    code = main(sys.argv[1:])
    gc.freeze()
    sys.exit(code)
