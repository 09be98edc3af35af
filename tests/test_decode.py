"""After training: averaging checkpoints, decoding with beam search, the exports and the translate
command, on the model the conftest chain trains on real text."""
import dataclasses
import gc
import io

import pytest
import torch

from conftest import TINY
from pipeline import cli
from stages import average, decode, export, vocab
from stages.io import PipelineError, read_lines
from stages.model_files import list_checkpoints, read_checkpoint, read_model, write_model


def test_average_takes_the_last_n_by_step(averaged, trained):
    path, metrics = averaged
    assert metrics == {"averaged": 2, "first_step": 4, "last_step": 6}
    weights, meta = read_model(path)
    c4, c6 = (read_checkpoint(trained[0] / f"checkpoint-0000000{s}.pt").parts["model"] for s in (4, 6))
    for k in weights:
        torch.testing.assert_close(weights[k], (c4[k] + c6[k]) / 2)
    assert meta.steps == (4, 6) and meta.config == TINY


def test_average_refuses_mismatched_checkpoints():
    with pytest.raises(PipelineError, match="b: parameter w has shape"):
        average.average_state_dicts([{"w": torch.zeros(2)}, {"w": torch.zeros(3)}], ["a", "b"])


def test_decode_translates_every_line_in_order(averaged, vocab_dir, cleaned, work):
    params = decode.DecodeParams(beam_size=2, length_penalty=0.6, length_penalty_formula="gnmt", stop="finished",
                                 max_length_extra=3, batch_tokens=2000)
    metrics = decode.run(params, model_path=averaged[0], vocab_dir=vocab_dir, clean_dir=cleaned[0],
                         out_dir=work / "hyps")
    assert metrics == {"dev_sentences": 3000, "test_sentences": 3003}
    assert sum(1 for _ in read_lines(work / "hyps/test.de")) == 3003


def test_decode_batch_size_does_not_change_translations(averaged, vocab_dir, cleaned):
    model = decode.load_translator(averaged[0], torch.device("cpu"))
    lines = list(read_lines(cleaned[0] / "dev.en"))[:64]
    sp = vocab.load(vocab_dir)
    params = dict(beam_size=3, length_penalty=0.6, length_penalty_formula="gnmt", stop="finished", max_length_extra=4)
    one = decode.translate(model, sp, lines, decode.DecodeParams(batch_tokens=1, **params))  # one sentence a batch
    many = decode.translate(model, sp, lines, decode.DecodeParams(batch_tokens=10**6, **params))  # all 64 in one
    assert one == many


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_decoding_on_cpus_makes_nothing_on_torchs_default_device(averaged, vocab_dir, cleaned, precision):
    # A default device set elsewhere (a notebook's set_default_device("cuda"), TEST_DEVICE=cuda) must not
    # leak in: on "meta" any tensor made there has no data, and mixing it with the CPU's raises.
    lines, sp = list(read_lines(cleaned[0] / "dev.en"))[:8], vocab.load(vocab_dir)
    params = decode.DecodeParams(beam_size=2, length_penalty=0.6, length_penalty_formula="gnmt", stop="finished",
                                 max_length_extra=3, batch_tokens=100)
    expected = decode.translate(decode.load_translator(averaged[0], torch.device("cpu"), precision), sp, lines, params)
    with torch.device("meta"):
        model = decode.load_translator(averaged[0], torch.device("cpu"), precision)
        assert decode.translate(model, sp, lines, params) == expected


