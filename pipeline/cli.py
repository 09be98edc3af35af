"""The one command line: every stage by name (as dvc.yaml runs them), the whole pipeline as a
Prefect flow, and presets.

    python -m pipeline clean --raw-dir data/raw --out-dir data/clean --metrics metrics/clean.json
    python -m pipeline run --preset quickstart -S train.max_steps=500
    python -m pipeline quickstart
    echo "Hello world." | python -m pipeline translate -S decode.beam_size=5
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import config, tracking
from pipeline.config import Params
from stages import average, clean, decode, download, encode, export, score, train, vocab
from stages.io import PipelineError, file_digest, write_json


@dataclass(frozen=True)
class StageSpec:
    """How the command line calls one stage: its params sections and its path arguments."""

    sections: tuple[str, ...]  # params.yaml sections the stage reads (dvc.yaml lists the same)
    inputs: tuple[str, ...]  # path arguments it reads, hashed into the MLflow tags
    outputs: tuple[str, ...]  # path arguments it writes
    call: Callable[[Params, dict[str, Path], tracking.Tracker], dict[str, Any]]
    artifacts: tuple[str, ...] = ()  # outputs logged to MLflow
    system_metrics: bool = False  # CPU/GPU/memory use sampled into the MLflow run
    source_digest: Callable[[Params], str] | None = None  # identifies inputs named by params, not paths


STAGES: dict[str, StageSpec] = {
    "download": StageSpec(
        ("download",), (), ("out_dir",), lambda p, a, t: download.run(p.download, **a),
        source_digest=lambda p: download.source_digest(p.download)),
    "clean": StageSpec(("clean",), ("raw_dir",), ("out_dir",), lambda p, a, t: clean.run(p.clean, **a)),
    "vocab": StageSpec(("vocab",), ("clean_dir",), ("out_dir",), lambda p, a, t: vocab.run(p.vocab, **a),
                       artifacts=("out_dir",)),
    "encode": StageSpec((), ("clean_dir", "vocab_dir"), ("out_dir",), lambda p, a, t: encode.run(**a)),
    "train": StageSpec(("model", "train"), ("encoded_dir", "vocab_dir"), ("checkpoint_dir", "plots_dir"),
                       lambda p, a, t: train.run(p.model, p.train, **a, log=t.log_metrics),
                       artifacts=("plots_dir",), system_metrics=True),
    "average": StageSpec(("average",), ("checkpoint_dir",), ("out_path",),
                         lambda p, a, t: average.run(p.average, **a), artifacts=("out_path",)),
    "decode": StageSpec(("decode",), ("model_path", "vocab_dir", "clean_dir"), ("out_dir",),
                        lambda p, a, t: decode.run(p.decode, **a), artifacts=("out_dir",)),
    "export": StageSpec((), ("model_path", "vocab_dir"), ("marian_dir", "ctranslate2_dir"),
                        lambda p, a, t: export.run(**a), artifacts=("marian_dir",)),
    "score": StageSpec(("score",), ("hyp_dir", "ref_dir"), (), lambda p, a, t: score.run(p.score, **a)),
}


def run_stage(name: str, paths: dict[str, Path], metrics_path: Path | None,
              params_path: Path = config.PARAMS_FILE) -> dict[str, Any]:
    """Run one stage as DVC, the flow and a user at the shell all do: load params, track, run, record."""
    spec = STAGES[name]
    params = config.load_params(params_path)
    sections = {s: getattr(params, s) for s in spec.sections}
    flat = {f"{s}.{k}": v for s, section in sections.items() for k, v in config.as_flat_dict(section).items()}
    hashed = {f"data.{k}": file_digest(paths[k]) for k in spec.inputs if paths[k].exists()}
    if spec.source_digest is not None:
        hashed["data.source"] = spec.source_digest(params)
    experiment = tracking.experiment_name(params.download.src_lang, params.download.tgt_lang)
    with tracking.stage_run(name, experiment, flat, hashed, spec.system_metrics) as tracker:
        metrics = spec.call(params, paths, tracker)
        tracker.log_metrics(metrics)
        if metrics_path is not None and tracking.is_main_process():
            write_json(metrics_path, metrics)
            tracker.log_artifact(metrics_path)
        for out in spec.artifacts:
            tracker.log_artifact(paths[out])
    return metrics


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, spec in STAGES.items():
        p = sub.add_parser(name, help=f"run the {name} stage alone")
        for arg in spec.inputs + spec.outputs:
            p.add_argument(_option(arg), dest=arg, type=Path, required=True)
        p.add_argument("--metrics", type=Path, help="write the stage's metrics here (JSON)")
        p.add_argument("--params", type=Path, default=config.PARAMS_FILE, help="parameters file (params.yaml)")
    run = sub.add_parser("run", help="apply presets and overrides to params.yaml, then run the Prefect flow")
    quick = sub.add_parser("quickstart", help="the whole pipeline on the bundled corpus, in minutes on a CPU")
    for p in (run, quick):
        p.add_argument("--preset", action="append", default=[], help="presets/<name>.yaml, applied in order")
        p.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one parameter, as `dvc exp run -S`")
    table3 = sub.add_parser("table3", help="the paper's Table 3 rows as named DVC experiments (experiments/table3.yaml)")
    table3.add_argument("rows", nargs="*", help="row names (default: all)")
    table3.add_argument("--queue", action="store_true", help="queue them with `dvc exp run --queue` (else print)")
    report = sub.add_parser("report", help="markdown and plots comparing the tracked runs with the paper")
    report.add_argument("--out", type=Path, default=Path("reports"))
    sub.add_parser("serve", help="serve the flow as a Prefect deployment (start runs from the Prefect UI)")
    preset = sub.add_parser("preset", help="apply presets and overrides to params.yaml without running")
    preset.add_argument("names", nargs="*")
    preset.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    preset.add_argument("--dvc-args", action="store_true", help="print the -S arguments for `dvc exp run` instead")
    translate = sub.add_parser("translate", help="translate lines of a file (or standard input) to standard output")
    translate.add_argument("input", nargs="?", type=Path, help="text, one sentence a line (default: standard input)")
    translate.add_argument("--model", type=Path, default=Path(DVC_PATHS["model"]),
                           help="an averaged model (.safetensors) or a training checkpoint (.pt)")
    translate.add_argument("--vocab-dir", type=Path, default=Path(DVC_PATHS["vocab"]))
    translate.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="decode.KEY=VALUE",
                           help="decoding parameters for this run only (params.yaml's decode section otherwise)")
    translate.add_argument("--params", type=Path, default=config.PARAMS_FILE)
    return parser


DVC_PATHS = config.dvc_paths()


def translate_command(args: argparse.Namespace) -> None:
    import dataclasses

    import torch

    params = config.load_params(args.params).decode
    changes = dict(config.parse_override(o) for o in args.overrides)
    unknown = [k for k in changes if not k.startswith("decode.") or not hasattr(params, k.split(".", 1)[1])]
    if unknown:
        raise PipelineError(f"translate takes decode.* parameters only, not {', '.join(unknown)}")
    params = dataclasses.replace(params, **{k.split(".", 1)[1]: v for k, v in changes.items()})
    if args.input is not None and not args.input.is_file():
        raise PipelineError(f"{args.input}: input file not found")
    lines = [line.rstrip("\n") for line in (args.input.open(encoding="utf-8") if args.input else sys.stdin)]
    model = decode.load_translator(args.model, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    for line in decode.translate(model, vocab.load(args.vocab_dir), lines, params, desc="translate"):
        print(line)


def model_size(params: Params) -> str:
    """The preset's parameter count, built on the meta device (no memory, no time)."""
    import torch

    from transformer import Transformer

    with torch.device("meta"):
        model = Transformer(params.model, params.vocab.vocab_size, vocab.PAD_ID)
    return f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters with a {params.vocab.vocab_size}-piece vocabulary"


