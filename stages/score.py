"""Stage 8, score: sacreBLEU (cased, 13a tokenizer by default) and chrF of each decoded split against
its untouched reference, each with the sacreBLEU signature that says exactly what was measured."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sacrebleu.metrics import BLEU, CHRF

from stages.io import PipelineError, read_lines, read_manifest, require_dir, split_path

SPLITS = ("dev", "test")


@dataclass(frozen=True)
class ScoreParams:
    tokenize: str  # sacreBLEU tokenizer: 13a (its default), intl, none, ...
    lowercase: bool


def score(params: ScoreParams, hypotheses: list[str], references: list[str], *, hyp_name: str,
          ref_name: str) -> dict[str, float | str]:
    if not hypotheses:
        raise PipelineError(f"{hyp_name}: the file is empty; nothing to score")
    if len(hypotheses) != len(references):
        raise PipelineError(f"{hyp_name} has {len(hypotheses)} lines but {ref_name} has {len(references)}")
    bleu = BLEU(tokenize=params.tokenize, lowercase=params.lowercase)
    chrf = CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return {"bleu": b.score, "bleu_signature": str(bleu.get_signature()), "chrf": c.score,
            "chrf_signature": str(chrf.get_signature())}


def run(params: ScoreParams, *, hyp_dir: str | Path, ref_dir: str | Path) -> dict[str, dict[str, float | str]]:
    """Scores per split; references come from the download stage's output, never cleaned."""
    hyp_dir, ref_dir = require_dir(hyp_dir, "translations (decode stage output)"), require_dir(ref_dir, "reference")
    _, tgt_lang = read_manifest(ref_dir)
    results = {}
    for split in SPLITS:
        hyp_path, ref_path = split_path(hyp_dir, split, tgt_lang), split_path(ref_dir, split, tgt_lang)
        results[split] = score(params, list(read_lines(hyp_path)), list(read_lines(ref_path)),
                               hyp_name=str(hyp_path), ref_name=str(ref_path))
    return results
