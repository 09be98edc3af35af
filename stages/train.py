"""Stage 5, train: the Transformer on the encoded corpus with Accelerate (one CPU to many GPUs).

The paper's recipe: Adam (0.9, 0.98, 1e-9), warm-up then inverse-square-root learning rate, label
smoothing 0.1, ~25k source + 25k target tokens per optimizer step. The step's loss is summed over
its target tokens and divided by their count across all micro-batches and processes, so the result
does not depend on how the step is split. Precision, parallelism and checkpoints live here, not in
the model. A checkpoint holds everything a resumed run needs to continue exactly as if never stopped.
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast, gather_object, set_seed
from tqdm import tqdm

from stages import vocab
from stages.batching import BatchSampler, collate, token_batches
from stages.encode import ParallelIds
from stages.io import PipelineError, atomic_write, require_dir
from transformer import Transformer, TransformerConfig, inverse_sqrt_rate, label_smoothed_nll_loss
from transformer.model import training_flops

CHECKPOINT_FORMAT = "transformer-pipeline/checkpoint/1"
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)\.pt$")
MetricsLogger = Callable[[dict[str, float], int], None]


@dataclass(frozen=True)
class TrainParams:
    max_steps: int
    batch_tokens: int  # per side per optimizer step, over all processes and accumulation steps
    grad_accum: int  # micro-batches per optimizer step on each process
    warmup_steps: int
    adam_betas: tuple[float, float]
    adam_eps: float
    label_smoothing: float
    clip_norm: float  # 0: no clipping, as the paper
    precision: Literal["auto", "fp32", "bf16", "fp16"]  # auto: bf16 on GPUs that have it, else fp32
    compile: bool  # torch.compile the model
    seed: int
    log_every: int  # steps
    validate_every: int  # steps
    checkpoint_every_steps: int  # 0: by time only
    checkpoint_every_minutes: float  # 0: by steps only
    keep_checkpoints: int


# Train parameters that may change between a run and its resumption: they do not alter the updates.
RESUMABLE_CHANGES = {"max_steps", "log_every", "validate_every", "checkpoint_every_steps",
                     "checkpoint_every_minutes", "keep_checkpoints", "compile"}


def checkpoints(checkpoint_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first, ordered by step number (never by file name)."""
    found = []
    for p in Path(checkpoint_dir).glob("checkpoint-*.pt"):
        if m := CHECKPOINT_NAME.match(p.name):
            found.append((int(m.group(1)), p))
    return sorted(found)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load one of our checkpoints without running any pickled code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle means: not a checkpoint of ours
        raise PipelineError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise PipelineError(f"{path}: not a checkpoint written by this pipeline's train stage")
    return state


def _digest(*paths: Path) -> str:
    h = hashlib.md5()
    for p in paths:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


# Dense bf16/fp16 tensor-core peaks (vendor datasheets, FLOP/s), for model FLOPs utilisation.
PEAK_FLOPS = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
              "A10G": 125e12, "L4": 121e12, "V100": 125e12}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The accelerator's peak for the precision trained in, or None (CPUs, fp32, unknown GPUs)."""
    if device.type != "cuda" or precision not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


def _precision(choice: str) -> str:
    if choice == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    return {"fp32": "no"}.get(choice, choice)


