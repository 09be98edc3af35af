"""The train stage on real encoded text: its outputs, exact resumption, several processes, gradient
accumulation, the non-finite guard, and each part of its loop alone (metrics rows, checkpoint
timing, curves, summary)."""
import dataclasses
import json
import math
import re
import shutil

import numpy as np
import pytest
import torch

from conftest import TINY, another_vocabulary, freed_bytes_kept, separate_projections, train_command, \
    train_params, train_params_file
from stages import devices, train
from stages.batching import BatchSampler
from stages.devices import default_device
from stages.io import MANIFEST, PipelineError
from stages.checkpoint import Checkpointer, Processes, Schedule
from stages.model_files import ModelMeta, current_dir, list_checkpoints, read_checkpoint, write_checkpoint, \
    read_model, write_model
from stages.train_metrics import MetricsWindow, Progress, StepMetrics, summary, write_curves
from transformer.attention import MultiHeadAttention
from transformer.config import TransformerConfig
from transformer.schedule import inverse_sqrt_rate, linear_decay_rate


def test_train_writes_checkpoints_curves_and_finite_metrics(trained, work):
    checkpoint_dir, m = trained
    assert [step for step, _ in list_checkpoints(checkpoint_dir)] == [2, 4, 6]
    assert m["steps"] == 6 and math.isfinite(m["loss"]) and math.isfinite(m["valid_loss"])
    assert m["train_flops"] > 0 and m["mean_tflops"] > 0 and "mean_mfu" not in m  # utilisation where a peak is known
    rows = (work / "plots/train.csv").read_text().splitlines()
    assert rows[0].startswith("step,loss,nll") and len(rows) == 4  # header + steps 2, 4, 6
    header = rows[0].split(",")
    for row in rows[1:]:
        values = dict(zip(header, map(float, row.split(","))))
        assert 0 <= values["src_padding"] < 0.5 and 0 <= values["tgt_padding"] < 0.5 and 0.5 < values["batch_fill"] <= 1
    checkpoint = read_checkpoint(checkpoint_dir / "checkpoint-00000006.pt")
    assert set(checkpoint.parts) == {"model", "optimizer", "scheduler", "sampler", "progress", "topology"}
    assert checkpoint.meta.config == TINY and checkpoint.meta.steps == (6,) and checkpoint.step == 6


def test_resume_equals_uninterrupted(encoded, vocab_dir, tmp_path):
    def run(steps, directory):
        return train.run(TINY, train_params(max_steps=steps), encoded_dir=encoded[0], vocab_dir=vocab_dir,
                         checkpoint_dir=directory, plots_dir=tmp_path / "plots")

    run(6, tmp_path / "straight")
    run(4, tmp_path / "stopped")  # a run stopped after step 4 ...
    (current_dir(tmp_path / "stopped") / "checkpoint-00000005.pt").write_bytes(b"cut short by a full disk")
    run(6, tmp_path / "stopped")  # ... and resumed to step 6, from the newest checkpoint that loads
    a = read_checkpoint(current_dir(tmp_path / "straight") / "checkpoint-00000006.pt").parts
    b = read_checkpoint(current_dir(tmp_path / "stopped") / "checkpoint-00000006.pt").parts
    same = lambda rows: [(r["step"], r["loss"], r["nll"], r["lr"], r["grad_norm"]) for r in rows]  # noqa: E731
    assert same(a["progress"]["history"]) == same(b["progress"]["history"])
    valid_b = {r["step"]: r for r in b["progress"]["valid_history"]}  # the stopped run also validated at step 4
    assert all(valid_b[r["step"]] == r for r in a["progress"]["valid_history"])
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=0)
    assert a["sampler"] == b["sampler"]


def test_each_step_takes_the_papers_rate_times_lr_scale(trained, encoded, vocab_dir, tmp_path):
    def rates(checkpoint_dir):
        newest = list_checkpoints(checkpoint_dir)[-1][1]
        return {r["step"]: r["lr"] for r in read_checkpoint(newest).parts["progress"]["history"]}

    paper = {s: inverse_sqrt_rate(s, TINY.d_model, 4) for s in (2, 4, 6)}  # the rows logged every 2 steps
    assert rates(trained[0]) == pytest.approx(paper)  # lr_scale 1: section 5.3 as it stands
    train.run(TINY, train_params(lr_scale=0.25), encoded_dir=encoded[0], vocab_dir=vocab_dir,
              checkpoint_dir=tmp_path / "c", plots_dir=tmp_path / "p")
    assert rates(current_dir(tmp_path / "c")) == pytest.approx({s: 0.25 * r for s, r in paper.items()})
    train.run(TINY, train_params(schedule="linear_decay"), encoded_dir=encoded[0], vocab_dir=vocab_dir,
              checkpoint_dir=tmp_path / "d", plots_dir=tmp_path / "p")
    assert rates(current_dir(tmp_path / "d")) == pytest.approx({s: linear_decay_rate(s, TINY.d_model, 4, 6)
                                                                 for s in (2, 4, 6)})


def test_under_linear_decay_the_length_is_part_of_the_run(encoded, vocab_dir):
    """max_steps changes every rate of a linear decay: another length is another run; the paper's
    schedule goes on to a longer max_steps in the same run."""
    identity = lambda **changes: train.run_identity(TINY, train_params(**changes), encoded[0], vocab_dir, None)  # noqa: E731
    assert identity(max_steps=6) == identity(max_steps=12)
    assert identity(max_steps=6, schedule="linear_decay") != identity(max_steps=12, schedule="linear_decay")
    with pytest.raises(ValueError, match="linear_decay falls to zero at max_steps"):
        train_params(max_steps=4, warmup_steps=4, schedule="linear_decay")


def test_a_changed_setup_trains_beside_the_other_and_going_back_retrains_nothing(encoded, vocab_dir, tmp_path,
                                                                                 capsys):
    def run(config, **changes):
        return train.run(config, train_params(**changes), encoded_dir=encoded[0], vocab_dir=vocab_dir,
                         checkpoint_dir=tmp_path / "c", plots_dir=tmp_path / "p")

    first = run(TINY)
    first_dir = current_dir(tmp_path / "c")
    files = {p.name: p.stat().st_mtime_ns for p in first_dir.glob("*.pt")}
    other = run(dataclasses.replace(TINY, d_ff=128), warmup_steps=8)  # a model and a schedule of its own
    assert current_dir(tmp_path / "c") != first_dir and other["steps"] == 6
    assert {p.name: p.stat().st_mtime_ns for p in first_dir.glob("*.pt")} == files  # the first run is untouched
    assert json.loads((current_dir(tmp_path / "c") / "setup.json").read_text())["train"]["warmup_steps"] == 8
    capsys.readouterr()
    back = run(TINY)  # the first settings again: their run is complete, nothing to train
    assert current_dir(tmp_path / "c") == first_dir and "at step 6" in capsys.readouterr().out
    assert back["loss"] == first["loss"] and {p.name: p.stat().st_mtime_ns for p in first_dir.glob("*.pt")} == files


