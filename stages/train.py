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
import dataclasses
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import extract_model_from_parallel, gather_object

from stages import vocab
from stages.batching import token_batches
from stages.checkpoint import Checkpointer, Processes, Schedule, Stateful, recorded_split, setup_dir
from stages.devices import attention_kernels, default_device, keep_freed_host_memory, keep_generated_kernels, \
    mixed_precision, out_of_memory_stops, peak_flops, processes
from stages.encode import ParallelIds, check_encoded_with
from stages.io import InputPath, OutputPath, PipelineError, Stopped, file_digest, require_dir
from stages.model_files import ModelMeta, list_checkpoints, load_weights, read_model
from stages.params import TrainParams
from stages.progress import Bar
from stages.train_compile import Compiled, LossFunction, compile_seconds, persistent_gradients
from stages.train_cpu import for_eager_cpu, runs_eager_on_cpu
from stages.train_inputs import PreparedStep, StepInputs, StepStream, training_sampler, within_positions
from stages.train_metrics import MetricsWindow, Progress, StepMetrics, progress_line, summary, write_curves
from stages.train_state import Agreed, Agreement, ModelState, OptimizerState, ScalerState, SchedulerState, \
    StopRequest, Topology, micro_batch_seed
from transformer.config import TransformerConfig
from transformer.loss import label_smoothed_nll_loss
from transformer.model import Transformer
from transformer.schedule import inverse_sqrt_rate, linear_decay_rate

MetricsLogger = Callable[[dict[str, float], int], None]
T = TypeVar("T")


# Train parameters that may change between a run and its resumption: they do not alter the updates.
# The processes may change, the micro-batches a step kept (the checkpoints' topology checks it).
RESUMABLE_CHANGES = {"max_steps", "log_every", "validate_every", "checkpoint_every_steps",
                     "checkpoint_every_minutes", "keep_checkpoints", "compile", "cuda_graphs", "processes",
                     "micro_batches"}


def run_identity(model_config: TransformerConfig, params: TrainParams, encoded_dir: Path, vocab_dir: Path,
                 init_weights: Path | None, checkpoint_dir: str | Path | None = None) -> dict[str, Any]:
    """What identifies a run: what it trains (model, data, vocabulary, starting weights) and how (the
    training parameters that alter the updates); a change starts a run of its own. A run goes on to a
    larger max_steps; where this setup's run in `checkpoint_dir` is already past max_steps, which it cannot
    be taken back to (its checkpoints before are pruned, and averaging takes its newest), the shorter run is
    one of its own, named by its max_steps too."""
    # a schedule that ends at max_steps makes max_steps alter every update
    resumable = RESUMABLE_CHANGES - ({"max_steps"} if params.schedule == "linear_decay" else set())
    identity = {"model": asdict(model_config),
                "train": {k: v for k, v in asdict(params).items() if k not in resumable},
                "vocab": vocab.identity(vocab_dir),
                "data": file_digest(*sorted(Path(encoded_dir).glob("train.*.npy"))),
                **({"init": file_digest(init_weights)} if init_weights is not None else {})}
    if checkpoint_dir is not None and "max_steps" not in identity["train"]:
        found = list_checkpoints(setup_dir(checkpoint_dir, identity), snapshots=True)
        if found and found[-1][0] > params.max_steps:
            identity["train"]["max_steps"] = params.max_steps
    return identity


def micro_batches(setting: int | str, processes: int, recorded: int | None = None) -> int:
    """train.micro_batches as a number for `processes`: auto is the run's own when it resumes
    (`recorded`), else one a process. Refused, before any work, where the processes cannot share it."""
    n = setting if isinstance(setting, int) else (recorded or processes)
    if n % processes:
        fix = (f"train.micro_batches to a multiple of {processes}" if isinstance(setting, int) or recorded is None
               else "train.micro_batches to another number to start a run of its own")
        owner = "train.micro_batches is" if isinstance(setting, int) else "the run to resume takes"
        raise PipelineError(f"{owner} {n} micro-batches a step, which {processes} processes cannot share: set "
                            f"train.processes to a divisor of {n}, or {fix}")
    return n


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: its figures, and what every process agreed (read one step late, or at
    this step where the loop settled it)."""

    metrics: StepMetrics
    stop: int  # the signal any process was asked to stop by; 0: none
    snapshot_due: bool  # the main process's clock says a snapshot is due


def forward_loss(model: torch.nn.Module, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor,
                 epsilon: float, loss: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's summed (smoothed loss, nll): the model and its loss in one function, which
    train.compile compiles as one graph (the logits never leave it in another precision). `loss`:
    label_smoothed_nll_loss, or that compiled (train.compile loss)."""
    return (loss or label_smoothed_nll_loss)(model(src, tgt_in), tgt_out, epsilon, vocab.PAD_ID)


