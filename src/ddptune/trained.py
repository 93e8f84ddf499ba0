"""A finished run read back for eval, predict and export: its config, and its trained files checked by their headers.

`trained_run` gives a run folder's config, or one ConfigError naming what is missing (the folder,
its config.yaml, its `model/` or `adapter/`) or damaged (`trained_weights_problems`: a safetensors
file that is cut or holds no tensor, an adapter_config.json that is not LoRA's). Nothing is unpickled
and no tensor is loaded: a refusal needs neither torch nor safetensors.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ddptune import config as config_lib, rundir
from ddptune.config import Config, ConfigError


def trained_run(run_dir: Path, where: str, overrides: list[str] = ()) -> Config:
    """A finished run's config (its config.yaml, with overrides), or ConfigError naming what is missing:
    the folder, its config.yaml, or the trained weights (`model/` or `adapter/`)."""
    if not run_dir.is_dir():
        raise ConfigError([f"{where}: {run_dir} is not a folder (give a run folder written by ddptune train)"])
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError([f"{where}: {run_dir} has no config.yaml (give a run folder written by ddptune train)"])
    cfg = config_lib.load(run_dir / "config.yaml", overrides)
    if problems := config_lib.check_values(cfg):
        raise ConfigError(problems)
    weights = rundir.trained_weights_dir(run_dir, cfg.train.method)
    if not weights.is_dir():
        raise ConfigError([f"{where}: {weights} not found (has the run finished? train it to the end, or give a finished run)"])
    if problems := trained_weights_problems(run_dir, cfg.train.method, where):
        raise ConfigError(problems)
    return cfg


RESTORE = "(retrain, or restore the file)"


def trained_weights_problems(run_dir: Path, method: str, where: str = "run") -> list[str]:
    """A finished run's trained files, read as far as their headers (nothing unpickled, no tensor
    loaded): the adapter's safetensors file opens and holds a tensor, and its adapter_config.json is
    a JSON object with the keys peft needs (LoRA's r, lora_alpha, target_modules); for full
    fine-tuning, model/config.json is a JSON object and its safetensors files open and hold tensors.
    One line per damaged file; none when the folder is missing (the caller says that)."""
    weights = rundir.trained_weights_dir(run_dir, method)
    if not weights.is_dir():
        return []
    if method == "full":
        files = sorted(weights.glob("*.safetensors"))
        problems = [] if files else [f"{where}: {weights} holds no .safetensors file {RESTORE}"]
        problems += [p for f in files if (p := safetensors_problem(f, where))]
        _, problem = json_object(weights / "config.json", where)
        return problems + ([problem] if problem else [])
    problem = safetensors_problem(weights / "adapter_model.safetensors", where)
    config, config_problem = json_object(weights / "adapter_config.json", where)
    if config is not None:
        r, alpha, targets = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
        ok = (config.get("peft_type") == "LORA" and type(r) is int and r >= 1
              and isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
              and (isinstance(targets, str) or isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)))
        if not ok:
            config_problem = (f"{where}: {weights / 'adapter_config.json'} is not a LoRA adapter's config (it needs "
                              f"peft_type LORA, a whole r, a numeric lora_alpha and target_modules) {RESTORE}")
    return [p for p in (problem, config_problem) if p]


def safetensors_problem(path: Path, where: str) -> str | None:
    """What keeps `path` from being a safetensors file of at least one tensor (its header alone is read)."""
    if not path.is_file():
        return f"{where}: {path} {'is not a file' if path.exists() else 'not found'} {RESTORE}"
    try:
        count = safetensors_count(path)
    except (OSError, ValueError, RecursionError) as e:
        return f"{where}: {path} is not a safetensors file ({type(e).__name__}: {' '.join(str(e).split())[:160]}) {RESTORE}"
    return None if count else f"{where}: {path} holds no tensors {RESTORE}"


ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
              "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


def safetensors_count(path: Path) -> int:
    """The tensors a safetensors file holds, from its header (an 8-byte length, then JSON naming each
    tensor's dtype, shape and byte range), checked as safetensors checks it: every range inside the
    file and as long as its shape and dtype say. ValueError when it is not such a file. Reading the
    header needs neither torch nor the library; no tensor is read."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= n <= min(size - 8, 100 * 2**20):
            raise ValueError(f"its header length {n} does not fit the file of {size} bytes")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    data = size - 8 - n
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, t in tensors.items():
        shape, span = (t.get("shape"), t.get("data_offsets")) if isinstance(t, dict) else (None, None)
        ok = (isinstance(t, dict) and t.get("dtype") in ITEM_BYTES and isinstance(shape, list)
              and all(type(d) is int and d >= 0 for d in shape) and isinstance(span, list) and len(span) == 2
              and all(type(o) is int for o in span) and 0 <= span[0] <= span[1] <= data)
        if not ok or span[1] - span[0] != math.prod(shape) * ITEM_BYTES[t["dtype"]]:
            raise ValueError(f"its entry for {name[:60]!r} is not a tensor inside the file")
    return len(tensors)


def json_object(path: Path, where: str) -> tuple[dict | None, str | None]:
    """(the JSON object in `path`, None) or (None, the problem line naming the file)."""
    if not path.is_file():
        return None, f"{where}: {path} {'is not a file' if path.exists() else 'not found'} {RESTORE}"
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        return None, f"{where}: {path} cannot be read as JSON ({type(e).__name__}: {' '.join(str(e).split())[:160]}) {RESTORE}"
    if not isinstance(obj, dict):
        return None, f"{where}: {path} holds a JSON {type(obj).__name__}, not an object {RESTORE}"
    return obj, None