def test_a_run_already_past_max_steps_leaves_a_shorter_one_to_train_in_a_folder_of_its_own(encoded, vocab_dir,
                                                                                            tmp_path, capsys):
    """Fewer steps than the setup's run has made: the stage trains that many, as a run of their own (its model
    that of a run never longer), where it used to keep the longer run's model under the shorter run's name."""
    def run(steps, root="c"):
        return train.run(TINY, train_params(max_steps=steps), encoded_dir=encoded[0], vocab_dir=vocab_dir,
                         checkpoint_dir=tmp_path / root, plots_dir=tmp_path / "p")

    run(6)
    longer = current_dir(tmp_path / "c")
    capsys.readouterr()
    assert run(4)["steps"] == 4
    assert f"{longer} holds this setup's run, past train.max_steps 4" in capsys.readouterr().out
    shorter = current_dir(tmp_path / "c")
    assert shorter != longer and [step for step, _ in list_checkpoints(shorter)] == [2, 4]
    run(4, root="straight")
    a = read_checkpoint(shorter / "checkpoint-00000004.pt").parts["model"]
    b = read_checkpoint(current_dir(tmp_path / "straight") / "checkpoint-00000004.pt").parts["model"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert run(6)["steps"] == 6 and current_dir(tmp_path / "c") == longer  # each goes back to its own, done
    assert run(4)["steps"] == 4 and current_dir(tmp_path / "c") == shorter


def test_a_run_whose_vocabulary_and_data_were_made_again_the_same_resumes(encoded, vocab_dir, cleaned, tmp_path,
                                                                          capsys):
    """A run is named by what it trains on, not by incidental bytes: the vocab and encode stages run
    again (as `dvc repro -f` does) into other folders leave the same run to resume."""
    from stages import encode, vocab

    def run(steps, vocab_at, encoded_at):
        return train.run(TINY, train_params(max_steps=steps), encoded_dir=encoded_at, vocab_dir=vocab_at,
                         checkpoint_dir=tmp_path / "c", plots_dir=tmp_path / "p")

    run(2, vocab_dir, encoded[0])
    first = current_dir(tmp_path / "c")
    params = vocab.VocabParams(model_type="bpe", vocab_size=1000, character_coverage=1.0, input_sentence_size=100000,
                               seed=1)
    vocab.run(params, clean_dir=cleaned[0], out_dir=tmp_path / "vocab")
    encode.run(clean_dir=cleaned[0], vocab_dir=tmp_path / "vocab", out_dir=tmp_path / "encoded")
    capsys.readouterr()
    assert run(4, tmp_path / "vocab", tmp_path / "encoded")["steps"] == 4
    assert current_dir(tmp_path / "c") == first and f"{first / 'checkpoint-00000002.pt'} at step 2" in \
        capsys.readouterr().out


def test_a_run_started_from_trained_weights_begins_at_them_in_a_folder_of_its_own(trained, encoded, vocab_dir,
                                                                                 tmp_path):
    start = list_checkpoints(trained[0])[-1][1]  # another run's step 6

    def run(config=TINY, **changes):
        return train.run(config, train_params(**changes), encoded_dir=encoded[0], vocab_dir=vocab_dir,
                         checkpoint_dir=tmp_path / "c", plots_dir=tmp_path / "p", init_weights=start)

    run(dataclasses.replace(TINY, dropout=0.0), max_steps=0)  # another dropout may; 0 steps: saved as it began
    begun = read_checkpoint(list_checkpoints(current_dir(tmp_path / "c"))[-1][1])
    weights = read_checkpoint(start).parts["model"]
    assert begun.step == 0 and begun.parts["model"].keys() == weights.keys()
    for k, v in weights.items():
        torch.testing.assert_close(begun.parts["model"][k], v, rtol=0, atol=0)
    from_trained = current_dir(tmp_path / "c")
    train.run(TINY, train_params(max_steps=0), encoded_dir=encoded[0], vocab_dir=vocab_dir,
              checkpoint_dir=tmp_path / "c", plots_dir=tmp_path / "p")  # from random weights: another setup
    assert current_dir(tmp_path / "c") != from_trained
    shapes = r"cannot start this run: its weight decoder.0.ffn.net.0.bias is \(64,\), this model's \(128,\)"
    with pytest.raises(PipelineError, match=shapes):
        run(dataclasses.replace(TINY, d_ff=128))
    weights, meta = read_model(start)
    start = tmp_path / "another-vocabulary.safetensors"  # of the same size, as another corpus's would be
    write_model(start, weights, dataclasses.replace(meta, vocab="0" * 32))
    with pytest.raises(PipelineError, match=r"cannot start this run: it was trained on another vocabulary"):
        run()


def test_ids_encoded_with_another_vocabulary_are_refused_before_training(encoded, cleaned, vocab_dir, tmp_path):
    other = another_vocabulary(cleaned[0], vocab_dir, tmp_path / "unigram")
    with pytest.raises(PipelineError, match=rf"{encoded[0]} was encoded with another vocabulary than {other}"):
        train.run(TINY, train_params(max_steps=0), encoded_dir=encoded[0], vocab_dir=other,
                  checkpoint_dir=tmp_path / "c", plots_dir=tmp_path / "p")
    assert not (tmp_path / "c").exists()


def test_a_damaged_manifest_of_the_encoded_data_is_named_with_its_line(encoded, vocab_dir, tmp_path):
    damaged = tmp_path / "encoded"
    shutil.copytree(encoded[0], damaged)
    (damaged / MANIFEST).write_text('{"src_lang": "en",\n "tgt_lang": \n', encoding="utf-8")  # cut short
    with pytest.raises(PipelineError, match=rf"{damaged / MANIFEST}:3: not valid JSON \(Expecting value\)"):
        train.run(TINY, train_params(max_steps=0), encoded_dir=damaged, vocab_dir=vocab_dir,
                  checkpoint_dir=tmp_path / "c", plots_dir=tmp_path / "p")
    assert not (tmp_path / "c").exists()


def test_a_run_starts_from_a_model_saved_with_attention_products_apart(trained, encoded, vocab_dir, tmp_path):
    """An averaged model from before q, k and v were one product starts a run at the same weights."""
    checkpoint = read_checkpoint(list_checkpoints(trained[0])[-1][1])
    old = tmp_path / "old.safetensors"
    write_model(old, separate_projections(checkpoint.parts["model"], TINY), checkpoint.meta)
    train.run(TINY, train_params(max_steps=0), encoded_dir=encoded[0], vocab_dir=vocab_dir,
              checkpoint_dir=tmp_path / "c", plots_dir=tmp_path / "p", init_weights=old)
    begun = read_checkpoint(list_checkpoints(current_dir(tmp_path / "c"))[-1][1]).parts["model"]
    assert "encoder.0.self_attn.k_proj.weight" not in begun and begun.keys() == checkpoint.parts["model"].keys()
    for name, weight in checkpoint.parts["model"].items():
        torch.testing.assert_close(begun[name], weight, rtol=0, atol=0)


def _accelerator():
    """On the device train.run picks (a GPU where there is one): one process has one Accelerate state."""
    from accelerate import Accelerator

    return Accelerator(cpu=default_device().type == "cpu")


def _trainer(encoded_dir, vocab_dir, accelerator=None, **changes):
    """A trainer of TINY without dropout, its step compiled as `changes` ask."""
    config = TransformerConfig(**{**TINY.__dict__, "dropout": 0.0})
    trainer = train.Trainer(config, train_params(**changes), encoded_dir=encoded_dir, vocab_dir=vocab_dir,
                            accelerator=accelerator or _accelerator())
    train.compile_step(trainer)
    return trainer


def _gradients(trainer, steps=1):
    """The gradients each of `steps` steps updates with."""
    captured = []
    update = trainer.optimizer.step
    trainer.optimizer.step = lambda: (captured.append([p.grad.clone() for p in trainer.model.parameters()]), update())
    for _ in range(steps):
        trainer.train_step()
    trainer.close()
    return captured


@pytest.mark.parametrize("compiled", [False, "loss", *(pytest.param(c, marks=pytest.mark.slow)
                                                         for c in (True, "layers"))])
def test_gradient_accumulation_equals_one_batch_of_the_union(encoded, vocab_dir, compiled):
    """Four micro-batches, eager, their loss compiled, their layers and loss or all compiled, against the
    eager step of their union."""
    from torch._dynamo.utils import counters

    parts = [np.arange(i * 5, i * 5 + 5) for i in range(4)]
    torch._dynamo.reset()  # a graph another test compiled would be reused, with no time compiling
    counters.clear()
    accumulating = _trainer(encoded[0], vocab_dir, micro_batches=4, compile=compiled)
    accumulating.sampler = BatchSampler(parts, seed=1)  # one step takes them all, in some order
    whole = _trainer(encoded[0], vocab_dir, micro_batches=1)
    whole.sampler = BatchSampler([np.concatenate(parts)], seed=1)
    for a, b in zip(*_gradients(accumulating), *_gradients(whole), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert isinstance(accumulating.forward_loss, train.Compiled) == bool(compiled)  # compiled, it did not fall back
    assert (accumulating.compiling > 0) == bool(compiled)  # and a graph was compiled
    # the whole step one graph, the loss one; layer by layer, one a kind of layer (TINY has two of each) and the loss
    assert counters["stats"]["unique_graphs"] == {False: 0, "loss": 1, True: 1, "layers": 3}[compiled]


def test_a_trainer_leaves_the_process_as_it_found_it(encoded, vocab_dir):
    """The seed makes the weights without reseeding the process; attention kernels are chosen within
    the step (on GPUs), not switched for the whole process."""
    torch.manual_seed(123)
    generator, kernels = torch.get_rng_state(), torch.backends.cuda.cudnn_sdp_enabled()
    trainers = [_trainer(encoded[0], vocab_dir) for _ in range(2)]
    assert torch.equal(torch.get_rng_state(), generator)
    for a, b in zip(*(t.model.parameters() for t in trainers), strict=True):
        assert torch.equal(a, b)
    trainers[0].train_step()
    assert torch.backends.cuda.cudnn_sdp_enabled() == kernels
    for trainer in trainers:
        trainer.close()


def test_auto_precision_is_bf16_on_gpus_that_have_it_and_on_cpus_with_fast_bf16_products(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for amx, avx512_bf16, expected in ((True, False, "bf16"), (False, True, "bf16"), (False, False, "no")):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda avx512_bf16=avx512_bf16: avx512_bf16)
        assert devices.mixed_precision("auto") == expected
        assert devices.mixed_precision("fp32") == "no" and devices.mixed_precision("bf16") == "bf16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for supported, expected in ((True, "bf16"), (False, "no")):  # a GPU's own support decides, not the CPU's
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda supported=supported: supported)
        assert devices.mixed_precision("auto") == expected


@pytest.mark.skipif(default_device().type != "cpu", reason="the CPU's attention kernels")
def test_a_bf16_step_on_cpus_attends_by_bf16_products_and_follows_fp32s_gradients(encoded, vocab_dir):
    """torch's CPU attention kernels compute bf16 attention in fp32, or slowly (stages/train_cpu.py), so a
    bf16 step attends by two bf16 products and calls none of them; fp32 keeps the fused kernel."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.profiler import profile

    from stages.train_cpu import ProductAttention

    grads, kernels, attention = {}, {}, {}
    try:
        for precision in ("no", "bf16"):
            AcceleratorState._reset_state(True)  # one precision a process: this test's, then the others' again
            trainer = _trainer(encoded[0], vocab_dir, Accelerator(cpu=True, mixed_precision=precision))
            attention[precision] = {type(m) for m in trainer.model.modules() if isinstance(m, MultiHeadAttention)}
            with profile() as prof:
                grads[precision] = _gradients(trainer)[0]
            kernels[precision] = {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}
            products = {e.key: e.count for e in prof.key_averages() if e.key == "aten::bmm"}
    finally:
        AcceleratorState._reset_state(True)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in kernels["no"] and not kernels["bf16"], kernels
    assert attention == {"no": {MultiHeadAttention}, "bf16": {ProductAttention}} and products
    exact, rounded = (torch.cat([g.flatten() for g in grads[p]]) for p in ("no", "bf16"))
    assert float((rounded - exact).norm()) <= 0.05 * float(exact.norm())  # bf16 keeps 8 bits of mantissa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_drawn_in_bulk_is_torchs_dropout_with_masks_from_torchs_seed(dtype):
    """BulkDropout (the CPU step's, stages/train_cpu.py) against torch's own: the units it drops, the
    scale of those it keeps and the gradient; its masks follow torch's generator and nothing else."""
    from stages.train_cpu import BulkDropout

    p, shape = 0.1, (64, 2000)
    bulk, reference = BulkDropout(p).train(), torch.nn.Dropout(p).train()
    x = torch.rand(shape, dtype=dtype) + 0.5  # no unit is zero before dropout
    torch.manual_seed(5)
    kept = (reference(x) != 0).float().mean()
    torch.manual_seed(5)
    x.requires_grad_(True)
    out = bulk(x)
    out.backward(torch.ones_like(out))
    dropped = out == 0
    sigma = (p * (1 - p) / out.numel()) ** 0.5
    assert abs(float(dropped.float().mean()) - p) < 5 * sigma and abs(float(kept) - (1 - p)) < 5 * sigma
    pairs = (dropped[:, :-1] & dropped[:, 1:]).float().mean()  # neighbours (one 64-bit draw's) drop independently
    assert abs(float(pairs) - p * p) < 5 * (p * p / out.numel()) ** 0.5
    scale = torch.tensor(1 / (1 - p), dtype=dtype)  # what torch's dropout scales by, in x's dtype
    close = {"rtol": 1e-4 if dtype == torch.float32 else 0, "atol": 0}  # p kept to within 2^-17
    torch.testing.assert_close(out[~dropped], (x * scale)[~dropped], **close)
    assert out.dtype == dtype
    torch.testing.assert_close(x.grad, torch.where(dropped, 0, scale).to(dtype), **close)
    torch.manual_seed(5)
    assert torch.equal(bulk(x) == 0, dropped) and not torch.equal(bulk(x) == 0, dropped)  # reseeded: the same
    torch.manual_seed(5)
    assert torch.equal(bulk(x.float().detach()) == 0, dropped)  # the mask does not depend on the dtype
    assert bulk.eval()(x) is x


def test_product_attention_drops_attention_weights_in_bulk_as_scaled_dot_product_attention_does():
    """ProductAttention (a bf16 CPU step's, stages/train_cpu.py) with attention dropout: with v the
    identity its output is the weights, each zeroed with probability p, the rest scaled by 1 / (1 - p)."""
    from stages.train_cpu import ProductAttention
    from translate.transforms import swap_class

    p, keys = 0.25, 32
    attention = MultiHeadAttention(16, 2, 8, 8, p, self_attention=True)
    swap_class(attention, ProductAttention)
    q, k = torch.randn(50, 2, 20, 8), torch.randn(50, 2, keys, 8)
    v = torch.eye(keys).expand(50, 2, keys, keys)
    weights = attention.eval().attend(q, k, v, None, False)
    torch.testing.assert_close(weights, torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1))
    torch.manual_seed(1)
    dropped = attention.train().attend(q, k, v, None, False)
    zero = dropped == 0
    assert abs(float(zero.float().mean()) - p) < 5 * (p * (1 - p) / zero.numel()) ** 0.5
    torch.testing.assert_close(dropped[~zero], weights[~zero] / (1 - p))
    torch.manual_seed(1)
    assert torch.equal(attention.attend(q, k, v, None, False), dropped)  # its masks follow torch's seed


@pytest.mark.parametrize("compiled", ["loss", True, "layers"])
def test_a_cpu_trainer_draws_dropout_in_bulk_where_its_model_runs_eager(encoded, vocab_dir, compiled):
    from stages.train_cpu import BulkDropout

    trainer = train.Trainer(TINY, train_params(compile=compiled), encoded_dir=encoded[0], vocab_dir=vocab_dir,
                            accelerator=_accelerator())
    layers = [type(m) for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout | BulkDropout)]
    bulk = default_device().type == "cpu" and compiled == "loss"  # compiled, inductor draws the masks
    assert layers and set(layers) == ({BulkDropout} if bulk else {torch.nn.Dropout})
    trainer.close()


