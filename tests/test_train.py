"""The train stage on real encoded text: its outputs, exact resumption, several processes, gradient
accumulation, the non-finite guard, and each part of its loop alone (metrics rows, checkpoint
timing, curves, summary)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY, train_params
from stages import train
from stages.io import PipelineError
from stages.model_files import list_checkpoints, read_checkpoint
from stages.train_metrics import MetricsWindow, Progress, summary, write_curves
from transformer import TransformerConfig


def test_train_writes_checkpoints_curves_and_finite_metrics(trained, work):
    checkpoint_dir, m = trained
    assert [step for step, _ in list_checkpoints(checkpoint_dir)] == [2, 4, 6]
    assert m["steps"] == 6 and math.isfinite(m["loss"]) and math.isfinite(m["valid_loss"])
    assert m["train_flops"] > 0 and m["tflops"] > 0 and "mfu" not in m  # utilisation only where a peak is known
    rows = (work / "plots/train.csv").read_text().splitlines()
    assert rows[0].startswith("step,loss,nll") and len(rows) == 4  # header + steps 2, 4, 6
    header = rows[0].split(",")
    for row in rows[1:]:
        values = dict(zip(header, map(float, row.split(","))))
        assert 0 <= values["src_padding"] < 0.5 and 0 <= values["tgt_padding"] < 0.5 and 0.5 < values["batch_fill"] <= 1
    checkpoint = read_checkpoint(checkpoint_dir / "checkpoint-00000006.pt")
    assert set(checkpoint.parts) == {"model", "optimizer", "scheduler", "sampler", "progress", "rng"}
    assert checkpoint.meta.config == TINY and checkpoint.meta.steps == (6,) and checkpoint.step == 6


def test_resume_equals_uninterrupted(encoded, vocab_dir, tmp_path):
    def run(steps, directory):
        return train.run(TINY, train_params(max_steps=steps), encoded_dir=encoded[0], vocab_dir=vocab_dir,
                         checkpoint_dir=directory, plots_dir=tmp_path / "plots")

    run(6, tmp_path / "straight")
    run(4, tmp_path / "stopped")  # a run stopped after step 4 ...
    (tmp_path / "stopped/checkpoint-00000005.pt").write_bytes(b"cut short by a full disk")
    run(6, tmp_path / "stopped")  # ... and resumed to step 6, from the newest checkpoint that loads
    a = read_checkpoint(tmp_path / "straight/checkpoint-00000006.pt").parts
    b = read_checkpoint(tmp_path / "stopped/checkpoint-00000006.pt").parts
    same = lambda rows: [(r["step"], r["loss"], r["nll"], r["lr"], r["grad_norm"]) for r in rows]  # noqa: E731
    assert same(a["progress"]["history"]) == same(b["progress"]["history"])
    valid_b = {r["step"]: r for r in b["progress"]["valid_history"]}  # the stopped run also validated at step 4
    assert all(valid_b[r["step"]] == r for r in a["progress"]["valid_history"])
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=0)
    assert a["sampler"] == b["sampler"] and torch.equal(a["rng"][0]["cpu"], b["rng"][0]["cpu"])


def test_resume_with_a_different_model_is_refused(encoded, vocab_dir, trained, tmp_path):
    other = TransformerConfig(**{**TINY.__dict__, "d_ff": 128})
    with pytest.raises(PipelineError, match=r"different training run \(model.d_ff changed\)"):
        train.run(other, train_params(), encoded_dir=encoded[0], vocab_dir=vocab_dir, checkpoint_dir=trained[0],
                  plots_dir=tmp_path)


@pytest.mark.slow
def test_two_processes_train_together_and_a_resume_on_one_is_refused(encoded, vocab_dir, tmp_path):
    """torchrun with two CPU processes (gloo): one set of checkpoints, one metrics file."""
    from pipeline.config import PARAMS_FILE
    from pipeline.presets import apply_overrides, load_preset

    params = tmp_path / "params.yaml"
    params.write_text(PARAMS_FILE.read_text())
    apply_overrides({**load_preset("quickstart"), "train.max_steps": 4, "train.checkpoint_every_steps": 2,
                     "train.validate_every": 2, "train.batch_tokens": 1500}, params)
    command = ["-m", "pipeline.stage", "train", "--params", str(params), "--encoded-dir", str(encoded[0]),
               "--vocab-dir", str(vocab_dir), "--checkpoint-dir", str(tmp_path / "ckpt"),
               "--plots-dir", str(tmp_path / "plots"), "--metrics", str(tmp_path / "train.json")]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *command],
                         env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert [s for s, _ in list_checkpoints(tmp_path / "ckpt")] == [2, 4]
    assert json.loads((tmp_path / "train.json").read_text())["steps"] == 4
    assert len(read_checkpoint(tmp_path / "ckpt/checkpoint-00000004.pt").parts["rng"]) == 2  # both processes'
    one = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 1 and "world_size changed" in one.stderr


def _trainer(encoded_dir, vocab_dir, **changes):
    from accelerate import Accelerator

    config = TransformerConfig(**{**TINY.__dict__, "dropout": 0.0})
    return train.Trainer(config, train_params(**changes), encoded_dir=encoded_dir, vocab_dir=vocab_dir,
                         accelerator=Accelerator(cpu=True))


def _gradients_of_one_step(trainer, batches):
    trainer.sampler = iter(batches)
    captured = []
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: (captured.extend(p.grad.clone() for p in trainer.model.parameters()), step())
    trainer.train_step()
    return captured


def test_gradient_accumulation_equals_one_batch_of_the_union(encoded, vocab_dir):
    parts = [np.arange(i * 5, i * 5 + 5) for i in range(4)]
    accumulated = _gradients_of_one_step(_trainer(encoded[0], vocab_dir, grad_accum=4), parts)
    whole = _gradients_of_one_step(_trainer(encoded[0], vocab_dir, grad_accum=1), [np.concatenate(parts)])
    for a, b in zip(accumulated, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_non_finite_loss_stops_before_the_update(encoded, vocab_dir, monkeypatch):
    trainer = _trainer(encoded[0], vocab_dir)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    monkeypatch.setattr(train, "label_smoothed_nll_loss",
                        lambda *a, **k: (torch.tensor(float("nan"), requires_grad=True), torch.tensor(0.0)))
    with pytest.raises(PipelineError, match=r"non-finite loss \(nan\) at step 1 on process 0; stopped before"):
        trainer.train_step()
    for p, b in zip(trainer.model.parameters(), before, strict=True):
        assert torch.equal(p, b)


def test_a_checkpoint_from_another_precision_names_the_parts_that_differ(encoded, vocab_dir, tmp_path):
    trainer = _trainer(encoded[0], vocab_dir)
    trainer.save(tmp_path)
    again = _trainer(encoded[0], vocab_dir)
    again.parts["scaler"] = again.parts["progress"]  # a part the checkpoint does not hold (as fp16's scaler)
    with pytest.raises(PipelineError, match=r"holds the parts \[.*\], this run has \[.*'scaler'"):
        again.resume(tmp_path)


# -- the loop's parts, each alone -------------------------------------------------------------------

def _step(**values):
    report = {"loss_sum": 0.0, "nll_sum": 0.0, "tokens": 0, "src_tokens": 0, "src_slots": 1, "tgt_slots": 1,
              "binding": 0, "flops": 0.0, "lr": 0.0, "grad_norm": 0.0}
    return {**report, **values}


def test_a_metrics_row_divides_the_window_sums_over_every_process():
    window = MetricsWindow(micro_tokens=100, grad_accum=2, num_processes=2, peak=1e12)
    window.add(_step(loss_sum=30.0, nll_sum=20.0, tokens=60, src_tokens=50, src_slots=80, tgt_slots=80, binding=70,
                     flops=4e12), seconds=2.0)
    window.add(_step(loss_sum=10.0, nll_sum=20.0, tokens=40, src_tokens=30, src_slots=40, tgt_slots=40, binding=50,
                     flops=4e12, lr=0.5, grad_norm=3.0), seconds=2.0)
    doubled = lambda t: 2 * t  # noqa: E731 - two processes that saw the same
    row, flops, seconds = window.close(7, _step(lr=0.5, grad_norm=3.0), doubled)
    assert row["step"] == 7 and (row["lr"], row["grad_norm"]) == (0.5, 3.0)  # the newest step's
    assert row["loss"] == pytest.approx(80 / 200) and row["nll"] == pytest.approx(80 / 200)
    assert row["ppl"] == pytest.approx(math.exp(0.4)) and row["tgt_tokens_per_step"] == 100
    assert row["tgt_tokens_per_sec"] == pytest.approx(200 / 4) and row["src_tokens_per_sec"] == pytest.approx(160 / 4)
    assert row["src_padding"] == pytest.approx(1 - 160 / 240) and row["tgt_padding"] == pytest.approx(1 - 200 / 240)
    assert row["batch_fill"] == pytest.approx(240 / (2 * 2 * 2 * 100))  # 8 micro-batches of 100 tokens
    assert row["tflops"] == pytest.approx(16e12 / 4 / 1e12) and row["mfu"] == pytest.approx(4 / 2)
    assert (flops, seconds) == (16e12, 4.0)
    assert window.steps == 0 and window.sums["tokens"] == 0 and window.seconds == 0  # the next window starts afresh


def test_checkpoints_are_due_by_steps_by_the_main_clock_and_at_the_end():
    now = [0.0]
    decided = []

    def agree(late):
        decided.append(late)
        return late

    params = train_params(max_steps=10, checkpoint_every_steps=4, checkpoint_every_minutes=1.0)
    schedule = train.CheckpointSchedule(params, agree, clock=lambda: now[0])
    assert [s for s in range(1, 11) if schedule.due(s)] == [4, 8, 10]
    now[0] = 61.0
    assert schedule.due(5) and decided[-1] is True  # a minute since the last save
    schedule.saved()
    assert not schedule.due(6)
    by_steps = train.CheckpointSchedule(train_params(max_steps=10, checkpoint_every_minutes=0.0),
                                        lambda late: pytest.fail("no clock to agree on"))
    assert [s for s in range(1, 11) if by_steps.due(s)] == [2, 4, 6, 8, 10]


def test_progress_records_totals_and_survives_its_state(tmp_path):
    progress = Progress()
    progress.step = 4
    progress.record({"step": 2, "loss": 3.0, "tgt_tokens_per_sec": 10.0, "tflops": 1.0}, flops=5.0, seconds=1.0)
    progress.record({"step": 4, "loss": 2.0, "tgt_tokens_per_sec": 30.0, "tflops": 3.0}, flops=7.0, seconds=3.0)
    progress.valid_history.append({"step": 4, "valid_loss": 2.5})
    assert [r["train_flops"] for r in progress.history] == [5.0, 12.0]
    restored = Progress()
    restored.load_state_dict(progress.state_dict())
    assert restored == progress
    out = summary(progress, parameters=123, num_processes=2, peak=None)
    assert out["steps"] == 4 and out["loss"] == 2.0 and out["tgt_tokens_per_sec"] == 20.0 and out["valid_loss"] == 2.5
    assert out["train_flops"] == 12.0 and out["accelerator_hours"] == pytest.approx(4 * 2 / 3600) and "mfu" not in out
    write_curves(tmp_path, progress)
    assert (tmp_path / "train.csv").read_text().splitlines() == [
        "step,loss,tgt_tokens_per_sec,tflops,train_flops", "2,3.0,10.0,1.0,5.0", "4,2.0,30.0,3.0,12.0"]
    assert (tmp_path / "valid.csv").read_text().splitlines() == ["step,valid_loss", "4,2.5"]
