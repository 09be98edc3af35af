"""Translator(model, device, precision): token ids in, token ids out, by batched beam search with a
key/value cache, as CTranslate2's Translator. The precision and device choose a backend (cpu.py,
cuda.py), which transforms the model from outside and picks its kernels; the model stays the plain one."""
from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from translate import cpu, cuda
from translate.beam_search import Select, beam_search, top_k
from translate.cache import DecoderCache
from translate.step import DecoderStep
from transformer.model import Transformer

PRECISIONS = ("fp32", "bf16", "fp16", "int8")  # int8: CPUs only (cpu.Int8Linear)


class ModelSteps:
    """The beam-search view of a model over one batch of sources: next-token log-probabilities for
    each prefix, with a key/value cache (or a full forward pass each step, for testing). The beams of
    a sentence share its encoder output and cross-attention keys and values (one row per sentence, not
    per beam). The tokens in `never` (padding, and the caller's BOS) get no probability at all: they
    are taken out before the softmax, so neither the search nor the other tokens' probabilities depend
    on their rows of the shared embedding."""

    def __init__(self, model: Transformer, src: Tensor, use_cache: bool = True, never: tuple[int, ...] = ()) -> None:
        self.model = model
        self.memory, src_pad = model.encode(src, unpadded=True)  # (B, S, d_model), (B, S)
        # No mask where no source is padded (one sentence, or sentences of one length): each step's attention
        # to the source then runs without one (`python -m bench.cpu_decoding`: attention, without a mask).
        self.src_pad: Tensor | None = src_pad if bool(src_pad.any()) else None
        self.cache = DecoderCache(len(model.decoder)) if use_cache else None
        self.decoder_step = DecoderStep(model) if use_cache else None
        self.never = torch.tensor(sorted({model.pad_id, *never}), device=src.device)

    def step(self, tokens: Tensor) -> Tensor:
        """tokens (N, t), every prefix so far, N = beams x B -> log-probabilities of the next token (N,
        vocab), in a tensor the next step may overwrite."""
        if self.decoder_step is None or self.cache is None:
            logits = self.model.decode(tokens, self.memory, self.src_pad)[:, -1]
            return torch.log_softmax(logits.float().index_fill_(-1, self.never, float("-inf")), dim=-1)
        logits = self.decoder_step(tokens[:, -1:], tokens.size(1) - 1, self.memory, self.src_pad, self.cache)
        x = logits.float().index_fill_(-1, self.never, float("-inf"))
        return torch.log_softmax(x, -1, out=x)  # in place: each row is read whole before it is written

    def reorder(self, order: Tensor, sentences: Tensor | None = None) -> None:
        """Keep the hypothesis rows `order` (N,) as beam search chose them, and the sentences'
        rows `sentences` when some left the batch."""
        if sentences is not None:
            self.memory = self.memory.index_select(0, sentences)
            if self.src_pad is not None:
                self.src_pad = self.src_pad.index_select(0, sentences)
        if self.cache is not None:
            self.cache.reorder(order, sentences)


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices sorted by length and cut into batches while (sentences x longest, EOS included) fits
    the budget: sentences of similar length together, little padding."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * (lengths[i] + 1) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector off for a while: beam search makes many small lists (a step's finished
    hypotheses), which set off collections that walk every object torch and the rest have made.
    Nothing the search makes holds a cycle; any other is collected once the collector is back."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# A backend: transforms the model for decoding, in place, and says how beam search selects candidates.
Backend = Callable[[Transformer], Select]


def default_backend(device: torch.device, precision: str) -> Backend:
    """The backend of a device and precision: cpu.py's, cuda.py's, or the model as it is elsewhere."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if precision == "int8" and device.type != "cpu":
        raise ValueError(f"int8 runs on CPUs only, not on {device.type}: bf16 or fp16 there")
    if device.type == "cpu":
        return lambda model: cpu.prepare(model, precision)
    if device.type == "cuda":
        return lambda model: cuda.prepare(model, device, precision)

    def as_it_is(model: Transformer) -> Select:
        model.to(device=device, dtype=cuda.DTYPES[precision])
        return top_k

    return as_it_is


class Translator:
    """A trained model made ready to translate on `device` in `precision`, by the backend of those
    (or another given). It takes the model over: the backend's transforms change it in place.

    Calls from several threads (a server's request threads) take turns, one batch search at a time:
    the transformed model keeps state from call to call within a step (the logits PackedOutput writes
    into a kept buffer), and each call turns the cycle collector off and back as it found it. Each call
    already has every intra-op thread; more at once would only share them."""

    def __init__(self, model: Transformer, device: torch.device | str, precision: str = "fp32", *,
                 bos_id: int, eos_id: int, backend: Backend | None = None) -> None:
        device = torch.device(device)
        model.eval()
        self.select = (backend or default_backend(device, precision))(model)
        self.model, self.device, self.precision = model, device, precision
        self.bos_id, self.eos_id = bos_id, eos_id
        self._turn = threading.Lock()

    @property
    def max_input_length(self) -> int:
        """The most source tokens a sentence may have (the model's positions, less EOS's)."""
        return self.model.config.max_positions - 1

    @torch.inference_mode()
    def translate_batch(self, sources: list[list[int]], *, beam_size: int = 4, length_penalty: float = 0.6,
                        length_penalty_formula: str = "gnmt", stop: str = "finished", max_length_extra: int = 50,
                        batch_tokens: int = 8000, progress: Callable[[int], None] | None = None) -> list[list[int]]:
        """The best translation of each source (token ids without EOS), in order. Sources are cut to
        max_input_length, sorted by length and searched in batches of at most `batch_tokens` source
        tokens, padding included; an empty source translates to an empty one without a search. A
        translation has at most (source tokens + max_length_extra) tokens; `progress` is told how many
        sentences each batch finished."""
        limit = self.max_input_length
        sources = [ids[:limit] for ids in sources]
        out: list[list[int]] = [[] for _ in sources]
        todo = [i for i, ids in enumerate(sources) if ids]
        if progress is not None and len(todo) < len(sources):
            progress(len(sources) - len(todo))
        with self._turn, no_cycle_collection():
            for batch_of_todo in length_batches([len(sources[i]) for i in todo], batch_tokens):
                indices = [todo[j] for j in batch_of_todo]
                batch = [torch.tensor(sources[i] + [self.eos_id], device="cpu") for i in indices]
                src = pad_sequence(batch, batch_first=True, padding_value=self.model.pad_id).to(self.device)
                max_lengths = torch.tensor([min(len(ids) - 1 + max_length_extra, limit) for ids in batch],
                                           device=self.device).clamp(min=1)
                steps = ModelSteps(self.model, src, never=(self.model.pad_id, self.bos_id))
                found = beam_search(steps, len(batch), beam_size, max_lengths, self.bos_id, self.eos_id,
                                    length_penalty, length_penalty_formula, stop, self.select)
                for i, hypotheses in zip(indices, found, strict=True):
                    out[i] = hypotheses[0].tokens if hypotheses else []
                if progress is not None:
                    progress(len(indices))
        return out
