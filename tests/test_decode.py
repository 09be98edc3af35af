"""After training: averaging checkpoints, the decode stage, the exports and the translate command, on
the model the conftest chain trains on real text (the decoding engine itself: tests/test_translate.py)."""
import dataclasses
import io
import re
import shutil
import weakref

import pytest
import torch

from conftest import ROOT, TINY, another_vocabulary, separate_projections
from pipeline import cli
from stages import average, decode, export, vocab
from stages.io import MANIFEST, PipelineError, read_lines
from stages.model_files import list_checkpoints, read_checkpoint, read_model, write_model
from translate import translator as translator_module


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
        average.average_state_dicts([("a", {"w": torch.zeros(2)}), ("b", {"w": torch.zeros(3)})])
    with pytest.raises(PipelineError, match="b: its parameters differ from a's"):
        average.average_state_dicts([("a", {"w": torch.zeros(2)}), ("b", {"v": torch.zeros(2)})])


def test_average_reads_one_checkpoint_at_a_time_mapped(trained, tmp_path, monkeypatch):
    """Big averages its last 20 checkpoints, each its model and Adam's two moments: all held at once they
    would be 60 models in memory. Each is read mapped (the moments never read from disk), and an earlier
    one is let go before the next is read."""
    held, how = [], []

    def read(path, mapped=False):
        held[:] = [tensor for tensor in held if tensor() is not None]
        assert not held[:-1], f"{len(held)} earlier checkpoints still held when {path.name} is read"
        how.append(mapped)
        checkpoint = read_checkpoint(path, mapped)
        held.append(weakref.ref(next(iter(checkpoint.parts["model"].values()))))
        return checkpoint

    monkeypatch.setattr(average, "read_checkpoint", read)
    metrics = average.run(average.AverageParams(last=3), checkpoint_dir=trained[0].parent, out_path=tmp_path / "m.st")
    assert metrics == {"averaged": 3, "first_step": 2, "last_step": 6} and how == [True] * 3
    weights, meta = read_model(tmp_path / "m.st")
    models = [read_checkpoint(trained[0] / f"checkpoint-0000000{s}.pt").parts["model"] for s in (2, 4, 6)]
    for k in weights:
        torch.testing.assert_close(weights[k], sum(m[k] for m in models) / 3)
    assert meta.steps == (2, 4, 6)


def test_decode_translates_every_line_in_order(averaged, vocab_dir, cleaned, tmp_path):
    """The first 500 lines of newstest2013 and 2014 (the whole sets take a minute here)."""
    clean_dir = tmp_path / "clean"
    clean_dir.mkdir()
    shutil.copy2(cleaned[0] / MANIFEST, clean_dir / MANIFEST)  # the languages
    for split in ("dev", "test"):
        for lang in ("en", "de"):
            lines = list(read_lines(cleaned[0] / f"{split}.{lang}"))[:500]
            (clean_dir / f"{split}.{lang}").write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    params = decode.DecodeParams(beam_size=2, length_penalty=0.6, length_penalty_formula="gnmt", stop="finished",
                                 max_length_extra=3, batch_tokens=2000)
    metrics = decode.run(params, model_path=averaged[0], vocab_dir=vocab_dir, clean_dir=clean_dir,
                         out_dir=tmp_path / "hyps")
    assert metrics == {"dev_sentences": 500, "test_sentences": 500}
    model, sp = decode.load_translator(averaged[0], torch.device("cpu")), vocab.load(vocab_dir)
    some = list(read_lines(clean_dir / "test.en"))[100:103]  # lines from the middle, translated alone
    assert list(read_lines(tmp_path / "hyps/test.de"))[100:103] == decode.translate(model, sp, some, params)


