"""Faults and bad input as an operator meets them, each through the real command line or stage
function: a stop signal to a training run (one process and two) and to a run of experiments, a failed
experiment among others, lines too long to learn from,
the padding token, a bad split found late, untranslated copies, eight stages starting at once
against a new tracking store, a damaged checkpoint, a save cut short, and averaging copies."""
import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import CLEAN, TINY, train_command, train_params, train_params_file, wait_for
from stages import average, clean, decode, train, vocab
from stages.io import EXIT_STOPPED, PipelineError, Stopped, read_lines, write_manifest
from stages.model_files import current_dir, list_checkpoints, read_checkpoint, write_checkpoint
from stages.train_state import StopRequest

ROOT = Path(__file__).resolve().parents[1]


def _saved(ckpt: Path) -> Path:
    """The newest file of the run's setup folder under `ckpt`."""
    return list_checkpoints(current_dir(ckpt), snapshots=True)[-1][1]


def _first_checkpoint(ckpt: Path) -> bool:
    return (ckpt / "current.json").exists() and (current_dir(ckpt) / "checkpoint-00000005.pt").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_each_stop_signal_asks_for_a_stop_and_a_second_ctrl_c_stops_at_once(signum):
    """The three signals a scheduler or a terminal sends: the first asks (the step in progress goes
    on), a second Ctrl-C raises at once, and the handlers before are back afterwards."""
    before = signal.getsignal(signum)
    with StopRequest() as stop:
        os.kill(os.getpid(), signum)
        assert stop.signum == signum
        if signum == signal.SIGINT:
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signum) == before



def test_a_run_that_stopped_and_saved_ignores_further_stop_signals_but_not_ctrl_c():
    """The launcher's closing SIGTERM to the other workers, once one has exited 75, must let them end
    as stopped; a Ctrl-C still interrupts a process that is slow to end."""
    before = {signum: signal.getsignal(signum) for signum in StopRequest.SIGNALS}
    try:
        with pytest.raises(Stopped), StopRequest():
            raise Stopped("stopped by SIGTERM after step 3")
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            assert signal.getsignal(signum) == signal.SIG_IGN
            os.kill(os.getpid(), signum)  # nothing happens
        assert signal.getsignal(signal.SIGINT) == before[signal.SIGINT]
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


EXPERIMENT = """import os, signal, sys, time
from pathlib import Path
out, name, code = Path(os.environ["EXPERIMENTS_OUT"]), sys.argv[1], int(sys.argv[2])
def stop(signum, frame):
    (out / f"{name}.stopped").write_text("")
    sys.exit(75)
signal.signal(signal.SIGINT, stop)
(out / f"{name}.started").write_text("")
while code == 75:  # as the train stage: works until asked to stop
    time.sleep(0.05)
sys.exit(code)
"""


def _experiments(tmp_path: Path, monkeypatch, codes: dict[str, int]) -> dict[str, list[str]]:
    """Stand-ins for `dvc exp run --temp` commands (module arguments): each notes its start and exits
    with its code; 75 works until Ctrl-C, which it notes."""
    (tmp_path / "experiment.py").write_text(EXPERIMENT)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("EXPERIMENTS_OUT", str(tmp_path))
    return {name: ["experiment", name, str(code)] for name, code in codes.items()}


def test_table3_run_goes_on_past_a_failed_experiment_and_names_it(tmp_path, monkeypatch, capfd):
    from pipeline.cli import run_experiments

    assert run_experiments(_experiments(tmp_path, monkeypatch, {"a": 0, "b": 3, "c": 0})) == 1
    assert all((tmp_path / f"{name}.started").exists() for name in "abc")
    assert "error: 1 of 3 experiments failed: b (" in capfd.readouterr().err


def test_table3_run_passes_a_stop_signal_on_once_and_starts_no_more(tmp_path, monkeypatch, capfd):
    """SIGTERM to the command (a scheduler's) reaches the experiment running as one Ctrl-C, as a
    terminal's would; the next is not started and the command's handlers are put back."""
    import threading

    from pipeline.cli import run_experiments

    before = signal.getsignal(signal.SIGTERM)
    commands = _experiments(tmp_path, monkeypatch, {"a": 75, "b": 0})
    stopper = threading.Thread(target=lambda: (wait_for(lambda: (tmp_path / "a.started").exists(), 30, "a to start"),
                                               os.kill(os.getpid(), signal.SIGTERM)))
    stopper.start()
    code = run_experiments(commands)
    stopper.join()
    assert code == 128 + signal.SIGTERM
    assert (tmp_path / "a.stopped").exists() and not (tmp_path / "b.started").exists()
    assert "stopped: a was stopped (SIGTERM); not run: b" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.slow
