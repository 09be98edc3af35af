"""Each stage on real text from ../shared/data, in a temporary directory, chained as the DAG chains them."""
import dataclasses
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch

from pipeline import cli
from stages import average, clean, decode, download, encode, export, score, train, vocab
from stages.io import ParallelFiles, PipelineError, atomic_write, read_lines, write_manifest
from transformer import TransformerConfig

TRAIN_LINES = 3000  # of each shared training sample, to keep the suite fast


@pytest.fixture(scope="module")
def work(tmp_path_factory, shared):
    """A corpus directory of real WMT14 text: Europarl and News Commentary samples (with their blank
    lines and carriage returns), newstest2013 as dev and newstest2014 (full) as test."""
    root = tmp_path_factory.mktemp("stages")
    corpus = root / "corpus"
    corpus.mkdir()
    sample = shared / "wmt14/train-sample/uedin-toy"
    for name in ("europarl-v7.first10k", "news-commentary.first10k"):
        for lang in ("en", "de"):
            with open(sample / f"{name}.{lang}", "rb") as f:
                head = b"".join(line for _, line in zip(range(TRAIN_LINES), f))
            (corpus / f"{name}.{lang}").write_bytes(head)
    return root


def download_params(shared, work, **changes):
    local = dict(dir=str(work / "corpus"),
                 train=(ParallelFiles("europarl-v7.first10k.en", "europarl-v7.first10k.de"),
                        ParallelFiles("news-commentary.first10k.en", "news-commentary.first10k.de")),
                 dev=ParallelFiles(str(shared / "wmt14/newstest2013/newstest2013.en"),
                                   str(shared / "wmt14/newstest2013/newstest2013.de")),
                 test=ParallelFiles(str(shared / "wmt14/newstest2014-full/newstest2014-deen-src.en.txt"),
                                    str(shared / "wmt14/newstest2014-full/newstest2014-deen-ref.de.txt")))
    local.update(changes)
    wmt = download.Wmt14Source(corpora=("europarl-v7",), test="full", mirrors=(), archive_dir=str(work / "archives"))
    return download.DownloadParams(source="local", src_lang="en", tgt_lang="de", wmt14=wmt,
                                   local=download.LocalSource(**local))


@pytest.fixture(scope="module")
def raw(shared, work):
    metrics = download.run(download_params(shared, work), out_dir=work / "raw")
    return work / "raw", metrics


def test_download_gathers_the_splits(raw):
    raw_dir, metrics = raw
    assert {k: v for k, v in metrics.items() if k.endswith("_pairs")} == \
        {"train_pairs": 2 * TRAIN_LINES, "dev_pairs": 3000, "test_pairs": 3003}
    assert metrics["train_corpora"] == {"europarl-v7.first10k": {"pairs": TRAIN_LINES, "published": None},
                                        "news-commentary.first10k": {"pairs": TRAIN_LINES, "published": None}}
    assert sum(1 for _ in read_lines(raw_dir / "test.de")) == 3003
    assert json.loads((raw_dir / "manifest.json").read_text())["src_lang"] == "en"


