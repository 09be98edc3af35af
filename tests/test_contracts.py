"""Each stage's contract has one owner, its `run` signature, and dvc.yaml must say the same: its
params sections, its path flags, which paths it reads and writes, and the code it runs. A stage whose
code or params changed can then never be skipped by DVC."""
import ast
import re
from pathlib import Path

import pytest
import yaml
from dvc.dependency.param import ParamsDependency
from dvc.repo import Repo

from pipeline import dag, stage
from stages import train_metrics

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "stages", "translate", "transformer", "bench")
FILES_IN = {("train", "plots_dir"): train_metrics.CURVE_FILES}  # an output folder whose files dvc.yaml names
RUNNER = ROOT / "pipeline/stage.py"  # what `python -m pipeline.stage <name>` runs besides the stage
# The params loader and classes, and what of their imports is followed: the rest they import (every
# stage's params, the download stage's tables of corpora) is for the checks of params.yaml at load,
# which cannot change a stage's outputs.
PARAMS = {ROOT / "pipeline/config.py": {ROOT / "stages/params.py", ROOT / "transformer/config.py"},
          ROOT / "stages/params.py": {ROOT / "stages/io.py"}}


def _module_file(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return path / "__init__.py" if (path / "__init__.py").is_file() else None


def _has_code(path: Path) -> bool:
    """A package __init__ with nothing but its docstring runs no code."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body)


def _imports(path: Path) -> set[Path]:
    """Project files a module imports, anywhere in it (lazy imports too), with the packages they run."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from stages import vocab` imports a module; `from stages.io import atomic_write` a name
            names = [f"{node.module}.{a.name}" if _module_file(f"{node.module}.{a.name}") else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] not in PACKAGES:
                continue
            for i in range(1, len(parts) + 1):  # each package on the way runs its __init__
                if (f := _module_file(".".join(parts[:i]))) is not None and _has_code(f):
                    found.add(f)
    return found


def code_closure(name: str) -> set[Path]:
    """The files the stage runs: its module and the runner, and what they import, transitively, but
    from the params loader and classes only what PARAMS says."""
    seen: set[Path] = set()
    todo = [ROOT / f"stages/{name}.py", RUNNER]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        imports = _imports(path)
        if path in PARAMS:
            imports = {f for f in imports if f.parent.name == "pipeline" or f in PARAMS[path]}
        todo += imports
    return seen


def _expand(dep: str) -> set[Path]:
    path = ROOT / dep
    return set(path.rglob("*.py")) if path.is_dir() else {path}


@pytest.fixture(scope="module")
def dvc_stages():
    with Repo(str(ROOT)) as repo:
        return {s.name: s for s in repo.index.stages}


def test_every_stage_of_dvc_yaml_is_a_stage_module_with_a_contract(dvc_stages):
    assert list(dag.stage_descriptions()) == list(dvc_stages)
    for name, desc in dag.stage_descriptions().items():
        assert stage.contract(name).name == name and desc, name


@pytest.mark.parametrize("name", list(dag.stage_descriptions()))
def test_dvc_yaml_declares_what_the_stage_function_reads_and_writes(name, dvc_stages):
    s, c = dvc_stages[name], stage.contract(name)
    assert s.cmd.startswith(f"python -m pipeline.stage {name} ")
    flags = {flag: value for flag, value in re.findall(r"--([\w-]+) (\S+)", s.cmd)}
    assert set(flags) == {stage.option(p)[2:] for p in c.paths} | {"metrics"}
    value = {p: flags[stage.option(p)[2:]] for p in c.paths}
    params = [d for d in s.deps if isinstance(d, ParamsDependency)]
    assert sorted(p for d in params for p in d.params) == sorted(c.sections)

    deps = {d.def_path for d in s.deps if not isinstance(d, ParamsDependency)}
    outs = {o.def_path for o in s.outs}
    assert {value[p] for p in c.inputs} <= deps
    for p in c.outputs:  # an output itself, or the folder of exactly the files dvc.yaml names in it
        inside = {o for o in outs if o.startswith(value[p] + "/")}
        assert value[p] in outs or inside == {f"{value[p]}/{f}" for f in FILES_IN.get((name, p), ())}, p
    assert flags["metrics"] in outs

    code = {d for d in deps if d.split("/")[0] in PACKAGES}
    closure = code_closure(name)
    assert set().union(*map(_expand, code)) == closure, (
        f"dvc.yaml's code deps of {name} should be {sorted(str(p.relative_to(ROOT)) for p in closure)}")
    # any other dep is named by a parameter (download.local.dir), not by a path of the stage's own
    raw = yaml.safe_load(dag.DVC_FILE.read_text(encoding="utf-8"))["stages"][name]["deps"]
    named_by_params = [d for d in raw if d.startswith("${") and not d.startswith("${paths.")]
    assert len(deps - code - {value[p] for p in c.inputs}) == len(named_by_params)


def test_the_closure_sees_what_a_module_imports(tmp_path):
    closure = code_closure("decode")
    assert ROOT / "translate/beam_search.py" in closure and ROOT / "translate/cpu.py" in closure
    assert ROOT / "pipeline/tracking.py" in closure and ROOT / "stages/train.py" not in closure
    assert ROOT / "stages/clean.py" not in code_closure("vocab")


def test_tracked_artifacts_are_outputs_of_their_stage():
    for name, artifacts in stage.ARTIFACTS.items():
        assert set(artifacts) <= set(stage.contract(name).outputs), name
    assert stage.SYSTEM_METRICS <= set(dag.stage_descriptions())


def test_a_path_parameter_without_an_annotation_is_refused(monkeypatch):
    from stages import score

    def run(params: score.ScoreParams, *, hyp_dir, ref_dir) -> dict:
        return {}

    monkeypatch.setattr(score, "run", run)
    with pytest.raises(TypeError, match="hyp_dir is neither a params section nor a path"):
        stage.contract("score")


def test_imports_point_one_way_and_close_no_circle():
    """transformer <- translate <- stages <- pipeline <- bench: no package imports one above it, and no
    module imports one that, through others, imports it back (lazy imports and package __init__s count)."""
    import networkx as nx

    layer = {"transformer": 0, "translate": 1, "stages": 2, "pipeline": 3, "bench": 4}
    graph = nx.DiGraph()
    for package in layer:
        for path in (ROOT / package).rglob("*.py"):
            graph.add_node(path)
            graph.add_edges_from((path, imported) for imported in _imports(path) if imported != path)
    name = lambda path: str(path.relative_to(ROOT))  # noqa: E731
    upward = [(name(a), name(b)) for a, b in graph.edges
              if layer[b.relative_to(ROOT).parts[0]] > layer[a.relative_to(ROOT).parts[0]]]
    assert not upward
    assert not [[name(p) for p in cycle] for cycle in nx.simple_cycles(graph)]

