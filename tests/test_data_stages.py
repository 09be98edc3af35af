"""The data stages on real text from ../shared/data (download, clean, vocab, encode), scoring, and the
shared reading and writing they rely on. The chain's fixtures are in conftest.py."""
import codecs
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import sacrebleu
from sacremoses import MosesPunctNormalizer

from conftest import CLEAN, ROOT, TRAIN_LINES, download_params, wait_for
from stages import clean, download, encode, score, vocab
from stages.io import ParallelFiles, PipelineError, atomic_write, read_lines, write_manifest


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


def _raw_text(tmp_path, en: bytes, de: bytes):
    """A download stage's output: the given training sides, and a one-line dev and test set."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "train.en").write_bytes(en)
    (raw / "train.de").write_bytes(de)
    for split in ("dev", "test"):
        for lang in ("en", "de"):
            (raw / f"{split}.{lang}").write_text("x\n")
    write_manifest(raw, "en", "de", {"train": en.count(b"\n"), "dev": 1, "test": 1})
    return raw


def test_normalised_targets_cost_what_docs_data_md_says_on_newstest2014(shared):
    """docs/data.md's ceiling: newstest2014's German reference normalised as the clean stage normalises the
    training targets (its „ “ become ", its en dashes -), scored against the reference as it is."""
    ref = list(read_lines(shared / "wmt14/newstest2014-full/newstest2014-deen-ref.de.txt"))
    normalize = clean.Normalizer("de", CLEAN)  # params.yaml's normalisation: Moses punctuation, NFC
    hyp = [normalize(line) for line in ref]
    assert sum(h != r for h, r in zip(hyp, ref)) == 370
    assert round(sacrebleu.corpus_bleu(hyp, [ref]).score, 2) == 96.49
    tokenised = sacrebleu.metrics.BLEU(tokenize="none", force=True)
    assert round(tokenised.corpus_score(score.paper_tokenize(hyp, "de"), [score.paper_tokenize(ref, "de")]).score,
                 2) == 97.32


def test_clean_normalises_like_moses(tmp_path):
    # a control character between words is a space (remove-non-printing-char.perl's; sacremoses would join
    # them), a soft hyphen or zero-width space goes (sacremoses'; the perl script would split the word)
    raw = _raw_text(tmp_path, "\u201cQuoted\u201d  text\u00a0here\r\nfine\none\ttwo\x0bthree\n".encode(),
                    "\u201eZitat\u201c\u200b Text\r\ngut\nAbgeord\u00adnete\u0085hier, drei\n".encode())
    clean.run(CLEAN, raw_dir=raw, out_dir=tmp_path / "out")
    assert (tmp_path / "out/train.en").read_text(encoding="utf-8") == '"Quoted" text here\nfine\none two three\n'
    assert (tmp_path / "out/train.de").read_text(encoding="utf-8") == '"Zitat" Text\ngut\nAbgeordnete hier, drei\n'


def test_clean_lowercases_every_split_where_asked(tmp_path):
    """clean.lowercase: every line of every split lowercased after its normalisation, lines that need Moses'
    rules and lines that skip them alike."""
    raw = _raw_text(tmp_path, '\u201cQuoted\u201d Text\nPlain Words\n'.encode(),
                    '\u201eZitat\u201c Text\nEinfache W\u00d6RTER\n'.encode())
    (raw / "dev.en").write_text("Dev Line (One)\n")
    clean.run(dataclasses.replace(CLEAN, lowercase=True), raw_dir=raw, out_dir=tmp_path / "out")
    assert (tmp_path / "out/train.en").read_text(encoding="utf-8") == '"quoted" text\nplain words\n'
    assert (tmp_path / "out/train.de").read_text(encoding="utf-8") == '"zitat" text\neinfache w\u00f6rter\n'
    assert (tmp_path / "out/dev.en").read_text(encoding="utf-8") == "dev line (one)\n"


@pytest.mark.parametrize("lang", ["en", "de", "fr", "cs"])
def test_normalising_skips_moses_only_where_it_would_change_nothing_but_spaces(lang, shared):
    """The Normalizer leaves Moses' rules out for lines without their characters: on random text of those
    characters (and of others they could meet) and on newstest2014, every line comes out as when the
    rules run on every line (bench.clean's reference)."""
    from bench.clean import moses_everywhere
    normalize, reference = clean.Normalizer(lang, CLEAN), moses_everywhere(lang)
    ruled = sorted({c for pattern, _ in MosesPunctNormalizer(lang=lang).substitutions for c in pattern})
    alphabet = ruled + list("'aZ19 .,!?-/<\t\u00e9\u0301\u00df\u00ad\u200b\u2009\u0085\u3002")
    draw = random.Random(lang)
    lines = ["".join(draw.choices(alphabet, k=draw.randrange(9))) + draw.choice(["", "\n", "\r\n"])
             for _ in range(30000)]  # the clean stage's lines end in their line endings
    news = shared / "wmt14/newstest2014-full"
    for name in ("deen-src.en", "deen-ref.de"):
        lines += [line + "\n" for line in read_lines(news / f"newstest2014-{name}.txt")]
    skipped = [line for line in lines if line.rstrip("\r\n").isprintable() and not normalize.moses_matches.search(line)]
    assert len(skipped) > 5000  # the random lines exercise both ways
    assert [normalize(line) for line in lines] == [reference(line) for line in lines]


def test_clean_invalid_utf8_names_file_line_and_byte_or_is_dropped(tmp_path):
    raw = _raw_text(tmp_path, b"good one\nbro\xffken\nlast one\n", b"gut eins\nkaputt\nletzte eins\n")
    with pytest.raises(PipelineError, match=r"train.en:2: invalid UTF-8 at byte 12 of the file"):
        clean.run(CLEAN, raw_dir=raw, out_dir=tmp_path / "out")
    assert not (tmp_path / "out/train.en").exists()
    m = clean.run(dataclasses.replace(CLEAN, invalid_utf8="drop"), raw_dir=raw, out_dir=tmp_path / "out")
    assert m["dropped_invalid_utf8"] == 1 and m["train_pairs"] == 2



def test_clean_called_by_a_script_without_a_main_guard_stops_and_says_why(tmp_path):
    """clean's workers are spawned processes, which import the script that called it; a worker that
    cannot start must end the stage with the remedy, not leave it waiting for ever."""
    raw = _raw_text(tmp_path, b"one\n", b"eins\n")
    script = tmp_path / "unguarded.py"
    script.write_text(f"from pipeline.config import load_params\nfrom stages import clean\n"
                      f"params = load_params({str(ROOT / 'params.yaml')!r})\n"
                      f"clean.run(params.clean, raw_dir={str(raw)!r}, out_dir='out')\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and not (tmp_path / "out").exists()
    assert 'call it under `if __name__ == "__main__":`' in proc.stderr.splitlines()[-1]


def test_clean_stopped_midway_keeps_nothing_and_leaves_no_worker(raw, tmp_path):
    """SIGTERM to the stage's process group (as the flow passes a stop on) while its workers clean the
    training split: it ends at once, interrupted, with no output and no process of its group left."""
    out = tmp_path / "clean"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "clean", "--raw-dir", str(raw[0]), "--out-dir",
                             str(out), "--metrics", str(tmp_path / "clean.json")], cwd=ROOT, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    said = []
    for line in proc.stderr:  # the workers are at work once the training split's bar has started
        said.append(line)
        if line.startswith("clean train: started"):
            break
    os.killpg(proc.pid, signal.SIGTERM)
    said.append(proc.communicate(timeout=60)[1])
    assert proc.returncode == 130, "".join(said)
    assert "interrupted: nothing of this stage's work is kept" in said[-1] and not out.exists()

    def group_gone() -> bool:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(group_gone, 10, "the stage's workers to end")

def test_vocab_is_shared_by_both_languages(vocab_dir):
    sp = vocab.load(vocab_dir)
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2, 3)
    for sentence in ("The European Parliament", "Das Europäische Parlament"):
        assert sp.decode(sp.encode(sentence)) == sentence
        assert vocab.UNK_ID not in sp.encode(sentence)