def test_a_stop_signal_finishes_the_step_saves_it_and_exits_75(encoded, vocab_dir, tmp_path):
    """SIGTERM through the command line: the others share its handler (the test above)."""
    signum = signal.SIGTERM
    params = train_params_file(tmp_path, **{"train.max_steps": 100000})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, *train_command(params, encoded[0], vocab_dir, tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: _first_checkpoint(tmp_path / "ckpt"), 180, "the first checkpoint")
    proc.send_signal(signum)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, err[-2000:]
    assert time.monotonic() - sent < 30
    step = read_checkpoint(_saved(tmp_path / "ckpt")).parts["progress"]["step"]
    assert step >= 5 and err.strip().splitlines()[-1].startswith(
        f"stopped: stopped by {signal.Signals(signum).name} after step {step}, saved in {_saved(tmp_path / 'ckpt')}")

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("transformer-en-de").experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]

    # run again: it goes on from the saved step
    again = train_params_file(tmp_path, **{"train.max_steps": step + 2})
    resumed = subprocess.run([sys.executable, *train_command(again, encoded[0], vocab_dir, tmp_path)], env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and f"at step {step}" in resumed.stdout + resumed.stderr
    assert json.loads((tmp_path / "train.json").read_text())["steps"] == step + 2


@pytest.mark.slow
def test_processes_agree_on_the_step_at_which_they_stop(encoded, vocab_dir, tmp_path):
    """torchrun, two CPU processes; the signal reaches one of them only."""
    params = train_params_file(tmp_path, **{"train.max_steps": 100000})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             *train_command(params, encoded[0], vocab_dir, tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: _first_checkpoint(tmp_path / "ckpt"), 240, "the first checkpoint")
    import psutil

    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if "pipeline.stage" in " ".join(p.cmdline())]
    assert len(workers) == 2
    os.kill(max(w.pid for w in workers), signal.SIGTERM)  # the second worker only
    _, err = proc.communicate(timeout=180)
    saved = read_checkpoint(_saved(tmp_path / "ckpt"))
    step = saved.parts["progress"]["step"]
    stops = [line for line in err.splitlines() if "stopped by SIGTERM after step" in line]
    assert len(stops) == 2 and all(f"after step {step}," in line for line in stops)  # both, at the saved step
    assert saved.parts["topology"] == {"processes": 2, "grad_accum": 1}


def test_pairs_longer_than_the_models_positions_are_dropped_and_counted(encoded, vocab_dir, tmp_path):
    from stages.encode import ParallelIds

    short = dataclasses.replace(TINY, max_positions=24)
    corpus, dev = ParallelIds(encoded[0], "train"), ParallelIds(encoded[0], "dev")
    over = int(((corpus.src_lengths >= 24) | (corpus.tgt_lengths >= 24)).sum())
    assert over > 100 and ((dev.src_lengths >= 24) | (dev.tgt_lengths >= 24)).any()
    out = train.run(short, train_params(max_steps=4, validate_every=2), encoded_dir=encoded[0], vocab_dir=vocab_dir,
                    checkpoint_dir=tmp_path / "c", plots_dir=tmp_path / "p")
    assert out["steps"] == 4 and out["dropped_over_positions"] == over and np.isfinite(out["valid_loss"])


def _raw(tmp_path: Path, train: tuple[list[str], list[str]], test_de_extra: str = "") -> Path:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "train.en").write_text("".join(line + "\n" for line in train[0]), encoding="utf-8")
    (raw / "train.de").write_text("".join(line + "\n" for line in train[1]), encoding="utf-8")
    for split in ("dev", "test"):
        (raw / f"{split}.en").write_text("a\n", encoding="utf-8")
        (raw / f"{split}.de").write_text("a\n" + (test_de_extra if split == "test" else ""), encoding="utf-8")
    write_manifest(raw, "en", "de", {"train": len(train[0]), "dev": 1, "test": 1})
    return raw


