"""The model's masks, cached decoding and beam search."""
import copy
import dataclasses
import math

import pytest
import torch

from transformer import IncrementalDecoder, Transformer, TransformerConfig, beam_search, inverse_sqrt_rate
import transformer.attention as attention
import transformer.loss as loss_module
from transformer.beam_search import STOPS, best_candidates
from transformer.loss import label_smoothed_nll_loss
from transformer.model import training_flops

PAD, BOS, EOS = 0, 2, 3


def tiny_model(seed: int = 0, norm: str = "post", positions: str = "sinusoidal") -> Transformer:
    torch.manual_seed(seed)
    config = TransformerConfig(d_model=32, n_heads=4, d_ff=64, encoder_layers=2, decoder_layers=2, dropout=0.0,
                               attention_dropout=0.0, norm=norm, positions=positions, max_positions=64)
    model = Transformer(config, vocab_size=23, pad_id=PAD).eval()
    with torch.no_grad():  # make the model opinionated, so different inputs give clearly different outputs
        model.embed.weight.mul_(4)
    return model


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


@pytest.fixture(params=["products", "fused"])
def decoding_attention(request, monkeypatch):
    """Decoding's attention through two batched products, then through the fused kernel, whatever the size."""
    monkeypatch.setattr(attention, "fused_decoding_is_faster", lambda *shape: request.param == "fused")


