"""The files a model lives in, and their one reader and writer.

- A checkpoint (`<dir>/checkpoint-<step>.pt`, written by the train stage) holds everything a resumed
  run needs: the training state's named parts (model weights, optimizer, schedule, sampler,
  progress, ...), the fingerprint of the run that wrote it, and the model's metadata. Checkpoints
  are written every `train.checkpoint_every_steps` steps and at the end, and they are what the
  average stage averages; a snapshot (`<dir>/snapshot-<step>.pt`), the same content written on
  a clock for crash safety, is only ever resumed from, and each save removes the snapshots before it.
- A model (`.safetensors`, written by the average stage) holds weights and metadata only: what
  decoding and export read. Either kind of file can be read as a model.

Checkpoints live in a folder per training setup (`<checkpoint dir>/<setup>/`, named by the train
stage's checkpoint component, stages/checkpoint.py, after what a run may not change), with the
setup written out in its `setup.json`; `<checkpoint dir>/current.json` names the setup last trained,
the one the average stage reads.

Both carry a `ModelMeta`, so a file alone rebuilds its Transformer. Loading runs no pickled code
(torch's weights-only unpickler; safetensors), and every write is atomic: a checkpoint is complete
once it has its final name, so the list of checkpoints is the list of files named as one.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from stages.io import PipelineError, atomic_write, read_json, write_json
from transformer.attention import with_stacked_projections
from transformer.config import TransformerConfig

# Format 3: attention's projections stacked (q, k and v in one weight, transformer/attention.py), as the
# optimizer's moments are too; an averaged model (.safetensors) of separate projections still loads.
_FORMATS = "transformer-pipeline/checkpoint/"
CHECKPOINT_FORMAT = _FORMATS + "3"
_FILE_NAME = re.compile(r"^(checkpoint|snapshot)-(\d+)\.pt$")
_UNFINISHED = re.compile(r"^\.(checkpoint|snapshot)-\d+\.pt\..+\.tmp$")  # atomic_write's, cut short
Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelMeta:
    """What a file says of its model besides the weights."""

    config: TransformerConfig
    vocab_size: int
    steps: tuple[int, ...]  # the training steps whose weights these are: one, or those averaged
    vocab: str = ""  # the vocabulary it was trained on (vocab.identity); "" in files from before it was kept

    def to_dict(self) -> dict[str, Any]:
        return {"model_config": dataclasses.asdict(self.config), "vocab_size": self.vocab_size,
                "steps": list(self.steps), "vocab": self.vocab}

    @classmethod
    def from_dict(cls, data: Any, source: str | Path) -> ModelMeta:
        try:
            return cls(TransformerConfig(**data["model_config"]), int(data["vocab_size"]),
                       tuple(int(s) for s in data["steps"]), str(data.get("vocab", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise PipelineError(f"{source}: its model metadata is incomplete or invalid ({e!r})") from None


@dataclass(frozen=True)
class Checkpoint:
    step: int
    meta: ModelMeta
    fingerprint: dict[str, Any]  # what identifies the training run (train stage): a resume must match it
    parts: dict[str, Any]  # each named part of the training state; "model" holds the weights


# -- checkpoints ----------------------------------------------------------------------------------

CURRENT = "current.json"


def make_current(root: str | Path, folder: Path, setup: dict[str, Any]) -> None:
    """Record `folder` as the setup being trained, and what that setup is (its setup.json, which the
    checkpoint component reads back with `read_setup`)."""
    write_json(folder / "setup.json", setup)
    write_json(Path(root) / CURRENT, {"setup": folder.name})


def read_setup(folder: Path) -> dict[str, Any] | None:
    """A setup folder's setup.json, if it has one."""
    path = folder / "setup.json"
    return read_json(path) if path.is_file() else None


def current_dir(root: str | Path) -> Path:
    """The checkpoint folder of the setup the train stage trained last."""
    path = Path(root) / CURRENT
    if not path.is_file():
        raise PipelineError(f"{path}: not found: no training run has started in {root} (has the train stage run?)")
    return Path(root) / read_json(path)["setup"]


def checkpoint_path(directory: str | Path, step: int, snapshot: bool = False) -> Path:
    return Path(directory) / f"{'snapshot' if snapshot else 'checkpoint'}-{step:08d}.pt"