class Trainer:
    """One training run: the model, its optimizer and schedule, and the stream of batches."""

    def __init__(self, model_config: TransformerConfig, params: TrainParams, *, encoded_dir: Path,
                 vocab_dir: Path, accelerator: Accelerator) -> None:
        self.params, self.acc = params, accelerator
        set_seed(params.seed)
        world, accum = accelerator.num_processes, params.grad_accum
        self.micro_tokens = params.batch_tokens // (world * accum)
        self.corpus = ParallelIds(encoded_dir, "train")
        self.dev = ParallelIds(encoded_dir, "dev")
        if len(self.corpus) == 0:
            raise PipelineError(f"{encoded_dir}: the training set is empty")
        batches, self.dropped = token_batches(self.corpus.src_lengths, self.corpus.tgt_lengths,
                                              self.micro_tokens, params.seed)
        if not batches:
            raise PipelineError(f"every training pair is longer than the batch budget of {self.micro_tokens} "
                                f"tokens per micro-batch (train.batch_tokens / processes / grad_accum)")
        self.sampler = BatchSampler(batches, params.seed, world, accelerator.process_index)
        dev_batches, _ = token_batches(self.dev.src_lengths, self.dev.tgt_lengths, self.micro_tokens, None)
        self.dev_batches = dev_batches[accelerator.process_index :: world]

        sp = vocab.load(vocab_dir)
        model = Transformer(model_config, sp.get_piece_size(), vocab.PAD_ID)
        self.n_parameters = sum(p.numel() for p in model.parameters())
        self.flops = lambda src_lengths, tgt_lengths: training_flops(model_config, model.vocab_size,
                                                                     src_lengths, tgt_lengths)
        self.peak = peak_flops(accelerator.device, accelerator.mixed_precision)
        self.total_flops = self.total_seconds = 0.0  # over the whole run, resumptions included
        optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=params.adam_betas, eps=params.adam_eps,
                                     fused=True)
        # LambdaLR scales lr=1.0 by the paper's rate; its counter is the number of steps taken so far.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda done: inverse_sqrt_rate(done + 1, model_config.d_model, params.warmup_steps))
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.valid_history: list[dict[str, float]] = []
        self.fingerprint = {
            "model": asdict(model_config),
            "train": {k: v for k, v in asdict(params).items() if k not in RESUMABLE_CHANGES},
            "vocab": _digest(Path(vocab_dir) / vocab.MODEL_FILE),
            "data": _digest(*sorted(Path(encoded_dir).glob("train.*.npy"))),
            "world_size": world,
        }

    # -- one optimizer step ---------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        acc, p = self.acc, self.params
        self.model.train()
        micro = [collate(self.corpus, next(self.sampler)) for _ in range(p.grad_accum)]
        local_tokens = sum(int(t.ne(vocab.PAD_ID).sum()) for _, _, t in micro)
        local_src_tokens = sum(int(s.ne(vocab.PAD_ID).sum()) for s, _, _ in micro)
        # what batching costs: padded slots per side, and the real tokens of the side that binds the budget
        padded = {"src_slots": sum(s.numel() for s, _, _ in micro), "tgt_slots": sum(t.numel() for _, _, t in micro),
                  "binding": sum(max(int(s.ne(vocab.PAD_ID).sum()), int(t.ne(vocab.PAD_ID).sum())) for s, _, t in micro)}
        flops = sum(self.flops(s.ne(vocab.PAD_ID).sum(1), t.ne(vocab.PAD_ID).sum(1)) for s, _, t in micro)
        global_tokens = float(acc.reduce(torch.tensor(local_tokens, device=acc.device), "sum"))
        loss_sum = nll_sum = 0.0
        for i, (src, tgt_in, tgt_out) in enumerate(micro):
            src, tgt_in, tgt_out = (x.to(acc.device) for x in (src, tgt_in, tgt_out))
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else acc.no_sync(self.model), acc.autocast():
                logits = self.model(src, tgt_in)
                loss, nll = label_smoothed_nll_loss(logits, tgt_out, p.label_smoothing, vocab.PAD_ID)
                # Gradients are averaged over processes; scale so the step's gradient is the sum over
                # all its target tokens divided by their global count.
                acc.backward(loss * acc.num_processes / global_tokens)
            loss_sum += loss.item()
            nll_sum += nll.item()
        if not math.isfinite(loss_sum):
            raise PipelineError(f"non-finite loss ({loss_sum}) at step {self.step + 1} on process "
                                f"{acc.process_index}; stopped before the optimizer step")
        grad_norm = acc.clip_grad_norm_(self.model.parameters(), p.clip_norm if p.clip_norm > 0 else math.inf)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss_sum": loss_sum, "nll_sum": nll_sum, "tokens": local_tokens, "src_tokens": local_src_tokens,
                "grad_norm": float(grad_norm), "lr": lr, "flops": flops, **padded}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        self.model.eval()
        sums = torch.zeros(3, device=self.acc.device)
        for indices in self.dev_batches:
            src, tgt_in, tgt_out = (x.to(self.acc.device) for x in collate(self.dev, indices))
            with self.acc.autocast():
                loss, nll = label_smoothed_nll_loss(self.model(src, tgt_in), tgt_out,
                                                    self.params.label_smoothing, vocab.PAD_ID)
            sums += torch.stack([loss.float(), nll.float(), tgt_out.ne(vocab.PAD_ID).sum().float()])
        loss, nll, tokens = self.acc.reduce(sums, "sum").tolist()
        tokens = max(tokens, 1.0)
        return {"valid_loss": loss / tokens, "valid_nll": nll / tokens, "valid_ppl": math.exp(nll / tokens)}

    # -- checkpoints ----------------------------------------------------------------------------
    def state(self) -> dict[str, Any] | None:
        """The full training state, gathered on the main process (None elsewhere)."""
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        rngs = gather_object([rng])  # one per process, in rank order
        if not self.acc.is_main_process:
            return None
        scaler = self.acc.scaler.state_dict() if self.acc.scaler is not None else None
        return {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "model": self.acc.unwrap_model(self.model).state_dict(),
            "model_config": asdict(self.acc.unwrap_model(self.model).config),
            "vocab_size": self.acc.unwrap_model(self.model).vocab_size,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": scaler,
            "sampler": self.sampler.state_dict(),
            "rng": rngs,
            "total_flops": self.total_flops,
            "total_seconds": self.total_seconds,
            "history": self.history,
            "valid_history": self.valid_history,
            "fingerprint": self.fingerprint,
        }

    def save(self, checkpoint_dir: Path) -> None:
        state = self.state()
        if state is not None:
            with atomic_write(checkpoint_dir / f"checkpoint-{self.step:08d}.pt", "wb") as f:
                torch.save(state, f)
            for _, old in checkpoints(checkpoint_dir)[: -self.params.keep_checkpoints]:
                old.unlink()
        self.acc.wait_for_everyone()

    def resume(self, checkpoint_dir: Path) -> None:
        state = path = None
        for _, path in reversed(checkpoints(checkpoint_dir)):
            try:
                state = load_checkpoint(path)
                break
            except PipelineError as e:  # e.g. a disk that filled up: fall back to the one before
                self.acc.print(f"warning: skipping {e}")
        if state is None:
            return
        if state["fingerprint"] != self.fingerprint:
            changed = _differences(state["fingerprint"], self.fingerprint)
            raise PipelineError(
                f"{checkpoint_dir} holds a different training run ({', '.join(changed)} changed), so it cannot be "
                f"resumed; move or delete that directory to start afresh")
        self.acc.unwrap_model(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.acc.scaler is not None and state["scaler"] is not None:
            self.acc.scaler.load_state_dict(state["scaler"])
        self.sampler.load_state_dict(state["sampler"])
        rng = state["rng"][self.acc.process_index]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        self.step = int(state["step"])
        self.total_flops, self.total_seconds = float(state["total_flops"]), float(state["total_seconds"])
        self.history, self.valid_history = list(state["history"]), list(state["valid_history"])
        self.acc.print(f"resumed from {path} at step {self.step}")


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


def _write_csv(path: Path, rows: list[dict[str, float]]) -> None:
    with atomic_write(path) as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def run(model_config: TransformerConfig, params: TrainParams, *, encoded_dir: str | Path, vocab_dir: str | Path,
        checkpoint_dir: str | Path, plots_dir: str | Path, log: MetricsLogger | None = None,
        accelerator: Accelerator | None = None) -> dict[str, float]:
    """Train to `params.max_steps`, resuming from the newest checkpoint in `checkpoint_dir` if any.
    Writes checkpoints there and the loss curves <plots_dir>/train.csv and valid.csv."""
    encoded_dir = require_dir(encoded_dir, "encoded data (encode stage output)")
    checkpoint_dir, plots_dir = Path(checkpoint_dir), Path(plots_dir)
    acc = accelerator or Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=_precision(params.precision),
                                     dynamo_backend="inductor" if params.compile else "no")
    trainer = Trainer(model_config, params, encoded_dir=encoded_dir, vocab_dir=Path(vocab_dir), accelerator=acc)
    trainer.resume(checkpoint_dir)
    main = acc.is_main_process
    log = log if (log is not None and main) else (lambda metrics, step: None)
    log({"parameters": trainer.n_parameters, "dropped_over_budget": trainer.dropped}, 0)
    acc.print(f"model: {trainer.n_parameters / 1e6:.1f}M parameters; {len(trainer.sampler)} batches per epoch "
              f"per process; {trainer.dropped} pairs over the batch budget dropped")

    bar = tqdm(total=params.max_steps, initial=trainer.step, desc="train", unit=" steps", disable=not main,
               mininterval=2)
    summed = ("loss_sum", "nll_sum", "tokens", "src_tokens", "src_slots", "tgt_slots", "binding", "flops")
    window = dict.fromkeys((*summed, "time", "steps"), 0.0)
    last_save = time.monotonic()
    while trainer.step < params.max_steps:
        t0 = time.perf_counter()
        out = trainer.train_step()
        window["time"] += time.perf_counter() - t0
        window["steps"] += 1
        for k in summed:
            window[k] += out[k]
        bar.update(1)
        step = trainer.step
        if step % params.log_every == 0 or step == params.max_steps:
            sums = acc.reduce(torch.tensor([window[k] for k in summed], device=acc.device, dtype=torch.float64), "sum")
            loss_sum, nll_sum, tokens, src_tokens, src_slots, tgt_slots, binding, flops = sums.tolist()
            trainer.total_flops += flops
            trainer.total_seconds += window["time"]
            micro_batches = window["steps"] * params.grad_accum * acc.num_processes
            row = {"step": step, "loss": loss_sum / tokens, "nll": nll_sum / tokens,
                   "ppl": math.exp(min(nll_sum / tokens, 50.0)), "lr": out["lr"], "grad_norm": out["grad_norm"],
                   "tgt_tokens_per_step": tokens / window["steps"],
                   "tgt_tokens_per_sec": tokens / max(window["time"], 1e-9),
                   "src_tokens_per_sec": src_tokens / max(window["time"], 1e-9),
                   "src_padding": 1 - src_tokens / src_slots, "tgt_padding": 1 - tokens / tgt_slots,
                   "batch_fill": binding / (micro_batches * trainer.micro_tokens),
                   "tflops": flops / max(window["time"], 1e-9) / 1e12, "train_flops": trainer.total_flops}
            if trainer.peak:  # model FLOPs utilisation of all the processes' accelerators
                row["mfu"] = flops / max(window["time"], 1e-9) / (trainer.peak * acc.num_processes)
            trainer.history.append(row)
            log({k: v for k, v in row.items() if k != "step"}, step)
            bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{row['lr']:.2e}", tok_s=f"{row['tgt_tokens_per_sec']:.0f}")
            window = dict.fromkeys(window, 0.0)
        if step % params.validate_every == 0 or step == params.max_steps:
            valid = trainer.validate()
            trainer.valid_history.append({"step": step, **valid})
            log(valid, step)
        due = (params.checkpoint_every_steps > 0 and step % params.checkpoint_every_steps == 0) or step == params.max_steps
        if params.checkpoint_every_minutes > 0:
            late = time.monotonic() - last_save >= 60 * params.checkpoint_every_minutes
            due = due or bool(broadcast(torch.tensor([late], device=acc.device)).item())  # the main process decides
        if due:
            trainer.save(checkpoint_dir)
            last_save = time.monotonic()
    bar.close()
    if not checkpoints(checkpoint_dir):
        trainer.save(checkpoint_dir)  # max_steps 0 or already reached: still leave a model behind
    if main:
        _write_csv(plots_dir / "train.csv", trainer.history)
        _write_csv(plots_dir / "valid.csv", trainer.valid_history)
    acc.wait_for_everyone()
    final = trainer.history[-1] if trainer.history else {}
    valid = {k: v for k, v in (trainer.valid_history[-1] if trainer.valid_history else {}).items() if k != "step"}
    mean = lambda key: float(np.mean([r[key] for r in trainer.history if key in r] or [float("nan")]))  # noqa: E731
    out = {"steps": trainer.step, "parameters": trainer.n_parameters,
           "loss": final.get("loss", float("nan")), "nll": final.get("nll", float("nan")),
           "tgt_tokens_per_sec": mean("tgt_tokens_per_sec"), "tflops": mean("tflops"),
           "train_flops": trainer.total_flops, "train_hours": trainer.total_seconds / 3600,
           "accelerator_hours": trainer.total_seconds / 3600 * acc.num_processes, **valid}
    if trainer.peak:
        out["mfu"] = mean("mfu")
    return out
