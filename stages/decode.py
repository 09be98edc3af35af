"""Stage 7, decode: translate the dev and test sources with beam search (paper section 6.1: beam 4,
length penalty alpha 0.6, at most input length + 50 tokens), detokenised, in input order."""
from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from tqdm import tqdm

from stages import vocab
from stages.batching import pad
from stages.devices import HEAP_BLOCK_LIMIT, default_device, keep_freed_memory, use_fast_attention
from stages.io import (
    InputPath, OutputPath, PipelineError, atomic_write, check, read_lines, read_manifest, require_dir, split_path)
from stages.model_files import read_model
from transformer import IncrementalDecoder, Transformer, beam_search
from transformer.layers import FeedForward
from transformer.model import PreSoftmax

SPLITS = ("dev", "test")
Precision = Literal["fp32", "bf16", "fp16", "int8"]  # int8: CPUs only (see Int8Linear)
PRECISIONS: tuple[str, ...] = get_args(Precision)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DecodeParams:
    beam_size: int  # 1: greedy
    length_penalty: float  # alpha
    length_penalty_formula: Literal["gnmt", "power"]  # gnmt: ((5 + |Y|) / 6)^alpha (the paper); power: |Y|^alpha
    stop: Literal["exact", "finished"]  # when a sentence's search ends: transformer.beam_search says
    max_length_extra: int  # a translation has at most (source tokens + this) tokens
    batch_tokens: int  # source tokens per batch, padding included
    precision: Precision = "fp32"

    def __post_init__(self) -> None:
        check(self.beam_size >= 1, "beam_size", f"must be at least 1 (1: greedy), not {self.beam_size}")
        check(self.length_penalty >= 0, "length_penalty", f"alpha must be 0 or more, not {self.length_penalty}")
        check(self.max_length_extra >= 0, "max_length_extra", f"must be 0 or more, not {self.max_length_extra}")
        check(self.batch_tokens >= 1, "batch_tokens", f"must be at least 1, not {self.batch_tokens}")
        check(self.precision in PRECISIONS, "precision",
              f"must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")


def load_translator(model_path: str | Path, device: torch.device, precision: str = "fp32") -> Transformer:
    """An averaged model (.safetensors, from the average stage) or a training checkpoint (.pt), in
    decode.precision."""
    if precision == "int8" and device.type != "cpu":
        raise PipelineError(f"decode.precision int8 runs on CPUs only, not on {device.type}: bf16 or fp16 there")
    model = read_transformer(model_path)
    model.fuse_projections()
    if device.type == "cuda":
        use_fast_attention()
    if precision == "int8":
        return quantize_int8(model.eval())
    if device.type == "cpu" and precision == "fp32" and torch.backends.mkldnn.is_available():
        model.pre_softmax = PackedPreSoftmax(model.embed.weight)
        pack_linear_layers(model)
    return model.to(device=device, dtype=DTYPES[precision]).eval()


def read_transformer(model_path: str | Path) -> Transformer:
    """The model as trained (fp32, on the CPU whatever torch's default device is, in training mode), from an
    averaged model or a checkpoint: the CPU's packed layers are made from it before it moves anywhere."""
    weights, meta = read_model(model_path)
    with torch.device("cpu"):
        model = Transformer(meta.config, meta.vocab_size, vocab.PAD_ID)
    model.load_state_dict(weights)
    return model


def replace_modules(root: nn.Module, kind: type[nn.Module], make: Callable[[Any], nn.Module]) -> None:
    """Every module of type `kind` under `root` becomes make(it), in place."""
    for module in list(root.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, kind):
                setattr(module, name, make(child))


class PackedLinear(nn.Module):
    """x W^T + b through oneDNN, with W reordered once into the blocked layout its kernels read and,
    for the feed-forward's first product, the ReLU applied in the same call. MKL's sgemm, behind
    nn.Linear, packs W anew at every call (its packing routines took about 6% of decoding's samples in
    `perf`, one-off), runs its AVX2 kernel on AMD CPUs where oneDNN runs AVX-512, and leaves the ReLU
    to a pass of its own. A step's linear layers in turn ran 2.4-3.1x faster at 4 rows and 1.18-1.21x
    at 320 and 1000 (`python -m bench.cpu_decoding`, README "Speed")."""

    def __init__(self, weight: Tensor, bias: Tensor | None, relu: bool = False) -> None:
        super().__init__()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float(), None)
        self.bias = None if bias is None else bias.detach().float()
        self.activation = "relu" if relu else "none"

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, self.activation, [], "")


def pack_linear_layers(model: Transformer) -> None:
    """Every linear layer of `model` (fp32, on the CPU) as a PackedLinear, in place, each feed-forward's
    ReLU fused into its first product. The packed weights replace the plain ones: no memory besides."""
    for module in model.modules():
        if isinstance(module, FeedForward):
            first, relu, second = module.net
            assert isinstance(first, nn.Linear) and isinstance(relu, nn.ReLU) and isinstance(second, nn.Linear)
            module.net = nn.Sequential(PackedLinear(first.weight, first.bias, relu=True),
                                       PackedLinear(second.weight, second.bias))
    replace_modules(model, nn.Linear, lambda linear: PackedLinear(linear.weight, linear.bias))


