"""Bench results as files, and docs/performance.md rendered from them, so the page cannot go stale.

Each bench run ends by `record(...)`: a JSON file in bench/results/ holding its figures with the
command that produced them, the machine (CPU or GPU model, cores), torch's version, the commit (and
whether the code had uncommitted changes), the date, and the share of the run's CPU time the
hypervisor gave other guests (steal: a shared VM's noise, which no ratio within the run cancels if it
came in bursts). One file per bench, case and machine: a rerun replaces the figure it remeasures
(git keeps the old one). `python -m bench.results` renders the page from every file; `--check` fails
when the page differs from what the files render (a test runs it).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from translate.cpuinfo import first_cpu

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"  # where record writes, unless BENCH_RESULTS names another folder (smoke runs)
PAGE = ROOT / "docs" / "performance.md"
STEAL_WARNING = 0.02  # a run that lost more than this to other guests says so: a rate off by more than 2%


# The instruction sets a CPU's training speed turns on, by /proc/cpuinfo's names: one model name covers
# CPUs with and without them (an AMD EPYC with AVX512-BF16 trains bf16 at 1.87x fp32, stages/devices.py).
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"}


def machine(cpuinfo: str | None = None) -> dict[str, Any]:
    """What ran the bench: the GPU's name where torch sees one, the CPU's model, cores and the instruction
    sets of ISA_FLAGS it has always (from /proc/cpuinfo, or `cpuinfo`)."""
    fields = first_cpu(cpuinfo)
    cpu = fields.get("model name") or platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    found: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "gpu": None,
                             "isa": [name for flag, name in ISA_FLAGS.items() if flag in flags]}
    if "torch" in sys.modules:
        import torch

        found["torch"] = torch.__version__
        if torch.cuda.is_available():
            found["gpu"] = torch.cuda.get_device_name()
    return found


def cpu_ticks(stat: str | None = None) -> tuple[int, int] | None:
    """(stolen, busy) CPU time of all CPUs since boot in clock ticks, from /proc/stat's first line (or
    `stat`); None where there is none. Stolen is time the hypervisor gave other guests while these CPUs
    had work; busy is every tick but idle and iowait, the stolen ones included. On a shared VM a bench
    runs slower by the stolen share of its busy time, whatever the code does."""
    try:
        line = (Path("/proc/stat").read_text() if stat is None else stat).split("\n", 1)[0].split()
    except OSError:
        return None
    if len(line) < 6 or line[0] != "cpu" or not all(x.isdigit() for x in line[1:9]):
        return None  # not the kernel's total line: no steal figure, and the bench's result is still written
    ticks = [int(x) for x in line[1:9]]  # user nice system idle iowait irq softirq steal (guest is within user)
    stolen = ticks[7] if len(ticks) == 8 else 0
    return stolen, sum(ticks) - ticks[3] - ticks[4]


START_TICKS = cpu_ticks()  # at import: every bench imports record at its top, so the span is the whole run


def stolen_share(start: tuple[int, int] | None, end: tuple[int, int] | None) -> float | None:
    """The share of the CPUs' busy time between two cpu_ticks() readings that the hypervisor took."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return (end[0] - start[0]) / (end[1] - start[1])


def _commit(root: Path = ROOT) -> str:
    """HEAD, with " and uncommitted changes" when a tracked file other than the results and their page
    differs from it: a figure then comes from code that no commit holds."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short=10", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                      f":(exclude){RESULTS.relative_to(ROOT)}", f":(exclude){PAGE.relative_to(ROOT)}")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} and uncommitted changes" if changed else head


def _slug(text: str, most: int = 120) -> str:
    """A name part of letters, digits and dashes. One past `most` characters (a try of many overrides) is
    cut and ends in a hash of the whole, so that a file name stays within the 255 bytes file systems allow
    and two such cases still keep a file each; the record itself holds the case in full."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if len(slug) <= most:
        return slug
    return f"{slug[:most - 11].rstrip('-')}-{hashlib.sha256(slug.encode()).hexdigest()[:10]}"


ELSEWHERE = "<dir>"  # a recorded path's folder outside the checkout: the reader's own folder goes there


def portable(arg: str) -> str:
    """An argument as a command on another machine reads it: a path of the checkout relative to it (the
    shared data as ../shared/data), any other absolute path as ELSEWHERE and its last two parts, so that no
    folder of this machine lands in a record."""
    if not arg.startswith("/"):
        return arg
    path = Path(arg)
    if path.is_relative_to(ROOT):
        return str(path.relative_to(ROOT))
    if path.is_relative_to(ROOT.parent / "shared"):
        return str(Path("..") / path.relative_to(ROOT.parent))
    return str(Path(ELSEWHERE, *path.parts[-2:]))


