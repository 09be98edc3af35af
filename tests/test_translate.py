"""The decoding engine (translate/): the cached step decoder against full forward passes, beam search
against scripted probabilities (exact tokens and scores), the Translator's batching, and each backend's
transforms against the plain model they came from, on tiny models and on the model the conftest chain
trains on real text."""
import copy
import dataclasses
import gc
import math
import threading
import time
import typing

import pytest
import torch

from conftest import BOS, EOS, PAD, freed_bytes_kept, tiny_model
from stages import decode, vocab
from stages.io import read_lines
from stages.params import DecodeParams, Precision
from translate import cpu, cpuinfo, translator as translator_module
from translate.translator import PRECISIONS, Translator
from translate.beam_search import STOPS, beam_search
from translate.cache import GrowingKVCache, SourceKVCache
from translate.translator import ModelSteps
from transformer.model import Transformer


@pytest.fixture(params=["sdpa", "products", "fused"])
def decoding_attention(request, monkeypatch):
    """Apply to a model: its decoder attending as the model does (scaled_dot_product_attention), or as
    the CPU backend does through two batched products, or through the fused kernel, whatever the size."""
    monkeypatch.setattr(cpu, "fused_attention_is_faster", lambda *shape: request.param == "fused")

    def apply(model: Transformer) -> Transformer:
        if request.param != "sdpa":
            cpu.attend_for_decoding(model)
        return model

    return apply


