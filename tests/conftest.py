"""Shared helpers: run the real CLI in subprocesses (real launcher, real gloo processes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def ddptune(*args: str, timeout: float = 600, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run `python -m ddptune ARGS` and return the finished process (output captured)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "ddptune", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Preset checkpoints go to a per-session temporary cache, never the user's."""
    monkeypatch.setenv("DDPTUNE_CACHE", str(tmp_path_factory.getbasetemp() / "ddptune-cache"))


# One tiny run that faults and restarts are measured against (test_faults, test_launch): 2 processes,
# dropout 0, a checkpoint every 2 steps (checkpoints change no result).
UNBROKEN_ARGS = ["train.max_steps=60", "data.val=null", "lora.dropout=0.0", "train.save_every=2"]


def _train_tiny_to_the_end(overrides: list[str]) -> None:
    from ddptune import config, train

    train.run(config.load(ROOT / "configs" / "tiny.yaml", overrides))


@pytest.fixture(scope="session")
def unbroken(tmp_path_factory) -> dict:
    """The adapter of that run, never interrupted (in-process gloo ranks)."""
    import multiproc
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("unbroken") / "run"
    multiproc.run(_train_tiny_to_the_end, 2, [*UNBROKEN_ARGS, f"output_dir={out}"])
    return load_file(out / "adapter" / "adapter_model.safetensors")
