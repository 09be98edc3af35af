"""Length-bucketed, token-budget batches (paper section 5.1: ~25k source and ~25k target tokens per step).

Sentences are sorted by length so a batch holds similar lengths and wastes little on padding; a
batch takes sentences while (sentences x longest side) stays within the budget. The batches are
fixed for a seed; their order is reshuffled each epoch from (seed, epoch) and shared out over
processes. The position in the stream is a small state that checkpoints save and restore exactly.
"""
from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np
import torch

from stages.vocab import BOS_ID, EOS_ID, PAD_ID


T = TypeVar("T")
BIN_WIDTHS = (1, 2, 3, 4, 6, 8)  # target-length bin widths tried; the tightest batching wins


def token_batches(src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_tokens: int,
                  seed: int | None, keep: np.ndarray | None = None) -> tuple[list[np.ndarray], int]:
    """Group sentence indices into batches of at most `max_tokens` padded tokens per side.

    Pairs are binned by target length and ordered by source length inside each bin, ascending and
    descending in turn ("snake" order), so a batch holds pairs alike on both sides. The bin width
    (1 to 8 target tokens) is the one that needs the fewest padded tokens for this data and budget:
    wide bins suit sparse data, narrow ones dense data. Lengths count the EOS (or BOS) the model
    adds. With a seed, pairs of equal lengths are ordered randomly (but reproducibly); without one,
    in corpus order. Pairs where `keep` is False are left out. Returns the batches and the number of
    (kept) pairs dropped because alone they exceed the budget.
    """
    src_len = np.asarray(src_lengths, dtype=np.int64) + 1
    tgt_len = np.asarray(tgt_lengths, dtype=np.int64) + 1
    order = np.arange(len(src_len))
    if seed is not None:
        order = np.random.default_rng(seed).permutation(order)
    longest = np.maximum(src_len, tgt_len)
    if keep is not None:
        order = order[np.asarray(keep)[order]]
    fits = longest[order] <= max_tokens
    dropped = int((~fits).sum())
    order = order[fits]
    candidates = [_fill(_snake(order, src_len, tgt_len, width), src_len, tgt_len, longest, max_tokens)
                  for width in BIN_WIDTHS]
    return min(candidates, key=lambda batches: _padded(batches, src_len, tgt_len)), dropped


def _snake(order: np.ndarray, src_len: np.ndarray, tgt_len: np.ndarray, width: int) -> np.ndarray:
    bins = tgt_len[order] // width
    snake = np.where(bins % 2 == 0, src_len[order], -src_len[order])
    return order[np.lexsort((tgt_len[order], snake, bins))]


def _fill(order: np.ndarray, src_len: np.ndarray, tgt_len: np.ndarray, longest: np.ndarray,
          max_tokens: int) -> list[np.ndarray]:
    """Cut the ordered pairs into batches greedily: a batch takes pairs while (pairs x the longest
    side of any of them) stays within the budget."""
    batches: list[np.ndarray] = []
    start, width = 0, 0
    for i, idx in enumerate(order):
        width_if_added = max(width, longest[idx])
        if width_if_added * (i - start + 1) > max_tokens:
            batches.append(order[start:i])
            start, width_if_added = i, longest[idx]
        width = width_if_added
    if start < len(order):
        batches.append(order[start:])
    return batches


def _padded(batches: list[np.ndarray], src_len: np.ndarray, tgt_len: np.ndarray) -> int:
    """Padding tokens, both sides together."""
    return sum(len(b) * int(src_len[b].max() + tgt_len[b].max()) - int(src_len[b].sum() + tgt_len[b].sum())
               for b in batches)


def divisible(batches: list[np.ndarray], parts: int) -> list[np.ndarray]:
    """The same pairs in a number of batches divisible by `parts`, by halving the largest batches,
    so every process gets as many batches as the others and every pair is still seen once an epoch."""
    batches = list(batches)
    while len(batches) % parts:
        largest = max(range(len(batches)), key=lambda i: len(batches[i]))
        if len(batches[largest]) < 2:
            raise ValueError(f"{len(batches)} batches of single pairs cannot be shared out over {parts} processes")
        half = len(batches[largest]) // 2
        batches[largest : largest + 1] = [batches[largest][:half], batches[largest][half:]]
    return batches


