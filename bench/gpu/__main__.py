"""bench.gpu's driver: runs each part in a process of its own, writes the JSON after each and the
table at the end (the package's docstring says what each part measures)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu import FULL, PARTS, SMOKE, Sizes, prepare
from bench.gpu.throughput import SYSTEMS
from bench.results import record  # at the start: a result's steal is measured from this import

OUT_OF_MEMORY = 3  # a part's exit status when the GPU ran out of memory
ORCHESTRATION = ("mlflow", "prefect", "dvc")


def run_part(sizes: Sizes, work: Path, part: str, accum: int) -> dict[str, Any]:
    """One measurement, in this process: `part` is its module's function and arguments, e.g.
    throughput:base:ours."""
    import torch

    kind, *args = part.split(":")
    try:
        if kind == "prepare":
            result = prepare(sizes, work)
        elif kind == "throughput":
            from bench.gpu.throughput import throughput

            result = throughput(sizes, work, args[0], args[1], accum)
        elif kind == "profile":
            from bench.gpu.profile import profile

            result = profile(sizes, work, args[0])
        elif kind == "curve":
            from bench.gpu.curves import curve

            result = curve(sizes, work, args[0])
        elif kind == "multi30k":
            from bench.gpu.multi30k import multi30k, tries

            result = multi30k(sizes, work, args[0], tries()[args[0]])
        else:
            from bench.gpu.decode import decode

            result = decode(sizes, work)
    except torch.cuda.OutOfMemoryError:
        sys.exit(OUT_OF_MEMORY)
    loaded = [m for m in ORCHESTRATION if m in sys.modules]
    assert not loaded, f"bench.gpu must run without the orchestration layer, but imported {loaded}"
    return result


# -- the whole run ------------------------------------------------------------------------------------

def spawn(part: str, args: argparse.Namespace, work: Path, accum: int = 1) -> dict[str, Any]:
    """Run one part in a fresh process; on running out of memory, again with twice the accumulation.
    A part that fails or runs past --part-timeout gives {"error": why}, and the run goes on."""
    out = work / f"{part.replace(':', '-')}.json"
    command = [sys.executable, "-m", "bench.gpu", "--part", part, "--work", str(work), "--accum", str(accum),
               "--part-out", str(out), *(["--smoke"] if args.smoke else [])]
    start = time.perf_counter()
    limits = [t for t in (args.part_timeout, args.deadline - time.monotonic() if args.budget else 0) if t]
    if args.budget and min(limits) < 10:
        return {"error": f"not run: --budget ({args.budget:.0f} s) spent"}
    print(f"== {part}", flush=True)
    try:
        proc = subprocess.run(command, timeout=min(limits) if limits else None)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {min(limits):.0f} s (--part-timeout or what was left of --budget)"}
    if proc.returncode == OUT_OF_MEMORY and accum < 16:
        print(f"{part}: out of memory with accumulation {accum}; again with {accum * 2}", flush=True)
        return spawn(part, args, work, accum * 2)
    if proc.returncode != 0:
        return {"error": f"failed (exit status {proc.returncode}; its output above)"}
    result = json.loads(out.read_text())
    result["wall_seconds"] = time.perf_counter() - start
    print(f"{part}: {result['wall_seconds']:.0f} s", flush=True)
    return result


def table(results: dict[str, Any]) -> str:
    """The markdown report of whichever parts ran."""
    lines = [f"# bench.gpu on {results['device']}{' (smoke sizes)' if results['smoke'] else ''}", ""]
    errors = [f"- {name}: {why}" for name, why in results.get("errors", {}).items()]
    if errors:
        lines += ["Parts that did not finish:", *errors, ""]
    if throughput := results.get("throughput"):
        lines += [f"Training, bf16, {results['batch_tokens']} target tokens a step (the train stage's step "
                  "against MarianMT of the same shape, on the same batches):", "",
                  "| model | system | accumulation | target tokens/s | TFLOP/s | MFU | peak memory (GB) "
                  "| compiling (s) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in throughput:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
            memory = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-"
            lines.append(f"| {r['model']} | {r['system']} | {r['grad_accum']} | {r['tgt_tokens_per_sec']:,.0f} | "
                         f"{r['tflops']:.3g} | {mfu} | {memory} | {r['compile_seconds']:.0f} |")
        lines += [""] + [f"{which} / MarianMT: {ratio:.2f}x" for which, ratio in results["over_marian"].items()]
        lines.append("")
    for r in results.get("profile", []):
        kinds = [f"| {k['kind']} | {k['ms a step']} | {k['share']} |" for k in r["kinds"]]
        lines += [f"Profile, {r['model']} {r['system']}: {_step_time(r)}; {r['steps']} steps under it:", "",
                  "```", r["table"], "```", "",
                  *(["The kernels by kind:", "", "| kind | ms a step | share |", "|---|---|---|", *kinds, ""]
                    if kinds else [])]
    if c := results.get("curves"):
        finals = ", ".join(f"{name} {loss:.3f}" for name, loss in c["final"].items())
        within = "; ".join(f"{name} within {d:.3%} ({'yes' if d <= c['limit'] else 'NO'})"
                           for name, d in c["compared"].items())
        lines += [f"Loss curves against fp32's, {c['model']}, {c['steps']} steps on the same (bucketed) batches "
                  f"(limit {c['limit']:.0%}): {within}; final loss {finals}", ""]
    if d := results.get("decode"):
        lines += [f"Decoding, beam 4, {d['sentences']} sentences of newstest2014, weights: {d['weights']}:", "",
                  *d["table"], *[f"{system}: not measured ({why})" for system, why in d["unavailable"].items()],
                  *[f"BLEU of {s['system']} {s['precision']}: {s['bleu']:.1f}" for s in d["systems"]], ""]
    for m in results.get("multi30k", []):
        times = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in m["seconds"].items())
        lines += [f"Multi30k {m['pair']}, try {m['try']} (presets multi30k + multi30k-gpu, then "
                  f"{m['overrides'] or 'nothing'}; {m['steps']} steps): test2016 sacreBLEU {m['bleu']['test']:.2f} "
                  f"(lowercased tokenised {m['bleu_lc_tok']['test']:.2f}), dev {m['bleu']['dev']:.2f}, "
                  f"in {m['total_seconds'] / 60:.1f} minutes: {times}",
                  *[f"  the same training with {r['changes']}: dev {r['bleu']:.2f} ({r['seconds']:.0f} s)"
                    for r in m.get("rescored", [])], ""]
    return "\n".join(lines)


def _step_time(profiled: dict[str, Any]) -> str:
    """A profile's step time, and the share of it the GPU's kernels were busy."""
    busy, step = profiled["kernel_seconds_per_step"], profiled["step_seconds"]
    kernels = f", its kernels {busy:.3f} s (the GPU busy {busy / step:.0%})" if busy is not None else ""
    return f"a step takes {step:.3f} s without the profiler{kernels}"


def record_results(results: dict[str, Any]) -> None:
    """The parts that ran, as bench results (bench/results.py) for docs/performance.md."""
    size = " (smoke sizes)" if results["smoke"] else ""
    if throughput := results.get("throughput"):
        # one result per models and systems asked: a run of some of them keeps the others' figures
        asked = f"{' and '.join(results['models'])}: {', '.join(results['systems'])}"
        unfinished = [f"{part.split(':', 1)[1]} {why}" for part, why in results["errors"].items()
                      if part.startswith("throughput:")]
        record("gpu", f"throughput {asked}{size}", f"Training steps of {results['batch_tokens']:,} target tokens "
               f"in bf16, the train stage's step against MarianMT's ({asked}){size}",
               [{"model": r["model"], "system": r["system"], "accumulation": r["grad_accum"],
                 "target tokens/s": round(r["tgt_tokens_per_sec"]), "TFLOP/s": round(r["tflops"], 1),
                 "MFU": f"{r['mfu']:.1%}" if r["mfu"] is not None else "-", "peak memory (GB)": r["peak_memory_gb"],
                 "compiling (s)": round(r["compile_seconds"])}
                for r in throughput],
               "; ".join([*(f"{which} / MarianMT {ratio:.2f}x" for which, ratio in results["over_marian"].items()),
                          *(f"not finished: {why}" for why in unfinished)]))
    for r in results.get("profile", []) if results["device"] != "cpu" else ():  # a CPU's profile has no kernels
        record("gpu", f"profile {r['model']} {r['system']}{size}", f"Where a bf16 step of {results['batch_tokens']:,} "
               f"target tokens spends the GPU's time, {r['model']} {r['system']}, by kind of kernel{size}", r["kinds"],
               _step_time(r), tables={"The kernels taking the most time": r["kernels"]})
    if d := results.get("decode"):
        record("gpu", f"decode{size}", f"Beam search on the GPU, {d['sentences']} sentences of newstest2014, beam 4, "
               f"weights: {d['weights']}{size}", d["rows"], d["summary"])
    if tried := results.get("multi30k"):
        record("gpu", f"multi30k{size}", f"Multi30k on one GPU, presets multi30k + multi30k-gpu and each try's "
               f"changes, the whole pipeline each{size}",
               [{"try": m["try"], "pair": m["pair"], "changes": m["overrides"] or "-", "steps": m["steps"],
                 "minutes": round(m["total_seconds"] / 60, 1), "dev sacreBLEU": round(m["bleu"]["dev"], 2),
                 "test sacreBLEU": round(m["bleu"]["test"], 2),
                 "test lowercased tokenised": round(m["bleu_lc_tok"]["test"], 2)} for m in tried]
               + [{"try": f"{m['try']}, rescored", "pair": m["pair"], "changes": r["changes"], "steps": m["steps"],
                   "minutes": round(r["seconds"] / 60, 1), "dev sacreBLEU": round(r["bleu"], 2),
                   "test sacreBLEU": "-", "test lowercased tokenised": "-"}
                  for m in tried for r in m.get("rescored", [])],
               "; ".join(f"best on dev, {pair}: {best}" for pair, best in _best_on_dev(tried).items()))


def _best_on_dev(tried: list[dict[str, Any]]) -> dict[str, str]:
    """Each language pair's best try or rescore variant on dev (dev BLEU compares within a pair only)."""
    scored: dict[str, list[tuple[float, str]]] = {}
    for m in tried:
        scored.setdefault(m["pair"], []).append((m["bleu"]["dev"], m["try"]))
        scored[m["pair"]] += [(r["bleu"], f"{m['try']} with {r['changes']}") for r in m.get("rescored", [])]
    return {pair: max(of_pair)[1] for pair, of_pair in scored.items()}