class Int8Linear(nn.Module):
    """x W^T + b with W in int8, one scale per output row, and x quantized at each call (fbgemm's
    dynamic int8 product; CTranslate2's int8 scales x per row, fbgemm per product, so a sentence's
    translation can depend a little on the others in its batch). torch deprecates the quantized
    tensors this needs (a future release drops them); the int8 tests fail when it does."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        weight = weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12).double() / 127
        zero = torch.zeros_like(scales, dtype=torch.long)
        with warnings.catch_warnings():  # the deprecation above, once per process: not the user's to act on
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(weight, scales, zero, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(q, None if bias is None else bias.detach().float())

    def forward(self, x: Tensor) -> Tensor:
        # 7-bit inputs: without VNNI, x86's 8-bit product sums pairs in 16 bits, which could overflow.
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)


class LinearPreSoftmax(PreSoftmax):
    """The pre-softmax projection as a linear layer of its own over a copy of the embedding matrix
    (PackedLinear or Int8Linear), for decoding; the input embedding keeps the original."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: Tensor, weight: Tensor, out: Tensor | None = None) -> Tensor:
        return self.linear(x)  # a tensor of its own: copying it into `out` would only add a copy


class PackedPreSoftmax(LinearPreSoftmax):
    """The pre-softmax projection of fp32 decoding on CPUs: through oneDNN on packed weights while the
    logits fit in a block glibc serves from its heap (keep_freed_memory), else as PreSoftmax does, into
    the decoder's buffer. MKL's sgemm took 1.2-3x as long at a step's 8-320 rows (beams x sentences);
    above the limit each step's fresh output would be new pages from the OS, and there oneDNN was
    1.03-1.09x slower than MKL into a kept buffer (`python -m bench.cpu_decoding`, README "Speed"). The
    linear layers run through oneDNN too (PackedLinear)."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__(PackedLinear(weight, None))

    def forward(self, x: Tensor, weight: Tensor, out: Tensor | None = None) -> Tensor:
        if out is not None and out.numel() * out.element_size() > HEAP_BLOCK_LIMIT:
            return PreSoftmax.forward(self, x, weight, out)
        return self.linear(x)


def quantize_int8(model: Transformer) -> Transformer:
    """Every linear layer and the pre-softmax projection of `model` (on the CPU) in int8, in place."""
    replace_modules(model, nn.Linear, lambda linear: Int8Linear(linear.weight, linear.bias))
    model.pre_softmax = LinearPreSoftmax(Int8Linear(model.embed.weight, None))
    return model


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
    hypotheses), which set off collections that walk every object torch and the rest have made: 18
    collections, 87 ms of 5.6 s decoding test2016 in a process that had not frozen them (`gc.freeze`,
    as pipeline.stage does; one-off). Nothing the search makes holds a cycle; any other is collected
    once the collector is back."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@torch.inference_mode()
def translate(model: Transformer, sp, lines: list[str], params: DecodeParams, desc: str = "decode") -> list[str]:
    """Translate `lines`, batched by length for speed, returned in input order."""
    device = next(model.parameters()).device
    if device.type == "cpu":
        keep_freed_memory()
    limit = model.config.max_positions - 1  # room for EOS
    encoded = [ids[:limit] for ids in sp.encode(lines)]
    truncated = sum(len(ids) == limit for ids in encoded)
    if truncated:
        print(f"warning: {truncated} input lines were longer than the model's {limit} positions and were "
              f"cut to that many tokens before translating", file=sys.stderr)
    out: list[str] = [""] * len(lines)  # an empty line translates to an empty line, without a search
    bar = tqdm(total=len(lines), desc=desc, unit=" sentences", mininterval=2, file=sys.stderr)
    bar.update(sum(not ids for ids in encoded))
    todo = [i for i, ids in enumerate(encoded) if ids]
    with no_cycle_collection():
        for batch_of_todo in length_batches([len(encoded[i]) for i in todo], params.batch_tokens):
            indices = [todo[j] for j in batch_of_todo]
            batch = [encoded[i] + [vocab.EOS_ID] for i in indices]
            src = pad(batch).to(device)
            max_lengths = torch.tensor([min(len(ids) - 1 + params.max_length_extra, limit) for ids in batch],
                                       device=device).clamp(min=1)
            decoder = IncrementalDecoder(model, src, never=(vocab.PAD_ID, vocab.BOS_ID))
            hyps = beam_search(decoder, len(batch), params.beam_size, max_lengths, vocab.BOS_ID, vocab.EOS_ID,
                               params.length_penalty, params.length_penalty_formula, params.stop)
            for i, found in zip(indices, hyps, strict=True):
                out[i] = sp.decode(found[0].tokens) if found else ""
            bar.update(len(indices))
    bar.close()
    return out


def run(params: DecodeParams, *, model_path: InputPath, vocab_dir: InputPath, clean_dir: InputPath,
        out_dir: OutputPath) -> dict[str, float]:
    clean_dir = require_dir(clean_dir, "clean text (clean stage output)")
    src_lang, tgt_lang = read_manifest(clean_dir)
    model = load_translator(model_path, default_device(), params.precision)
    sp = vocab.load(vocab_dir)
    metrics: dict[str, float] = {}
    for split in SPLITS:
        lines = list(read_lines(split_path(clean_dir, split, src_lang)))
        hyps = translate(model, sp, lines, params, desc=f"decode {split}")
        with atomic_write(split_path(out_dir, split, tgt_lang)) as f:
            f.writelines(h + "\n" for h in hyps)
        metrics[f"{split}_sentences"] = len(hyps)
    return metrics