def dvc_set_args(overrides: dict[str, Any]) -> list[str]:
    """['-S', 'key=value', ...] as `dvc exp run` takes them (values written as YAML/JSON)."""
    out = []
    for k, v in overrides.items():
        out += ["-S", f"{k}={v if isinstance(v, str) else json.dumps(v)}"]
    return out


def table3_command(names: list[str], queue: bool) -> None:
    import shlex
    import subprocess

    rows = config.table3_rows()
    unknown = [n for n in names if n not in rows]
    if unknown:
        raise PipelineError(f"{config.TABLE3_FILE}: no row {', '.join(unknown)} (known: {', '.join(rows)})")
    for name in names or rows:
        command = ["dvc", "exp", "run", "--queue", "-n", f"table3-{name}", *dvc_set_args(rows[name])]
        if queue:
            subprocess.run([sys.executable, "-m", *command], cwd=config.ROOT, check=True)
        else:
            print(shlex.join(command))


def collect_overrides(presets: list[str], overrides: list[str]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for name in presets:
        merged.update(config.load_preset(name))
    merged.update(dict(config.parse_override(o) for o in overrides))
    return merged


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command in STAGES:
            spec = STAGES[args.command]
            paths = {k: getattr(args, k) for k in spec.inputs + spec.outputs}
            run_stage(args.command, paths, args.metrics, args.params)
        elif args.command == "preset":
            overrides = collect_overrides(args.names, args.overrides)
            if args.dvc_args:
                import shlex

                print(shlex.join(dvc_set_args(overrides)))
            else:
                params = config.apply_overrides(overrides)
                print(f"params.yaml: set {', '.join(overrides) or 'nothing'}")
                print(model_size(params))
        elif args.command == "translate":
            translate_command(args)
        elif args.command == "report":
            from pipeline import report

            print(f"wrote {report.write_report(args.out)}")
        elif args.command == "table3":
            table3_command(args.rows, args.queue)
        elif args.command == "serve":
            from pipeline import flow

            flow.serve()
        else:
            from pipeline import flow

            presets = ["quickstart", *args.preset] if args.command == "quickstart" else args.preset
            flow.pipeline(presets=presets, overrides=collect_overrides([], args.overrides))
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
