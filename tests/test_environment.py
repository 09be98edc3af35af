"""The pinned environment: requirements.lock agrees with pyproject.toml, and a run names what it ran in."""
from __future__ import annotations

import importlib.util
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pipeline import tracking

ROOT = Path(__file__).resolve().parents[1]


def _pins(text: str) -> dict[str, str]:
    return {canonicalize_name(name): version for name, sep, version in
            (line.partition("==") for line in text.splitlines() if not line.startswith("#")) if sep}


def test_the_lock_pins_every_dependency_within_pyprojects_ranges():
    """A range moved in pyproject.toml without `make lock` fails here, not on a newcomer's machine."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins((ROOT / "requirements.lock").read_text())
    wanted = [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["dev"]]]
    for requirement in wanted:
        if requirement.name == "torch":  # installed first, by its own pin (CPU or CUDA build)
            assert "torch" not in pins
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not in requirements.lock"
        assert requirement.specifier.contains(pins[name]), f"lock has {name} {pins[name]}, outside {requirement}"


def test_a_runs_environment_tags_name_the_lock_and_every_package_that_differs(tmp_path, monkeypatch):
    lock = tmp_path / "requirements.lock"
    lock.write_text(f"# comment==1\npytest=={metadata.version('pytest')}\nPyYAML=={metadata.version('pyyaml')}\n")
    monkeypatch.setattr(tracking, "LOCK", lock)
    tracking.environment_tags.cache_clear()
    tags = tracking.environment_tags()
    assert tags["env.matches_lock"] == "yes" and len(tags["env.lock"]) == 16
    assert tags["env.torch"] == metadata.version("torch")
    lock.write_text("pytest==0.0.1\nno-such-package==1.0\n")
    tracking.environment_tags.cache_clear()
    differ = tracking.environment_tags()
    assert differ["env.matches_lock"] == (f"no: 2 differ, e.g. pytest {metadata.version('pytest')} (lock 0.0.1), "
                                          "no-such-package missing (lock 1.0)")
    assert differ["env.lock"] != tags["env.lock"]
    tracking.environment_tags.cache_clear()


def test_the_heavy_packages_are_byte_compiled():
    """Where processes may not write .pyc files (PYTHONDONTWRITEBYTECODE), an uncompiled torch, prefect or mlflow
    is compiled anew by each of the suite's hundreds of processes (10 s each): `make setup` compiles at install."""
    for name in ("torch", "prefect", "mlflow", "sacrebleu"):
        source = importlib.util.find_spec(name).origin
        cached = importlib.util.cache_from_source(source)
        assert Path(cached).is_file(), f"{name} is not byte-compiled ({cached} missing): install without --no-compile"