@pytest.mark.usefixtures("decoding_attention")
def test_cached_decoding_equals_full_decoding():
    model = tiny_model()
    src = torch.randint(4, 23, (3, 8))
    src[1, 5:] = PAD
    tokens = torch.cat([torch.full((3, 1), BOS), torch.randint(4, 23, (3, 6))], dim=1)
    with torch.no_grad():
        full = torch.log_softmax(model(src, tokens).index_fill(-1, torch.tensor([PAD]), float("-inf")), dim=-1)
        decoder = IncrementalDecoder(model, src)
        steps = [decoder.step(tokens[:, : t + 1]).clone() for t in range(tokens.size(1))]  # each overwrites the last
    torch.testing.assert_close(torch.stack(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_the_cache_has_a_place_per_layer_and_reorders_without_names():
    model = tiny_model()
    src = torch.randint(4, 23, (3, 5))
    decoder = IncrementalDecoder(model, src)  # stepped with 6 rows: two beams per sentence
    with torch.no_grad():
        decoder.step(torch.full((6, 1), BOS))
        decoder.step(torch.cat([torch.full((6, 1), BOS), torch.randint(4, 23, (6, 1))], dim=1))
    layers = decoder.cache.layers
    assert len(layers) == len(model.decoder) == 2
    # Self-attention per hypothesis; cross-attention per sentence, which its beams share.
    assert layers[0].self_attn.k.shape == (6, 4, 2, 8) and layers[0].cross_attn.k.shape == (3, 4, 5, 8)
    before = [(layer.self_attn.k, layer.cross_attn.k) for layer in layers]
    swap = torch.tensor([1, 0, 3, 2, 5, 4])  # beams trade places within each sentence
    decoder.reorder(swap)
    for layer, (self_k, cross_k) in zip(layers, before):  # a sentence's beams share its source: left alone
        assert torch.equal(layer.self_attn.k, self_k[swap]) and layer.cross_attn.k is cross_k
    keep = torch.tensor([2, 3])  # only the second sentence is still searching
    decoder.reorder(keep, sentences=torch.tensor([1]))
    for layer, (self_k, cross_k) in zip(layers, before):
        assert torch.equal(layer.self_attn.k, self_k[swap][keep]) and torch.equal(layer.cross_attn.k, cross_k[1:2])
    assert decoder.memory.shape[0] == 1


def test_beams_sharing_a_source_row_attend_as_if_it_were_repeated():
    model = tiny_model(seed=7)
    src = torch.randint(4, 23, (3, 6))
    src[2, 4:] = PAD
    tokens = torch.randint(4, 23, (6, 4))  # two hypotheses of each sentence
    with torch.no_grad():
        memory, src_pad = model.encode(src)
        shared = model.decode(tokens, memory, src_pad)
        repeated = model.decode(tokens, memory.repeat_interleave(2, 0), src_pad.repeat_interleave(2, 0))
    torch.testing.assert_close(shared, repeated, atol=1e-5, rtol=1e-5)


def _search(model, src, beam, use_cache=True, alpha=0.6, stop="exact"):
    with torch.no_grad():
        decoder = IncrementalDecoder(model, src, use_cache=use_cache)
        lengths = src.ne(PAD).sum(1) + 5
        return beam_search(decoder, src.size(0), beam, lengths, BOS, EOS, alpha, stop=stop)


@pytest.mark.usefixtures("decoding_attention")
@pytest.mark.parametrize("stop", STOPS)
def test_beam_search_with_cache_equals_without(stop):
    model = tiny_model(seed=3)
    src = torch.randint(4, 23, (4, 6))
    cached, uncached = _search(model, src, 4, stop=stop), _search(model, src, 4, use_cache=False, stop=stop)
    assert [[h.tokens for h in hs] for hs in cached] == [[h.tokens for h in hs] for hs in uncached]
    for a, b in zip(cached, uncached):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


@pytest.mark.parametrize("stop", STOPS)
def test_batched_beam_search_equals_one_by_one(stop):
    model = tiny_model(seed=5)
    sentences = [torch.randint(4, 23, (n,)) for n in (3, 7, 5, 1, 6)]
    batch = torch.full((len(sentences), 7), PAD)
    for i, s in enumerate(sentences):
        batch[i, : len(s)] = s
    together = _search(model, batch, 4, stop=stop)
    for s, hyps in zip(sentences, together):
        alone = _search(model, s[None], 4, stop=stop)[0]
        assert alone[0].tokens == hyps[0].tokens
        assert alone[0].score == pytest.approx(hyps[0].score, abs=1e-4)


@pytest.mark.parametrize("head_sizes", [{}, {"d_k": 4, "d_v": 12}])
def test_fused_self_attention_projections_compute_what_the_three_did(head_sizes):
    model = tiny_model(seed=9)
    if head_sizes:
        torch.manual_seed(9)
        model = Transformer(dataclasses.replace(model.config, **head_sizes), vocab_size=23, pad_id=PAD).eval()
    fused = copy.deepcopy(model)
    fused.fuse_projections()
    fused.fuse_projections()  # already fused: nothing more to do
    for layer in (*fused.encoder, *fused.decoder):
        assert not hasattr(layer.self_attn, "q_proj") and layer.self_attn.qkv_proj is not None
    assert fused.decoder[0].cross_attn.qkv_proj is None  # keys and values from the source: not fusable
    src = torch.randint(4, 23, (3, 7))
    src[1, 4:] = PAD
    tokens = torch.cat([torch.full((3, 1), BOS), torch.randint(4, 23, (3, 5))], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(fused(src, tokens), model(src, tokens), atol=1e-5, rtol=1e-5)
        for unpadded in (False, True):
            torch.testing.assert_close(fused.encode(src, unpadded)[0], model.encode(src, unpadded)[0],
                                       atol=1e-5, rtol=1e-5)
        steps = {}
        for m in (model, fused):
            decoder = IncrementalDecoder(m, src)
            steps[m] = torch.stack([decoder.step(tokens[:, : t + 1]).clone() for t in range(tokens.size(1))], 1)
        torch.testing.assert_close(steps[fused], steps[model], atol=1e-5, rtol=1e-5)
    assert [[h.tokens for h in hs] for hs in _search(fused, src, 4)] == \
        [[h.tokens for h in hs] for hs in _search(model, src, 4)]


class ScriptedDecoder:
    """Next-token log-probabilities that depend only on the last token, from a fixed table."""

    def __init__(self, table: dict[int, dict[int, float]], vocab: int = 6) -> None:
        self.rows = {}
        for prev, probs in table.items():
            row = torch.full((vocab,), float("-inf"))
            for tok, p in probs.items():
                row[tok] = math.log(p)
            self.rows[prev] = row

    def step(self, tokens):  # a prefix the table does not know (kept at -inf by the search) can only end
        dead = torch.full_like(self.rows[BOS], float("-inf")).index_fill_(0, torch.tensor([EOS]), 0.0)
        return torch.stack([self.rows.get(int(t), dead) for t in tokens[:, -1]])

    def reorder(self, order, sentences):
        pass


@pytest.mark.parametrize("formula, penalty", [("gnmt", lambda n, a: ((5 + n) / 6) ** a), ("power", lambda n, a: n**a)])
def test_length_penalty_decides_between_short_and_long(formula, penalty):
    # After BOS: EOS at once (p=.45), token 4 (p=.35) or 5 (p=.2); after 4: 5 (p=1); after 5: EOS (p=1).
    decoder = ScriptedDecoder({BOS: {EOS: 0.45, 4: 0.35, 5: 0.2}, 4: {5: 1.0}, 5: {EOS: 1.0}})
    winners = {}
    for alpha in (0.0, 0.6, 1.0):
        hyps = beam_search(decoder, 1, 2, torch.tensor([10]), BOS, EOS, alpha, formula)[0]
        by_tokens = {tuple(h.tokens): h for h in hyps}
        short, long = by_tokens[()], by_tokens[(4, 5)]
        assert short.score == pytest.approx(math.log(0.45) / penalty(1, alpha))  # EOS first: |Y| = 1
        assert long.score == pytest.approx(math.log(0.35) / penalty(3, alpha))
        winners[alpha] = hyps[0].tokens
    # log .45 / lp(1) against log .35 / lp(3): the short one wins without a penalty, the long one with alpha 1;
    # at 0.6 the GNMT penalty is too mild to turn it, |Y|^0.6 is not
    assert winners == {0.0: [], 0.6: [] if formula == "gnmt" else [4, 5], 1.0: [4, 5]}


def test_maximum_length_forces_the_end():
    decoder = ScriptedDecoder({BOS: {4: 0.9, EOS: 0.1}, 4: {4: 0.9, EOS: 0.1}})
    best = beam_search(decoder, 1, 1, torch.tensor([3]), BOS, EOS, 0.6)[0][0]
    assert best.tokens == [4, 4]  # two tokens, then EOS as the third and last


def test_schedule_warms_up_then_decays():
    rates = [inverse_sqrt_rate(s, 512, 4000) for s in (1, 2000, 4000, 16000)]
    assert rates[0] < rates[1] < rates[2] and rates[3] == pytest.approx(rates[2] / 2)
    assert rates[2] == pytest.approx(512**-0.5 * 4000**-0.5)


@pytest.mark.parametrize("chunk_rows", [3, 1000])
def test_label_smoothing_ignores_padding_and_matches_pytorch(monkeypatch, chunk_rows):
    monkeypatch.setattr(loss_module, "_chunk_rows", lambda logits: chunk_rows)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    target = torch.randint(1, 11, (2, 5))
    target[1, 3:] = PAD
    loss, nll = label_smoothed_nll_loss(logits, target, 0.1, PAD)
    flat, ce = logits.view(-1, 11), torch.nn.functional.cross_entropy
    expected = ce(flat, target.view(-1), ignore_index=PAD, label_smoothing=0.1, reduction="sum")
    expected_nll = ce(flat, target.view(-1), ignore_index=PAD, reduction="sum")
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, expected_nll)
    # gradients of any combination of the two, padding rows included (they must get none)
    for a, b in ((1.0, 0.0), (0.5, 2.0), (-1.0, 0.3)):
        ours, = torch.autograd.grad(a * loss + b * nll, logits, retain_graph=True)
        theirs, = torch.autograd.grad(a * expected + b * expected_nll, logits, retain_graph=True)
        torch.testing.assert_close(ours, theirs)
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
    assert attn.q_proj.out_features == attn.k_proj.out_features == 16 and attn.v_proj.out_features == 48
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


def test_search_does_not_stop_before_a_better_hypothesis_can_finish():
    # Two weak hypotheses end first ([] at step 1, [5] at step 2); the best, [4, 6], ends at step 3.
    decoder = ScriptedDecoder({BOS: {4: 0.5, EOS: 0.3, 5: 0.2}, 4: {6: 0.99, EOS: 0.01}, 5: {EOS: 1.0},
                               6: {EOS: 0.9, 4: 0.1}}, vocab=8)
    for alpha in (0.0, 0.6):
        best = beam_search(decoder, 1, 2, torch.tensor([10]), BOS, EOS, alpha)[0][0]
        assert best.tokens == [4, 6]
        assert best.log_prob == pytest.approx(math.log(0.5 * 0.99 * 0.9))


def test_the_finished_rule_stops_once_beam_size_hypotheses_ended():
    # As above: [] ends at step 1 and [5] at step 2, so with beam 2 "finished" stops there, before the
    # better [4, 6] can end at step 3; "exact" waits for it.
    decoder = ScriptedDecoder({BOS: {4: 0.5, EOS: 0.3, 5: 0.2}, 4: {6: 0.99, EOS: 0.01}, 5: {EOS: 1.0},
                               6: {EOS: 0.9, 4: 0.1}}, vocab=8)
    found = beam_search(decoder, 1, 2, torch.tensor([10]), BOS, EOS, 0.0, stop="finished")[0]
    assert [h.tokens for h in found] == [[], [5]]
    assert beam_search(decoder, 1, 2, torch.tensor([10]), BOS, EOS, 0.0, stop="exact")[0][0].tokens == [4, 6]
    with pytest.raises(ValueError, match="stop must be one of"):
        beam_search(decoder, 1, 2, torch.tensor([10]), BOS, EOS, 0.0, stop="early")


@pytest.mark.parametrize("vocab", [8000, 37000, 8008, 23])  # chunks of 64, 200 and 104 tokens; 23: a full top-k
def test_best_candidates_are_the_full_top_k_over_beams_and_vocabulary(vocab):
    torch.manual_seed(0)
    B, beams, k = 5, 4, 8
    lprobs = torch.log_softmax(torch.randn(B, beams, vocab) * 4, dim=-1)
    lprobs[0, :, 1:] = float("-inf")  # a sentence at its length limit: one candidate per beam
    lprobs[1, 2] = -1e-3  # a row of equal sums: any of them is a right answer
    lprobs[2, :, -1] = 0.0  # the best candidates in the last chunk of every beam
    scores = torch.randn(B, beams) * 3
    full = (lprobs + scores.unsqueeze(-1)).view(B, -1)
    expected = full.topk(k, dim=1).values
    top, beam, token = best_candidates(lprobs.clone(), scores, k)
    assert torch.equal(top, expected)
    assert torch.equal(full.gather(1, beam * vocab + token), top)  # each (beam, token) has the sum reported
    for b in range(B):  # no candidate twice, unless both are -inf (more asked for than there are)
        finite = top[b] > float("-inf")
        pairs = set(zip(beam[b][finite].tolist(), token[b][finite].tolist(), strict=True))
        assert len(pairs) == int(finite.sum())


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
        hyps = beam_search(IncrementalDecoder(model, src), 24, 2, torch.full((24,), 10), 2, 3, 0.6)
    assert [h[0].tokens for h in hyps] == sources.tolist()
