"""The model alone: its masks, padding, shared embedding and state, shapes and parameter counts, loss,
schedule and FLOPs, and that it learns. Decoding it is tests/test_translate.py's."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import transformer.loss as loss_module
from translate.beam_search import beam_search
from translate.translator import ModelSteps
from transformer.attention import attention_by_products, with_stacked_projections
from transformer.config import TransformerConfig
from transformer.loss import label_smoothed_nll_loss
from transformer.model import Transformer, training_flops
from transformer.schedule import inverse_sqrt_rate, linear_decay_rate

from conftest import PAD, separate_projections, tiny_model

ROOT = Path(__file__).resolve().parents[1]

@pytest.mark.parametrize("norm", ["post", "pre"])
def test_future_target_tokens_cannot_change_earlier_outputs(norm):
    model = tiny_model(norm=norm)
    src = torch.randint(4, 23, (2, 7))
    tgt = torch.randint(4, 23, (2, 9))
    changed = tgt.clone()
    changed[:, 5:] = torch.randint(4, 23, (2, 4))
    with torch.no_grad():
        a, b = model(src, tgt), model(src, changed)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_source_padding_cannot_change_outputs(positions):
    model = tiny_model(positions=positions)
    src = torch.randint(4, 23, (1, 6))
    tgt = torch.randint(4, 23, (1, 5))
    padded = torch.cat([src, torch.full((1, 4), PAD)], dim=1)
    with torch.no_grad():
        memory, pad_mask = model.encode(padded)
        torch.testing.assert_close(model(src, tgt), model(padded, tgt))
        # what the encoder computes at padded positions must not leak into the decoder either
        memory[:, 6:] = 1e3
        torch.testing.assert_close(model.decode(tgt, memory, pad_mask), model(src, tgt))


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_the_encoder_without_padding_equals_the_padded_one(norm):
    model = tiny_model(norm=norm)
    src = torch.randint(4, 23, (3, 7))
    src[0, 4:], src[2, 1:] = PAD, PAD  # lengths 4, 7 and 1
    with torch.no_grad():
        padded, pad_mask = model.encode(src)
        unpadded, same_mask = model.encode(src, unpadded=True)
    assert torch.equal(pad_mask, same_mask)
    torch.testing.assert_close(unpadded[~pad_mask], padded[~pad_mask], atol=1e-5, rtol=1e-5)
    assert not unpadded[pad_mask].any()


def test_shared_embedding_is_the_output_projection():
    model = tiny_model()
    assert sum(p.numel() for p in model.parameters() if p.shape == (23, 32)) == 23 * 32
    assert model.output.weight is model.embed.weight
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(model.output(x), x @ model.embed.weight.t())


def test_the_state_dict_holds_the_shared_matrix_once_and_loads_back_tied():
    model, other = tiny_model(seed=1), tiny_model(seed=2)
    state = model.state_dict()
    assert "embed.weight" in state and "output.weight" not in state  # the files' format: one copy
    other.load_state_dict(state)
    assert other.output.weight is other.embed.weight and torch.equal(other.embed.weight, model.embed.weight)
    src, tgt = torch.randint(4, 23, (2, 5)), torch.randint(4, 23, (2, 4))
    with torch.no_grad():
        torch.testing.assert_close(other(src, tgt), model(src, tgt), rtol=0, atol=0)


def _torch_attention(ours, d_model: int) -> torch.nn.MultiheadAttention:
    """torch's own multi-head attention with our module's weights: its in_proj stacks q, k and v too."""
    theirs = torch.nn.MultiheadAttention(d_model, ours.n_heads, batch_first=True).eval()
    stacked = [ours.qkv_proj] if ours.self_attention else [ours.q_proj, ours.kv_proj]
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([m.weight for m in stacked]))
        theirs.in_proj_bias.copy_(torch.cat([m.bias for m in stacked]))
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        theirs.out_proj.bias.copy_(ours.out_proj.bias)
    return theirs


def test_attention_computes_what_torchs_multihead_attention_does_with_the_same_weights():
    model = tiny_model(seed=4)
    x, memory = torch.randn(3, 6, 32), torch.randn(3, 8, 32)
    padding = torch.zeros(3, 8, dtype=torch.bool)
    padding[1, 5:] = True
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)  # True: may not attend
    self_attn, cross_attn = model.decoder[0].self_attn, model.decoder[0].cross_attn
    with torch.no_grad():
        want = _torch_attention(self_attn, 32)(x, x, x, attn_mask=causal, need_weights=False)[0]
        torch.testing.assert_close(self_attn(x, causal=True), want, rtol=1e-5, atol=1e-5)
        want = _torch_attention(cross_attn, 32)(x, memory, memory, key_padding_mask=padding, need_weights=False)[0]
        torch.testing.assert_close(cross_attn(x, memory, key_padding_mask=padding), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal, queries, keys", [(True, 7, 7), (False, 7, 7), (False, 5, 9), (True, 5, 9)])
def test_attention_by_products_is_torchs_scaled_dot_product_attention(causal, queries, keys):
    """The written-out attention (the train stage's in bf16 on CPUs, decoding's on CPUs) against torch's
    kernel in float64, forward and backward, with padded keys; in bf16, within its rounding."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(3, 2, t, 16, dtype=torch.float64) for t in (queries, keys, keys))
    padding = torch.zeros(3, keys, dtype=torch.bool)
    padding[1, 4:], padding[2, 1:] = True, True  # some rows see one key only
    grad = torch.randn(3, 2, queries, 16, dtype=torch.float64)
    results = {}
    for name in ("torch", "products", "products in bf16"):
        inputs = [x.clone().to(torch.bfloat16 if "bf16" in name else x.dtype).requires_grad_() for x in (q, k, v)]
        if name == "torch":
            out = torch.nn.functional.scaled_dot_product_attention(
                *inputs, attn_mask=~padding[:, None, None, :] & torch.ones(queries, keys, dtype=torch.bool).tril()
                if causal else ~padding[:, None, None, :])
        else:
            out = attention_by_products(*inputs, padding, causal)
        out.backward(grad.to(out.dtype))
        results[name] = [out.detach().double(), *(x.grad.double() for x in inputs)]
    for want, got in zip(results["torch"], results["products"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for want, got in zip(results["torch"], results["products in bf16"], strict=True):
        assert float((got - want).norm()) <= 0.02 * float(want.norm())  # bf16 keeps 8 bits of mantissa


def test_each_stacked_projection_is_initialised_as_a_matrix_of_its_own():
    # Xavier's bound for W^Q alone (32 x 32) is sqrt(6 / 64); for a stack of r rows, sqrt(6 / (32 + r)),
    # smaller, and 1,024 draws reach past it.
    model = tiny_model(seed=2)
    for weight in (model.encoder[0].self_attn.qkv_proj.weight, model.decoder[0].cross_attn.kv_proj.weight):
        for part in weight.split(32):
            assert (6 / (32 + weight.size(0))) ** 0.5 < part.abs().max() <= (6 / 64) ** 0.5


@pytest.mark.parametrize("head_sizes", [{}, {"d_k": 4, "d_v": 12}])
def test_weights_saved_with_separate_projections_load_stacked(head_sizes):
    config = dataclasses.replace(tiny_model().config, **head_sizes)
    torch.manual_seed(5)
    model, other = Transformer(config, 23, PAD).eval(), Transformer(config, 23, PAD).eval()
    separate = separate_projections(model.state_dict(), config)
    assert "decoder.0.cross_attn.k_proj.bias" in separate and "encoder.1.self_attn.v_proj.weight" in separate
    other.load_state_dict(with_stacked_projections(other, separate))
    assert all(torch.equal(other.state_dict()[name], w) for name, w in model.state_dict().items())
    src, tgt = torch.randint(4, 23, (2, 5)), torch.randint(4, 23, (2, 4))
    with torch.no_grad():
        torch.testing.assert_close(other(src, tgt), model(src, tgt), rtol=0, atol=0)


def test_schedule_warms_up_then_decays():
    rates = [inverse_sqrt_rate(s, 512, 4000) for s in (1, 2000, 4000, 16000)]
    assert rates[0] < rates[1] < rates[2] and rates[3] == pytest.approx(rates[2] / 2)
    assert rates[2] == pytest.approx(512**-0.5 * 4000**-0.5)


def test_the_linear_decay_warms_up_alike_then_falls_in_a_line_to_zero_after_the_last_step():
    peak = 256**-0.5 * 800**-0.5
    assert [linear_decay_rate(s, 256, 800, 1400) for s in (400, 800)] == pytest.approx(
        [inverse_sqrt_rate(s, 256, 800) for s in (400, 800)])  # the paper's warm-up to the paper's peak
    assert linear_decay_rate(800, 256, 800, 1400) == pytest.approx(peak)
    assert linear_decay_rate(1100, 256, 800, 1400) == pytest.approx(peak * 301 / 601)  # halfway down
    assert linear_decay_rate(1400, 256, 800, 1400) == pytest.approx(peak / 601)  # the last step still learns
    assert linear_decay_rate(1401, 256, 800, 1400) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [3, 1000, "compiled"])
def test_label_smoothing_ignores_padding_and_matches_pytorch(monkeypatch, chunk_rows, dtype):
    """In chunks of rows, in one, and compiled (one fused pass each way, the target picked by comparison);
    bf16 logits (a bf16 step's) against PyTorch's loss of the same values in fp32."""
    loss_fn = label_smoothed_nll_loss
    if chunk_rows == "compiled":
        loss_fn = torch.compile(label_smoothed_nll_loss, dynamic=True)
    else:
        monkeypatch.setattr(loss_module, "_chunk_rows", lambda logits: chunk_rows)
    logits = torch.randn(2, 5, 11).to(dtype).requires_grad_()
    target = torch.randint(1, 11, (2, 5))
    target[1, 3:] = PAD
    loss, nll = loss_fn(logits, target, 0.1, PAD)
    flat, ce = logits.view(-1, 11).float(), torch.nn.functional.cross_entropy
    expected = ce(flat, target.view(-1), ignore_index=PAD, label_smoothing=0.1, reduction="sum")
    expected_nll = ce(flat, target.view(-1), ignore_index=PAD, reduction="sum")
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, expected_nll)
    # gradients of any combination of the two, padding rows included (they must get none)
    for a, b in ((1.0, 0.0), (0.5, 2.0), (-1.0, 0.3)):
        loss, nll = loss_fn(logits, target, 0.1, PAD)  # a graph each: a compiled one's buffers go in backward
        ours, = torch.autograd.grad(a * loss + b * nll, logits)
        theirs, = torch.autograd.grad(a * expected + b * expected_nll, logits, retain_graph=True)
        torch.testing.assert_close(ours, theirs.to(dtype))
        assert ours[1, 3:].abs().sum() == 0