def test_clean_drops_a_line_of_too_many_characters_and_copies_of_the_source(tmp_path):
    no_spaces = "x" * 1_000_000  # one "word" of a megabyte
    src = ["A real sentence.", no_spaces, "Untranslated text", "Hello there."]
    tgt = ["Ein echter Satz.", "kurz", "Untranslated text", "Hallo zusammen."]
    m = clean.run(CLEAN, raw_dir=_raw(tmp_path, (src, tgt)), out_dir=tmp_path / "out")
    assert (m["dropped_too_many_characters"], m["dropped_source_equals_target"], m["train_pairs"]) == (1, 1, 2)
    assert list(read_lines(tmp_path / "out/train.en")) == ["A real sentence.", "Hello there."]
    kept = clean.run(dataclasses.replace(CLEAN, keep_copies=True), raw_dir=tmp_path / "raw", out_dir=tmp_path / "o2")
    assert kept["dropped_source_equals_target"] == 0 and kept["train_pairs"] == 3


def test_clean_checks_every_split_before_writing_anything(tmp_path):
    raw = _raw(tmp_path, (["Hello."], ["Hallo."]), test_de_extra="one line too many\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.en").write_text("the previous run's\n")
    with pytest.raises(PipelineError, match=r"test.en has 1 lines, .*test.de has 2"):
        clean.run(CLEAN, raw_dir=raw, out_dir=out)
    assert sorted(p.name for p in out.iterdir()) == ["train.en"]
    assert (out / "train.en").read_text() == "the previous run's\n"
    assert not list(tmp_path.glob(".out-*"))  # no staging left behind


def test_translations_never_contain_padding_or_bos_and_ignore_the_padding_row(averaged, vocab_dir, cleaned):
    lines = list(read_lines(cleaned[0] / "dev.en"))[:60]
    params = decode.DecodeParams(beam_size=3, length_penalty=0.6, length_penalty_formula="gnmt", stop="finished",
                                 max_length_extra=5, batch_tokens=2000)
    translator = decode.load_translator(averaged[0], torch.device("cpu"))
    model, sp = translator.model, vocab.load(vocab_dir)
    before = decode.translate(translator, sp, lines, params)
    with torch.no_grad():  # would win every step; and fills the source's padded positions, which are masked
        model.embed.weight[vocab.PAD_ID] = 50 * model.embed.weight.abs().max()
    assert decode.translate(translator, sp, lines, params) == before
    with torch.no_grad():  # would win too (and changes the decoder's first input, so the translations)
        model.embed.weight[vocab.BOS_ID] = model.embed.weight[vocab.PAD_ID]
    from translate.beam_search import beam_search
    from translate.translator import ModelSteps

    src = torch.tensor([sp.encode(line)[:20] + [vocab.EOS_ID] for line in lines[:4] if len(sp.encode(line)) >= 20])
    with torch.no_grad():
        found = beam_search(ModelSteps(model, src, never=(vocab.PAD_ID, vocab.BOS_ID)), len(src), 3,
                            torch.full((len(src),), 25), vocab.BOS_ID, vocab.EOS_ID, 0.6)
    assert all(vocab.PAD_ID not in h.tokens and vocab.BOS_ID not in h.tokens for hyps in found for h in hyps)


@pytest.mark.slow
def test_eight_stages_starting_at_once_against_a_new_store_all_record_everything(tmp_path):
    script = ("import sys\nfrom pipeline import tracking\ni = int(sys.argv[1])\n"
              "with tracking.stage_run(f'stage{i}', 'transformer-en-de', {'p': i}, {}, False) as t:\n"
              "    for step in range(10):\n        t.log_metrics({'m': float(step)}, step)\n")
    uri = f"sqlite:///{tmp_path / 'fresh/mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(8)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert all(rc == 0 for rc, _ in results), [err[-500:] for rc, err in results if rc]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("transformer-en-de").experiment_id])
    assert len(runs) == 8 and {r.info.status for r in runs} == {"FINISHED"}
    assert all(len(client.get_metric_history(r.info.run_id, "m")) == 10 for r in runs)


def _wrong_size(optimizer: dict) -> dict:
    state = {**optimizer, "state": dict(optimizer["state"])}
    state["state"][3] = {**state["state"][3], "exp_avg": torch.zeros(7)}
    return state


def _without(state: dict, key: str) -> dict:
    return {k: v for k, v in state.items() if k != key}


