"""Decoding the same lines with the same weights in each system, each in a process of its own as a user
runs it: ours (the decode stage's translate on translate/'s Translator), Hugging Face transformers'
MarianMT `generate` and CTranslate2, from the export stage's files; and the report comparing them.
Used by bench.decode and bench.gpu's decode part."""
from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stages import export, vocab
from stages.decode import load_translator, translate
from stages.devices import default_device
from stages.params import DecodeParams
from translate.cuda import DTYPES
from translate.translator import length_batches

CT2_TYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "int8"}


@dataclass(frozen=True)
class Decoded:
    system: str
    precision: str
    batch_tokens: int
    seconds: float
    tokens: int  # sentencepiece pieces of the output
    lines: list[str]

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def _timed(work: Callable[[], list[str]]) -> tuple[float, list[str]]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    lines = work()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, lines


SYSTEMS = ("ours (decode stage)", "transformers MarianMT generate", "CTranslate2")
PEERS = {"transformers": SYSTEMS[1], "ctranslate2": SYSTEMS[2]}  # --peers names


@dataclass(frozen=True)
class Setup:
    """What a worker process needs to load one system: the same weights in each system's format."""
    model_path: Path
    vocab_dir: Path
    marian_dir: Path
    ct2_dir: Path
    beam: int
    batch_tokens: int
    threads: int


def decode_all(model_path: Path, vocab_dir: Path, lines: list[str], beam: int, batch_sizes: tuple[int, ...],
               precisions: tuple[str, ...], tmp: Path, repeats: int = 1,
               peers: tuple[str, ...] = SYSTEMS[1:]) -> tuple[list[Decoded], dict[str, str]]:
    """Every system at every precision and batch size (source tokens) on the same lines: ours (the
    decode stage), transformers MarianMT generate and CTranslate2 (or those of `peers`), from the same
    weights. Also returns, by system and precision, why a peer could not run here (CTranslate2's wheel
    is built for one CUDA major version).

    Each system runs in a process of its own, as a user runs it: two in one process would share its
    allocator settings and bring two OpenMP runtimes. The processes load at once, then take turns, one
    translating at a time, warm-ups included (OpenMP threads of several processes at once on few cores
    wait at every barrier for a time slice: `bench.decode --train-base multi30k:1,europarl:1 --limit 2` in CI
    warmed up in 65 s what takes 2 s in turn). The turns are short: the lines are cut into the batches
    every system makes of them (length_batches, as each does), consecutive batches joined into about ten
    turns a round (`turns`), each turn goes to every system in turn, the first rotating, and a system's
    time is the sum of each turn's best over the `repeats` rounds. A slow spell of a shared machine,
    seconds to minutes long, so falls on every system alike: turns of whole runs of every line gave
    ratios from 0.76x to 1.11x between the same two systems on 2 cloud cores."""
    marian_dir, ct2_dir = export.to_marian(model_path, vocab_dir, tmp / "marian"), tmp / "ct2"
    unavailable: dict[str, str] = {}
    if SYSTEMS[2] in peers:
        try:
            export.to_ctranslate2(marian_dir, ct2_dir)
        except ImportError as error:  # not installed here (bench/gpu/check.sh: the GPU machine has none)
            unavailable = {f"{SYSTEMS[2]} {precision}": f"not installed: {error}" for precision in precisions}
            peers = tuple(peer for peer in peers if peer != SYSTEMS[2])
    sp = vocab.load(vocab_dir)
    lengths = [len(ids) for ids in sp.encode(lines)]
    results: list[Decoded] = []
    for precision in precisions:
        with ExitStack() as stack:
            # lines[:8] warm each worker up in turn: first calls, kernels chosen, caches filled
            workers = {size: stack.enter_context(_Workers(
                Setup(model_path, vocab_dir, marian_dir, ct2_dir, beam, size, torch.get_num_threads()),
                precision, lines[:8], (SYSTEMS[0], *peers))) for size in batch_sizes}
            for size_workers in workers.values():
                unavailable |= {f"{name} {precision}": why for name, why in size_workers.unavailable.items()}
            fastest: dict[tuple[str, int], dict[int, float]] = {}  # (system, size) -> each turn's best seconds
            outputs: dict[tuple[str, int], list[str]] = {}
            for _ in range(repeats):
                for size, size_workers in workers.items():
                    ready = size_workers.ready
                    for t, turn in enumerate(turns(length_batches(lengths, size), len(lines))):
                        some = [lines[i] for i in turn]
                        for name in ready[t % len(ready):] + ready[: t % len(ready)]:
                            time.sleep(SETTLE_SECONDS)
                            seconds, out = size_workers.translate(name, some)
                            times = fastest.setdefault((name, size), {})
                            times[t] = min(times.get(t, float("inf")), seconds)
                            done = outputs.setdefault((name, size), [""] * len(lines))
                            for i, line in zip(turn, out, strict=True):
                                done[i] = line
        results += [Decoded(name, precision, size, sum(fastest[name, size].values()),
                            sum(len(ids) for ids in sp.encode(out)), out) for (name, size), out in outputs.items()]
    return results, unavailable


