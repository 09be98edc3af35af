"""Beam-search decoding speed: the decode stage against the same weights in Hugging Face transformers'
MarianMT `generate` and in CTranslate2, in one run.

    python -m bench.decode                                   # the pipeline's model on newstest2014
    python -m bench.decode --model M --vocab-dir V --source S --limit 500
    python -m bench.decode --model M --vocab-dir V --source S --peers ctranslate2   # ours and CTranslate2 only
    python -m bench.decode --model M --vocab-dir V --source S --batch-tokens 4000,16000   # and each at its fastest
    python -m bench.decode --model M --vocab-dir V --source S --limit 1 --repeats 20   # one sentence, as served
    python -m bench.decode --model M --vocab-dir V --source S --batch-tokens 1 --threads 1   # one-thread workers
    python -m bench.decode --train-base multi30k:750 --work W --limit 500   # base size, trained here first: see below

The model is exported with the export stage (so all three hold identical weights), then each system,
in a process of its own as a user runs it (the processes take turns: bench/peers.py), translates the
same source lines with beam 4 on the same device, batched by length, sentences of similar length
together, with the same length penalty (|Y|^alpha, the one all three have) and the same stopping rule
(a sentence is done once 4 hypotheses have ended: `decode.stop: finished`, CTranslate2's default,
transformers' early_stopping=True). Each system's own length limit is the source length + 50 where it
has one (ours; CTranslate2 and transformers take one limit per batch). The figure is target tokens
produced (sentencepiece pieces of the output) per second, over each turn's best of --repeats rounds,
the systems taking short turns of a few batches (a shared machine's speed drifts within a run: bench/peers.py),
with the ratio of ours to each peer and how many output lines are the same; a peer whose lines agree
with ours on fewer than 95% gets no ratio. With a
reference (--reference; by default newstest2014's, or that of --train-base's last corpus) each
system's sacreBLEU is printed too: what --precisions int8 (the decode stage's and CTranslate2's) costs.

--train-base CORPUS:STEPS[,...] measures at the paper's base size: the train stage trains Transformer
base on each corpus in turn for its steps (3,000 target tokens each), each from the weights the one
before ended with, and the last checkpoint is decoded on the last corpus's test set: multi30k
(Multi30k's 29k captions; test2016) or europarl (the 20k Europarl pairs of WMT14's training sample;
newstest2014). One 8,000-piece BPE vocabulary, learned by the vocab stage on both, serves every plan,
so a plan goes on from a shorter one kept in --work (the train stage resumes a run of the same setup,
or finds it done). Random weights would not do: such a model rarely ends a sentence, so each system
stops at a different length limit and tokens/s would compare different work. Steps this small keep
base on its plateau at the paper's rate, so the rate is scaled by 0.12 (3,000 / 25,000 tokens, the
linear scaling rule) over a 250-step warm-up. --train-precision bf16 trains under bf16 autocast
(faster on CPUs with AVX512-BF16). On a GPU, bench.gpu trains base on the Europarl sample at the
paper's step and rate (`--parts decode --work W`), and this bench decodes it on the CPU with --model.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench.common import CORPORA, NEWSTEST, model_config, prepare_corpora, train_params
from bench.peers import CT2_TYPES, PEERS, decode_all, report, table
from bench.results import record

NEWSTEST_SOURCE, NEWSTEST_REFERENCE = Path(f"{NEWSTEST}-src.en.txt"), Path(f"{NEWSTEST}-ref.de.txt")


def trained_base(work: Path, plan: tuple[tuple[str, int], ...], precision: str = "fp32") -> tuple[Path, Path]:
    """Transformer base trained by the train stage on each (corpus, steps) of `plan` in turn, each from the
    weights the one before ended with (in `precision`), and one vocabulary for both shared corpora; the
    text, vocabulary and encoding by the vocab and encode stages (bench.gpu's preparation). A run already
    in `work` is reused (the train stage resumes it, or finds it done)."""
    from stages import train
    from stages.model_files import current_dir, list_checkpoints

    if not all((work / corpus / "encoded").is_dir() for corpus in CORPORA):
        prepare_corpora(work, tuple(CORPORA), vocab_size=8000, limits={"train": 30000, "dev": 500, "test": 3003})
    start = None
    for corpus, steps in plan:
        params = train_params(max_steps=steps, batch_tokens=3000, precision=precision, warmup_steps=250,
                              lr_scale=0.12, log_every=25, checkpoint_every_steps=min(steps, 100))  # stops go on
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
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds over every batch, the systems in turn at each few; each turn's best counts")
    ap.add_argument("--precisions", type=lambda text: tuple(text.split(",")), default=("fp32",),
                    help=f"comma-separated, of {', '.join(CT2_TYPES)} (bf16 and fp16 for GPUs, int8 for CPUs)")
    ap.add_argument("--peers", type=lambda text: tuple(text.split(",")), default=tuple(PEERS),
                    help=f"comma-separated, of {', '.join(PEERS)}: the systems to run beside ours (a long "
                         "transformers run between ours and CTranslate2's leaves time for the machine to drift)")
    ap.add_argument("--threads", type=int, help="threads each system decodes with: torch's and CTranslate2's "
                    "intra-op threads (default: torch's own count, every core); a server of many one-thread "
                    "workers is --threads 1")
    ap.add_argument("--train-base", type=_plan, metavar="CORPUS:STEPS[,...]",
                    help=f"train Transformer base first, on each corpus ({', '.join(sorted(CORPORA))}) in turn "
                         "for its steps, e.g. multi30k:750,europarl:300")
    ap.add_argument("--work", type=Path, help="where --train-base keeps its model (default: a temporary folder)")
    ap.add_argument("--train-precision", choices=("fp32", "bf16"), help="what --train-base trains in (default: "
                    "fp32; bf16 autocast is faster on CPUs with AVX512-BF16)")
    args = ap.parse_args()
    args.train_base_text = ",".join(f"{corpus}:{steps}" for corpus, steps in args.train_base or ())
    if unknown := set(args.precisions) - set(CT2_TYPES):
        ap.error(f"--precisions: unknown {', '.join(sorted(unknown))} (known: {', '.join(CT2_TYPES)})")
    if unknown := set(args.peers) - set(PEERS):
        ap.error(f"--peers: unknown {', '.join(sorted(unknown))} (known: {', '.join(PEERS)})")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, not {args.repeats}")
    every_core = torch.get_num_threads()
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be at least 1, not {args.threads}")
        torch.set_num_threads(args.threads)  # each system's worker takes this count (bench/peers.py: Setup)
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
            args.source, args.reference = NEWSTEST_SOURCE, args.reference or NEWSTEST_REFERENCE
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
    rows, summary = table(results, references)
    model = f"base trained {args.train_base_text}" if args.train_base else args.model.name
    threads = ("" if args.threads in (None, every_core)  # another count's record is kept beside the default's
               else f", {args.threads} thread{'s' * (args.threads > 1)}")
    record("decode", f"{model} {args.source.name} {len(lines)} {','.join(args.precisions)}{threads}",
           f"Beam search, {model}: {len(lines)} sentences of {args.source.name}, beam {args.beam}{threads}", rows,
           summary + "".join(f"; {system}: not measured ({why})" for system, why in unavailable.items()))


if __name__ == "__main__":
    main()
