"""Stage 5, train: the Transformer on the encoded corpus with Accelerate (one CPU to many GPUs).

The paper's recipe: Adam (0.9, 0.98, 1e-9), warm-up then inverse-square-root learning rate, label
smoothing 0.1, ~25k source + 25k target tokens per optimizer step. The step's loss is summed over
its target tokens and divided by their count across all micro-batches and processes, so the result
does not depend on how the step is split. Precision, parallelism and checkpoints live here, not in
the model. A checkpoint holds every named part of the training state, so a resumed run continues
exactly as if never stopped.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from tqdm import tqdm

from stages import vocab
from stages.batching import collate, token_batches
from stages.devices import default_device, mixed_precision, peak_flops, use_fast_attention
from stages.encode import ParallelIds
from stages.io import InputPath, OutputPath, PipelineError, Stopped, check, require_dir
from stages.model_files import Checkpoint, ModelMeta, checkpoint_path, list_checkpoints, make_current, \
    prune_checkpoints, read_checkpoint, read_model, remove_unfinished, setup_dir, write_checkpoint
from stages.train_inputs import StepInputs, StepStream, training_sampler, within_positions
from stages.train_metrics import MetricsWindow, Progress, progress_line, summary, write_curves
from stages.train_state import CheckpointSchedule, Stateful, StopRequest, Topology, UnwrappedModel, differences, \
    micro_batch_seed
from transformer import Transformer, TransformerConfig, inverse_sqrt_rate, label_smoothed_nll_loss

MetricsLogger = Callable[[dict[str, float], int], None]


@dataclass(frozen=True)
class TrainParams:
    max_steps: int
    batch_tokens: int  # per side per optimizer step, over all processes and accumulation steps
    grad_accum: int  # micro-batches per optimizer step on each process
    warmup_steps: int
    lr_scale: float  # times the paper's rate; 1: the paper. Smaller batches want less: see params.yaml
    adam_betas: tuple[float, float]
    adam_eps: float
    label_smoothing: float
    clip_norm: float  # 0: no clipping, as the paper
    precision: Literal["auto", "fp32", "bf16", "fp16"]  # auto: bf16 on GPUs that have it, else fp32
    compile: bool  # torch.compile the model, for dynamic shapes: one graph whatever the batch's lengths
    seed: int
    log_every: int  # steps
    validate_every: int  # steps
    checkpoint_every_steps: int  # the checkpoints averaging takes (and the last step's); 0: the last one only
    checkpoint_every_minutes: float  # snapshots for crash safety, never averaged; 0: none
    keep_checkpoints: int  # of the step-spaced checkpoints; snapshots are kept only until the next save

    def __post_init__(self) -> None:
        for key in ("batch_tokens", "grad_accum", "warmup_steps", "log_every", "validate_every", "keep_checkpoints"):
            check(getattr(self, key) >= 1, key, f"must be at least 1, not {getattr(self, key)}")
        for key in ("max_steps", "seed", "checkpoint_every_steps", "checkpoint_every_minutes", "clip_norm"):
            check(getattr(self, key) >= 0, key, f"must be 0 or more, not {getattr(self, key)}")
        check(all(0 <= b < 1 for b in self.adam_betas), "adam_betas", f"must be in [0, 1), not {self.adam_betas}")
        check(self.adam_eps > 0, "adam_eps", f"must be positive, not {self.adam_eps}")
        check(self.lr_scale > 0, "lr_scale", f"must be positive, not {self.lr_scale}")
        check(0 <= self.label_smoothing < 1, "label_smoothing", f"must be in [0, 1), not {self.label_smoothing}")


# Train parameters that may change between a run and its resumption: they do not alter the updates.
# grad_accum may change with the number of processes, their product (micro-batches a step) kept.
RESUMABLE_CHANGES = {"max_steps", "log_every", "validate_every", "checkpoint_every_steps",
                     "checkpoint_every_minutes", "keep_checkpoints", "compile", "grad_accum"}
PER_STEP = "micro_batches_per_step"  # processes x grad_accum: a resumption must keep it


def _digest(*paths: Path) -> str:
    h = hashlib.md5()
    for p in paths:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


class Trainer:
    """One training run: the model, its optimizer and schedule, and the stream of batches."""

    def __init__(self, model_config: TransformerConfig, params: TrainParams, *, encoded_dir: Path,
                 vocab_dir: Path, accelerator: Accelerator, init_weights: Path | None = None) -> None:
        self.params, self.acc = params, accelerator
        set_seed(params.seed)
        world, rank = accelerator.num_processes, accelerator.process_index
        corpus, self.dev = ParallelIds(encoded_dir, "train"), ParallelIds(encoded_dir, "dev")
        if len(corpus) == 0:
            raise PipelineError(f"{encoded_dir}: the training set is empty")
        self.sampler, self.micro_tokens, self.dropped = training_sampler(
            corpus, params.batch_tokens, params.grad_accum, params.seed, world, rank, model_config.max_positions)
        dev_batches, _ = token_batches(self.dev.src_lengths, self.dev.tgt_lengths, self.micro_tokens, None,
                                       within_positions(self.dev, model_config.max_positions))
        self.dev_batches = dev_batches[rank::world]

        model = Transformer(model_config, vocab.load(vocab_dir).get_piece_size(), vocab.PAD_ID)
        if init_weights is not None:
            _start_from(model, init_weights)
        self.n_parameters = sum(p.numel() for p in model.parameters())
        self.meta = ModelMeta(model_config, model.vocab_size, steps=())
        on_gpu = accelerator.device.type == "cuda"
        if on_gpu:
            use_fast_attention()
        self.inputs = StepInputs(corpus, model_config, model.vocab_size, params.grad_accum, rank,
                                 pad_multiple=8 if on_gpu else 1, pin=on_gpu)
        self.stream: StepStream | None = None  # started at the first step, after any resume
        self.peak = peak_flops(accelerator.device, accelerator.mixed_precision)
        optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=params.adam_betas, eps=params.adam_eps,
                                     fused=True)
        # LambdaLR scales lr=1.0 by lr_scale times the paper's rate; its counter is the number of steps taken so far.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: params.lr_scale * inverse_sqrt_rate(
            done + 1, model_config.d_model, params.warmup_steps))
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        if params.compile:  # after DDP wraps it, as torch recommends; lengths vary every step: dynamic shapes
            self.model = torch.compile(self.model, dynamic=True)
        self.progress = Progress()
        self.fingerprint = {
            "model": asdict(model_config),
            "train": {k: v for k, v in asdict(params).items() if k not in RESUMABLE_CHANGES},
            "vocab": _digest(Path(vocab_dir) / vocab.MODEL_FILE),
            "data": _digest(*sorted(Path(encoded_dir).glob("train.*.npy"))),
            **({"init": _digest(init_weights)} if init_weights is not None else {}),
            PER_STEP: world * params.grad_accum,
        }

    @property
    def setup(self) -> dict[str, Any]:
        """What names this run's checkpoint folder: the fingerprint but the micro-batches a step, a
        change of which is refused on resumption rather than started afresh."""
        return {k: v for k, v in self.fingerprint.items() if k != PER_STEP}

    @property
    def parts(self) -> dict[str, Stateful]:
        """The training state a checkpoint holds, by name; the RNGs last, after all that draws on them."""
        return {"model": UnwrappedModel(self.acc, self.model), "optimizer": self.optimizer,
                "scheduler": self.scheduler, "sampler": self.sampler, "progress": self.progress,
                **({"scaler": self.acc.scaler} if self.acc.scaler is not None else {}),
                "topology": Topology(self.acc.num_processes, self.params.grad_accum, self.acc.print)}

    def close(self) -> None:
        """Stop preparing batches ahead."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    # -- one optimizer step ---------------------------------------------------------------------
    def train_step(self, stop: int = 0, late: bool = False) -> dict[str, Any]:
        """One optimizer step. Nothing waits on the device but the step's one agreement: whether the
        loss is finite (checked before the update), and whether this process was asked to stop
        (`stop`, a signal number) or its clock says a snapshot is due (`late`); every process learns
        every process's flags, so all stop, or save, at the same step. Loss sums stay device tensors;
        token counts come from the host."""
        acc, p = self.acc, self.params
        self.model.train()
        if self.stream is None:
            self.stream = StepStream(self.inputs, self.sampler)
        prepared, waited = self.stream.next()
        # Gradients are averaged over processes; scale so the step's gradient is the sum over all its
        # target tokens divided by their global count.
        scale = acc.num_processes / prepared.global_tokens
        loss_sum = nll_sum = torch.zeros((), device=acc.device)
        for i, batch in enumerate(prepared.micro):
            src, tgt_in, tgt_out = (x.to(acc.device, non_blocking=True) for x in batch)
            last = i == len(prepared.micro) - 1
            torch.manual_seed(micro_batch_seed(p.seed, self.progress.step, i * acc.num_processes + acc.process_index))
            with contextlib.nullcontext() if last else acc.no_sync(self.model), acc.autocast():
                logits = self.model(src, tgt_in)
                loss, nll = label_smoothed_nll_loss(logits, tgt_out, p.label_smoothing, vocab.PAD_ID)
                acc.backward(loss * scale)
            loss_sum, nll_sum = loss_sum + loss.detach(), nll_sum + nll.detach()
        nonfinite, stop, late = self._agree(loss_sum, stop, late)
        if nonfinite:
            value = float(loss_sum) if acc.process_index in nonfinite else "on another process"
            raise PipelineError(f"non-finite loss ({value}) at step {self.progress.step + 1} on process "
                                f"{', '.join(map(str, nonfinite))}; stopped before the optimizer step")
        grad_norm = acc.clip_grad_norm_(self.model.parameters(), p.clip_norm if p.clip_norm > 0 else math.inf)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        return {"loss_sum": loss_sum, "nll_sum": nll_sum, "grad_norm": grad_norm, "lr": lr, "data_wait": waited,
                "stop": stop, "late": late, **prepared.report}

    def _agree(self, loss_sum: torch.Tensor, stop: int, late: bool) -> tuple[list[int], int, bool]:
        """(processes whose loss is not finite, the signal any process was stopped by, any process
        late), from one reduction read back to the host: the step's one wait on the device."""
        acc = self.acc
        local = torch.stack([torch.isfinite(loss_sum).logical_not().float(), loss_sum.new_full((), float(stop)),
                             loss_sum.new_full((), float(late))])  # filled on the device: no copy, no wait
        table = loss_sum.new_zeros(acc.num_processes, 3)
        table[acc.process_index] = local
        if acc.num_processes > 1:
            table = acc.reduce(table, "sum")
        rows = table.tolist()
        nonfinite = [r for r, row in enumerate(rows) if row[0]]
        return nonfinite, max(int(row[1]) for row in rows), any(row[2] for row in rows)

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
    def save(self, checkpoint_dir: Path, snapshot: bool = False) -> None:
        """A checkpoint (averaged later), or a snapshot (crash safety only); every process calls it."""
        parts = {name: part.state_dict() for name, part in self.parts.items()}
        if self.acc.is_main_process:
            step = self.progress.step
            meta = ModelMeta(self.meta.config, self.meta.vocab_size, (step,))
            write_checkpoint(checkpoint_dir, Checkpoint(step, meta, self.fingerprint, parts), snapshot)
            prune_checkpoints(checkpoint_dir, self.params.keep_checkpoints)
        self.acc.wait_for_everyone()

    def resume(self, checkpoint_dir: Path) -> None:
        """Continue from the newest checkpoint or snapshot that loads, if it is of this run. A file that
        is truncated or damaged is skipped, with a warning, for the one before it. Every process must
        find the same one: on several nodes the folder is one that all of them read."""
        self.close()  # a stream started before this would read from the old position
        for _, path in reversed(list_checkpoints(checkpoint_dir, snapshots=True)):
            try:
                checkpoint = read_checkpoint(path)
            except PipelineError as e:  # e.g. cut short by a full disk
                self.acc.print(f"warning: skipping {e}")
                continue
            try:
                self._check(checkpoint, checkpoint_dir, path)
            except Damaged as e:
                self.acc.print(f"warning: skipping {path}: {e}")
                continue
            for name, part in self.parts.items():
                part.load_state_dict(checkpoint.parts[name])
            self.acc.print(f"resumed from {path} at step {self.progress.step}")
            break
        steps = gather_object([self.progress.step])
        if len(set(steps)) > 1:
            raise PipelineError(f"the processes found different checkpoints in {checkpoint_dir} (steps {steps}, by "
                                f"process): on several nodes it must be one folder all read, on a shared filesystem")

    def _check(self, checkpoint: Checkpoint, checkpoint_dir: Path, path: Path) -> None:
        """Refuse another run's checkpoint; find damage before anything is loaded."""
        if checkpoint.fingerprint != self.fingerprint:
            changed = differences(checkpoint.fingerprint, self.fingerprint)
            if changed == [PER_STEP]:  # another split of the step, of another product
                try:
                    refusal = self.parts["topology"].refusal(checkpoint.parts.get("topology"))
                except ValueError as e:
                    raise Damaged(str(e)) from None
                raise PipelineError(f"{checkpoint_dir} holds a run of {refusal}")
            raise PipelineError(
                f"{checkpoint_dir} holds a run of this setup with {', '.join(changed)} changed, which cannot be "
                f"resumed so; move or delete that directory to start afresh")
        if checkpoint.parts.keys() != self.parts.keys():
            raise PipelineError(f"{path}: holds the parts {sorted(checkpoint.parts)}, "
                                f"this run has {sorted(self.parts)}")
        for name, part in self.parts.items():
            try:
                getattr(part, "validate", lambda state: None)(checkpoint.parts[name])
            except ValueError as e:
                raise Damaged(str(e)) from None


