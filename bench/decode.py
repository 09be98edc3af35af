"""Beam-search decoding speed: the decode stage against the same weights in Hugging Face transformers'
MarianMT `generate` and in CTranslate2, in one run.

    python -m bench.decode                                   # the pipeline's model on newstest2014
    python -m bench.decode --model M --vocab-dir V --source S --limit 500
    python -m bench.decode --random-base --limit 100         # no trained model at hand: see below

The model is exported with the export stage (so all three hold identical weights), then each system
translates the same source lines with beam 4 on the same device, batched by length, sentences of
similar length together. Each system's own length limit is the source length + 50 where it has one
(ours; CTranslate2 and transformers take one limit per batch). The figure is target tokens produced
(sentencepiece pieces, EOS excluded) per second, with the ratio of ours to each peer.

--random-base measures at the paper's base size without a trained model: Transformer base with
seeded random weights over a 8000-piece BPE vocabulary learned on the spot from the shared WMT14
training samples. Such a model rarely ends a sentence, so every system decodes to its length limit:
the same work per token as a trained model, on longer outputs.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from stages import export, vocab
from stages.decode import DecodeParams, load_translator, translate
from stages.devices import default_device
from stages.model_files import ModelMeta, write_model
from transformer import Transformer, TransformerConfig
from bench import SHARED

NEWSTEST = SHARED / "wmt14/newstest2014-full/newstest2014-deen-src.en.txt"


def length_batches(lines: list[list[int]], batch_tokens: int) -> list[list[int]]:
    """Indices grouped as the decode stage groups them: sorted by length, within a token budget."""
    order = sorted(range(len(lines)), key=lambda i: len(lines[i]))
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * (len(lines[i]) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


def random_base(tmp: Path) -> tuple[Path, Path]:
    """A base-size model with random weights and a vocabulary learned from the shared samples."""
    import sentencepiece as spm

    text = tmp / "train.txt"
    stem = SHARED / "wmt14/train-sample/hf-europarl-20k/train"
    text.write_text("".join(Path(f"{stem}.{lang}").read_text(encoding="utf-8") for lang in ("en", "de")),
                    encoding="utf-8")
    (tmp / "vocab").mkdir()
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp / "vocab/spm"), vocab_size=8000,
                                   model_type="bpe", pad_id=vocab.PAD_ID, unk_id=vocab.UNK_ID, bos_id=vocab.BOS_ID,
                                   eos_id=vocab.EOS_ID, minloglevel=2)
    torch.manual_seed(0)
    config = TransformerConfig(512, 8, 2048, 6, 6, 0.1, 0.0, "post", "sinusoidal", 1024)
    model = Transformer(config, 8000, vocab.PAD_ID)
    write_model(tmp / "model.safetensors", model.state_dict(), ModelMeta(config, 8000, steps=(0,)))
    return tmp / "model.safetensors", tmp / "vocab"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("models/averaged.safetensors"))
    ap.add_argument("--vocab-dir", type=Path, default=Path("data/vocab"))
    ap.add_argument("--source", type=Path, default=NEWSTEST)
    ap.add_argument("--limit", type=int, default=0, help="first N lines only (0: all)")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, default=8000)
    ap.add_argument("--random-base", action="store_true", help="a base-size model with random weights")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_base:
            args.model, args.vocab_dir = random_base(Path(tmp))
        measure(args)


def measure(args: argparse.Namespace) -> None:
    device = default_device()
    lines = args.source.read_text(encoding="utf-8").splitlines()[: args.limit or None]
    sp = vocab.load(args.vocab_dir)
    pieces = [sp.encode(line) for line in lines]
    batches = length_batches(pieces, args.batch_tokens)
    threads = torch.get_num_threads()
    results: dict[str, tuple[float, int]] = {}

    model = load_translator(args.model, device)
    params = DecodeParams(beam_size=args.beam, length_penalty=0.6, length_penalty_formula="gnmt",
                          max_length_extra=50, batch_tokens=args.batch_tokens)
    translate(model, sp, lines[:8], params, desc="warm-up")
    start = time.perf_counter()
    ours = translate(model, sp, lines, params, desc="ours")
    results["ours (decode stage)"] = (time.perf_counter() - start, sum(len(sp.encode(h)) for h in ours))

    with tempfile.TemporaryDirectory() as tmp:
        marian_dir = export.to_marian(args.model, args.vocab_dir, Path(tmp) / "marian")
        ct2_dir = export.to_ctranslate2(marian_dir, Path(tmp) / "ct2")

        import ctranslate2
        from transformers import MarianMTModel, MarianTokenizer

        hf = MarianMTModel.from_pretrained(marian_dir).to(device).eval()
        tokenizer = MarianTokenizer.from_pretrained(marian_dir)
        produced, start = 0, time.perf_counter()
        with torch.no_grad():
            for batch in batches:
                inputs = tokenizer([lines[i] for i in batch], return_tensors="pt", padding=True).to(device)
                out = hf.generate(**inputs, num_beams=args.beam, length_penalty=0.6, do_sample=False,
                                  max_new_tokens=inputs["input_ids"].size(1) + 50)
                produced += int((out[:, 1:] > vocab.EOS_ID).sum())
        results["transformers MarianMT generate"] = (time.perf_counter() - start, produced)

        translator = ctranslate2.Translator(str(ct2_dir), device=device.type, intra_threads=threads)
        produced, start = 0, time.perf_counter()
        for batch in batches:
            source = [sp.encode(lines[i], out_type=str) + ["</s>"] for i in batch]
            out = translator.translate_batch(source, beam_size=args.beam, length_penalty=0.6,
                                             max_decoding_length=max(map(len, source)) + 50)
            produced += sum(len(r.hypotheses[0]) for r in out)
        results["CTranslate2"] = (time.perf_counter() - start, produced)

    where = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu, {threads} threads"
    print(f"{len(lines)} sentences of {args.source.name}, beam {args.beam}, {where}, fp32")
    ours_rate = results["ours (decode stage)"][1] / results["ours (decode stage)"][0]
    for name, (seconds, tokens) in results.items():
        rate = tokens / seconds
        print(f"{name:34}{rate:>10,.0f} target tokens/s  {len(lines) / seconds:>8,.1f} sentences/s  "
              f"({tokens} tokens)  ours / this: {ours_rate / rate:.2f}x")


if __name__ == "__main__":
    main()