# Between turns: the OpenMP threads of the system whose turn ended spin on for milliseconds, on the
# cores the next one needs. With a turn per sentence (bench.decode --batch-tokens 1) that took 10-17%
# from ours and CTranslate2 alike; in turns of about a tenth of the lines (`turns`) it is under the
# machine's drift, and the pause costs a few seconds a round.
SETTLE_SECONDS = 0.1


def turns(batches: list[list[int]], lines: int, per_round: int = 10) -> list[list[int]]:
    """Consecutive batches joined into turns of at least lines / per_round lines each (the last may
    hold fewer): a turn per batch where batches are large, and few pauses where they are one sentence
    each. A system cuts a turn's lines into the same batches again, as they are consecutive in
    length order."""
    out: list[list[int]] = []
    for batch in batches:
        if out and len(out[-1]) * per_round < lines:
            out[-1] = out[-1] + batch
        else:
            out.append(list(batch))
    return out


class _Workers:
    """One process per system, each loading its system and answering translation requests with
    (seconds, output lines); a system that cannot load here says why instead."""

    def __init__(self, setup: Setup, precision: str, warm_up: list[str], systems: tuple[str, ...]) -> None:
        context = multiprocessing.get_context("spawn")  # no state of this process is inherited
        self.connections, self.processes, self.ready, self.unavailable = {}, [], [], {}
        for name in systems:
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs, name, precision, setup), daemon=True)
            process.start()
            theirs.close()
            self.connections[name] = ours
            self.processes.append(process)
        for name in self.connections:
            why = self._answer(name)
            if why is None:
                self.ready.append(name)
            else:
                self.unavailable[name] = why
        for name in self.ready:
            self.translate(name, warm_up)

    def _answer(self, name: str) -> Any:
        try:
            return self.connections[name].recv()
        except EOFError:
            raise RuntimeError(f"{name}: its worker process ended without answering (its error is above)") from None

    def translate(self, name: str, lines: list[str]) -> tuple[float, list[str]]:
        self.connections[name].send(lines)
        return self._answer(name)

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        for connection in self.connections.values():
            connection.close()  # a worker waiting for lines reads the end and returns
        for process in self.processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()


def _serve(connection, name: str, precision: str, setup: Setup) -> None:
    """A worker process: load one system, then time each list of lines it is sent."""
    torch.set_num_threads(setup.threads)
    work = _load(name, precision, setup)
    if isinstance(work, str):
        connection.send(work)
        return
    connection.send(None)
    while True:
        try:
            lines = connection.recv()
        except EOFError:
            return
        connection.send(_timed(lambda: work(lines)))


def _load(name: str, precision: str, setup: Setup) -> Callable[[list[str]], list[str]] | str:
    """One system's translation of a list of lines, batched alike in all, or why it cannot run here."""
    device = default_device()
    sp = vocab.load(setup.vocab_dir)

    def batches(some: list[str]) -> list[list[int]]:
        return length_batches([len(ids) for ids in sp.encode(some)], setup.batch_tokens)

    if name == "CTranslate2":
        return _ctranslate2(setup.ct2_dir, sp, setup.beam, batches, device, precision)
    if name.startswith("ours"):
        ours = load_translator(setup.model_path, device, precision)
        params = DecodeParams(beam_size=setup.beam, length_penalty=0.6, length_penalty_formula="power",
                              stop="finished", max_length_extra=50, batch_tokens=setup.batch_tokens)
        return lambda some: translate(ours, sp, some, params, desc=None)  # a batch at a time: no progress lines
    if precision not in DTYPES:
        return "no int8 decoding without another package (bitsandbytes, optimum-quanto or torchao)"
    from transformers import MarianMTModel, MarianTokenizer

    tokenizer = MarianTokenizer.from_pretrained(setup.marian_dir)
    hf = MarianMTModel.from_pretrained(setup.marian_dir).to(device=device, dtype=DTYPES[precision]).eval()

    def generate(some: list[str]) -> list[str]:
        out = [""] * len(some)
        with torch.inference_mode():
            for batch in batches(some):
                inputs = tokenizer([some[i] for i in batch], return_tensors="pt", padding=True).to(device)
                ids = hf.generate(**inputs, num_beams=setup.beam, length_penalty=0.6, do_sample=False,
                                  early_stopping=True, max_new_tokens=inputs["input_ids"].size(1) + 50)
                for i, text in zip(batch, tokenizer.batch_decode(ids, skip_special_tokens=True), strict=True):
                    out[i] = text
        return out

    return generate


