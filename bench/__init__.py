"""Speed measured against peers: each script runs ours and a peer on the same work in one run and
prints both and the ratio (`python -m bench.<name>`)."""
import os
from pathlib import Path

# The real WMT14 text beside the checkout (../shared/data), or where SHARED_DATA says; the tests read it too.
SHARED = Path(os.environ.get("SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
