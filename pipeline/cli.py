"""The one command line: every stage by name (as dvc.yaml runs them), the whole pipeline as a
Prefect flow, presets, and translating with a trained model.

    python -m pipeline clean --raw-dir data/raw --out-dir data/clean --metrics metrics/clean.json
    python -m pipeline run --preset quickstart -S train.max_steps=500
    python -m pipeline quickstart
    echo "Hello world." | python -m pipeline translate -S decode.beam_size=5
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from pipeline import config, dag, presets, runlock, stage
from pipeline.config import Params
from stages import progress, vocab
from stages.io import PipelineError, decode_lines, read_lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, desc in dag.stage_descriptions().items():  # parsed by pipeline.stage; listed here
        sub.add_parser(name, help=f"stage: {desc}")
    run = sub.add_parser("run", help="apply presets and overrides to params.yaml, then run the Prefect flow")
    quick = sub.add_parser("quickstart", help="the whole pipeline on the bundled corpus, in minutes on a CPU")
    for p in (run, quick):
        p.add_argument("--preset", action="append", default=[], help="presets/<name>.yaml, applied in order")
        p.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one parameter, as `dvc exp run -S`")
    table3 = sub.add_parser("table3",
                            help="the paper's Table 3 rows as named DVC experiments (experiments/table3.yaml)")
    table3.add_argument("rows", nargs="*", help="row names (default: all)")
    how = table3.add_mutually_exclusive_group()
    how.add_argument("--run", action="store_true",
                     help="run them one after another, each as `dvc exp run --temp` in a copy of the checkout")
    how.add_argument("--queue", action="store_true",
                     help="queue them with `dvc exp run --queue`, for `dvc queue start` (else print the commands)")
    report = sub.add_parser("report", help="markdown and plots comparing the tracked runs with the paper")
    report.add_argument("--out", type=Path, default=Path("reports"),
                        help="folder of the report and its plots (default reports)")
    sub.add_parser("serve", help="serve the flow as a Prefect deployment (start runs from the Prefect UI)")
    deploy = sub.add_parser("deploy", help="register the flow to a Prefect process work pool, for workers to run")
    deploy.add_argument("--pool", required=True, help="the work pool (a process pool, made if missing)")
    deploy.add_argument("--source", default=str(config.ROOT),
                        help="where workers find the code: this checkout's folder (default) or a git URL")
    compare = sub.add_parser("compare", help="the experiments side by side: what each changed, its scores, its cost")
    compare.add_argument("--width", type=int, default=120, help="columns (default 120)")
    sub.add_parser("sync", help="send an MLflow server what it missed while away (the notes in .mlflow-unsent/), "
                   "once it answers")
    sub.add_parser("offline-plots", help="fetch vega once, so that `dvc plots show` works offline (make setup runs it)")
    preset = sub.add_parser("preset", help="apply presets and overrides to params.yaml without running")
    preset.add_argument("names", nargs="*", help="presets/<name>.yaml, applied in order")
    preset.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one parameter, as `dvc exp run -S`")
    preset.add_argument("--dvc-args", action="store_true", help="print the -S arguments for `dvc exp run` instead")
    paths = dag.paths()
    translate = sub.add_parser("translate", help="translate lines of a file (or standard input) to standard output")
    translate.add_argument("input", nargs="?", type=Path, help="text, one sentence a line (default: standard input)")
    # the defaults are the pipeline's outputs, found from any folder, as `dvc` and `--params` find theirs
    translate.add_argument("--model", type=Path, default=config.ROOT / paths["model"],
                           help="an averaged model (.safetensors) or a training checkpoint (.pt)")
    translate.add_argument("--vocab-dir", type=Path, default=config.ROOT / paths["vocab"],
                           help="the vocabulary the model was trained on (default: the vocab stage's)")
    translate.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="decode.KEY=VALUE",
                           help="decoding parameters for this run only (params.yaml's decode section otherwise)")
    translate.add_argument("--params", type=Path, default=config.PARAMS_FILE,
                           help="parameters: its decode and clean sections and source language (default params.yaml)")
    return parser


def translate_command(args: argparse.Namespace) -> None:
    import dataclasses

    from stages import clean, decode
    from stages.devices import default_device

    loaded = config.load_params(args.params)
    params = loaded.decode
    changes = dict(presets.parse_override(o) for o in args.overrides)
    unknown = [k for k in changes if not k.startswith("decode.") or not hasattr(params, k.split(".", 1)[1])]
    if unknown:
        raise PipelineError(f"translate takes decode.* parameters only, not {', '.join(unknown)}")
    try:
        params = dataclasses.replace(params, **{k.split(".", 1)[1]: v for k, v in changes.items()})
    except ValueError as e:  # a check of DecodeParams: (key, message)
        raise PipelineError(f"-S decode.{e.args[0]}: {e.args[-1]}") from None
    lines = list(read_lines(args.input) if args.input else decode_lines(sys.stdin.buffer, "standard input"))
    translator, sp = decode.load_with_vocabulary(args.model, args.vocab_dir, default_device(), params.precision)
    normalize = clean.Normalizer(loaded.download.src_lang, loaded.clean)  # as the training text was
    for line in decode.translate(translator, sp, lines, params, desc="translate", normalize=normalize):
        print(line)


def model_size(params: Params) -> str:
    """The preset's parameter count, built on the meta device (no memory, no time)."""
    import torch

    from transformer.model import Transformer

    with torch.device("meta"):
        model = Transformer(params.model, params.vocab.vocab_size, vocab.PAD_ID)
    return (f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters with a "
            f"{params.vocab.vocab_size}-piece vocabulary")


