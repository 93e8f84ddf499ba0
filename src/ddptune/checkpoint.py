"""Atomic checkpoints and exact resume.

A checkpoint is a folder `checkpoints/step-NNNNNN/` holding the trained weights (adapters only for
LoRA), the optimizer and scheduler states, every process's RNG states and the step reached. It is
written under a temporary name and renamed when complete, so a crash never leaves a half-written
checkpoint that `--resume` would pick up. Only the caller decides which process writes.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

PREFIX = "step-"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def atomic_dir(final: Path):
    """A fresh temporary folder beside `final`; `commit(tmp, final)` renames it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))


def commit(tmp: Path, final: Path) -> None:
    if final.exists():  # an older copy of the same step: replace it whole
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def save(folder: Path, step: int, weights: dict, optimizer, scheduler, rng_states: list[dict], extra: dict) -> Path:
    """Write checkpoint `step` atomically under `folder`; return its path."""
    final = folder / f"{PREFIX}{step:06d}"
    tmp = atomic_dir(final)
    torch.save({k: v.cpu() for k, v in weights.items()}, tmp / "weights.pt")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_states, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **extra}, indent=2))
    commit(tmp, final)
    return final


def prune(folder: Path, keep: int) -> None:
    for old in list_checkpoints(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are ignored)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.startswith(PREFIX) and (p / "state.json").exists())


def load(path: Path, model, optimizer, scheduler, process_index: int) -> dict:
    """Restore weights, optimizer, scheduler and this process's RNG; return state.json."""
    weights = torch.load(path / "weights.pt", map_location="cpu")
    params = dict(model.named_parameters())
    missing = [k for k in weights if k not in params]
    if missing:
        raise RuntimeError(f"checkpoint {path} has weights the model lacks, e.g. {missing[0]}: was the config changed?")
    with torch.no_grad():
        for k, v in weights.items():
            params[k].copy_(v)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    rngs = torch.load(path / "rng.pt", weights_only=False)
    set_rng_state(rngs[process_index])
    return json.loads((path / "state.json").read_text())
