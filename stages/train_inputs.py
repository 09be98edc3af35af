"""What each optimizer step of the train stage takes from the corpus, made ready ahead of time.

The batches come from a token-budget sampler over the encoded corpus; a step's micro-batches are
collated (pinned on GPUs) and counted on a background thread while the previous step computes.
Every process knows every process's batches, so the step's global token count needs no
communication, and nothing here touches the device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from stages.batching import BatchSampler, Prefetcher, bucket_shape, collate, token_batches
from stages.encode import ParallelIds
from stages.io import PipelineError
from transformer.config import TransformerConfig
from transformer.model import training_flops


def within_positions(corpus: ParallelIds, max_positions: int) -> np.ndarray:
    """Pairs the model can embed: source + EOS and BOS + target within its positions."""
    return (corpus.src_lengths < max_positions) & (corpus.tgt_lengths < max_positions)


def training_sampler(corpus: ParallelIds, batch_tokens: int, grad_accum: int, seed: int, world: int,
                     rank: int, max_positions: int, bucketed: bool = False) -> tuple[BatchSampler, int, dict[str, int]]:
    """(this process's sampler, tokens per micro-batch, pairs dropped: longer than the model's
    positions, or alone longer than a micro-batch's budget); `bucketed`: batches that fit their
    bucket_shape (train.shapes buckets)."""
    micro_tokens = batch_tokens // (world * grad_accum)
    keep = within_positions(corpus, max_positions)
    batches, over_budget = token_batches(corpus.src_lengths, corpus.tgt_lengths, micro_tokens, seed, keep, bucketed)
    dropped = {"over_positions": int((~keep).sum()), "over_budget": over_budget}
    if not batches:
        raise PipelineError(f"no training pair fits: {dropped['over_budget']} are longer than the batch budget of "
                            f"{micro_tokens} tokens per micro-batch (train.batch_tokens / train.micro_batches) "
                            f"and {dropped['over_positions']} longer than model.max_positions ({max_positions})")
    return BatchSampler(batches, seed, world, rank, per_step=world * grad_accum), micro_tokens, dropped


@dataclass(frozen=True)
class BatchCounts:
    """What a step's batches cost on this process: its real tokens and padded slots per side, the real
    tokens of the side that binds the batch budget, and their model FLOPs."""

    tokens: int  # target tokens
    src_tokens: int
    src_slots: int
    tgt_slots: int
    binding: int
    flops: float


@dataclass(frozen=True)
class PreparedStep:
    micro: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # this process's micro-batches
    global_tokens: int  # the step's target tokens over every process
    counts: BatchCounts


@dataclass(frozen=True)
class StepInputs:
    """How a step's batches are made: from which corpus, for which model, how many micro-batches."""

    corpus: ParallelIds
    config: TransformerConfig
    vocab_size: int
    grad_accum: int
    rank: int
    pad_multiple: int  # 8 on GPUs (tensor-core tiles, fewer shapes to compile for); 1 on CPUs, where it only adds work
    pin: bool  # pinned memory, so the copy to a GPU does not block
    bucket_budget: int | None = None  # tokens per micro-batch, under train.shapes buckets: batches get bucket_shape

    def collate(self, batch: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`batch`'s tensors on the host, padded as this run pads (to a multiple, or to its bucket_shape)."""
        c, shape = self.corpus, None
        if self.bucket_budget is not None:
            longest = int(max(c.src_lengths[batch].max(), c.tgt_lengths[batch].max())) + 1
            shape = bucket_shape(longest, self.bucket_budget)
        tensors = collate(c, batch, self.pad_multiple, shape)
        return tuple(x.pin_memory() for x in tensors) if self.pin else tensors

    def prepare(self, cursor: BatchSampler) -> PreparedStep:
        """The next step's batches from `cursor`: this process's collated, every process's counted."""
        steps = [cursor.next_for_all() for _ in range(self.grad_accum)]
        own = [batches[self.rank] for batches in steps]
        c = self.corpus
        global_tokens = sum(int(c.tgt_lengths[b].sum()) + len(b) for batches in steps for b in batches)
        micro = [self.collate(b) for b in own]
        src = [c.src_lengths[b] + 1 for b in own]  # + EOS
        tgt = [c.tgt_lengths[b] + 1 for b in own]  # + EOS (or BOS)
        pairs = list(zip(src, tgt, strict=True))
        return PreparedStep(micro, global_tokens, BatchCounts(
            tokens=sum(int(t.sum()) for t in tgt), src_tokens=sum(int(s.sum()) for s in src),
            src_slots=sum(m[0].numel() for m in micro), tgt_slots=sum(m[2].numel() for m in micro),
            binding=sum(max(int(s.sum()), int(t.sum())) for s, t in pairs),
            flops=sum(training_flops(self.config, self.vocab_size, torch.from_numpy(s), torch.from_numpy(t))
                      for s, t in pairs)))


class StepStream:
    """The steps' inputs, prepared ahead on a background thread from a copy of `sampler`. The sampler
    itself (what checkpoints save) moves only past the steps taken, so batches prefetched but not
    trained on are not lost when a run resumes."""

    def __init__(self, inputs: StepInputs, sampler: BatchSampler) -> None:
        cursor = sampler.copy()
        self.inputs, self.sampler = inputs, sampler
        self.prefetcher = Prefetcher(lambda: inputs.prepare(cursor))

    def next(self) -> tuple[PreparedStep, float]:
        """The next step's input, and the seconds spent waiting for it."""
        start = time.perf_counter()
        prepared = self.prefetcher.get()
        waited = time.perf_counter() - start
        for _ in range(self.inputs.grad_accum):
            next(self.sampler)
        return prepared, waited

    def close(self) -> None:
        self.prefetcher.close()
