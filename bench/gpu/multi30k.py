"""bench.gpu's multi30k part: the pipeline's stages in dvc.yaml's order with the presets multi30k and
multi30k-gpu and a try's changes (bench/gpu/multi30k-tries.yaml), each stage timed, and the BLEU; then
the try's `rescore` variants, other averaging and decoding of the same training, on dev only (a GPU
minute trains one model, and averages and decodes it several ways in seconds)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.common import MULTI30K, settings
from bench.gpu import Sizes
from pipeline.config import Params, load_yaml

TRIES = Path(__file__).with_name("multi30k-tries.yaml")


RESCORED = ("average.", "decode.")  # what a rescore variant may change: not the training it reuses


def tries() -> dict[str, dict[str, Any]]:
    """Name -> overrides after the presets (with `rescore`, a list of variants), in the file's order."""
    return load_yaml(TRIES.read_text(encoding="utf-8"), str(TRIES))


def try_settings(sizes: Sizes, name: str, overrides: dict[str, Any], source: Path) -> list[Params]:
    """The try's settings, then each rescore variant's (the try's with the variant's changes), the sizes'
    overrides last; checked before any GPU time is spent: a variant changes averaging and decoding only,
    and (params' own check) averages no more checkpoints than training keeps."""
    tgt = target_language(overrides)
    local = {"download.source": "local", "download.local.dir": str(source),
             "download.local.train": [{"src": "train.en", "tgt": f"train.{tgt}"}],
             "download.local.dev": {"src": "val.en", "tgt": f"val.{tgt}"},
             "download.local.test": {"src": "test_2016_flickr.en", "tgt": f"test_2016_flickr.{tgt}"}}
    changes = {k: v for k, v in overrides.items() if k != "rescore"}
    variants = overrides.get("rescore", [])
    for variant in variants:
        if wrong := [k for k in variant if not k.startswith(RESCORED)]:
            raise ValueError(f"{TRIES}: {name}: a rescore variant changes {', '.join(wrong)}; it may change only "
                             f"average.* and decode.*, what reuses the try's training")
    return [settings({**local, **changes, **variant, **sizes.multi30k}, presets=("multi30k", "multi30k-gpu"))
            for variant in [{}, *variants]]


def target_language(overrides: dict[str, Any]) -> str:
    """The language a try translates English into: its `download.tgt_lang`, else the preset's German."""
    return overrides.get("download.tgt_lang", "de")


def first_of_each_pair(named: dict[str, dict[str, Any]]) -> list[str]:
    """The first try of each language pair, in the file's order (what --smoke runs)."""
    first: dict[str, str] = {}
    for name, overrides in named.items():
        first.setdefault(target_language(overrides), name)
    return list(first.values())


def multi30k(sizes: Sizes, work: Path, name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The pipeline's stages, in dvc.yaml's order, with the presets multi30k and multi30k-gpu and then
    `overrides`, on the shared Multi30k copy (the download stage's local source): each stage's time
    and the BLEU; then each rescore variant's dev BLEU. The pair is English to the overrides'
    `download.tgt_lang` (German by default)."""
    from stages import average, clean, download, encode, score, train, vocab
    from stages import decode as decode_stage
    from stages.devices import default_device
    from stages.io import read_lines, split_path

    source = work / "multi30k-source"
    source.mkdir(parents=True, exist_ok=True)
    tgt = target_language(overrides)
    for stem in ("train", "val", "test_2016_flickr"):
        for lang in ("en", tgt):
            lines = (MULTI30K / f"{stem}.{lang}").read_text(encoding="utf-8").splitlines()
            (source / f"{stem}.{lang}").write_text("\n".join(lines[: sizes.multi30k_lines]) + "\n", encoding="utf-8")
    params, *variants = try_settings(sizes, name, overrides, source)
    out = work / f"multi30k-{name}"
    paths = {name: out / name for name in ("raw", "clean", "vocab", "encoded", "checkpoints", "plots", "hyps")}
    model = out / "averaged.safetensors"
    stages = {
        "download": lambda: download.run(params.download, out_dir=paths["raw"]),
        "clean": lambda: clean.run(params.clean, raw_dir=paths["raw"], out_dir=paths["clean"]),
        "vocab": lambda: vocab.run(params.vocab, clean_dir=paths["clean"], out_dir=paths["vocab"]),
        "encode": lambda: encode.run(clean_dir=paths["clean"], vocab_dir=paths["vocab"], out_dir=paths["encoded"]),
        "train": lambda: train.run(params.model, params.train, encoded_dir=paths["encoded"], vocab_dir=paths["vocab"],
                                   checkpoint_dir=paths["checkpoints"], plots_dir=paths["plots"]),
        "average": lambda: average.run(params.average, checkpoint_dir=paths["checkpoints"], out_path=model),
        "decode": lambda: decode_stage.run(params.decode, model_path=model, vocab_dir=paths["vocab"],
                                           clean_dir=paths["clean"], out_dir=paths["hyps"]),
        "score": lambda: score.run(params.score, hyp_dir=paths["hyps"], ref_dir=paths["raw"]),
    }
    seconds, metrics = {}, {}
    for stage, run in stages.items():
        start = time.perf_counter()
        metrics[stage] = run()
        seconds[stage] = time.perf_counter() - start
        print(f"multi30k: {stage} done in {seconds[stage]:.0f} s", flush=True)
    dev_src = list(read_lines(split_path(paths["clean"], "dev", "en")))
    dev_ref = list(read_lines(split_path(paths["raw"], "dev", tgt)))
    sp, rescored = vocab.load(paths["vocab"]), []
    for variant, found in zip(overrides.get("rescore", []), variants, strict=True):
        start, averaged = time.perf_counter(), out / "rescored.safetensors"
        average.run(found.average, checkpoint_dir=paths["checkpoints"], out_path=averaged)
        translator = decode_stage.load_translator(averaged, default_device(), found.decode.precision)
        hyps = decode_stage.translate(translator, sp, dev_src, found.decode, desc=None)
        dev = score.score(found.score, hyps, dev_ref, hyp_name=f"{name} {variant}", ref_name="val", lang=tgt)
        rescored.append({"changes": variant, "bleu": dev["bleu"], "bleu_lc_tok": dev["bleu_lc_tok"],
                         "seconds": time.perf_counter() - start})
        print(f"multi30k: {name} with {variant}: dev sacreBLEU {dev['bleu']:.2f}", flush=True)
    return {"try": name, "pair": f"en-{tgt}", "overrides": {k: v for k, v in overrides.items() if k != "rescore"},
            "seconds": seconds, "total_seconds": sum(seconds.values()), "steps": params.train.max_steps,
            "train": metrics["train"], "rescored": rescored,
            **{kind: {split: metrics["score"][split][kind] for split in ("dev", "test")}
               for kind in ("bleu", "bleu_lc_tok")}}
