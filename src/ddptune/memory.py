"""Peak memory per GPU, predicted from the model's shape before anything is loaded.

Used by `ddptune plan`'s table of ways (ways.py) and the speed decider (its choices, and its refusal of a
run that will not fit).

Six terms, in bytes per GPU (`estimate`):
- weights: NF4 with double quantization for QLoRA's decoder matrices (`NF4_BYTES` a weight: 4 bits
  plus an 8-bit absmax per 64 weights plus an fp32 absmax per 256 of those); embeddings, norms and
  head stay bf16 in LoRA and QLoRA (`model.add_adapters`); bf16 everything in LoRA (and in QLoRA with
  a dequantized base: the NF4-rounded weights kept in bf16; while it is dequantized, the 4-bit ones are
  still allocated beside them, a peak of its own: `load_peak`); full fine-tuning
  keeps fp32 master weights, and autocast's bf16 copies of the matrices live until backward uses them:
  all of them without checkpointing, the head's and one layer's (the one recomputing) with it.
- adapters: LoRA's r·(d_in + d_out) per adapted projection, in fp32 (peft upcasts them).
- gradients: fp32, one per trained weight (DDP's buckets are views of them), twice over in a DDP group
  of 2 or more (measured; the reducer's buckets, rebuilt after the first step, are the likely holder).
- optimizer: fused AdamW 8 bytes a trained weight (two fp32 states); 8-bit AdamW 2 bytes (paged:
  the same bytes, which may spill to host memory under pressure).
- activations: what one forward of `tokens` tokens keeps for its backward (`activation_bytes`),
  the output head at the `targets` positions only, and the backward's working set.
- graphs: with CUDA graphs, the recorded graphs' memory pool: `GRAPH_POOL` of the activations a
  forward would keep without checkpointing, and with checkpointing under layer graphs
  `GRAPH_POOL_CHECKPOINTED` more (each recorded recomputation keeps its buffers: 8B QLoRA, 4 lengths,
  +10.8 GiB on 8.2 measured on an H200). The whole step recorded with checkpointing measured no such
  pool (8B: 18.8 GiB, against 21.2 unrecorded, which then still held the 4-bit codes).
Then the CUDA context and the caching allocator's slack (`CUDA_CONTEXT_GIB`, `ALLOCATOR_SLACK`),
which torch's max_memory_allocated does not count but the GPU must hold.

Full sharding (FSDP) divides weights, gradients and optimizer states by the GPU count and adds
the gathered layers in flight and the root unit (embeddings and head), gathered through each step,
also over one GPU (FSDP gathers into buffers of its own). A 4-bit base shards its codes (0.5 bytes a
weight) and keeps each layer's quantization state (absmax) whole on every GPU; its gathered layers
are codes too, dequantized one matrix at a time as without FSDP. Each process first loads the whole
model onto its GPU (`load_gib`): a sharded way fits only where that load fits too.
The constants were calibrated against the peaks measured on an H200 (BENCHMARKS.md, "plan against
measured peaks"; tests/test_plan.py keeps every one within PLAN_UNDER under to PLAN_OVER over).
Pure functions of a config and a shape: nothing here loads weights or knows about processes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ddptune import arch
from ddptune.batchplan import batch_plan
from ddptune.config import LORA_DROPOUT, Config

GIB = 2**30
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit code + 8-bit absmax per 64 + fp32 absmax per 256 blocks
CUDA_CONTEXT_GIB = 0.75   # CUDA context, cuBLAS and NCCL workspaces: outside torch's allocator
ALLOCATOR_SLACK = 0.08    # reserved but not allocated (the recipe's run: 13.71 GiB reserved for 12.63 allocated)
# a CPU process's libraries (0.39 GiB after the imports) and what loading leaves held: fitted on the CPU demo
# (SmolLM2-135M LoRA): peak resident 4.55 GiB, 2.44 with checkpointing; modelled 4.41 and 2.45 (in-sample)
CPU_PROCESS_GIB = 1.5
# How far the prediction has been from measured peaks (BENCHMARKS.md, "Plan against measured peaks"): from 4 %
# under to 8 % over, LoRA, QLoRA and full fine-tunes (1B and 8B, DDP and FSDP). A verdict closer than these to
# the GPU's memory is said to be one a run must settle.
PLAN_OVER, PLAN_UNDER = 0.08, 0.04
COMPILED_ACTIVATIONS = 0.85  # compiled decoder layers keep this share of the eager layers' saved tensors
GRAPH_POOL, GRAPH_POOL_CHECKPOINTED = 0.05, 0.35  # the graphs' pool, as shares of the uncheckpointed activations
CHECKPOINT_WORKING = 1.0  # layers' worth of saved tensors alive at once while checkpointed layers recompute
TARGET_SHARE = 0.25       # without data, summaries are assumed at most this share of a forward's tokens
DEFAULT_GPU_GIB = 139.8   # one H200 as torch reports it (used when there is no GPU here and no --gpu-memory)
MAX_GPUS = 1024

# The projections of a Llama-style decoder layer: name -> (d_in, d_out) as functions of the shape.
PROJECTIONS = {
    "q_proj": lambda s: (s.hidden, s.attn_width), "k_proj": lambda s: (s.hidden, s.kv_width),
    "v_proj": lambda s: (s.hidden, s.kv_width), "o_proj": lambda s: (s.attn_width, s.hidden),
    "gate_proj": lambda s: (s.hidden, s.intermediate), "up_proj": lambda s: (s.hidden, s.intermediate),
    "down_proj": lambda s: (s.intermediate, s.hidden),
}


@dataclass(frozen=True)
class Shape:
    """What memory depends on in a Llama-style decoder (Llama, Mistral, Qwen, SmolLM...), and what else the
    architecture defines that the speed choices and the plan must know (arch.Arch)."""
    layers: int
    hidden: int
    intermediate: int             # the MLP width a token passes through (a mixture: its experts x each one's width)
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int = 0              # a mixture of experts: the memory terms here do not model it
    dynamic: str = ""             # why no layer can be compiled for fixed shapes or recorded (empty: they can)
    windows: tuple = ()           # each layer's sliding window (arch.Arch.windows); empty: none anywhere

    @property
    def attn_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's projections."""
        return sum(a * b for a, b in (f(self) for f in PROJECTIONS.values()))

    @property
    def matrix_params(self) -> int:
        return self.layers * self.layer_params

    @property
    def other_params(self) -> int:
        """Embeddings, head (unless tied) and norms: never quantized."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + (2 * self.layers + 1) * self.hidden

    @property
    def params(self) -> int:
        return self.matrix_params + self.other_params

    def lora_params(self, rank: int, targets: list[str]) -> int:
        names = PROJECTIONS if targets == ["all-linear"] else [n for n in PROJECTIONS if n in targets]
        return self.layers * sum(rank * sum(PROJECTIONS[n](self)) for n in names)

    def saved_params(self, names: list[str]) -> int:
        """Weights lora.modules_to_save trains whole: the embeddings and head (one matrix when tied), and
        any projection named, in every layer."""
        ends = {n.rsplit(".", 1)[-1] for n in names}
        big = len(ends & {"embed_tokens", "lm_head"})
        return self.vocab * self.hidden * (min(big, 1) if self.tied else big) + sum(
            self.layers * a * b for a, b in (PROJECTIONS[n](self) for n in ends if n in PROJECTIONS))


def shape_of(hf_config) -> Shape:
    """The Shape of a transformers config (its text part, for multimodal ones)."""
    c = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    a = arch.of(hf_config)
    intermediate = getattr(c, "intermediate_size", None) or 4 * c.hidden_size
    if a.moe:  # the MLP width a token passes through: its experts, each of the per-expert width
        intermediate = a.experts_per_token * (getattr(c, "moe_intermediate_size", None) or intermediate)
    return Shape(layers=c.num_hidden_layers, hidden=c.hidden_size, intermediate=intermediate, heads=heads,
                 kv_heads=getattr(c, "num_key_value_heads", None) or heads, head_dim=head_dim, vocab=c.vocab_size,
                 tied=bool(getattr(c, "tie_word_embeddings", False)), experts=a.experts, dynamic=dynamic_reason(a),
                 windows=a.windows if a.windowed else ())


def dynamic_reason(a: arch.Arch) -> str:
    """Why the layers of architecture `a` change their work with the data (so neither compiling them for
    fixed shapes nor recording them as CUDA graphs holds), or "" where they do not."""
    if a.moe:
        return "a mixture of experts routes a different number of tokens to each expert every step"
    if slow := a.slow_attention():
        return f"{' and '.join(slow)} run through the model's own attention, sample by sample"
    return ""


def model_shape(cfg: Config) -> Shape:
    """The model's Shape from its config alone: a preset, config.json, a GGUF header, or the hub's
    config.json (only that file is fetched). No weights are read."""
    from ddptune import model as model_lib, sources

    src = sources.resolve_source(cfg.model)
    if src.kind == "preset":
        return shape_of(model_lib.preset_config(src.path, "sdpa"))
    from transformers import AutoConfig

    if src.kind == "gguf" and (folder := model_lib.gguf_folder(src, "model", build=False)):
        return shape_of(AutoConfig.from_pretrained(folder))  # converted before: no GGUF header to parse
    return shape_of(AutoConfig.from_pretrained(src.path, gguf_file=src.gguf_file, revision=cfg.model.revision,
                                               trust_remote_code=cfg.model.trust_remote_code))


# ---------------------------------------------------------------------------------------------
# The estimate


@dataclass(frozen=True, kw_only=True)
class Job:
    """What one GPU runs: the method, optimizer, checkpointing and the largest forward."""
    method: str                   # lora | qlora | full
    optimizer: str                # adamw | adamw_8bit | paged_adamw_8bit
    checkpointing: bool
    tokens: int                   # tokens in the largest forward (packed row, or micro-batch x padded length)
    targets: int                  # loss targets (summary tokens) in that forward: the head runs there only
    compiled: bool = True
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ("all-linear",)
    lora_dropout: float = 0.05
    shards: int = 1               # FSDP full shard over this many GPUs; 1: every GPU holds everything
    processes: int = 1            # processes in the group (DDP's reducer exists from 2)
    dequantized: bool = False     # qlora: the base kept in bf16 after quantizing (the speed decider's choice)
    graphs: str = "off"           # CUDA graphs recorded: off, layers or step (the whole step)
    fsdp: bool = False            # sharded by FSDP, also with one shard (it gathers each unit into a copy)
    lora_saved: tuple[str, ...] = ()  # lora.modules_to_save: trained whole, with gradients and optimizer states
    cpu: bool = False             # a CPU process: fp32 weights and activations, no CUDA context


def layer_activation_bytes(s: Shape, job: Job) -> float:
    """Bytes one token leaves saved for backward in one decoder layer (bf16 compute, eager layers):
    each RMSNorm its fp32 input (4h), attention its q, k, v and output (4a + 4kv), SwiGLU the gate and
    up outputs and the SiLU (6i). A frozen projection keeps no input (its weight needs no gradient);
    a trained one does (full: 2h for q, k and v, 2h for gate and up, 2i for down; o's input is attention's
    output). Each LoRA-adapted projection keeps its dropout mask and a bf16 copy of its input (3·d_in,
    2·d_in without dropout). Compiled layers keep `COMPILED_ACTIVATIONS` of that."""
    h, a, kv, i = s.hidden, s.attn_width, s.kv_width, s.intermediate
    per = 2 * 4 * h + 4 * a + 4 * kv + 6 * i
    if job.method == "full":
        per += 4 * h + 2 * i
    else:
        names = PROJECTIONS if list(job.lora_targets) == ["all-linear"] else [n for n in PROJECTIONS if n in job.lora_targets]
        per += (3 if job.lora_dropout > 0 else 2) * sum(PROJECTIONS[n](s)[0] for n in names)
    return per * (COMPILED_ACTIVATIONS if job.compiled else 1.0)


def activation_bytes(s: Shape, job: Job) -> float:
    """Peak activation memory of one forward and its backward: the saved tensors of every layer
    or, with checkpointing, each layer's input (2h a token) plus the layer being recomputed and its
    backward's working set (`CHECKPOINT_WORKING` layers' worth); the output head's fp32
    log-probabilities and their gradients at the loss targets (10 bytes a vocabulary entry), and the
    final hidden states and their gradient."""
    per_layer = job.tokens * layer_activation_bytes(s, job)
    if job.checkpointing:
        saved = job.tokens * s.layers * 2 * s.hidden + CHECKPOINT_WORKING * per_layer
    else:
        saved = s.layers * per_layer
    head = job.targets * s.vocab * 10 + job.tokens * s.hidden * 4
    return saved + head


def load_peak(s: Shape, job: Job) -> float:
    """Bytes held while a QLoRA base is dequantized, before training: its bf16 weights and the 4-bit
    codes they replace, freed once the whole model is done (model.dequantize_base); 0 otherwise."""
    if job.method != "qlora" or not job.dequantized:
        return 0.0
    return s.params * 2 + s.matrix_params * NF4_BYTES


def estimate(s: Shape, job: Job) -> dict:
    """Bytes per GPU of each term, `allocated` (what torch.cuda.max_memory_allocated would read)
    and `total` (with the CUDA context and the allocator's slack: what the GPU must hold). A CPU
    process (`job.cpu`): its host memory, the process's own libraries in place of the CUDA context."""
    n, sharding = job.shards, job.shards > 1 or job.fsdp
    trained = s.params if job.method == "full" else \
        s.lora_params(job.lora_r, list(job.lora_targets)) + s.saved_params(list(job.lora_saved))
    four_bit = job.method == "qlora" and not job.dequantized
    if four_bit:  # the 4-bit codes are sharded; their quantization state (absmax) stays whole with each layer
        weights = s.matrix_params * (0.5 / n + NF4_BYTES - 0.5) + s.other_params * 2 / n
        weights += 2 * max(a * b for a, b in (f(s) for f in PROJECTIONS.values()))  # one matrix dequantized at a time
    elif job.method in ("lora", "qlora"):  # qlora dequantized: bf16 weights as LoRA's
        weights = s.params * 2 / n
    elif not sharding:  # fp32 master weights; autocast's bf16 copies are saved for backward: every matrix's, or
        # with checkpointing only the head's and the recomputing layer's (8B on one H200: 119.8 GiB
        # measured, 119.6 of it weights, gradients and AdamW; every copy would have added 15 GiB)
        copies = s.layer_params + s.vocab * s.hidden if job.checkpointing else s.matrix_params + s.vocab * s.hidden
        weights = s.params * 4 + copies * 2
    else:  # fp32 shards; FSDP computes on gathered bf16 weights, which it frees after each layer
        weights = s.params * 4 / n
    if sharding:  # FSDP (also over one process: it gathers into buffers of its own): a layer's gathered weights
        # (bf16, or 4-bit codes) and the next one's (prefetched), and the root unit (embeddings, head, final norm),
        # which stays gathered from its forward to its backward
        weights += 2 * (0.5 if four_bit else 2) * s.layer_params + s.other_params * 2
    adapters = 0.0 if job.method == "full" else trained * 4 / n
    gradients = trained * 4 / n
    if not sharding and job.processes > 1:  # DDP: 1B full at 2 processes peaked 3.5 GiB above 1 process; the
        gradients *= 2                # reducer's buckets, rebuilt after the first step, are the likely holder
    optimizer = trained * (8 if job.optimizer == "adamw" else 2) / n
    activations = activation_bytes(s, job)
    if job.cpu:  # fp32 compute: every weight and saved activation in 4 bytes, bf16's twice; no autocast copies
        weights, activations = s.params * 4 / n, activations * 2
    graphs = 0.0
    if job.graphs != "off":
        eager = activation_bytes(s, dataclasses.replace(job, checkpointing=False))
        graphs = eager * (GRAPH_POOL + (GRAPH_POOL_CHECKPOINTED if job.checkpointing and job.graphs == "layers" else 0.0))
    allocated = max(weights + adapters + gradients + optimizer + activations + graphs, load_peak(s, job))
    total = allocated + CPU_PROCESS_GIB * GIB if job.cpu else allocated * (1 + ALLOCATOR_SLACK) + CUDA_CONTEXT_GIB * GIB
    return {"weights": weights, "adapters": adapters, "gradients": gradients, "optimizer": optimizer,
            "activations": activations, "graphs": graphs, "overhead": total - allocated, "allocated": allocated,
            "total": total}


# ---------------------------------------------------------------------------------------------
# From a config: the largest forward, and the recommendation


def forward_tokens(cfg: Config, world: int = 1) -> int:
    """Tokens of the largest forward the config allows: a packed row (at most tokens_per_forward,
    and at most the process's samples at max_length), or a padded micro-batch at max_length."""
    t, plan = cfg.train, batch_plan(cfg.train, world)
    if t.packing:
        return min(t.tokens_per_forward, plan.per_process * cfg.data.max_length)
    return t.micro_batch_size * cfg.data.max_length


def job_of(cfg: Config, world: int = 1, checkpointing: bool | None = None, shards: int = 1,
           tokens: int | None = None, targets: int | None = None, compiled: bool | None = None,
           fsdp: bool | None = None, cpu: bool = False) -> Job:
    """The Job a config runs on a GPU, or a CPU process (checkpointing None: as configured, `auto`
    counted as off; fsdp None: sharded over more than one GPU, or train.strategy=fsdp)."""
    t = cfg.train
    tokens = forward_tokens(cfg, world) if tokens is None else tokens
    return Job(method=t.method, optimizer=t.optimizer,
               checkpointing=t.gradient_checkpointing is True if checkpointing is None else checkpointing,
               tokens=tokens, targets=math.ceil(tokens * TARGET_SHARE) if targets is None else targets,
               compiled=t.compile is not False if compiled is None else compiled,
               lora_r=cfg.lora.r, lora_targets=tuple(cfg.lora.target_modules),
               lora_dropout=LORA_DROPOUT if cfg.lora.dropout is None else cfg.lora.dropout, shards=shards, processes=world,
               dequantized=False, graphs=("step" if t.optimizer == "adamw" else "layers") if t.cuda_graphs is True else "off",
               fsdp=shards > 1 or t.strategy == "fsdp" if fsdp is None else fsdp, lora_saved=tuple(cfg.lora.modules_to_save),
               cpu=cpu)


def load_gib(s: Shape, method: str) -> float:
    """GiB one process holds on its GPU while it loads the whole model (before FSDP shards it): fp32
    weights for full fine-tuning, bf16 for LoRA, the 4-bit model for QLoRA (each matrix quantized as it
    arrives: one in bf16 at a time), and the CUDA context."""
    if method == "qlora":
        held = s.matrix_params * NF4_BYTES + s.other_params * 2 + 2 * max(a * b for a, b in (f(s) for f in PROJECTIONS.values()))
    else:
        held = s.params * (4 if method == "full" else 2)
    return held / GIB + CUDA_CONTEXT_GIB
