"""Generate the quickstart corpus: English number, date, time and quantity phrases with their German
translations. The project's own work, written out by rule, small enough for a CPU to learn in minutes
and structured enough (German says "einundzwanzig", one-and-twenty, and "halb vier", half four, for
3:30) that the score rising from near 0 shows the pipeline learns.

    python corpora/numbers/generate.py corpora/numbers   # rewrites {train,dev,test}.{en,de}
"""
from __future__ import annotations

import hashlib
import random
import sys
from pathlib import Path

EN_UNITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
            "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
EN_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
DE_UNITS = ["null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn", "elf",
            "zwölf", "dreizehn", "vierzehn", "fünfzehn", "sechzehn", "siebzehn", "achtzehn", "neunzehn"]
DE_TENS = ["", "", "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig", "siebzig", "achtzig", "neunzig"]
EN_ORDINAL_UNITS = {1: "first", 2: "second", 3: "third", 5: "fifth", 8: "eighth", 9: "ninth", 12: "twelfth"}
MONTHS = [("January", "Januar"), ("February", "Februar"), ("March", "März"), ("April", "April"), ("May", "Mai"),
          ("June", "Juni"), ("July", "Juli"), ("August", "August"), ("September", "September"),
          ("October", "Oktober"), ("November", "November"), ("December", "Dezember")]
DAYS = [("Monday", "Montag"), ("Tuesday", "Dienstag"), ("Wednesday", "Mittwoch"), ("Thursday", "Donnerstag"),
        ("Friday", "Freitag"), ("Saturday", "Samstag"), ("Sunday", "Sonntag")]
# English singular, English plural, German singular, German plural, German gender
NOUNS = [("apple", "apples", "Apfel", "Äpfel", "m"), ("house", "houses", "Haus", "Häuser", "n"),
         ("book", "books", "Buch", "Bücher", "n"), ("car", "cars", "Auto", "Autos", "n"),
         ("day", "days", "Tag", "Tage", "m"), ("year", "years", "Jahr", "Jahre", "n"),
         ("minute", "minutes", "Minute", "Minuten", "f"), ("child", "children", "Kind", "Kinder", "n"),
         ("bottle", "bottles", "Flasche", "Flaschen", "f"), ("chair", "chairs", "Stuhl", "Stühle", "m"),
         ("week", "weeks", "Woche", "Wochen", "f"), ("table", "tables", "Tisch", "Tische", "m")]


