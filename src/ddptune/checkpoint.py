"""Atomic checkpoints and exact resume, in files that hold data only.

A checkpoint is a folder `checkpoints/step-NNNNNN/` holding the trained weights (adapters only for
LoRA), the optimizer and scheduler states, every process's RNG states, the step reached and what wrote
it (processes, global batch, CPU threads, which a resume on a CPU takes again for the same sums): tensors
in safetensors files, everything else in JSON. Nothing read back is unpickled, so a crafted
checkpoint cannot run code (`torch.load`'s pickle could). The folder is written under a temporary
name, each file fsynced, and renamed when complete, so a crash never leaves a half-written
checkpoint that `--resume` would pick up. Only the caller decides which process writes.
torch, numpy and safetensors are imported by the functions that use them: listing checkpoints and
judging their state.json (what a refusal before a run reads) needs none of them.

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PREFIX = "step-"


# ---------------------------------------------------------------------------------------------
# Nested state (dicts, lists, numbers, tensors) as a JSON skeleton plus a flat dict of tensors.


def split_tensors(obj, prefix: str, tensors: dict):
    """`obj` with every tensor replaced by {"tensor": key}; the tensors go to `tensors[key]`.
    Dicts keep keys of any JSON type ({"dict": [[key, value], ...]}) and tuples stay tuples."""
    import torch

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
    import torch

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
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# RNG


def rng_state() -> dict:
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

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


def plain_mode() -> int:
    """The permissions a plain `mkdir` gives a folder: 0o777 less the umask."""
    umask = os.umask(0o022)  # read it (os has no other way) and put it back at once
    os.umask(umask)
    return 0o777 & ~umask


def make_plain(folder: Path) -> None:
    """Give `folder` and everything in it the permissions a plain `mkdir` and `open` give under the
    umask (0755 and 0644 under 022): mkdtemp makes a folder private (0700), and safetensors writes
    its files 0600. Symlinks are left as they are, never followed."""
    mode = plain_mode()
    for root, _, files in os.walk(folder):
        os.chmod(root, mode)
        for name in files:
            if not os.path.islink(path := os.path.join(root, name)):
                os.chmod(path, mode & 0o666)


def commit(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` into place as `final` (replacing an older `final` whole), with the
    permissions of plain folders and files (make_plain)."""
    make_plain(tmp)
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


def remove_leftovers(final: Path) -> None:
    """Delete what a save killed midway left beside `final`: its temporary folders
    (`.NAME.tmp-*`: for full fine-tuning, model-sized) and a replaced copy (`.NAME.old`). A symlink
    by such a name is removed, never followed."""
    if not final.parent.is_dir():
        return
    temporary, old = f".{final.name}.tmp-", f".{final.name}.old"
    for p in final.parent.iterdir():
        if not (p.name.startswith(temporary) or p.name == old):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


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


# ---------------------------------------------------------------------------------------------
# Loading: everything read and checked against this run before anything of it changes


def load(path: Path, model, optimizer, scheduler, process_index: int, total_steps: int | None = None) -> dict:
    """Restore weights, optimizer, scheduler and this process's RNG; return state.json.
    Every file is read and checked against this run first (each weight's shape and dtype, the step
    against the folder's name and 1..`total_steps`, the optimizer's parameters and states, the
    scheduler's keys, the RNG states' form): a ValueError naming the checkpoint and what is wrong
    leaves the model, optimizer, scheduler and RNG as they were."""
    from safetensors.torch import load_file

    state = _read(path, lambda: json.loads((path / "state.json").read_text()))
    if problem := state_problem(path, state, total_steps):
        raise ValueError(f"checkpoint {path} {problem}")
    shards = state.get("shards")
    if shards is not None and not 0 <= process_index < shards:
        raise ValueError(f"checkpoint {path} holds the shards of {shards} processes, not of process {process_index}")
    name = (lambda stem, suffix: shard_name(stem, process_index, suffix)) if shards else (lambda stem, suffix: f"{stem}.{suffix}")  # noqa: E731
    weights = _read(path, lambda: load_file(str(path / name("weights", "safetensors"))))
    optimizer_state = _read(path, lambda: join_tensors(json.loads((path / name("optimizer", "json")).read_text()),
                                                       load_file(str(path / name("optimizer", "safetensors")))))
    scheduler_state = _read(path, lambda: join_tensors(json.loads((path / "scheduler.json").read_text()), {}))
    rngs = _read(path, lambda: join_tensors(json.loads((path / "rng.json").read_text()), load_file(str(path / "rng.safetensors"))))
    try:
        problem = (weights_problem(weights, model) or optimizer_problem(optimizer_state, optimizer)
                   or scheduler_problem(scheduler_state, scheduler) or rngs_problem(rngs))
    except Exception as e:  # noqa: BLE001 - a form no check foresaw is damage all the same
        problem = f"holds state of a form this run cannot take ({type(e).__name__}: {_first_line(e)})"
    if problem:
        raise ValueError(f"checkpoint {path} {problem}")
    _restore(weights, optimizer_state, scheduler_state, model, optimizer, scheduler)
    # At another process count (same global batch) a process takes some writer's RNG: dropout masks
    # then differ from the unbroken run's, which the shares' new split already implies.
    set_rng_state(rngs[process_index % len(rngs)])
    return state