def _ctranslate2(model_dir: Path, sp, beam: int, batches: Callable[[list[str]], list[list[int]]],
                 device: torch.device, precision: str) -> Callable[[list[str]], list[str]] | str:
    """CTranslate2's translation of a list of lines, or why it cannot run on this device."""
    import ctranslate2

    if device.type == "cuda":  # its CUDA libraries load at the first translation, and a missing one can abort
        probe = subprocess.run([sys.executable, "-c", f"import ctranslate2; ctranslate2.Translator({str(model_dir)!r}, "
                                f"device='cuda', compute_type={CT2_TYPES[precision]!r}).translate_batch([['a']])"],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            return (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
    try:
        translator = ctranslate2.Translator(str(model_dir), device=device.type, compute_type=CT2_TYPES[precision],
                                            intra_threads=torch.get_num_threads())

        def ct2(some: list[str]) -> list[str]:
            out = [""] * len(some)
            for batch in batches(some):
                source = [sp.encode(some[i], out_type=str) + ["</s>"] for i in batch]
                found = translator.translate_batch(source, beam_size=beam, length_penalty=0.6,
                                                   max_decoding_length=max(map(len, source)) + 50)
                for i, result in zip(batch, found, strict=True):
                    out[i] = sp.decode(result.hypotheses[0])
            return out

        ct2(["a"])  # loads the device's libraries (cuBLAS of the CUDA version it was built for)
    except (RuntimeError, OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return ct2


AGREEMENT = 0.95  # the share of identical output lines below which two speeds are not compared


def _same(a: list[str], b: list[str]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def _ratio(ours: Decoded, other: Decoded) -> str:
    """Ours against another system, unless their outputs agree on too few lines to compare speeds."""
    if _same(ours.lines, other.lines) < AGREEMENT:
        return "not compared: outputs differ"
    return f"ours / this: {ours.rate / other.rate:.2f}x"


def table(results: list[Decoded], references: list[str] | None = None) -> tuple[list[dict[str, Any]], str]:
    """Each system's rate, ours against it at the same precision and batch size, and the share of
    output lines identical to ours; with references, each system's sacreBLEU (what a lower precision
    costs). The summary: each peer against ours, each at its fastest batch size, and ours at a precision
    a peer lacks against that peer at the first precision."""
    import sacrebleu

    rows = []
    for r in results:
        ours = next(o for o in results if (o.system, o.precision, o.batch_tokens) ==
                    (SYSTEMS[0], r.precision, r.batch_tokens))
        row = {"system": r.system, "precision": r.precision, "batch tokens": r.batch_tokens,
               "target tokens/s": round(r.rate), "sentences/s": round(len(r.lines) / r.seconds, 1),
               "ours / this": _ratio(ours, r) if r is not ours else "",
               "same lines as ours": f"{_same(ours.lines, r.lines):.1%}"}
        if references:
            row["BLEU"] = round(sacrebleu.corpus_bleu(r.lines, [references]).score, 2)
        first = results[0].precision  # ours at a later precision: how many lines that precision changed
        if r is ours and r.precision != first:
            ours_first = next(o for o in results if (o.precision, o.batch_tokens, o.system) ==
                              (first, r.batch_tokens, r.system))
            row["same lines as ours"] = f"{_same(ours_first.lines, r.lines):.1%} of ours in {first}"
        rows.append(row)
    fastest: dict[tuple[str, str], Decoded] = {}
    for r in results:
        if (r.system, r.precision) not in fastest or r.rate > fastest[r.system, r.precision].rate:
            fastest[r.system, r.precision] = r
    sizes = len({r.batch_tokens for r in results}) > 1
    at = (lambda r: f" at {r.batch_tokens:,}") if sizes else (lambda r: "")
    pairs = [(fastest[SYSTEMS[0], r.precision], r) for r in fastest.values() if r.system != SYSTEMS[0]]
    # ours at a precision a peer could not run (CTranslate2 has no fp16 on CPUs): against the peer at the first
    first = results[0].precision
    pairs += [(ours, r) for ours in fastest.values() if ours.system == SYSTEMS[0] and ours.precision != first
              for r in fastest.values() if r.system != SYSTEMS[0] and r.precision == first
              and (r.system, ours.precision) not in fastest]
    summary = "; ".join(f"{r.system} {r.precision}{at(r)}: {_ratio(ours, r)}" if ours.precision == r.precision
                        else f"ours {ours.precision}{at(ours)} against {r.system} {r.precision}{at(r)}: "
                             f"{_ratio(ours, r)}" for ours, r in pairs) or "ours alone"
    return rows, (f"each at its fastest batch size: {summary}" if sizes else summary)


def report(results: list[Decoded], references: list[str] | None = None) -> list[str]:
    """`table` as lines to print."""
    rows, summary = table(results, references)
    return [f"{r['system']:32}{r['precision']:>5}{r['batch tokens']:>7,}{r['target tokens/s']:>10,} target tokens/s"
            f"{r['sentences/s']:>8,.1f} sentences/s  {r['ours / this'] or 'ours':28}  same lines: "
            f"{r['same lines as ours']}" + (f"  BLEU {r['BLEU']:.2f}" if "BLEU" in r else "") for r in rows] + [summary]