@pytest.mark.parametrize("variant", [{}, {"norm": "pre"}, {"positions": "learned"}, {"d_k": 4, "d_v": 12}])
def test_cached_decoding_equals_full_decoding(decoding_attention, variant):
    # The cached step (translate/step.py) writes the decoder out anew: held here to the model's forward
    # pass over whole prefixes, for each way the model can be built, two beams a sentence.
    torch.manual_seed(1)
    config = dataclasses.replace(tiny_model().config, **variant)
    model = Transformer(config, vocab_size=23, pad_id=PAD).eval()
    src = torch.randint(4, 23, (3, 8))
    src[1, 5:] = PAD
    tokens = torch.cat([torch.full((6, 1), BOS), torch.randint(4, 23, (6, 6))], dim=1)
    with torch.no_grad():
        logits = model(src.repeat_interleave(2, 0), tokens)  # each beam with its own copy of the source
        full = torch.log_softmax(logits.index_fill(-1, torch.tensor([PAD]), float("-inf")), dim=-1)
        decoder = ModelSteps(decoding_attention(copy.deepcopy(model)), src)
        steps = [decoder.step(tokens[:, : t + 1]).clone() for t in range(tokens.size(1))]  # each overwrites the last
    torch.testing.assert_close(torch.stack(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_the_cache_has_a_place_per_layer_and_reorders_without_names():
    model = tiny_model()
    src = torch.randint(4, 23, (3, 5))
    decoder = ModelSteps(model, src)  # stepped with 6 rows: two beams per sentence
    with torch.no_grad():
        decoder.step(torch.full((6, 1), BOS))
        decoder.step(torch.cat([torch.full((6, 1), BOS), torch.randint(4, 23, (6, 1))], dim=1))
    layers = decoder.cache
    assert len(layers) == len(model.decoder) == 2
    assert all(isinstance(s, GrowingKVCache) and isinstance(c, SourceKVCache) for s, c in layers)
    # Self-attention per hypothesis; cross-attention per sentence, which its beams share.
    assert layers[0][0].k.shape == (6, 4, 2, 8) and layers[0][1].k.shape == (3, 4, 5, 8)
    before = [(self_attn.k, source.k) for self_attn, source in layers]
    swap = torch.tensor([1, 0, 3, 2, 5, 4])  # beams trade places within each sentence
    decoder.reorder(swap)
    for (self_attn, source), (self_k, cross_k) in zip(layers, before):  # a sentence's beams share its source
        assert torch.equal(self_attn.k, self_k[swap]) and source.k is cross_k
    keep = torch.tensor([2, 3])  # only the second sentence is still searching
    decoder.reorder(keep, sentences=torch.tensor([1]))
    for (self_attn, source), (self_k, cross_k) in zip(layers, before):
        assert torch.equal(self_attn.k, self_k[swap][keep]) and torch.equal(source.k, cross_k[1:2])
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
        decoder = ModelSteps(model, src, use_cache=use_cache)
        lengths = src.ne(PAD).sum(1) + 5
        return beam_search(decoder, src.size(0), beam, lengths, BOS, EOS, alpha, stop=stop)


@pytest.mark.parametrize("stop", STOPS)
def test_beam_search_with_cache_equals_without(stop, decoding_attention):
    model = tiny_model(seed=3)
    src = torch.randint(4, 23, (4, 6))
    cached = _search(decoding_attention(copy.deepcopy(model)), src, 4, stop=stop)
    uncached = _search(model, src, 4, use_cache=False, stop=stop)
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


def test_a_batch_without_padding_is_decoded_without_a_mask_to_the_same_log_probabilities():
    model = tiny_model(seed=13)
    src = torch.randint(4, 23, (3, 6))  # no padding
    tokens = torch.cat([torch.full((6, 1), BOS), torch.randint(4, 23, (6, 3))], dim=1)  # two beams a sentence
    with torch.no_grad():
        unmasked, masked = ModelSteps(model, src), ModelSteps(model, src)
        assert unmasked.src_pad is None
        masked.src_pad = src.eq(PAD)  # a mask of no padding, as before there was none
        for t in range(2):
            torch.testing.assert_close(unmasked.step(tokens[:, : t + 1]), masked.step(tokens[:, : t + 1]))
        for steps in (unmasked, masked):  # the first sentence is done: its rows leave the batch
            steps.reorder(torch.tensor([2, 3, 4, 5]), sentences=torch.tensor([1, 2]))
        assert unmasked.src_pad is None and unmasked.memory.size(0) == 2
        torch.testing.assert_close(unmasked.step(tokens[2:]), masked.step(tokens[2:]))


def test_the_translator_batches_by_length_and_returns_in_order_what_each_search_finds():
    model = tiny_model(seed=3)
    sources = [[5, 6, 7], [], [8] * 9, [9, 4], [6] * 5]
    translator = Translator(copy.deepcopy(model), "cpu", bos_id=BOS, eos_id=EOS)
    done = []
    found = translator.translate_batch(sources, beam_size=3, max_length_extra=4, batch_tokens=12,
                                       progress=done.append)
    assert found[1] == [] and sum(done) == len(sources) and len(done) > 2  # the empty line first, then batches
    for ids, got in zip(sources, found):  # each as the search of it alone finds it
        if ids:
            src = torch.tensor([ids + [EOS]])
            with torch.no_grad():
                alone = beam_search(ModelSteps(model, src, never=(PAD, BOS)), 1, 3, torch.tensor([len(ids) + 4]),
                                    BOS, EOS, 0.6, "gnmt", "finished")
            assert got == alone[0][0].tokens
    assert Translator(copy.deepcopy(model), "cpu", bos_id=BOS, eos_id=EOS).translate_batch(
        [[5] * 70], max_length_extra=1)[0] is not None  # longer than the positions (64): cut, not an error


def test_threads_translating_at_once_take_turns_and_each_gets_its_own_translations():
    # A server's request threads share one Translator, whose CPU model keeps state within a step
    # (PackedOutput's logits buffer): two searches at once would read each other's logits.
    translator = Translator(tiny_model(seed=5), "cpu", bos_id=BOS, eos_id=EOS)
    requests = [[[5, 6, 7]], [[8] * 6, [9, 4]], [[6] * 5], [[4, 7, 9, 5]]]
    alone = [translator.translate_batch(sources, beam_size=3, max_length_extra=4) for sources in requests]
    encode, inside, most = translator.model.encode, [0], [0]

    def slow_encode(*args, **kwargs):  # long enough that threads not taking turns would overlap here
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.002)
        inside[0] -= 1
        return encode(*args, **kwargs)

    translator.model.encode = slow_encode
    was = gc.isenabled()
    found = [None] * len(requests)

    def serve(i):
        found[i] = translator.translate_batch(requests[i], beam_size=3, max_length_extra=4)

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 1 and found == alone
    assert gc.isenabled() is was  # each call restored the collector before the next turned it off


def test_precisions_the_loader_takes_are_the_translators():
    assert typing.get_args(Precision) == PRECISIONS
    with pytest.raises(ValueError, match="int8 runs on CPUs only, not on meta"):
        Translator(tiny_model(), "meta", "int8", bos_id=BOS, eos_id=EOS)


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
def test_the_cpus_best_candidates_are_the_full_top_k_over_beams_and_vocabulary(vocab):
    torch.manual_seed(0)
    B, beams, k = 5, 4, 8
    lprobs = torch.log_softmax(torch.randn(B, beams, vocab) * 4, dim=-1)
    lprobs[0, :, 1:] = float("-inf")  # a sentence at its length limit: one candidate per beam
    lprobs[1, 2] = -1e-3  # a row of equal sums: any of them is a right answer
    lprobs[2, :, -1] = 0.0  # the best candidates in the last chunk of every beam
    scores = torch.randn(B, beams) * 3
    full = (lprobs + scores.unsqueeze(-1)).view(B, -1)
    expected = full.topk(k, dim=1).values
    top, beam, token = cpu.best_candidates(lprobs.clone(), scores, k)
    assert torch.equal(top, expected)
    assert torch.equal(full.gather(1, beam * vocab + token), top)  # each (beam, token) has the sum reported
    for b in range(B):  # no candidate twice, unless both are -inf (more asked for than there are)
        finite = top[b] > float("-inf")
        pairs = set(zip(beam[b][finite].tolist(), token[b][finite].tolist(), strict=True))
        assert len(pairs) == int(finite.sum())




# -- the CPU backend on the model trained on real text ------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_decoding_on_cpus_makes_nothing_on_torchs_default_device(averaged, vocab_dir, cleaned, precision):
    # A default device set elsewhere (a notebook's set_default_device("cuda"), TEST_DEVICE=cuda) must not
    # leak in: on "meta" any tensor made there has no data, and mixing it with the CPU's raises.
    lines, sp = list(read_lines(cleaned[0] / "dev.en"))[:8], vocab.load(vocab_dir)
    params = DecodeParams(beam_size=2, length_penalty=0.6, length_penalty_formula="gnmt", stop="finished",
                                 max_length_extra=3, batch_tokens=100)
    expected = decode.translate(decode.load_translator(averaged[0], torch.device("cpu"), precision), sp, lines, params)
    with torch.device("meta"):
        model = decode.load_translator(averaged[0], torch.device("cpu"), precision)
        assert decode.translate(model, sp, lines, params) == expected


def test_translate_leaves_the_cycle_collector_as_it_found_it(averaged, vocab_dir, monkeypatch):
    model, sp = decode.load_translator(averaged[0], torch.device("cpu")), vocab.load(vocab_dir)
    params = DecodeParams(beam_size=2, length_penalty=0.6, length_penalty_formula="gnmt", stop="finished",
                                 max_length_extra=2, batch_tokens=100)
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            decode.translate(model, sp, ["a dog runs"], params)
            assert gc.isenabled() is enabled

        def fails(*args, **kwargs):
            assert not gc.isenabled()  # off while searching
            raise RuntimeError("the search failed")

        gc.enable()
        monkeypatch.setattr(translator_module, "beam_search", fails)
        with pytest.raises(RuntimeError, match="the search failed"):
            decode.translate(model, sp, ["a dog runs"], params)
        assert gc.isenabled()  # back on after the failure too
    finally:
        (gc.enable if was else gc.disable)()


@pytest.fixture
def on_cpu():
    """For tests of the CPU's own paths: the tensors they make go to the CPU whatever TEST_DEVICE says."""
    with torch.device("cpu"):
        yield


def test_fp32_on_cpus_runs_every_product_on_packed_weights_as_the_plain_model(averaged, on_cpu):
    plain = decode.read_transformer(averaged[0]).eval()
    packed = decode.load_translator(averaged[0], torch.device("cpu")).model
    assert isinstance(packed.output, cpu.PackedOutput)
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    layers = [m for stack in (packed.encoder, packed.decoder) for m in stack.modules()
              if isinstance(m, cpu.PackedLinear)]
    # self-attention's stacked q, k and v and its output, the feed-forward's two; cross-attention's query,
    # stacked keys and values, and output
    assert len(layers) == 4 * plain.config.encoder_layers + 7 * plain.config.decoder_layers
    first, second = packed.decoder[0].ffn.net
    assert (first.activation, second.activation) == ("relu", "none")  # the ReLU in the first product
    for rows in (4, 1000):  # a step of one sentence, a step of a large batch
        x = torch.randn(rows, 1, plain.config.d_model)
        with torch.inference_mode():
            torch.testing.assert_close(packed.decoder[0].ffn(x), plain.decoder[0].ffn(x), rtol=1e-5, atol=1e-5)
    src, tgt = torch.randint(4, plain.vocab_size, (3, 9)), torch.randint(4, plain.vocab_size, (3, 6))
    with torch.inference_mode():
        torch.testing.assert_close(packed(src, tgt), plain(src, tgt), rtol=1e-5, atol=1e-5)
        # logits larger than the heap's blocks go into a buffer kept from step to step, the same numbers
        rows = cpu.HEAP_BLOCK_LIMIT // (4 * plain.vocab_size) + 1
        x = torch.randn(rows, 1, plain.config.d_model)
        expected = torch.nn.functional.linear(x, plain.embed.weight)
        large = packed.output(x)
        torch.testing.assert_close(large, expected, rtol=1e-5, atol=1e-5)
        assert packed.output(x).data_ptr() == large.data_ptr()  # the same buffer, again
        small = packed.output(x[:8])  # through oneDNN, into a tensor of its own
        assert small.data_ptr() != large.data_ptr()
        torch.testing.assert_close(small, expected[:8], rtol=1e-5, atol=1e-5)


def test_packed_linear_takes_mkl_for_products_up_to_small_product_and_onednn_above(on_cpu, monkeypatch):
    torch.manual_seed(0)
    weight, bias = torch.randn(1024, 256), torch.randn(1024)
    by_mkl = cpu.PackedLinear(weight, bias, relu=True, small_by_mkl=True)
    onednn = cpu.PackedLinear(weight, bias, relu=True, small_by_mkl=False)
    assert by_mkl.mkl_rows == 8 == cpu.SMALL_PRODUCT // weight.numel()
    calls, addmm = [], torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda bias, x, *rest: calls.append(x.shape[0]) or addmm(bias, x, *rest))
    with torch.inference_mode():
        for module, through_mkl in ((by_mkl, [1, 8]), (onednn, [])):
            calls.clear()
            for rows in (1, 8, 9, 100):  # up to 8 rows: 2^21 multiply-adds at most
                x = torch.randn(rows, 1, 256)
                expected = (x @ weight.t() + bias).relu()  # the reference, by neither path
                torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-4)
            assert calls == through_mkl
    no_bias, x = cpu.PackedLinear(weight, None, small_by_mkl=True), torch.randn(4, 1, 256)
    with torch.inference_mode():
        torch.testing.assert_close(no_bias(x), x @ weight.t(), rtol=1e-5, atol=1e-4)
    large = cpu.PackedLinear(torch.randn(2048, 1025), None, small_by_mkl=True)  # over 2^21 multiply-adds at 1 row
    assert large.weight_t is None and not large.through_mkl(1)  # no transposed copy kept for it


