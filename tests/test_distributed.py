"""Training beyond one process, on 127.0.0.1 with gloo: two torchrun launchers joined by c10d
rendezvous, as two nodes of one process each, train as one node of two processes does; a run of
2 processes x 1 micro-batch a step resumes on 1 process x 2 and goes on with the same batches; a
resumption that would change the micro-batches a step is refused, naming them; the stage's own
command on two processes (train.processes) fails with the rank of a worker that dies."""
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, train_command, train_params_file, without_key_biases
from servers import free_port
from stages.model_files import current_dir, read_checkpoint

pytestmark = pytest.mark.slow
STEPS = 3  # N: the reference trains 2N steps straight
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# one thread a process, as torchrun sets for several processes a node but not for one: the thread
# count changes how matrix products split their sums, and so their fp32 rounding
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _train(launcher: list[str], out, encoded, vocab_dir, steps: int, micro_batches: int | str = "auto",
           processes: int = 1) -> subprocess.Popen:
    params = train_params_file(out, **{"train.max_steps": steps, "train.micro_batches": micro_batches,
                                       "train.processes": processes, "train.checkpoint_every_steps": STEPS,
                                       "train.log_every": 1})
    return subprocess.Popen([*launcher, *train_command(params, encoded, vocab_dir, out)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finished(*procs: subprocess.Popen) -> str:
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output[-3000:]
    return "".join(outputs)


def _checkpoint(out, step: int):
    return read_checkpoint(current_dir(out / "ckpt") / f"checkpoint-{step:08d}.pt").parts


def _per_step(parts, key: str) -> list[float]:
    return [row[key] for row in parts["progress"]["history"]]


@pytest.fixture(scope="module")
def one_node(encoded, vocab_dir, tmp_path_factory):
    """2N steps on one node of two processes: the reference."""
    out = tmp_path_factory.mktemp("one-node")
    _finished(_train([*TORCHRUN, "--standalone", "--nproc_per_node", "2"], out, encoded[0], vocab_dir, 2 * STEPS))
    return _checkpoint(out, 2 * STEPS)


def test_two_nodes_of_one_process_train_as_one_node_of_two(one_node, encoded, vocab_dir, tmp_path):
    """Each launcher is what one machine of a cluster runs (`--node-rank` is not needed: c10d numbers
    the nodes as they join); they share the checkpoint folder as nodes share a filesystem."""
    node = [*TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "two-nodes", "--local-addr", "127.0.0.1"]
    output = _finished(*[_train(node, tmp_path, encoded[0], vocab_dir, 2 * STEPS) for _ in range(2)])
    assert "resumed from" not in output
    two = _checkpoint(tmp_path, 2 * STEPS)
    assert two["topology"] == one_node["topology"] == {"processes": 2, "grad_accum": 1}
    assert two["sampler"] == one_node["sampler"]
    assert _per_step(two, "tgt_tokens_per_step") == _per_step(one_node, "tgt_tokens_per_step")  # the same batches
    assert _per_step(two, "loss") == _per_step(one_node, "loss")
    for name, weight in one_node["model"].items():
        assert torch.equal(two["model"][name], weight), name  # bit for bit: the same sums in the same order


def test_a_run_of_two_processes_resumes_on_one_with_twice_the_accumulation(one_node, encoded, vocab_dir, tmp_path):
    """2 x 1 for N steps, then 1 x 2 for N more, against 2 x 1 for 2N: the same batches step by step,
    and the weights equal within fp32 rounding (a sum over two processes' gradients, or accumulated in
    one, rounds differently; Adam's updates carry that on: relative 1e-4, absolute 1e-6 after 2N
    steps), but for the keys' biases, whose gradient is rounding noise."""
    _finished(_train([*TORCHRUN, "--standalone", "--nproc_per_node", "2"], tmp_path, encoded[0], vocab_dir, STEPS))
    refused = _train([sys.executable], tmp_path, encoded[0], vocab_dir, 2 * STEPS, micro_batches=1)
    said = refused.communicate(timeout=300)[0]
    assert refused.returncode == 1
    assert "a run of 2 processes x 1 = 2 micro-batches a step; this one has 1 x 1 = 1: resume it with " \
           "train.micro_batches 2 (or auto)" in said
    output = _finished(_train([sys.executable], tmp_path, encoded[0], vocab_dir, 2 * STEPS))  # auto: the run's 2
    assert f"at step {STEPS}" in output and "topology changed: the run was trained on 2 processes x 1" in output
    resumed = _checkpoint(tmp_path, 2 * STEPS)
    assert resumed["topology"] == {"processes": 1, "grad_accum": 2} and resumed["sampler"] == one_node["sampler"]
    assert _per_step(resumed, "tgt_tokens_per_step") == _per_step(one_node, "tgt_tokens_per_step")
    torch.testing.assert_close(_per_step(resumed, "loss"), _per_step(one_node, "loss"), rtol=1e-5, atol=0)
    for name, weight in one_node["model"].items():
        torch.testing.assert_close(without_key_biases(name, resumed["model"][name]), without_key_biases(name, weight),
                                   rtol=1e-4, atol=1e-6, msg=name)


def test_a_worker_that_dies_fails_the_stage_with_its_rank_within_seconds(encoded, vocab_dir, tmp_path):
    """The stage's own command on two processes; SIGKILL to the second worker: the other cannot finish
    its step, the launcher stops it, and the command ends with the dead worker's rank, nothing left."""
    import psutil

    from conftest import wait_for

    proc = _train([sys.executable], tmp_path, encoded[0], vocab_dir, 100000, processes=2)
    wait_for(lambda: (tmp_path / "ckpt/current.json").exists(), 240, "the workers to train")
    workers = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(proc.pid).children()}
    assert set(workers) == {0, 1}
    workers[1].kill()
    killed = time.monotonic()
    output = proc.communicate(timeout=120)[0]
    assert time.monotonic() - killed < 20
    assert proc.returncode == 1
    assert "error: worker 1 of the train stage failed (killed by SIGKILL)" in output
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers.values())

