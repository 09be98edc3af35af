"""`dvc plots show` without a network. DVC's page loads vega, vega-lite and vega-embed from a CDN, so
offline it is blank; `python -m pipeline offline-plots` (which `make setup` runs) fetches those three
from the npm registry, as set-up fetches every other package, and writes a page template with them
inlined, `.dvc/offline-plots.html`, which .dvc/config names as DVC's `plots.html_template`."""
from __future__ import annotations

import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from pipeline.config import ROOT
from stages.io import PipelineError, atomic_write

# The majors DVC's vega-lite specifications are written for.
VERSIONS = {"vega": "5.33.1", "vega-lite": "5.23.0", "vega-embed": "6.29.0"}
TEMPLATE = ROOT / ".dvc" / "offline-plots.html"

# DVC's own page (dvc_render.html.PAGE_HTML) with the scripts inlined where its `{scripts}` was.
PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <title>DVC Plot</title>
    <!-- vega, vega-lite and vega-embed, inlined: the page needs no network -->
    %s
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>"""


def install(target: Path = TEMPLATE) -> Path:
    npm = shutil.which("npm")
    if npm is None:
        raise PipelineError("npm is needed to fetch vega for offline plots (Node.js's package manager)")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([npm, "pack", "--silent", *(f"{n}@{v}" for n, v in VERSIONS.items())], cwd=tmp,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise PipelineError(f"npm pack {' '.join(VERSIONS)} failed: {proc.stderr.strip()[-500:]}")
        scripts = []
        for name, version in VERSIONS.items():
            with tarfile.open(Path(tmp) / f"{name}-{version}.tgz") as archive:  # one member read, nothing extracted
                member = archive.extractfile(f"package/build/{name}.min.js")
                assert member is not None
                code = member.read().decode("utf-8").replace("</script", "<\\/script")
            scripts.append(f"<script>/* {name} {version} */\n{code}\n</script>")
    with atomic_write(target) as f:
        f.write(PAGE % "\n".join(scripts))
    return target
