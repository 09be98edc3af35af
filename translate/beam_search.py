"""Batched beam search with the GNMT length penalty (paper section 6.1: beam 4, alpha 0.6) or another.

The search knows nothing of the model: it asks a decoder for next-token log-probabilities of every
live hypothesis and tells it how the hypotheses were reordered, so any decoder (the Transformer with
its key/value cache, or a toy with scripted probabilities in the tests) can be searched the same way.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


class StepDecoder(Protocol):
    def step(self, tokens: Tensor) -> Tensor:
        """tokens (N, t), each live prefix starting with BOS -> next-token log-probs (N, vocab), which
        the search may write into (it reads them only before the next call)."""

    def reorder(self, order: Tensor, sentences: Tensor | None) -> None:
        """Row i of every per-hypothesis state becomes old row order[i]. Rows move only among a
        sentence's beams, unless some sentences left the batch: then `sentences` holds the old
        batch rows of those that stay (for per-sentence state), and their beams' rows are in order."""


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]  # without BOS and EOS
    score: float  # sum of log-probabilities (EOS included) divided by the length penalty
    log_prob: float


def gnmt_length_penalty(length: int, alpha: float) -> float:
    """lp(Y) = ((5 + |Y|) / 6)^alpha  (Wu et al. 2016), |Y| counting the EOS token."""
    return ((5.0 + length) / 6.0) ** alpha


def power_length_penalty(length: int, alpha: float) -> float:
    """lp(Y) = |Y|^alpha, as fairseq's and transformers' beam searches divide scores."""
    return float(length) ** alpha


LENGTH_PENALTIES = {"gnmt": gnmt_length_penalty, "power": power_length_penalty}


STOPS = ("exact", "finished")
# A step's candidate selection: (log-probabilities, beam scores, k) -> (sums, beams, tokens), as top_k.
Select = Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor, Tensor]]