def test_decode_batch_size_does_not_change_translations(averaged, vocab_dir, cleaned):
    model = decode.load_translator(averaged[0], torch.device("cpu"))
    lines = list(read_lines(cleaned[0] / "dev.en"))[:64]
    sp = vocab.load(vocab_dir)
    params = dict(beam_size=3, length_penalty=0.6, length_penalty_formula="gnmt", stop="finished", max_length_extra=4)
    one = decode.translate(model, sp, lines, decode.DecodeParams(batch_tokens=1, **params))  # one sentence a batch
    many = decode.translate(model, sp, lines, decode.DecodeParams(batch_tokens=10**6, **params))  # all 64 in one
    assert one == many


def test_decoding_out_of_gpu_memory_stops_naming_the_setting_that_takes_less_at_a_time(averaged, vocab_dir,
                                                                                      monkeypatch):
    model, sp = decode.load_translator(averaged[0], torch.device("cpu")), vocab.load(vocab_dir)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    monkeypatch.setattr(model, "translate_batch", out_of_memory)
    params = decode.DecodeParams(beam_size=4, length_penalty=0.6, length_penalty_formula="gnmt", stop="finished",
                                 max_length_extra=50, batch_tokens=8000)
    with pytest.raises(PipelineError, match=r"^decode test ran out of GPU memory: a batch holds up to "
                                            r"decode.batch_tokens 8000 source tokens, each sentence searched with 4 "
                                            r"beams; -S decode.batch_tokens=4000 takes half as many at a time$"):
        decode.translate(model, sp, ["A line."], params, desc="decode test")


def test_int8_is_refused_off_the_cpu(averaged):
    with pytest.raises(PipelineError, match="int8 runs on CPUs only"):
        decode.load_translator(averaged[0], torch.device("meta"), "int8")