def test_translate_leaves_the_cycle_collector_as_it_found_it(averaged, vocab_dir, monkeypatch):
    model, sp = decode.load_translator(averaged[0], torch.device("cpu")), vocab.load(vocab_dir)
    params = decode.DecodeParams(beam_size=2, length_penalty=0.6, length_penalty_formula="gnmt", stop="finished",
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
        monkeypatch.setattr(decode, "beam_search", fails)
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
    packed = decode.load_translator(averaged[0], torch.device("cpu"))
    assert isinstance(packed.pre_softmax, decode.PackedPreSoftmax)
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    layers = [m for stack in (packed.encoder, packed.decoder) for m in stack.modules()
              if isinstance(m, decode.PackedLinear)]
    # self-attention's fused q, k and v and its output, the feed-forward's two; cross-attention's four
    assert len(layers) == 4 * plain.config.encoder_layers + 8 * plain.config.decoder_layers
    first, second = packed.decoder[0].ffn.net
    assert (first.activation, second.activation) == ("relu", "none")  # the ReLU in the first product
    for rows in (4, 1000):  # a step of one sentence, a step of a large batch
        x = torch.randn(rows, 1, plain.config.d_model)
        with torch.inference_mode():
            torch.testing.assert_close(packed.decoder[0].ffn(x), plain.decoder[0].ffn(x), rtol=1e-5, atol=1e-5)
    src, tgt = torch.randint(4, plain.vocab_size, (3, 9)), torch.randint(4, plain.vocab_size, (3, 6))
    with torch.inference_mode():
        torch.testing.assert_close(packed(src, tgt), plain(src, tgt), rtol=1e-5, atol=1e-5)
        # logits larger than the heap's blocks go into the decoder's buffer, the same numbers
        rows = decode.HEAP_BLOCK_LIMIT // (4 * plain.vocab_size) + 1
        x, buffer = torch.randn(rows, 1, plain.config.d_model), torch.empty(rows, 1, plain.vocab_size)
        expected = torch.nn.functional.linear(x, plain.embed.weight)
        assert packed.pre_softmax(x, packed.embed.weight, buffer).data_ptr() == buffer.data_ptr()
        torch.testing.assert_close(buffer, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.pre_softmax(x[:8], packed.embed.weight, buffer[:8]), expected[:8],
                                   rtol=1e-5, atol=1e-5)


def test_int8_model_runs_every_product_in_int8_close_to_fp32(averaged, on_cpu):
    fp32 = decode.load_translator(averaged[0], torch.device("cpu"))
    int8 = decode.load_translator(averaged[0], torch.device("cpu"), "int8")
    assert not any(isinstance(m, torch.nn.Linear) for m in int8.modules())
    assert isinstance(int8.pre_softmax.linear, decode.Int8Linear)
    src, tgt = torch.randint(4, fp32.vocab_size, (3, 9)), torch.randint(4, fp32.vocab_size, (3, 6))
    with torch.inference_mode():
        exact, approx = fp32(src, tgt), int8(src, tgt)
    error = float((exact - approx).abs().max() / exact.abs().max())
    assert 0 < error < 0.05, error  # quantized (not fp32 under another name), and no product far off


def test_int8_is_refused_off_the_cpu(averaged):
    with pytest.raises(PipelineError, match="int8 runs on CPUs only"):
        decode.load_translator(averaged[0], torch.device("meta"), "int8")


def test_decode_refuses_a_model_that_is_not_ours(tmp_path):
    (tmp_path / "m.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(PipelineError, match="not a model written by this pipeline"):
        read_model(tmp_path / "m.safetensors")


@pytest.fixture(scope="module")
def exported(averaged, vocab_dir, work):
    metrics = export.run(model_path=averaged[0], vocab_dir=vocab_dir, marian_dir=work / "exports/marian",
                         ctranslate2_dir=work / "exports/ctranslate2")
    return work / "exports", metrics


def test_exported_models_translate_like_the_decode_stage(exported, averaged, vocab_dir, cleaned):
    import ctranslate2
    from transformers import MarianMTModel, MarianTokenizer

    lines = list(read_lines(cleaned[0] / "dev.en"))[:12]
    sp = vocab.load(vocab_dir)
    ours = decode.translate(decode.load_translator(averaged[0], torch.device("cpu")), sp, lines, decode.DecodeParams(
        beam_size=1, length_penalty=0.0, length_penalty_formula="gnmt", stop="finished", max_length_extra=5,
        batch_tokens=10**6))
    hf = MarianMTModel.from_pretrained(exported[0] / "marian").eval()
    tokenizer = MarianTokenizer.from_pretrained(exported[0] / "marian")
    ct2 = ctranslate2.Translator(str(exported[0] / "ctranslate2"))
    for line, expected in zip(lines, ours, strict=True):
        inputs = tokenizer([line], return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == sp.encode(line) + [vocab.EOS_ID]
        n = len(sp.encode(line)) + 5  # the decode stage's limit: source length + max_length_extra, EOS included
        with torch.no_grad():
            out = hf.generate(**inputs, num_beams=1, do_sample=False, max_new_tokens=n)
        assert tokenizer.decode(out[0], skip_special_tokens=True) == expected
        result = ct2.translate_batch([sp.encode(line, out_type=str) + ["</s>"]], beam_size=1,
                                     max_decoding_length=n - 1)  # CTranslate2 counts tokens before EOS
        assert sp.decode(result[0].hypotheses[0]) == expected


def test_export_refuses_what_marian_cannot_express(trained, vocab_dir, tmp_path):
    checkpoint = read_checkpoint(list_checkpoints(trained[0])[-1][1])
    meta = dataclasses.replace(checkpoint.meta, config=dataclasses.replace(checkpoint.meta.config, norm="pre"))
    write_model(tmp_path / "pre.st", checkpoint.parts["model"], meta)
    with pytest.raises(PipelineError, match="cannot be written as MarianMT: model.norm is pre"):
        export.to_marian(tmp_path / "pre.st", vocab_dir, tmp_path / "marian")
    assert not (tmp_path / "marian").exists()


def test_translate_command_reads_a_file_or_stdin_and_warns_of_cut_lines(averaged, vocab_dir, cleaned, tmp_path,
                                                                       capsys, monkeypatch):
    lines = list(read_lines(cleaned[0] / "dev.en"))[:5] + ["word " * 600]  # longer than the 512 positions
    (tmp_path / "in.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = ["translate", "--model", str(averaged[0]), "--vocab-dir", str(vocab_dir), "-S", "decode.beam_size=2",
            "-S", "decode.max_length_extra=3"]
    assert cli.main([*args, str(tmp_path / "in.en")]) == 0
    out, err = capsys.readouterr()
    params = decode.DecodeParams(beam_size=2, length_penalty=0.6, length_penalty_formula="gnmt", stop="finished",
                                 max_length_extra=3, batch_tokens=8000)
    expected = decode.translate(decode.load_translator(averaged[0], torch.device("cpu")), vocab.load(vocab_dir),
                                lines, params)
    assert out.splitlines() == expected and "1 input lines were longer than the model's 511 positions" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines[:2]) + "\n"))
    assert cli.main(args) == 0
    assert capsys.readouterr().out.splitlines() == expected[:2]
    assert cli.main([*args, "-S", "train.max_steps=3"]) == 1
    assert "decode.* parameters only" in capsys.readouterr().err