def test_vocab_learned_again_from_the_same_text_is_the_same_bytes(vocab_dir, cleaned, tmp_path):
    """Wherever the text and the output are: nothing incidental (a temporary folder, an input path) is
    recorded in the files, so a rerun changes nothing downstream (DVC, the run's identity)."""
    import shutil

    params = vocab.VocabParams(model_type="bpe", vocab_size=1000, character_coverage=1.0, input_sentence_size=100000,
                               seed=1)  # the conftest chain's
    elsewhere = shutil.copytree(cleaned[0], tmp_path / "moved")
    vocab.run(params, clean_dir=elsewhere, out_dir=tmp_path / "again")
    for name in (vocab.MODEL_FILE, "spm.vocab"):
        assert (tmp_path / "again" / name).read_bytes() == (vocab_dir / name).read_bytes(), name
    assert vocab.identity(tmp_path / "again") == vocab.identity(vocab_dir)
    vocab.run(dataclasses.replace(params, vocab_size=999), clean_dir=elsewhere, out_dir=tmp_path / "other")
    assert vocab.identity(tmp_path / "other") != vocab.identity(vocab_dir)


@pytest.mark.parametrize("size, message", [
    (900000, r"vocab.vocab_size 900000 is more than the training text supports \(at most \d+\)"),
    (10, r"vocab.vocab_size 10 is fewer than the \d+ pieces the training text's characters need at "
         r"vocab.character_coverage 1 \(the special pieces included\)"),
])
def test_a_vocabulary_size_the_text_cannot_give_is_a_clear_error(cleaned, tmp_path, size, message):
    params = vocab.VocabParams(model_type="bpe", vocab_size=size, character_coverage=1.0,
                               input_sentence_size=100000, seed=1)
    with pytest.raises(PipelineError, match=message):
        vocab.run(params, clean_dir=cleaned[0], out_dir=tmp_path)


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
    assert result["bleu_tok_signature"] == "moses-tokenized|compound-split:##AT##|case:mixed|multi-bleu"
    # lowercased, then Moses-tokenised, as published Multi30k results: against sacreBLEU on that same text
    hyp_lc, ref_lc = (score.moses_tokenize([line.lower() for line in lines], "de") for lines in (hyp, ref))
    lowered = sacrebleu.corpus_bleu(hyp_lc, [ref_lc], tokenize="none")
    assert result["bleu_lc_tok"] == pytest.approx(lowered.score) and result["bleu_lc_tok"] != result["bleu_tok"]


