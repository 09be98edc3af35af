"""Stage 8, score: three figures per decoded split against its untouched reference, each named by
its variant so nobody compares the wrong numbers.

- `bleu`: sacreBLEU, detokenised, cased, its 13a tokenizer by default, with the signature that says
  exactly what was measured. The figure to compare with other systems.
- `bleu_tok`: the paper's kind of BLEU (tensor2tensor's get_ende_bleu.sh): both sides Moses-tokenised,
  hyphenated compounds split as `a ##AT##-##AT## b`, BLEU over those tokens (multi-bleu.perl's
  arithmetic). The figure to compare with the paper's 27.3 / 28.4; it runs higher than `bleu`.
- `bleu_lc_tok`: BLEU over lowercased, then Moses-tokenised text (no compound splitting), what published
  Multi30k results quote (fairseq's BLEU on lowercased, tokenised captions: test2016's reference comes
  to their 12,103 tokens); it runs higher still.
- `chrf`: sacreBLEU's chrF.

`bleu`, `bleu_tok` and `chrf` are cased unless `score.lowercase` (a model trained on lowercased text,
`clean.lowercase`, has no casing to be scored on); each signature says which.
"""
from __future__ import annotations

import re

from sacrebleu.metrics import BLEU, CHRF
from sacremoses import MosesTokenizer

from stages.io import InputPath, PipelineError, read_lines, read_manifest, require_dir, split_path
from stages.params import ScoreParams

SPLITS = ("dev", "test")
COMPOUND = re.compile(r"(\S)-(\S)")
BLEU_TOK_VARIANT = "moses-tokenized|compound-split:##AT##|case:{case}|multi-bleu"
BLEU_LC_TOK_VARIANT = "moses-tokenized|case:lower|multi-bleu"


def moses_tokenize(lines: list[str], lang: str) -> list[str]:
    tok = MosesTokenizer(lang=lang)
    return [tok.tokenize(line, return_str=True, escape=False) for line in lines]


def split_compounds(tokenized: list[str]) -> list[str]:
    """get_ende_bleu.sh's compound splitting of Moses-tokenised lines."""
    # one pass, as the script's perl s{(\S)-(\S)}{...}g: in "3-4-mal" only the first hyphen splits
    return [COMPOUND.sub(r"\1 ##AT##-##AT## \2", text) for text in tokenized]


def paper_tokenize(lines: list[str], lang: str) -> list[str]:
    """Moses tokenisation and compound splitting as in tensor2tensor's get_ende_bleu.sh."""
    return split_compounds(moses_tokenize(lines, lang))


def score(params: ScoreParams, hypotheses: list[str], references: list[str], *, hyp_name: str,
          ref_name: str, lang: str) -> dict[str, float | str]:
    if not hypotheses:
        raise PipelineError(f"{hyp_name}: the file is empty; nothing to score")
    if len(hypotheses) != len(references):
        raise PipelineError(f"{hyp_name} has {len(hypotheses)} lines but {ref_name} has {len(references)}")
    bleu = BLEU(tokenize=params.tokenize, lowercase=params.lowercase)
    tokenized = BLEU(tokenize="none", force=True)
    chrf = CHRF(lowercase=params.lowercase)
    hyp_tok, ref_tok = (moses_tokenize([line.lower() for line in lines], lang) for lines in (hypotheses, references))
    # under score.lowercase the paper's tokens are the lowercased ones, compounds split: tokenised once
    hyp_paper, ref_paper = (split_compounds(tokens) if params.lowercase else paper_tokenize(lines, lang)
                            for tokens, lines in ((hyp_tok, hypotheses), (ref_tok, references)))
    return {
        "bleu": bleu.corpus_score(hypotheses, [references]).score,
        "bleu_signature": str(bleu.get_signature()),
        "bleu_tok": tokenized.corpus_score(hyp_paper, [ref_paper]).score,
        "bleu_tok_signature": BLEU_TOK_VARIANT.format(case="lower" if params.lowercase else "mixed"),
        "bleu_lc_tok": tokenized.corpus_score(hyp_tok, [ref_tok]).score,
        "bleu_lc_tok_signature": BLEU_LC_TOK_VARIANT,
        "chrf": chrf.corpus_score(hypotheses, [references]).score,
        "chrf_signature": str(chrf.get_signature()),
    }


def run(params: ScoreParams, *, hyp_dir: InputPath, ref_dir: InputPath) -> dict[str, dict[str, float | str]]:
    """Scores per split; references come from the download stage's output, never cleaned."""
    hyp_dir, ref_dir = require_dir(hyp_dir, "translations (decode stage output)"), require_dir(ref_dir, "reference")
    _, tgt_lang = read_manifest(ref_dir)
    results = {}
    for split in SPLITS:
        hyp_path, ref_path = split_path(hyp_dir, split, tgt_lang), split_path(ref_dir, split, tgt_lang)
        results[split] = r = score(params, list(read_lines(hyp_path)), list(read_lines(ref_path)),
                                   hyp_name=str(hyp_path), ref_name=str(ref_path), lang=tgt_lang)
        print(f"score: {split}: sacreBLEU {r['bleu']:.2f}, the paper's tokenised BLEU {r['bleu_tok']:.2f}, "
              f"lowercased tokenised {r['bleu_lc_tok']:.2f}, chrF {r['chrf']:.2f}  ({r['bleu_signature']})",
              flush=True)
    return results