class Trainer:
    """One training run: the model, its optimizer and schedule, and the stream of batches. Its progress
    (step, cost, curves) is a checkpoint part of its own: the Trainer is Stateful. Its step runs
    forward_loss as written; compile_step compiles it from outside."""

    def __init__(self, model_config: TransformerConfig, params: TrainParams, *, encoded_dir: Path,
                 vocab_dir: Path, accelerator: Accelerator, init_weights: Path | None = None,
                 split: int | None = None, identity: dict[str, Any] | None = None) -> None:
        """`split`: the micro-batches a step (train.micro_batches resolved; by default as for a new run);
        `identity`: run_identity's, if already known."""
        params = params.resolved(gpu=accelerator.device.type == "cuda")
        self.params, self.acc = params, accelerator
        world, rank = accelerator.num_processes, accelerator.process_index
        self.grad_accum = (split or micro_batches(params.micro_batches, world)) // world
        corpus, self.dev = ParallelIds(encoded_dir, "train"), ParallelIds(encoded_dir, "dev")
        if len(corpus) == 0:
            raise PipelineError(f"{encoded_dir}: the training set is empty")
        bucketed = params.shapes == "buckets"
        self.sampler, self.micro_tokens, self.dropped = training_sampler(
            corpus, params.batch_tokens, self.grad_accum, params.seed, world, rank, model_config.max_positions,
            bucketed)
        dev_batches, _ = token_batches(self.dev.src_lengths, self.dev.tgt_lengths, self.micro_tokens, None,
                                       within_positions(self.dev, model_config.max_positions), bucketed)
        self.dev_batches = dev_batches[rank::world]

        with torch.random.fork_rng(devices=[]):  # the seed makes the weights; the process's generator is left as it was
            torch.manual_seed(params.seed)
            pieces = vocab.load(vocab_dir)
            model = Transformer(model_config, pieces.get_piece_size(), vocab.PAD_ID)
        self.meta = ModelMeta(model_config, model.vocab_size, steps=(), vocab=vocab.identity(pieces))
        if init_weights is not None:
            _start_from(model, init_weights, self.meta.vocab)
        self.n_parameters = sum(p.numel() for p in model.parameters())
        on_gpu = accelerator.device.type == "cuda"
        if runs_eager_on_cpu(accelerator.device, params.compile):  # train_cpu.py says why
            for_eager_cpu(model, bf16=accelerator.mixed_precision == "bf16")
        self.inputs = StepInputs(corpus, model_config, model.vocab_size, self.grad_accum, rank,
                                 pad_multiple=8 if on_gpu else 1, pin=on_gpu,
                                 bucket_budget=self.micro_tokens if bucketed else None)
        self.stream: StepStream | None = None  # started at the first step, after any resume
        self.peak = peak_flops(accelerator.device, accelerator.mixed_precision)
        optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=params.adam_betas, eps=params.adam_eps,
                                     fused=True)
        # LambdaLR scales lr=1.0 by lr_scale times the schedule's rate; its counter is the number of steps taken so far.
        self.rate = lambda done: params.lr_scale * (
            inverse_sqrt_rate(done + 1, model_config.d_model, params.warmup_steps) if params.schedule == "inverse_sqrt"
            else linear_decay_rate(done + 1, model_config.d_model, params.warmup_steps, params.max_steps))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.rate)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        # Under mixed precision, prepare wraps the model's forward to cast its outputs to fp32: a full fp32
        # copy of the logits and of their gradient. The step runs under acc.autocast() and its loss reads
        # the logits in their own precision, so the wrapper goes.
        extract_model_from_parallel(self.model, keep_fp32_wrapper=False)
        self.forward_loss: LossFunction = forward_loss
        self._compile_start = compile_seconds()
        self.agreement = Agreement(accelerator.device, world, rank, lambda t: accelerator.reduce(t, "sum"))
        self._previous = Agreed(0, {}, 0, False)  # the latest agreement read
        self.progress = Progress()
        self.identity = identity or run_identity(model_config, params, encoded_dir, vocab_dir, init_weights)

    @property
    def parts(self) -> dict[str, Stateful]:
        """The training state a checkpoint holds, by name; the step's split first, which the sampler's
        place depends on."""
        acc = self.acc
        return {"topology": Topology(acc.num_processes, self.grad_accum, acc.print),
                "model": ModelState(lambda: acc.unwrap_model(self.model)),
                "optimizer": OptimizerState(self.optimizer), "scheduler": SchedulerState(self.scheduler),
                "sampler": self.sampler, "progress": self,
                **({"scaler": ScalerState(acc.scaler)} if acc.scaler is not None else {})}

    def state_dict(self) -> dict[str, Any]:
        return self.progress.state_dict()

    def check(self, state: Any, step: int) -> None:
        self.progress.check(state, step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()  # a stream started before this would read from the old place
        self.progress.load_state_dict(state)

    def close(self) -> None:
        """Stop preparing batches ahead."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    # -- one optimizer step ---------------------------------------------------------------------
    def train_step(self, stop: int = 0, late: bool = False) -> StepResult:
        """One optimizer step, which never waits on the device. What every process must learn of
        every other (a loss not finite, `stop`: a signal that asked this one to stop, `late`: its clock
        says a snapshot is due) is reduced on the device and read one step late (Agreement): the result
        carries the previous step's, and a previous step whose loss was not finite raises here, its
        update having been skipped on the device. Loss sums stay device tensors; token counts come
        from the host."""
        acc, p = self.acc, self.params
        self.model.train()
        if self.stream is None:
            self.stream = StepStream(self.inputs, self.sampler)
        prepared, waited = self.stream.next()
        loss_sum, nll_sum = self._or_eager(lambda: self._accumulate(prepared))
        self._check(self.agreement.receive())  # the previous step's: copied to the host long ago
        found_inf = self.agreement.send(self.progress.step + 1, loss_sum, stop, late)
        grad_norm = acc.clip_grad_norm_(self.model.parameters(), p.clip_norm if p.clip_norm > 0 else math.inf)
        if acc.scaler is None:  # fp16's scaler skips steps with non-finite gradients itself
            self.optimizer.optimizer.found_inf = found_inf  # fused Adam skips the update where it is 1
        lr = self.rate(self.progress.step)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=False)  # in place: gradients persist (train_compile.py says why)
        self.progress.step += 1
        metrics = StepMetrics(loss_sum=loss_sum, nll_sum=nll_sum, lr=lr, grad_norm=grad_norm, data_wait=waited,
                              **asdict(prepared.counts))
        return StepResult(metrics, self._previous.stop, self._previous.late)

    @property
    def compiling(self) -> float:
        """Seconds this run has spent compiling its step and capturing it."""
        return compile_seconds() - self._compile_start

    def _accumulate(self, prepared: PreparedStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's gradient, summed over its micro-batches into the parameters' gradients, and its
        summed (smoothed loss, nll) as device tensors."""
        acc, p = self.acc, self.params
        # Gradients are averaged over processes; scale so the step's gradient is the sum over all its
        # target tokens divided by their global count.
        scale = acc.num_processes / prepared.global_tokens
        loss_sum = nll_sum = torch.zeros((), device=acc.device)
        for i, batch in enumerate(prepared.micro):
            src, tgt_in, tgt_out = (x.to(acc.device, non_blocking=True) for x in batch)
            last = i == len(prepared.micro) - 1
            # Seeded outside the compiled step: a CUDA graph reads the generator's seed and offset
            # when it is replayed, so each micro-batch draws its own masks, captured or not.
            torch.manual_seed(micro_batch_seed(p.seed, self.progress.step, i * acc.num_processes + acc.process_index))
            if p.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with (contextlib.nullcontext() if last else acc.no_sync(self.model), acc.autocast(),
                  attention_kernels(acc.device, acc.mixed_precision)):
                loss, nll = self.forward_loss(self.model, src, tgt_in, tgt_out, p.label_smoothing)
                acc.backward(loss * scale)
            loss_sum, nll_sum = loss_sum + loss.detach(), nll_sum + nll.detach()
        return loss_sum, nll_sum

    def _or_eager(self, work: Callable[[], T]) -> T:
        """`work`, done again as written where compiling its step failed: one warning, never a lost run."""
        try:
            return work()
        except torch._dynamo.exc.TorchDynamoException as error:
            if not isinstance(self.forward_loss, Compiled):
                raise
            cause = getattr(error, "inner_exception", None) or error  # what the compiler raised
            reason = f"{type(cause).__name__}: {next(iter(str(cause).splitlines()), '')}"
            print(f"warning: the {self.forward_loss} step failed to compile ({reason}); training goes on "
                  f"eager", file=sys.stderr, flush=True)
            self.forward_loss = self.forward_loss.undo()
            self.optimizer.zero_grad(set_to_none=False)  # what the failed try had added
            return work()

    def settle(self) -> Agreed:
        """The last step's agreement now, waiting for it: before a checkpoint is saved and where the run
        ends, so that no saved or finished run hides a loss that was not finite."""
        return self._check(self.agreement.receive())

    def _check(self, agreed: Agreed | None) -> Agreed:
        """`agreed`, kept as the latest known; PipelineError if any process's loss was not finite."""
        agreed = agreed or Agreed(self.progress.step, {}, 0, False)
        if agreed.nonfinite:
            me = self.acc.process_index
            value = agreed.nonfinite.get(me, "on another process")
            raise PipelineError(f"non-finite loss ({value}) at step {agreed.step} on process "
                                f"{', '.join(map(str, agreed.nonfinite))}; its update was skipped and training "
                                f"stopped there")
        self._previous = agreed
        return agreed

    def validate(self) -> dict[str, float]:
        self.model.eval()
        loss, nll, tokens = self.acc.reduce(self._or_eager(self._dev_sums), "sum").tolist()
        tokens = max(tokens, 1.0)
        return {"valid_loss": loss / tokens, "valid_nll": nll / tokens, "valid_ppl": math.exp(nll / tokens)}

    @torch.no_grad()
    def _dev_sums(self) -> torch.Tensor:
        """This process's share of the dev set: summed (smoothed loss, nll, target tokens)."""
        sums = torch.zeros(3, device=self.acc.device)
        dev = dataclasses.replace(self.inputs, corpus=self.dev)
        for indices in self.dev_batches:
            src, tgt_in, tgt_out = (x.to(self.acc.device, non_blocking=True) for x in dev.collate(indices))
            if self.params.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with self.acc.autocast(), attention_kernels(self.acc.device, self.acc.mixed_precision):
                loss, nll = self.forward_loss(self.model, src, tgt_in, tgt_out, self.params.label_smoothing)
            sums += torch.stack([loss.float(), nll.float(), tgt_out.ne(vocab.PAD_ID).sum().float()])
        return sums


def compile_step(trainer: Trainer) -> None:
    """Compile the trainer's step as train.compile and train.cuda_graphs ask (after Accelerate's prepare
    has wrapped the model for its processes, as torch recommends)."""
    p, device = trainer.params, trainer.acc.device
    if p.cuda_graphs and device.type != "cuda":
        raise PipelineError(f"train.cuda_graphs replays the step on a GPU, and this process trains on {device}: "
                            f"set it to false")
    if p.compile and not isinstance(trainer.forward_loss, Compiled):
        if p.cuda_graphs:
            persistent_gradients(list(trainer.model.parameters()))
        part = p.compile if isinstance(p.compile, str) else "step"
        trainer.forward_loss = Compiled(trainer.forward_loss, captured=p.cuda_graphs, part=part,
                                        model=trainer.acc.unwrap_model(trainer.model) if part == "layers" else None)


def _start_from(model: Transformer, path: Path, vocabulary: str) -> None:
    """Load a trained model's weights into `model` (fine-tuning, or one corpus after another); its dropout may
    differ, not its shape, nor its vocabulary (`vocabulary`'s identity: another's ids are other pieces)."""
    weights, meta = read_model(path)
    if meta.vocab not in ("", vocabulary):  # "": a file from before models kept it
        raise PipelineError(f"{path}: cannot start this run: it was trained on another vocabulary than this "
                            f"run's, whose ids are other pieces")
    load_weights(model, weights, path, "cannot start this run")


def _split(params: TrainParams, processes: int, identity: dict[str, Any], checkpoint_dir: str | Path) -> int:
    return micro_batches(params.micro_batches, processes, recorded_split(setup_dir(checkpoint_dir, identity)))


def workers(model_config: TransformerConfig, params: TrainParams, *, encoded_dir: InputPath, vocab_dir: InputPath,
            checkpoint_dir: OutputPath, **paths: Any) -> int:
    """The processes the stage's command trains on (train.processes), each a worker the command starts;
    where they cannot share the run's micro-batches, or the data is not the vocabulary's, refused before any starts."""
    n = processes(params.processes)
    if n > 1:
        check_encoded_with(encoded_dir, vocab_dir)
        identity = run_identity(model_config, params, Path(encoded_dir), Path(vocab_dir), None, checkpoint_dir)
        _split(params, n, identity, checkpoint_dir)
    return n


def checkpointer(trainer: Trainer, checkpoint_dir: str | Path) -> Checkpointer:
    """The run's checkpoints, in its setup's folder of `checkpoint_dir`: a run of another setup keeps
    its own, and going back to it goes on there."""
    p, acc = trainer.params, trainer.acc
    return Checkpointer(
        checkpoint_dir, trainer.identity, acc.num_processes * trainer.grad_accum, trainer.parts,
        Schedule(p.checkpoint_every_steps, p.checkpoint_every_minutes, p.keep_checkpoints, p.max_steps), trainer.meta,
        Processes(acc.is_main_process, acc.print, acc.wait_for_everyone, lambda value: gather_object([value])))


def run(model_config: TransformerConfig, params: TrainParams, *, encoded_dir: InputPath, vocab_dir: InputPath,
        checkpoint_dir: OutputPath, plots_dir: OutputPath, log: MetricsLogger | None = None,
        accelerator: Accelerator | None = None, init_weights: str | Path | None = None) -> dict[str, float]:
    """Train to `params.max_steps`, in this setup's folder of `checkpoint_dir` (resuming from its newest
    checkpoint, if any), from random weights or from those of `init_weights` (a model or checkpoint of the same
    shape and vocabulary). Writes checkpoints there and the loss curves <plots_dir>/train.csv and valid.csv."""
    encoded_dir = require_dir(encoded_dir, "encoded data (encode stage output)")
    check_encoded_with(encoded_dir, vocab_dir)
    if default_device().type == "cpu":
        keep_generated_kernels()  # before anything else generates one
    acc = accelerator or Accelerator(cpu=default_device().type == "cpu",
                                     mixed_precision=mixed_precision(params.precision))
    if acc.device.type == "cpu":
        keep_freed_host_memory()
    init = None if init_weights is None else Path(init_weights)
    identity = run_identity(model_config, params, encoded_dir, Path(vocab_dir), init, checkpoint_dir)
    if "max_steps" in identity["train"] and params.schedule != "linear_decay":
        longer = setup_dir(checkpoint_dir, {**identity, "train": {k: v for k, v in identity["train"].items()
                                                                  if k != "max_steps"}})
        acc.print(f"{longer} holds this setup's run, past train.max_steps {params.max_steps}: a run of "
                  f"{params.max_steps} steps trains in a folder of its own", flush=True)
    split = _split(params, acc.num_processes, identity, checkpoint_dir)
    precision = {"no": "fp32"}.get(acc.mixed_precision, acc.mixed_precision)
    print(f"process {acc.process_index} of {acc.num_processes} on {acc.device} in {precision}: "
          f"{split // acc.num_processes} of the step's {split} micro-batches", flush=True)
    trainer = Trainer(model_config, params, encoded_dir=encoded_dir, vocab_dir=Path(vocab_dir), accelerator=acc,
                      init_weights=init, split=split, identity=identity)
    compile_step(trainer)
    checkpoints = checkpointer(trainer, checkpoint_dir)
    checkpoints.start()
    log = log if (log is not None and acc.is_main_process) else (lambda metrics, step: None)
    log({"parameters": trainer.n_parameters, **{f"dropped_{k}": v for k, v in trainer.dropped.items()}}, 0)
    acc.print(f"model: {trainer.n_parameters / 1e6:.1f}M parameters; {len(trainer.sampler)} batches per epoch "
              f"per process; training pairs dropped: {trainer.dropped['over_positions']} longer than "
              f"model.max_positions, {trainer.dropped['over_budget']} alone over a micro-batch's budget; "
              f"the step is {trainer.forward_loss if isinstance(trainer.forward_loss, Compiled) else 'eager'}")
    with StopRequest() as request, out_of_memory_stops(acc.device, lambda: f"step {trainer.progress.step + 1}",
                                                       lambda: _smaller_micro_batches(trainer, checkpoints)):
        try:
            _loop(trainer, checkpoints, log, request)
        finally:
            trainer.close()
            if acc.is_main_process:
                write_curves(plots_dir, trainer.progress)  # stopped or failed too: the curves so far
    if not checkpoints.has_checkpoint():
        checkpoints.save(trainer.progress.step)  # max_steps 0 or already reached: still leave a model behind
    acc.wait_for_everyone()
    return {**summary(trainer.progress, trainer.n_parameters, acc.num_processes, trainer.peak),
            **{f"dropped_{k}": v for k, v in trainer.dropped.items()},
            **({"compile_seconds": trainer.compiling} if trainer.compiling else {})}


def _smaller_micro_batches(trainer: Trainer, checkpoints: Checkpointer) -> str:
    """What asks a step for less memory at a time: more micro-batches, of the same tokens a step."""
    split = trainer.acc.num_processes * trainer.grad_accum
    fix = (f"each process takes {trainer.micro_tokens} target tokens at a time, a step's {trainer.params.batch_tokens} "
           f"in {split} micro-batch{'es' if split > 1 else ''}; -S train.micro_batches={2 * split} takes half as many "
           f"at a time, the same tokens a step")
    return fix + (f" (this run's checkpoints keep its {split}: move {checkpoints.folder} aside to start a run with "
                  f"{2 * split})" if checkpoints.has_checkpoint() else "")


def _loop(trainer: Trainer, checkpoints: Checkpointer, log: MetricsLogger, request: StopRequest) -> None:
    """Step to max_steps: log a row every log_every steps, validate, save when due; when asked to
    stop, finish the step, save it and raise Stopped. Each step learns the step before's agreement;
    where it saves or ends, it waits for its own."""
    acc, params, progress = trainer.acc, trainer.params, trainer.progress
    window = MetricsWindow(trainer.micro_tokens, trainer.grad_accum, acc.num_processes, trainer.peak)
    reported = 0.0  # seconds compiling, as last logged

    def report_compiling(step: int) -> None:
        """Log the time compiling where a graph was compiled (or captured): once, or once a shape."""
        nonlocal reported
        if (total := trainer.compiling) > reported:
            log({"compile_seconds": total}, step)
            if acc.is_main_process:
                Bar.write(f"step {step}: compiled in {total - reported:.1f} s ({total:.1f} s in all)")
            reported = total

    with Bar(total=params.max_steps, initial=progress.step, desc="train", unit=" steps",
             disable=not acc.is_main_process, mininterval=2) as bar:  # closed before any error is said
        while progress.step < params.max_steps:
            start = time.perf_counter()
            out = trainer.train_step(stop=request.signum, late=checkpoints.late())
            window.add(out.metrics, time.perf_counter() - start)
            bar.update(1)
            step = progress.step
            report_compiling(step)
            if step == params.max_steps or out.stop or checkpoints.due(step, out.snapshot_due):
                agreed = trainer.settle()  # this step's own agreement, before saving or ending
                out = dataclasses.replace(out, stop=out.stop or agreed.stop,
                                          snapshot_due=out.snapshot_due or agreed.late)
            if step % params.log_every == 0 or step == params.max_steps or out.stop:
                row, flops, seconds = window.close(step, out.metrics,
                                                   lambda t: acc.reduce(t.to(acc.device), "sum").cpu())
                progress.record(row, flops, seconds)
                log({k: v for k, v in progress.history[-1].items() if k != "step"}, step)
                if acc.is_main_process:
                    Bar.write(progress_line(row, params.max_steps))
                bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{row['lr']:.2e}",
                                tok_s=f"{row['tgt_tokens_per_sec']:.0f}")
            if (step % params.validate_every == 0 or step == params.max_steps) and not out.stop:
                with out_of_memory_stops(acc.device, lambda: f"the validation after step {step}",
                                         lambda: _smaller_micro_batches(trainer, checkpoints)):
                    valid = trainer.validate()  # dev batches of the training's micro-batch budget
                progress.valid_history.append({"step": step, **valid})
                log(valid, step)
                report_compiling(step)
            if kind := checkpoints.due(step, out.snapshot_due) or ("snapshot" if out.stop else None):
                saved = checkpoints.save(step, snapshot=kind == "snapshot")
            if out.stop:
                raise Stopped(f"stopped by {signal.Signals(out.stop).name} after step {step}, saved in {saved}; "
                              f"run the stage again to go on from there")
