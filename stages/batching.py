"""Length-bucketed, token-budget batches (paper section 5.1: ~25k source and ~25k target tokens per step).

Sentences are sorted by length so a batch holds similar lengths and wastes little on padding; a
batch takes sentences while (sentences x longest side) stays within the budget. Under
train.shapes buckets a batch is padded to one of a few (rows, width) shapes instead, so a compiled
step replays a handful of CUDA graphs rather than meeting a new shape nearly every step. The batches are
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
                  seed: int | None, keep: np.ndarray | None = None,
                  bucketed: bool = False) -> tuple[list[np.ndarray], int]:
    """Group sentence indices into batches of at most `max_tokens` padded tokens per side.

    Pairs are binned by target length and ordered by source length inside each bin, ascending and
    descending in turn ("snake" order), so a batch holds pairs alike on both sides. The bin width
    (1 to 8 target tokens) is the one that needs the fewest padded tokens for this data and budget:
    wide bins suit sparse data, narrow ones dense data. Lengths count the EOS (or BOS) the model
    adds. With a seed, pairs of equal lengths are ordered randomly (but reproducibly); without one,
    in corpus order. Pairs where `keep` is False are left out. Bucketed, a batch costs its shape's
    tokens (bucket_shape: its longest side rounded up to one of a few widths, times the rows the
    budget gives that width), so it fits the shape it is padded to. Returns the batches and the number
    of (kept) pairs dropped because alone they exceed the budget.

    Every stage start builds them for the whole corpus, so no step loops over the pairs or the batches:
    array operations, and a loop over runs of pairs of equal lengths. WMT14 en-de's 4.5M pairs take
    about a second (`python -m bench.batching`, against the same cut pair by pair).
    """
    src_len = np.asarray(src_lengths, dtype=np.int64) + 1
    tgt_len = np.asarray(tgt_lengths, dtype=np.int64) + 1
    order = np.arange(len(src_len))
    if seed is not None:
        order = np.random.default_rng(seed).permutation(order)
    longest = np.maximum(src_len, tgt_len)
    if bucketed:
        lengths, where = np.unique(longest, return_inverse=True)
        longest = np.array([bucket_width(int(n)) for n in lengths], dtype=np.int64)[where]
    if keep is not None:
        order = order[np.asarray(keep)[order]]
    fits = longest[order] <= max_tokens
    dropped = int((~fits).sum())
    order = order[fits]
    if not len(order):
        return [], dropped
    groups = _LengthGroups(src_len[order], tgt_len[order], longest[order])  # the kept pairs', in `order`
    best: tuple[int, np.ndarray, np.ndarray] | None = None
    for width in BIN_WIDTHS:
        snake = _snake(groups.src, groups.tgt, width)
        starts = _cut(groups.wide[snake], groups.sizes[snake], max_tokens)
        if bucketed:
            slots = _bucket_slots(groups.spread(groups.wide, snake), starts, max_tokens)
        else:
            slots = _slots(groups.spread(groups.src, snake), groups.spread(groups.tgt, snake), starts)
        if best is None or slots < best[0]:  # the same pairs in every cut: fewest slots, least padding
            best = slots, snake, starts
    _, snake, starts = best
    return np.split(order[groups.members_in(snake)], starts[1:]), dropped


class _LengthGroups:
    """Pairs grouped by their (source, target) lengths. Pairs of the same lengths stand together, in
    their own order, in every snake order, so each bin width sorts the groups (as many as distinct
    length pairs: tens of thousands, not millions) and the corpus is sorted once, not once a width.
    `wide`: each pair's longest side as the cut counts it, which its lengths fix."""

    def __init__(self, src: np.ndarray, tgt: np.ndarray, wide: np.ndarray) -> None:
        self.members = _by_lengths(src, tgt)  # pair indices, group by group, each group's in order
        src, tgt = src[self.members], tgt[self.members]
        new = np.concatenate(([True], (src[1:] != src[:-1]) | (tgt[1:] != tgt[:-1])))
        self.first = np.flatnonzero(new)  # where each group starts in members
        self.sizes = np.diff(self.first, append=len(src))
        self.src, self.tgt, self.wide = src[self.first], tgt[self.first], wide[self.members[self.first]]

    def spread(self, values: np.ndarray, order: np.ndarray) -> np.ndarray:
        """Each pair's value, pairs in the given order of the groups (`values`: one a group)."""
        return np.repeat(values[order], self.sizes[order])

    def members_in(self, order: np.ndarray) -> np.ndarray:
        """The pairs' indices, the groups in the given order."""
        sizes = self.sizes[order]
        starts = np.cumsum(sizes) - sizes
        return self.members[np.arange(len(self.members)) + np.repeat(self.first[order] - starts, sizes)]


