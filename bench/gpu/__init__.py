"""Everything measured on a GPU, by one command: training throughput against MarianMT, a profile
of one step, bf16 against fp32, beam-search decoding against transformers and CTranslate2, and the
Multi30k GPU preset end to end. It writes one JSON (after every part, so a run cut short keeps what
it measured) and prints (and writes beside it, as markdown) a readable table.

    python -m bench.gpu --out gpu.json                       # on a GPU machine: every part
    python -m bench.gpu --parts throughput,profile,curves    # some parts only
    python -m bench.gpu --smoke                              # tiny sizes, on a CPU too, end to end (CI runs it)
    python -m bench.gpu --parts decode --work W              # keeps decode's model: bench.decode --model it on the CPU

1. Data: the shared WMT14 Europarl sample (20k pairs) with a BPE vocabulary learned on it by the vocab
   stage (37k pieces, the paper's size; 800 with --smoke) and encoded by the encode stage.
2. throughput: Transformer base and big, bf16, the paper's 25k-token step (with gradient
   accumulation only when a step does not fit): the train stage's own step (`Trainer.train_step`:
   prefetched batches, fused loss, no host syncs) against MarianMT of the same shape and precision
   on the same batches with the same optimizer. Target tokens/s, model TFLOP/s, MFU, peak memory.
3. profile: torch.profiler over steps of base: the operators taking the most GPU time, and the
   kernels' time per step against a step's time without the profiler (how busy the GPU is).
4. curves: bf16 against fp32, 200 steps of base through the train stage on the same batches; the two
   loss curves must agree (the largest relative difference is reported).
5. decode: base trained here for a short while (1,000 steps of 25k tokens in bf16, at the paper's
   peak rate), then newstest2014 (3003 sentences), beam 4: ours, transformers `generate` and
   CTranslate2, in fp32 and bf16, with the share of identical outputs and our BLEU. (CTranslate2's
   wheel is built for CUDA 12; where only CUDA 13's cuBLAS is installed it is reported as not run.)
6. multi30k: the pipeline's stages in DAG order (download from the shared copy, clean, vocab, encode,
   train, average, decode, score) with the presets multi30k and multi30k-gpu, then each try's changes
   (bench/gpu/multi30k-tries.yaml; en-de, and en-fr where a try says so): the time of each stage and
   test2016 BLEU.

Each part is a module of this package; each measurement runs in a process of its own (a fresh
Accelerate state and a clean peak-memory count); one that runs out of memory is retried with twice
the accumulation, one that runs past --part-timeout is reported so and the rest go on. It needs
torch, accelerate, transformers, sentencepiece, sacremoses, sacrebleu and safetensors (CTranslate2 is
measured where it is installed), and never imports MLflow, Prefect or DVC (each part checks).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from bench.common import TINY


@dataclasses.dataclass(frozen=True)
class Sizes:
    train_lines: int
    vocab_size: int
    batch_tokens: int
    models: tuple[str, ...]  # bench.common.model_config's names
    warmup_steps: int  # untimed steps before the timed ones
    timed_steps: int
    curve_steps: int
    curve_log_every: int
    decode_lines: int
    decode_precisions: tuple[str, ...]
    decode_train_steps: int  # of the weights decoded, at the paper's rate peaking at the last step
    multi30k: dict[str, Any]  # overrides after the presets multi30k and multi30k-gpu
    multi30k_lines: int | None  # of each Multi30k file (None: all)

    @property
    def small_model(self) -> str:
        """The model the profile, curves and decode parts train: base, or tiny at smoke sizes."""
        return "tiny" if "tiny" in self.models else "base"


FULL = Sizes(20000, 37000, 25000, ("base", "big"), 3, 10, 200, 10, 3003, ("fp32", "bf16"), 1000, {}, None)
SMOKE = Sizes(2000, 800, 1200, ("tiny",), 1, 2, 12, 3, 16, ("fp32",), 12,
              {**TINY, "vocab.vocab_size": 800, "train.batch_tokens": 1200, "train.max_steps": 4,
               "train.checkpoint_every_steps": 2, "train.validate_every": 2, "average.last": 2,
               "decode.max_length_extra": 5}, 1000)
PARTS = ("throughput", "profile", "curves", "decode", "multi30k")


def prepare(sizes: Sizes, work):
    """The Europarl sample's text, vocabulary and encoded text, by the pipeline's own stages."""
    from bench.common import prepare_corpora

    return prepare_corpora(work, ("europarl",), sizes.vocab_size,
                           {"train": sizes.train_lines, "dev": 500, "test": sizes.decode_lines})
