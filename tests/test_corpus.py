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


def test_training_holds_most_of_every_construction():
    """Held out phrase by phrase from all phrases, dev and test once took every "o'clock" phrase and ten of the
    twelve "half past" ones: training never saw them, so no model could learn them."""
    made = generate.splits()
    constructions = {c for pairs in made.values() for c, _, _ in pairs}
    for construction in constructions:
        trained = {en for c, en, _ in made["train"] if c == construction}
        held_out = {en for name in ("dev", "test") for c, en, _ in made[name] if c == construction}
        assert len(trained) >= 2 * len(held_out), (construction, sorted(held_out))
    assert {c for c, _, _ in made["train"]} == constructions


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