def _start_from(model: Transformer, path: Path) -> None:
    """Load a trained model's weights into `model` (fine-tuning, or one corpus after another); its dropout may
    differ, not its shape: a model with other weights or shapes is refused, naming the first."""
    weights, _ = read_model(path)
    ours = model.state_dict()
    for name in sorted(ours.keys() | weights.keys()):
        theirs = tuple(weights[name].shape) if name in weights else "missing"
        mine = tuple(ours[name].shape) if name in ours else "missing"
        if theirs != mine:
            raise PipelineError(f"{path}: cannot start this run: its weight {name} is {theirs}, this model's {mine}")
    model.load_state_dict(weights)


class Damaged(Exception):
    """A checkpoint part that would not load."""


def run(model_config: TransformerConfig, params: TrainParams, *, encoded_dir: InputPath, vocab_dir: InputPath,
        checkpoint_dir: OutputPath, plots_dir: OutputPath, log: MetricsLogger | None = None,
        accelerator: Accelerator | None = None, init_weights: str | Path | None = None) -> dict[str, float]:
    """Train to `params.max_steps`, in this setup's folder of `checkpoint_dir` (resuming from its newest
    checkpoint, if any), from random weights or from those of `init_weights` (a model or checkpoint of the same
    shape and vocabulary size). Writes checkpoints there and the loss curves <plots_dir>/train.csv and valid.csv."""
    encoded_dir = require_dir(encoded_dir, "encoded data (encode stage output)")
    acc = accelerator or Accelerator(cpu=default_device().type == "cpu",
                                     mixed_precision=mixed_precision(params.precision))
    trainer = Trainer(model_config, params, encoded_dir=encoded_dir, vocab_dir=Path(vocab_dir), accelerator=acc,
                      init_weights=None if init_weights is None else Path(init_weights))
    # this setup's folder: a run of another setup keeps its own, and going back to it goes on there
    checkpoint_dir = setup_dir(checkpoint_dir, trainer.setup)
    if acc.is_main_process:
        make_current(checkpoint_dir.parent, checkpoint_dir, trainer.setup)
        for stale in remove_unfinished(checkpoint_dir):
            acc.print(f"removed {stale}, left by a save that was cut short")
    acc.print(f"checkpoints of this setup: {checkpoint_dir}")
    acc.wait_for_everyone()
    trainer.resume(checkpoint_dir)
    log = log if (log is not None and acc.is_main_process) else (lambda metrics, step: None)
    log({"parameters": trainer.n_parameters, **{f"dropped_{k}": v for k, v in trainer.dropped.items()}}, 0)
    acc.print(f"model: {trainer.n_parameters / 1e6:.1f}M parameters; {len(trainer.sampler)} batches per epoch "
              f"per process; training pairs dropped: {trainer.dropped['over_positions']} longer than "
              f"model.max_positions, {trainer.dropped['over_budget']} alone over a micro-batch's budget")
    with StopRequest() as request:
        try:
            _loop(trainer, checkpoint_dir, log, request)
        finally:
            trainer.close()
            if acc.is_main_process:
                write_curves(plots_dir, trainer.progress)  # stopped or failed too: the curves so far
    if not list_checkpoints(checkpoint_dir):
        trainer.save(checkpoint_dir)  # max_steps 0 or already reached: still leave a model behind
    acc.wait_for_everyone()
    return {**summary(trainer.progress, trainer.n_parameters, acc.num_processes, trainer.peak),
            **{f"dropped_{k}": v for k, v in trainer.dropped.items()}}