BASE = TransformerConfig(512, 8, 2048, 6, 6, 0.1, 0.0, "post", "sinusoidal", 1024)
BIG = TransformerConfig(1024, 16, 4096, 6, 6, 0.3, 0.0, "post", "sinusoidal", 1024)


def count(config, vocab=37000):
    return sum(p.numel() for p in Transformer(config, vocab, PAD).parameters())


def test_paper_shapes_and_parameter_counts():
    # With a shared 37k vocabulary: base 63.1M (the paper's Table 3: 65M, -3.0%), big 214.2M (213M, +0.6%).
    # Without the embedding, the count is the architecture's alone and exact.
    d, f, L = 512, 2048, 6
    attention, ffn, norm = 4 * (d * d + d), 2 * d * f + d + f, 2 * d
    assert count(BASE) - 37000 * d == L * (attention + ffn + 2 * norm) + L * (2 * attention + ffn + 3 * norm)
    assert count(BASE) == pytest.approx(65e6, rel=0.035)
    assert count(BIG) == pytest.approx(213e6, rel=0.01)
    model = Transformer(BIG, 37000, PAD)
    assert len(model.encoder) == len(model.decoder) == 6
    assert model.decoder[0].cross_attn.q_proj.weight.shape == (1024, 1024)
    assert model.decoder[0].ffn.net[0].out_features == 4096


