"""Beam-search decoding speed: the decode stage against the same weights in Hugging Face transformers'
MarianMT `generate` and in CTranslate2, in one run.

    python -m bench.decode                                   # the pipeline's model on newstest2014
    python -m bench.decode --model M --vocab-dir V --source S --limit 500
    python -m bench.decode --model M --vocab-dir V --source S --peers ctranslate2   # ours and CTranslate2 only
    python -m bench.decode --model M --vocab-dir V --source S --batch-tokens 4000,16000   # and each at its fastest
    python -m bench.decode --train-base multi30k:750 --work W --limit 500   # base size, trained here first: see below

The model is exported with the export stage (so all three hold identical weights), then each system,
in a process of its own as a user runs it (the processes take turns), translates the same source
lines with beam 4 on the same device, batched by length, sentences of similar length together, with
the same length penalty (|Y|^alpha, the one all three have) and the same stopping rule (a sentence
is done once 4 hypotheses have ended: `decode.stop: finished`, CTranslate2's default, transformers'
early_stopping=True). Each system's own length limit is the source length + 50
where it has one (ours; CTranslate2 and transformers take one limit per batch). The figure is target
tokens produced (sentencepiece pieces of the output) per second, the best of --repeats runs taken in
turn (this machine's speed drifts by 10-20% between runs), with the ratio of ours to each peer and how
many output lines are the same; a peer whose lines agree with ours on fewer than 95% gets no ratio.
With a reference (--reference; by default newstest2014's, or that of --train-base's last corpus) each system's
sacreBLEU is printed too: what --precisions int8 (the decode stage's and CTranslate2's) costs.

--train-base CORPUS:STEPS[,...] measures at the paper's base size: the train stage trains Transformer base
on each corpus in turn for its steps (3,000 target tokens each, the small Multi30k preset's step), each
from the weights the one before ended with, and the last checkpoint is decoded on the last corpus's test
set: multi30k (Multi30k's 29k captions; test2016) or europarl (the 20k Europarl pairs of WMT14's training
sample; newstest2014). One 8,000-piece BPE vocabulary, learned by the vocab stage on both, serves every
plan, so a plan goes on from a shorter one kept in --work (the train stage resumes a run of the same
setup, or finds it done). Random weights would not do: such a model rarely ends a sentence, so each
system stops at a different length limit and tokens/s would compare different work. At the paper's
rate, base stays on its plateau at steps this small: 1,500 tokens, warm-up 600: loss 6.39 after 400
steps; 3,000 tokens, warm-up 800: 6.12 after 300 (11 of the first 12 test2016 outputs run to their
length limit), falling until the rate passed about 4e-4 and no further. So the rate is scaled by 0.12
(`train.lr_scale`: 3,000 / 25,000 tokens, the linear scaling rule) over a 250-step warm-up, peaking at
3.4e-4: on Multi30k (with a vocabulary of its own, in fp32) the loss was 5.64 after 300 steps, 5.06
after 500 and 4.59 after 750 (about 100 minutes on 2 cores), when the outputs agreed on 96.6% of the
first 500 test2016 lines (90.0% after 500 steps): the rest never end, and there the systems' length
limits differ (see README, "Speed"). --train-precision bf16 trains under bf16 autocast: on this Zen 4
CPU (AVX512-BF16) base ran at 766 target tokens/s against 467 in fp32 (6 steps each on the Europarl
sample, one-off). From random weights on europarl alone base does not get there in CPU time: in a
one-off run (then with a vocabulary of its own) at rate x0.06 in bf16, the loss was 7.08 after 400
steps and 7.00 after 500 (35 minutes), barely under a unigram model's 7.3 with label smoothing, and 26
then 30 of the first 30 newstest2014 outputs ran to their length limit (x0.12 in fp32: 7.24 after 350).
Nor from the Multi30k model: multi30k:750,europarl:300 in bf16 (2026-11-26, one run) took the loss on
Europarl from 7.58 after 25 steps to 6.40 after 300 (20 minutes), faster than from random weights but
not far enough: ours and CTranslate2 agreed on 58.6% of 500 newstest2014 lines (BLEU 0.04), so the bench
gave no ratio. On a GPU, bench.gpu trains base on that sample at the paper's 25k-token step and rate
(`--parts decode --work W`), and this bench decodes it on the CPU with --model: on an H200 machine's
Xeon, 8 threads, 150 newstest2014 lines, ours 1.12x CTranslate2 and 11.52x transformers with 97.3% of
lines the same (README, "Speed").
"""
from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench import SHARED
from bench.gpu import CORPORA
from stages import export, vocab
from stages.decode import DTYPES, DecodeParams, length_batches, load_translator, translate
from stages.devices import default_device