def test_download_refuses_mismatched_files_before_writing(shared, work, tmp_path):
    (tmp_path / "short.en").write_text("one\ntwo\n")
    (tmp_path / "short.de").write_text("eins\nzwei\ndrei\n")
    test = ParallelFiles(str(tmp_path / "short.en"), str(tmp_path / "short.de"))
    with pytest.raises(PipelineError, match=r"differ in length: .*short.en has 2 lines, .*short.de has 3"):
        download.run(download_params(shared, work, test=test), out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_download_errors_name_what_is_missing(shared, work, tmp_path):
    with pytest.raises(PipelineError, match="download.local.dir: .*nowhere is not a directory"):
        download.run(download_params(shared, work, dir=str(tmp_path / "nowhere")), out_dir=tmp_path / "o")
    with pytest.raises(PipelineError, match="absent.en: file not found"):
        download.run(download_params(shared, work, train=(ParallelFiles("absent.en", "absent.de"),)),
                     out_dir=tmp_path / "o")


CLEAN = clean.CleanParams(max_tokens=80, max_ratio=1.5, drop_duplicates=True, normalize_punctuation=True,
                          unicode_form="NFC", invalid_utf8="error", workers=2)


@pytest.fixture(scope="module")
def cleaned(raw, work):
    metrics = clean.run(CLEAN, raw_dir=raw[0], out_dir=work / "clean")
    return work / "clean", metrics


def test_clean_reports_drops_by_reason_per_corpus_and_never_filters_test_sets(cleaned):
    clean_dir, m = cleaned
    for corpus in ("europarl-v7.first10k", "news-commentary.first10k"):
        c = m["corpora"][corpus]
        assert c["pairs"] == TRAIN_LINES and c["dropped_empty"] > 0 and c["dropped_length_ratio"] > 0
        assert c["kept"] + sum(v for k, v in c.items() if k.startswith("dropped_")) == TRAIN_LINES
    assert m["dropped_too_long"] > 0 and m["dropped_duplicate"] > 0
    assert m["train_pairs"] == sum(c["kept"] for c in m["corpora"].values())
    assert (m["dev_pairs"], m["test_pairs"]) == (3000, 3003)
    assert not any("\r" in line or not line.strip() for line in read_lines(clean_dir / "train.en"))


def test_clean_normalises_like_moses(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "train.en").write_text("\u201cQuoted\u201d  text\u00a0here\r\nfine\n", encoding="utf-8")
    (raw / "train.de").write_text("\u201eZitat\u201c\u200b Text\r\ngut\n", encoding="utf-8")
    for split in ("dev", "test"):
        for lang in ("en", "de"):
            (raw / f"{split}.{lang}").write_text("x\n")
    write_manifest(raw, "en", "de", {"train": 2, "dev": 1, "test": 1})
    clean.run(CLEAN, raw_dir=raw, out_dir=tmp_path / "out")
    assert (tmp_path / "out/train.en").read_text(encoding="utf-8") == '"Quoted" text here\nfine\n'
    assert (tmp_path / "out/train.de").read_text(encoding="utf-8") == '"Zitat" Text\ngut\n'


def test_clean_invalid_utf8_names_file_line_and_byte_or_is_dropped(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "train.en").write_bytes(b"good one\nbro\xffken\nlast one\n")
    (raw / "train.de").write_bytes(b"gut eins\nkaputt\nletzte eins\n")
    for split in ("dev", "test"):
        for lang in ("en", "de"):
            (raw / f"{split}.{lang}").write_text("x\n")
    write_manifest(raw, "en", "de", {"train": 3, "dev": 1, "test": 1})
    with pytest.raises(PipelineError, match=r"train.en:2: invalid UTF-8 at byte 12 of the file"):
        clean.run(CLEAN, raw_dir=raw, out_dir=tmp_path / "out")
    assert not (tmp_path / "out/train.en").exists()
    m = clean.run(dataclasses.replace(CLEAN, invalid_utf8="drop"), raw_dir=raw, out_dir=tmp_path / "out")
    assert m["dropped_invalid_utf8"] == 1 and m["train_pairs"] == 2


@pytest.fixture(scope="module")
def vocab_dir(cleaned, work):
    params = vocab.VocabParams(model_type="bpe", vocab_size=1000, character_coverage=1.0,
                               input_sentence_size=100000, seed=1)
    metrics = vocab.run(params, clean_dir=cleaned[0], out_dir=work / "vocab")
    assert metrics == {"vocab_size": 1000}
    return work / "vocab"


def test_vocab_is_shared_by_both_languages(vocab_dir):
    sp = vocab.load(vocab_dir)
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2, 3)
    for sentence in ("The European Parliament", "Das Europäische Parlament"):
        assert sp.decode(sp.encode(sentence)) == sentence
        assert vocab.UNK_ID not in sp.encode(sentence)