def table3_command(names: list[str], how: str) -> int:
    """The rows as named experiments: their `dvc exp run` commands printed, queued, or run."""
    rows = presets.table3_rows()
    unknown = [n for n in names if n not in rows]
    if unknown:
        raise PipelineError(f"{presets.TABLE3_FILE}: no row {', '.join(unknown)} (known: {', '.join(rows)})")
    commands = {f"table3-{name}": ["dvc", "exp", "run", "--queue" if how == "queue" else "--temp", "-n",
                                   f"table3-{name}", *presets.dvc_set_args(rows[name])] for name in names or rows}
    if how == "print":
        print("\n".join(shlex.join(command) for command in commands.values()))
        return 0
    dag.require_git()  # DVC's experiments live in git: one line here, not an error from every row
    if how == "queue":
        for command in commands.values():
            subprocess.run([sys.executable, "-m", *command], cwd=config.ROOT, check=True)
        return 0
    return run_experiments(commands)


def run_experiments(commands: dict[str, list[str]]) -> int:
    """Each `dvc exp run --temp` in turn: a copy of the checkout per experiment, as DVC's queue makes, without
    the queue's worker, which can wait forever once its experiments have ended (treeverse/dvc#10428). One that
    fails does not stop the rest. Ctrl-C or SIGTERM stops the one running as Ctrl-C stops `dvc exp run`, and
    starts no more."""
    received: list[int] = []
    running: list[subprocess.Popen] = []

    def relay(signum: int, frame: object) -> None:
        received.append(signum)
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)

    previous = {s: signal.signal(s, relay) for s in (signal.SIGINT, signal.SIGTERM)}
    failed, ran = [], []
    try:
        for number, (name, command) in enumerate(commands.items(), start=1):
            if received:
                break
            print(f"{name} ({number} of {len(commands)}): {shlex.join(command)}", flush=True)
            # in a process group of its own, so that a signal reaches it once, as passed on here
            running.append(subprocess.Popen([sys.executable, "-m", *command], cwd=config.ROOT,
                                            env=config.stages_env(), start_new_session=True))
            if running[0].wait() != 0:
                failed.append(name)
            running.clear()
            ran.append(name)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    left = [name for name in commands if name not in ran]
    if received:
        print(f"stopped: {ran[-1]} was stopped ({signal.Signals(received[0]).name}); not run: "
              f"{', '.join(left) or 'none'}", file=sys.stderr)
        return 128 + received[0]
    if failed:
        print(f"error: {len(failed)} of {len(commands)} experiments failed: {', '.join(failed)} (each one's output "
              "is above; `python -m pipeline compare` lists them all)", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    progress.library_bars_as_lines()
    if argv and argv[0] in dag.stage_descriptions():
        return stage.main(argv, prog="python -m pipeline")
    args = build_parser().parse_args(argv)
    last_words = sys.stderr.write
    if args.command in ("run", "quickstart"):  # the flow's temporary Prefect server says it stopped at exit:
        last = []  # say the outcome after it (exit handlers run last-registered first; it registers later)
        atexit.register(lambda: sys.stderr.write("".join(last)))
        last_words = last.append
    try:
        if args.command == "preset":
            overrides = presets.collect_overrides(args.names, args.overrides)
            if args.dvc_args:
                print(shlex.join(presets.dvc_set_args(overrides)))
            else:
                runlock.hold()
                params = presets.apply(args.names, presets.collect_overrides([], args.overrides))
                print(f"params.yaml: set {', '.join(overrides) or 'nothing'}")
                print(model_size(params))
        elif args.command == "translate":
            translate_command(args)
        elif args.command == "report":
            from pipeline import report

            print(f"wrote {report.write_report(args.out)}")
        elif args.command == "table3":
            return table3_command(args.rows, "run" if args.run else "queue" if args.queue else "print")
        elif args.command == "compare":
            from pipeline import compare

            print(compare.table(compare.experiments(), args.width))
        elif args.command == "sync":
            from pipeline import unsent

            if left := unsent.sync():
                raise PipelineError(f"{left} run(s) still unsent: their server does not answer; sync again later")
        elif args.command == "offline-plots":
            from pipeline import offline_plots

            print(f"wrote {offline_plots.install()}: `dvc plots show` needs no network")
        elif args.command == "serve":
            from pipeline import flow

            flow.serve()
        elif args.command == "deploy":
            from pipeline import flow

            name = flow.deploy(args.pool, args.source)
            print(f"deployed {name} to the work pool {args.pool}: start a worker where the runs should go "
                  f"(prefect worker start --pool {args.pool}), then a run from the UI or "
                  f"`prefect deployment run '{name}' -p presets='[\"quickstart\"]'`")
        else:
            names = ["quickstart", *args.preset] if args.command == "quickstart" else args.preset
            overrides = presets.collect_overrides([], args.overrides)
            # A wrong preset, key or value, a folder outside git, or another run at work here stops here, in a line,
            # before Prefect starts a server for the flow.
            presets.layered({**presets.collect_overrides(names, []), **overrides}, start_over=bool(names))
            dag.require_git()
            runlock.hold()
            from pipeline import flow

            flow.use_a_server_that_answers()
            flow.quiet_if_the_server_is_lost()
            try:
                state = flow.pipeline(presets=names, overrides=overrides, return_state=True)
                lost = None if state.is_completed() else flow.server_lost(state.message or "")
            except Exception as e:
                if (lost := flow.server_lost(e)) is None:
                    raise
            if lost and flow.FINISHED:  # the work is done; only Prefect's record of its end is missing
                last_words(f"warning: {lost} before the flow's end reached it; the pipeline finished (test BLEU "
                           f"{flow.FINISHED['scores']['test']['bleu']:.2f}), every stage recorded by DVC\n")
            elif lost:
                raise PipelineError(f"{lost} during the flow; the stages that finished are recorded by DVC, whose "
                                    "stage in progress runs on regardless: `dvc repro` runs the rest from its cache "
                                    "(or this command, once the server answers)")
            elif not state.is_completed():
                raise PipelineError(state.message)
    except PipelineError as e:
        last_words(f"error: {e}\n")
        return 1
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM as the tracking turns it: one line, not a traceback
        last_words("stopped: the run was interrupted; a stage stopped in its work saved what it had done, and "
                   "the next run goes on from there\n")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