def test_decode_refuses_a_model_that_is_not_ours(tmp_path):
    (tmp_path / "m.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(PipelineError, match="not a model written by this pipeline"):
        read_model(tmp_path / "m.safetensors")


def test_a_model_saved_with_attention_products_apart_loads_as_the_same_model(averaged, tmp_path):
    """Files from before q, k and v were one product decode and export; one with a weight missing is
    refused before any loads, naming the file and the weight."""
    weights, meta = read_model(averaged[0])
    separate = separate_projections(weights, TINY)
    write_model(tmp_path / "old.safetensors", separate, meta)
    ours, old = decode.read_transformer(averaged[0]), decode.read_transformer(tmp_path / "old.safetensors")
    assert ours.state_dict().keys() == old.state_dict().keys()
    assert all(torch.equal(w, old.state_dict()[name]) for name, w in ours.state_dict().items())
    del separate["decoder.0.cross_attn.v_proj.weight"]
    write_model(tmp_path / "partial.safetensors", separate, meta)
    missing = r"partial.safetensors: not the model its metadata describes: its weight " \
              r"decoder.0.cross_attn.k_proj.weight is \(32, 32\), this model's missing"
    with pytest.raises(PipelineError, match=missing):
        decode.read_transformer(tmp_path / "partial.safetensors")


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


@pytest.fixture
def pre_norm_model(trained, tmp_path):
    """The trained model's file, saying it is pre-LayerNorm, which Marian cannot express."""
    checkpoint = read_checkpoint(list_checkpoints(trained[0])[-1][1])
    meta = dataclasses.replace(checkpoint.meta, config=dataclasses.replace(checkpoint.meta.config, norm="pre"))
    write_model(tmp_path / "pre.st", checkpoint.parts["model"], meta)
    return tmp_path / "pre.st"


def test_export_refuses_what_marian_cannot_express(pre_norm_model, vocab_dir, tmp_path):
    with pytest.raises(PipelineError, match="cannot be written as MarianMT: model.norm is pre"):
        export.to_marian(pre_norm_model, vocab_dir, tmp_path / "marian")
    assert not (tmp_path / "marian").exists()


def test_export_stage_passes_over_such_a_model_and_leaves_no_earlier_export(pre_norm_model, exported, vocab_dir,
                                                                          tmp_path, capsys):
    exports = tmp_path / "exports"
    shutil.copytree(exported[0], exports)  # an earlier model's exports, which must not pass for this one's
    metrics = export.run(model_path=pre_norm_model, vocab_dir=vocab_dir, marian_dir=exports / "marian",
                         ctranslate2_dir=exports / "ctranslate2")
    assert metrics == {"skipped": "this model cannot be written as MarianMT: model.norm is pre "
                                  "(Marian is post-LayerNorm)"}
    assert exports.is_dir() and not any(exports.iterdir())
    assert "warning: not exported: this model cannot be written as MarianMT" in capsys.readouterr().out


def test_export_stage_still_stops_at_a_missing_model(vocab_dir, tmp_path):
    with pytest.raises(PipelineError, match="absent.st: model file not found"):
        export.run(model_path=tmp_path / "absent.st", vocab_dir=vocab_dir, marian_dir=tmp_path / "marian",
                   ctranslate2_dir=tmp_path / "ct2")


def test_a_model_given_another_runs_vocabulary_is_refused_before_translating(averaged, cleaned, vocab_dir, tmp_path,
                                                                              capsys):
    import sentencepiece as spm

    smaller, proto = tmp_path / "smaller", io.BytesIO()
    smaller.mkdir()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["a vocabulary of its own"] * 20), model_writer=proto,
                                   vocab_size=30, hard_vocab_limit=False, pad_id=0, unk_id=1, bos_id=2, eos_id=3,
                                   minloglevel=2)
    (smaller / vocab.MODEL_FILE).write_bytes(proto.getvalue())
    size = read_model(averaged[0])[1].vocab_size
    same_size = another_vocabulary(cleaned[0], vocab_dir, tmp_path / "same-size")
    (tmp_path / "in.en").write_text("A dog runs.\n", encoding="utf-8")
    params = decode.DecodeParams(beam_size=1, length_penalty=0.6, length_penalty_formula="gnmt", stop="finished",
                                 max_length_extra=3, batch_tokens=8000)
    for other in (smaller, same_size):
        said = rf"{averaged[0]} was trained on another vocabulary than {other / vocab.MODEL_FILE} \({size} pieces"
        assert cli.main(["translate", str(tmp_path / "in.en"), "--model", str(averaged[0]),
                         "--vocab-dir", str(other)]) == 1
        assert re.search(said, capsys.readouterr().err)
        with pytest.raises(PipelineError, match=said):
            decode.run(params, model_path=averaged[0], vocab_dir=other, clean_dir=cleaned[0], out_dir=tmp_path / "hyps")
        assert not (tmp_path / "hyps").exists()
        with pytest.raises(PipelineError, match=said):
            export.to_marian(averaged[0], other, tmp_path / "marian")


def test_translate_finds_the_pipelines_model_and_vocabulary_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # as from docs/ or another project's folder
    args = cli.build_parser().parse_args(["translate"])
    assert (args.model, args.vocab_dir, args.params) == (
        ROOT / "models/averaged.safetensors", ROOT / "data/vocab", ROOT / "params.yaml")


def test_translate_command_reads_a_file_or_stdin_and_warns_of_cut_lines(averaged, vocab_dir, cleaned, tmp_path,
                                                                       capsys, monkeypatch):
    lines = list(read_lines(cleaned[0] / "dev.en"))[:5] + ["word " * 600]  # longer than the 512 positions
    (tmp_path / "news.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = ["translate", "--model", str(averaged[0]), "--vocab-dir", str(vocab_dir), "-S", "decode.beam_size=2",
            "-S", "decode.max_length_extra=3"]
    assert cli.main([*args, str(tmp_path / "news.en")]) == 0
    out, err = capsys.readouterr()
    params = decode.DecodeParams(beam_size=2, length_penalty=0.6, length_penalty_formula="gnmt", stop="finished",
                                 max_length_extra=3, batch_tokens=8000)
    expected = decode.translate(decode.load_translator(averaged[0], torch.device("cpu")), vocab.load(vocab_dir),
                                lines, params)
    assert out.splitlines() == expected and "1 input lines were longer than the model's 511 positions" in err
    def stdin(data: bytes) -> None:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))

    stdin("\r\n".join(lines[:2]).encode() + b"\r\n")  # Windows line endings are line endings
    assert cli.main(args) == 0
    assert capsys.readouterr().out.splitlines() == expected[:2]
    stdin(lines[0].encode() + b"\nA dog\xff runs.\n")
    assert cli.main(args) == 1
    at = len(lines[0].encode()) + len(b"\nA dog")
    assert f"error: standard input:2: invalid UTF-8 at byte {at} of the input" in capsys.readouterr().err
    assert cli.main([*args, "-S", "train.max_steps=3"]) == 1
    assert "decode.* parameters only" in capsys.readouterr().err
    assert cli.main([*args, str(tmp_path / "absent.en")]) == 1
    assert "absent.en: file not found" in capsys.readouterr().err