def test_vocab_too_large_for_the_data_is_a_clear_error(cleaned, tmp_path):
    params = vocab.VocabParams(model_type="bpe", vocab_size=900000, character_coverage=1.0,
                               input_sentence_size=100000, seed=1)
    with pytest.raises(PipelineError, match=r"vocab.vocab_size 900000 is more than the training text supports"):
        vocab.run(params, clean_dir=cleaned[0], out_dir=tmp_path)


@pytest.fixture(scope="module")
def encoded(cleaned, vocab_dir, work):
    metrics = encode.run(clean_dir=cleaned[0], vocab_dir=vocab_dir, out_dir=work / "encoded")
    return work / "encoded", metrics


def test_encode_stores_exactly_what_sentencepiece_gives(encoded, cleaned, vocab_dir):
    encoded_dir, metrics = encoded
    sp = vocab.load(vocab_dir)
    corpus = encode.ParallelIds(encoded_dir, "test")
    lines = list(read_lines(cleaned[0] / "test.en"))
    assert len(corpus) == 3003
    for i in (0, 1, 1500, 3002):
        assert corpus.src(i).tolist() == sp.encode(lines[i])
    assert metrics["test_en_tokens"] == int(corpus.src_lengths.sum())
    assert corpus.src_ids.dtype == np.uint16


TINY = TransformerConfig(d_model=32, n_heads=4, d_ff=64, encoder_layers=1, decoder_layers=1, dropout=0.1,
                         attention_dropout=0.0, norm="post", positions="sinusoidal", max_positions=512)


def train_params(**changes):
    p = dict(max_steps=6, batch_tokens=1500, grad_accum=1, warmup_steps=4, adam_betas=(0.9, 0.98), adam_eps=1e-9,
             label_smoothing=0.1, clip_norm=0.0, precision="fp32", compile=False, seed=1, log_every=2,
             validate_every=3, checkpoint_every_steps=2, checkpoint_every_minutes=0.0, keep_checkpoints=20)
    p.update(changes)
    return train.TrainParams(**p)


@pytest.fixture(scope="module")
def trained(encoded, vocab_dir, work):
    metrics = train.run(TINY, train_params(), encoded_dir=encoded[0], vocab_dir=vocab_dir,
                        checkpoint_dir=work / "checkpoints", plots_dir=work / "plots")
    return work / "checkpoints", metrics


def test_train_writes_checkpoints_curves_and_finite_metrics(trained, work):
    checkpoint_dir, m = trained
    assert [step for step, _ in train.checkpoints(checkpoint_dir)] == [2, 4, 6]
    assert m["steps"] == 6 and math.isfinite(m["loss"]) and math.isfinite(m["valid_loss"])
    assert m["train_flops"] > 0 and m["tflops"] > 0 and "mfu" not in m  # utilisation only where a peak is known
    rows = (work / "plots/train.csv").read_text().splitlines()
    assert rows[0].startswith("step,loss,nll") and len(rows) == 4  # header + steps 2, 4, 6
    header = rows[0].split(",")
    for row in rows[1:]:
        values = dict(zip(header, map(float, row.split(","))))
        assert 0 <= values["src_padding"] < 0.5 and 0 <= values["tgt_padding"] < 0.5 and 0.5 < values["batch_fill"] <= 1


