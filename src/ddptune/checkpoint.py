"""Atomic checkpoints and exact resume, in files that hold data only.

A checkpoint is a folder `checkpoints/step-NNNNNN/` holding the trained weights (adapters only for
LoRA), the optimizer and scheduler states, every process's RNG states and the step reached: tensors
in safetensors files, everything else in JSON. Nothing read back is unpickled, so a crafted
checkpoint cannot run code (`torch.load`'s pickle could). The folder is written under a temporary
name, each file fsynced, and renamed when complete, so a crash never leaves a half-written
checkpoint that `--resume` would pick up. Only the caller decides which process writes.

A sharded model (FSDP2: parameters and optimizer states are DTensors, each process holds a part)
is saved as one weights and optimizer file set per process (`weights.shard-00001.safetensors`, ...),
each holding that process's own parts (`save_shard`), beside the one scheduler, RNG and state
files; it is resumed by the same number of processes, each reading its own set back into place.
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
from safetensors.torch import load_file, save_file

PREFIX = "step-"


# ---------------------------------------------------------------------------------------------
# Nested state (dicts, lists, numbers, tensors) as a JSON skeleton plus a flat dict of tensors.


def split_tensors(obj, prefix: str, tensors: dict):
    """`obj` with every tensor replaced by {"tensor": key}; the tensors go to `tensors[key]`.
    Dicts keep keys of any JSON type ({"dict": [[key, value], ...]}) and tuples stay tuples."""
    if torch.is_tensor(obj):
        tensors[prefix] = local(obj).detach().cpu().contiguous()
        return {"tensor": prefix}
    if isinstance(obj, dict):
        return {"dict": [[k, split_tensors(v, f"{prefix}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [split_tensors(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]
        return {"tuple": items} if isinstance(obj, tuple) else {"list": items}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} at {prefix} in a checkpoint")


def numbers(obj):
    """`obj` with one-element tensors as plain numbers: the learning rates of a capturable optimizer
    and its schedule (a step recorded as CUDA graphs keeps them on the GPU) are stored as the numbers
    they are, so that a run with either kind of optimizer resumes them."""
    if torch.is_tensor(obj) and obj.numel() == 1:
        return obj.item()
    if isinstance(obj, dict):
        return {k: numbers(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(numbers(v) for v in obj)
    return obj


def optimizer_state(optimizer) -> dict:
    """The optimizer's state dict with its hyperparameters (learning rates) as numbers."""
    state = optimizer.state_dict()
    return dict(state, param_groups=numbers(state["param_groups"]))


def join_tensors(skeleton, tensors: dict):
    """The inverse of split_tensors."""
    if isinstance(skeleton, dict):
        if "tensor" in skeleton:
            return tensors[skeleton["tensor"]]
        if "dict" in skeleton:
            return {k: join_tensors(v, tensors) for k, v in skeleton["dict"]}
        if "list" in skeleton:
            return [join_tensors(v, tensors) for v in skeleton["list"]]
        if "tuple" in skeleton:
            return tuple(join_tensors(v, tensors) for v in skeleton["tuple"])
        raise ValueError(f"unknown entry {sorted(skeleton)}")
    return skeleton


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's own part of a sharded tensor (DTensor); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _like(value: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`value` (a local part read back) as a DTensor sharded like `ref`, when `ref` is one."""
    from torch.distributed.tensor import DTensor

    if not isinstance(ref, DTensor) or value.shape != ref.to_local().shape:
        return value
    return DTensor.from_local(value.to(ref.device), ref.device_mesh, ref.placements, run_check=False,
                              shape=ref.shape, stride=ref.stride())