def test_auto_compiles_the_step_on_gpus_its_loss_on_cpus_and_a_run_resumes_across_them(encoded, vocab_dir):
    auto = train_params(compile="auto")
    assert auto.resolved(gpu=True).compile is True and auto.resolved(gpu=False).compile == "loss"
    assert train_params(compile=False).resolved(gpu=True).compile is False
    assert train_params(compile="loss").resolved(gpu=True).compile == "loss"
    identity = {gpu: train.run_identity(TINY, auto.resolved(gpu), encoded[0], vocab_dir, None) for gpu in (True, False)}
    assert identity[True] == identity[False]  # compiling never alters the updates
    trainer = _trainer(encoded[0], vocab_dir, compile="auto")
    assert isinstance(trainer.forward_loss, train.Compiled)
    assert trainer.forward_loss.part == ("step" if default_device().type == "cuda" else "loss")
    trainer.close()


def test_a_step_that_fails_to_compile_trains_eager_after_one_warning(encoded, vocab_dir, tmp_path, monkeypatch,
                                                                     capfd):
    """A machine without what torch.compile needs (a C++ compiler, Triton) still trains: the step that
    failed is done again as written, and so is every later one."""
    import torch._inductor.compile_fx

    def no_compiler(*args, **kwargs):
        raise torch._inductor.exc.InvalidCxxCompiler()

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", no_compiler)
    torch._dynamo.reset()
    history = {}
    for compiled in (False, True, "layers", "loss"):
        config = dataclasses.replace(TINY, dropout=0.0)
        out = tmp_path / str(compiled)
        metrics = train.run(config, train_params(max_steps=4, compile=compiled, log_every=1, validate_every=2),
                            encoded_dir=encoded[0], vocab_dir=vocab_dir, checkpoint_dir=out,
                            plots_dir=tmp_path / "plots")
        checkpoint = read_checkpoint(current_dir(out) / "checkpoint-00000004.pt")
        history[compiled] = [(r["loss"], r["grad_norm"]) for r in checkpoint.parts["progress"]["history"]]
        assert compiled or "compile_seconds" not in metrics  # eager: no time compiling to report
    assert history[True] == history["layers"] == history["loss"] == history[False]
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning")]
    assert len(warnings) == 3, warnings  # one a run that compiles
    steps = ("compiled", "layer-compiled (each layer and the loss)", "loss-compiled (the model eager)")
    for warning, step in zip(warnings, steps, strict=True):
        assert warning.startswith(f"warning: the {step} step failed to compile (InvalidCxxCompiler: No working C++ "
                                  f"compiler found in torch._inductor.config.cpp.cxx")
        assert warning.endswith("); training goes on eager")