DAMAGE = {  # part: (what is done to checkpoint 4's part, what the warning says of it)
    "sampler": (lambda s: {"epoch": 0, "batches": -3}, "its sampler state"),
    "sampler ahead": (lambda s: {"epoch": 0, "batches": 6},
                      "its sampler state {'epoch': 0, 'batches': 6} is not where step 4 ends"),
    "topology": (lambda s: {"processes": "1", "grad_accum": 1}, "its topology"),
    "progress at 0": (lambda s: {**s, "step": 0}, "its progress says step 0, its file step 4"),
    "progress ahead": (lambda s: {**s, "step": 9}, "its progress says step 9, its file step 4"),
    "progress without a key": (lambda s: _without(s, "history"), "its progress lacks history"),
    "scheduler": (lambda s: {**s, "last_epoch": 0}, "its schedule says 0 steps were taken, its file step 4"),
    "optimizer": (_wrong_size, "its optimizer's exp_avg of parameter 3 is (7,) float32"),
    "model": (lambda s: {**s, "decoder.0.ffn.net.0.weight": torch.zeros(5, 32)},
              "its model weight decoder.0.ffn.net.0.weight is (5, 32) float32, this run's (64, 32) float32"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_part_of_the_newest_checkpoint_is_found_before_loading_and_skipped(case, encoded, vocab_dir,
                                                                                     tmp_path, capsys):
    """Every part is checked before any loads: a damaged one names file and part, the run resumes from
    the checkpoint before, the damaged file is moved aside (nothing takes it for a checkpoint), and no
    sound checkpoint is written over by the run that went back in steps."""
    run = lambda steps: train.run(TINY, train_params(max_steps=steps), encoded_dir=encoded[0],  # noqa: E731
                                  vocab_dir=vocab_dir, checkpoint_dir=tmp_path / "c", plots_dir=tmp_path / "p")
    run(4)
    folder = current_dir(tmp_path / "c")
    newest = read_checkpoint(folder / "checkpoint-00000004.pt")
    part = case.split()[0]
    damage, said = DAMAGE[case]
    newest.parts[part] = damage(newest.parts[part])
    write_checkpoint(folder, newest)
    sound = (folder / "checkpoint-00000002.pt").read_bytes()
    stale = folder / ".checkpoint-00000006.pt.k3j2_x.tmp"  # a save a kill cut short
    stale.write_bytes(b"half a checkpoint")
    capsys.readouterr()
    assert run(6)["steps"] == 6
    out = capsys.readouterr().out
    assert f"warning: skipping {folder / 'checkpoint-00000004.pt'}: {said}" in out
    assert f"resumed from {folder / 'checkpoint-00000002.pt'} at step 2" in out
    assert f"moved {folder / 'checkpoint-00000004.pt'} aside to checkpoint-00000004.pt.damaged" in out
    assert (folder / "checkpoint-00000002.pt").read_bytes() == sound
    assert (folder / "checkpoint-00000004.pt.damaged").is_file()
    assert [step for step, _ in list_checkpoints(folder)] == [2, 4, 6]  # 4 trained again from 2
    assert read_checkpoint(folder / "checkpoint-00000004.pt").parts["progress"]["step"] == 4
    assert not stale.exists() and f"removed {stale}" in out


def test_a_full_disk_during_a_save_ends_in_an_error_line_and_keeps_what_was_saved(encoded, vocab_dir, tmp_path,
                                                                                  capsys, monkeypatch):
    """The train stage's command, in this process, with the disk full when step 10's checkpoint is written."""
    from pipeline import stage
    from stages import model_files

    params = train_params_file(tmp_path, **{"train.max_steps": 10})  # checkpoints every 5 steps
    save = torch.save

    def full(state, f, *args, **kwargs):
        if state["step"] < 10:
            return save(state, f, *args, **kwargs)
        f.write(b"the first bytes")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(model_files.torch, "save", full)
    assert stage.main(train_command(params, encoded[0], vocab_dir, tmp_path)[2:]) == 1
    err = capsys.readouterr().err
    folder = current_dir(tmp_path / "ckpt")
    assert err.strip().splitlines()[-1] == (f"error: {folder / 'checkpoint-00000010.pt'}: could not be written: "
                                            f"No space left on device; what was there before is left as it was")
    assert "Traceback" not in err
    assert [step for step, _ in list_checkpoints(folder)] == [5]
    assert read_checkpoint(folder / "checkpoint-00000005.pt").parts["progress"]["step"] == 5
    assert not list(folder.glob(".*.tmp"))


def test_averaging_copies_of_one_checkpoint_returns_it_exactly(trained):
    state = read_checkpoint(trained[0] / "checkpoint-00000006.pt").parts["model"]
    for n in (3, 7):
        for k, v in average.average_state_dicts([(str(i), state) for i in range(n)]).items():
            assert torch.equal(v, state[k]), (n, k)