def test_an_empty_line_translates_to_an_empty_line(averaged, vocab_dir, tmp_path, capsys, monkeypatch):
    searched = []
    search = translator_module.beam_search
    monkeypatch.setattr(translator_module, "beam_search",
                        lambda d, n, *a, **k: (searched.append(n), search(d, n, *a, **k))[1])
    (tmp_path / "in.en").write_text("\nThe European Parliament.\n   \n\n", encoding="utf-8")
    args = ["translate", str(tmp_path / "in.en"), "--model", str(averaged[0]), "--vocab-dir", str(vocab_dir),
            "-S", "decode.max_length_extra=3"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out.split("\n")
    assert len(out) == 5 and out[0] == out[2] == out[3] == "" and out[4] == ""  # four lines, then the end
    assert searched == [1]  # only the sentence was searched; a model asked for an empty line says something


TYPED = "The \u201cEuropean\u201d Parliament\u2019s vote \u2013 today."  # as a word processor writes it
NORMALISED = "The \"European\" Parliament's vote - today."  # as the clean stage writes the training text


@pytest.fixture
def sources_searched(monkeypatch) -> list:
    """The token ids each translate_batch call is given."""
    seen: list = []
    batch = translator_module.Translator.translate_batch
    monkeypatch.setattr(translator_module.Translator, "translate_batch",
                        lambda self, sources, **kw: (seen.extend(sources), batch(self, sources, **kw))[1])
    return seen


def test_translate_normalises_its_input_as_the_training_text_was(averaged, vocab_dir, tmp_path, capsys,
                                                                 sources_searched):
    (tmp_path / "in.en").write_text(TYPED + "\n", encoding="utf-8")
    assert cli.main(["translate", str(tmp_path / "in.en"), "--model", str(averaged[0]), "--vocab-dir", str(vocab_dir),
                     "-S", "decode.max_length_extra=3"]) == 0
    assert sources_searched == [vocab.load(vocab_dir).encode(NORMALISED)]


def test_the_served_model_normalises_its_input_as_the_training_text_was(averaged, vocab_dir, tmp_path,
                                                                        sources_searched):
    import json
    from types import SimpleNamespace

    from conftest import CLEAN
    from pipeline import serving

    params = decode.DecodeParams(beam_size=1, length_penalty=0.6, length_penalty_formula="gnmt", stop="finished",
                                 max_length_extra=3, batch_tokens=8000)
    files = {"decode": dataclasses.asdict(params), "clean": {"lang": "en", **dataclasses.asdict(CLEAN)}}
    for kind, content in files.items():
        (tmp_path / f"{kind}.json").write_text(json.dumps(content), encoding="utf-8")
    model = serving.Translator()
    model.load_context(SimpleNamespace(artifacts={"model": str(averaged[0]), "vocab": str(vocab_dir),
                                                  **{kind: str(tmp_path / f"{kind}.json") for kind in files}}))
    model.predict(None, [TYPED])
    assert sources_searched == [vocab.load(vocab_dir).encode(NORMALISED)]
