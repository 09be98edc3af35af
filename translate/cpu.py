"""Decoding on CPUs: fp32 on oneDNN's packed weights (small products through MKL on Intel CPUs), fp16
weights with fp32 arithmetic, or int8 on fbgemm's; attention and the beam's candidate selection as they
run fastest there; glibc told to keep freed memory. Each a transform of the trained model; `prepare`
applies those of a precision. `python -m bench.cpu_decoding` measures each against PyTorch's own way,
alone and in decoding, and `python -m bench.decode` the whole against CTranslate2."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from translate.beam_search import Select, top_k
from translate.cpuinfo import first_cpu
from translate.transforms import replace_modules, swap_class
from transformer.attention import MultiHeadAttention, attention_by_products
from transformer.layers import FeedForward
from transformer.model import Transformer

HEAP_BLOCK_LIMIT = 32 << 20  # bytes: the largest block glibc can be told to serve from its heap


@functools.cache  # once a process: finding the C library runs ldconfig
def keep_freed_memory() -> None:
    """Make glibc serve blocks up to HEAP_BLOCK_LIMIT from its heap and keep what is freed there,
    instead of mapping fresh pages from the OS (each zeroed by the kernel on first touch) and returning
    them at each free: beam search allocates and frees tensors of a few MB every step. The process
    keeps its peak memory instead. No-op without glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is not None:
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        mallopt(m_mmap_threshold, HEAP_BLOCK_LIMIT)
        mallopt(m_trim_threshold, 1 << 30)


# Multiply-adds (rows x inputs x outputs) up to which MKL's product beats oneDNN's on packed weights, on
# Intel CPUs: oneDNN's kernel is quick (3 us for 4 x 256 x 16, by ONEDNN_VERBOSE), but torch's call around
# it takes about 20 us, more than MKL's whole product of this size (`python -m bench.cpu_decoding`: linear
# layers, against oneDNN alone). A step of one sentence's beams at Multi30k's width is all such products.
SMALL_PRODUCT = 1 << 21


@functools.cache
def mkl_is_fast() -> bool:
    """Whether MKL, behind nn.Linear in torch's x86 builds, runs its own kernels here: on Intel CPUs. On
    others it takes generic ones: on 2 AMD EPYC cores a decoding step's products at 4 rows ran 1.32x slower
    through it than through oneDNN on packed weights (`python -m bench.cpu_decoding`: linear layers)."""
    return torch.backends.mkl.is_available() and first_cpu().get("vendor_id") == "GenuineIntel"


class PackedLinear(nn.Module):
    """x W^T + b through oneDNN, with W reordered once into the blocked layout its kernels read and,
    for the feed-forward's first product, the ReLU applied in the same call. MKL's sgemm, behind
    nn.Linear, packs W anew at every call and leaves the ReLU to a pass of its own (`python -m
    bench.cpu_decoding`: linear layers). Where MKL is fast (`small_by_mkl`, by default mkl_is_fast),
    products of at most SMALL_PRODUCT multiply-adds run through it instead, on W^T kept contiguous beside
    the packed copy (for no weight of more than SMALL_PRODUCT elements), which MKL reads faster than W
    through nn.Linear's transposed view: on one thread a step's layers at 4 and 8 rows 1.10x and 1.30x
    nn.Linear's speed, on two within the noise (`python -m bench.cpu_decoding`: linear layers)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, relu: bool = False,
                 small_by_mkl: bool | None = None) -> None:
        super().__init__()
        weight = weight.detach().float()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if bias is None else bias.detach().float()
        self.activation = "relu" if relu else "none"
        by_mkl = mkl_is_fast() if small_by_mkl is None else small_by_mkl
        self.mkl_rows = SMALL_PRODUCT // weight.numel() if by_mkl else 0  # the most rows a product MKL runs has
        self.weight_t = weight.t().contiguous() if self.mkl_rows else None  # only where some product can use it

    def through_mkl(self, rows: int) -> bool:
        """Whether a product of `rows` rows runs through MKL."""
        return 0 < rows <= self.mkl_rows

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // x.size(-1)
        if self.weight_t is not None and self.through_mkl(rows):
            flat = x.reshape(rows, x.size(-1))
            y = torch.mm(flat, self.weight_t) if self.bias is None else torch.addmm(self.bias, flat, self.weight_t)
            y = y.view(*x.shape[:-1], y.size(-1))
            return y.relu_() if self.activation == "relu" else y
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, self.activation, [], "")


class PackedOutput(nn.Module):
    """The pre-softmax projection for fp32 decoding: through oneDNN on packed weights (PackedLinear)
    while the logits fit in a block glibc serves from its heap (keep_freed_memory); above that, MKL
    writes them into a buffer kept from step to step, where a fresh tensor would be new pages from the
    OS at every step (`python -m bench.cpu_decoding`: the pre-softmax projection). The logits it
    returns are that buffer when they are large: the next call overwrites them, as decoding allows."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = weight.detach()
        self.packed = PackedLinear(weight, None) if torch.backends.mkldnn.is_available() else None
        self.buffer: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        """x (..., d_model) -> logits (..., vocab)."""
        shape = (*x.shape[:-1], self.weight.size(0))
        size = x.numel() // x.size(-1) * self.weight.size(0)
        if self.packed is not None and size * self.weight.element_size() <= HEAP_BLOCK_LIMIT:
            return self.packed(x)
        if self.buffer is None or self.buffer.numel() < size:
            self.buffer = self.weight.new_empty(size)
        return torch.matmul(x, self.weight.t(), out=self.buffer[:size].view(shape))