@pytest.mark.parametrize("row, changes, paper", [
    ("B", {"d_k": 16}, 58 - 65), ("B", {"d_k": 32}, 60 - 65),
    ("C", {"encoder_layers": 2, "decoder_layers": 2}, 36 - 65),
    ("C", {"encoder_layers": 8, "decoder_layers": 8}, 80 - 65),
    ("C", {"d_ff": 1024}, 53 - 65), ("C", {"d_ff": 4096}, 90 - 65),
])
def test_table3_variants_change_the_parameter_count_as_the_paper_says(row, changes, paper):
    # The paper's Table 3 gives counts rounded to millions; compare each row's change from base.
    assert (count(dataclasses.replace(BASE, **changes)) - count(BASE)) / 1e6 == pytest.approx(paper, abs=0.8)


def test_heads_with_their_own_key_and_value_sizes():
    config = TransformerConfig(32, 4, 64, 1, 1, 0.0, 0.0, "post", "sinusoidal", 64, d_k=4, d_v=12)
    model = Transformer(config, 23, PAD).eval()
    attn = model.encoder[0].self_attn
    assert attn.sizes == (16, 16, 48) and attn.qkv_proj.out_features == 80
    src, tgt = torch.randint(4, 23, (2, 5)), torch.randint(4, 23, (2, 4))
    assert model(src, tgt).shape == (2, 4, 23)
    with pytest.raises(ValueError, match="not divisible"):
        TransformerConfig(30, 4, 64, 1, 1, 0.0, 0.0, "post", "sinusoidal", 64)