def write(path: Path, text: str) -> None:
    from stages.io import atomic_write

    with atomic_write(path) as f:
        f.write(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for a CPU")
    ap.add_argument("--out", type=Path, default=Path("gpu-bench.json"), help="the JSON; the table goes beside (.md)")
    ap.add_argument("--parts", type=lambda text: text.split(","), default=list(PARTS),
                    help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
    ap.add_argument("--systems", type=lambda text: text.split(","),
                    help=f"comma-separated, the train steps throughput times: of {', '.join(SYSTEMS)} (the train "
                    "stage's step settings, bench/gpu/throughput.py) and marian (default: all on a GPU, ours,marian "
                    "elsewhere); profile takes ours and captured of them, curves captured if named")
    ap.add_argument("--part-timeout", type=float, default=0.0,
                    help="seconds each measurement may take before it is stopped and reported so (0: no limit)")
    ap.add_argument("--models", type=lambda text: text.split(","),
                    help="comma-separated, the models throughput times: base, big (default: both; tiny with --smoke)")
    ap.add_argument("--tries", type=lambda text: text.split(","),
                    help="the multi30k part's tries, of bench/gpu/multi30k-tries.yaml (default: all, in order)")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds for the whole run: parts stop when it is spent, and those not begun are reported "
                    "not run (0: no limit)")
    ap.add_argument("--work", type=Path, help="keep the prepared data and the trained models here, e.g. to decode "
                    "decode's model on the CPU afterwards (default: a temporary folder, removed at the end)")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--accum", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.work is not None and args.work.exists() and not args.work.is_dir():
        ap.error(f"--work {args.work}: not a folder (it is where the data and models are kept)")
    if args.part_timeout < 0 or args.budget < 0:
        ap.error("--part-timeout and --budget are 0 (no limit) or more seconds")
    args.deadline = time.monotonic() + args.budget
    if unknown := set(args.parts) - set(PARTS):
        ap.error(f"--parts: unknown {', '.join(sorted(unknown))} (known: {', '.join(PARTS)})")
    if unknown := set(args.systems or ()) - {*SYSTEMS, "marian"}:
        ap.error(f"--systems: unknown {', '.join(sorted(unknown))} (known: {', '.join(SYSTEMS)}, marian)")
    if unknown := set(args.models or ()) - {"base", "big"}:
        ap.error(f"--models: unknown {', '.join(sorted(unknown))} (known: base, big)")
    from bench.gpu.multi30k import first_of_each_pair, tries, try_settings
    from stages.io import PipelineError

    if unknown := set(args.tries or ()) - set(tries()):
        ap.error(f"--tries: unknown {', '.join(sorted(unknown))} (known: {', '.join(tries())})")
    sizes = SMOKE if args.smoke else FULL
    chosen = args.tries or (first_of_each_pair(tries()) if args.smoke else list(tries()))
    if "multi30k" in args.parts and not args.part:
        for name in chosen:  # a bad try fails here, before the GPU's minutes
            try:
                try_settings(sizes, name, tries()[name], Path("multi30k-source"))
            except (ValueError, PipelineError) as e:
                ap.error(str(e))
    if args.part:
        write(args.part_out, json.dumps(run_part(sizes, args.work, args.part, args.accum)))
        return
    import torch

    systems = args.systems or ([*SYSTEMS, "marian"] if torch.cuda.is_available() else ["ours", "marian"])
    start = time.perf_counter()
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                               "smoke": args.smoke, "batch_tokens": sizes.batch_tokens, "torch": torch.__version__,
                               "models": args.models or list(sizes.models), "systems": systems, "errors": {}}

    def measured(key: str, part: str) -> dict[str, Any] | None:
        """A part's result, or None with its error recorded; the JSON rewritten either way."""
        result = spawn(part, args, work)
        if "error" in result:
            results["errors"][part] = result["error"]
        write(args.out, json.dumps(results, indent=2) + "\n")
        return None if "error" in result else result

    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if set(args.parts) - {"multi30k"}:  # every other part reads the prepared Europarl sample
            results["prepare"] = measured("prepare", "prepare")
            if results["prepare"] is None:
                raise SystemExit(f"bench.gpu: preparing the data failed: {results['errors']['prepare']}")
        if "throughput" in args.parts:
            results["throughput"], results["over_marian"] = [], {}
            for m in results["models"]:
                for system in systems:
                    if r := measured("throughput", f"throughput:{m}:{system}"):
                        results["throughput"].append(r)
                        print(f"{m} {system}: {r['tgt_tokens_per_sec']:,.0f} target tokens/s, {r['tflops']:.3g} "
                              f"TFLOP/s, MFU {r['mfu']}, peak {r['peak_memory_gb']} GB", flush=True)
                rate = {r["system"]: r["tgt_tokens_per_sec"] for r in results["throughput"] if r["model"] == m}
                for system in rate.keys() - {"marian"} if "marian" in rate else ():
                    results["over_marian"][f"{m} {system}"] = rate[system] / rate["marian"]
        if "profile" in args.parts:
            results["profile"] = []
            for system in [s for s in ("ours", "captured") if s in systems]:
                if r := measured("profile", f"profile:{system}"):
                    results["profile"].append(r)
                    print(r["table"], flush=True)
        if "curves" in args.parts:
            names = ["fp32", "bf16", *(["bf16-captured"] if "captured" in systems else [])]
            curves = {name: measured("curves", f"curve:{name}") for name in names}
            if curves["fp32"]:
                compared = {name: max(abs(a - b) / a for a, b in zip(curves["fp32"]["loss"], c["loss"], strict=True))
                            for name, c in curves.items() if c and name != "fp32"}
                results["curves"] = {"model": curves["fp32"]["model"], "steps": sizes.curve_steps, "runs": curves,
                                     "compared": compared, "limit": 0.03,
                                     "agree": all(d <= 0.03 for d in compared.values()),
                                     "final": {name: c["loss"][-1] for name, c in curves.items() if c}}
                for name, d in compared.items():
                    print(f"{name} against fp32: largest relative difference {d:.3%}", flush=True)
        if "decode" in args.parts:
            results["decode"] = measured("decode", "decode")
        if "multi30k" in args.parts:
            results["multi30k"] = []
            for name in chosen:
                if r := measured("multi30k", f"multi30k:{name}"):
                    results["multi30k"].append(r)
    results["wall_seconds"] = time.perf_counter() - start
    write(args.out, json.dumps(results, indent=2) + "\n")
    record_results(results)
    text = table(results) + f"\n{results['wall_seconds'] / 60:.1f} minutes in all\n"
    write(args.out.with_suffix(".md"), text)
    print(text)
    if results["errors"]:
        raise SystemExit(f"bench.gpu: {len(results['errors'])} part(s) did not finish: {', '.join(results['errors'])}")


if __name__ == "__main__":
    main()
