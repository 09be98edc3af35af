import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("SHARED_DATA", ROOT.parent / "shared" / "data"))

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def shared() -> Path:
    """The real WMT14 sample data beside the checkout (../shared/data); tests need it, never skip it."""
    assert (SHARED / "wmt14").is_dir(), f"the shared WMT14 data is missing: expected it at {SHARED}"
    return SHARED


@pytest.fixture(autouse=True)
def _no_tracking_in_the_working_tree(tmp_path, monkeypatch):
    """Stages called through the command line track into a store of the test's own."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
