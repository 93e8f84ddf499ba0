"""Past one machine and past a failure, with torch's own launcher: two "nodes" on loopback (one
torchrun agent each, static rendezvous) equal one process; `--max-restarts` brings a job whose worker
was killed back from its newest checkpoint to the unbroken run's adapter."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import multiproc
from conftest import ROOT, UNBROKEN_ARGS, metrics
from ddptune import config, launch, train

TINY = str(ROOT / "configs" / "tiny.yaml")
ENV = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))


def train_tiny(overrides: list[str]) -> dict:
    return train.run(config.load(TINY, overrides))[0]


def ddptune(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ddptune", *args], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in metrics(run_dir) if "loss" in r]


def test_two_nodes_on_loopback_equal_one_process(tmp_path):
    """3 steps: tiny's warm-up starts at learning rate 0, so the third step's loss is the first computed on
    weights that the all-reduced gradients moved."""
    args = ["train.max_steps=3", "data.val=null", "lora.dropout=0.0", "train.grad_accum=null", "train.effective_batch_size=8"]
    one = tmp_path / "one"
    multiproc.run(train_tiny, 1, [f"output_dir={one}", *args])
    out = tmp_path / "nodes"
    master = f"127.0.0.1:{multiproc.free_port()}"
    nodes = [ddptune("train", TINY, "--nproc", "1", "--nnodes", "2", "--node-rank", str(r), "--master", master,
                     f"output_dir={out}", *args) for r in (0, 1)]
    results = [n.communicate(timeout=240) for n in nodes]
    for n, (_, err) in zip(nodes, results):
        assert n.returncode == 0, err[-3000:]
    assert "2 process(es)" in results[0][0] + results[0][1]
    assert losses(out) == pytest.approx(losses(one), abs=1e-5)


def test_a_killed_worker_is_restarted_from_the_newest_checkpoint(tmp_path, unbroken):
    out = tmp_path / "run"
    job = ddptune("train", TINY, "--nproc", "2", "--max-restarts", "1", f"output_dir={out}", *UNBROKEN_ARGS)
    deadline = time.time() + 240
    while time.time() < deadline and not (out / "checkpoints" / "step-000010").is_dir() and job.poll() is None:
        time.sleep(0.02)
    workers = launch.workers(job.pid)
    assert job.poll() is None and len(workers) == 2
    os.kill(workers[-1].pid, signal.SIGKILL)
    out_text, err = job.communicate(timeout=240)
    assert job.returncode == 0, err[-3000:]
    assert "resuming after step 1" in out_text  # the restarted workers continued from a checkpoint, not from step 0
    assert [r["step"] for r in metrics(out) if "loss" in r] == list(range(1, 61))
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert all(torch.allclose(unbroken[k], adapter[k], atol=1e-6, rtol=0) for k in unbroken)