def test_a_non_finite_loss_skips_its_update_on_the_device_and_stops_the_next_step(encoded, vocab_dir, monkeypatch):
    trainer = _trainer(encoded[0], vocab_dir)
    trainer.train_step()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    moments = {k: v.clone() for k, v in trainer.optimizer.optimizer.state_dict()["state"][0].items()}
    monkeypatch.setattr(train, "label_smoothed_nll_loss",
                        lambda logits, *a: ((logits * float("nan")).sum(), logits.sum().detach()))
    trainer.train_step()  # step 2: its agreement is read at the next step; its update is skipped meanwhile
    for p, b in zip(trainer.model.parameters(), before, strict=True):
        assert torch.equal(p, b)
    after = trainer.optimizer.optimizer.state_dict()["state"][0]
    assert all(torch.equal(after[k], v) for k, v in moments.items())  # moments and Adam's own step count too
    with pytest.raises(PipelineError, match=r"non-finite loss \(nan\) at step 2 on process 0; its update was "
                                            r"skipped and training stopped there"):
        trainer.train_step()
    for p, b in zip(trainer.model.parameters(), before, strict=True):
        assert torch.equal(p, b)
    trainer.close()


def test_a_run_saves_no_checkpoint_past_a_non_finite_loss(encoded, vocab_dir, tmp_path, monkeypatch):
    losses = iter([None, float("nan")])  # step 1 as it is, step 2 not finite, which step 2's checkpoint must see
    loss = train.label_smoothed_nll_loss

    def patched(logits, *args):
        scale = next(losses, None)
        total, nll = loss(logits, *args)
        return (total * scale, nll) if scale is not None else (total, nll)
    monkeypatch.setattr(train, "label_smoothed_nll_loss", patched)
    with pytest.raises(PipelineError, match="non-finite loss .* at step 2 on process 0"):
        train.run(TINY, train_params(max_steps=4), encoded_dir=encoded[0], vocab_dir=vocab_dir,
                  checkpoint_dir=tmp_path / "c", plots_dir=tmp_path / "plots")
    assert list_checkpoints(current_dir(tmp_path / "c")) == []