# Rows up to which fbgemm's fp16 product beats oneDNN's fp32 one on the same weights: a step of one or
# two sentences' beams, where a product has little arithmetic (`python -m bench.cpu_decoding`: linear layers).
FEW_ROWS = 8


class HalfWeights(nn.Module):
    """x W^T + b with W rounded to fp16 and the arithmetic in fp32 (decode.precision fp16 on CPUs): at up
    to FEW_ROWS rows fbgemm's product, which widens the fp16 weights as it reads them, so a step of one
    sentence reads half the bytes; above, `wide` on the same rounded weights in fp32 (PackedLinear or
    PackedOutput), where the products are bound by arithmetic. Either way the numbers are those of the
    model with its weights in fp16. torch deprecates fbgemm's fp16 product (a future release drops it);
    the fp16 tests fail when it does."""

    def __init__(self, weight: Tensor, bias: Tensor | None, wide: Callable[[Tensor, Tensor | None], nn.Module],
                 relu: bool = False) -> None:
        super().__init__()
        rounded = weight.detach().to(torch.float16).float()
        self.bias = rounded.new_zeros(rounded.size(0)) if bias is None else bias.detach().float()
        self.wide = wide(rounded, None if bias is None else self.bias)
        self.relu = relu
        with warnings.catch_warnings():  # the deprecation above, once per process: not the user's to act on
            warnings.simplefilter("ignore", UserWarning)
            self.packed = torch.fbgemm_pack_gemm_matrix_fp16(rounded)
            self.narrow(rounded.new_zeros(1, rounded.size(1)))

    def narrow(self, x: Tensor) -> Tensor:
        """fbgemm's product, at any number of rows."""
        y = torch.fbgemm_linear_fp16_weight(x, self.packed, self.bias)
        return y.relu_() if self.relu else y

    def forward(self, x: Tensor) -> Tensor:
        return self.narrow(x) if x.numel() <= FEW_ROWS * x.size(-1) else self.wide(x)


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


def fused_attention_is_faster(queries: int, per_matrix: int, keys: int) -> bool:
    """Whether a decoding step attends faster with the fused kernel than with two batched products:
    `queries` in all (rows x heads), `per_matrix` of them to each set of `keys` (1 in self-attention,
    where each row has its own keys; the beams in attention to the source, which they share). The
    fused kernel's one call wins at few queries; the products win above, except in self-attention
    against fewer than 8 keys, which MKL's batched product runs slowly (`python -m bench.cpu_decoding`:
    attention)."""
    return queries <= 128 or (per_matrix == 1 and keys < 8)


