"""params.yaml loads into typed, frozen objects; every mistake names the file, line and key."""
import dataclasses
import re
import typing

import pytest
import yaml

from pipeline import config
from pipeline.config import ROOT
from pipeline.config import ConfigError, Params, load_params, parse_params
from pipeline.presets import apply, apply_overrides, committed_params, dvc_set_args, layered, load_preset, \
    parse_override, preset_names, table3_rows

BASE = committed_params()[1]  # the paper's recipe, whatever a run (make quickstart) wrote into params.yaml since


def test_committed_params_are_the_papers_base_recipe():
    p = parse_params(BASE, "params.yaml")
    assert (p.model.d_model, p.model.n_heads, p.model.d_ff, p.model.encoder_layers, p.model.decoder_layers) == \
        (512, 8, 2048, 6, 6)
    assert p.model.dropout == 0.1 and p.model.norm == "post" and p.model.positions == "sinusoidal"
    assert p.train.adam_betas == (0.9, 0.98) and p.train.adam_eps == 1e-9 and p.train.warmup_steps == 4000
    assert p.train.label_smoothing == 0.1 and p.train.max_steps == 100_000 and p.train.batch_tokens == 25_000
    assert p.vocab.vocab_size == 37000 and p.vocab.model_type == "bpe"
    assert (p.average.last, p.decode.beam_size, p.decode.length_penalty, p.decode.max_length_extra) == (5, 4, 0.6, 50)
    assert (p.download.source, p.download.src_lang, p.download.tgt_lang) == ("wmt14", "en", "de")
    assert p.download.wmt14.corpora == ("europarl-v7", "commoncrawl", "news-commentary-v9")
    assert p.download.wmt14.test == "full" and (p.clean.max_ratio, p.clean.max_tokens) == (1.5, 250)