@pytest.mark.parametrize("failing_call, what", [(2, "step 3"), (3, "the validation after step 3")])
def test_a_step_out_of_gpu_memory_stops_naming_the_setting_that_takes_less_at_a_time(encoded, vocab_dir, tmp_path,
                                                                                    monkeypatch, failing_call, what):
    """torch's error comes from deep in the step and names no setting: the stage says which step (or which
    validation, after a step) ran out and how to ask for less at a time, and keeps the checkpoints saved before."""
    calls = iter(range(10**6))  # each step has one micro-batch; after step 3, validation's dev batches
    loss = train.label_smoothed_nll_loss

    def patched(*args):
        if next(calls) == failing_call:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return loss(*args)
    monkeypatch.setattr(train, "label_smoothed_nll_loss", patched)
    monkeypatch.setattr(devices, "memory_held", lambda device: "its memory")  # said on a GPU (TEST_DEVICE=cuda)
    with pytest.raises(PipelineError) as stopped:
        train.run(TINY, train_params(max_steps=4), encoded_dir=encoded[0], vocab_dir=vocab_dir,
                  checkpoint_dir=tmp_path / "c", plots_dir=tmp_path / "plots")
    folder, held = current_dir(tmp_path / "c"), " (its memory)" if default_device().type == "cuda" else ""
    assert str(stopped.value) == (
        f"{what} ran out of GPU memory{held}: each process takes 1500 target tokens at a time, a step's 1500 in 1 "
        f"micro-batch; -S train.micro_batches=2 takes half as many at a time, the same tokens a step (this run's "
        f"checkpoints keep its 1: move {folder} aside to start a run with 2)")
    assert [step for step, _ in list_checkpoints(folder)] == [2]


def test_out_of_gpu_memory_is_said_with_the_devices_memory_and_other_errors_pass(monkeypatch):
    if torch.cuda.is_available():  # bench/gpu/check.sh speed runs this test on a GPU
        held = devices.memory_held(torch.device("cuda"))
        assert re.fullmatch(r".+: \d+\.\d GiB, this process held at most \d+\.\d", held), held
    monkeypatch.setattr(devices, "memory_held", lambda d: f"{d.type}: 79.1 GiB, this process held at most 78.0")
    with pytest.raises(PipelineError, match=r"^work ran out of GPU memory \(cuda: 79.1 GiB, this process held at most "
                                            r"78.0\): less at a time$"):
        with devices.out_of_memory_stops(torch.device("cuda"), lambda: "work", lambda: "less at a time"):
            raise torch.OutOfMemoryError("CUDA out of memory.")
    with pytest.raises(RuntimeError, match="^not memory$"):
        with devices.out_of_memory_stops(torch.device("cuda"), lambda: "work", lambda: "less at a time"):
            raise RuntimeError("not memory")


def test_a_checkpoint_without_a_part_of_the_state_names_the_parts(encoded, vocab_dir, tmp_path):
    path = train.checkpointer(_trainer(encoded[0], vocab_dir), tmp_path).save(0)
    checkpoint = read_checkpoint(path)
    del checkpoint.parts["scheduler"]
    write_checkpoint(path.parent, checkpoint)
    with pytest.raises(PipelineError, match=r"holds the parts \[.*\], this run has \[.*'scheduler'"):
        train.checkpointer(_trainer(encoded[0], vocab_dir), tmp_path).start()


def test_the_processes_and_the_step_they_share_are_checked_before_any_work(monkeypatch):
    assert devices.processes("auto") == 1 and devices.processes(3) == 3  # no GPU: CPU processes (gloo), any number
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    assert devices.processes("auto") == 2 and devices.processes(1) == 1
    with pytest.raises(PipelineError, match=r"train.processes is 3, but 2 GPUs can be seen \(NVIDIA H100 80GB HBM3, "):
        devices.processes(3)
    assert train.micro_batches("auto", 4) == 4  # a new run: one a process
    assert train.micro_batches("auto", 4, recorded=8) == 8  # the run's own: two each
    assert train.micro_batches(8, 2) == 8
    with pytest.raises(PipelineError, match="the run to resume takes 8 micro-batches a step, which 3 processes "
                                            "cannot share: set train.processes to a divisor of 8"):
        train.micro_batches("auto", 3, recorded=8)
    with pytest.raises(PipelineError, match="train.micro_batches is 8 .* or train.micro_batches to a multiple of 3"):
        train.micro_batches(8, 3)


# -- the loop's parts, each alone -------------------------------------------------------------------

def _step(**values):
    report = {"loss_sum": 0.0, "nll_sum": 0.0, "tokens": 0, "src_tokens": 0, "src_slots": 1, "tgt_slots": 1,
              "binding": 0, "flops": 0.0, "lr": 0.0, "grad_norm": 0.0, "data_wait": 0.0}
    return StepMetrics(**{**report, **values})


def test_a_metrics_row_divides_the_window_sums_over_every_process():
    window = MetricsWindow(micro_tokens=100, grad_accum=2, num_processes=2, peak=1e12)
    window.add(_step(loss_sum=torch.tensor(30.0), nll_sum=torch.tensor(20.0), tokens=60, src_tokens=50, src_slots=80,
                     tgt_slots=80, binding=70, flops=4e12, data_wait=0.1), seconds=2.0)
    window.add(_step(loss_sum=torch.tensor(10.0), nll_sum=torch.tensor(20.0), tokens=40, src_tokens=30, src_slots=40,
                     tgt_slots=40, binding=50, flops=4e12, lr=0.5, grad_norm=torch.tensor(3.0)), seconds=2.0)
    doubled = lambda t: 2 * t  # noqa: E731 - two processes that saw the same
    row, flops, seconds = window.close(7, _step(lr=0.5, grad_norm=3.0), doubled)
    assert row["step"] == 7 and (row["lr"], row["grad_norm"]) == (0.5, 3.0)  # the newest step's
    assert row["loss"] == pytest.approx(80 / 200) and row["nll"] == pytest.approx(80 / 200)
    assert row["ppl"] == pytest.approx(math.exp(0.4)) and row["tgt_tokens_per_step"] == 100
    assert row["tgt_tokens_per_sec"] == pytest.approx(200 / 4) and row["src_tokens_per_sec"] == pytest.approx(160 / 4)
    assert row["src_padding"] == pytest.approx(1 - 160 / 240) and row["tgt_padding"] == pytest.approx(1 - 200 / 240)
    assert row["batch_fill"] == pytest.approx(240 / (2 * 2 * 2 * 100))  # 8 micro-batches of 100 tokens
    assert row["tflops"] == pytest.approx(16e12 / 4 / 1e12) and row["mfu"] == pytest.approx(4 / 2)
    assert row["data_wait_fraction"] == pytest.approx(0.2 / (4 * 2))
    assert (flops, seconds) == (16e12, 4.0)
    assert window.steps == 0 and window.sums["tokens"] == 0 and window.seconds == 0  # the next window starts afresh


