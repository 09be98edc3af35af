"""Multi30k task 1 (Elliott et al. 2016): 29,000 image captions in English, German and French, a
small real benchmark a Transformer learns in minutes. The files are fetched one by one, gzipped,
from the dataset's own repository at a pinned commit; each is verified by the sha256 of its
decompressed text, so any faithful copy (a mirror that recompresses them included) is accepted.
Dev is `val` (1,014), test is `test_2016_flickr` (1,000), the set published results are quoted on.
"""
from __future__ import annotations

from stages.fetch import Archive

COMMIT = "a3d2e0d26b56f3846f66a952536ffed4e401d05a"
BASE = f"https://raw.githubusercontent.com/multi30k/dataset/{COMMIT}/data/task1/raw"
LANGUAGES = ("en", "de", "fr")
FILES = {"train": "train", "dev": "val", "test": "test_2016_flickr"}  # split -> file name stem
PAIRS = {"train": 29_000, "dev": 1_014, "test": 1_000}

# sha256 of each file's text after gunzip (the snapshot of the commit above).
TEXT_SHA256 = {
    ("train", "en"): "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6",
    ("train", "de"): "2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72",
    ("train", "fr"): "5925a3c18f1587b6b54b87743106e6e8ab93618edb6f65d19eac0621f853a10d",
    ("dev", "en"): "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227",
    ("dev", "de"): "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660",
    ("dev", "fr"): "5304e444d842e962b2dda4d816b70b22a1765b15401642b7ca37a67477e708dc",
    ("test", "en"): "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182",
    ("test", "de"): "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16",
    ("test", "fr"): "cb3160d69b002bb638e66cc7612fcd56cb0af82eadc9c142dedc438afb885ef6",
}


def archive(split: str, lang: str) -> Archive:
    """The gzipped file of one split in one language, checked by its decompressed text."""
    return Archive(f"{BASE}/{FILES[split]}.{lang}.gz", None, "sha256", TEXT_SHA256[(split, lang)], gunzipped=True)
