"""params.yaml -> frozen, typed objects, composed from each stage's params class (stages/params.py)
and the model's (transformer/config.py), none of which imports torch.

Every key must be known and present, and every value is checked by its class when it loads (each
params class's __post_init__ raises ValueError(key, message)): a typo, a forgotten key or a value
out of range stops the run with the file, the line and the key named, before any stage does work.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from stages.io import PipelineError
from stages.params import AverageParams, CleanParams, DecodeParams, DownloadParams, ScoreParams, TrainParams, \
    VocabParams
from transformer.config import TransformerConfig

ROOT = Path(__file__).resolve().parent.parent
PARAMS_FILE = ROOT / "params.yaml"


def checkout_of(root: Path, dvc_root: str | None) -> Path:
    """The checkout where records that outlive a run belong (MLflow's store, notes of what a server
    missed): `root`, unless it is a temporary copy in which DVC runs an experiment (`dvc queue start`,
    `dvc exp run --run-all`: <repository>/.dvc/tmp/exps/<copy>/; `dvc exp run --temp`:
    .../exps/standalone/<copy>/), deleted when the run ends; then the same folder of the repository it
    was started from, which DVC names in DVC_ROOT."""
    if dvc_root:
        repository = Path(dvc_root).resolve()
        copies = repository / ".dvc" / "tmp" / "exps"
        if root.is_relative_to(copies):
            parts = root.relative_to(copies).parts
            copy = 2 if parts[:1] == ("standalone",) else 1  # the parts that name the copy
            if len(parts) >= copy:
                return repository.joinpath(*parts[copy:])
    return root


def stages_env() -> dict[str, str]:
    """The environment for a `dvc` command started from here: the `python` of dvc.yaml's commands is
    this one, whether or not its environment is activated."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


CHECKOUT = checkout_of(ROOT, os.environ.get("DVC_ROOT"))


@dataclass(frozen=True)
class Params:
    download: DownloadParams
    clean: CleanParams
    vocab: VocabParams
    model: TransformerConfig
    train: TrainParams
    average: AverageParams
    decode: DecodeParams
    score: ScoreParams

    def __post_init__(self) -> None:  # checks across sections
        if self.train.keep_checkpoints < self.average.last:
            raise ValueError("train.keep_checkpoints", f"{self.train.keep_checkpoints} would delete checkpoints that "
                                                       f"average.last ({self.average.last}) averages")
        if self.clean.lowercase and not self.score.lowercase:
            raise ValueError("clean.lowercase", "trains on lowercased text, whose translations a cased BLEU would "
                                                "count wrong on every capital: set score.lowercase: true too")


class ConfigError(PipelineError):
    pass


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading a number with an exponent and no point (1e-8) as a float, as YAML 1.2
    does and as ruamel (DVC's library, which writes `-S` overrides into params.yaml) writes 1e-08: YAML 1.1
    reads it as the string '1e-8'. A key given twice in one mapping is an error, as in ruamel: PyYAML
    would keep the last one silently, so a stage run alone and `dvc repro` would read two configurations."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:  # as written: `<<: *anchor` merges keys that may be set again
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice, first on line {first[key]}", key_node.start_mark)
            first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
                                 list("-+0123456789"))