def _schedule(tmp_path, max_steps: int, every_steps: int, minutes: float, is_main: bool, clock) -> Checkpointer:
    return Checkpointer(tmp_path, {}, 1, {}, Schedule(every_steps, minutes, 20, max_steps), ModelMeta(TINY, 11, ()),
                        Processes(is_main, print, lambda: None, lambda value: [value]), clock)


def test_checkpoints_are_due_by_steps_snapshots_by_the_main_clock(tmp_path):
    now = [0.0]
    schedule = _schedule(tmp_path, 10, 4, 1.0, True, lambda: now[0])
    assert {s: schedule.due(s, late=False) for s in range(1, 11) if schedule.due(s, late=False)} == \
        {4: "checkpoint", 8: "checkpoint", 10: "checkpoint"}
    assert not schedule.late()
    now[0] = 61.0
    assert schedule.late() and not _schedule(tmp_path, 10, 4, 1.0, False, lambda: now[0]).late()
    assert schedule.due(5, late=True) == "snapshot"  # a minute since the last save: crash safety
    assert schedule.due(8, late=True) == "checkpoint"  # on the spacing it is a checkpoint, late or not
    schedule.save(8)
    assert not schedule.late() and schedule.due(6, late=False) is None
    by_steps = _schedule(tmp_path, 10, 2, 0.0, True, lambda: 1e9)
    assert not by_steps.late() and [s for s in range(1, 11) if by_steps.due(s, False)] == [2, 4, 6, 8, 10]


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
    assert out["steps"] == 4 and out["loss"] == 2.0 and out["mean_tgt_tokens_per_sec"] == 20.0
    assert out["valid_loss"] == 2.5 and out["train_flops"] == 12.0 and "mean_mfu" not in out
    assert out["accelerator_hours"] == pytest.approx(4 * 2 / 3600)
    write_curves(tmp_path, progress)
    assert (tmp_path / "train.csv").read_text().splitlines() == [
        "step,loss,tgt_tokens_per_sec,tflops,train_flops", "2,3.0,10.0,1.0,5.0", "4,2.0,30.0,3.0,12.0"]
    assert (tmp_path / "valid.csv").read_text().splitlines() == ["step,valid_loss", "4,2.5"]


# -- the GPU path, checked on the CPU -------------------------------------------------------------

def test_averaging_takes_the_step_spaced_checkpoints_not_the_snapshots_between_them(encoded, vocab_dir, tmp_path,
                                                                                    monkeypatch):
    from stages import average

    # a snapshot is due at every step (a clock of a microsecond), a checkpoint every 3 steps and at the end
    params = train_params(max_steps=8, checkpoint_every_steps=3, checkpoint_every_minutes=1e-8, keep_checkpoints=2)
    seen, save = [], Checkpointer.save

    def spy(self, step, snapshot=False):
        seen.append((step, snapshot))
        return save(self, step, snapshot)

    monkeypatch.setattr(Checkpointer, "save", spy)
    train.run(TINY, params, encoded_dir=encoded[0], vocab_dir=vocab_dir, checkpoint_dir=tmp_path / "c",
              plots_dir=tmp_path / "plots")
    # The clock's word is agreed one step late: a snapshot follows the step after each save, never on it.
    assert seen == [(2, True), (3, False), (5, True), (6, False), (8, False)]
    assert [p.name for _, p in list_checkpoints(current_dir(tmp_path / "c"), snapshots=True)] == \
        ["checkpoint-00000006.pt", "checkpoint-00000008.pt"]  # keep 2; every snapshot superseded
    metrics = average.run(average.AverageParams(last=2), checkpoint_dir=tmp_path / "c", out_path=tmp_path / "m.st")
    assert (metrics["first_step"], metrics["last_step"]) == (6, 8)


