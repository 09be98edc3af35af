"""The documentation stays current: the performance page is what the bench results render, the
README stays a guide (not a log), every page it links to exists, and every command of the README and
docs/ parses as its program's parser would take it, naming presets, parameters and files that exist."""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from bench import results
from pipeline import cli, dag, presets, stage

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
    assert re.search(r"commit \w+( and uncommitted changes)?; \d{4}-\d{2}-\d{2}", page)
    assert path.name.startswith("demo--two-rows--")


def test_a_results_further_tables_render_under_their_captions(tmp_path):
    results.record("demo", "tables", "A demo", [{"system": "ours", "tokens/s": 1.0}], "1.00x", results_dir=tmp_path,
                   tables={"Where its time goes": [{"operation": "aten::mm", "share": "80.0%"}]})
    page = results.render(tmp_path)
    assert "**1.00x**\n\nWhere its time goes:\n\n| operation | share |\n|---|---|\n| aten::mm | 80.0% |" in page


def test_a_profiles_matrix_products_are_counted_at_their_own_flops():
    """bench.train's profile table: a step's calls and milliseconds, and the products' share and rate from
    the FLOPs of the shapes profiled (2 n^3 for an n x n product)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.train import where_time_goes

    a = torch.randn(128, 128)
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        for _ in range(3):
            torch.mm(a, a).exp()
    events = list(prof.key_averages())
    mm = next(e for e in events if e.key == "aten::mm")
    assert mm.flops == 3 * 2 * 128**3
    rows, line = where_time_goes(events, steps=3)
    row = next(r for r in rows if r["operation"] == "aten::mm")
    assert row["calls a step"] == 1 and row["GFLOP/s"] == round(mm.flops / mm.self_cpu_time_total / 1e3)
    assert next(r for r in rows if r["operation"] == "aten::exp")["GFLOP/s"] == ""
    share = mm.self_cpu_time_total / sum(e.self_cpu_time_total for e in events)
    assert line.startswith(f"matrix products {share:.0%} of ours' profiled step time, at ")
    graphs = [SimpleNamespace(key=f"## Call CompiledFxGraph {h} ##", count=3, self_cpu_time_total=1e9, flops=0)
              for h in ("f4chm", "facjw")]  # a forward and a backward, by inductor's hashes
    rows, _ = where_time_goes([*events, *graphs], steps=3)
    assert rows[0] == {"operation": "inductor's compiled graphs", "calls a step": 2, "self ms a step": 666666.67,
                       "share": f"{2e9 / (2e9 + sum(e.self_cpu_time_total for e in events)):.1%}", "GFLOP/s": ""}


def test_a_gpu_profile_sorts_its_kernels_into_kinds_by_their_names():
    """bench.gpu's profile: kernels as a GPU profile names them, each counted once in its kind; the memory-
    efficient attention kernels (CUTLASS-named) as attention, not as products."""
    from bench.gpu.profile import OTHER, kernel_kinds

    kernels = [("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", 3000.0),
               ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN", 1500.0),
               ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", 900.0),
               ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>", 600.0),
               ("triton_red_fused_native_layer_norm_native_dropout_0", 1200.0),
               ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", 300.0),
               ("Memcpy HtoD (Pinned -> Device)", 90.0),
               ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", 210.0)]
    rows = kernel_kinds(kernels, steps=3)
    assert [(r["kind"], r["ms a step"]) for r in rows] == [
        ("matrix products", 1.5), ("attention", 0.5), ("inductor's generated kernels", 0.4),
        ("optimizer and clipping", 0.1), (OTHER, 0.07), ("copies and casts", 0.03)]
    assert rows[0]["share"] == f"{4500 / 7800:.1%}"


def test_a_result_names_the_instruction_sets_that_set_a_cpus_training_speed(tmp_path, monkeypatch):
    zen4 = ("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16\n"
            "processor\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16\n")
    found = results.machine(zen4)
    assert found["cpu"] == "AMD EPYC" and found["isa"] == ["AVX2", "AVX-512", "AVX512-BF16"]
    assert results.machine("model name\t: Old\nflags\t\t: fpu sse2\n")["isa"] == []
    monkeypatch.setattr(results, "machine", lambda: {**found, "cores": 2})
    zen4_file = results.record("demo", "isa", "A demo", [{"system": "ours", "tokens/s": 1.0}], "1.00x",
                               results_dir=tmp_path)
    assert "AMD EPYC (AVX2, AVX-512, AVX512-BF16), 2 cores; " in results.render(tmp_path)
    monkeypatch.setattr(results, "machine", lambda: {**found, "cores": 2, "isa": ["AVX2"]})
    zen3_file = results.record("demo", "isa", "A demo", [{"system": "ours", "tokens/s": 2.0}], "1.00x",
                               results_dir=tmp_path)
    assert zen4_file.name == "demo--isa--amd-epyc-avx512-bf16-2-cores.json"
    assert zen3_file.name == "demo--isa--amd-epyc-avx2-2-cores.json" and zen4_file.is_file()  # one file each


def test_a_recorded_command_names_no_folder_of_this_machine():
    assert results.portable(str(ROOT / "bench/results")) == "bench/results"
    assert results.portable(str(ROOT.parent / "shared/data/multi30k")) == "../shared/data/multi30k"
    assert results.portable("/home/someone/runs/tiny/params.yaml") == "<dir>/tiny/params.yaml"
    assert results.shell_word("<dir>/tiny/params.yaml") == "<dir>/tiny/params.yaml"  # the folder to fill in, unquoted
    assert results.shell_word("<dir>/my runs/a*.yaml") == "<dir>/'my runs/a*.yaml'"
    assert results.portable("train.max_steps=8000") == "train.max_steps=8000"


def test_a_recorded_command_reads_back_as_the_arguments_it_ran_with(tmp_path):
    """An override holding a space or a shell's pattern characters (YAML lists) stays one argument in the
    recorded command, as it was given."""
    argv = ["-S", "train.adam_betas=[0.9, 0.999]", "-S", "train.adam_betas=[0.9,0.98]", "--source", "*.en",
            "-S", "train.max_steps=8000"]
    path = results.record("demo", "argv", "A demo", [{"system": "ours", "tokens/s": 1.0}], "1.00x",
                          results_dir=tmp_path, argv=argv)
    command = json.loads(path.read_text(encoding="utf-8"))["command"]
    # bash itself, in a folder with files the patterns would match, failing any pattern that matches none
    for name in ("a.en", "train.adam_betas=0"):
        (tmp_path / name).touch()
    words = subprocess.run(["bash", "-O", "failglob", "-c", f"printf '%s\\n' {command}"], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert words == ["python", "-m", "bench.demo", *argv]


def test_a_try_of_many_overrides_records_in_a_file_of_its_own(tmp_path):
    """A file name past 255 bytes fails at the end of a run; the case, cut, keeps a hash of the whole."""
    overrides = " ".join(f"-S model.setting_{i}=value" for i in range(20))
    paths = [results.record("multi30k", f"en-de {overrides} -S train.max_steps={steps}", "A try",
                            [{"split": "val", "sacreBLEU": 40.0}], "", results_dir=tmp_path)
             for steps in (7000, 8000)]
    assert paths[0] != paths[1] and all(len(path.name) < 255 for path in paths)
    assert [json.loads(path.read_text())["case"][-4:] for path in paths] == ["7000", "8000"]  # held in full


def test_a_result_from_code_no_commit_holds_says_so_but_not_for_results_alone(tmp_path):
    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    for path in ("stages/train.py", "bench/results/a.json", "docs/performance.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("1\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "x")
    head = results._commit(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{10}", head)
    (tmp_path / "bench/results/a.json").write_text("2\n")  # a bench's own output, and the page rendered from it
    (tmp_path / "docs/performance.md").write_text("2\n")
    (tmp_path / "notes.txt").write_text("untracked\n")
    assert results._commit(tmp_path) == head
    (tmp_path / "stages/train.py").write_text("2\n")
    assert results._commit(tmp_path) == f"{head} and uncommitted changes"


def test_a_result_gives_the_cpu_time_the_host_took_and_warns_when_it_passes_two_percent(tmp_path, monkeypatch,
                                                                                          capsys):
    # /proc/stat's first line: user nice system idle iowait irq softirq steal guest guest_nice
    start = results.cpu_ticks("cpu  1000 0 200 5000 100 0 0 50 0 0\ncpu0 500 0 100 2500 50 0 0 25 0 0\n")
    assert start == (50, 1250)  # idle and iowait are not busy; steal is
    assert results.cpu_ticks("cpu  1000 0 200 5000 100 0 0\n") == (0, 1200)  # a kernel without the column
    for bad in ("intr 1 2 3\n", "cpu  1000 0 x 5000 100 0 0 50\n", "cpu  1000 0\n", ""):
        assert results.cpu_ticks(bad) is None, bad  # no figure, never an error that loses the result
    monkeypatch.setattr(results, "START_TICKS", start)
    parse, pages = results.cpu_ticks, {}
    for name, later, warned in (("noisy", "cpu  1700 0 350 9000 100 0 0 200 0 0", True),  # 150 of 1,000 busy
                                ("quiet", "cpu  1800 0 450 9000 100 0 0 50 0 0", False)):
        monkeypatch.setattr(results, "cpu_ticks", lambda stat=None, later=later: parse(later))
        results.record("demo", name, f"A {name} run", [{"system": "ours", "tokens/s": 1.0}], "1.00x",
                       results_dir=tmp_path / name, argv=[])
        assert ("warning: the hypervisor took 15.0% of this run's CPU time" in capsys.readouterr().out) == warned
        pages[name] = results.render(tmp_path / name)
    assert "CPU time taken by the host (steal): 15.0%" in pages["noisy"]
    assert "CPU time taken by the host (steal): 0.0%" in pages["quiet"]


def test_every_bench_imports_record_before_it_measures():
    """A result's steal figure spans from bench.results' import: an import at record time would give 0%."""
    for path in [*sorted((ROOT / "bench").glob("*.py")), ROOT / "bench/gpu/__main__.py"]:
        text = path.read_text(encoding="utf-8")
        if "record(" in text and path.name != "results.py":
            assert re.search(r"^from bench\.results import record\b", text, re.M), path.relative_to(ROOT)


def test_the_readme_is_a_guide_of_at_most_350_lines_whose_links_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 350, "README.md passed 350 lines: move the detail to docs/"
    for target in re.findall(r"\]\(((?!http)[^)#]+)", readme):
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}


def shell_blocks(page: Path) -> list[str]:
    return [body for kind, body in re.findall(r"```(\w*)\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
            if kind in ("", "bash", "sh")]


def commands(block: str) -> list[list[str]]:
    """The block's commands, each as its words: comments dropped, continued lines joined, `&&` and `|`
    split, leading VAR=value assignments dropped."""
    text = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        lexer = shlex.shlex(line.split("  #")[0], posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        words: list[str] = []
        for word in [*lexer, "&&"]:
            if word not in ("&&", "||", "|", ";", "(", ")", "$"):
                words.append(word)
                continue
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words.pop(0)
            if words:
                out.append(words)
            words = []
    return out


class _Parsed(Exception):
    pass


def parse_python_module(module: str, argv: list[str]) -> argparse.Namespace | None:
    """What the module's own parser makes of `argv` (its main stopped right after parsing)."""
    if module in ("pipeline", "pipeline.stage"):
        if argv and argv[0] in dag.stage_descriptions():
            c = stage.contract(argv[0])
            return stage.parser(c, "stage").parse_args(argv[1:])
        return cli.build_parser().parse_args(argv)
    main = importlib.import_module(module if module != "bench.gpu" else "bench.gpu.__main__").main
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    sys_argv = sys.argv
    try:
        sys.argv = [module, *argv]
        argparse.ArgumentParser.parse_args = parse_then_stop
        if "parse_args" not in Path(sys.modules[main.__module__].__file__).read_text(encoding="utf-8"):
            assert not argv, f"python -m {module} takes no arguments"
            return None
        main()
    except _Parsed as parsed:
        return parsed.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = sys_argv
    raise AssertionError(f"python -m {module}: its main returned without parsing arguments")