def test_resume_equals_uninterrupted(encoded, vocab_dir, tmp_path):
    def run(steps, directory):
        return train.run(TINY, train_params(max_steps=steps), encoded_dir=encoded[0], vocab_dir=vocab_dir,
                         checkpoint_dir=directory, plots_dir=tmp_path / "plots")

    run(6, tmp_path / "straight")
    run(4, tmp_path / "stopped")  # a run stopped after step 4 ...
    (tmp_path / "stopped/checkpoint-00000005.pt").write_bytes(b"cut short by a full disk")
    run(6, tmp_path / "stopped")  # ... and resumed to step 6, from the newest checkpoint that loads
    a = train.load_checkpoint(tmp_path / "straight/checkpoint-00000006.pt")
    b = train.load_checkpoint(tmp_path / "stopped/checkpoint-00000006.pt")
    same = lambda rows: [(r["step"], r["loss"], r["nll"], r["lr"], r["grad_norm"]) for r in rows]  # noqa: E731
    assert same(a["history"]) == same(b["history"])
    valid_b = {r["step"]: r for r in b["valid_history"]}  # the stopped run also validated at its last step
    assert all(valid_b[r["step"]] == r for r in a["valid_history"])
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=0)


def test_resume_with_a_different_model_is_refused(encoded, vocab_dir, trained, tmp_path):
    other = TransformerConfig(**{**TINY.__dict__, "d_ff": 128})
    with pytest.raises(PipelineError, match=r"different training run \(model.d_ff changed\)"):
        train.run(other, train_params(), encoded_dir=encoded[0], vocab_dir=vocab_dir, checkpoint_dir=trained[0],
                  plots_dir=tmp_path)


def test_checkpoints_are_chosen_by_step_not_by_name(tmp_path):
    for step in (9, 10, 100):
        (tmp_path / f"checkpoint-{step}.pt").write_bytes(b"")
    (tmp_path / ".checkpoint-00000200.pt.x.tmp").write_bytes(b"")  # an unfinished write
    assert [s for s, _ in train.checkpoints(tmp_path)] == [9, 10, 100]