def test_a_run_resumed_from_a_snapshot_equals_one_never_stopped(encoded, vocab_dir, tmp_path, capsys):
    """The prefetcher has batches of later steps ready when the snapshot is taken: they must not count
    as consumed. fp32, so the weights must agree to the bit."""
    params = train_params(max_steps=7, checkpoint_every_steps=0, micro_batches=2)
    straight = train.run(TINY, params, encoded_dir=encoded[0], vocab_dir=vocab_dir, checkpoint_dir=tmp_path / "a",
                         plots_dir=tmp_path / "plots")
    killed = train.Trainer(TINY, params, encoded_dir=encoded[0], vocab_dir=vocab_dir, accelerator=_accelerator())
    for _ in range(3):
        killed.train_step()
    train.checkpointer(killed, tmp_path / "b").save(3, snapshot=True)  # then the process dies
    killed.close()
    capsys.readouterr()
    resumed = train.run(TINY, params, encoded_dir=encoded[0], vocab_dir=vocab_dir, checkpoint_dir=tmp_path / "b",
                        plots_dir=tmp_path / "plots")
    assert resumed["steps"] == straight["steps"] == 7 and "snapshot-00000003.pt at step 3" in capsys.readouterr().out
    a = read_checkpoint(current_dir(tmp_path / "a") / "checkpoint-00000007.pt").parts
    b = read_checkpoint(current_dir(tmp_path / "b") / "checkpoint-00000007.pt").parts
    assert a["sampler"] == b["sampler"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


SYNCS = {"item", "__float__", "__int__", "__bool__", "__index__", "tolist", "nonzero", "numpy", "cpu"}


def test_only_log_and_save_steps_read_from_the_device(encoded, vocab_dir, tmp_path, monkeypatch):
    """Every call that reads a tensor's value back to the host (or indexes with a boolean mask, which
    does), watched as torch dispatches them through a whole run with gradient accumulation: the steps
    between log rows, validation and checkpoints read nothing (their agreement travels in pinned
    memory and is read a step late, without torch). On CPUs dropout drawn in bulk reads its seed from
    host memory, which waits on nothing: that read alone is not watched."""
    from torch.overrides import TorchFunctionMode

    from stages.train_cpu import BulkDropout

    class Watch(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.reads, self.seeding = [], False

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", str(func))
            masked = name in ("__getitem__", "__setitem__") and isinstance(args[1], torch.Tensor) \
                and args[1].dtype == torch.bool
            if (name in SYNCS or masked) and not self.seeding:
                self.reads.append(name)
            return func(*args, **(kwargs or {}))

    watch, step, seed = Watch(), train.Trainer.train_step, BulkDropout.seed

    def seeding():
        watch.seeding = True
        try:
            return seed()
        finally:
            watch.seeding = False
    monkeypatch.setattr(BulkDropout, "seed", staticmethod(seeding))

    def marked(self, *args, **kwargs):
        watch.reads.append(self.progress.step + 1)  # what follows happened in (or after) this step
        return step(self, *args, **kwargs)
    monkeypatch.setattr(train.Trainer, "train_step", marked)
    params = train_params(max_steps=6, micro_batches=3, log_every=3, validate_every=6, checkpoint_every_steps=0)
    with watch:
        train.run(TINY, params, encoded_dir=encoded[0], vocab_dir=vocab_dir, checkpoint_dir=tmp_path / "c",
                  plots_dir=tmp_path / "plots")
    marks = [i for i, entry in enumerate(watch.reads) if isinstance(entry, int)]
    during = {watch.reads[i]: watch.reads[i + 1 : j] for i, j in zip(marks, marks[1:] + [len(watch.reads)])}
    assert list(during) == [1, 2, 3, 4, 5, 6]
    assert during[1] == during[2] == during[4] == during[5] == []
    assert during[3] and during[6]  # the log rows (and at 6 validation and the last checkpoint) read their figures


def test_batches_are_padded_to_a_multiple_of_eight_on_a_gpu_only(encoded, vocab_dir):
    trainer = _trainer(encoded[0], vocab_dir)
    on_gpu = default_device().type == "cuda"  # on a CPU padding would only add work
    assert trainer.inputs.pad_multiple == (8 if on_gpu else 1) and trainer.inputs.pin == on_gpu
    prepared = dataclasses.replace(trainer.inputs, pad_multiple=8).prepare(trainer.sampler.copy())
    for src, tgt_in, tgt_out in prepared.micro:
        assert src.size(1) % 8 == 0 and tgt_in.size(1) % 8 == 0 and tgt_in.shape == tgt_out.shape
    assert prepared.counts.tokens == sum(int(t.ne(0).sum()) for _, _, t in prepared.micro)  # real tokens only
    assert prepared.global_tokens == prepared.counts.tokens  # one process: the step's count is its own


@pytest.mark.slow
@pytest.mark.parametrize("shapes", ["exact", "buckets"])
def test_compiled_training_equals_eager_and_compiles_once_for_all_lengths(encoded, vocab_dir, tmp_path, shapes):
    """Without dropout (compiled dropout draws other random numbers than eager) the two train alike;
    with it, compiling still makes one training graph for every batch shape, and the masks apply."""
    from torch._dynamo.utils import counters

    from stages.batching import collate
    from stages.encode import ParallelIds
    from transformer.model import Transformer

    history, models, graphs, compiling = {}, {}, {}, {}
    runs = [(False, 0.0), (True, 0.0)] + ([(True, TINY.dropout)] if shapes == "buckets" else [("layers", 0.0)])
    for compiled, dropout in runs:
        config = dataclasses.replace(TINY, dropout=dropout)
        torch._dynamo.reset()
        counters.clear()
        out, logged = tmp_path / f"{compiled}-{dropout}", []
        metrics = train.run(config, train_params(max_steps=8, compile=compiled, shapes=shapes, log_every=1,
                                                 validate_every=100),
                            encoded_dir=encoded[0], vocab_dir=vocab_dir, checkpoint_dir=out,
                            plots_dir=tmp_path / "plots",
                            log=lambda values, step: logged.append((step, values.get("compile_seconds"))))
        graphs[compiled, dropout] = counters["stats"]["unique_graphs"]
        compiling[compiled, dropout] = ([(step, seconds > 0) for step, seconds in logged if seconds is not None],
                                        metrics.get("compile_seconds", 0) > 0)
        checkpoint = read_checkpoint(current_dir(out) / "checkpoint-00000008.pt")
        history[compiled, dropout] = [r["loss"] for r in checkpoint.parts["progress"]["history"]]
        models[compiled, dropout] = Transformer(config, checkpoint.meta.vocab_size, 0).eval()
        models[compiled, dropout].load_state_dict(checkpoint.parts["model"])
    # training and validation (eval mode) at the end: not one graph per batch shape, and not none; layer by
    # layer, a graph for each kind of layer and for the loss, each trained and evaluated
    assert graphs == {run: {False: 0, True: 2, "layers": 6}[run[0]] for run in runs}
    # the time compiling is logged where a graph compiled (the first step's, then the eval graph's at step 8),
    # and is in the run's figures
    assert compiling == {run: ([(1, True), (8, True)], True) if run[0] else ([], False) for run in runs}
    if ("layers", 0.0) in history:
        assert history["layers", 0.0] == pytest.approx(history[False, 0.0], rel=1e-4)
    trainer = _trainer(encoded[0], vocab_dir, shapes=shapes)
    seen = {tuple(x.shape for x in trainer.inputs.prepare(trainer.sampler).micro[0]) for _ in range(8)}
    assert len(seen) >= 3  # the steps' batches came in several shapes
    assert history[True, 0.0] == pytest.approx(history[False, 0.0], rel=1e-4)
    if (True, TINY.dropout) in history:  # dropout is applied in the compiled step: other losses, still learning
        assert history[True, TINY.dropout] != pytest.approx(history[True, 0.0], rel=1e-3)
        assert history[True, TINY.dropout][-1] < history[True, TINY.dropout][0]
    # Weights are compared by what they compute: key biases get no gradient (softmax ignores a constant
    # added to every key's logit), so Adam turns each run's rounding noise there into full-size steps.
    src, tgt_in, _ = collate(ParallelIds(encoded[0], "dev"), np.arange(16))
    with torch.no_grad():
        torch.testing.assert_close(models[True, 0.0](src, tgt_in), models[False, 0.0](src, tgt_in), rtol=1e-3,
                                   atol=1e-3)


# -- bounded shapes, and the logits' precision ----------------------------------------------------

def test_an_epoch_of_bucketed_steps_takes_few_shapes_and_every_pair_once(encoded, vocab_dir):
    """Over an epoch of the shared WMT14 sample: at most 16 step shapes (what a replayed CUDA graph
    needs), against a new shape nearly every step when each batch is padded to its longest pair."""
    shapes = {}
    for kind in ("exact", "buckets"):
        trainer = _trainer(encoded[0], vocab_dir, shapes=kind, micro_batches=2)
        seen, pairs, tokens = set(), [], 0
        for _ in range(len(trainer.sampler) // 2):
            batches = [next(trainer.sampler) for _ in range(2)]
            for batch in batches:
                tensors = trainer.inputs.collate(batch)
                seen.add(tuple(x.shape for x in tensors))
                tokens += int(tensors[2].ne(0).sum())
                pairs.extend(batch.tolist())
        corpus = trainer.inputs.corpus
        assert sorted(pairs) == list(range(len(corpus)))  # every pair once: nothing lost to the shapes
        assert tokens == int(corpus.tgt_lengths.sum()) + len(corpus)  # every target token (and EOS) counted
        shapes[kind] = seen
        trainer.close()
    assert len(shapes["buckets"]) <= 16 and len(shapes["exact"]) > 4 * len(shapes["buckets"])


def test_a_batch_padded_to_its_bucket_gives_the_same_loss_and_gradients(encoded, vocab_dir):
    from stages.batching import bucket_shape, collate
    from stages.encode import ParallelIds

    torch.manual_seed(0)
    corpus = ParallelIds(encoded[0], "dev")
    model = train.Transformer(dataclasses.replace(TINY, dropout=0.0), 1000, 0)
    batch = np.arange(10, 30)
    longest = int(max(corpus.src_lengths[batch].max(), corpus.tgt_lengths[batch].max())) + 1
    results = []
    for shape in (None, bucket_shape(longest, 4000)):
        tensors = collate(corpus, batch, shape=shape)
        loss, nll = train.forward_loss(model, *tensors, 0.1)
        model.zero_grad()
        loss.backward()
        results.append((loss.detach(), nll.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, nll_a, grads_a), (loss_b, nll_b, grads_b) = results
    assert tensors[0].shape[0] > len(batch)  # rows of padding were added
    torch.testing.assert_close(loss_a, loss_b)
    torch.testing.assert_close(nll_a, nll_b)
    scale = max(float(g.abs().max()) for g in grads_a)  # fp32 sums over more rows: rounding of the largest's order
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)


def test_under_bf16_the_loss_reads_the_logits_in_bf16(encoded, vocab_dir, monkeypatch):
    """Accelerate's prepare would wrap the model to return fp32 (a full copy of the logits)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # one precision a process: this test's, then the others' again

    seen, loss = [], train.label_smoothed_nll_loss
    monkeypatch.setattr(train, "label_smoothed_nll_loss",
                        lambda logits, *a: (seen.append(logits.dtype), loss(logits, *a))[1])
    try:
        trainer = train.Trainer(TINY, train_params(precision="bf16"), encoded_dir=encoded[0], vocab_dir=vocab_dir,
                                accelerator=Accelerator(cpu=True, mixed_precision="bf16"))
        trainer.train_step()
        trainer.close()
    finally:
        AcceleratorState._reset_state(True)
    assert seen == [torch.bfloat16]


def test_cuda_graphs_need_a_gpu_compile_and_buckets(encoded, vocab_dir):
    with pytest.raises(ValueError, match=r"needs train.compile true \(or auto\) and train.shapes buckets"):
        train_params(cuda_graphs=True, compile=True, shapes="exact")
    with pytest.raises(ValueError, match=r"needs train.compile true \(or auto\)"):
        train_params(cuda_graphs=True, compile="loss", shapes="buckets")
    with pytest.raises(ValueError, match="a captured step is compiled whole"):
        train.Compiled(train.forward_loss, captured=True, part="loss")
    if default_device().type == "cpu":
        with pytest.raises(PipelineError, match="train.cuda_graphs replays the step on a GPU, and this process "
                                                "trains on cpu: set it to false"):
            _trainer(encoded[0], vocab_dir, cuda_graphs=True, compile=True, shapes="buckets")


def test_compiled_layers_leave_the_weights_and_are_undone_to_run_as_written():
    from transformer.model import Transformer

    model = Transformer(TINY, 100, 0)
    layers, names = [*model.encoder, *model.decoder], list(model.state_dict())
    step = train.Compiled(train.forward_loss, part="layers", model=model)
    assert step.layers == layers and all("forward" in vars(layer) for layer in layers)
    assert list(model.state_dict()) == names  # checkpoints and averaging read the same names
    assert step.undo() is train.forward_loss
    assert not any("forward" in vars(layer) for layer in layers) and step.layers == []
    for part, model_given in (("layers", None), ("loss", model), ("step", model)):
        with pytest.raises(ValueError, match="the model is given where its layers are compiled, and only there"):
            train.Compiled(train.forward_loss, part=part, model=model_given)
    with pytest.raises(ValueError, match="a captured step is compiled whole"):
        train.Compiled(train.forward_loss, captured=True, part="layers", model=model)


def test_a_captured_step_has_a_graph_for_each_batch_shape_past_torchs_default_limit():
    """Captured, a step compiles one static graph a shape (a CUDA graph replays fixed shapes): bucketed
    batches bring up to 16, which must not fall back to eager after torch's default of 8."""
    from torch._dynamo.utils import counters

    def forward_loss(model, src, tgt_in, tgt_out, epsilon):
        return model(src.float()).sum(), tgt_out.sum()

    torch._dynamo.reset()
    counters.clear()
    step, model = train.Compiled(forward_loss, captured=True), torch.nn.Linear(4, 2)
    for rows in range(1, 11):
        x = torch.ones(rows, 4)
        loss, _ = step(model, x, x, x, 0.1)
        assert float(loss.detach()) == pytest.approx(float(model(x).detach().sum()))
    assert counters["stats"]["unique_graphs"] == 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs replay on a GPU")
def test_captured_steps_update_with_the_eager_steps_gradients(encoded, vocab_dir):
    """Three steps of two micro-batches each, in bf16: a replay that overwrote the gradient an earlier
    one left (or the first micro-batch's, kept as .grad) would give twice one micro-batch's."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from torch._dynamo.utils import counters

    grads = {}
    counters.clear()
    for captured in (False, True):
        AcceleratorState._reset_state(True)
        trainer = _trainer(encoded[0], vocab_dir, Accelerator(mixed_precision="bf16"), micro_batches=2,
                           shapes="buckets", compile=captured, cuda_graphs=captured)
        grads[captured] = _gradients(trainer, steps=3)
    AcceleratorState._reset_state(True)
    assert isinstance(trainer.forward_loss, train.Compiled)  # it did not fall back to eager
    assert counters["inductor"]["cudagraph_skips"] == 0  # and replayed CUDA graphs, never skipped them
    for eager, replayed in zip(grads[False], grads[True], strict=True):
        scale = max(float(g.abs().max()) for g in eager)
        for a, b in zip(eager, replayed, strict=True):
            torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2 * scale)


TRAINED = """
from pipeline import stage
assert stage.main(["train", *sys.argv[1:]]) == 0
"""


def test_training_on_cpus_keeps_freed_blocks_of_any_size_for_the_next_step(encoded, vocab_dir, tmp_path):
    """After the train stage's command has run a step on the CPU, a freed 64 MB block (a step's logits
    and their gradient are such blocks) stays in glibc's heap for the next step instead of going back
    to the OS (devices.keep_freed_host_memory), as it does by default and under decoding's setting."""
    params = train_params_file(tmp_path, **{"train.max_steps": 1})
    flags = train_command(params, encoded[0], vocab_dir, tmp_path)[3:]  # after `-m pipeline.stage train`
    decoding = "from translate import cpu; cpu.keep_freed_memory()"
    kept = {how: freed_bytes_kept(prepare, 64, *flags) for how, prepare in
            (("default", ""), ("decoding's", decoding), ("trained", TRAINED))}
    assert kept["default"] < 64 << 20 and kept["decoding's"] < 64 << 20 <= kept["trained"], kept