def test_params_are_frozen():
    p = parse_params(BASE, "params.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.train.max_steps = 1


def _broken(old: str, new: str) -> str:
    assert old in BASE
    return BASE.replace(old, new, 1)


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_unknown_key_is_named_with_its_line():
    text = _broken("  warmup_steps: 4000", "  warmup_steps: 4000\n  warmup_stpes: 4000")
    with pytest.raises(ConfigError, match=rf"params.yaml:{_line_of(text, 'warmup_stpes')}: train.warmup_stpes: "
                                          r"unknown key"):
        parse_params(text, "params.yaml")


def test_missing_key_is_named():
    text = _broken("  label_smoothing: 0.1      # section 5.4\n", "")
    with pytest.raises(ConfigError, match=r"train.label_smoothing: missing key in train"):
        parse_params(text, "params.yaml")


def test_wrong_type_and_choice_are_named_with_their_line():
    text = _broken("  d_model: 512", "  d_model: big")
    with pytest.raises(ConfigError, match=rf":{_line_of(text, 'd_model: big')}: model.d_model: expected an integer"):
        parse_params(text, "params.yaml")
    with pytest.raises(ConfigError, match=r"model.norm: 'middle' is not one of 'post', 'pre'"):
        parse_params(_broken("  norm: post", "  norm: middle"), "params.yaml")
    with pytest.raises(ConfigError, match=r"train.adam_betas: expected 2 values"):
        parse_params(_broken("adam_betas: [0.9, 0.98]", "adam_betas: [0.9]"), "params.yaml")


def test_malformed_yaml_names_the_line():
    text = _broken("  beam_size: 4", "  beam_size: [4")
    with pytest.raises(ConfigError, match=r"params.yaml:\d+: not valid YAML"):
        parse_params(text, "params.yaml")


def test_a_key_given_twice_is_named_with_both_lines_where_pyyaml_would_keep_the_last(tmp_path):
    text = _broken("  d_model: 512", "  d_model: 512\n  d_model: 256")
    first = _line_of(text, "d_model: 512")
    with pytest.raises(ConfigError, match=rf"params.yaml:{first + 1}: not valid YAML \(key 'd_model' given twice, "
                                          rf"first on line {first}\)"):
        parse_params(text, "params.yaml")
    path = tmp_path / "params.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"params.yaml:{first + 1}: not valid YAML \(key 'd_model' given twice"):
        apply_overrides({"train.max_steps": 7}, path)  # before DVC's YAML library reads it, with its own error
    assert path.read_text(encoding="utf-8") == text


def test_keys_a_merge_brings_in_may_be_set_again():
    """The GPU tries reuse one try's keys by a YAML merge and change some (bench/gpu/multi30k-tries.yaml)."""
    assert config.load_yaml("a: &a {x: 1, y: 2}\nb: {<<: *a, y: 3}\n", "tries.yaml")["b"] == {"x": 1, "y": 3}


def test_an_override_that_is_not_yaml_or_not_valid_is_named_as_given(tmp_path):
    with pytest.raises(ConfigError, match=r"^override 'train.adam_betas=\[0.9': not valid YAML"):
        parse_override("train.adam_betas=[0.9")
    path = tmp_path / "params.yaml"
    path.write_text(BASE, encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: override train.max_steps: must be 0 or more"):
        apply(["multi30k"], {"train.max_steps": -3}, path, say=lambda _: None)
    assert path.read_text(encoding="utf-8") == BASE


def test_a_preset_that_is_not_valid_yaml_is_named_with_its_line(tmp_path, monkeypatch):
    monkeypatch.setattr("pipeline.presets.PRESETS_DIR", tmp_path)
    (tmp_path / "mine.yaml").write_text("train.max_steps: 10\ntrain.max_steps: 20\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"mine.yaml:2: not valid YAML \(key 'train.max_steps' given twice"):
        load_preset("mine")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="parameters file not found"):
        load_params(tmp_path / "params.yaml")


def test_every_preset_applies_cleanly(tmp_path):
    assert {"big", "en-fr", "quickstart"} <= set(preset_names())
    for name in preset_names():
        path = tmp_path / f"{name}.yaml"
        path.write_text(BASE, encoding="utf-8")
        p = apply_overrides(load_preset(name), path)
        reloaded = load_params(path)
        assert reloaded == p
        for key, value in load_preset(name).items():
            got = p
            for part in key.split("."):
                got = getattr(got, part)
            assert config._plain(got) == value


def test_presets_layered_in_memory_equal_those_written_into_params_yaml(tmp_path):
    path = tmp_path / "params.yaml"
    for names in (["multi30k", "multi30k-gpu"], ["big"], ["quickstart"]):
        path.write_text(BASE, encoding="utf-8")
        overrides = {k: v for n in names for k, v in load_preset(n).items()}
        assert layered(overrides, path) == apply_overrides(overrides, path), names
    with pytest.raises(ConfigError, match=r"train.max_stpes: unknown key \(known here: max_steps, batch_tokens"):
        layered({"train.max_stpes": 7}, path)
    with pytest.raises(ConfigError, match=r"trian.max_steps: unknown key \(known here: download, clean"):
        layered({"trian.max_steps": 7}, path)
    # An error names the override that set its value, else the line of its key in the file, however the
    # layered text would be laid out.
    line = _line_of(BASE, "keep_checkpoints:")
    for check in (layered, apply_overrides):
        with pytest.raises(ConfigError, match=r"params.yaml: override train.max_steps: expected an integer"):
            check({"train.max_steps": "many"}, path)
        with pytest.raises(ConfigError, match=rf"params.yaml \(with overrides average.last\):{line}: "
                                              rf"train.keep_checkpoints: \d+ would delete checkpoints"):
            check({"average.last": 99}, path)


def test_big_preset_is_the_papers_big_model(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(BASE, encoding="utf-8")
    p = apply_overrides(load_preset("big"), path)
    assert (p.model.d_model, p.model.n_heads, p.model.d_ff, p.model.dropout) == (1024, 16, 4096, 0.3)
    assert (p.train.max_steps, p.average.last) == (300_000, 20)


def test_overrides_keep_comments_and_refuse_unknown_keys(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(BASE, encoding="utf-8")
    apply_overrides({"train.max_steps": 7}, path)
    text = path.read_text(encoding="utf-8")
    assert re.search(r"max_steps: 7 +# section 5.2", text)
    with pytest.raises(ConfigError, match="train.max_stpes: unknown key"):
        apply_overrides({"train.max_stpes": 7}, path)
    with pytest.raises(ConfigError, match="train.max_steps: expected an integer"):
        apply_overrides({"train.max_steps": "many"}, path)
    assert yaml.safe_load(path.read_text(encoding="utf-8"))["train"]["max_steps"] == 7  # the bad ones wrote nothing


def test_lowercased_training_text_is_scored_lowercased(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(BASE, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"params.yaml: override clean.lowercase: .*set score.lowercase: true"):
        apply_overrides({"clean.lowercase": True}, path)
    assert apply_overrides({"clean.lowercase": True, "score.lowercase": True}, path).clean.lowercase


@pytest.mark.parametrize("written", ["1e-8", "1.0e-8", "1E-08", "+1e-8"])
def test_a_number_with_an_exponent_is_a_number_by_hand_and_by_override(written, tmp_path):
    """YAML 1.1 reads 1e-8 (no point) as a string; ruamel, which writes overrides, writes 1.0e-8 as 1e-08.
    Both ways it must read back as the number, in params.yaml and in a `-S` value."""
    path = tmp_path / "params.yaml"
    path.write_text(BASE.replace("adam_eps: 1.0e-9", f"adam_eps: {written}"), encoding="utf-8")
    assert load_params(path).train.adam_eps == 1e-8
    path.write_text(BASE, encoding="utf-8")
    key, value = parse_override(f"train.adam_eps={written}")
    assert apply_overrides({key: value}, path).train.adam_eps == 1e-8
    assert load_params(path).train.adam_eps == 1e-8  # as written: the next command reads it back


def test_presets_start_over_from_the_file_before_the_last_presets_and_values_alone_stack(tmp_path):
    """The README's commands in order: `--preset multi30k` after the quickstart or after an en-fr run is
    the preset on the committed file, not on their settings; `-S` alone extends the file as it is."""
    path, fresh = tmp_path / "params.yaml", tmp_path / "fresh.yaml"
    fresh.write_text(BASE, encoding="utf-8")
    multi30k = load_preset("multi30k")
    alone = apply_overrides(multi30k, fresh)
    path.write_text(BASE, encoding="utf-8")
    quickstart = apply_overrides(load_preset("quickstart"), path, start_over=True)
    assert quickstart.train.compile != alone.train.compile  # the quickstart's own, which multi30k does not set
    extended = apply_overrides({"train.max_steps": 1600}, path)  # values alone: on the quickstart
    assert extended == dataclasses.replace(quickstart, train=dataclasses.replace(quickstart.train, max_steps=1600))
    said = []
    assert layered(multi30k, path, start_over=True) == apply(["multi30k"], {}, path, said.append) == alone
    assert said == ["params.yaml: train.lr_scale, train.compile as before the last presets (presets start over)"]
    french = apply(["multi30k"], {"download.tgt_lang": "fr"}, path, said.append)
    assert french.download.tgt_lang == "fr" and len(said) == 1  # nothing set back: the file was the preset's
    assert apply(["multi30k"], {}, path, said.append) == alone
    assert said[1] == "params.yaml: download.tgt_lang as before the last presets (presets start over)"


def test_presets_start_over_from_an_edit_by_hand_never_from_before_it(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(BASE.replace("max_tokens: 250", "max_tokens: 200"), encoding="utf-8")  # an edit before
    assert apply_overrides(load_preset("quickstart"), path, start_over=True).clean.max_tokens == 200
    assert apply_overrides(load_preset("multi30k"), path, start_over=True).clean.max_tokens == 200
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("  seed: 1\n", "  seed: 5\n", 1), encoding="utf-8")  # an edit after: the base
    edited = load_params(path)
    amx = apply_overrides(load_preset("multi30k-amx"), path, start_over=True)
    assert amx.vocab.seed == 5 and amx.vocab.vocab_size == edited.vocab.vocab_size == 8000  # multi30k's, kept
    assert amx.train.max_steps == 3000
    (tmp_path / ".params-layers.json").write_text("[not json", encoding="utf-8")  # a broken record: the file as it is
    assert apply_overrides(load_preset("multi30k-amx"), path, start_over=True) == amx


def test_a_missing_params_file_is_named_before_anything_is_written(tmp_path):
    path = tmp_path / "params.yaml"
    for change in (lambda: apply(["quickstart"], {}, path), lambda: layered({}, path, start_over=True),
                   lambda: apply([], {"train.max_steps": 5}, path)):
        with pytest.raises(ConfigError, match=f"{path}: parameters file not found"):
            change()
    assert list(tmp_path.iterdir()) == []


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"no preset 'huge' \(known: .*big"):
        load_preset("huge")


def test_table3_rows_are_valid_experiments_of_the_papers_shapes(tmp_path):
    rows = table3_rows()
    assert {n[0] for n in rows} == set("ABCDE") and len(rows) == 18
    path = tmp_path / "params.yaml"
    for name, overrides in rows.items():
        path.write_text(BASE, encoding="utf-8")
        p = apply_overrides(overrides, path)
        assert p.average.last == 1, name  # the paper scored Table 3 without checkpoint averaging
        d_k, d_v = p.model.head_dims
        if name.startswith("A"):  # attention heads vary with the computation kept constant
            assert p.model.n_heads * d_k == p.model.n_heads * d_v == 512
    assert dvc_set_args(rows["E-learned"]) == ["-S", "average.last=1", "-S", "model.positions=learned"]
    assert dvc_set_args({"train.adam_betas": [0.9, 0.98]}) == ["-S", "train.adam_betas=[0.9, 0.98]"]


# Every value is checked when params.yaml loads, by its section's class, and reported at its line.
BAD_VALUES = [
    ("download", "  tgt_lang: de", "  tgt_lang: en", "download.tgt_lang: must differ from src_lang"),
    ("download", "    corpora: [europarl-v7, commoncrawl, news-commentary-v9]", "    corpora: [europarl-v8]",
     "download.wmt14.corpora: unknown corpus 'europarl-v8'"),
    ("download", "    corpora: [europarl-v7, commoncrawl, news-commentary-v9]", "    corpora: [un]",
     "download.wmt14.corpora: no en-de text in un"),
    ("download", "    mirrors: []", "    mirrors: [ftp.example.org]", "download.wmt14.mirrors: 'ftp.example.org'"),
    ("clean", "  max_tokens: 250", "  max_tokens: 0", "clean.max_tokens: must be at least 1"),
    ("clean", "  max_ratio: 1.5", "  max_ratio: 0.5", "clean.max_ratio: is longest over shortest"),
    ("vocab", "  vocab_size: 37000", "  vocab_size: 3", "vocab.vocab_size: must exceed the 4 special pieces"),
    ("vocab", "  character_coverage: 1.0", "  character_coverage: 1.5", "vocab.character_coverage"),
    ("model", "  n_heads: 8", "  n_heads: 7", "model.n_heads: d_model 512 is not divisible by n_heads 7"),
    ("model", "  dropout: 0.1", "  dropout: 1.0", "model.dropout: is a probability in"),
    ("model", "  d_ff: 2048", "  d_ff: 0", "model.d_ff: must be at least 1"),
    ("train", "  batch_tokens: 25000", "  batch_tokens: 0", "train.batch_tokens: must be at least 1"),
    ("train", "  warmup_steps: 4000", "  warmup_steps: 0", "train.warmup_steps: must be at least 1"),
    ("train", "  lr_scale: 1.0", "  lr_scale: 0.0", "train.lr_scale: must be positive"),
    ("train", "  adam_betas: [0.9, 0.98]", "  adam_betas: [0.9, 1.0]", "train.adam_betas: must be in"),
    ("train", "  keep_checkpoints: 20", "  keep_checkpoints: 3", "train.keep_checkpoints: 3 would delete checkpoints "
                                                               r"that average.last \(5\) averages"),
    ("average", "  last: 5  ", "  last: 0  ", "average.last: must be at least 1"),
    ("decode", "  beam_size: 4", "  beam_size: 0", "decode.beam_size: must be at least 1"),
    ("decode", "  max_length_extra: 50", "  max_length_extra: -1", "decode.max_length_extra: must be 0 or more"),
    ("score", "  tokenize: 13a", "  tokenize: 14a", "score.tokenize: '14a' is not a sacreBLEU tokenizer"),
]


@pytest.mark.parametrize("section, old, new, message", BAD_VALUES, ids=[f"{b[0]}:{b[2].split(':')[0].strip()}"
                                                                         for b in BAD_VALUES])
def test_a_value_out_of_range_is_named_with_its_line_before_any_stage_runs(section, old, new, message):
    text = _broken(old, new)
    line = _line_of(text, new.rstrip())
    with pytest.raises(ConfigError, match=rf"params.yaml:{line}: {message}"):
        parse_params(text, "params.yaml")


def test_local_training_files_are_needed_only_when_the_source_is_local():
    text = _broken("    train: [{src: train.en, tgt: train.de}]", "    train: []")
    assert parse_params(text, "params.yaml").download.local.train == ()
    local = text.replace("  source: wmt14", "  source: local", 1)
    line = _line_of(local, "train: []")
    with pytest.raises(ConfigError, match=rf"params.yaml:{line}: download.local.train: names no"):
        parse_params(local, "params.yaml")



@pytest.mark.parametrize("overrides, name", [
    ({}, "newstest2014"),
    ({"download.wmt14.test": "filtered"}, "newstest2014-filtered"),
    ({"download.source": "multi30k"}, "multi30k-test_2016_flickr"),
    ({"download.source": "local"}, "numbers"),  # the quickstart's corpus
    ({"download.source": "local", "download.local.dir": "../shared/data/multi30k",
      "download.local.test": {"src": "test_2016_flickr.en", "tgt": "test_2016_flickr.de"}},
     "multi30k-test_2016_flickr"),
    ({"download.source": "local", "download.local.dir": "my data/WMT 2014"}, "WMT-2014"),
    ({"download.source": "local", "download.local.dir": "."}, "local"),
])
def test_the_test_set_names_what_test_bleu_compares_within(overrides, name):
    """The registered model's name carries it (pipeline/registry.py), so `best` never ranks a model on
    one test set above one scored on another."""
    assert layered(overrides, ROOT / "params.yaml", BASE).download.test_set == name

def _numeric_keys(cls, prefix=""):
    """Every int or float parameter of a params class, nested sections included."""
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _numeric_keys(hint, f"{prefix}{f.name}.")
        elif hint in (int, float) or int in typing.get_args(hint):  # int | None, int | Literal["auto"]
            yield f"{prefix}{f.name}"


@pytest.mark.parametrize("key", list(_numeric_keys(Params)))
def test_every_numeric_parameter_refuses_a_negative_value(key, tmp_path):
    """So a parameter added without a check of its own fails here."""
    path = tmp_path / "params.yaml"
    path.write_text(BASE, encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: "):
        apply_overrides({key: -1}, path)


def test_the_processes_and_micro_batches_are_auto_or_counts_that_share(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(BASE, encoding="utf-8")
    assert (load_params(path).train.processes, load_params(path).train.micro_batches) == ("auto", "auto")
    assert apply_overrides({"train.processes": 2, "train.micro_batches": 8}, path).train.micro_batches == 8
    for value, said in ((0, "must be auto or at least 1, not 0"), ("all", "expected an integer or 'auto', got 'all'")):
        path.write_text(BASE, encoding="utf-8")
        with pytest.raises(ConfigError, match=rf"params.yaml: override train.processes: {said}"):
            apply_overrides({"train.processes": value}, path)
    with pytest.raises(ConfigError, match="micro_batches: 8 micro-batches a step cannot be shared by 3 processes"):
        apply_overrides({"train.processes": 3, "train.micro_batches": 8}, path)


def test_reading_params_yaml_imports_no_torch():
    """The params classes live apart from the stages' code, so loading params.yaml (and presets, as the
    benches do) costs YAML and the checks, not torch, Accelerate or the orchestration's libraries."""
    import subprocess
    import sys

    code = ("import sys, pipeline.config, pipeline.presets; pipeline.presets.layered({'train.max_steps': 5}); "
            "print(sorted(m for m in ('torch', 'accelerate', 'mlflow', 'prefect', 'dvc', 'transformer.model') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_bench_base_is_the_committed_recipe_whatever_a_run_wrote_into_params_yaml(tmp_path_factory):
    """`pipeline run --preset quickstart` writes its preset into params.yaml; a bench's base (and the
    presets layered on it) still reads params.yaml as committed."""
    import shutil
    import subprocess
    import sys

    from conftest import copy_project, env_of

    project = copy_project(tmp_path_factory)
    apply_overrides(load_preset("quickstart"), project / "params.yaml")
    code = ("from bench.common import model_settings; "
            "print(*(model_settings(n).model.d_model for n in ('base', 'big', 'multi30k')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=project, env=env_of(project), capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == ["512", "1024", "256"], out.stdout + out.stderr  # not the quickstart's 128
    shutil.rmtree(project / ".git")  # no clone: the file as it stands is all there is
    out = subprocess.run([sys.executable, "-c", code], cwd=project, env=env_of(project), capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == ["128", "1024", "256"], out.stdout + out.stderr


def test_a_clone_has_params_yaml_as_committed_the_code_as_it_stands_and_no_run_outputs(tmp_path_factory):
    """What the tests' copies and the benches' fresh clones are (bench.common.clone): after `make quickstart`
    the checkout's params.yaml holds the quickstart and dvc.lock and metrics/ its outputs, none of which a
    clone has; an edit to a tracked file not yet committed is in it."""
    import subprocess
    import sys

    from conftest import copy_project, env_of

    project = copy_project(tmp_path_factory)
    apply_overrides(load_preset("quickstart"), project / "params.yaml")
    (project / "dvc.lock").write_text("schema: '2.0'\n", encoding="utf-8")
    (project / "metrics").mkdir()
    (project / "metrics/score.json").write_text("{}", encoding="utf-8")
    with (project / "README.md").open("a", encoding="utf-8") as f:
        f.write("an edit not yet committed\n")
    dest = tmp_path_factory.mktemp("again") / "project"
    code = f"import pathlib, bench.common; bench.common.clone(pathlib.Path({str(dest)!r}))"
    subprocess.run([sys.executable, "-c", code], cwd=project, env=env_of(project), capture_output=True, check=True)
    assert (dest / "params.yaml").read_text(encoding="utf-8") == BASE
    assert not (dest / "dvc.lock").exists() and not (dest / "metrics").exists()
    assert (dest / "README.md").read_text(encoding="utf-8").endswith("an edit not yet committed\n")


def test_the_preset_command_starts_over_and_says_what_it_sets_back(tmp_path_factory):
    """The CLI's way in (the flow's is the same call): the quickstart, then Multi30k in French, then the
    Multi30k preset: German again, and compiled as the preset is without the quickstart's setting."""
    import subprocess
    import sys

    from conftest import copy_project, env_of

    project = copy_project(tmp_path_factory)
    outputs = [subprocess.run([sys.executable, "-m", "pipeline", "preset", *args], cwd=project, env=env_of(project),
                              capture_output=True, text=True, check=True).stdout
               for args in (["quickstart"], ["multi30k", "-S", "download.tgt_lang=fr"], ["multi30k"])]
    assert "as before the last presets" not in outputs[0]
    assert outputs[1].startswith("params.yaml: train.lr_scale, train.compile as before the last presets"), outputs[1]
    assert outputs[2].startswith("params.yaml: download.tgt_lang as before the last presets"), outputs[2]
    params = load_params(project / "params.yaml")
    assert (params.download.tgt_lang, params.train.compile, params.model.d_model) == ("de", "auto", 256)
    assert subprocess.run(["git", "status", "--porcelain", "--ignored", ".params-layers.json"], cwd=project,
                          capture_output=True, text=True, check=True).stdout.startswith("!!")  # git ignores it


@pytest.mark.parametrize("args, message", [
    (["run", "--preset", "nope"], "error: no preset 'nope' (known: big, en-fr, multi30k"),
    (["run", "-S", "train.max_stpes=3"], "override train.max_stpes: unknown key (known here: max_steps"),
    (["quickstart", "-S", "train.max_steps=abc"], "train.max_steps: expected an integer, got 'abc'"),
])
def test_a_wrong_preset_or_override_stops_the_run_in_one_line_before_the_flow_starts(args, message):
    """Checked before Prefect is imported and its server started: one line, no traceback, params.yaml as
    it was."""
    import subprocess
    import sys

    before = config.PARAMS_FILE.read_bytes()
    out = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stdout == "" and out.stderr.count("\n") == 1 and out.stderr.startswith("error: "), out.stderr
    assert message in out.stderr
    assert config.PARAMS_FILE.read_bytes() == before


def test_gpu_multi30k_tries_load_and_their_rescore_variants_reuse_the_training_only(tmp_path):
    from bench.gpu import FULL
    from bench.gpu.multi30k import tries, try_settings

    for name, overrides in tries().items():  # the file as committed: every try and variant loads
        found = try_settings(FULL, name, overrides, tmp_path)
        assert len(found) == 1 + len(overrides.get("rescore", []))
        assert all(v.train == found[0].train and v.model == found[0].model for v in found[1:]), name
    preset = try_settings(FULL, "preset", tries()["preset"], tmp_path)
    assert [(p.average.last, p.decode.beam_size) for p in preset[:2]] == [(5, 4), (10, 4)]
    with pytest.raises(ValueError, match=r"x: a rescore variant changes train.max_steps; it may change only"):
        try_settings(FULL, "x", {"rescore": [{"train.max_steps": 9}]}, tmp_path)
    with pytest.raises(ConfigError, match=r"keep_checkpoints: 5 would delete checkpoints that average.last \(10\)"):
        try_settings(FULL, "x", {"rescore": [{"average.last": 10}]}, tmp_path)