def en_number(n: int) -> str:
    if n < 20:
        return EN_UNITS[n]
    if n < 100:
        return EN_TENS[n // 10] + ("-" + EN_UNITS[n % 10] if n % 10 else "")
    if n < 1000:
        rest = n % 100
        return EN_UNITS[n // 100] + " hundred" + (" and " + en_number(rest) if rest else "")
    rest = n % 1000
    head = en_number(n // 1000) + " thousand"
    if not rest:
        return head
    return head + (" and " if rest < 100 else " ") + en_number(rest)


def de_number(n: int, final: bool = True) -> str:
    """German cardinal in one word; `final` False gives "ein" for a trailing one (einundzwanzig)."""
    if n == 1:
        return "eins" if final else "ein"
    if n < 20:
        return DE_UNITS[n]
    if n < 100:
        unit = n % 10
        return (de_number(unit, final=False) + "und" if unit else "") + DE_TENS[n // 10]
    if n < 1000:
        rest = n % 100
        return ("ein" if n // 100 == 1 else DE_UNITS[n // 100]) + "hundert" + (de_number(rest, final) if rest else "")
    rest = n % 1000
    thousands = "ein" if n // 1000 == 1 else de_number(n // 1000, False)
    return thousands + "tausend" + (de_number(rest, final) if rest else "")


def en_ordinal(n: int) -> str:
    if n in EN_ORDINAL_UNITS:
        return EN_ORDINAL_UNITS[n]
    if n < 20:
        return EN_UNITS[n] + "th"
    if n % 10 == 0:
        return EN_TENS[n // 10][:-1] + "ieth"
    return EN_TENS[n // 10] + "-" + en_ordinal(n % 10)


def de_ordinal_dative(n: int) -> str:
    """am ersten, am dritten, am zwanzigsten, am einunddreißigsten."""
    special = {1: "ersten", 3: "dritten", 7: "siebten", 8: "achten"}
    if n in special:
        return special[n]
    return de_number(n, final=False) + ("sten" if n >= 20 else "ten")


def en_suffix(n: int) -> str:
    if 10 < n % 100 < 14:
        return f"{n}th"
    return f"{n}" + {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def de_one(gender: str) -> str:
    return "eine" if gender == "f" else "ein"


def phrase(rng: random.Random) -> tuple[str, str, str]:
    """(construction, English, German): one phrase of the corpus, and the rule that made it."""
    kind = rng.randrange(7)
    if kind == 0:  # a number in words
        n = rng.choice([rng.randrange(100), rng.randrange(1000), rng.randrange(10000)])
        return "number", en_number(n), de_number(n)
    if kind == 1:  # a quantity
        n = rng.choice([1, rng.randrange(2, 100), rng.randrange(2, 1000)])
        en1, en2, de1, de2, gender = rng.choice(NOUNS)
        if n == 1:
            return "one thing", f"one {en1}", f"{de_one(gender)} {de1}"
        if rng.random() < 0.3:
            return "things in digits", f"{n} {en2}", f"{n} {de2}"
        return "things in words", f"{en_number(n)} {en2}", f"{de_number(n, final=False)} {de2}"
    if kind == 2:  # a date in digits
        (en_m, de_m), day, year = rng.choice(MONTHS), rng.randrange(1, 29), rng.randrange(1900, 2100)
        if rng.random() < 0.5:
            return "date in digits", f"on {day} {en_m} {year}", f"am {day}. {de_m} {year}"
        return "date with a suffix", f"on {en_m} {en_suffix(day)}, {year}", f"am {day}. {de_m} {year}"
    if kind == 3:  # a date in words
        (en_m, de_m), day = rng.choice(MONTHS), rng.randrange(1, 32)
        if rng.random() < 0.5:
            (en_d, de_d) = rng.choice(DAYS)
            return ("weekday and date", f"on {en_d}, the {en_ordinal(day)} of {en_m}",
                    f"am {de_d}, dem {de_ordinal_dative(day)} {de_m}")
        return "date in words", f"on the {en_ordinal(day)} of {en_m}", f"am {de_ordinal_dative(day)} {de_m}"
    if kind == 4:  # a time of day
        hour = rng.randrange(1, 13)
        following = hour % 12 + 1
        choice = rng.randrange(5)
        if choice == 0:
            return "half past", f"half past {en_number(hour)}", f"halb {de_number(following)}"
        if choice == 1:
            return "quarter past", f"quarter past {en_number(hour)}", f"Viertel nach {de_number(hour)}"
        if choice == 2:
            return "quarter to", f"quarter to {en_number(following)}", f"Viertel vor {de_number(following)}"
        if choice == 3:
            return "o'clock", f"{en_number(hour)} o'clock", f"{de_number(hour, final=False)} Uhr"
        minutes = rng.choice([5, 10, 20, 25])
        return "minutes past", f"{en_number(minutes)} past {en_number(hour)}", \
            f"{de_number(minutes)} nach {de_number(hour)}"
    if kind == 5:  # a year
        year = rng.randrange(1000, 2100)
        return "year", f"in the year {year}", f"im Jahr {year}"
    # arithmetic, to give the numbers a sentence around them
    a, b = rng.randrange(1, 100), rng.randrange(1, 100)
    return ("sum", f"{en_number(a)} plus {en_number(b)} is {en_number(a + b)}",
            f"{de_number(a)} plus {de_number(b)} ist {de_number(a + b)}")


HELD_OUT_SHARE = 0.2  # of the phrases each construction can make, those that only dev and test may hold
# Constructions whose every phrase is a word's own translation ("one table": Tisch, a singular that no other phrase
# has, and its gender): a model learns them from training or not at all, so none is held out.
LEXICAL = {"one thing"}


def may_be_held_out(construction: str, english: str) -> bool:
    """Whether a phrase belongs to dev and test's part of its construction (by a stable hash), never to training.
    Held-out phrases drawn from all phrases would take whole small constructions (twelve "o'clock" phrases, twelve
    "half past") from training, which then could not learn them; this way each keeps most of its phrases for
    training, and test still measures phrases never trained on."""
    share = 0.0 if construction in LEXICAL else HELD_OUT_SHARE
    return int.from_bytes(hashlib.sha256(english.encode()).digest()[:4], "big") < share * 2**32


def splits(seed: int = 2017, sizes: tuple[int, int, int] = (30000, 500, 500)) -> dict[str, list[tuple[str, str, str]]]:
    """train, dev and test (their sizes in that order): (construction, English, German) each. A dev or test
    phrase is there once and never in training."""
    rng = random.Random(seed)
    held_out: set[str] = set()
    made = {}
    for name, size in zip(("test", "dev", "train"), sizes[::-1], strict=True):
        pairs: list[tuple[str, str, str]] = []
        while len(pairs) < size:
            construction, en, de = phrase(rng)
            if may_be_held_out(construction, en) == (name == "train") or en in held_out:
                continue
            if name != "train":
                held_out.add(en)
            pairs.append((construction, en, de))
        made[name] = pairs
    return made


def generate(out_dir: Path, seed: int = 2017, sizes: tuple[int, int, int] = (30000, 500, 500)) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, pairs in splits(seed, sizes).items():
        for index, lang in enumerate(("en", "de"), start=1):
            (out_dir / f"{name}.{lang}").write_text("".join(p[index] + "\n" for p in pairs), encoding="utf-8")


if __name__ == "__main__":
    generate(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent))