def test_loading_refuses_files_that_are_not_our_checkpoints(tmp_path):
    (tmp_path / "evil.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(PipelineError, match="evil.pt: not a readable checkpoint"):
        train.load_checkpoint(tmp_path / "evil.pt")
    torch.save({"model": {}}, tmp_path / "foreign.pt")
    with pytest.raises(PipelineError, match="foreign.pt: not a checkpoint written by this pipeline"):
        train.load_checkpoint(tmp_path / "foreign.pt")


@pytest.fixture(scope="module")
def averaged(trained, work):
    metrics = average.run(average.AverageParams(last=2), checkpoint_dir=trained[0], out_path=work / "model.st")
    return work / "model.st", metrics


def test_average_takes_the_last_n_by_step(averaged, trained):
    path, metrics = averaged
    assert metrics == {"averaged": 2, "first_step": 4, "last_step": 6}
    weights, meta = average.load_model(path)
    c4, c6 = (train.load_checkpoint(trained[0] / f"checkpoint-0000000{s}.pt")["model"] for s in (4, 6))
    for k in weights:
        torch.testing.assert_close(weights[k], (c4[k] + c6[k]) / 2)
    assert meta["averaged_steps"] == [4, 6] and meta["model_config"]["d_model"] == 32


def test_averaging_copies_of_one_checkpoint_returns_it(trained):
    state = train.load_checkpoint(trained[0] / "checkpoint-00000006.pt")["model"]
    for k, v in average.average_state_dicts([state] * 3, ["a", "b", "c"]).items():
        torch.testing.assert_close(v, state[k])


def test_average_refuses_mismatched_checkpoints():
    with pytest.raises(PipelineError, match="b: parameter w has shape"):
        average.average_state_dicts([{"w": torch.zeros(2)}, {"w": torch.zeros(3)}], ["a", "b"])


def test_decode_translates_every_line_in_order(averaged, vocab_dir, cleaned, work):
    params = decode.DecodeParams(beam_size=2, length_penalty=0.6, length_penalty_formula="gnmt",
                                 max_length_extra=3, batch_tokens=2000)
    metrics = decode.run(params, model_path=averaged[0], vocab_dir=vocab_dir, clean_dir=cleaned[0],
                         out_dir=work / "hyps")
    assert metrics == {"dev_sentences": 3000, "test_sentences": 3003}
    assert sum(1 for _ in read_lines(work / "hyps/test.de")) == 3003


def test_decode_batch_size_does_not_change_translations(averaged, vocab_dir, cleaned):
    model = decode.load_translator(averaged[0], torch.device("cpu"))
    lines = list(read_lines(cleaned[0] / "dev.en"))[:64]
    sp = vocab.load(vocab_dir)
    params = dict(beam_size=3, length_penalty=0.6, length_penalty_formula="gnmt", max_length_extra=4)
    one = decode.translate(model, sp, lines, decode.DecodeParams(batch_tokens=1, **params))  # one sentence a batch
    many = decode.translate(model, sp, lines, decode.DecodeParams(batch_tokens=10**6, **params))  # all 64 in one
    assert one == many


def test_decode_refuses_a_model_that_is_not_ours(tmp_path):
    (tmp_path / "m.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(PipelineError, match="not a model written by this pipeline"):
        average.load_model(tmp_path / "m.safetensors")


def test_score_reproduces_sacrebleu_on_newstest(shared, tmp_path):
    ref = list(read_lines(shared / "wmt14/newstest2014-full/newstest2014-deen-ref.de.txt"))
    hyp = [" ".join(line.split()[::2]) for line in ref]  # a poor but deterministic "translation"
    result = score.score(score.ScoreParams(tokenize="13a", lowercase=False), hyp, ref, hyp_name="h", ref_name="r",
                         lang="de")
    expected = sacrebleu.corpus_bleu(hyp, [ref])
    assert result["bleu"] == pytest.approx(expected.score) and 0 < result["bleu"] < 100
    assert result["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert result["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyp, [ref]).score)
    # the paper's tokenised, compound-split BLEU: its own figure, and it counts split compounds as tokens
    assert result["bleu_tok"] != pytest.approx(result["bleu"]) and 0 < result["bleu_tok"] < 100
    assert result["bleu_tok_signature"] == score.BLEU_TOK_VARIANT


def test_paper_tokenisation_splits_compounds_like_get_ende_bleu():
    assert score.paper_tokenize(["Die US-Regierung, 3-4-mal (so)."], "de") == [
        "Die US ##AT##-##AT## Regierung , 3 ##AT##-##AT## 4-mal ( so ) ."]


def test_score_refuses_mismatched_or_empty_hypotheses():
    p = score.ScoreParams(tokenize="13a", lowercase=False)
    with pytest.raises(PipelineError, match="hyp.de has 1 lines but ref.de has 2"):
        score.score(p, ["a"], ["a", "b"], hyp_name="hyp.de", ref_name="ref.de", lang="de")
    with pytest.raises(PipelineError, match="hyp.de: the file is empty"):
        score.score(p, [], ["a", "b"], hyp_name="hyp.de", ref_name="ref.de", lang="de")
    assert score.score(p, ["", ""], ["a b c d", "e f g h"], hyp_name="h", ref_name="r", lang="de")["bleu"] == 0.0


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_write(target) as f:
        f.write("half")
        raise RuntimeError("killed")
    assert target.read_text() == "old" and list(tmp_path.iterdir()) == [target]


def test_invalid_utf8_names_file_line_and_byte(tmp_path):
    path = tmp_path / "bad.en"
    path.write_bytes(b"fine\nalso fine\nbro\xffken\n")
    with pytest.raises(PipelineError, match=r"bad.en:3: invalid UTF-8 at byte 18"):
        list(read_lines(path))


def test_two_processes_train_together_and_a_resume_on_one_is_refused(encoded, vocab_dir, tmp_path):
    """torchrun with two CPU processes (gloo): one set of checkpoints, one metrics file."""
    import os
    import subprocess
    import sys

    from pipeline.config import PARAMS_FILE, apply_overrides, load_preset

    params = tmp_path / "params.yaml"
    params.write_text(PARAMS_FILE.read_text())
    apply_overrides({**load_preset("quickstart"), "train.max_steps": 4, "train.checkpoint_every_steps": 2,
                     "train.validate_every": 2, "train.batch_tokens": 1500}, params)
    command = ["-m", "pipeline", "train", "--params", str(params), "--encoded-dir", str(encoded[0]),
               "--vocab-dir", str(vocab_dir), "--checkpoint-dir", str(tmp_path / "ckpt"),
               "--plots-dir", str(tmp_path / "plots"), "--metrics", str(tmp_path / "train.json")]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *command],
                         env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert [s for s, _ in train.checkpoints(tmp_path / "ckpt")] == [2, 4]
    assert json.loads((tmp_path / "train.json").read_text())["steps"] == 4
    one = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 1 and "world_size changed" in one.stderr