def check_overrides(named: list[str], overrides: list[str]) -> None:
    """Presets that exist, and overrides whose keys and values params.yaml's loader accepts."""
    presets.layered(presets.collect_overrides(named, overrides))


@functools.cache
def dag_outputs() -> frozenset[str]:
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))
    named = {out if isinstance(out, str) else next(iter(out)) for s in dvc["stages"].values()
             for key in ("outs", "plots", "metrics") for out in s.get(key, [])}
    paths = dag.paths()
    return frozenset(re.sub(r"\$\{paths\.(\w+)\}", lambda m: paths[m[1]], out) for out in named)


def check_paths(words: list[str], written: set[str]) -> None:
    """A path of the repository's folders exists; one under the DAG's outputs is one of them (or under
    one, or written by an earlier command of the block); no absolute path of this machine."""
    outputs = dag_outputs() | written
    checked = TOP | {o.split("/")[0] for o in dag_outputs()}
    for word in words:
        for path in re.findall(r"(?:^|=)([\w.-]+/[\w./<>-]*)", word):
            if "<" in path or "://" in word:
                continue
            if path.split("/")[0] in checked and not any(path == o or path.startswith(o.rstrip("/") + "/")
                                                     for o in outputs):
                assert (ROOT / path).exists(), f"{path} does not exist"
        assert str(ROOT.parent) not in word and str(Path.home()) + "/" not in word, f"an absolute path: {word}"


