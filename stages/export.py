"""Stage export: the averaged model in the forms people deploy, a Hugging Face MarianMT directory
(`MarianMTModel.from_pretrained` and `MarianTokenizer` load it) and a CTranslate2 model.

Marian is the paper's architecture (post-LayerNorm, sinusoidal positions with sines then cosines,
embeddings scaled by sqrt(d_model) and shared with the output projection), so the weights map one
to one. A model Marian cannot express (pre-LayerNorm, learned positions, or Table 3's d_k and d_v
rows) is not exported: the stage says why in one warning and its metrics, and the pipeline's scores
stand without it.
transformers and ctranslate2 are imported here only, so no other stage needs them.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from stages import vocab
from stages.io import InputPath, OutputPath, PipelineError
from stages.model_files import load_weights, read_model
from transformer.config import TransformerConfig
from transformer.model import Transformer

# ours -> Marian's names, per encoder / decoder layer; a stacked projection -> Marian's, one per part
_ENCODER_LAYER = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  "self_attn.out_proj": "self_attn.out_proj", "attn_block.norm": "self_attn_layer_norm",
                  "ffn.net.0": "fc1", "ffn.net.2": "fc2", "ffn_block.norm": "final_layer_norm"}
_DECODER_LAYER = {**{k: v for k, v in _ENCODER_LAYER.items() if k != "attn_block.norm"},
                  "self_block.norm": "self_attn_layer_norm", "cross_attn.q_proj": "encoder_attn.q_proj",
                  "cross_attn.kv_proj": ("encoder_attn.k_proj", "encoder_attn.v_proj"),
                  "cross_attn.out_proj": "encoder_attn.out_proj", "cross_block.norm": "encoder_attn_layer_norm"}


def marian_state_dict(weights: dict[str, torch.Tensor], encoder_layers: int,
                      decoder_layers: int) -> dict[str, torch.Tensor]:
    """Our weights (a Transformer's state dict, d_k = d_v = d_model / n_heads) under Marian's names."""
    out = {"model.shared.weight": weights["embed.weight"]}
    for side, n, table in (("encoder", encoder_layers, _ENCODER_LAYER), ("decoder", decoder_layers, _DECODER_LAYER)):
        for i in range(n):
            for ours, theirs in table.items():
                names = (theirs,) if isinstance(theirs, str) else theirs
                for leaf in ("weight", "bias"):
                    parts = weights[f"{side}.{i}.{ours}.{leaf}"].chunk(len(names))  # equal parts: d_k = d_v
                    for name, part in zip(names, parts, strict=True):
                        out[f"model.{side}.layers.{i}.{name}.{leaf}"] = part
    return out


class NotMarian(PipelineError):
    """The model's architecture is one Marian cannot express."""


def _check_expressible(config: TransformerConfig) -> None:
    problems = []
    if config.norm != "post":
        problems.append("model.norm is pre (Marian is post-LayerNorm)")
    if config.positions != "sinusoidal":
        problems.append("model.positions is learned (Marian's are sinusoidal)")
    if config.head_dims != (config.d_model // config.n_heads,) * 2:
        problems.append("d_k or d_v differs from d_model / n_heads")
    if problems:
        raise NotMarian("this model cannot be written as MarianMT: " + "; ".join(problems))


def marian_config(c: TransformerConfig, vocab_size: int):
    """Our architecture as a transformers MarianConfig."""
    from transformers import MarianConfig

    return MarianConfig(
        vocab_size=vocab_size, decoder_vocab_size=vocab_size, d_model=c.d_model,
        encoder_layers=c.encoder_layers, decoder_layers=c.decoder_layers,
        encoder_attention_heads=c.n_heads, decoder_attention_heads=c.n_heads,
        encoder_ffn_dim=c.d_ff, decoder_ffn_dim=c.d_ff, activation_function="relu",
        dropout=c.dropout, attention_dropout=c.attention_dropout, activation_dropout=0.0,
        max_position_embeddings=c.max_positions, scale_embedding=True, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, pad_token_id=vocab.PAD_ID, bos_token_id=vocab.BOS_ID, eos_token_id=vocab.EOS_ID,
        decoder_start_token_id=vocab.BOS_ID, forced_eos_token_id=vocab.EOS_ID,
    )


def to_marian(model_path: str | Path, vocab_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a MarianMT directory (config, safetensors weights, tokenizer files, generation defaults)."""
    from transformers import GenerationConfig, MarianMTModel

    weights, meta = read_model(model_path)
    c = meta.config
    _check_expressible(c)
    ours = Transformer(c, meta.vocab_size, vocab.PAD_ID)
    load_weights(ours, weights, model_path, "not the model its metadata describes")  # in today's layout
    model = MarianMTModel(marian_config(c, meta.vocab_size))
    missing, unexpected = model.load_state_dict(
        marian_state_dict(ours.state_dict(), c.encoder_layers, c.decoder_layers), strict=False)
    # Everything else is tied to the shared embedding, a zero logits bias, or computed positions.
    tied = ("embed_tokens.weight", "lm_head.weight", "embed_positions.weight", "final_logits_bias")
    left = [k for k in missing if not k.endswith(tied)]
    if left or unexpected:
        raise PipelineError(f"{model_path}: weights do not map onto MarianMT (missing {left[:3]}, "
                            f"unexpected {unexpected[:3]})")
    model.generation_config = GenerationConfig(
        decoder_start_token_id=vocab.BOS_ID, bos_token_id=vocab.BOS_ID, eos_token_id=vocab.EOS_ID,
        forced_eos_token_id=vocab.EOS_ID, pad_token_id=vocab.PAD_ID, num_beams=4, max_length=c.max_positions)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    sp = vocab.load(vocab_dir, (model_path, meta.vocab_size, meta.vocab))
    spm_file = Path(vocab_dir) / vocab.MODEL_FILE
    for name in ("source.spm", "target.spm"):  # one joint vocabulary for both sides
        shutil.copyfile(spm_file, tmp / name)
    (tmp / "vocab.json").write_text(
        json.dumps({sp.id_to_piece(i): i for i in range(sp.get_piece_size())}, ensure_ascii=False), encoding="utf-8")
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "MarianTokenizer", "model_max_length": c.max_positions,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>", "separate_vocabs": False}),
        encoding="utf-8")
    _replace_dir(tmp, out_dir)
    return out_dir


def to_ctranslate2(marian_dir: str | Path, out_dir: str | Path, quantization: str | None = None) -> Path:
    """Convert the MarianMT directory with CTranslate2's own converter, keeping our decoder start."""
    import ctranslate2
    from ctranslate2.converters import transformers as ct2_hf
    from transformers import MarianMTModel, MarianTokenizer

    class Loader(ct2_hf.MarianMTLoader):
        """CTranslate2's Marian loader assumes Opus-MT (decoding starts from a zero embedding, <pad>
        last in the vocabulary); ours starts from <s> and keeps <pad> at 0, which is plain BART."""

        def get_model_spec(self, model):
            model.config.normalize_before = False
            model.config.normalize_embedding = False
            return ct2_hf.BartLoader.get_model_spec(self, model)

        set_config = ct2_hf.BartLoader.set_config
        set_decoder = ct2_hf.BartLoader.set_decoder
        get_vocabulary = ct2_hf.BartLoader.get_vocabulary

    class Converter(ctranslate2.converters.Converter):
        def _load(self):
            # CTranslate2 reads the weights' bytes from host memory: on the CPU whatever torch's default device
            with torch.no_grad(), torch.device("cpu"):
                model = MarianMTModel.from_pretrained(marian_dir)
                return Loader()(model, MarianTokenizer.from_pretrained(marian_dir))

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    Converter().convert(str(tmp), quantization=quantization, force=True)
    _replace_dir(tmp, out_dir)
    return out_dir


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Swap a finished directory into place, so a reader never sees half an export."""
    if out_dir.exists():
        old = out_dir.with_name(out_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old)
    else:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out_dir)


def run(*, model_path: InputPath, vocab_dir: InputPath, marian_dir: OutputPath,
        ctranslate2_dir: OutputPath) -> dict[str, float | str]:
    """Both forms; for a model Marian cannot express, neither, and no earlier model's either, so
    what lies in the output folders is always this model."""
    try:
        marian = to_marian(model_path, vocab_dir, marian_dir)
    except NotMarian as e:
        for out_dir in (Path(marian_dir), Path(ctranslate2_dir)):
            shutil.rmtree(out_dir, ignore_errors=True)
            out_dir.parent.mkdir(parents=True, exist_ok=True)  # the stage's output folder, left empty
        print(f"warning: not exported: {e}")
        return {"skipped": str(e)}
    to_ctranslate2(marian, ctranslate2_dir)
    size = lambda d: sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file())  # noqa: E731
    return {"marian_mb": size(marian_dir) / 1e6, "ctranslate2_mb": size(ctranslate2_dir) / 1e6}