def test_lowercase_scoring_scores_every_figure_lowercased(shared):
    """A model trained on lowercased text (clean.lowercase needs score.lowercase) is scored on no casing in any
    figure: the same hypotheses read the same whether written lowercased or not, and their signatures say so."""
    ref = list(read_lines(shared / "multi30k/val.de"))[:300]
    hyp = [" ".join(line.split()[1:]) for line in ref]
    lowered = score.ScoreParams(tokenize="13a", lowercase=True)
    cased, lower = (score.score(lowered, h, ref, hyp_name="h", ref_name="r", lang="de")
                    for h in (hyp, [line.lower() for line in hyp]))
    for key in ("bleu", "bleu_tok", "bleu_lc_tok", "chrf"):
        assert cased[key] == pytest.approx(lower[key]), key
    as_cased = score.score(score.ScoreParams(tokenize="13a", lowercase=False), [line.lower() for line in hyp], ref,
                           hyp_name="h", ref_name="r", lang="de")
    for key in ("bleu", "bleu_tok", "chrf"):
        assert as_cased[key] < lower[key] - 5, key
    hyp_lc, ref_lc = (score.paper_tokenize([line.lower() for line in lines], "de") for lines in (hyp, ref))
    assert lower["bleu_tok"] == pytest.approx(sacrebleu.corpus_bleu(hyp_lc, [ref_lc], tokenize="none").score)
    assert "case:lc" in lower["bleu_signature"] and "case:lc" in lower["chrf_signature"]
    assert lower["bleu_tok_signature"] == "moses-tokenized|compound-split:##AT##|case:lower|multi-bleu"


def test_lowercased_tokenised_bleu_counts_test2016_as_published_multi30k_results(shared):
    """bleu_lc_tok's tokens are those of the fairseq BLEU that Wu et al. 2021 report (docs/multi30k.md): test2016's
    German reference lowercased, then Moses-tokenised, is the 12,103 tokens of their published log's reflen.
    Tokenised before lowercasing it is one fewer: "Bart." ends a caption, and Moses keeps the period of a
    capitalised word on its list of abbreviations."""
    ref = list(read_lines(shared / "multi30k/test_2016_flickr.de"))
    assert sum(len(line.split()) for line in score.moses_tokenize([line.lower() for line in ref], "de")) == 12103
    assert sum(len(line.split()) for line in score.moses_tokenize(ref, "de")) == 12102


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
    path.write_bytes(codecs.BOM_UTF8 + b"bro\xffken\n")  # the offset counts the byte-order mark's 3 bytes
    with pytest.raises(PipelineError, match=r"bad.en:1: invalid UTF-8 at byte 6"):
        list(read_lines(path))


def test_files_saved_with_a_byte_order_mark_and_crlf_read_as_their_text(shared, work, tmp_path):
    """Dev and test sets of one's own from a Windows editor (UTF-8 with a byte-order mark, CRLF line
    endings): downloaded as they are, their references score the same lines given plainly at 100."""
    corpus, hyps = tmp_path / "corpus", tmp_path / "hyps"
    corpus.mkdir(), hyps.mkdir()
    sets = {}
    for split, name in (("dev", "val"), ("test", "test_2016_flickr")):
        for lang in ("en", "de"):
            lines = list(read_lines(shared / f"multi30k/{name}.{lang}"))[:200]
            (corpus / f"{split}.{lang}").write_bytes(codecs.BOM_UTF8 + "".join(f"{x}\r\n" for x in lines).encode())
            if lang == "de":
                (hyps / f"{split}.de").write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")
        sets[split] = ParallelFiles(str(corpus / f"{split}.en"), str(corpus / f"{split}.de"))
    download.run(download_params(shared, work, **sets), out_dir=tmp_path / "raw")
    assert (tmp_path / "raw/test.de").read_bytes().startswith(codecs.BOM_UTF8)  # the bytes as they came
    results = score.run(score.ScoreParams(tokenize="13a", lowercase=False), hyp_dir=hyps, ref_dir=tmp_path / "raw")
    assert [results[split]["bleu"] for split in ("dev", "test")] == pytest.approx([100, 100], abs=1e-9)