def shell_word(arg: str) -> str:
    """An argument as a shell reads it back from a recorded command: quoted where it holds anything a
    shell would split or expand (a YAML list in an override, say, with or without spaces). A path from
    outside the checkout keeps its ELSEWHERE folder unquoted, so that it reads as the folder to fill in."""
    head = f"{ELSEWHERE}/" if arg.startswith(f"{ELSEWHERE}/") else ""
    return head + shlex.quote(arg[len(head):])


def record(bench: str, case: str, title: str, rows: list[dict[str, Any]], summary: str,
           results_dir: Path | None = None, argv: list[str] | None = None,
           tables: dict[str, list[dict[str, Any]]] | None = None) -> Path:
    """Write one bench run's figures: `rows` a table (one dict per system or size, the same keys),
    `summary` its one-line conclusion (the ratio), `case` what distinguishes this run's work from
    the bench's other cases (e.g. '20 sentences'); `tables` more of the same run's tables by their
    captions (e.g. a profile)."""
    found = machine()
    result = {"bench": bench, "case": case, "title": title, "rows": rows, "summary": summary,
              "command": " ".join(["python -m", f"bench.{bench}",
                                   *(shell_word(portable(a)) for a in (sys.argv[1:] if argv is None else argv))]),
              "machine": found, "commit": _commit(), "date": datetime.date.today().isoformat(),
              **({"tables": tables} if tables else {})}
    stolen = stolen_share(START_TICKS, cpu_ticks())
    if stolen is not None:
        result["cpu_steal"] = round(stolen, 4)
        if stolen >= STEAL_WARNING:
            print(f"warning: the hypervisor took {stolen:.1%} of this run's CPU time (steal): "
                  "its rates and minutes are low by about as much; rerun when the host is quiet", flush=True)
    # The widest instruction set goes into the name, so CPUs under one model name (AMD EPYC with and
    # without AVX512-BF16) keep a file each instead of replacing each other's.
    widest = found["isa"][-1:] if found.get("isa") else []
    where = found["gpu"] or " ".join([found["cpu"], *widest, f"{found['cores']} cores"])
    folder = results_dir or Path(os.environ.get("BENCH_RESULTS", RESULTS))
    out = folder / f"{_slug(bench)}--{_slug(case)}--{_slug(where)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(out)
    print(f"result: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}", flush=True)
    return out


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}".rstrip("0").rstrip(".") if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    keys = list(rows[0])
    return ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys),
            *("| " + " | ".join(_cell(row.get(k, "")) for k in keys) + " |" for row in rows), ""]


def render(results_dir: Path | None = None) -> str:
    """The page: each bench's results, newest machine kind first within a bench."""
    results = [json.loads(p.read_text(encoding="utf-8")) for p in sorted((results_dir or RESULTS).glob("*.json"))]
    lines = ["# Performance", "",
             "Rendered by `python -m bench.results` from the files in `bench/results/`, one per bench, case and",
             "machine, each written by the bench run it names; do not edit by hand. Each bench runs ours and a",
             "peer on the same work in one run, so compare the ratios, which hold across a machine's drift, more",
             "than the rates. Where a result gives the CPU time taken by the host (steal), a shared VM gave that",
             "share of the run to other guests: its rates are low by about as much, in bursts no ratio cancels.",
             "Rerun a command on your machine and render again.", ""]
    for bench in sorted({r["bench"] for r in results}):
        lines += [f"## bench.{bench}", ""]
        for r in sorted((r for r in results if r["bench"] == bench), key=lambda r: (r["case"], r["date"])):
            m = r["machine"]
            isa = f" ({', '.join(m['isa'])})" if m.get("isa") else ""
            where = m["gpu"] or f"{m['cpu']}{isa}, {m['cores']} cores"
            lines += [f"### {r['title']}", "",
                      f"{where}; torch {m.get('torch', 'not loaded')}; commit {r['commit']}; {r['date']}"
                      + (f"; CPU time taken by the host (steal): {r['cpu_steal']:.1%}" if "cpu_steal" in r else "")
                      + (f" ({r['source']})" if r.get("source") else ""), "",
                      "```", r["command"], "```", ""]
            lines += _table(r["rows"])
            lines += [f"**{r['summary']}**", ""]
            for caption, rows in r.get("tables", {}).items():
                lines += [f"{caption}:", "", *_table(rows)]
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description="Render docs/performance.md from bench/results/*.json.")
    ap.add_argument("--check", action="store_true", help="fail if the page differs from what the files render")
    args = ap.parse_args()
    page = render()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text(encoding="utf-8") != page:
            sys.exit(f"error: {PAGE.relative_to(ROOT)} is not what bench/results/ renders: "
                     "run `python -m bench.results` and commit it")
        return
    tmp = PAGE.with_suffix(".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(PAGE)
    print(f"wrote {PAGE.relative_to(ROOT)} from {len(list(RESULTS.glob('*.json')))} results")


if __name__ == "__main__":
    main()
