"""The token-budget batch sampler: coverage, determinism, exact resume, sharing over processes; the
bounded shapes of bucketed batches; collation against a sentence-by-sentence reference."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from stages.batching import BatchSampler, bucket_shape, bucket_width, collate, token_batches

rng = np.random.default_rng(0)
SRC = rng.integers(1, 60, 2000)
TGT = np.clip(SRC + rng.integers(-5, 6, 2000), 1, None)


def test_batches_cover_every_pair_once_within_budget():
    batches, dropped = token_batches(SRC, TGT, 500, seed=1)
    assert dropped == 0
    covered = np.concatenate(batches)
    assert sorted(covered.tolist()) == list(range(len(SRC)))
    for b in batches:
        assert len(b) * max((SRC[b] + 1).max(), (TGT[b] + 1).max()) <= 500


def test_length_bucketing_keeps_padding_low_on_both_sides():
    batches, _ = token_batches(SRC, TGT, 2000, seed=1)
    for side in (SRC, TGT):
        real = sum(int(side[b].sum() + len(b)) for b in batches)
        padded = sum(len(b) * int(side[b].max() + 1) for b in batches)
        assert real / padded > 0.9


def test_too_long_sentences_are_dropped_and_counted():
    batches, dropped = token_batches(np.array([3, 300, 4]), np.array([3, 5, 4]), 100, seed=None)
    assert dropped == 1 and sorted(np.concatenate(batches).tolist()) == [0, 2]


def _epoch(sampler):
    return [next(sampler).tolist() for _ in range(len(sampler))]


def test_same_seed_same_batches_and_each_epoch_reshuffled():
    batches, _ = token_batches(SRC, TGT, 500, seed=1)
    a, b = BatchSampler(batches, seed=7), BatchSampler(batches, seed=7)
    first = _epoch(a)
    assert first == _epoch(b)
    second = _epoch(a)
    assert second != first and sorted(map(tuple, first)) == sorted(map(tuple, second))
    assert _epoch(BatchSampler(batches, seed=8)) != first


def test_resume_mid_epoch_yields_the_remaining_batches_exactly():
    batches, _ = token_batches(SRC, TGT, 500, seed=1)
    reference = BatchSampler(batches, seed=3)
    stream = [next(reference).tolist() for _ in range(len(reference) + 10)]
    interrupted = BatchSampler(batches, seed=3)
    head = [next(interrupted).tolist() for _ in range(len(interrupted) - 4)]
    resumed = BatchSampler(batches, seed=3)
    resumed.load_state_dict(interrupted.state_dict())
    tail = [next(resumed).tolist() for _ in range(14)]
    assert head + tail == stream


@pytest.mark.parametrize("world", [2, 4])
def test_processes_get_equal_disjoint_shares(world):
    batches, _ = token_batches(SRC, TGT, 500, seed=1)
    samplers = [BatchSampler(batches, seed=3, num_processes=world, rank=r) for r in range(world)]
    epochs = [_epoch(s) for s in samplers]
    assert len({len(e) for e in epochs}) == 1
    seen = sorted(i for e in epochs for batch in e for i in batch)
    assert seen == list(range(len(SRC)))  # every pair exactly once per epoch, over all processes


def _steps(samplers: list[BatchSampler], grad_accum: int, steps: int) -> list[list[list[int]]]:
    """Each step's micro-batches over all processes, in the order of their global index a x W + r."""
    return [[next(s).tolist() for _ in range(grad_accum) for s in samplers] for _ in range(steps)]


def test_the_stream_is_global_so_a_run_resumes_on_another_split_of_the_step():
    """2 processes x 1 micro-batch and 1 process x 2 take the same batches in the same steps, across
    the end of an epoch, and the place saved by the one resumes the other."""
    batches = token_batches(SRC, TGT, 500, seed=1)[0][:-1]
    assert len(batches) % 2  # an odd number: the split into whole steps is the sampler's job
    two = [BatchSampler(batches, seed=3, num_processes=2, rank=r, per_step=2) for r in range(2)]
    one = BatchSampler(batches, seed=3, per_step=2)
    steps = len(one) // 2 + 3
    by_two = _steps(two, 1, steps)
    assert by_two == _steps([one], 2, steps)
    resumed = BatchSampler(batches, seed=3, per_step=2)
    halfway = [BatchSampler(batches, seed=3, num_processes=2, rank=r, per_step=2) for r in range(2)]
    head = _steps(halfway, 1, steps - 5)
    resumed.load_state_dict(halfway[0].state_dict())
    assert halfway[0].state_dict() == halfway[1].state_dict()
    assert head + _steps([resumed], 2, 5) == by_two