class BatchSampler:
    """An endless, resumable stream of this process's batches, epoch after epoch.

    The stream is global: the seed alone orders each epoch's batches, and a step takes the next
    `per_step` of them (processes x micro-batches per process), process r every r-th of each
    `num_processes`. A run resumed on another number of processes, with gradient accumulation
    changed to keep the product, so trains on the same batches in the same steps. Every process
    knows every process's batch at each position, so the step's global token count needs no
    communication."""

    def __init__(self, batches: list[np.ndarray], seed: int, num_processes: int = 1, rank: int = 0,
                 per_step: int | None = None) -> None:
        per_step = per_step or num_processes
        if per_step % num_processes:
            raise ValueError(f"{per_step} batches a step cannot be shared out over {num_processes} processes")
        self.batches, self.seed = divisible(batches, per_step), seed  # whole steps an epoch
        self.num_processes, self.rank, self.per_step = num_processes, rank, per_step
        self.epoch, self.position = 0, 0  # position: this process's batches taken in the epoch
        self._order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        """Every process's batches of the epoch: process r takes positions r, r + W, r + 2W, ..."""
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.batches))

    def __len__(self) -> int:
        """Batches per epoch for each process."""
        return len(self._order) // self.num_processes

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> np.ndarray:
        return self.next_for_all()[self.rank]

    def next_for_all(self) -> list[np.ndarray]:
        """The next batch of every process, in rank order."""
        if self.position == len(self):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order()
        start = self.position * self.num_processes
        self.position += 1
        return [self.batches[i] for i in self._order[start : start + self.num_processes]]

    def copy(self) -> BatchSampler:
        """An independent cursor at the same place (sharing the batches)."""
        other = copy.copy(self)
        other._order = self._order.copy()
        return other

    def state_dict(self) -> dict[str, int]:
        """The place in the global stream: whatever the number of processes that resumes from it."""
        return {"epoch": self.epoch, "batches": self.position * self.num_processes}

    def _check_place(self, state: dict[str, int]) -> None:
        epoch, taken = state.get("epoch"), state.get("batches")
        if not (isinstance(epoch, int) and isinstance(taken, int) and epoch >= 0 and 0 <= taken <= len(self.batches)
                and taken % self.num_processes == 0):
            raise ValueError(f"its sampler state {state} is not a place in an epoch of {len(self.batches)} batches "
                             f"shared by {self.num_processes} processes")

    def check(self, state: dict[str, int], step: int) -> None:
        """Refuse a place this stream does not have, or not the one `step` steps end at, before anything
        is loaded."""
        self._check_place(state)
        done = step * self.per_step  # batches of the global stream that `step` steps took
        expected = {"epoch": max(done - 1, 0) // len(self.batches)}  # an epoch ends at its last batch
        expected["batches"] = done - expected["epoch"] * len(self.batches)
        if state != expected:
            raise ValueError(f"its sampler state {state} is not where step {step} ends ({expected})")

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._check_place(state)
        self.epoch, self.position = state["epoch"], state["batches"] // self.num_processes
        self._order = self._epoch_order()


def pad(rows: list, pad_id: int = PAD_ID, multiple: int = 1) -> torch.Tensor:
    """Rows of token ids of any lengths as one (rows, longest) int64 tensor, padded at the end; the
    width rounded up to a multiple of `multiple` (8 on GPUs: tensor-core tiles, and fewer shapes). On
    the host whatever torch's default device is: batches are pinned there and copied without blocking."""
    width = -(-max(map(len, rows), default=0) // multiple) * multiple
    out = torch.full((len(rows), width), pad_id, dtype=torch.long, device="cpu")
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.from_numpy(np.asarray(row, dtype=np.int64))
    return out


def collate(corpus, indices: np.ndarray, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded tensors for a batch of pairs: source + EOS, BOS + target (decoder input), target + EOS.
    `corpus` gives pair i's token ids as corpus.src(i) and corpus.tgt(i)."""
    tgts = [np.asarray(corpus.tgt(i), dtype=np.int64) for i in indices]
    return (pad([np.append(corpus.src(i), EOS_ID) for i in indices], multiple=multiple),
            pad([np.concatenate([[BOS_ID], t]) for t in tgts], multiple=multiple),
            pad([np.append(t, EOS_ID) for t in tgts], multiple=multiple))


class Prefetcher(Generic[T]):
    """Calls `make` on a background thread, keeping up to `depth` results ready, so that preparing
    the next step's batches (collating, pinning memory) overlaps the current step's compute.
    An exception in `make` is raised where the result is taken."""

    def __init__(self, make: Callable[[], T], depth: int = 2) -> None:
        self._make, self._queue = make, queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="prefetch", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._make()
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
                self._queue.put(e)
                return
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def get(self) -> T:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
