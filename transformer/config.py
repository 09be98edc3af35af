"""The architecture's hyperparameters: the paper's Table 3 columns, plus the choices it leaves open."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:  # (key, message): whoever loaded the values can point at the key
        raise ValueError(key, message)


@dataclass(frozen=True)
class TransformerConfig:
    """The paper's base model is 512 / 8 heads / 2048 / 6+6 / dropout 0.1; big is 1024 / 16 / 4096 / 0.3."""

    d_model: int
    n_heads: int
    d_ff: int
    encoder_layers: int
    decoder_layers: int
    dropout: float  # on embeddings and on every sub-layer's output (section 5.4)
    attention_dropout: float  # on attention weights; the paper uses none
    norm: Literal["post", "pre"]  # post: the paper's LayerNorm(x + Sublayer(x))
    positions: Literal["sinusoidal", "learned"]
    max_positions: int  # longest sequence the position encoding covers
    d_k: int | None = None  # per-head query/key size; None: d_model / n_heads, as the paper
    d_v: int | None = None  # per-head value size; None: d_model / n_heads

    def __post_init__(self) -> None:
        for key in ("d_model", "n_heads", "d_ff", "encoder_layers", "decoder_layers"):
            _check(getattr(self, key) >= 1, key, f"must be at least 1, not {getattr(self, key)}")
        for key in ("d_k", "d_v"):
            value = getattr(self, key)
            _check(value is None or value >= 1, key, f"must be at least 1 (or null: d_model / n_heads), not {value}")
        for key in ("dropout", "attention_dropout"):
            _check(0 <= getattr(self, key) < 1, key, f"is a probability in [0, 1), not {getattr(self, key)}")
        _check(self.max_positions >= 2, "max_positions", f"must hold at least BOS and EOS, not {self.max_positions}")
        _check((self.d_k is not None and self.d_v is not None) or self.d_model % self.n_heads == 0, "n_heads",
               f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}: set d_k and d_v")

    @property
    def head_dims(self) -> tuple[int, int]:
        """(d_k, d_v) with the paper's default of d_model / n_heads filled in."""
        default = self.d_model // self.n_heads
        return self.d_k or default, self.d_v or default