def _read(path: Path, read):
    """`read()`, or ValueError naming the checkpoint when a file is missing, truncated or foreign."""
    try:
        return read()
    except Exception as e:  # noqa: BLE001 - missing, truncated or foreign files (safetensors has its own error type)
        raise ValueError(f"checkpoint {path} cannot be read ({type(e).__name__}: {_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0][:200]


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _positive_int(value) -> bool:
    return type(value) is int and value >= 1


def state_problem(path: Path, state, total_steps: int | None = None) -> str | None:
    """What is wrong with a checkpoint's state.json (read from `path`), or None: its step must be a
    whole number equal to the folder's (step-000025: 25), within 1..total_steps when that is given;
    its process, batch and CPU thread counts positive whole numbers."""
    if not isinstance(state, dict):
        return f"has a state.json that holds a JSON {type(state).__name__}, not an object"
    step, number = state.get("step"), path.name.removeprefix(PREFIX)
    if type(step) is not int:
        return f"has a step that is not a whole number ({_shown(step)} in state.json)"
    if not (number.isdigit() and number.isascii()) or int(number) != step:
        return f"says step {step} in state.json, but its folder is named {path.name}"
    if total_steps is not None and not 1 <= step <= total_steps:
        return f"is at step {step}, outside this run's steps 1..{total_steps}"
    for key in ("world_size", "global_batch", "shards", "threads"):
        if key in state and not _positive_int(state[key]):
            return f"has a {key} that is not a positive whole number ({_shown(state[key])} in state.json)"
    return None


def weights_problem(weights: dict, model) -> str | None:
    """Each saved weight is a parameter of `model` with its (local, when sharded) shape and dtype,
    and every trained parameter is there."""
    params = dict(model.named_parameters())
    for k, v in weights.items():
        if k not in params:
            return f"has weights the model lacks, e.g. {_shown(k)}: was the config changed?"
        own = local(params[k])
        if v.shape != own.shape or v.dtype != own.dtype:
            return f"holds {k} as {_kind(v)}, but this run's is {_kind(own)} (was the config changed?)"
    absent = [k for k, p in params.items() if p.requires_grad and k not in weights]
    if absent:
        return f"lacks {len(absent)} of this run's trained weights, e.g. {absent[0]} (was the config changed?)"
    return None


PER_PARAMETER = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "state1", "state2")  # a parameter's shape


