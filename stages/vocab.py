"""Stage 3, vocab: one sentencepiece model learned on both languages of the training text, so the
source, the target and the output projection can share one embedding matrix (paper section 3.4)."""
from __future__ import annotations

import hashlib
import io
import os
import re
from pathlib import Path

import sentencepiece as spm

from stages.io import InputPath, OutputPath, PipelineError, atomic_write, read_lines, read_manifest, require_dir, \
    split_path
from stages.params import SPECIAL_PIECES, VocabParams

# Fixed ids the model relies on: padding is 0, and every sentence ends in EOS.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = range(SPECIAL_PIECES)
MODEL_FILE = "spm.model"


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
    model = io.BytesIO()  # the model written here, not to a file: it then holds no path of its making
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=(line for path in inputs for line in read_lines(path)),  # it holds no input paths either
            model_writer=model,
            model_type=params.model_type,
            vocab_size=params.vocab_size,
            character_coverage=params.character_coverage,
            input_sentence_size=params.input_sentence_size,
            shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            minloglevel=2,
        )
    except RuntimeError as e:  # sentencepiece's own words for what the text and settings cannot give
        if m := re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", str(e)):
            raise PipelineError(
                f"vocab.vocab_size {m.group(1)} is more than the training text supports (at most {m.group(2)})"
            ) from None
        if m := re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", str(e)):
            raise PipelineError(
                f"vocab.vocab_size {m.group(1)} is fewer than the {m.group(2)} pieces the training text's characters "
                f"need at vocab.character_coverage {params.character_coverage:g} (the special pieces included): "
                "raise the one or lower the other") from None
        raise PipelineError(f"vocab: sentencepiece could not learn a vocabulary from "
                            f"{' and '.join(map(str, inputs))}: {e}") from None
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    with atomic_write(out_dir / MODEL_FILE, "wb") as f:
        f.write(model.getvalue())
    with atomic_write(out_dir / "spm.vocab") as f:  # each piece and its score, as sentencepiece writes them
        f.writelines(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    print(f"vocab: wrote {out_dir / MODEL_FILE}, {sp.get_piece_size()} pieces", flush=True)
    return {"vocab_size": sp.get_piece_size()}


def identity(vocab: str | Path | spm.SentencePieceProcessor) -> str:
    """What a model trained on this vocabulary's ids depends on, its pieces and their scores in id order,
    as an md5: the same for the same vocabulary, whatever else its file records."""
    sp = vocab if isinstance(vocab, spm.SentencePieceProcessor) else load(vocab)
    pieces = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i)!r}\n" for i in range(sp.get_piece_size()))
    return hashlib.md5(pieces.encode()).hexdigest()


def load(vocab_dir: str | Path, model: tuple[str | Path, int, str] | None = None) -> spm.SentencePieceProcessor:
    """The vocabulary; with `model` (its file, its vocabulary's size and identity, "" where the file
    predates keeping it), checked to be the one that model was trained on: another's ids come out as
    other words, or out of range."""
    path = Path(vocab_dir) / MODEL_FILE
    if not path.is_file():
        raise PipelineError(f"{path}: no sentencepiece model (has the vocab stage run?)")
    sp = spm.SentencePieceProcessor(model_file=str(path))
    if model is not None:
        model_path, size, trained_on = model
        if sp.get_piece_size() != size or trained_on not in ("", identity(sp)):
            raise PipelineError(f"{model_path} was trained on another vocabulary than {path} ({size} pieces, "
                                f"{path} has {sp.get_piece_size()}): give the vocabulary of the run that trained it")
    return sp