def load_yaml(text: str, name: str) -> Any:
    """The project's YAML (params.yaml, presets, overrides, the GPU tries) as plain data, safely; an error
    names `name` and, where `text` is lines (a file, not a value on the command line), the line."""
    try:
        return yaml.load(text, Loader=YamlLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark and "\n" in text else ""
        raise ConfigError(f"{name}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None


class _Source:
    """Where the values came from, to point errors at a line, or at the override that set the value."""

    def __init__(self, name: str, text: str, overrides: Collection[str] = ()) -> None:
        self.name, self.overrides = name, tuple(overrides)
        self.lines: dict[str, int] = {}
        try:
            root = yaml.compose(text, Loader=YamlLoader)
        except yaml.YAMLError:
            root = None  # a syntax error: parse_params reports it with its own line
        self._index(root, "")

    def _index(self, node: yaml.Node | None, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                path = f"{prefix}{key.value}"
                self.lines[path] = key.start_mark.line + 1
                self._index(value, path + ".")
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.lines[f"{prefix}{i}"] = item.start_mark.line + 1
                self._index(item, f"{prefix}{i}.")

    def error(self, key: str, message: str) -> ConfigError:
        if any(key == o or key.startswith(o + ".") for o in self.overrides):  # the value is not in the file
            return ConfigError(f"{self.name}: override {key}: {message}")
        line = self.lines.get(key) or self.lines.get(key.rsplit(".", 1)[0])
        layered = f" (with overrides {', '.join(self.overrides)})" if self.overrides else ""
        return ConfigError(f"{self.name}{layered}{f':{line}' if line else ''}: {key}: {message}")


def _convert(tp: Any, value: Any, key: str, src: _Source) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise src.error(key, f"expected a mapping of {', '.join(f.name for f in dataclasses.fields(tp))}")
        return _build(tp, value, key + ".", src)
    if origin is Literal:
        if value not in args:
            raise src.error(key, f"{value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise src.error(key, f"expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{key}.{i}", src) for i, v in enumerate(value))
        if len(value) != len(args):
            raise src.error(key, f"expected {len(args)} values, got {len(value)}")
        return tuple(_convert(a, v, f"{key}.{i}", src) for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:  # the first kind the value is of
            try:
                return _convert(option, value, key, src)
            except ConfigError:
                continue
        raise src.error(key, f"expected {' or '.join(map(_kind, options))}, got {value!r}")
    if tp is bool:
        if not isinstance(value, bool):
            raise src.error(key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise src.error(key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise src.error(key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise src.error(key, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported parameter type {tp}")


def _kind(tp: Any) -> str:
    """What a value of type `tp` is called in an error."""
    if typing.get_origin(tp) is Literal:
        return " or ".join(map(repr, typing.get_args(tp)))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _build(cls: type, data: dict[str, Any], prefix: str, src: _Source) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in hints:
            raise src.error(f"{prefix}{key}", f"unknown key (known here: {', '.join(names)})")
    missing = [n for n in names if n not in data]
    if missing:
        where = prefix.rstrip(".") or "the top level"
        raise src.error(f"{prefix}{missing[0]}", f"missing key in {where}")
    values = {n: _convert(hints[n], data[n], prefix + n, src) for n in names}
    try:
        return cls(**values)
    except ValueError as e:  # a check of the class's own __post_init__: ValueError(key, message)
        if len(e.args) == 2 and isinstance(e.args[0], str):
            raise src.error(prefix + e.args[0], e.args[1]) from None
        raise src.error(prefix.rstrip(".") or names[0], str(e)) from None


def read_yaml(text: str, name: str) -> dict[str, Any]:
    """params.yaml's text as plain data; a syntax error names its line."""
    data = load_yaml(text, name)
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: expected a mapping of stage names to their parameters")
    return data


def build_params(data: dict[str, Any], name: str, text: str, overrides: Collection[str] = ()) -> Params:
    """Params from `data`, read from `text` and then changed by `overrides` (dotted keys, values only):
    an error names the override that set the value, else the line of its key in `text`."""
    return _build(Params, data, "", _Source(name, text, overrides))


def parse_params(text: str, name: str, overrides: Collection[str] = ()) -> Params:
    return build_params(read_yaml(text, name), name, text, overrides)


def load_params(path: str | Path = PARAMS_FILE) -> Params:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: parameters file not found")
    return parse_params(path.read_text(encoding="utf-8"), str(path))


def as_flat_dict(params: Any, prefix: str = "") -> dict[str, Any]:
    """{'train.max_steps': 100000, ...}: for logging, with each stage's prefix."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if dataclasses.is_dataclass(value):
            out.update(as_flat_dict(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