def test_mkl_counts_as_fast_on_intel_cpus_only(tmp_path, monkeypatch):
    intel, amd = ("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2\n\nprocessor\t: 1\n"
                  "vendor_id\t: GenuineIntel\n", "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\n"  # no vendor_id
    assert cpuinfo.first_cpu(intel) == {"processor": "0", "vendor_id": "GenuineIntel", "flags": "fpu avx2"}
    monkeypatch.setattr(cpuinfo, "CPUINFO", tmp_path / "absent")  # not Linux: no file to read
    assert cpuinfo.first_cpu() == {}
    monkeypatch.undo()
    try:
        mkl = torch.backends.mkl.is_available()
        for text, fast in ((intel, mkl), (amd, False), (arm, False), ("", False)):
            monkeypatch.setattr(cpu, "first_cpu", lambda text=text: cpuinfo.first_cpu(text))
            cpu.mkl_is_fast.cache_clear()
            assert cpu.mkl_is_fast() == fast
    finally:
        monkeypatch.undo()
        cpu.mkl_is_fast.cache_clear()


def test_int8_model_runs_every_product_in_int8_close_to_fp32(averaged, on_cpu):
    fp32 = decode.load_translator(averaged[0], torch.device("cpu")).model
    int8 = decode.load_translator(averaged[0], torch.device("cpu"), "int8").model
    assert not any(isinstance(m, torch.nn.Linear) for m in int8.modules())
    assert isinstance(int8.output, cpu.Int8Linear)
    src, tgt = torch.randint(4, fp32.vocab_size, (3, 9)), torch.randint(4, fp32.vocab_size, (3, 6))
    with torch.inference_mode():
        exact, approx = fp32(src, tgt), int8(src, tgt)
    error = float((exact - approx).abs().max() / exact.abs().max())
    assert 0 < error < 0.05, error  # quantized (not fp32 under another name), and no product far off


@pytest.mark.skipif(not cpu.has_fp16_products(), reason="fbgemm's fp16 product is in x86 builds of PyTorch")
def test_fp16_on_cpus_computes_in_fp32_what_the_model_with_its_weights_in_fp16_does(averaged, vocab_dir, cleaned,
                                                                                     on_cpu, monkeypatch):
    plain = decode.read_transformer(averaged[0]).eval()
    rounded = decode.read_transformer(averaged[0]).eval()  # the independent reference: every matrix in fp16
    with torch.no_grad():
        for p in rounded.parameters():
            if p.dim() == 2:
                p.copy_(p.half())
    translator = decode.load_translator(averaged[0], torch.device("cpu"), "fp16")
    half = translator.model
    assert not any(isinstance(m, torch.nn.Linear) for m in half.modules())
    assert isinstance(half.output, cpu.HalfWeights)
    layers = [m for stack in (half.encoder, half.decoder) for m in stack.modules() if isinstance(m, cpu.HalfWeights)]
    assert len(layers) == 4 * plain.config.encoder_layers + 7 * plain.config.decoder_layers
    src, tgt = torch.randint(4, plain.vocab_size, (3, 9)), torch.randint(4, plain.vocab_size, (3, 6))
    with torch.inference_mode():
        for rows in (4, cpu.FEW_ROWS + 1, 1000):  # fbgemm's fp16 product, then oneDNN's on the rounded weights
            x = torch.randn(rows, 1, plain.config.d_model)
            expected = rounded.decoder[0].ffn(x)
            torch.testing.assert_close(half.decoder[0].ffn(x), expected, rtol=1e-5, atol=1e-5)
            assert not torch.allclose(plain.decoder[0].ffn(x), expected, rtol=1e-5, atol=1e-5)  # rounding changed it
            torch.testing.assert_close(half.output(x), rounded.output(x), rtol=1e-5, atol=1e-5)
        # a step of one sentence (few rows: fbgemm), and the whole batch (oneDNN)
        torch.testing.assert_close(half(src[:1], tgt[:1, :2]), rounded(src[:1], tgt[:1, :2]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(half(src, tgt), rounded(src, tgt), rtol=1e-5, atol=1e-5)
    lines, sp = list(read_lines(cleaned[0] / "dev.en"))[:8], vocab.load(vocab_dir)
    reference = Translator(rounded, "cpu", "fp32", bos_id=vocab.BOS_ID, eos_id=vocab.EOS_ID)
    rows, fbgemm = [], torch.fbgemm_linear_fp16_weight
    monkeypatch.setattr(torch, "fbgemm_linear_fp16_weight",
                        lambda x, *weights: rows.append(x[..., 0].numel()) or fbgemm(x, *weights))
    for batch_tokens in (1, 100):  # one sentence at a time (fbgemm's product) and all together (oneDNN's)
        params = DecodeParams(beam_size=4, length_penalty=0.6, length_penalty_formula="gnmt", stop="finished",
                              max_length_extra=5, batch_tokens=batch_tokens)
        assert decode.translate(translator, sp, lines, params) == decode.translate(reference, sp, lines, params)
    assert rows and max(rows) <= cpu.FEW_ROWS  # a sentence's beams took fbgemm's product, larger steps not


DECODED = """
from stages import decode, vocab
from stages.params import DecodeParams
params = DecodeParams(beam_size=2, length_penalty=0.6, length_penalty_formula="gnmt", stop="exact", max_length_extra=5,
                      batch_tokens=100)
decode.translate(decode.load_translator(sys.argv[1], torch.device("cpu")), vocab.load(sys.argv[2]), ["a dog"], params)
"""


def test_decoding_on_cpus_keeps_freed_memory_for_the_next_step(averaged, vocab_dir):
    """After the decode stage has run on the CPU (a line translated), a freed 16 MB block stays in
    glibc's heap for the next step's tensors instead of going back to the OS (cpu.keep_freed_memory),
    as it does by default."""
    kept = {how: freed_bytes_kept(prepare, 16, averaged[0], vocab_dir) for how, prepare in
            (("default", ""), ("decoded", DECODED))}
    assert kept["default"] < 16 << 20 <= kept["decoded"], kept


@pytest.mark.parametrize("budget", [1, 60, 4000])
def test_bench_turns_hold_whole_batches_that_each_system_cuts_again_alike(budget):
    """bench.decode times each system a turn of consecutive batches at a time: a turn's lines, batched
    again by a system, must be the very batches the turn was made of, so turns add up to the work of one
    run over every line."""
    from bench.peers import turns
    from translate.translator import length_batches

    lengths = [int(x) for x in torch.randint(1, 40, (300,), generator=torch.Generator().manual_seed(0))]
    batches = length_batches(lengths, budget)
    made = turns(batches, len(lengths))
    assert sorted(i for turn in made for i in turn) == list(range(len(lengths)))
    assert all(len(turn) * 10 >= len(lengths) for turn in made[:-1]) and len(made) <= 10 + 1
    again = [[turn[j] for j in batch] for turn in made for batch in length_batches([lengths[i] for i in turn], budget)]
    assert again == batches


def test_bench_compares_ours_at_a_precision_a_peer_lacks_with_that_peer_at_the_first_precision():
    """CTranslate2 has no fp16 on CPUs: bench.decode --precisions fp32,fp16 sets ours in fp16 against its
    fp32, named as such, and a peer that has the precision against ours at it only."""
    from bench.peers import SYSTEMS, Decoded, table

    lines = ["ein Hund", "eine Katze"]
    ours, peer = SYSTEMS[0], SYSTEMS[2]
    results = [Decoded(ours, "fp32", 1, 2.0, 100, lines), Decoded(peer, "fp32", 1, 1.0, 100, lines),
               Decoded(ours, "fp16", 1, 1.25, 100, lines)]
    assert table(results)[1] == ("CTranslate2 fp32: ours / this: 0.50x; "
                                 "ours fp16 against CTranslate2 fp32: ours / this: 0.80x")
    results.append(Decoded(peer, "fp16", 1, 0.5, 100, lines))
    assert table(results)[1] == "CTranslate2 fp32: ours / this: 0.50x; CTranslate2 fp16: ours / this: 0.40x"
