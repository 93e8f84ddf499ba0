"""A finished run read back for eval, predict and export: its config, and its trained files checked by their headers.

`trained_run` gives a run folder's config, or one ConfigError naming what is missing (the folder,
its config.yaml, its `model/` or `adapter/`) or damaged (`trained_weights_problems`: a safetensors
file that is cut or holds no tensor, an adapter_config.json that is not LoRA's or does not describe
the adapter's tensors, tokenizer files that do not parse). Nothing is unpickled and no tensor is
loaded: a refusal needs neither torch nor safetensors.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

from ddptune import checks, config as config_lib, rundir
from ddptune.config import Config, ConfigError


def trained_run(run_dir: Path, where: str, overrides: list[str] = ()) -> Config:
    """A finished run's config (its config.yaml, with overrides), or ConfigError naming what is missing:
    the folder, its config.yaml, or the trained weights (`model/` or `adapter/`)."""
    if not run_dir.is_dir():
        raise ConfigError([f"{where}: {run_dir} is not a folder (give a run folder written by ddptune train)"])
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError([f"{where}: {run_dir} has no config.yaml (give a run folder written by ddptune train)"])
    cfg = config_lib.load(run_dir / "config.yaml", overrides)
    if problems := checks.check_values(cfg):
        raise ConfigError(problems)
    weights = rundir.trained_weights_dir(run_dir, cfg.train.method)
    if not weights.is_dir():
        raise ConfigError([f"{where}: {weights} not found (has the run finished? train it to the end, or give a finished run)"])
    if problems := trained_weights_problems(run_dir, cfg.train.method, where):
        raise ConfigError(problems)
    return cfg


RESTORE = "(retrain, or restore the file)"
ADAPTER = "adapter_model.safetensors"


def trained_weights_problems(run_dir: Path, method: str, where: str = "run") -> list[str]:
    """A finished run's trained files, read as far as their headers (nothing unpickled, no tensor
    loaded): the adapter's safetensors file opens and holds a tensor, and its adapter_config.json is
    a JSON object with the keys peft needs (LoRA's r, lora_alpha, target_modules) that describes
    those tensors (`adapter_mismatch`); for full fine-tuning, model/config.json is a JSON object and
    its safetensors files open and hold tensors. Either way the tokenizer saved beside them parses
    (`tokenizer_problems`). One line per damaged file; none when the folder is missing (the caller
    says that)."""
    weights = rundir.trained_weights_dir(run_dir, method)
    if not weights.is_dir():
        return []
    if method == "full":
        files = sorted(weights.glob("*.safetensors"))
        problems = [] if files else [f"{where}: {weights} holds no .safetensors file {RESTORE}"]
        problems += [p for f in files if (p := safetensors_problem(f, where))]
        _, problem = json_object(weights / "config.json", where)
        return problems + ([problem] if problem else []) + tokenizer_problems(weights, where)
    problem = safetensors_problem(weights / ADAPTER, where)
    config, config_problem = json_object(weights / "adapter_config.json", where)
    if config is not None:
        r, alpha, targets = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
        ok = (config.get("peft_type") == "LORA" and type(r) is int and r >= 1
              and isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
              and (isinstance(targets, str) or isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)))
        if not ok:
            config_problem = (f"{where}: {weights / 'adapter_config.json'} is not a LoRA adapter's config (it needs "
                              f"peft_type LORA, a whole r, a numeric lora_alpha and target_modules) {RESTORE}")
        elif problem is None and (mismatch := adapter_mismatch(config, safetensors_shapes(weights / ADAPTER))):
            config_problem = (f"{where}: {weights / 'adapter_config.json'} does not describe adapter_model.safetensors beside "
                              f"it: {mismatch} (restore the config the run saved, or retrain)")
    return [p for p in (problem, config_problem) if p] + tokenizer_problems(weights, where)


PREFIX = "base_model.model."  # what peft puts before a module's name in the saved file
SUFFIXES = {".lora_A.weight": 0, ".lora_B.weight": 1, ".lora_embedding_A": 0, ".lora_embedding_B": 1,
            ".lora_magnitude_vector": None}  # LoRA's tensors, by the axis that holds the rank (DoRA's has none)


def adapter_mismatch(config: dict, shapes: dict[str, list[int]]) -> str | None:
    """Where a LoRA adapter's config does not describe its tensors (names and shapes, as peft saves
    them), or None: each tensor belongs to a module the config targets (target_modules, or
    target_parameters, whose adapters hold a rank of r for each expert) or saves whole
    (modules_to_save); each adapter's rank is r (or its rank_pattern's); each listed target has an
    adapter; DoRA's magnitudes are there exactly when use_dora is. This is what PeftModel's load
    would otherwise fail on ("size mismatch") or skip with a warning (weights left untrained)."""
    targets, parameters = config["target_modules"], config.get("target_parameters") or []
    saved, ranks = config.get("modules_to_save") or [], config.get("rank_pattern") or {}
    if not (isinstance(parameters, list) and isinstance(saved, list) and all(isinstance(n, str) for n in parameters + saved)):
        return "its target_parameters and modules_to_save are not lists of names"
    if not (isinstance(ranks, dict) and all(type(v) is int and v >= 1 for v in ranks.values())):
        return "its rank_pattern is not a map of module names to whole ranks"
    found, dora = set(), False
    try:
        for key, shape in shapes.items():
            name = key.removeprefix(PREFIX)
            suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
            if suffix is None:
                if not any(re.match(rf"(^|.*\.){m}($|\..*)", name) for m in saved):
                    return f"it holds {key}, of no adapter and no module in modules_to_save"
                continue
            module = name.removesuffix(suffix)
            expert = _parameter_target(module, parameters)
            listed = None if expert else _listed_target(module, targets)
            if not expert and not listed:
                return f"it holds {key}, of a module that neither target_modules nor target_parameters names"
            found.add(listed)
            dora |= suffix == ".lora_magnitude_vector"
            if SUFFIXES[suffix] is None:
                continue
            r = next((v for k, v in ranks.items() if re.match(rf"(.*\.)?({k})$", module)), config["r"])
            rank = shape[SUFFIXES[suffix]] if len(shape) >= 2 else None
            if rank is None or (rank % r if expert else rank != r):
                return f"its r is {r} but {key} has the shape {shape}"
    except re.error as e:
        return f"a pattern in it is not a regular expression ({e})"
    if dora != bool(config.get("use_dora")):
        return f"its use_dora is {bool(config.get('use_dora'))} but the tensors hold {'' if dora else 'no '}DoRA magnitudes"
    if isinstance(targets, list) and (missing := [t for t in targets if t not in found]):
        return f"its target_modules names {missing[0]!r}, which no tensor adapts"
    return None


def _listed_target(module: str, targets: str | list[str]) -> str | bool | None:
    """The target_modules entry that `module` matches (peft's rule: the name or its end; a string is a
    regular expression for the whole name), True for a matching string, None for none."""
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, module) is not None or None
    return next((t for t in targets if module == t or module.endswith("." + t)), None)


def _parameter_target(module: str, parameters: list[str]) -> bool:
    """`module` (peft's wrapper of an experts' parameter, one `.base_layer` deeper for each further
    parameter of the same module) holds a parameter that target_parameters names."""
    while module.endswith(".base_layer"):
        module = module.removesuffix(".base_layer")
    owners = [p.rpartition(".")[0] for p in parameters]
    return any(module == o or module.endswith("." + o) for o in owners)


TOKENIZER_JSON = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "chat_template.json")


def tokenizer_problems(weights: Path, where: str) -> list[str]:
    """The tokenizer saved beside the trained weights parses (it is loaded from there by export):
    tokenizer.json (unless a sentencepiece tokenizer.model stands for it) is a JSON object with a
    model, and tokenizer_config.json and the other JSON files, where present, are JSON objects. One line per
    damaged file."""
    problems = []
    if (weights / "tokenizer.json").exists() or not (weights / "tokenizer.model").is_file():
        obj, problem = json_object(weights / "tokenizer.json", where)
        if obj is not None and not isinstance(obj.get("model"), dict):
            problem = f"{where}: {weights / 'tokenizer.json'} is not a tokenizer (it has no model) {RESTORE}"
        problems += [problem] if problem else []
    for name in TOKENIZER_JSON:
        if (weights / name).exists():
            _, problem = json_object(weights / name, where)
            problems += [problem] if problem else []
    return problems


def safetensors_problem(path: Path, where: str) -> str | None:
    """What keeps `path` from being a safetensors file of at least one tensor (its header alone is read)."""
    if not path.is_file():
        return f"{where}: {path} {'is not a file' if path.exists() else 'not found'} {RESTORE}"
    try:
        count = len(safetensors_shapes(path))
    except (OSError, ValueError, RecursionError) as e:
        return f"{where}: {path} is not a safetensors file ({type(e).__name__}: {' '.join(str(e).split())[:160]}) {RESTORE}"
    return None if count else f"{where}: {path} holds no tensors {RESTORE}"


ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
              "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


def safetensors_count(path: Path) -> int:
    return len(safetensors_shapes(path))


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """The tensors a safetensors file holds, by name, with their shapes, from its header (an 8-byte
    length, then JSON naming each tensor's dtype, shape and byte range), checked as safetensors checks
    it: every range inside the file and as long as its shape and dtype say. ValueError when it is not
    such a file. Reading the header needs neither torch nor the library; no tensor is read."""
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
    return {name: t["shape"] for name, t in tensors.items()}


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