def _loop(trainer: Trainer, checkpoint_dir: Path, log: MetricsLogger, request: StopRequest) -> None:
    """Step to max_steps: log a row every log_every steps, validate, save when due; when asked to
    stop, finish the step, save it and raise Stopped."""
    acc, params, progress = trainer.acc, trainer.params, trainer.progress
    window = MetricsWindow(trainer.micro_tokens, params.grad_accum, acc.num_processes, trainer.peak)
    saves = CheckpointSchedule(params, acc.is_main_process)
    bar = tqdm(total=params.max_steps, initial=progress.step, desc="train", unit=" steps",
               disable=not acc.is_main_process, mininterval=2)
    while progress.step < params.max_steps:
        start = time.perf_counter()
        out = trainer.train_step(stop=request.signum, late=saves.late())
        window.add(out, time.perf_counter() - start)
        bar.update(1)
        step, stopping = progress.step, out["stop"]
        if step % params.log_every == 0 or step == params.max_steps or stopping:
            row, flops, seconds = window.close(step, out, lambda t: acc.reduce(t.to(acc.device), "sum").cpu())
            progress.record(row, flops, seconds)
            log({k: v for k, v in progress.history[-1].items() if k != "step"}, step)
            if acc.is_main_process:
                tqdm.write(progress_line(row, params.max_steps))
            bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{row['lr']:.2e}", tok_s=f"{row['tgt_tokens_per_sec']:.0f}")
        if (step % params.validate_every == 0 or step == params.max_steps) and not stopping:
            valid = trainer.validate()
            progress.valid_history.append({"step": step, **valid})
            log(valid, step)
        if kind := saves.due(step, out["late"]) or ("snapshot" if stopping else None):
            trainer.save(checkpoint_dir, snapshot=kind == "snapshot")
            saves.saved()
        if stopping:
            bar.close()
            saved = checkpoint_path(checkpoint_dir, step, snapshot=kind == "snapshot")
            raise Stopped(f"stopped by {signal.Signals(stopping).name} after step {step}, saved in {saved}; "
                          f"run the stage again to go on from there")
    bar.close()
