"""Stage 7, decode: translate the dev and test sources with beam search (paper section 6.1: beam 4,
length penalty alpha 0.6, at most input length + 50 tokens), detokenised, in input order. The decoding
engine is translate/; this stage reads the model and the text and writes the translations."""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from sentencepiece import SentencePieceProcessor

from stages import vocab
from stages.devices import default_device, out_of_memory_stops
from stages.io import InputPath, OutputPath, PipelineError, atomic_write, read_lines, read_manifest, require_dir, \
    split_path
from stages.model_files import ModelMeta, load_weights, read_model
from stages.params import DecodeParams
from stages.progress import Bar
from translate.translator import Translator
from transformer.model import Transformer

SPLITS = ("dev", "test")


def read_transformer(model_path: str | Path) -> Transformer:
    """The model as trained (fp32, on the CPU whatever torch's default device is, in training mode), from an
    averaged model or a checkpoint."""
    return _read(model_path)[0]


def _read(model_path: str | Path) -> tuple[Transformer, ModelMeta]:
    weights, meta = read_model(model_path)
    with torch.device("cpu"):
        model = Transformer(meta.config, meta.vocab_size, vocab.PAD_ID)
    load_weights(model, weights, model_path, "not the model its metadata describes")
    return model, meta


def load_translator(model_path: str | Path, device: torch.device, precision: str = "fp32") -> Translator:
    """A Translator of an averaged model (.safetensors, from the average stage) or a training checkpoint
    (.pt), in decode.precision."""
    return _translator(read_transformer(model_path), device, precision)


def load_with_vocabulary(model_path: str | Path, vocab_dir: str | Path, device: torch.device,
                         precision: str = "fp32") -> tuple[Translator, SentencePieceProcessor]:
    """load_translator's Translator, and the vocabulary in `vocab_dir`, checked first to be the one the
    model was trained on."""
    model, meta = _read(model_path)
    sp = vocab.load(vocab_dir, (model_path, meta.vocab_size, meta.vocab))
    return _translator(model, device, precision), sp


def _translator(model: Transformer, device: torch.device, precision: str) -> Translator:
    try:
        return Translator(model, device, precision, bos_id=vocab.BOS_ID, eos_id=vocab.EOS_ID)
    except ValueError as e:  # a precision this device does not run
        raise PipelineError(f"decode.precision {e}") from None


def translate(translator: Translator, sp, lines: list[str], params: DecodeParams,
              desc: str | None = "decode", normalize: Callable[[str], str] | None = None) -> list[str]:
    """Translate `lines` (text), returned in input order; lines longer than the model's positions are
    cut, with a warning. Progress is shown as `desc`, or not at all with None. Text that is not the
    clean stage's output needs `normalize`, its normalisation (clean.Normalizer): the model has seen
    only normalised text, and a character it has not seen (a curly quote, an en dash) is unknown to it."""
    encoded = sp.encode([normalize(line) for line in lines] if normalize else lines)
    limit = translator.max_input_length
    cut = sum(len(ids) > limit for ids in encoded)
    if cut:
        print(f"warning: {cut} input lines were longer than the model's {limit} positions and were "
              f"cut to that many tokens before translating", file=sys.stderr)
    fewer = (f"a batch holds up to decode.batch_tokens {params.batch_tokens} source tokens, each sentence searched "
             f"with {params.beam_size} beams; -S decode.batch_tokens={max(params.batch_tokens // 2, 1)} takes half as "
             f"many at a time")
    with Bar(total=len(lines), desc=desc, unit=" sentences", mininterval=2, file=sys.stderr,
             disable=desc is None) as bar, \
            out_of_memory_stops(torch.device(translator.device), lambda: desc or "translating", lambda: fewer):
        found = translator.translate_batch(
            encoded, beam_size=params.beam_size, length_penalty=params.length_penalty,
            length_penalty_formula=params.length_penalty_formula, stop=params.stop,
            max_length_extra=params.max_length_extra, batch_tokens=params.batch_tokens, progress=bar.update)
    return [sp.decode(ids) if ids else "" for ids in found]


def run(params: DecodeParams, *, model_path: InputPath, vocab_dir: InputPath, clean_dir: InputPath,
        out_dir: OutputPath) -> dict[str, float]:
    clean_dir = require_dir(clean_dir, "clean text (clean stage output)")
    src_lang, tgt_lang = read_manifest(clean_dir)
    translator, sp = load_with_vocabulary(model_path, vocab_dir, default_device(), params.precision)
    metrics: dict[str, float] = {}
    for split in SPLITS:
        lines = list(read_lines(split_path(clean_dir, split, src_lang)))
        hyps = translate(translator, sp, lines, params, desc=f"decode {split}")
        with atomic_write(split_path(out_dir, split, tgt_lang)) as f:
            f.writelines(h + "\n" for h in hyps)
        metrics[f"{split}_sentences"] = len(hyps)
    return metrics