def top_k(lprobs: Tensor, scores: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The k best extensions of each sentence's beams: lprobs (B, beams, vocab), the next token's
    log-probabilities, scores (B, beams), the beams' own -> their sums (B, k), best first, and the
    beam (B, k) and token (B, k) of each. `lprobs` may be overwritten."""
    B, beams, vocab = lprobs.shape
    top, index = lprobs.add_(scores.unsqueeze(-1)).view(B, beams * vocab).topk(k, dim=1)
    return top, index // vocab, index % vocab


def beam_search(
    decoder: StepDecoder,
    batch_size: int,
    beam_size: int,
    max_lengths: Tensor,
    bos: int,
    eos: int,
    alpha: float,
    formula: str = "gnmt",
    stop: str = "exact",
    select: Select = top_k,
) -> list[list[Hypothesis]]:
    """Search every sentence of the batch at once; return each one's finished hypotheses, best first.

    max_lengths (B,): the most tokens (EOS included) sentence b may produce, e.g. source length + 50;
    at that length only EOS is allowed. A hypothesis ends when EOS is among the best `beam_size`
    candidates of its step. Scores rank live hypotheses by their summed log-probability and finished
    ones by that sum over the length penalty. `formula` names the length penalty (LENGTH_PENALTIES):
    the paper's GNMT one, or |Y|^alpha. `stop` says when a sentence is done:
    - "exact": once its `beam_size` best finished hypotheses cannot be beaten by any live one (see
      `_settled`), so the search returns what an unbounded one would among the hypotheses it kept
      (tensor2tensor, the paper's code);
    - "finished": once `beam_size` of its hypotheses have finished (fairseq, CTranslate2, transformers
      with early_stopping): a live one could still have won after the length penalty, rarely (the
      same dev BLEU on Multi30k), and it takes about two thirds of exact's steps.
    A done sentence's rows leave the batch, so the steps that remain compute only for sentences
    still searching. The first step has one row per sentence (every beam would start from BOS alone);
    the decoder's reorder then spreads it to `beam_size` rows. `select` finds each step's best
    candidates (top_k, or a faster way that returns the same).
    """
    if stop not in STOPS:
        raise ValueError(f"stop must be one of {STOPS}, not {stop!r}")
    penalty = LENGTH_PENALTIES[formula]
    K = beam_size
    device = max_lengths.device
    active = list(range(batch_size))  # the batch's sentences still searching, in row order
    tokens = torch.full((batch_size, 1), bos, dtype=torch.long, device=device)
    scores = torch.zeros(batch_size, 1, device=device)  # (B, beams): 1 beam at the first step, then K
    finished: list[list[Hypothesis]] = [[] for _ in range(batch_size)]
    limits = max_lengths.tolist()
    for t in range(int(max_lengths.max())):
        B, beams = scores.shape
        lprobs = decoder.step(tokens).view(B, beams, -1)
        vocab = lprobs.size(-1)
        at_limit = [row for row, b in enumerate(active) if limits[b] <= t + 1]
        if at_limit:  # only EOS is left to these sentences' beams
            limited = torch.tensor(at_limit, device=device)
            eos_lprobs = lprobs[limited, :, eos]
            lprobs[limited] = float("-inf")
            lprobs[limited, :, eos] = eos_lprobs
        # Each sentence's best 2K extensions, (B, 2K): at most K of them end here.
        top_scores, top_beam, top_token = select(lprobs, scores, min(2 * K, beams * vocab))
        ended = top_token.eq(eos)

        # Hypotheses that end among a sentence's best K candidates are finished: gathered in one go,
        # so that Python sees a step's few, not a tensor call per hypothesis. The best K candidates that
        # did not end live on: the first K where none ended (most steps), else ended ones sort last.
        ending_row, ending_j = ended[:, :K].nonzero().unbind(1)
        if not len(ending_row):
            scores, kept_beam, kept_token = top_scores[:, :K], top_beam[:, :K], top_token[:, :K]
        else:
            ending_scores = top_scores[ending_row, ending_j].tolist()
            prefixes = tokens[ending_row * beams + top_beam[ending_row, ending_j], 1:].tolist()
            lp = penalty(t + 1, alpha)
            for row, log_prob, prefix in zip(ending_row.tolist(), ending_scores, prefixes, strict=True):
                if log_prob > float("-inf"):
                    finished[active[row]].append(Hypothesis(prefix, log_prob / lp, log_prob))
            rank = torch.arange(top_token.size(1), device=device).expand(B, -1) + ended.long() * 2 * K
            keep = rank.topk(K, dim=1, largest=False).indices
            scores, kept_beam, kept_token = (x.gather(1, keep) for x in (top_scores, top_beam, top_token))
        if stop == "finished":
            searching = [row for row, b in enumerate(active) if not (t + 1 >= limits[b] or len(finished[b]) >= K)]
        else:
            best_alive = scores[:, 0].tolist()
            searching = [row for row, b in enumerate(active) if not (
                t + 1 >= limits[b] or _settled(finished[b], K, best_alive[row], penalty(limits[b], alpha)))]
        if not searching:
            break
        order = (torch.arange(B, device=device)[:, None] * beams + kept_beam).view(-1)
        tokens = torch.cat([tokens.index_select(0, order), kept_token.reshape(-1, 1)], dim=1)
        rows = None
        if len(searching) < B:  # drop the done sentences' rows from every state
            rows = torch.tensor(searching, device=device)
            beam_rows = (rows[:, None] * K + torch.arange(K, device=device)).view(-1)
            order, tokens, scores = order[beam_rows], tokens[beam_rows], scores[rows]
            active = [active[row] for row in searching]
        decoder.reorder(order, rows)
    return [sorted(f, key=lambda h: h.score, reverse=True) for f in finished]


def _settled(finished: list[Hypothesis], k: int, best_alive_log_prob: float, largest_penalty: float) -> bool:
    """True when the k-th best finished score is at least the best score any live hypothesis can
    still reach: log-probabilities only fall as it grows, so that is its log-probability now over
    the largest length penalty it could be given (at the maximum length; penalties grow with length)."""
    if len(finished) < k:
        return False
    kth = sorted((h.score for h in finished), reverse=True)[k - 1]
    return kth >= best_alive_log_prob / largest_penalty