def shard_name(stem: str, index: int, suffix: str) -> str:
    return f"{stem}.shard-{index:05d}.{suffix}"


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_tensors(path: Path, tensors: dict) -> None:
    save_file(tensors, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# RNG


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _numpy_state_as_json(state: dict) -> dict:
    name, keys, pos, has_gauss, cached = state["numpy"]
    return dict(state, numpy=[name, keys.tolist(), int(pos), int(has_gauss), float(cached)])


# ---------------------------------------------------------------------------------------------
# Folders


def atomic_dir(final: Path):
    """A fresh temporary folder beside `final`; `commit(tmp, final)` renames it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path) -> None:
    _fsync_dir(tmp)  # its entries (each file is synced as written) reach the disk before the rename does
    if final.exists():  # an older copy of the same step: replace it whole
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)  # the rename itself survives a power cut


def path_of(folder: Path, step: int) -> Path:
    return folder / f"{PREFIX}{step:06d}"


def save(folder: Path, step: int, weights: dict | None, optimizer, scheduler, rng_states: list[dict], extra: dict,
         tmp: Path | None = None) -> Path:
    """Write checkpoint `step` atomically under `folder`; return its path. Sharded: `weights` and
    `optimizer` are None, every process has written its shard into `tmp` (save_shard)."""
    final = path_of(folder, step)
    tmp = tmp or atomic_dir(final)
    if weights is not None:
        _write_tensors(tmp / "weights.safetensors", {k: v.detach().cpu().contiguous() for k, v in weights.items()})
        tensors: dict = {}
        _write_json(tmp / "optimizer.json", split_tensors(optimizer_state(optimizer), "optimizer", tensors))
        _write_tensors(tmp / "optimizer.safetensors", tensors)
    _write_json(tmp / "scheduler.json", split_tensors(numbers(scheduler.state_dict()), "scheduler", {}))
    tensors = {}
    _write_json(tmp / "rng.json", split_tensors([_numpy_state_as_json(s) for s in rng_states], "rng", tensors))
    _write_tensors(tmp / "rng.safetensors", tensors)
    _write_json(tmp / "state.json", {"step": step, **extra})
    commit(tmp, final)
    return final


def save_shard(tmp: Path, index: int, weights: dict, optimizer) -> None:
    """Process `index`'s own parts of the sharded weights and optimizer states, into `tmp`."""
    _write_tensors(tmp / shard_name("weights", index, "safetensors"),
                   {k: local(v).detach().cpu().contiguous() for k, v in weights.items()})
    tensors: dict = {}
    _write_json(tmp / shard_name("optimizer", index, "json"), split_tensors(optimizer_state(optimizer), "optimizer", tensors))
    _write_tensors(tmp / shard_name("optimizer", index, "safetensors"), tensors)


def prune(folder: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints; remove the rest and any temporary or replaced folder a
    crash left."""
    for old in list_checkpoints(folder)[:-keep] + sorted(folder.glob(f".{PREFIX}*.tmp-*")) + sorted(folder.glob(f".{PREFIX}*.old")):
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are ignored)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.startswith(PREFIX) and (p / "state.json").exists())


def load(path: Path, model, optimizer, scheduler, process_index: int) -> dict:
    """Restore weights, optimizer, scheduler and this process's RNG; return state.json.
    Raises ValueError naming the checkpoint when a file is missing or not what it should be."""
    try:
        state = json.loads((path / "state.json").read_text())
        shards = state.get("shards")
        if shards is not None and not 0 <= process_index < shards:
            raise ValueError(f"it holds the shards of {shards} processes, not of process {process_index}")
        name = (lambda stem, suffix: shard_name(stem, process_index, suffix)) if shards else (lambda stem, suffix: f"{stem}.{suffix}")  # noqa: E731
        weights = load_file(str(path / name("weights", "safetensors")))
        optimizer_state = join_tensors(json.loads((path / name("optimizer", "json")).read_text()),
                                       load_file(str(path / name("optimizer", "safetensors"))))
        scheduler_state = join_tensors(json.loads((path / "scheduler.json").read_text()), {})
        rngs = join_tensors(json.loads((path / "rng.json").read_text()), load_file(str(path / "rng.safetensors")))
    except Exception as e:  # noqa: BLE001 - missing, truncated or foreign files (safetensors has its own error type)
        reason = (str(e).splitlines() or [""])[0][:200]
        raise ValueError(f"checkpoint {path} cannot be read ({type(e).__name__}: {reason})") from None
    params = dict(model.named_parameters())
    missing = [k for k in weights if k not in params]
    if missing:
        raise ValueError(f"checkpoint {path} has weights the model lacks, e.g. {missing[0]}: was the config changed?")
    with torch.no_grad():
        for k, v in weights.items():
            local(params[k]).copy_(v)  # sharded: this process's part, in place
    by_index = [p for group in optimizer.param_groups for p in group["params"]]
    for i, values in optimizer_state["state"].items():  # sharded parameters' states are sharded likewise
        optimizer_state["state"][i] = {k: _like(v, by_index[i]) if torch.is_tensor(v) else v for k, v in values.items()}
    own = [(group["lr"], group.get("capturable")) for group in optimizer.param_groups]
    optimizer.load_state_dict(optimizer_state)
    for group, (lr, capturable) in zip(optimizer.param_groups, own):  # this run's kind of optimizer, the saved rates
        if capturable is not None:
            group["capturable"] = capturable
        if torch.is_tensor(lr):
            group["lr"] = lr.fill_(float(group["lr"]))
    scheduler.load_state_dict(scheduler_state)
    # At another process count (same global batch) a process takes some writer's RNG: dropout masks
    # then differ from the unbroken run's, which the shares' new split already implies.
    set_rng_state(rngs[process_index % len(rngs)])
    return state


def newest_step(folder: Path) -> int:
    """The step of the newest checkpoint that has a readable state (what --resume will continue from)."""
    for path in reversed(list_checkpoints(folder)):
        try:
            step = json.loads((path / "state.json").read_text()).get("step")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(step, int):
            return step
    return 0