def test_a_sampler_state_out_of_its_epoch_is_refused_before_it_loads():
    sampler = BatchSampler([np.arange(i, i + 2) for i in range(0, 20, 2)], seed=3, num_processes=2, rank=0)
    for state in ({"epoch": 0, "batches": 11}, {"epoch": 0, "batches": 3}, {"epoch": -1, "batches": 0}, {}):
        with pytest.raises(ValueError, match="not a place in an epoch of 10 batches shared by 2 processes"):
            sampler.load_state_dict(state)
    assert sampler.state_dict() == {"epoch": 0, "batches": 0}


def pairs(*sides):
    """A corpus as the encode stage stores it: per side, ids end to end and sentence offsets."""
    flat = {}
    for name, sentences in zip(("src", "tgt"), sides, strict=True):
        flat[f"{name}_ids"] = np.array([i for s in sentences for i in s], dtype=np.uint16)
        flat[f"{name}_offsets"] = np.cumsum([0] + [len(s) for s in sentences])
        flat[f"{name}_lengths"] = np.array([len(s) for s in sentences])
    return SimpleNamespace(**flat)


def test_collate_adds_eos_and_bos_and_pads():
    src, tgt_in, tgt_out = collate(pairs([[5, 6], [7]], [[8], [9, 10, 11]]), np.array([0, 1]))
    assert src.tolist() == [[5, 6, 3], [7, 3, 0]]
    assert tgt_in.tolist() == [[2, 8, 0, 0], [2, 9, 10, 11]]
    assert tgt_out.tolist() == [[8, 3, 0, 0], [9, 10, 11, 3]]
    assert tgt_in.dtype == torch.long
    assert [x.shape for x in collate(pairs([[5] * 9], [[6]]), np.array([0]), multiple=8)] == [(1, 16), (1, 8), (1, 8)]


def test_collate_to_a_shape_pads_rows_with_a_lone_eos_source_and_no_target():
    src, tgt_in, tgt_out = collate(pairs([[5, 6], [7]], [[8], [9, 10]]), np.array([1, 0]), shape=(3, 8))
    assert src.tolist() == [[7, 3, 0, 0, 0, 0, 0, 0], [5, 6, 3, 0, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 0]]
    assert tgt_in.tolist()[:2] == [[2, 9, 10, 0, 0, 0, 0, 0], [2, 8, 0, 0, 0, 0, 0, 0]]
    assert tgt_out.tolist() == [[9, 10, 3, 0, 0, 0, 0, 0], [8, 3, 0, 0, 0, 0, 0, 0], [0] * 8]
    with pytest.raises(ValueError, match=r"a batch of 2 pairs up to 3 tokens does not fit the shape \(1, 8\)"):
        collate(pairs([[5, 6], [7]], [[8], [9, 10]]), np.array([0, 1]), shape=(1, 8))


def test_collate_equals_a_sentence_by_sentence_reference():
    rng = np.random.default_rng(1)
    sides = [[rng.integers(4, 60000, n).tolist() for n in rng.integers(0, 30, 50)] for _ in range(2)]
    corpus, batch = pairs(*sides), rng.permutation(50)[:20]
    src, tgt_in, tgt_out = collate(corpus, batch)
    for row, i in enumerate(batch):
        s, t = sides[0][i] + [3], sides[1][i]
        assert src[row].tolist() == s + [0] * (src.size(1) - len(s))
        assert tgt_in[row].tolist() == [2] + t + [0] * (tgt_in.size(1) - len(t) - 1)
        assert tgt_out[row].tolist() == t + [3] + [0] * (tgt_out.size(1) - len(t) - 1)


def test_bucket_widths_are_few_and_waste_little():
    widths = sorted({bucket_width(n) for n in range(1, 257)})
    assert widths[:9] == [8, 16, 24, 32, 40, 48, 56, 64, 80] and widths[-4:] == [160, 192, 224, 256]
    assert len(widths) == 16
    assert all(0 <= bucket_width(n) - n < 8 for n in range(1, 65))
    assert all(0 <= bucket_width(n) - n < bucket_width(n) / 5 for n in range(65, 5000))
    assert bucket_shape(30, 1500) == (46, 32) and bucket_shape(200, 1500) == (6, 224)