NEWSTEST = SHARED / "wmt14/newstest2014-full/newstest2014-deen-src.en.txt"
NEWSTEST_REF = SHARED / "wmt14/newstest2014-full/newstest2014-deen-ref.de.txt"
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

    Each system runs in a process of its own, as a user runs it: two of them in one process share
    its allocator settings and bring two OpenMP runtimes (one-off, base on 500 test2016 lines: ours
    25.3 s alone, 27.9 s after CTranslate2 in the same process). The processes take turns, one
    translating at a time, every system at every batch size in each round."""
    marian_dir = export.to_marian(model_path, vocab_dir, tmp / "marian")
    ct2_dir = export.to_ctranslate2(marian_dir, tmp / "ct2")
    sp = vocab.load(vocab_dir)
    results, unavailable = [], {}
    for precision in precisions:
        with ExitStack() as stack:
            # lines[:8] warm each worker up: first calls, kernels chosen, caches filled
            workers = {size: stack.enter_context(_Workers(
                Setup(model_path, vocab_dir, marian_dir, ct2_dir, beam, size, torch.get_num_threads()),
                precision, lines[:8], (SYSTEMS[0], *peers))) for size in batch_sizes}
            for size_workers in workers.values():
                unavailable |= {f"{name} {precision}": why for name, why in size_workers.unavailable.items()}
            best, outputs = {}, {}
            for _ in range(repeats):  # in turn, so a slow spell of the machine does not fall on one system only
                for size, size_workers in workers.items():
                    for name in size_workers.ready:
                        seconds, outputs[name, size] = size_workers.translate(name, lines)
                        best[name, size] = min(best.get((name, size), float("inf")), seconds)
        results += [Decoded(name, precision, size, seconds, sum(len(ids) for ids in sp.encode(outputs[name, size])),
                            outputs[name, size]) for (name, size), seconds in best.items()]
    return results, unavailable


class _Workers:
    """One process per system, each loading its system and answering translation requests with
    (seconds, output lines); a system that cannot load here says why instead."""

    def __init__(self, setup: Setup, precision: str, warm_up: list[str], systems: tuple[str, ...]) -> None:
        context = multiprocessing.get_context("spawn")  # no state of this process is inherited
        self.connections, self.processes, self.ready, self.unavailable = {}, [], [], {}
        for name in systems:
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs, name, precision, setup, warm_up), daemon=True)
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


def _serve(connection, name: str, precision: str, setup: Setup, warm_up: list[str]) -> None:
    """A worker process: load one system, warm it up, then time each list of lines it is sent."""
    torch.set_num_threads(setup.threads)
    work = _load(name, precision, setup)
    if isinstance(work, str):
        connection.send(work)
        return
    work(warm_up)
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
        return lambda some: translate(ours, sp, some, params, "ours")
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


def report(results: list[Decoded], references: list[str] | None = None) -> list[str]:
    """Each system's rate, ours against it at the same precision and batch size, and the share of
    output lines identical to ours; with references, each system's sacreBLEU (what a lower precision
    costs). With several batch sizes, then each system at its fastest one against ours at its own."""
    import sacrebleu

    sizes = len({r.batch_tokens for r in results}) > 1
    rows = []
    for r in results:
        ours = next(o for o in results if (o.system, o.precision, o.batch_tokens) ==
                    (SYSTEMS[0], r.precision, r.batch_tokens))
        bleu = f"  BLEU {sacrebleu.corpus_bleu(r.lines, [references]).score:.2f}" if references else ""
        first = results[0].precision  # ours at a later precision: how many lines that precision changed
        if r is ours and r.precision != first:
            ours_first = next(o for o in results if (o.precision, o.batch_tokens, o.system) ==
                              (first, r.batch_tokens, r.system))
            bleu += f"  same lines as ours {first}: {_same(ours_first.lines, r.lines):.1%}"
        size = f"{r.batch_tokens:>7,}" if sizes else ""
        rows.append(f"{r.system:32}{r.precision:>5}{size}{r.rate:>10,.0f} target tokens/s"
                    f"{len(r.lines) / r.seconds:>8,.1f} sentences/s  ({r.tokens} tokens)  {_ratio(ours, r)}"
                    f"  same lines: {_same(ours.lines, r.lines):.1%}{bleu}")
    if sizes:
        rows.append("each at its fastest batch size (source tokens):")
        fastest: dict[tuple[str, str], Decoded] = {}
        for r in results:
            if (r.system, r.precision) not in fastest or r.rate > fastest[r.system, r.precision].rate:
                fastest[r.system, r.precision] = r
        for r in fastest.values():
            rows.append(f"{r.system:32}{r.precision:>5}{r.batch_tokens:>7,}{r.rate:>10,.0f} target tokens/s  "
                        f"{_ratio(fastest[SYSTEMS[0], r.precision], r)}")
    return rows


def trained_base(work: Path, plan: tuple[tuple[str, int], ...], precision: str = "fp32") -> tuple[Path, Path]:
    """Transformer base trained by the train stage on each (corpus, steps) of `plan` in turn, each from the
    weights the one before ended with (in `precision`), and one vocabulary for both shared corpora; the
    text, vocabulary and encoding by the vocab and encode stages (bench.gpu's preparation). A run already
    in `work` is reused (the train stage resumes it, or finds it done)."""
    from bench.gpu import FULL, model_config, prepare_corpora, train_params
    from stages import train
    from stages.model_files import current_dir, list_checkpoints

    sizes = replace(FULL, train_lines=30000, vocab_size=8000, batch_tokens=3000, decode_lines=3003)
    if not all((work / corpus / "encoded").is_dir() for corpus in CORPORA):
        prepare_corpora(sizes, work, tuple(CORPORA))
    start = None
    for corpus, steps in plan:
        params = train_params(sizes, max_steps=steps, precision=precision, warmup_steps=250, lr_scale=0.12,
                              log_every=25, checkpoint_every_steps=min(steps, 100))  # a stopped run goes on
        # its folder is named by its setup, the weights it starts from included: each plan keeps its own
        train.run(model_config("base"), params, encoded_dir=work / corpus / "encoded", vocab_dir=work / "vocab",
                  checkpoint_dir=work / corpus / "checkpoints", plots_dir=work / corpus / "plots",
                  init_weights=start)
        start = list_checkpoints(current_dir(work / corpus / "checkpoints"))[-1][1]
    assert start is not None
    return start, work / "vocab"


def _plan(text: str) -> tuple[tuple[str, int], ...]:
    """--train-base: CORPUS:STEPS, comma-separated, trained in that order."""
    plan = []
    for part in text.split(","):
        corpus, _, steps = part.partition(":")
        if corpus not in CORPORA or not steps.isdigit() or int(steps) < 1:
            raise argparse.ArgumentTypeError(f"CORPUS:STEPS, comma-separated, each corpus one of "
                                             f"{', '.join(sorted(CORPORA))} and at least 1 step: not {part!r}")
        plan.append((corpus, int(steps)))
    return tuple(plan)


def _batch_sizes(text: str) -> tuple[int, ...]:
    """--batch-tokens: one or more whole numbers of source tokens, comma-separated, each once."""
    try:
        sizes = tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated numbers of tokens (e.g. 4000,16000), not {text!r}") from None
    if min(sizes) < 1 or len(set(sizes)) < len(sizes):
        raise argparse.ArgumentTypeError(f"each size at least 1 token and given once, not {text!r}")
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("models/averaged.safetensors"))
    ap.add_argument("--vocab-dir", type=Path, default=Path("data/vocab"))
    ap.add_argument("--source", type=Path, help="source lines to translate (default: newstest2014, or with "
                    "--train-base the test set of --corpus)")
    ap.add_argument("--reference", type=Path, help="translations of --source to score each system's output "
                    "against with sacreBLEU (default: the reference of the default source)")
    ap.add_argument("--limit", type=int, default=0, help="first N lines only (0: all)")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--batch-tokens", type=_batch_sizes, default=(8000,),
                    help="source tokens per batch, padding included; comma-separated for several: each system "
                         "runs at each (a worker process per system and size, all loaded at once), and the "
                         "report adds each at its fastest")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each system, taken in turn; the best counts")
    ap.add_argument("--precisions", type=lambda text: tuple(text.split(",")), default=("fp32",),
                    help=f"comma-separated, of {', '.join(CT2_TYPES)} (bf16 and fp16 for GPUs, int8 for CPUs)")
    ap.add_argument("--peers", type=lambda text: tuple(text.split(",")), default=tuple(PEERS),
                    help=f"comma-separated, of {', '.join(PEERS)}: the systems to run beside ours (a long "
                         "transformers run between ours and CTranslate2's leaves time for the machine to drift)")
    ap.add_argument("--train-base", type=_plan, metavar="CORPUS:STEPS[,...]",
                    help=f"train Transformer base first, on each corpus ({', '.join(sorted(CORPORA))}) in turn "
                         "for its steps, e.g. multi30k:750,europarl:300")
    ap.add_argument("--work", type=Path, help="where --train-base keeps its model (default: a temporary folder)")
    ap.add_argument("--train-precision", choices=("fp32", "bf16"), help="what --train-base trains in (default: "
                    "fp32; bf16 autocast took base 1.6x the tokens/s on this Zen 4 CPU, which has AVX512-BF16)")
    args = ap.parse_args()
    if unknown := set(args.precisions) - set(CT2_TYPES):
        ap.error(f"--precisions: unknown {', '.join(sorted(unknown))} (known: {', '.join(CT2_TYPES)})")
    if unknown := set(args.peers) - set(PEERS):
        ap.error(f"--peers: unknown {', '.join(sorted(unknown))} (known: {', '.join(PEERS)})")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, not {args.repeats}")
    if args.work and args.train_base is None:
        ap.error("--work is where --train-base keeps its model: give --train-base too")
    if args.train_precision and args.train_base is None:
        ap.error("--train-precision is for --train-base's training: give --train-base too")
    with tempfile.TemporaryDirectory() as tmp:
        if args.train_base is not None:
            args.model, args.vocab_dir = trained_base(args.work or Path(tmp), args.train_base,
                                                       args.train_precision or "fp32")
            if args.source is None:
                test = CORPORA[args.train_base[-1][0]]["test"]
                args.source, args.reference = Path(test["en"]), args.reference or Path(test["de"])
        if args.source is None:
            args.source, args.reference = NEWSTEST, args.reference or NEWSTEST_REF
        for name, path in (("--source", args.source), ("--reference", args.reference)):
            if path is not None and not path.is_file():
                ap.error(f"{name} {path}: file not found")
        lines = args.source.read_text(encoding="utf-8").splitlines()[: args.limit or None]
        references = args.reference.read_text(encoding="utf-8").splitlines()[: len(lines)] if args.reference else None
        if references is not None and len(references) != len(lines):
            ap.error(f"--reference {args.reference}: {len(references)} lines for {len(lines)} source lines")
        results, unavailable = decode_all(args.model, args.vocab_dir, lines, args.beam, args.batch_tokens,
                                          args.precisions, Path(tmp), args.repeats,
                                          tuple(PEERS[name] for name in PEERS if name in args.peers))
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu, {torch.get_num_threads()} threads"
    print(f"{len(lines)} sentences of {args.source.name}, beam {args.beam}, {where}")
    print("\n".join(report(results, references)))
    for system, why in unavailable.items():
        print(f"{system}: not measured ({why})")


if __name__ == "__main__":
    main()
