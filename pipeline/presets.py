"""Changing params.yaml: presets (presets/<name>.yaml, sets of dotted-key overrides), `-S key=value`
overrides and the paper's Table 3 rows, layered onto params.yaml as `dvc exp run -S` does, its
comments kept. The result is checked as params.yaml itself is before anything is written.

Presets start over: a change that names presets is layered onto params.yaml as it was before the last
presets the pipeline layered, so that `--preset multi30k` after the quickstart is the Multi30k preset,
not it on the quickstart's settings, and a run's name (its presets and values) is its whole change. A
change of `-S` values only is layered onto the file as it is (`-S train.max_steps=...` extends the last
run). Beside params.yaml the pipeline keeps the file it layered presets onto and the digest of what it
wrote; once the file is edited by anyone else, that edited file is the one presets go onto."""
from __future__ import annotations

import hashlib
import io
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.config import PARAMS_FILE, ROOT, ConfigError, Params, build_params, load_yaml, parse_params, read_yaml
from stages.io import atomic_write

PRESETS_DIR = ROOT / "presets"
TABLE3_FILE = ROOT / "experiments/table3.yaml"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_preset(name: str) -> dict[str, Any]:
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"no preset '{name}' (known: {', '.join(preset_names())})")
    data = load_yaml(path.read_text(encoding="utf-8"), str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of dotted keys to values")
    return data


def table3_rows() -> dict[str, dict[str, Any]]:
    """Row name -> overrides (the common ones included) of the paper's Table 3 experiments."""
    data = load_yaml(TABLE3_FILE.read_text(encoding="utf-8"), str(TABLE3_FILE))
    return {name: {**data["common"], **row} for name, row in data["rows"].items()}


def parse_override(text: str) -> tuple[str, Any]:
    """'train.max_steps=300000' -> ('train.max_steps', 300000), values read as YAML, as DVC's -S."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r}: expected key=value")
    return key.strip(), load_yaml(value, f"override {text!r}")


def collect_overrides(presets: list[str], overrides: list[str]) -> dict[str, Any]:
    """Presets in order, then `key=value` overrides: one mapping of dotted keys to values."""
    merged: dict[str, Any] = {}
    for name in presets:
        merged.update(load_preset(name))
    merged.update(dict(parse_override(o) for o in overrides))
    return merged


def dvc_set_args(overrides: dict[str, Any]) -> list[str]:
    """['-S', 'key=value', ...] as `dvc exp run` takes them (values written as YAML/JSON)."""
    out = []
    for k, v in overrides.items():
        out += ["-S", f"{k}={v if isinstance(v, str) else json.dumps(v)}"]
    return out


def _flow_style(value: Any) -> Any:
    """Mappings and lists written inline ({src: a, tgt: b}), as params.yaml writes them."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    if isinstance(value, dict):
        node = CommentedMap((k, _flow_style(v)) for k, v in value.items())
    elif isinstance(value, list):
        node = CommentedSeq(_flow_style(v) for v in value)
    else:
        return value
    node.fa.set_flow_style()
    return node


def _set(data: dict[str, Any], key: str, value: Any, path: Path) -> None:
    """data[a][b] = value for the dotted key 'a.b', which must already be there."""
    parent, node = None, data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            known = f" (known here: {', '.join(map(str, node))})" if isinstance(node, dict) else ""
            raise ConfigError(f"{path}: override {key}: unknown key{known}")
        parent, node = node, node[part]
    parent[part] = value


def _layers_file(path: Path) -> Path:
    return path.with_name(f".{path.stem}-layers.json")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _base(path: Path, text: str) -> str:
    """The file the pipeline last layered presets onto, where `text` (the file now) is what it wrote
    since; else `text` itself: an edit by anyone else makes the edited file the base."""
    try:
        state = json.loads(_layers_file(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return text
    if isinstance(state, dict) and isinstance(state.get("base"), str) and state.get("written") == _digest(text):
        return state["base"]
    return text


def _read(path: Path) -> str:
    if not path.is_file():
        raise ConfigError(f"{path}: parameters file not found")
    return path.read_text(encoding="utf-8")


def _start(path: Path, start_over: bool) -> tuple[str, str]:
    """(the text a change is layered onto, the base to remember after it)."""
    text = _read(path)
    base = _base(path, text)
    return (base if start_over else text), base


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    return {k: v for key, value in data.items() for k, v in _flat(value, f"{prefix}.{key}" if prefix else key).items()}


def _set_back(overrides: dict[str, Any], path: Path) -> list[str]:
    """The dotted keys a change naming presets sets back: where params.yaml differs from the file the
    pipeline last layered presets onto, and `overrides` do not set them again."""
    text = _read(path)
    base, now = (_flat(read_yaml(t, str(path))) for t in (_base(path, text), text))
    return [key for key in now if now[key] != base.get(key) and key not in overrides]


def apply(names: list[str], overrides: dict[str, Any], path: str | Path = PARAMS_FILE,
          say: Callable[[str], Any] = print) -> Params:
    """Presets `names`, then `overrides`, written into params.yaml as the module's docstring says: from
    before the last presets where `names` are given, saying which keys that sets back."""
    path = Path(path)
    merged = {**collect_overrides(names, []), **overrides}
    if names and (back := _set_back(merged, path)):
        say(f"params.yaml: {', '.join(back)} as before the last presets (presets start over)")
    return apply_overrides(merged, path, start_over=bool(names))


def committed_params() -> tuple[str, str]:
    """(name, text) of params.yaml as committed, the paper's recipe, whatever runs wrote into the file since
    (`pipeline run --preset`, `make quickstart`, `dvc exp run -S`): what a bench starts from, so that its base
    is not the last run's model, and what the tests read. Git's copy at HEAD in a clone (the path relative
    to the checkout, which may sit inside another repository); the file itself where there is no git or no
    commit."""
    try:
        shown = subprocess.run(["git", "show", "HEAD:./params.yaml"], cwd=PARAMS_FILE.parent, capture_output=True,
                               text=True)
    except FileNotFoundError:  # no git installed
        shown = None
    if shown is not None and shown.returncode == 0:
        return "params.yaml at git HEAD", shown.stdout
    return str(PARAMS_FILE), PARAMS_FILE.read_text(encoding="utf-8")


def layered(overrides: dict[str, Any], path: str | Path = PARAMS_FILE, text: str | None = None,
            start_over: bool = False) -> Params:
    """params.yaml (or `text`, a version of it named by `path`) with `overrides` layered on, in memory and
    nothing written, from where `apply_overrides` would start: for checking a change before the flow
    starts, and for the stages run outside the pipeline (bench.gpu), where DVC's YAML library may not be
    installed."""
    path = Path(path)
    text = _start(path, start_over)[0] if text is None else text
    data = read_yaml(text, str(path))
    for key, value in overrides.items():
        _set(data, key, value, path)
    return build_params(data, str(path), text, overrides)  # the file's lines


def apply_overrides(overrides: dict[str, Any], path: str | Path = PARAMS_FILE, start_over: bool = False) -> Params:
    """Set dotted keys in params.yaml, keeping its comments, after checking the result is valid; with
    `start_over` (a change that names presets), in the file as it was before the last presets."""
    from ruamel.yaml import YAML  # DVC's own YAML library, which keeps comments

    path = Path(path)
    start, base = _start(path, start_over)
    read_yaml(start, str(path))  # a syntax error or a key given twice named with its line, not as a traceback
    rt = YAML()
    rt.preserve_quotes = True
    data = rt.load(start)
    for key, value in overrides.items():
        _set(data, key, _flow_style(value), path)
    buffer = io.StringIO()
    rt.dump(data, buffer)
    params = parse_params(buffer.getvalue(), str(path), overrides)
    with atomic_write(path) as f:
        f.write(buffer.getvalue())
    with atomic_write(_layers_file(path)) as f:
        json.dump({"base": base, "written": _digest(buffer.getvalue())}, f)
    return params
