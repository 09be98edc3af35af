"""The model files have one owner, stages/model_files.py: what it writes it reads back, it refuses
what is not ours, and nothing else in the project reads or writes those formats or needs the
training stage (and Accelerate) to read a model."""
import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY
from stages.io import PipelineError
from stages.checkpoint import prune
from stages.model_files import Checkpoint, ModelMeta, list_checkpoints, read_checkpoint, read_model, \
    write_checkpoint, write_model

ROOT = Path(__file__).resolve().parents[1]
META = ModelMeta(TINY, vocab_size=11, steps=(3,), vocab="0f3c")  # the vocabulary is kept with it


def test_a_checkpoint_reads_back_as_written_and_as_a_model(tmp_path):
    weights = {"w": torch.arange(6.0).view(2, 3)}
    parts = {"model": weights, "progress": {"step": 3, "history": [{"loss": 1.5}]}, "rng": [{"cpu": torch.ones(2)}]}
    path = write_checkpoint(tmp_path, Checkpoint(3, META, {"world_size": 1}, parts))
    assert path.name == "checkpoint-00000003.pt"
    back = read_checkpoint(path)
    assert (back.step, back.meta, back.fingerprint) == (3, META, {"world_size": 1})
    assert back.parts["progress"] == parts["progress"] and torch.equal(back.parts["model"]["w"], weights["w"])
    as_model, meta = read_model(path)
    assert meta == META and torch.equal(as_model["w"], weights["w"])


def test_a_model_reads_back_with_its_metadata(tmp_path):
    meta = dataclasses.replace(META, steps=(4, 6))
    write_model(tmp_path / "m.safetensors", {"w": torch.ones(2, 2).t()}, meta)  # not contiguous: still written
    weights, back = read_model(tmp_path / "m.safetensors")
    assert back == meta and torch.equal(weights["w"], torch.ones(2, 2))


def test_checkpoints_are_chosen_by_step_not_by_name_and_pruned_oldest_first(tmp_path):
    for step in (9, 10, 100):
        (tmp_path / f"checkpoint-{step}.pt").write_bytes(b"")
    (tmp_path / ".checkpoint-00000200.pt.x.tmp").write_bytes(b"")  # an unfinished write
    assert [s for s, _ in list_checkpoints(tmp_path)] == [9, 10, 100]
    prune(tmp_path, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10, 100]


def test_files_that_are_not_ours_are_refused_by_name(tmp_path):
    (tmp_path / "evil.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(PipelineError, match="evil.pt: not a readable checkpoint"):
        read_checkpoint(tmp_path / "evil.pt")
    torch.save({"model": {}}, tmp_path / "foreign.pt")
    with pytest.raises(PipelineError, match="foreign.pt: not a checkpoint written by this pipeline"):
        read_model(tmp_path / "foreign.pt")
    torch.save({"format": "transformer-pipeline/checkpoint/2", "step": 3}, tmp_path / "older.pt")
    with pytest.raises(PipelineError, match="older.pt: a checkpoint of format transformer-pipeline/checkpoint/2, "
                                            "from another version of the train stage"):
        read_checkpoint(tmp_path / "older.pt")
    with pytest.raises(PipelineError, match="absent.safetensors: model file not found"):
        read_model(tmp_path / "absent.safetensors")
    with pytest.raises(PipelineError, match="old.safetensors: its model metadata is incomplete"):
        ModelMeta.from_dict({"model_config": {"d_model": 8}, "vocab_size": 3, "steps": []}, "old.safetensors")


@pytest.mark.parametrize("mapped", [False, True])
def test_a_checkpoint_cut_short_or_not_ours_is_refused_by_name_read_or_mapped(tmp_path, mapped):
    """Averaging and decoding map checkpoints (read_checkpoint's `mapped`): a file cut short, or not one
    torch.save writes as a zip, is refused with its name as a read one is, never a crash."""
    path = write_checkpoint(tmp_path, Checkpoint(3, META, {}, {"model": {"w": torch.zeros(1000)}}))
    whole = path.read_bytes()
    for name, data in (("cut.pt", whole[: len(whole) // 2]), ("text.pt", b"not a checkpoint")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(PipelineError, match=f"{name}: not a readable checkpoint"):
            read_checkpoint(tmp_path / name, mapped)
    assert torch.equal(read_checkpoint(path, mapped).parts["model"]["w"], torch.zeros(1000))


FORMAT_CALLS = {"torch.save", "torch.load", "safe_open", "safetensors.torch", "safetensors.torch.save"}


def _format_uses(path: Path) -> set[str]:
    """The model-file reading and writing calls a module makes or imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            name = f"{node.value.id}.{node.attr}"
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{a.name}" for a in node.names} & FORMAT_CALLS | ({node.module} & FORMAT_CALLS)
            continue
        elif isinstance(node, ast.Name):
            name = node.id
        else:
            continue
        if name in FORMAT_CALLS:
            found.add(name)
    return found


def test_only_model_files_reads_or_writes_model_files():
    users = {str(p.relative_to(ROOT)) for package in ("pipeline", "stages", "translate", "transformer", "bench")
             for p in (ROOT / package).glob("*.py") if _format_uses(p)}
    assert users == {"stages/model_files.py"}


def test_reading_a_model_needs_neither_the_train_stage_nor_accelerate():
    code = ("import sys; import stages.average, stages.decode, stages.export; "
            "print(sorted(m for m in ('accelerate', 'stages.train') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
