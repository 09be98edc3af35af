"""The quickstart corpus is what its generator writes, and its German is right."""
import importlib.util
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[1] / "corpora" / "numbers"
spec = importlib.util.spec_from_file_location("generate", CORPUS / "generate.py")
generate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate)


def test_the_committed_corpus_is_what_the_generator_writes(tmp_path):
    generate.generate(tmp_path)
    for name in ("train", "dev", "test"):
        for lang in ("en", "de"):
            assert (tmp_path / f"{name}.{lang}").read_bytes() == (CORPUS / f"{name}.{lang}").read_bytes()


def test_held_out_phrases_never_appear_in_training():
    train = set((CORPUS / "train.en").read_text().splitlines())
    for name in ("dev", "test"):
        assert not train & set((CORPUS / f"{name}.en").read_text().splitlines())


@pytest.mark.parametrize(("n", "english", "german"), [
    (1, "one", "eins"), (21, "twenty-one", "einundzwanzig"), (101, "one hundred and one", "einhunderteins"),
    (1999, "one thousand nine hundred and ninety-nine", "eintausendneunhundertneunundneunzig"),
    (2005, "two thousand and five", "zweitausendfünf"), (31000, "thirty-one thousand", "einunddreißigtausend"),
])
def test_numbers(n, english, german):
    assert generate.en_number(n) == english and generate.de_number(n) == german


def test_ordinals_and_times():
    assert [generate.en_ordinal(n) for n in (1, 2, 3, 12, 20, 21, 30)] == \
        ["first", "second", "third", "twelfth", "twentieth", "twenty-first", "thirtieth"]
    assert [generate.de_ordinal_dative(n) for n in (1, 3, 7, 19, 20, 31)] == \
        ["ersten", "dritten", "siebten", "neunzehnten", "zwanzigsten", "einunddreißigsten"]
