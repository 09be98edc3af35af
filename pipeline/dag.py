"""dvc.yaml, the pipeline's one DAG, as the orchestration reads it: the paths it names once (its
`vars`), its stages with their descriptions, and their dependency order (DVC's own graph)."""
from __future__ import annotations

from pathlib import Path

import yaml

from pipeline.config import ROOT
from stages.io import PipelineError

DVC_FILE = ROOT / "dvc.yaml"


def _read() -> dict:
    return yaml.safe_load(DVC_FILE.read_text(encoding="utf-8"))


def paths() -> dict[str, str]:
    """The paths dvc.yaml names once in its vars, for commands that default to the pipeline's outputs."""
    return next(v["paths"] for v in _read()["vars"] if isinstance(v, dict) and "paths" in v)


def stage_descriptions() -> dict[str, str]:
    """Stage name -> its `desc`, in the order dvc.yaml lists them."""
    return {name: stage.get("desc", "") for name, stage in _read()["stages"].items()}


def stage_order(root: Path = ROOT) -> list[str]:
    """dvc.yaml's stage names, each after every stage it depends on. Names, not DVC's addresses, which
    are relative to the working folder ('../dvc.yaml:train' from docs/) while the stages run at the root."""
    import networkx as nx
    from dvc.repo import Repo
    from dvc.stage import PipelineStage

    with Repo(str(root)) as repo:
        graph = repo.index.graph  # edges point from a stage to the stages it depends on
        return [stage.name for stage in reversed(list(nx.topological_sort(graph))) if isinstance(stage, PipelineStage)]


def require_git(root: Path = ROOT) -> None:
    """Stop, in a line, where `root` is not in a git repository (a source archive unpacked, say): DVC keeps
    the record of every run in git (dvc.lock, experiments), and fails there with a traceback."""
    from dvc.scm import SCM, SCMError

    try:
        SCM(str(root))
    except SCMError:
        raise PipelineError(f"{root} is not a git repository, and DVC records the pipeline's runs in git: clone the "
                            "project with git, or make this folder a repository first (git init && git add -A && "
                            "git commit -m 'the pipeline')") from None
