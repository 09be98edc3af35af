"""Every stage's parameters: the sections of params.yaml as frozen, typed classes, each checking its
values when it is made (ValueError(key, message), which pipeline/config.py reports at that key's line).
Nothing here imports torch, so reading params.yaml costs no more than YAML and these checks."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import PurePath
from typing import Literal, get_args

from sacrebleu.metrics import BLEU

from stages import multi30k, wmt14
from stages.io import ParallelFiles, check

SPECIAL_PIECES = 4  # padding, unknown, BOS and EOS: the vocabulary's first ids (stages/vocab.py)
Precision = Literal["fp32", "bf16", "fp16", "int8"]  # of decoding; int8: CPUs only (translate/cpu.py)


@dataclass(frozen=True)
class Wmt14Source:
    corpora: tuple[str, ...]  # training corpora, concatenated in this order
    test: Literal["full", "filtered"]  # newstest2014 as sacreBLEU's wmt14/full (3003, the paper's) or wmt14
    mirrors: tuple[str, ...]  # base addresses tried in order before statmt.org's own
    archive_dir: str  # archives are kept (and verified) here between runs

    def __post_init__(self) -> None:
        check(bool(self.corpora), "corpora", "names no training corpus")
        unknown = [c for c in self.corpora if c not in wmt14.TRAINING_ARCHIVES]
        check(not unknown, "corpora", f"unknown corpus {', '.join(map(repr, unknown))} "
                                      f"(known: {', '.join(wmt14.TRAINING_ARCHIVES)})")
        _check_mirrors(self.mirrors)


@dataclass(frozen=True)
class Multi30kSource:
    mirrors: tuple[str, ...]  # base addresses tried in order before the dataset's own repository
    archive_dir: str  # the gzipped files are kept (and verified) here between runs

    def __post_init__(self) -> None:
        _check_mirrors(self.mirrors)


def _check_mirrors(mirrors: tuple[str, ...]) -> None:
    bad = [m for m in mirrors if not m.startswith(("http://", "https://"))]
    check(not bad, "mirrors", f"{', '.join(map(repr, bad))} is not an http:// or https:// address")


@dataclass(frozen=True)
class LocalSource:
    dir: str  # the directory the files below are relative to
    train: tuple[ParallelFiles, ...]  # concatenated in this order
    dev: ParallelFiles
    test: ParallelFiles


@dataclass(frozen=True)
class DownloadParams:
    source: Literal["wmt14", "multi30k", "local"]
    src_lang: str
    tgt_lang: str
    wmt14: Wmt14Source
    multi30k: Multi30kSource
    local: LocalSource

    def __post_init__(self) -> None:
        check(bool(self.src_lang) and self.src_lang != self.tgt_lang, "tgt_lang",
              f"must differ from src_lang, not also '{self.src_lang}'")
        if self.source == "wmt14":
            check(self.src_lang == "en" and self.tgt_lang in wmt14.PAPER_CORPORA, "tgt_lang",
                  f"wmt14 has en-de and en-fr, not {self.src_lang}-{self.tgt_lang}")
            other = [c for c in self.wmt14.corpora if c not in wmt14.PAPER_CORPORA[self.tgt_lang]]
            check(not other, "wmt14.corpora", f"no en-{self.tgt_lang} text in {', '.join(other)}")
        elif self.source == "multi30k":
            odd = [lang for lang in (self.src_lang, self.tgt_lang) if lang not in multi30k.LANGUAGES]
            check(not odd, "tgt_lang" if self.src_lang in multi30k.LANGUAGES else "src_lang",
                  f"multi30k has {', '.join(multi30k.LANGUAGES)}, not {', '.join(odd)}")
        else:
            check(bool(self.local.train), "local.train", "names no training corpus")

    @property
    def test_set(self) -> str:
        """The test set this source's models are scored on, by name: test BLEU compares only within one
        (newstest2014, multi30k-test_2016_flickr; a local one by its folder, and its file where that is
        not test.<lang>: numbers, multi30k-test_2016_flickr)."""
        if self.source == "wmt14":
            return "newstest2014" if self.wmt14.test == "full" else "newstest2014-filtered"
        if self.source == "multi30k":
            return f"multi30k-{multi30k.FILES['test']}"
        stem = PurePath(self.local.test.src).stem
        name = "-".join(filter(None, [PurePath(self.local.dir).name or "local", stem if stem != "test" else ""]))
        return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


@dataclass(frozen=True)
class CleanParams:
    max_tokens: int  # words (whitespace-separated) per side
    max_chars: int  # characters per side
    max_ratio: float  # longest side over shortest side, in words
    keep_copies: bool  # keep pairs whose target is their source, untouched
    drop_duplicates: bool  # drop exact repeats of an earlier training pair
    normalize_punctuation: bool  # Moses punctuation normalisation and non-printing character removal
    unicode_form: Literal["NFC", "NFKC", "none"]
    invalid_utf8: Literal["error", "drop"]  # stop with file, line and byte, or drop the pair and count it
    workers: int  # processes; 0: one per core
    # Every side lowercased, as the Multi30k literature trains and scores (its BLEU: score.lowercase and
    # bleu_lc_tok). The default serves the clean artifacts of models logged before the key was kept.
    lowercase: bool = False

    def __post_init__(self) -> None:
        check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, not {self.max_tokens}")
        check(self.max_chars >= 1, "max_chars", f"must be at least 1, not {self.max_chars}")
        check(self.max_ratio >= 1, "max_ratio", f"is longest over shortest, so at least 1, not {self.max_ratio}")
        check(self.workers >= 0, "workers", f"must be 0 (one per core) or more, not {self.workers}")


@dataclass(frozen=True)
class VocabParams:
    model_type: Literal["bpe", "unigram"]  # bpe: the paper's en-de; unigram: word-piece style, its en-fr
    vocab_size: int
    character_coverage: float
    input_sentence_size: int  # lines sampled (per run, both languages together) to learn from; 0: all
    seed: int

    def __post_init__(self) -> None:
        check(self.vocab_size > SPECIAL_PIECES, "vocab_size",
              f"must exceed the {SPECIAL_PIECES} special pieces, not {self.vocab_size}")
        check(0 < self.character_coverage <= 1, "character_coverage",
              f"is a fraction of characters, in (0, 1], not {self.character_coverage}")
        check(self.input_sentence_size >= 0, "input_sentence_size",
              f"must be 0 (all) or more, not {self.input_sentence_size}")
        check(self.seed >= 0, "seed", f"must be 0 or more, not {self.seed}")


@dataclass(frozen=True)
class TrainParams:
    max_steps: int
    batch_tokens: int  # per side per optimizer step, over all processes and accumulation steps
    processes: int | Literal["auto"]  # that train; auto: one per GPU the stage sees, or one on a CPU
    micro_batches: int | Literal["auto"]  # a step's, over all processes; auto: the run's own, or one a process
    warmup_steps: int
    schedule: Literal["inverse_sqrt", "linear_decay"]  # after warm-up: the paper's decay, or a line to 0 at max_steps
    lr_scale: float  # times the paper's rate; 1: the paper. Smaller batches want less: see params.yaml
    adam_betas: tuple[float, float]
    adam_eps: float
    label_smoothing: float
    clip_norm: float  # 0: no clipping, as the paper
    precision: Literal["auto", "fp32", "bf16", "fp16"]  # auto: bf16 on GPUs that have it, else fp32
    compile: bool | Literal["auto", "layers", "loss"]  # torch.compile the step (model and loss), each layer and
                                                       # the loss, the loss alone, or not at all; auto: resolved()
    cuda_graphs: bool  # replay the compiled step as CUDA graphs, one a batch shape: GPUs, compile and buckets
    shapes: Literal["exact", "buckets"]  # a batch padded to its longest pair, or to one of a few shapes (batching.py)
    seed: int
    log_every: int  # steps
    validate_every: int  # steps
    checkpoint_every_steps: int  # the checkpoints averaging takes (and the last step's); 0: the last one only
    checkpoint_every_minutes: float  # snapshots for crash safety, never averaged; 0: none
    keep_checkpoints: int  # of the step-spaced checkpoints; snapshots are kept only until the next save

    def __post_init__(self) -> None:
        for key in ("batch_tokens", "warmup_steps", "log_every", "validate_every", "keep_checkpoints"):
            check(getattr(self, key) >= 1, key, f"must be at least 1, not {getattr(self, key)}")
        for key in ("processes", "micro_batches"):
            value = getattr(self, key)
            check(value == "auto" or (isinstance(value, int) and value >= 1), key,
                  f"must be auto or at least 1, not {value!r}")
        if isinstance(self.processes, int) and isinstance(self.micro_batches, int):
            check(self.micro_batches % self.processes == 0, "micro_batches",
                  f"{self.micro_batches} micro-batches a step cannot be shared by {self.processes} processes: "
                  f"set it to a multiple of train.processes, or auto")
        for key in ("max_steps", "seed", "checkpoint_every_steps", "checkpoint_every_minutes", "clip_norm"):
            check(getattr(self, key) >= 0, key, f"must be 0 or more, not {getattr(self, key)}")
        check(all(0 <= b < 1 for b in self.adam_betas), "adam_betas", f"must be in [0, 1), not {self.adam_betas}")
        check(self.adam_eps > 0, "adam_eps", f"must be positive, not {self.adam_eps}")
        check(self.lr_scale > 0, "lr_scale", f"must be positive, not {self.lr_scale}")
        check(self.schedule != "linear_decay" or self.warmup_steps < self.max_steps, "schedule",
              f"linear_decay falls to zero at max_steps ({self.max_steps}), which must come after the "
              f"{self.warmup_steps} warm-up steps")
        check(0 <= self.label_smoothing < 1, "label_smoothing", f"must be in [0, 1), not {self.label_smoothing}")
        check(not self.cuda_graphs or (self.compile in (True, "auto") and self.shapes == "buckets"), "cuda_graphs",
              "replays the compiled step, one graph a batch shape: it needs train.compile true (or auto) and "
              "train.shapes buckets (a bounded set of shapes)")

    def resolved(self, gpu: bool) -> TrainParams:
        """train.compile for where the step runs, each the fastest measured there: on GPUs the step
        (bench.gpu's throughput part); on CPUs the loss alone, whose compiled kernels read the logits
        once each way with no copies in another precision, where the compiled step is no faster and
        takes over a minute to compile (bench.train --compile loss and --compile step, each --against-eager).
        It never alters the updates: a run resumes across them."""
        return replace(self, compile=(True if gpu else "loss") if self.compile == "auto" else self.compile)


@dataclass(frozen=True)
class AverageParams:
    last: int  # how many of the newest checkpoints to average

    def __post_init__(self) -> None:
        check(self.last >= 1, "last", f"must be at least 1 (1: the newest checkpoint alone), not {self.last}")


@dataclass(frozen=True)
class DecodeParams:
    beam_size: int  # 1: greedy
    length_penalty: float  # alpha
    length_penalty_formula: Literal["gnmt", "power"]  # gnmt: ((5 + |Y|) / 6)^alpha (the paper); power: |Y|^alpha
    stop: Literal["exact", "finished"]  # when a sentence's search ends: translate/beam_search.py says
    max_length_extra: int  # a translation has at most (source tokens + this) tokens
    batch_tokens: int  # source tokens per batch, padding included
    precision: Precision = "fp32"

    def __post_init__(self) -> None:
        check(self.beam_size >= 1, "beam_size", f"must be at least 1 (1: greedy), not {self.beam_size}")
        check(self.length_penalty >= 0, "length_penalty", f"alpha must be 0 or more, not {self.length_penalty}")
        check(self.max_length_extra >= 0, "max_length_extra", f"must be 0 or more, not {self.max_length_extra}")
        check(self.batch_tokens >= 1, "batch_tokens", f"must be at least 1, not {self.batch_tokens}")
        check(self.precision in get_args(Precision), "precision",
              f"must be one of {', '.join(get_args(Precision))}, not {self.precision!r}")


@dataclass(frozen=True)
class ScoreParams:
    tokenize: str  # sacreBLEU tokenizer: 13a (its default), intl, none, ...
    lowercase: bool

    def __post_init__(self) -> None:
        check(self.tokenize in BLEU.TOKENIZERS, "tokenize",
              f"{self.tokenize!r} is not a sacreBLEU tokenizer (known: {', '.join(BLEU.TOKENIZERS)})")