def test_an_empty_line_translates_to_an_empty_line(averaged, vocab_dir, tmp_path, capsys, monkeypatch):
    searched = []
    search = decode.beam_search
    monkeypatch.setattr(decode, "beam_search", lambda d, n, *a, **k: (searched.append(n), search(d, n, *a, **k))[1])
    (tmp_path / "in.en").write_text("\nThe European Parliament.\n   \n\n", encoding="utf-8")
    args = ["translate", str(tmp_path / "in.en"), "--model", str(averaged[0]), "--vocab-dir", str(vocab_dir),
            "-S", "decode.max_length_extra=3"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out.split("\n")
    assert len(out) == 5 and out[0] == out[2] == out[3] == "" and out[4] == ""  # four lines, then the end
    assert searched == [1]  # only the sentence was searched; a model asked for an empty line says something


FREED_BYTES_KEPT = """
import ctypes, sys, torch
from stages import decode, vocab
if sys.argv[1] == "decoded":  # a line translated on the CPU first, as the decode stage does
    params = decode.DecodeParams(beam_size=2, length_penalty=0.6, length_penalty_formula="gnmt", stop="exact",
                                 max_length_extra=5, batch_tokens=100)
    decode.translate(decode.load_translator(sys.argv[2], torch.device("cpu")), vocab.load(sys.argv[3]), ["a dog"],
                     params)
x = torch.ones(4 << 20)  # 16 MB: by glibc's default a block of its own, mapped from the OS and unmapped at free
del x
libc = ctypes.CDLL("libc.so.6")
new = hasattr(libc, "mallinfo2")  # glibc 2.33 on; before it mallinfo, the same fields in ints
class MallInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t if new else ctypes.c_int)
                for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
mallinfo = libc.mallinfo2 if new else libc.mallinfo
mallinfo.restype = MallInfo
print(mallinfo().fordblks)
"""


def test_decoding_on_cpus_keeps_freed_memory_for_the_next_step(averaged, vocab_dir):
    """After the decode stage has run on the CPU, freed blocks stay in glibc's heap for the next step's
    tensors instead of going back to the OS (keep_freed_memory), which they do by default."""
    import ctypes
    import subprocess
    import sys

    try:
        ctypes.CDLL("libc.so.6").mallinfo
    except (OSError, AttributeError):
        pytest.skip("no glibc here, where keep_freed_memory does nothing (the setting and its statistics are glibc's)")
    kept = {how: int(subprocess.run([sys.executable, "-c", FREED_BYTES_KEPT, how, str(averaged[0]), str(vocab_dir)],
                                    capture_output=True, text=True, check=True).stdout)
            for how in ("default", "decoded")}
    assert kept["default"] < 16 << 20 <= kept["decoded"], kept
