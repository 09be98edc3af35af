"""Stage 3, vocab: one sentencepiece model learned on both languages of the training text, so the
source, the target and the output projection can share one embedding matrix (paper section 3.4)."""
from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import sentencepiece as spm

from stages.io import InputPath, OutputPath, PipelineError, check, read_manifest, require_dir, split_path

# Fixed ids the model relies on: padding is 0, and every sentence ends in EOS.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
MODEL_FILE = "spm.model"


@dataclass(frozen=True)
class VocabParams:
    model_type: Literal["bpe", "unigram"]  # bpe: the paper's en-de; unigram: word-piece style, its en-fr
    vocab_size: int
    character_coverage: float
    input_sentence_size: int  # lines sampled (per run, both languages together) to learn from; 0: all
    seed: int

    def __post_init__(self) -> None:
        check(self.vocab_size > EOS_ID + 1, "vocab_size",
              f"must exceed the {EOS_ID + 1} special pieces, not {self.vocab_size}")
        check(0 < self.character_coverage <= 1, "character_coverage",
              f"is a fraction of characters, in (0, 1], not {self.character_coverage}")
        check(self.input_sentence_size >= 0, "input_sentence_size",
              f"must be 0 (all) or more, not {self.input_sentence_size}")
        check(self.seed >= 0, "seed", f"must be 0 or more, not {self.seed}")


def run(params: VocabParams, *, clean_dir: InputPath, out_dir: OutputPath) -> dict[str, int]:
    clean_dir = require_dir(clean_dir, "clean text (clean stage output)")
    src_lang, tgt_lang = read_manifest(clean_dir)
    inputs = [split_path(clean_dir, "train", lang) for lang in (src_lang, tgt_lang)]
    if all(p.stat().st_size == 0 for p in inputs):
        raise PipelineError(f"vocab: the training text in {clean_dir} is empty; nothing to learn a vocabulary from")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"vocab: learning a {params.vocab_size}-piece {params.model_type} vocabulary from "
          f"{' and '.join(str(p) for p in inputs)} (sentencepiece, {os.cpu_count() or 1} threads)", flush=True)
    spm.set_random_generator_seed(params.seed)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        try:
            spm.SentencePieceTrainer.train(
                input=[str(p) for p in inputs],
                model_prefix=str(Path(tmp) / "spm"),
                model_type=params.model_type,
                vocab_size=params.vocab_size,
                character_coverage=params.character_coverage,
                input_sentence_size=params.input_sentence_size,
                shuffle_input_sentence=True,
                num_threads=os.cpu_count() or 1,
                pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                minloglevel=2,
            )
        except RuntimeError as e:
            if m := re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", str(e)):
                raise PipelineError(
                    f"vocab.vocab_size {m.group(1)} is more than the training text supports (at most {m.group(2)})"
                ) from None
            raise
        for name in (MODEL_FILE, "spm.vocab"):
            os.replace(Path(tmp) / name, out_dir / name)
    size = spm.SentencePieceProcessor(model_file=str(out_dir / MODEL_FILE)).get_piece_size()
    print(f"vocab: wrote {out_dir / MODEL_FILE}, {size} pieces", flush=True)
    return {"vocab_size": size}


def load(vocab_dir: str | Path) -> spm.SentencePieceProcessor:
    path = Path(vocab_dir) / MODEL_FILE
    if not path.is_file():
        raise PipelineError(f"{path}: no sentencepiece model (has the vocab stage run?)")
    return spm.SentencePieceProcessor(model_file=str(path))