@pytest.mark.parametrize("budget", [500, 2000, 25000])
def test_bucketed_batches_fit_their_shape_and_cover_every_pair(budget):
    long_tail = np.concatenate([SRC, rng.integers(60, 240, 100)])
    tgt = np.clip(long_tail + rng.integers(-5, 6, len(long_tail)), 1, None)
    batches, dropped = token_batches(long_tail, tgt, budget, seed=1, bucketed=True)
    assert dropped == 0 and sorted(np.concatenate(batches).tolist()) == list(range(len(long_tail)))
    shapes = set()
    for b in batches:
        rows, width = bucket_shape(int(max(long_tail[b].max(), tgt[b].max())) + 1, budget)
        assert len(b) <= rows and rows * width <= budget
        shapes.add((rows, width))
    assert len(shapes) <= 16


@pytest.mark.parametrize("bucketed", [False, True])
def test_batches_are_the_pair_by_pair_cut(bucketed):
    """token_batches cuts with array operations what bench.batching's reference cuts pair by pair: the
    same batches, in the same order, for any lengths, budget, seed and kept pairs."""
    from bench.batching import pairwise_batches
    draw = np.random.default_rng(7)
    for trial in range(60):
        n = int(draw.integers(0, 300))
        src = draw.integers(0, int(draw.integers(1, 300)), n)
        tgt = np.clip(src + draw.integers(-20, 20, n), 0, None)
        budget, seed = int(draw.integers(1, 3000)), (None if trial % 3 == 0 else trial)
        keep = None if trial % 2 else draw.random(n) < 0.8
        ours, dropped = token_batches(src, tgt, budget, seed, keep, bucketed)
        reference, dropped_there = pairwise_batches(src, tgt, budget, seed, keep, bucketed)
        assert dropped == dropped_there, trial
        assert [b.tolist() for b in ours] == [b.tolist() for b in reference], trial
    # lengths of millions of tokens, past the 16-bit keys of the sort by lengths
    src = draw.integers(1, 3_000_000, 50)
    tgt = np.clip(src + draw.integers(-9, 9, 50), 1, None)
    ours, reference = (cut(src, tgt, 10**7, 1, None, bucketed)[0] for cut in (token_batches, pairwise_batches))
    assert [b.tolist() for b in ours] == [b.tolist() for b in reference]


def test_every_process_knows_every_process_batches_and_a_copy_moves_alone():
    batches, _ = token_batches(SRC, TGT, 500, seed=1)
    ranks = [BatchSampler(batches, seed=3, num_processes=3, rank=r) for r in range(3)]
    seen_by_one = BatchSampler(batches, seed=3, num_processes=3, rank=1)
    for _ in range(len(seen_by_one) + 5):  # across an epoch's end
        everyone = seen_by_one.next_for_all()
        assert [b.tolist() for b in everyone] == [next(s).tolist() for s in ranks]
    ahead = ranks[0].copy()
    next(ahead), next(ahead)
    assert ranks[0].state_dict() != ahead.state_dict()
    behind = ranks[0].copy()
    assert [next(behind).tolist() for _ in range(3)] == [next(ranks[0]).tolist() for _ in range(3)]


def test_padding_rounds_each_side_up_to_a_multiple():
    src, tgt_in, tgt_out = collate(pairs([[5, 6, 7], [8]], [[5] * 9, [6]]), np.array([0, 1]), multiple=8)
    assert src.shape == (2, 8) and tgt_in.shape == tgt_out.shape == (2, 16)
    assert collate(pairs([[5, 6], [8]], [[1], [2]]), np.array([0, 1]), multiple=4)[0].tolist() == \
        [[5, 6, 3, 0], [8, 3, 0, 0]]


def test_the_prefetcher_keeps_order_and_hands_errors_to_the_consumer():
    from stages.batching import Prefetcher

    counter = iter(range(5))

    def make():
        value = next(counter)  # StopIteration after five: an error in the producer
        return value

    prefetcher = Prefetcher(make, depth=2)
    assert [prefetcher.get() for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(StopIteration):
        prefetcher.get()
    prefetcher.close()