def check_command(words: list[str], written: set[str]) -> None:
    if words[0] in ("torchrun", "accelerate", "srun") and "-m" in words:
        words = ["python", *words[words.index("-m"):]]
    check_paths(words, written)
    if "..." in words:  # elided on purpose: its paths are checked, not its arguments
        return
    if words[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
        assert all(t in targets for t in words[1:]), f"no make target {words[1:]}"
    elif words[0] == "dvc":
        from dvc.cli import parse_args

        args = parse_args(words[1:])
        if getattr(args, "set_param", None):
            check_overrides([], args.set_param)
    elif words[:2] == ["python", "-m"] and words[2] != "pytest":
        args = parse_python_module(words[2], words[3:])
        if args is not None and hasattr(args, "overrides"):
            if getattr(args, "command", None) == "translate":
                check_overrides([], args.overrides)
            else:
                check_overrides(getattr(args, "preset", None) or getattr(args, "names", None) or [], args.overrides)
        for out in ("out_dir", "out_path", "checkpoint_dir", "plots_dir", "metrics"):
            if args is not None and getattr(args, out, None) is not None:
                written.add(str(getattr(args, out)))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_of_the_docs_parses_as_its_program_takes_it(page):
    blocks = shell_blocks(page)
    for block in blocks:
        written: set[str] = set()
        for words in commands(block):
            try:
                with contextlib.redirect_stderr(io.StringIO()) as err:
                    check_command(words, written)
            except (SystemExit, Exception) as e:  # noqa: BLE001 - argparse exits; dvc's parser raises
                pytest.fail(f"{page.name}: {shlex.join(words)}: {e} {err.getvalue()[-300:]}")


def test_a_wrong_command_in_the_docs_is_caught():
    """The check above fails for a misspelled flag, an unknown preset or key, a missing file."""
    for wrong in ("python -m pipeline run --presets multi30k", "python -m pipeline run --preset multi31k",
                  "python -m pipeline run -S train.max_stepz=3", "dvc exp run --bogus",
                  "python -m bench.collate --bogus 3", "make tests", "bash bench/gpu/check.py speed",
                  "python -m pipeline vocab --clean-dir data/cleaned --out-dir my/vocab"):
        with pytest.raises((SystemExit, Exception)), contextlib.redirect_stderr(io.StringIO()):
            check_command(shlex.split(wrong), set())
            print(f"not caught: {wrong}")


def test_every_shell_block_of_the_readme_says_what_runs_it():
    """A block runs in the file it names, which holds each of its commands (a shell script line for
    line; a test as the words it passes, or by reading the block itself), or says it needs a GPU or a
    server, or that it is long; text blocks are output, not commands."""
    shell = shell_blocks(ROOT / "README.md")
    assert len(shell) >= 8
    for body in shell:
        first = body.splitlines()[0]
        if first.startswith(("# needs a GPU", "# needs a server", "# long:")):
            continue
        assert first.startswith("# run by "), f"a README block without a marker:\n{body}"
        name = first.removeprefix("# run by ")
        runner = (ROOT / name).read_text(encoding="utf-8")
        if first in runner:  # the runner reads this block out of the README and runs it
            continue
        for words in commands(body):
            if words[0] not in ("python", "dvc", "make"):
                continue
            if name.endswith(".py"):
                words = [w for w in words[3 if words[:2] == ["python", "-m"] else 0:] if "<" not in w]
                missing = [w for w in words if f'"{w}"' not in runner and f"'{w}'" not in runner]
            else:
                missing = [] if re.search(rf"^{re.escape(shlex.join(words))}\b", runner, re.M) else words
            assert not missing, f"{name} does not run `{shlex.join(words)}`: {missing} not in it"


def _options_without_help(parser: argparse.ArgumentParser, name: str) -> list[str]:
    """`name`'s options and positional arguments, and its subcommands', that --help shows without a word."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                missing += _options_without_help(subparser, f"{name} {sub}")
        elif not action.help and not isinstance(action, argparse._HelpAction):
            missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_option_of_the_command_line_says_what_it_is():
    """`python -m pipeline <command> --help` and each stage's own parser describe every argument."""
    missing = _options_without_help(cli.build_parser(), "pipeline")
    for name in dag.stage_descriptions():
        missing += _options_without_help(stage.parser(stage.contract(name), "stage"), f"pipeline {name}")
    assert not missing, f"arguments --help shows without a description: {missing}"