def list_checkpoints(directory: str | Path, snapshots: bool = False) -> list[tuple[int, Path]]:
    """Complete checkpoints (with `snapshots`, snapshots too: what a resumption may start from),
    oldest first, ordered by step number (never by file name)."""
    found = []
    for p in Path(directory).glob("*-*.pt"):
        if (m := _FILE_NAME.match(p.name)) and (snapshots or m.group(1) == "checkpoint"):
            found.append((int(m.group(2)), p))
    return sorted(found)


def write_checkpoint(directory: str | Path, checkpoint: Checkpoint, snapshot: bool = False) -> Path:
    path = checkpoint_path(directory, checkpoint.step, snapshot)
    state = {"format": CHECKPOINT_FORMAT, "step": checkpoint.step, "meta": checkpoint.meta.to_dict(),
             "fingerprint": checkpoint.fingerprint, "parts": checkpoint.parts}
    with atomic_write(path, "wb") as f:
        torch.save(state, f)
    return path


def remove_unfinished(directory: str | Path) -> list[Path]:
    """Delete the temporary files of saves that a kill cut short (atomic_write's `.<name>.*.tmp`);
    called before a run writes anything, when no save of the directory can be in progress."""
    stale = [p for p in Path(directory).glob(".*.tmp") if _UNFINISHED.match(p.name)]
    for p in stale:
        p.unlink()
    return stale


def read_checkpoint(path: str | Path, mapped: bool = False) -> Checkpoint:
    """One of our checkpoints, loaded without running any pickled code. `mapped`: its tensors mapped from
    the file, read from disk only where touched (averaging and decoding read the model of checkpoints
    whose optimizer state is twice its size)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle means: not a checkpoint of ours
        raise PipelineError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e})") from None
    found = state.get("format") if isinstance(state, dict) else None
    if isinstance(found, str) and found.startswith(_FORMATS) and found != CHECKPOINT_FORMAT:
        raise PipelineError(f"{path}: a checkpoint of format {found}, from another version of the train stage; "
                            f"this one resumes and averages {CHECKPOINT_FORMAT}: finish that run with the code "
                            f"that wrote it")
    if found != CHECKPOINT_FORMAT:
        raise PipelineError(f"{path}: not a checkpoint written by this pipeline's train stage "
                            f"(format {CHECKPOINT_FORMAT})")
    try:
        step, fingerprint, parts = int(state["step"]), dict(state["fingerprint"]), dict(state["parts"])
    except (KeyError, TypeError, ValueError) as e:
        raise PipelineError(f"{path}: not a readable checkpoint (its {e} is missing or malformed)") from None
    return Checkpoint(step, ModelMeta.from_dict(state["meta"], path), fingerprint, parts)


# -- models ---------------------------------------------------------------------------------------

def write_model(path: str | Path, weights: Weights, meta: ModelMeta) -> None:
    """Weights as safetensors (no pickle, so loading runs no code), with the metadata beside them."""
    with atomic_write(path, "wb") as f:
        f.write(save({k: v.contiguous() for k, v in weights.items()}, metadata={"meta": json.dumps(meta.to_dict())}))


def load_weights(model: torch.nn.Module, weights: Weights, path: str | Path, refusal: str) -> None:
    """`weights`, read from `path`, into `model`, in either layout of attention's products. Weights of
    other names or shapes are refused before any loads, as "<path>: <refusal>: its weight <name> is ...",
    naming the first."""
    weights = with_stacked_projections(model, weights)
    ours = model.state_dict()
    for name in sorted(ours.keys() | weights.keys()):
        theirs = tuple(weights[name].shape) if name in weights else "missing"
        mine = tuple(ours[name].shape) if name in ours else "missing"
        if theirs != mine:
            raise PipelineError(f"{path}: {refusal}: its weight {name} is {theirs}, this model's {mine}")
    model.load_state_dict(weights)


def read_model(path: str | Path) -> tuple[Weights, ModelMeta]:
    """(weights, metadata) of a model (.safetensors, the average stage's) or of a checkpoint (.pt)."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"{path}: model file not found (has the train or average stage run?)")
    if path.suffix == ".pt":  # mapped: the optimizer's moments, twice the model, are never read
        checkpoint = read_checkpoint(path, mapped=True)
        return checkpoint.parts["model"], checkpoint.meta
    try:
        with safe_open(path, framework="pt") as f:
            meta = json.loads((f.metadata() or {})["meta"])
            weights = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, KeyError, ValueError) as e:
        raise PipelineError(f"{path}: not a model written by this pipeline's average stage ({e})") from None
    return weights, ModelMeta.from_dict(meta, path)
