"""The documentation stays current: the performance page is what the bench results render, the
README stays a guide (not a log), and every page it links to exists."""
from __future__ import annotations

import re
from pathlib import Path

from bench import results

ROOT = Path(__file__).resolve().parents[1]


def test_the_performance_page_is_what_the_bench_results_render():
    assert results.PAGE.read_text(encoding="utf-8") == results.render(), \
        "docs/performance.md is stale: run `python -m bench.results` and commit it"


def test_a_recorded_result_names_its_command_machine_commit_and_date_and_renders(tmp_path):
    path = results.record("demo", "two rows", "A demo", [{"system": "ours", "tokens/s": 1234.4},
                                                         {"system": "peer", "tokens/s": 61.25}],
                          "ours / peer: 2.00x", results_dir=tmp_path, argv=["--limit", "3"])
    page = results.render(tmp_path)
    assert "python -m bench.demo --limit 3" in page and "ours / peer: 2.00x" in page
    assert "| ours | 1,234 |" in page and "| peer | 61.25 |" in page
    assert re.search(r"commit \w+; \d{4}-\d{2}-\d{2}", page) and path.name.startswith("demo--two-rows--")


def test_the_readme_is_a_guide_of_at_most_350_lines_whose_links_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 350, "README.md passed 350 lines: move the detail to docs/"
    for target in re.findall(r"\]\(((?!http)[^)#]+)", readme):
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_every_shell_block_of_the_readme_says_what_runs_it():
    """A block runs in the test it names (which must exist and hold its commands), or says it needs a
    GPU or a server, or that it is long; text blocks are output, not commands."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```(\w*)\n(.*?)```", readme, re.S)
    shell = [body for kind, body in blocks if kind == ""]
    assert len(shell) >= 8
    for body in shell:
        first, *lines = body.splitlines()
        if first.startswith(("# needs a GPU", "# needs a server", "# long:")):
            continue
        assert first.startswith("# run by "), f"a README block without a marker:\n{body}"
        runner = (ROOT / first.removeprefix("# run by ")).read_text(encoding="utf-8")
        for line in lines:
            for tool, sub in re.findall(r"\b(make|pipeline|dvc) (\w+)", line.split("  #")[0]):
                assert f"{tool} {sub}" in runner or f'"{sub}"' in runner, f"{first}: does not run {tool} {sub}"