def _trainer(encoded_dir, vocab_dir, **changes):
    from accelerate import Accelerator

    config = TransformerConfig(**{**TINY.__dict__, "dropout": 0.0})
    return train.Trainer(config, train_params(**changes), encoded_dir=encoded_dir, vocab_dir=vocab_dir,
                         accelerator=Accelerator(cpu=True))


def _gradients_of_one_step(trainer, batches):
    trainer.sampler = iter(batches)
    captured = []
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: (captured.extend(p.grad.clone() for p in trainer.model.parameters()), step())
    trainer.train_step()
    return captured


def test_gradient_accumulation_equals_one_batch_of_the_union(encoded, vocab_dir):
    parts = [np.arange(i * 5, i * 5 + 5) for i in range(4)]
    accumulated = _gradients_of_one_step(_trainer(encoded[0], vocab_dir, grad_accum=4), parts)
    whole = _gradients_of_one_step(_trainer(encoded[0], vocab_dir, grad_accum=1), [np.concatenate(parts)])
    for a, b in zip(accumulated, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_non_finite_loss_stops_before_the_update(encoded, vocab_dir, monkeypatch):
    trainer = _trainer(encoded[0], vocab_dir)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    monkeypatch.setattr(train, "label_smoothed_nll_loss",
                        lambda *a, **k: (torch.tensor(float("nan"), requires_grad=True), torch.tensor(0.0)))
    with pytest.raises(PipelineError, match=r"non-finite loss \(nan\) at step 1 on process 0; stopped before"):
        trainer.train_step()
    for p, b in zip(trainer.model.parameters(), before, strict=True):
        assert torch.equal(p, b)


def test_a_small_model_memorises_a_copy_task():
    from transformer import IncrementalDecoder, Transformer, beam_search, inverse_sqrt_rate, label_smoothed_nll_loss

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
        hyps = beam_search(IncrementalDecoder(model, src, 2), 24, 2, torch.full((24,), 10), 2, 3, 0.6)
    assert [h[0].tokens for h in hyps] == sources.tolist()


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
        beam_size=1, length_penalty=0.0, length_penalty_formula="gnmt", max_length_extra=5, batch_tokens=10**6))
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
    state = train.load_checkpoint(train.checkpoints(trained[0])[-1][1])
    config = {**state["model_config"], "norm": "pre"}
    average.save_model(tmp_path / "pre.st", state["model"], {"model_config": config, "vocab_size": state["vocab_size"]})
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
    params = decode.DecodeParams(beam_size=2, length_penalty=0.6, length_penalty_formula="gnmt", max_length_extra=3,
                                 batch_tokens=8000)
    expected = decode.translate(decode.load_translator(averaged[0], torch.device("cpu")), vocab.load(vocab_dir),
                                lines, params)
    assert out.splitlines() == expected and "1 input lines were longer than the model's 511 positions" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines[:2]) + "\n"))
    assert cli.main(args) == 0
    assert capsys.readouterr().out.splitlines() == expected[:2]
    assert cli.main([*args, "-S", "train.max_steps=3"]) == 1
    assert "decode.* parameters only" in capsys.readouterr().err