def optimizer_problem(saved, optimizer) -> str | None:
    """The saved optimizer state has this optimizer's parameter groups, numbers its parameters as
    it does, holds states only for parameters that exist, each of its parameter's (local) shape."""
    import torch

    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) or not isinstance(saved.get("param_groups"), list):
        return "holds an optimizer state without its state and param_groups"
    groups, own = saved["param_groups"], optimizer.param_groups
    if len(groups) != len(own):
        return f"has {len(groups)} optimizer parameter groups, this run {len(own)} (was the config changed?)"
    for i, (group, mine) in enumerate(zip(groups, own)):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list) or len(group["params"]) != len(mine["params"]):
            return f"has an optimizer parameter group {i} unlike this run's (was the config changed?)"
        for key, value in group.items():  # hyperparameters: the same kinds of values (a rate kept on the GPU: a number)
            if key != "params" and key in mine and value is not None and mine[key] is not None and not same_kind(value, numbers(mine[key])):
                return f"holds the optimizer's {key} as {_shown(value)}, unlike this run's {_shown(numbers(mine[key]))}"
    by_index = [p for group in own for p in group["params"]]
    if [i for group in groups for i in group["params"]] != list(range(len(by_index))):
        return "numbers the optimizer's parameters unlike this run (was the config changed?)"
    for i, values in saved["state"].items():
        if type(i) is not int or not 0 <= i < len(by_index) or not isinstance(values, dict):
            return f"holds optimizer state for a parameter {_shown(i)} this run lacks (it has {len(by_index)})"
        shape = local(by_index[i]).shape
        for key, v in values.items():
            if key in PER_PARAMETER and (not torch.is_tensor(v) or v.shape != shape):
                what = _kind(v) if torch.is_tensor(v) else _shown(v)
                return f"holds the optimizer's {key} of parameter {i} as {what}, but that parameter is {list(shape)}"
            if key == "step" and not (torch.is_tensor(v) and v.numel() == 1 or same_kind(v, 0.0)):
                return f"holds the optimizer's step of parameter {i} as {_shown(v)}, not a number"
    return None


def scheduler_problem(saved, scheduler) -> str | None:
    """The saved schedule has the keys of this run's, each with a value of the same kind."""
    own = numbers(scheduler.state_dict())
    if not isinstance(saved, dict):
        return f"holds a learning-rate schedule that is a {type(saved).__name__}, not this run's kind of state"
    if saved.keys() != own.keys():
        missing, foreign = [k for k in own if k not in saved], [k for k in saved if k not in own]
        return (f"holds a learning-rate schedule unlike this run's (without {_shown(missing)}, "
                f"with {_shown(foreign)} that this run's lacks)")
    for key, value in own.items():
        if not same_kind(saved[key], value):
            return f"holds the schedule's {key} as {_shown(saved[key])}, unlike this run's {_shown(value)}"
    return None


def same_kind(value, ref) -> bool:
    """Whether `value` has the form of `ref`: the same kind of number (an int for an int), the same
    keys, lengths and tensor shapes, all the way down."""
    import torch

    if isinstance(ref, (bool, str)) or ref is None:
        return type(value) is type(ref)
    if isinstance(ref, int):
        return type(value) is int
    if isinstance(ref, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(ref, (list, tuple)):
        return isinstance(value, (list, tuple)) and len(value) == len(ref) and all(map(same_kind, value, ref))
    if isinstance(ref, dict):
        return isinstance(value, dict) and value.keys() == ref.keys() and all(same_kind(value[k], ref[k]) for k in ref)
    if torch.is_tensor(ref):
        return torch.is_tensor(value) and value.shape == ref.shape and value.dtype == ref.dtype
    return False


def rngs_problem(rngs) -> str | None:
    """The RNG states are a non-empty list of what `rng_state()` writes, each set on a throwaway
    generator first: Python's state tuple, numpy's, torch's ByteTensor and, optionally, CUDA's."""
    import numpy as np
    import torch

    if not isinstance(rngs, list) or not rngs:
        return "holds no RNG states (rng.json is not a non-empty list)"
    for i, state in enumerate(rngs):
        if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= state.keys() <= {"python", "numpy", "torch", "cuda"}:
            return f"holds an RNG state {i} that is not the python, numpy and torch states"
        try:
            version, internal, gauss = state["python"]
            random.Random().setstate((version, tuple(internal), gauss))
            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.RandomState().set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
            torch.Generator().set_state(state["torch"])
        except Exception as e:  # noqa: BLE001 - each library says in its own way what it cannot take
            return f"holds an RNG state {i} that cannot be set ({type(e).__name__}: {_first_line(e)})"
        cuda = state.get("cuda", torch.zeros(0, dtype=torch.uint8))
        if not (torch.is_tensor(cuda) and cuda.dtype == torch.uint8 and cuda.dim() == 1) or (
                "cuda" in state and torch.cuda.is_available() and cuda.numel() != torch.cuda.get_rng_state().numel()):
            return f"holds an RNG state {i} whose CUDA state is not a CUDA generator's ByteTensor"
    return None


def _restore(weights: dict, optimizer_state: dict, scheduler_state: dict, model, optimizer, scheduler) -> None:
    """Put checked weights, optimizer and scheduler states into place."""
    import torch

    params = dict(model.named_parameters())
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