def _by_lengths(src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """The stable permutation that sorts pairs by source, then target length: two passes of numpy's
    stable sort of 16-bit keys, a radix sort, linear in the pairs (a comparison sort of a shuffled
    corpus of millions is most of the sampler's time); lexsort where lengths need more bits."""
    if max(int(src.max()), int(tgt.max())) >= 1 << 16:
        return np.lexsort((tgt, src))
    by_tgt = np.argsort(tgt.astype(np.uint16), kind="stable")
    return by_tgt[np.argsort(src[by_tgt].astype(np.uint16), kind="stable")]


def _snake(src: np.ndarray, tgt: np.ndarray, width: int) -> np.ndarray:
    """The permutation that sorts length pairs by target-length bin, then source length (ascending in
    even bins, descending in odd ones), then target length."""
    bins = tgt // width
    return np.lexsort((tgt, np.where(bins % 2 == 0, src, -src), bins))


def _cut(longest: np.ndarray, runs: np.ndarray, max_tokens: int) -> np.ndarray:
    """Where each batch starts when pairs, in order, are cut greedily: a batch takes the next pair while
    (its pairs + 1) x the longest side of any of them stays within the budget. The pairs come as runs:
    `runs[i]` pairs in a row whose longest side is `longest[i]`, each within the budget. Inside a run a
    batch's cost grows by the same step each pair, so each run is a few lines of arithmetic whatever
    the batches it holds: a loop over the distinct lengths, not over the batches."""
    spaced = []  # (first start, pairs apart, batches): the batches' starts, a run's at a time
    pos, pairs, widest = 0, 0, 0  # the open batch: its pairs and their longest side
    for width, left in zip(longest.tolist(), runs.tolist()):
        if pairs:  # the open batch takes what of this run fits it
            widest = max(widest, width)
            take = min(max(max_tokens // widest - pairs, 0), left)
            pos, pairs, left = pos + take, pairs + take, left - take
        if left:  # new batches of `per` pairs each, the last one open
            per = max_tokens // width
            new = -(-left // per)
            spaced.append((pos, per, new))
            pos, pairs, widest = pos + left, left - (new - 1) * per, width
    first, step, count = np.array(spaced, dtype=np.int64).reshape(-1, 3).T
    nth = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)  # each batch's place in its run
    return np.repeat(first, count) + np.repeat(step, count) * nth


def _slots(src: np.ndarray, tgt: np.ndarray, starts: np.ndarray) -> int:
    """Padded token slots, both sides together, of pairs in order cut at `starts`, each side padded to
    its longest."""
    pairs = np.diff(starts, append=len(src))
    return int((pairs * (np.maximum.reduceat(src, starts) + np.maximum.reduceat(tgt, starts))).sum())


def _bucket_slots(longest: np.ndarray, starts: np.ndarray, budget: int) -> int:
    """Padded token slots, both sides together, of pairs in order cut at `starts`, each batch padded to
    its bucket_shape: its width the largest of its pairs' `longest` (bucket widths, each within the
    budget), its rows what the budget gives that width."""
    width = np.maximum.reduceat(longest, starts)
    return int((2 * (budget // width) * width).sum())


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


def bucket_width(length: int) -> int:
    """The width a batch whose longest side is `length` is padded to under train.shapes buckets: a
    multiple of 8 up to 64, then four widths a doubling (80, 96, 112, 128, 160, ...), so a batch wastes
    under 8 tokens of its width up to 64 and under a fifth of it above, and a corpus whose pairs reach
    L tokens brings at most 8 + 4 log2(L / 64) shapes (16 to L = 256)."""
    if length <= 64:
        return max(8, -(-length // 8) * 8)
    step = (1 << (int(length) - 1).bit_length() - 1) // 4  # a quarter of the doubling below
    return -(-length // step) * step


def bucket_shape(longest: int, max_tokens: int) -> tuple[int, int]:
    """(rows, width) of a bucketed batch: its width's share of the token budget, so every batch of a
    width has one shape. `longest`: the batch's longest side in tokens, EOS (or BOS) counted."""
    width = bucket_width(longest)
    return max(1, max_tokens // width), width


def _side(ids: np.ndarray, offsets: np.ndarray, indices: np.ndarray, shape: tuple[int, int],
          bos: bool, eos: bool) -> torch.Tensor:
    """One side of a batch as a (rows, width) int64 tensor, built with array operations over the
    memory-mapped ids (no loop over sentences): [BOS] + ids + [EOS], then padding, and rows past the
    batch's own all padding."""
    starts = np.asarray(offsets[indices], dtype=np.int64)
    lengths = np.asarray(offsets[indices + 1], dtype=np.int64) - starts
    out = np.full(shape, PAD_ID, dtype=np.int64)
    rows = np.arange(len(indices))
    columns = np.arange(shape[1]) - int(bos)  # position within the sentence's own ids
    inside = (columns >= 0) & (columns < lengths[:, None])
    body = out[: len(indices)]
    body[inside] = ids[(starts[:, None] + columns)[inside]]
    if bos:
        body[:, 0] = BOS_ID
    if eos:
        body[rows, lengths + int(bos)] = EOS_ID
    return torch.from_numpy(out)


def collate(corpus, indices: np.ndarray, multiple: int = 1,
            shape: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded tensors for a batch of pairs: source + EOS, BOS + target (decoder input), target + EOS.
    Each side as wide as its longest sentence rounded up to a multiple of `multiple` (8 on GPUs:
    tensor-core tiles), or both sides `shape` (rows, width): rows past the batch's own hold a source of
    EOS alone (a key to attend to, so no attention row is empty) and no target.
    `corpus` holds flat ids and offsets per side (src_ids, src_offsets, tgt_ids, tgt_offsets), sentence
    i being ids[offsets[i]:offsets[i + 1]], as the encode stage writes them; the result is on the host."""
    indices = np.asarray(indices, dtype=np.int64)
    src_len = np.asarray(corpus.src_offsets[indices + 1]) - np.asarray(corpus.src_offsets[indices])
    tgt_len = np.asarray(corpus.tgt_offsets[indices + 1]) - np.asarray(corpus.tgt_offsets[indices])
    if shape is None:
        src_shape, tgt_shape = ((len(indices), -(-(int(n.max(initial=0)) + 1) // multiple) * multiple)
                                for n in (src_len, tgt_len))
    elif shape[0] < len(indices) or shape[1] <= max(int(src_len.max(initial=0)), int(tgt_len.max(initial=0))):
        raise ValueError(f"a batch of {len(indices)} pairs up to {max(src_len.max(), tgt_len.max()) + 1} tokens "
                         f"does not fit the shape {shape}")
    else:
        src_shape = tgt_shape = shape
    src = _side(corpus.src_ids, corpus.src_offsets, indices, src_shape, bos=False, eos=True)
    src[len(indices) :, 0] = EOS_ID
    return (src,
            _side(corpus.tgt_ids, corpus.tgt_offsets, indices, tgt_shape, bos=True, eos=False),
            _side(corpus.tgt_ids, corpus.tgt_offsets, indices, tgt_shape, bos=False, eos=True))


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