def test_training_flops_count_every_matrix_product():
    # torch's FLOP counter sees the forward pass's products; it counts the decoder's causal attention
    # over all T x T pairs, where the model only needs the T (T + 1) / 2 at or before each position.
    from torch.utils.flop_counter import FlopCounterMode

    config = TransformerConfig(32, 4, 64, 2, 3, 0.0, 0.0, "post", "sinusoidal", 64, d_k=4, d_v=12)
    model = Transformer(config, 23, PAD)
    s, t = 7, 5
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(4, 23, (1, s)), torch.randint(4, 23, (1, t)))
    causal_saving = 2 * 4 * (4 + 12) * (t * t - t * (t + 1) // 2) * 3
    counted = counter.get_total_flops() - causal_saving
    assert training_flops(config, 23, torch.tensor([s]), torch.tensor([t])) == 3 * counted


def test_a_small_model_memorises_a_copy_task():
    torch.manual_seed(0)
    config = TransformerConfig(d_model=64, n_heads=4, d_ff=128, encoder_layers=2, decoder_layers=2, dropout=0.0,
                               attention_dropout=0.0, norm="post", positions="sinusoidal", max_positions=32)
    model = Transformer(config, vocab_size=16, pad_id=0)
    sources = torch.randint(4, 16, (24, 6))
    src = torch.cat([sources, torch.full((24, 1), 3)], dim=1)  # + EOS
    tgt_in = torch.cat([torch.full((24, 1), 2), sources], dim=1)  # BOS +
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 0.2 * inverse_sqrt_rate(done + 1, 64, 50))
    for _ in range(300):
        loss, _ = label_smoothed_nll_loss(model(src, tgt_in), src, 0.0, 0)
        optimizer.zero_grad()
        (loss / src.numel()).backward()
        optimizer.step()
        schedule.step()
    model.eval()
    with torch.no_grad():
        hyps = beam_search(ModelSteps(model, src), 24, 2, torch.full((24,), 10), 2, 3, 0.6)
    assert [h[0].tokens for h in hyps] == sources.tolist()


def test_the_model_and_its_config_know_nothing_of_kernels_files_or_decoding():
    """transformer/ is the paper's model in plain PyTorch; CPU kernels, memory and collector settings and
    decoding's buffers belong to the decoding engine (translate/), which applies them from outside."""
    import ast

    files = list((ROOT / "transformer").glob("*.py"))
    text = "\n".join(p.read_text(encoding="utf-8") for p in files)
    for word in ("mkldnn", "mallopt", "import gc", "gc.", "_is_faster", "PreSoftmax"):
        assert word not in text, word
    model = "\n".join((ROOT / f"transformer/{name}.py").read_text() for name in ("attention", "layers", "model"))
    assert "out=" not in model  # the loss writes its gradient in place; the model gives no output buffers
    imported = {alias.name.split(".")[0] for p in files for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for p in files for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "collections", "dataclasses", "math", "typing", "torch", "transformer"}, imported
    code = "import sys, transformer.config; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
