"""The speed decider: the one place that decides how a run goes fast on its device.

From the config, the device, the model's shape, the process count, the free memory and a bounded
sample of one process's steps (`Work`: their rows and tokens, known before the first step), `decide` chooses
- compiled decoder layers (train.compile: auto is on with CUDA, off on CPU, where compiling costs
  more than a short run saves);
- CUDA graphs: off, each layer recorded (8-bit optimizers, which cannot be recorded), or the whole
  step (fused AdamW), and how many padded lengths packed rows go to (train.cuda_graphs);
- gradient checkpointing (train.gradient_checkpointing);
- a QLoRA base kept dequantized in bf16 instead of dequantized in every pass;
- DDP's gradient buckets;
- Inductor's combo kernels (independent kernels launched as one) where compiled layers run without
  graphs: there the host issues every launch, and the 8B step is bound by it (a steady-state profile:
  the GPU idles after launches that came late, and no launch call waits for room in the queue).
Every combination the config allows is costed, memory by `memory.estimate` and time a step by the
model below; of those whose memory fits the free GPU memory with `MARGIN` to spare, the shortest step
wins, and of steps within `TIE` of it the least set-up (`fastest`). How long the run is does not enter:
a trial of 30 steps, an epoch and three epochs run one program, and so does each process count with
the same batch a process (buckets and shards apart). Nothing else in ddptune makes these choices. Each choice
comes with its reason, a code and its numbers (summary.json's `speed`), worded by `reasons.render` (the run's banner).

The time model, per process and step. Its constants were fitted on an H200 (16-core host, torch 2.11)
and hold on an H100 (the 8B step below: 0.222 s estimated, 0.221 s measured); on any card each is
scaled by what `card.py` measures there against the H100's figures (`card.Card.factors`):
- GPU: FLOPs / (`RATE_SHARE` x the GPU's matrix rate), but never under one kernel's latency
  (`KERNEL_S`) times the step's kernels (`KERNELS_PER_LAYER` a layer and forward); a 4-bit base
  adds its dequantization, `DEQUANT_BYTES_S` a pass (two passes, three with checkpointing).
  8B QLoRA, 16 SAMSum samples: 0.209 s measured with a dequantized base (the model: 0.21 s).
- host, without graphs: `HOST_S_PER_LAYER` a compiled layer and forward, and for a 4-bit base
  `HOST_S_PER_4BIT_MATMUL` for each of bitsandbytes' matmul calls (295 µs measured a call).
  SmolLM2-135M shape: 0.152 s measured, 0.15 s modelled; 8B 4-bit: 0.279 s measured, 0.29 s.
- a step is the larger of the two. With the whole step recorded the host issues nothing, so a
  step is the GPU's time over the padded rows (SmolLM2 shape: 26-27 ms measured); layer graphs
  leave `HOST_S_PER_LAYER_GRAPHED` a layer. Where the kernels' latency bounds the GPU, padding
  costs nothing in this model, less than measured: SmolLM2's step with 2 lengths took 24.3 ms
  against 26.9 with 1 (12.6 % padding against 24.6 %).
- set-up, measured cold (an empty compiler cache, a user's first run) on an H200: compiled layers
  without graphs compile for changing shapes in the first step (`DYNAMIC_COMPILE_S`: SmolLM2-135M
  75.4 s, 8B QLoRA with checkpointing 74 s, without 88-103 s); with graphs each padded length is
  compiled for its static shapes and recorded instead (`LENGTH_S`: SmolLM2's 4 step shapes at one
  length in 21.7 s, 8B's 5 in 21.7 s), plus DDP's warm-up steps; eager layers (the CPU) have no
  set-up. Set-up only breaks ties: where padding costs nothing (a step bound by kernel latency) one
  recorded length wins; where it costs (a step bound by the GPU's FLOPs) the unpadded path does.
Gradient checkpointing costs one more forward (FLOPs, launches and dequantization), so it is
chosen only where the run would not fit without it. A dequantized base costs 2 bytes a weight
instead of about 0.5; with checkpointing and graphs it measured 15 % slower a step, so it is not
combined with both. Under FSDP the base stays 4-bit: it would be dequantized before sharding, so
every process would first hold the whole bf16 base (what sharding a 4-bit base is for), and its
shards, all-gathered twice a step, would be 4x the bytes; a bf16 base that fits sharded is LoRA's,
which `ddptune plan` offers. Otherwise FSDP's candidates are DDP's without CUDA graphs, each costed
with sharded memory. One DDP bucket (all-reduced after the backward) measured 1.5 % faster a step
on two NVLink H200s; elsewhere (PCIe, several machines) torch's overlapping buckets stay.

`DDPTUNE_SPEED` forces choices for a benchmark (`graphs=off|layers|step,lengths=N,checkpointing=
true|false,dequantize=true|false,bucket_mb=N,compile=true|false,combo=true|false`); summary.json records what it forced.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass, field

from ddptune import batches, card as card_lib, data, memory, metrics, ways
from ddptune.config import Config, ConfigError
from ddptune.reasons import Reason, render

DDP_WARMUP = 11               # eager DDP steps before a whole-step capture (PyTorch's notes on DDP under whole-network capture)
MARGIN = 0.10                 # free memory kept spare: the plan has been up to 8 % under measured peaks
RATE_SHARE = 0.56             # of the card's 8192^3 GEMM rate a fine-tuning step's GEMMs reach (8B: 435 of 776 TFLOP/s)
FALLBACK_TFLOPS = 300.0       # a GPU whose matrix rate is not known
KERNEL_S = 5.5e-6             # a small kernel's time on the GPU, launch to launch
KERNELS_PER_LAYER = 157       # kernels of one decoder layer's forward and backward (LoRA, compiled)
DEQUANT_BYTES_S = 2.2e12      # bytes a second the 4-bit dequantization writes and reads (2.5 a weight)
HOST_S_PER_LAYER = 5.0e-3     # host time to issue one compiled layer's forward and backward
HOST_S_PER_LAYER_GRAPHED = 0.5e-3
HOST_S_PER_4BIT_MATMUL = 0.3e-3
DYNAMIC_COMPILE_S = 75.0      # compiled layers without graphs: the first step's compile for changing shapes
LENGTH_S = 22.0               # with graphs: one padded length's static-shape compile and recording
GRAPH_COUNTS = (1, 2, 4)      # padded lengths tried
FORCE_ENV = "DDPTUNE_SPEED"
FORCE_KEYS = {"graphs": ("off", "layers", "step"), "lengths": int, "checkpointing": bool, "dequantize": bool,
              "bucket_mb": float, "compile": bool, "combo": bool}
WORK_STEPS = 64  # steps whose shares the choices are estimated from (Work.of)
TIE = 0.01       # step estimates this close are equal: the one with less set-up wins


@dataclass(frozen=True)
class Work:
    """What one process computes a step: each step's packed rows' tokens and targets, from the same
    split the steps will use."""
    rows: list[tuple[int, int]]    # (tokens, targets) of every packed row of the sampled steps
    forwards: float                # forwards a step
    tokens: float                  # real tokens a step
    targets: float                 # loss targets a step

    @classmethod
    def of(cls, stream: batches.Stream) -> "Work":
        """From at most WORK_STEPS steps spread evenly over one pass of the data, as one process meets
        them (the examples at one process's batch): the same sample, and so the same program, for a
        trial of a few steps, one epoch or several, and at each process count with the same batch a
        process (`scale`'s same-per-device runs). A long run's choices take the time a short one's do."""
        one = dataclasses.replace(stream, global_batch=max(stream.global_batch // stream.parts, 1), parts=1)
        steps = max(len(stream.examples) // one.global_batch, 1)  # a mixture's epoch draws as many
        picked = sorted({steps * k // WORK_STEPS for k in range(WORK_STEPS)}) if steps > WORK_STEPS else range(steps)
        rows, forwards = [], 0
        for s in picked:
            share = one.share(s)
            forwards += len(share.forwards[0])
            rows += [(batches.tokens_of(g), batches.target_tokens(g)) for g in share.forwards[0]]
        n = max(len(picked), 1)
        return cls(rows, forwards / n, sum(t for t, _ in rows) / n, sum(t for _, t in rows) / n)


    @classmethod
    def assumed(cls, cfg: Config, world: int) -> "Work":
        """Without the data to sample (on the hub until the run fetches it): a forward a step of the
        config's largest (memory.forward_tokens), TARGET_SHARE of it loss targets, as plan's table assumes."""
        tokens = memory.forward_tokens(cfg, world)
        return cls(rows=[], forwards=1.0, tokens=float(tokens), targets=float(math.ceil(tokens * memory.TARGET_SHARE)))


@dataclass(frozen=True, kw_only=True)
class Speed:
    """The choices, each with its reason (a code and its numbers, rendered to words by `reasons.render`)."""
    compiled: bool
    graphs: str                    # off | layers | step
    lengths: int                   # padded lengths with graphs, else 0
    sizes: tuple[int, ...]         # those lengths in tokens (from the sampled rows), else ()
    checkpointing: bool
    dequantize: bool
    bucket_mb: float | None        # None: torch's default
    combo: bool = False            # compiled layers combine independent kernels into one launch
    fits: bool | None = True       # the least memory of the options costed is within the free memory (None: a
                                   # mixture, no estimate); what the admission asks (memory_problems)
    reasons: dict[str, Reason] = field(default_factory=dict)
    forced: dict = field(default_factory=dict)
    estimate: dict = field(default_factory=dict)

    def lines(self) -> list[str]:
        return [render(name, reason) for name, reason in self.reasons.items()]

    def as_dict(self) -> dict:
        """The record (summary.json's `speed`, the plan's JSON): each reason as its code and numbers, no words."""
        return {**dataclasses.asdict(self), "reasons": {name: r.as_dict() for name, r in self.reasons.items()}}

    def unrecorded(self, why: str) -> "Speed":
        """These choices once recording the whole step failed: compiled layers at the padded lengths, no graphs."""
        reasons = {**self.reasons, "CUDA graphs": Reason(code="recording_failed", numbers={"why": why})}
        return dataclasses.replace(self, graphs="off", reasons=reasons)


@dataclass(frozen=True)
class Option:
    checkpointing: bool
    dequantize: bool
    graphs: str
    lengths: int


def forced() -> dict:
    """The choices DDPTUNE_SPEED forces (benchmarks only); ConfigError for a malformed value."""
    text = os.environ.get(FORCE_ENV, "").strip()
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, _, raw = item.partition("=")
        kind = FORCE_KEYS.get(key)
        value = _value(kind, raw)
        if kind is None or value is None:
            known = ", ".join(f"{k}={'|'.join(v) if isinstance(v, tuple) else v.__name__}" for k, v in FORCE_KEYS.items())
            raise ConfigError([f"{FORCE_ENV}: {item[:80]!r} is not one of {known} (or unset it)"])
        out[key] = value
    return out


def _value(kind, raw: str):
    if isinstance(kind, tuple):
        return raw if raw in kind else None
    if kind is bool:
        return {"true": True, "false": False}.get(raw.lower())
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value > 0 else None


def flops_of(cfg: Config, shape: memory.Shape) -> metrics.FlopModel:
    """The FLOP model of the config's model before it is loaded: what each sample costs."""
    return metrics.FlopModel.of_shape(shape, cfg.train.method, cfg.lora.r, list(cfg.lora.target_modules))


def stream_of(cfg: Config, train_set, flops: metrics.FlopModel, world: int, global_batch: int) -> batches.Stream:
    """The run's steps over `world` processes: the training examples, each costed by the FLOPs it takes."""
    t = cfg.train
    return batches.Stream(examples=train_set, costs=flops.sample(train_set.lengths, train_set.targets), targets=train_set.targets,
                          global_batch=global_batch, parts=world, seed=t.seed, packing=t.packing, micro_batch_size=t.micro_batch_size,
                          tokens_per_forward=t.tokens_per_forward, max_length=cfg.data.max_length, lockstep=t.strategy == "fsdp",
                          mix=data.mixture(cfg.data, train_set.sizes))


# ---------------------------------------------------------------------------------------------
# The decision


def decide(cfg: Config, cuda: bool, shape: memory.Shape, world: int, free_gib: float | None, work: Work,
           card: card_lib.Card | None = None, link: str = "", one_machine: bool = True) -> Speed:
    """The fastest allowed combination that fits `free_gib` (None: no fixed budget, CPU), with reasons;
    on CUDA timed for `card` (None: the reference card's figures)."""
    t, force = cfg.train, forced()
    compiled = force.get("compile", t.compile is True or (t.compile == "auto" and cuda and not shape.dynamic))
    options = candidates(cfg, cuda, compiled, force, shape.dynamic)
    card = card or card_lib.REFERENCE
    rate = (card.matrix_tflops if cuda else FALLBACK_TFLOPS) * 1e12 * RATE_SHARE
    factors = card.factors() if cuda else card_lib.REFERENCE.factors()
    costed = [(o, memory_gib(cfg, shape, world, o, work, compiled, not cuda),
               *time_s(cfg, shape, o, work, rate, compiled, factors)) for o in options]
    budget = None if free_gib is None else free_gib * (1 - MARGIN)
    fitting = [c for c in costed if budget is None or c[1] <= budget]
    best = fastest(fitting) if fitting else min(costed, key=lambda c: c[1])
    choice = best[0]
    bucket_mb, bucket_why = bucket(cfg, shape, world, cuda, link, one_machine, force)
    reasons = {"compiled layers": compile_reason(t.compile, compiled, cuda, "compile" in force, shape.dynamic)}
    reasons["gradient checkpointing"] = checkpoint_reason(t.gradient_checkpointing, choice, costed, free_gib, force)
    if t.method == "qlora":
        reasons["4-bit base"] = dequantize_reason(choice, costed, budget, force, t.strategy, cuda)
    reasons["CUDA graphs"] = graphs_reason(cfg=cfg, cuda=cuda, compiled=compiled, choice=choice, best=best, fitting=fitting,
                                           force=force, dynamic=shape.dynamic)
    reasons["DDP gradient buckets"] = bucket_why
    combo = force.get("combo", compiled and cuda and choice.graphs == "off")
    reasons["combined kernels"] = combo_reason(combo, compiled, cuda, force)
    least = min(c[1] for c in costed)  # the least memory any option takes: whether the job fits at all
    estimate = {"step_s": best[2], "setup_s": best[3], "memory_gib": best[1], "free_gib": free_gib, "least_gib": least,
                "card": {"name": card.name, "source": card.source, "factors": factors} if cuda else None,
                "options": [{**dataclasses.asdict(o), "memory_gib": m, "step_s": s, "setup_s": u}
                                                 for o, m, s, u in costed]}
    sizes = tuple(padded(work, choice.lengths)[3]) if choice.graphs != "off" else ()
    fits = None if shape.experts else free_gib is None or least <= free_gib
    return Speed(compiled=compiled, graphs=choice.graphs, lengths=choice.lengths, sizes=sizes, checkpointing=choice.checkpointing,
                 dequantize=choice.dequantize, bucket_mb=bucket_mb, combo=combo, fits=fits, reasons=reasons, forced=force,
                 estimate=estimate)


def for_device(*, cfg: Config, shape: memory.Shape, work: Work, world: int, device, free_gib: float | None,
                link: str = "", one_machine: bool = True) -> Speed:
    """`decide` for a run on `device` (a torch.device): a CUDA card's figures measured once and cached
    (card.of), the reference's on a CPU. `ddptune train` and `ddptune plan` both decide here (`plan
    --gpu-memory`, for GPUs that need not be this machine's, calls `decide` with the reference card's figures)."""
    cuda = device.type == "cuda"
    return decide(cfg=cfg, cuda=cuda, shape=shape, world=world, free_gib=free_gib, work=work,
                  card=card_lib.of(device) if cuda else None, link=link, one_machine=one_machine)


def fastest(costed: list) -> tuple:
    """The option of the shortest step: estimates within TIE of it count as equal, and of those the one
    that compiles and records least (then the one that needs least memory) wins. A run's length does not
    enter: a trial of a few steps, an epoch and three epochs run one program."""
    quickest = min(c[2] for c in costed)
    return min((c for c in costed if c[2] <= quickest * (1 + TIE)), key=lambda c: (c[3], c[1]))


def memory_problems(cfg: Config, shape: memory.Shape, world: int, chosen: Speed) -> list[str]:
    """A GPU run's refusal, one line with the way out `ddptune plan` recommends, where even the least
    memory of the options the decider costed (checkpointing on where `auto`) exceeds the free memory;
    none where it fits, where train.memory_check is off, without a budget, or for a mixture (no
    estimate: `ddptune plan` says so). FSDP first loads the whole model onto each GPU: that must fit too."""
    t, free = cfg.train, chosen.estimate.get("free_gib")
    if not t.memory_check or free is None or shape.experts:
        return []
    if t.strategy == "fsdp" and (load := memory.load_gib(shape, t.method)) > free:
        return [f"memory: train.strategy=fsdp: each process loads the whole model onto its GPU before sharding it, "
                f"{load:.1f} GiB for {t.method} fine-tuning of {cfg.model.source}, more than {free:.1f} GiB "
                "(loading on the meta device is not supported yet: use GPUs with more memory"
                + {"full": ", or train.method=lora", "lora": ", or train.method=qlora"}.get(t.method, "") + ")"]
    if chosen.fits:
        return []
    need = chosen.estimate["least_gib"]
    p = ways.plan(cfg, shape, world, free)
    way = next((o for o in p["options"] if o["fits"]), None)
    fix = p["recommendation"] + (f" ({way['total']:.1f} GiB per GPU)" if way else "")
    return [f"memory: {t.method} fine-tuning of {cfg.model.source} needs about {need:.1f} GiB per GPU, more than "
            f"{free:.1f} GiB; the way out: {fix} (`ddptune plan` shows each term; train.memory_check=false tries anyway)"]


def run_choices(cfg, shape: memory.Shape, gpus: int, gpu_memory: float | None, assume: bool = False):
    """(`decide`'s choices for the run, where they are for), as `ddptune train` makes them: on
    this machine's device, or on GPUs of `gpu_memory` GiB, from a sample of the steps; (None, why)
    where the batch does not divide over `gpus`, or where the data or its tokenizer is on the hub
    (with `assume`: from the config's largest forward, enough to say whether the run fits, not how
    its steps pad)."""
    import torch

    from ddptune import batchplan, comm, model as model_lib, system
    from ddptune.data import tokenized

    try:
        global_batch = batchplan.batch_plan(cfg.train, gpus).global_batch
    except ConfigError as e:
        return None, f"no run choices ({e.problems[0]})"
    if any(s.source.startswith("hub:") for s in data.sources(cfg.data, "train")) or \
            (tokenizer := model_lib.local_tokenizer(cfg.model, cfg.data)) is None:
        if not assume:
            return None, "the run's choices are made by `ddptune train` once it has the data and tokenizer from the hub"
        work, sample = Work.assumed(cfg, gpus), " (the data is on the hub: the config's largest forward assumed)"
    else:
        train_set, _ = tokenized.load(tokenized.prepare(cfg.data, tokenizer))
        work, sample = Work.of(stream_of(cfg, train_set, flops_of(cfg, shape), gpus, global_batch)), ""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if gpu_memory is not None:
        cuda, free, where = True, gpu_memory, f"on GPUs of {gpu_memory:g} GiB, timed as the reference {card_lib.REFERENCE.name}"
    else:
        cuda, free = device.type == "cuda", system.free_gib(device, gpus)
        where = (f"on this machine's {torch.cuda.get_device_name(device)}" if cuda else "on this machine's CPU") + (
            f" ({free:.1f} GiB free a process)" if free is not None else "")
    if gpu_memory is not None:  # GPUs not here: the reference card's figures
        chosen = decide(cfg=cfg, cuda=True, shape=shape, world=gpus, free_gib=free, work=work)
    else:
        chosen = for_device(cfg=cfg, shape=shape, work=work, world=gpus, device=device, free_gib=free,
                            link=comm.link(device, gpus) if cuda else "")
    return chosen, f"{where}, {gpus} process{'es' if gpus > 1 else ''}{sample}:"


def gpu_memory_problems(cfg: Config, world_size: int, gpu_memory: float) -> list[str]:
    """Whether the run fits GPUs of `gpu_memory` GiB, as the speed decider would choose for them
    (speed.memory_problems; hub data: its largest forward assumed); none where the model's config
    cannot be read (loading will say why)."""
    try:
        shape = memory.model_shape(cfg)
    except Exception:  # noqa: BLE001 - no config to size the model by: the load will say what is wrong
        return []
    chosen, _ = run_choices(cfg, shape, world_size, gpu_memory, assume=True)
    return memory_problems(cfg, shape, world_size, chosen) if chosen else []


def unrecordable(cfg: Config, cuda: bool, compiled: bool, dynamic: str = "") -> str | None:
    """Why no step of this run can be recorded as CUDA graphs (None: it can): graph eligibility, once."""
    t = cfg.train
    return ("no CUDA device" if not cuda else dynamic if dynamic else "compiled layers are off" if not compiled else
            "needs train.packing=true" if not t.packing else "needs train.strategy=ddp" if t.strategy != "ddp" else None)


def candidates(cfg: Config, cuda: bool, compiled: bool, force: dict, dynamic: str = "") -> list[Option]:
    """Every combination the config (and DDPTUNE_SPEED) allows; none recorded where the layers' work
    changes with the data (`dynamic`, memory.dynamic_reason)."""
    t = cfg.train
    if "checkpointing" in force:
        ckpt = [force["checkpointing"]]
    elif t.gradient_checkpointing != "auto":
        ckpt = [bool(t.gradient_checkpointing)]
    else:
        ckpt = [False, True]
    if force.get("dequantize") and t.strategy == "fsdp":
        raise ConfigError([f"{FORCE_ENV}: dequantize=true needs train.strategy=ddp (FSDP shards the 4-bit base; "
                           "or dequantize=false)"])
    dequant = [force["dequantize"]] if "dequantize" in force else [False, True] if (
        t.method == "qlora" and cuda and t.strategy == "ddp") else [False]
    scope = "step" if t.optimizer == "adamw" else "layers"  # only torch's fused AdamW can be recorded
    blocked = unrecordable(cfg, cuda, compiled, dynamic)
    if "graphs" in force:
        if force["graphs"] != "off" and blocked:
            raise ConfigError([f"{FORCE_ENV}: graphs={force['graphs']} cannot be recorded here: {blocked} (or graphs=off)"])
        scopes = [force["graphs"]]
    else:
        scopes = ["off"] if blocked or t.cuda_graphs is False else [scope] if t.cuda_graphs is True else ["off", scope]
    counts = [force["lengths"]] if "lengths" in force else list(GRAPH_COUNTS)
    out = []
    for c, d, g in itertools.product(ckpt, dequant, scopes):
        if g != "off" and c and d and not force:  # measured slower a step than either alone
            continue
        out += [Option(c, d, g, k) for k in (counts if g != "off" else [0])]
    return out


def padded(work: Work, lengths: int) -> tuple[float, int, int, list[int]]:
    """With `lengths` padded lengths: (computed tokens over real ones, the longest padded row, its
    padded target rows, the lengths); without (0): (1, the longest row, its targets, [])."""
    if not work.rows:
        return 1.0, 0, 0, []
    tokens = [t for t, _ in work.rows]
    targets = max(n for _, n in work.rows)
    if not lengths:
        return 1.0, max(tokens), targets, []
    sizes = batches.pad_lengths(tokens, lengths, batches.GRAPH_PAD)
    total = sum(min(s for s in sizes if s >= n) for n in tokens)
    return total / max(sum(tokens), 1), max(sizes), batches.target_rows(targets), sizes


def memory_gib(cfg: Config, shape: memory.Shape, world: int, o: Option, work: Work, compiled: bool, cpu: bool = False) -> float:
    _, tokens, targets, _ = padded(work, o.lengths)
    shards = world if cfg.train.strategy == "fsdp" else 1
    job = memory.job_of(cfg=cfg, world=world, checkpointing=o.checkpointing, shards=shards, tokens=tokens or None,
                        targets=targets or None, compiled=compiled, cpu=cpu)
    job = dataclasses.replace(job, dequantized=o.dequantize, graphs=o.graphs)
    return memory.estimate(shape, job)["total"] / memory.GIB


def time_s(cfg: Config, shape: memory.Shape, o: Option, work: Work, rate: float,
           compiled: bool = True, factors: dict | None = None) -> tuple[float, float]:
    """(seconds a step, seconds of set-up: compiling and recording) of option `o`, with layers
    `compiled` or not: the model of the module docstring, its constants scaled by the card's `factors`
    (card.Card.factors; set-up, the host compiling, is not scaled)."""
    f = factors or card_lib.REFERENCE.factors()
    t = cfg.train
    passes = 3 if o.checkpointing else 2  # forward, backward, and the forward checkpointing repeats
    per_weight = 2 * passes + (2 if t.method == "full" else 0)
    stretch = padded(work, o.lengths)[0]
    tokens, head = work.tokens * stretch, shape.vocab * shape.hidden
    trained = 0 if t.method == "full" else shape.lora_params(cfg.lora.r, list(cfg.lora.target_modules))
    flops = per_weight * (shape.matrix_params * tokens + head * work.targets) + 6 * trained * tokens
    launches = shape.layers * max(work.forwards, 1) * passes / 2
    gpu = max(flops / rate, KERNEL_S * f["kernel"] * KERNELS_PER_LAYER * launches)
    four_bit = t.method == "qlora" and not o.dequantize
    if four_bit:
        gpu += passes * shape.matrix_params * 2.5 / DEQUANT_BYTES_S * f["dequant"]
    if o.graphs == "off":
        host = launches * HOST_S_PER_LAYER * f["host"]
        if four_bit:
            host += len(memory.PROJECTIONS) * launches * 2 * HOST_S_PER_4BIT_MATMUL * f["host_4bit"]
    else:
        host = launches * HOST_S_PER_LAYER_GRAPHED * f["host"] if o.graphs == "layers" else 0.0
    step = max(gpu, host)
    if o.graphs != "off":
        setup = o.lengths * LENGTH_S + (DDP_WARMUP * gpu if o.graphs == "step" else 0.0)
    else:
        setup = DYNAMIC_COMPILE_S if compiled else 0.0
    return step, setup


# ---------------------------------------------------------------------------------------------
# Reasons: a code and the numbers its line shows (reasons.render words them)


def _forced(**chosen) -> Reason:
    """A choice DDPTUNE_SPEED forced: the reason holds what it chose."""
    return Reason(code="forced", numbers=chosen)


def compile_reason(setting, compiled: bool, cuda: bool, forced_: bool, dynamic: str = "") -> Reason:
    if forced_:
        return _forced(on=compiled)
    if setting != "auto":
        return Reason(code="set_by_config", numbers={"on": compiled, "setting": str(setting).lower()})
    if dynamic and cuda:
        return Reason(code="dynamic_layers", numbers={"why": dynamic})
    return Reason(code="cuda" if cuda else "cpu")


def combo_reason(combo: bool, compiled: bool, cuda: bool, force: dict) -> Reason:
    if "combo" in force:
        return _forced(on=combo)
    return Reason(code="launched_one_by_one" if combo else "not_compiled" if not compiled else
                  "no_cuda" if not cuda else "step_recorded")


def checkpoint_reason(setting, choice: Option, costed: list, free_gib: float | None, force: dict) -> Reason:
    if "checkpointing" in force:
        return _forced(on=choice.checkpointing)
    if setting != "auto":
        return Reason(code="set_by_config", numbers={"on": choice.checkpointing, "setting": str(setting).lower()})
    if free_gib is None:
        return Reason(code="no_budget")
    without = min(m for o, m, _, _ in costed if not o.checkpointing)  # `auto` costs every option without it
    numbers = {"memory_gib": without, "free_gib": free_gib}
    if choice.checkpointing:
        return Reason(code="does_not_fit_without", numbers={**numbers, "share": 1 - MARGIN})
    return Reason(code="fits_without", numbers=numbers)


def dequantize_reason(choice: Option, costed: list, budget: float | None, force: dict, strategy: str = "ddp",
                      cuda: bool = True) -> Reason:
    if "dequantize" in force:
        return _forced(dequantized=choice.dequantize)
    if strategy == "fsdp":
        return Reason(code="fsdp_shards_4bit")
    if not cuda:
        return Reason(code="cpu_base_as_loaded")
    same = [c for c in costed if c[0].checkpointing == choice.checkpointing and c[0].graphs == choice.graphs
            and c[0].lengths == choice.lengths]
    other = next((c for c in same if c[0].dequantize != choice.dequantize), None)
    mine = next(c for c in same if c[0] == choice)
    steps = {"step_s": mine[2], "other_step_s": other[2] if other else None}
    if choice.dequantize:
        return Reason(code="dequantized_faster", numbers={**steps, "memory_gib": mine[1]})
    if other is None:
        return Reason(code="not_tried_with_both")
    if budget is not None and other[1] > budget:
        return Reason(code="dequantized_does_not_fit", numbers={"memory_gib": other[1], "budget_gib": budget})
    return Reason(code="four_bit_faster", numbers=steps)


def graphs_reason(cfg: Config, cuda: bool, compiled: bool, choice: Option, best: tuple, fitting: list,
                  force: dict, dynamic: str = "") -> Reason:
    chosen = {"graphs": choice.graphs, "lengths": choice.lengths}
    if "graphs" in force:
        return _forced(**chosen)
    why_not = unrecordable(cfg, cuda, compiled, dynamic)
    if why_not:
        return Reason(code="unrecordable", numbers={"why": why_not})
    if cfg.train.cuda_graphs is False:
        return Reason(code="set_by_config", numbers={**chosen, "setting": "false"})
    off = [c[2] for c in fitting if c[0].graphs == "off"]
    on = [c[2] for c in fitting if c[0].graphs != "off"]
    if choice.graphs != "off":
        return Reason(code="graphs_faster" if off else "graphs_only_option",
                      numbers={**chosen, "step_s": best[2], "other_step_s": min(off, default=None), "setup_s": best[3]})
    if not on:
        return Reason(code="graphs_do_not_fit")
    return Reason(code="graphs_not_faster", numbers={"step_s": best[2], "other_step_s": min(on)})


def bucket(cfg: Config, shape: memory.Shape, world: int, cuda: bool, link: str, one_machine: bool,
           force: dict) -> tuple[float | None, Reason]:
    """DDP's bucket size in MiB (None: torch's default) and why."""
    if "bucket_mb" in force:
        return force["bucket_mb"], _forced(bucket_mb=force["bucket_mb"])
    if cfg.train.strategy != "ddp":
        return None, Reason(code="fsdp_reduce_scatters")
    if world == 1:
        return None, Reason(code="one_process")
    trained = shape.params if cfg.train.method == "full" else \
        shape.lora_params(cfg.lora.r, list(cfg.lora.target_modules)) + shape.saved_params(cfg.lora.modules_to_save)
    mib = trained * 4 / 2**20
    if cuda and one_machine and link == "NVLink" and cfg.train.method != "full":
        size = math.ceil(mib) + 1
        return size, Reason(code="nvlink_one_bucket", numbers={"bucket_mb": size, "gradients_mib": mib})
    return None, Reason(code="overlapping_buckets" if cuda else "cpu_processes")