class DecodingAttention(MultiHeadAttention):
    """A decoder's attention, for decoding on CPUs: where fused_attention_is_faster says so, two
    batched products (attention_by_products) instead of scaled_dot_product_attention."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool) -> Tensor:
        if causal or self.training or fused_attention_is_faster(q.numel() // q.size(-1), q.size(2), k.size(2)):
            return super().attend(q, k, v, key_padding_mask, causal)
        return attention_by_products(q, k, v, key_padding_mask)


def _chunk_size(vocab: int) -> int | None:
    """64 tokens where that divides `vocab`, else the largest multiple of 8 (AVX2's float lanes) from 32
    to 256 that does, if any: the chunks' maxima cost the most, and torch's row maximum is fastest at
    64 floats (`python -m bench.cpu_decoding`: selection)."""
    if vocab % 64 == 0:
        return 64
    return next((c for c in range(256, 31, -8) if vocab % c == 0), None)


def best_candidates(lprobs: Tensor, scores: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """What top_k returns, found faster on CPUs: a full top-k over beams x vocabulary sums runs at a
    fraction of memory speed there (torch sorts each row's candidates with their indices). So each row
    is cut into chunks of c tokens, the chunks ranked by their best sum (one vectorised pass) and only
    the k best chunks searched: each of the k best sums lies in a chunk whose best is at least that
    sum, and fewer than k chunks have a better best (between equal sums either may be chosen, as in a
    full top-k)."""
    B, beams, vocab = lprobs.shape
    c = _chunk_size(vocab)
    if c is None or beams * vocab // c < k:
        return top_k(lprobs, scores, k)
    chunk_best = lprobs.view(B, beams, vocab // c, c).amax(-1).add_(scores.unsqueeze(-1))  # (B, beams, vocab / c)
    chunks = chunk_best.view(B, -1).topk(k, dim=1).indices  # (B, k), numbered across the beams
    index = (chunks.unsqueeze(-1) * c + torch.arange(c, device=lprobs.device)).view(B, k * c)  # into beams x vocab
    sums = lprobs.view(B, beams * vocab).gather(1, index).add_(scores.gather(1, index // vocab))
    top, j = sums.topk(k, dim=1)
    index = index.gather(1, j)
    return top, index // vocab, index % vocab


def pack_output(model: Transformer) -> None:
    """The output projection (fp32) as a PackedOutput, in place."""
    model.output = PackedOutput(model.embed.weight)


Product = Callable[..., nn.Module]  # (weight, bias, relu=False) -> the module that computes x W^T + b


def pack_linear_layers(model: Transformer, product: Product = PackedLinear) -> None:
    """Every linear layer but the output projection as a PackedLinear (or `product`), in place, each
    feed-forward's ReLU fused into its first product. The packed weights replace the plain ones."""
    for module in model.modules():
        if isinstance(module, FeedForward):
            first, relu, second = module.net
            assert isinstance(first, nn.Linear) and isinstance(relu, nn.ReLU) and isinstance(second, nn.Linear)
            module.net = nn.Sequential(product(first.weight, first.bias, relu=True),
                                       product(second.weight, second.bias))
    replace_modules(model.encoder, nn.Linear, lambda linear: product(linear.weight, linear.bias))
    replace_modules(model.decoder, nn.Linear, lambda linear: product(linear.weight, linear.bias))


def half_weights(weight: Tensor, bias: Tensor | None, relu: bool = False) -> HalfWeights:
    """A linear layer as HalfWeights, PackedLinear above FEW_ROWS rows."""
    return HalfWeights(weight, bias, lambda rounded, b: PackedLinear(rounded, b, relu), relu)


def round_weights_to_fp16(model: Transformer) -> None:
    """Every linear layer and the output projection as HalfWeights, in place (the shared embedding's
    rows rounded too, so that the whole model is the one with its weights in fp16)."""
    pack_linear_layers(model, half_weights)
    with torch.no_grad():
        model.embed.weight.copy_(model.embed.weight.half())
    model.output = HalfWeights(model.embed.weight, None, lambda rounded, _: PackedOutput(rounded))


def quantize_int8(model: Transformer) -> None:
    """Every linear layer and the output projection in int8 (Int8Linear), in place."""
    replace_modules(model, nn.Linear, lambda linear: Int8Linear(linear.weight, linear.bias))


def attend_for_decoding(model: Transformer) -> None:
    """The decoder's attention as DecodingAttention; the encoder's, which attends once a batch, as it is."""
    for module in model.decoder.modules():
        if type(module) is MultiHeadAttention:
            swap_class(module, DecodingAttention)


def has_fp16_products() -> bool:
    """Whether this PyTorch has fbgemm's fp16 product (x86 builds); elsewhere fp16 is the model in fp16."""
    return "fbgemm" in torch.backends.quantized.supported_engines and torch.backends.mkldnn.is_available()


def prepare(model: Transformer, precision: str) -> Select:
    """Apply the CPU's transforms for `precision` to `model` (fp32, on the CPU); return the beam's
    candidate selection to use with it."""
    keep_freed_memory()
    attend_for_decoding(model)
    if precision == "int8":
        quantize_int8(model)
    elif precision == "fp16" and has_fp16_products():
        round_weights_to_fp16(model)
    elif precision == "fp32":
        pack_output(model)
        if torch.backends.mkldnn.is_available():
            pack_linear_layers(model)
    else:
        model.to(dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[precision])
    return best_candidates
