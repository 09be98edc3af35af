"""The token-budget batch sampler: coverage, determinism, exact resume, sharing over processes."""
import numpy as np
import pytest
import torch

from stages.batching import BatchSampler, collate, token_batches

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


def test_collate_adds_eos_and_bos_and_pads():
    class Corpus:
        def src(self, i):
            return np.array([[5, 6], [7]][i])

        def tgt(self, i):
            return np.array([[8], [9, 10, 11]][i])

    src, tgt_in, tgt_out = collate(Corpus(), np.array([0, 1]))
    assert src.tolist() == [[5, 6, 3], [7, 3, 0]]
    assert tgt_in.tolist() == [[2, 8, 0, 0], [2, 9, 10, 11]]
    assert tgt_out.tolist() == [[8, 3, 0, 0], [9, 10, 11, 3]]
    assert tgt_in.dtype == torch.long


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


def test_padding_rounds_the_width_up_to_a_multiple():
    from stages.batching import pad

    assert pad([[5, 6, 7], [8]], multiple=8).shape == (2, 8)
    assert pad([[5] * 9], multiple=8).shape == (1, 16) and pad([[5] * 9]).shape == (1, 9)
    assert pad([[5, 6, 7], [8]], multiple=4).tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]


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
