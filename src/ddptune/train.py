"""`ddptune train`: data-parallel fine-tuning, one process per device, the same code for 1 and N.

Read top to bottom: `setup()` (validate, join the process group, data, model, optimizer) →
`fit()` (the loop; `train_step()` is one optimizer step) → `finish()` (check, save, evaluate).

Each optimizer step takes a fixed global batch of samples. Every process knows every sample, so
each one computes the same split of the step: shares of equal cost (tokens and attention FLOPs,
`data.balance`), so no process waits for a busier one at the all-reduce. Gradients are all-reduced
once, on the last backward of the step. The loss is the sum over summary tokens divided by the
number of summary tokens in the whole global batch (counted on the host: no communication), so N
processes take exactly the step that one process would take with N times the samples.
Nothing in a step waits for the device: its figures are read one step later, while the next
step runs.
"""
from __future__ import annotations

import gc
import hashlib
import json
import math
import signal
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import AutocastKwargs, set_seed
from tqdm.auto import tqdm

from ddptune import checkpoint, checks, config as config_lib, data, dist, evaluate, metrics, model as model_lib, plan as plan_lib
from ddptune import rundir, timeline
from ddptune.config import BatchPlan, Config, ConfigError


class NonFinite(RuntimeError):
    """The loss or gradient norm of a step is not a finite number: training stops."""


class Interrupted(Exception):
    """SIGINT or SIGTERM reached a process: the step was finished and checkpointed, then training stopped."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


GC_EVERY = 50  # optimizer steps between collections of Python's young generations (every process at once)
GRAPH_PAD = 256  # with train.cuda_graphs, packed rows are padded to multiples of this (train.cuda_graph_lengths of them)


@dataclass
class Run:
    """What setup() builds and the loop uses."""
    cfg: Config
    plan: BatchPlan
    accelerator: Accelerator
    out: Path
    tokenizer: Any
    train_set: list[dict]
    val_set: list[dict]
    model: Any            # what is saved, checkpointed and evaluated (a PEFT model, or the full model)
    loss_model: Any       # model_lib.CausalLMLoss around `model`
    ddp_model: Any        # `loss_model` as accelerator.prepare wrapped it: DDP with several processes;
                          # with strategy fsdp `loss_model` itself, sharded in place (FSDP2)
    optimizer: Any
    scheduler: Any
    clock: dist.StepClock
    flops: metrics.FlopModel
    costs: list[float]    # model FLOPs of each training example: what the processes' shares balance
    targets: list[int]    # summary tokens of each training example
    start: int            # optimizer steps already done (resume)
    total_steps: int
    checkpointing: bool
    compiled: bool
    graphs: bool          # compiled layers replayed as CUDA graphs
    load_s: float
    started: float = 0.0  # perf_counter when setup began: the run's wall time counts from here
    eval_s: float = 0.0   # validation and generation (zero-shot, final), the run's "eval" time
    graph_lengths: list[int] = field(default_factory=list)  # with graphs: the lengths packed rows are padded to
    step_graphs: Any = None  # with train.cuda_graph_scope=step: the recorded steps (StepGraphs)


@dataclass
class Share:
    """Who computes what in one optimizer step (the same answer on every process)."""
    forwards: list[list[list[dict]]]  # each process's examples, grouped per forward pass
    targets: int             # summary tokens of the whole global batch: every loss divides by it
    tokens: list[int]        # real tokens of each process
    computed: list[int]      # tokens each process computes (real tokens plus padding)
    cost: list[float]        # model FLOPs of each process


# ---------------------------------------------------------------------------------------------
# setup


def run(cfg: Config, resume: bool = False):
    """Train as configured; every process calls this. Returns (summary, trained model)."""
    r = setup(cfg, resume)
    try:
        history, times = fit(r)
        return finish(r, history, times)
    finally:
        stop_trackers(r)


def start_trackers(r: Run) -> None:
    """train.log_with: accelerate's tracker on the main process, with the resolved config as its
    hyperparameters. TensorBoard writes output_dir/tensorboard/ (its project name is the folder);
    W&B and MLflow log to project / experiment `ddptune`, the run named after output_dir."""
    log_with = r.cfg.train.log_with
    if log_with == "none":
        return
    flat = {}
    for section, values in config_lib.to_dict(r.cfg).items():
        for key, value in values.items() if isinstance(values, dict) else [(None, values)]:
            # hyperparameters must be numbers, strings or booleans (TensorBoard's add_hparams)
            flat[f"{section}.{key}" if key else section] = value if isinstance(value, (int, float, str, bool)) else str(value)
    name = r.out.resolve().name
    init = {"wandb": {"name": name}, "mlflow": {"run_name": name}}
    r.accelerator.init_trackers("tensorboard" if log_with == "tensorboard" else "ddptune", config=flat, init_kwargs=init)


def stop_trackers(r: Run) -> None:
    """Flush and close the trackers, also after an error. (Not accelerator.end_training, which
    also destroys the process group: the CLI leaves it when the command ends, dist.teardown.)"""
    for tracker in r.accelerator.trackers:
        tracker.finish()
    r.accelerator.trackers.clear()


def track(r: Run, row: dict) -> None:
    """One metrics.jsonl row to the trackers (main process only; its numbers, at its step)."""
    if r.cfg.train.log_with != "none":
        values = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        r.accelerator.log(values, step=row["step"])


def setup(cfg: Config, resume: bool = False) -> Run:
    started = time.perf_counter()
    accelerator = dist.setup(cfg.train.precision, cfg.train.strategy, log_with=cfg.train.log_with, logging_dir=cfg.output_dir,
                             bucket_mb=cfg.train.ddp_bucket_mb)
    world = accelerator.num_processes
    if dist.validated_by_parent():  # `--nproc`: the parent validated before starting us
        plan = config_lib.batch_plan(cfg.train, world)
    else:  # the process that talks to the user validates; the others wait for its verdict
        plan = dist.on_main(accelerator, lambda: checks.validate(cfg, world, resume))
    if accelerator.device.type == "cuda":  # `ddptune plan` against this GPU's free memory, before loading (CPUs have no fixed budget)
        free = torch.cuda.mem_get_info(accelerator.device)[0] / plan_lib.GIB + plan_lib.CUDA_CONTEXT_GIB  # our context is in use already
        if problems := dist.on_main(accelerator, lambda: checks.memory_problems(cfg, world, free)):
            raise ConfigError(problems)
    out = Path(cfg.output_dir)
    if accelerator.is_main_process:
        rundir.mark(out)  # first: whatever happens next, this folder is a run that --overwrite may clear
        (out / "config.yaml").write_text(config_lib.dump(cfg))
    t0 = time.perf_counter()

    tokenizer = model_lib.load_tokenizer(cfg.model)
    train_set, val_set = load_data(cfg, tokenizer, accelerator)
    accelerator.print(f"ddptune: data ready in {time.perf_counter() - t0:.1f}s; loading {cfg.model.source} ...")
    if cfg.data.train.startswith("hub:"):  # file data was counted by checks.validate
        if problems := checks.rows_problems(len(train_set), plan):
            raise ConfigError(problems)
    total_steps = cfg.train.max_steps or max(1, math.floor(cfg.train.epochs * len(train_set) / plan.global_batch))
    if cfg.train.profile_steps and total_steps < cfg.train.profile_after + cfg.train.profile_steps:
        raise ConfigError([f"train.profile_steps: {cfg.train.profile_steps} steps after {cfg.train.profile_after} warm-up steps "
                           f"do not fit a run of {total_steps} steps (profile fewer steps or train longer)"])

    t1 = time.perf_counter()
    model, checkpointing, compiled = build_model(cfg, accelerator, plan)
    accelerator.print(f"ddptune: model loaded in {time.perf_counter() - t1:.1f}s")
    optimizer, scheduler = build_optimizer(cfg, model, total_steps, capturable=whole_step(cfg, accelerator))
    flops = metrics.FlopModel.of(model, cfg.train.method)
    loss_model = model_lib.CausalLMLoss(model)
    # The scheduler stays outside accelerator.prepare: accelerate's wrapper would step it once per
    # process for every optimizer step (it assumes each process's dataloader moved on); this loop
    # counts optimizer steps itself. A step recorded whole needs DDP built on the stream that records.
    side = torch.cuda.Stream(accelerator.device) if whole_step(cfg, accelerator) else None
    with on_stream(side):
        ddp_model, optimizer = accelerator.prepare(loss_model, optimizer)
    clock = dist.StepClock(accelerator.device)
    dist.time_gradient_sync(ddp_model, clock)
    graphs = compiled and cfg.train.cuda_graphs and accelerator.device.type == "cuda"

    start = resume_from(out, model, optimizer, scheduler, accelerator, plan.global_batch, total_steps) if resume else 0
    targets = [data.target_tokens([e]) for e in train_set]
    costs = [flops.sample(len(e["input_ids"]), t) for e, t in zip(train_set, targets)]
    r = Run(cfg, plan, accelerator, out, tokenizer, train_set, val_set, model, loss_model, ddp_model, optimizer,
            scheduler, clock, flops, costs, targets, start, total_steps, checkpointing, compiled, graphs,
            time.perf_counter() - t0, started)
    if graphs:
        prepare_graphs(r, side)
    announce(r)
    return r


def whole_step(cfg: Config, accelerator: Accelerator) -> bool:
    """Whether each optimizer step is replayed as recorded CUDA graphs (train.cuda_graph_scope step,
    or auto with AdamW)."""
    return config_lib.records_whole_step(cfg.train) and accelerator.device.type == "cuda"


@contextmanager
def on_stream(stream):
    """Work issued inside runs on `stream`, after what the current stream has queued, and the current
    stream waits for it afterwards. None: nothing changes."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream(stream.device).wait_stream(stream)


def resume_from(out: Path, model, optimizer, scheduler, accelerator: Accelerator, global_batch: int,
                total_steps: int | None = None) -> int:
    """Restore the newest checkpoint that reads back whole (an older one, with a warning, when the
    newest is damaged); return its step. Any process count may resume it with the run's global batch."""
    problems = []
    for path in reversed(checkpoint.list_checkpoints(out / "checkpoints")):
        try:
            state, error = checkpoint.load(path, model, optimizer, scheduler, accelerator.process_index, total_steps), None
        except ValueError as e:
            state, error = None, str(e)
        # All processes move on together: FSDP's parts are read one per process, so one damaged part
        # fails on its process only, and the others must not resume from a later step than it.
        if errors := list(dict.fromkeys(e for e in dist.gather(error) if e)):
            problems += errors
            accelerator.print(f"ddptune: warning: {errors[0]}; trying the one before")
            continue
        if state.get("global_batch", global_batch) != global_batch or (
                "global_batch" not in state and state["world_size"] != accelerator.num_processes):
            raise ConfigError([f"--resume: {path} was written by {state['world_size']} processes with "
                               f"{state.get('global_batch', '?')} samples per optimizer step: set train.effective_batch_size to "
                               f"that, or resume with --nproc {state['world_size']}"])
        return state["step"]
    raise ConfigError([f"--resume: no checkpoint in {out / 'checkpoints'} can be read back"] + problems)


def load_data(cfg: Config, tokenizer, accelerator: Accelerator) -> tuple[list[dict], list[dict]]:
    """Tokenized train and validation examples; the main process tokenizes, the others read its cache."""
    cache = Path(cfg.output_dir) / "cache"
    tok_id = model_lib.fingerprint(tokenizer)
    with accelerator.main_process_first():
        train_rows = data.load_split(cfg.data.train, cfg.data.train_rows, cfg.data)
        train = data.tokenize_cached(train_rows, tokenizer, cfg.data, cache, tok_id, accelerator.is_main_process)
        val = []
        if cfg.data.val:
            val_rows = data.load_split(cfg.data.val, cfg.data.val_rows, cfg.data)
            val = data.tokenize_cached(val_rows, tokenizer, cfg.data, cache, tok_id, accelerator.is_main_process)
    return train, val


def build_model(cfg: Config, accelerator: Accelerator, plan: BatchPlan):
    """The model with adapters, whether gradient checkpointing is on, and whether layers are compiled."""
    t = cfg.train
    with accelerator.main_process_first():  # a preset checkpoint or hub download is made once
        base = model_lib.load_model(cfg.model, t.method, accelerator.device, t.precision, t.seed)
    if t.dequantize_base:
        base = model_lib.dequantize_base(base, t.precision, accelerator.device)
    # what training adds to the loaded model without checkpointing: activations, gradients, optimizer states
    shards = plan.world_size if t.strategy == "fsdp" else 1  # FSDP holds 1/n of the weights, gradients and states
    est = plan_lib.estimate(plan_lib.shape_of(base.config), plan_lib.job_of(cfg, plan.world_size, checkpointing=False, shards=shards))
    added = est["activations"] + est["gradients"] + est["optimizer"]
    checkpointing = model_lib.use_checkpointing(t.gradient_checkpointing, added, accelerator.device)
    set_seed(t.seed)  # adapters start equal on every process
    model = model_lib.add_adapters(base, t.method, cfg.lora, checkpointing)
    compiled = t.compile is True or (t.compile == "auto" and accelerator.device.type == "cuda")
    if compiled:
        step = whole_step(cfg, accelerator)  # static shapes, recorded by the step's graphs rather than their own
        model_lib.compile_layers(model, t.cuda_graphs and accelerator.device.type == "cuda" and not step, static=step)
    return model, checkpointing, compiled


def build_optimizer(cfg: Config, model, total_steps: int, capturable: bool = False):
    """AdamW (torch's fused one on a GPU) or bitsandbytes' 8-bit AdamW, and the learning-rate schedule.
    `capturable`: the update can be recorded in a CUDA graph; its learning rate is then a tensor on
    the GPU, which the schedule fills in place each step."""
    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    if t.optimizer == "adamw":
        lr = torch.tensor(t.lr, device=params[0].device) if capturable else t.lr
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=t.weight_decay, fused=params[0].is_cuda, capturable=capturable)
    else:  # bitsandbytes' 8-bit states (note: they synchronize the GPU after every parameter)
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if t.optimizer == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        opt = cls(params, lr=t.lr, weight_decay=t.weight_decay)
    sched = transformers.get_scheduler(t.lr_schedule, opt, num_warmup_steps=t.warmup_steps, num_training_steps=total_steps)
    return opt, sched


def prepare_graphs(r: Run, side=None) -> None:
    """A few shapes for the whole run (each new length is a compile and a recording): the lengths
    that pad the packed rows every process will see least; and gradients allocated once, outside
    the graphs' memory, which every replay overwrites. With train.cuda_graph_scope=step, every
    step's shape this process will meet is then recorded (on `side`, the stream DDP was built on)."""
    forwards = [split_step(r, step).forwards for step in range(r.start, r.total_steps)]  # the same on every process
    groups = [group for step in forwards for rank in step for group in rank]
    rows = [tokens_of(group) for group in groups]
    r.graph_lengths = data.pad_lengths(rows, r.cfg.train.cuda_graph_lengths, GRAPH_PAD)
    padded = sum(padded_length(r, n) for n in rows)
    for p in r.model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    t0 = time.perf_counter()
    with on_stream(side):
        warm_graphs(r, {padded_length(r, n): g for n, g in zip(rows, groups)}, sorted({data.padded_targets(g) for g in groups}))
        mine = {}  # shape of this process's step -> its rows in one step of that shape
        for step in forwards if side is not None else []:
            mine.setdefault(step_shape(r, step[r.accelerator.process_index]), step[r.accelerator.process_index])
        if mine:  # (none when a resumed run has no step left)
            r.step_graphs = StepGraphs(r, mine, side)
    warm_s = time.perf_counter() - t0
    r.load_s += warm_s
    recorded = f"{len(r.step_graphs.graphs)} step shapes recorded whole" if r.step_graphs else "compiled and recorded"
    r.accelerator.print(f"ddptune: CUDA graphs: packed rows padded to {', '.join(map(str, r.graph_lengths))} tokens "
                        f"({1 - sum(rows) / padded:.0%} of the computed tokens are padding), {recorded} in {warm_s:.1f}s")


def warm_graphs(r: Run, rows: dict[int, list[dict]], head_rows: list[int]) -> None:
    """Compile and record the layers' graphs at every padded length before the first step, each
    with one packed row of the run (`rows`: padded length -> row), every process all of them. Else
    each length compiles in the step where it first comes, seconds in the middle of the run, and a
    step time measured over those steps (`ddptune scale`) counts them. Twice per length: a new
    shape's first call runs as a warm-up, the second records. Then the output head (not in a graph)
    forward and backward at each padded target count of the run (`head_rows`, data.pad_targets).
    Nothing of it stays: no gradient is all-reduced (no_sync), the gradients are zeroed after, and
    the random state is put back."""
    acc = r.accelerator
    r.ddp_model.train()  # a model from from_pretrained is in eval mode, and dynamo guards on it: compile what fit runs
    devices = [acc.device] if acc.device.type == "cuda" else []  # (its index is None in a process of its own)
    with torch.random.fork_rng(devices=devices), acc.no_sync(r.ddp_model):
        for length, group in sorted(rows.items()):
            for _ in range(2):
                batch = to_device(collate(r.cfg, group, r.tokenizer.pad_token_id, length), acc.device)
                torch.compiler.cudagraph_mark_step_begin()
                with acc.autocast():
                    loss = r.ddp_model(**batch, num_items=1)
                acc.backward(loss * 0)
        head = r.loss_model.head.weight
        for n in head_rows:  # the gradient of the head's input only: the same matrix products as a step's
            hidden = torch.zeros(n, head.shape[1], device=head.device, dtype=head.dtype, requires_grad=True)
            with acc.autocast():
                loss = r.loss_model.head_loss(hidden, torch.zeros(n, dtype=torch.long, device=head.device))
            torch.autograd.grad(loss, hidden)
    for p in r.model.parameters():
        if p.grad is not None:
            p.grad.zero_()


DDP_WARMUP = 11  # eager DDP steps before a capture (PyTorch's notes on DDP under whole-network capture)


def step_shape(r: Run, forwards: list[list[dict]]) -> tuple:
    """What a recorded step is recorded for: each packed row's (tokens, boundary entries, target rows)."""
    return tuple(data.packed_shape(g, padded_length(r, tokens_of(g)), r.cfg.data.max_length) for g in forwards)


class StepGraphs:
    """train.cuda_graph_scope=step: this process's optimizer steps as two recorded CUDA graphs each.

    For every step shape (`step_shape`) one graph holds the forwards and backwards, DDP's all-reduce
    in the last; one graph for all shapes clips, sums the loss over the processes, updates and
    zeroes the gradients. Their inputs live at fixed addresses (`inputs`, `num_items`); a step copies
    its rows there and replays both. The recordings share one memory pool (they never run at once;
    what outlives a replay, the gradients, optimizer states and `figures`, is allocated outside it).

    Recorded before the first step, in this order (PyTorch's notes on whole-network capture): every
    layer compiled at every length (warm_graphs), then DDP_WARMUP forwards and backwards through DDP
    whose all-reduces sum zeros, then the optimizer's state created by an update that moves nothing.
    Processes record different shapes at their own pace: a recording runs nothing, collectives included.
    """

    def __init__(self, r: Run, rows: dict[tuple, list[list[dict]]], stream):
        device = r.accelerator.device
        self.stream, self.pool = stream, torch.cuda.graph_pool_handle()
        self.num_items = torch.ones((), device=device)   # summary tokens of the global batch
        self.loss_sum = torch.zeros((), device=device)   # this process's loss, out of the backward graph
        self.figures = torch.zeros(2, device=device)     # the step's summed loss and gradient norm
        self.optimizer = getattr(r.optimizer, "optimizer", r.optimizer)  # torch's, not accelerate's wrapper
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.inputs: dict[tuple, list[dict]] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.buckets: dict[tuple, int] = {}
        self.warm_ddp(r, next(iter(rows.values()))[0])
        self.start_optimizer(device)
        for shape, forwards in rows.items():
            self.record_backward(r, shape, forwards)
        self.update = self.record(lambda: self.clip_and_update(r))

    def record(self, work) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                work()
        except RuntimeError as e:
            raise ConfigError([f"train.cuda_graph_scope: recording the step failed ({dist.first_line(e)}): "
                               "set train.cuda_graph_scope=layers"]) from e
        return graph

    def warm_ddp(self, r: Run, group: list[dict]) -> None:
        """DDP_WARMUP forwards and backwards of one row through DDP, every process as many: the
        all-reduces sum zeros (DDP settles its buckets), the gradients are zeroed after."""
        acc = r.accelerator
        batch = to_device(forward_batch(r, group), acc.device)
        for _ in range(DDP_WARMUP):
            with acc.autocast():
                loss = r.ddp_model(**batch, num_items=1)
            acc.backward(loss * 0)
        torch._foreach_zero_([p.grad for p in self.params])

    def start_optimizer(self, device: torch.device) -> None:
        """The fused AdamW creates its state in its first update: one at learning rate 0 with zero
        gradients (it moves no weight), then its step counts back to 0. A resumed run has its state.
        Its learning rate becomes a tensor on the GPU (a resumed one may have come back as a number)."""
        for group in self.optimizer.param_groups:
            if not (torch.is_tensor(group["lr"]) and group["lr"].device == device):
                group["lr"] = torch.tensor(float(group["lr"]), device=device)
        if self.optimizer.state:
            return
        lrs = [group["lr"].clone() for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"].zero_()
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"].copy_(lr)
        for state in self.optimizer.state.values():
            state["step"].zero_()

    def record_backward(self, r: Run, shape: tuple, forwards: list[list[dict]]) -> None:
        acc, world = r.accelerator, r.accelerator.num_processes
        inputs = [to_device(forward_batch(r, group), acc.device) for group in forwards]

        def autocast():  # without its cache, which would outlive the recording
            return acc.autocast(autocast_handler=AutocastKwargs(cache_enabled=False))

        r.clock.buckets = 0

        def work():
            self.loss_sum.zero_()
            for k, batch in enumerate(inputs):
                with (nullcontext() if k == len(inputs) - 1 else acc.no_sync(r.ddp_model)), autocast():
                    loss = r.ddp_model(**batch, num_items=self.num_items)
                acc.backward(loss * world)  # DDP averages over processes: make it a sum (train_step)
                self.loss_sum.add_(loss.detach())

        self.graphs[shape] = self.record(work)
        self.inputs[shape], self.buckets[shape] = inputs, r.clock.buckets

    def clip_and_update(self, r: Run) -> None:
        norm = torch.nn.utils.clip_grad_norm_(self.params, r.cfg.train.max_grad_norm or float("inf"), foreach=True)
        loss = self.loss_sum.clone()
        if r.accelerator.num_processes > 1:
            torch.distributed.all_reduce(loss)
        self.figures.copy_(torch.stack([loss.float(), norm.float()]))
        self.optimizer.step()
        torch._foreach_zero_([p.grad for p in self.params])

    def replay(self, r: Run, share: Share, forwards: list[list[dict]]) -> torch.Tensor:
        """Run one optimizer step on these rows: copy them to the inputs of their shape and replay."""
        shape = step_shape(r, forwards)
        for inputs, group in zip(self.inputs[shape], forwards):
            for name, t in forward_batch(r, group).items():
                if torch.is_tensor(t):
                    inputs[name].copy_(t.pin_memory(), non_blocking=True)
        self.num_items.fill_(share.targets)
        self.graphs[shape].replay()
        r.clock.mark("synced")
        self.update.replay()
        r.clock.buckets = self.buckets[shape]
        return self.figures


def announce(r: Run) -> None:
    say, cfg, acc = r.accelerator.print, r.cfg, r.accelerator
    trainable, total = model_lib.count_params(r.model)
    say(f"ddptune: {cfg.model.source} | {cfg.train.method} | {trainable:,} of {total:,} parameters trained"
        f" | gradient checkpointing {'on' if r.checkpointing else 'off'} | compiled layers {'on' if r.compiled else 'off'}"
        + (" as CUDA graphs" if r.graphs else ""))
    say(f"ddptune: {acc.num_processes} process(es) on {acc.device.type} ({acc.distributed_type.value}, "
        f"mixed precision {acc.mixed_precision}){', ' + cfg.model.attn_implementation + ' attention' if cfg.train.packing else ''}")
    say(f"ddptune: {r.plan.describe()}" + ("; each step's samples split into shares of equal cost" if acc.num_processes > 1 else ""))
    for note in config_lib.batch_notes(cfg.train):
        say(f"ddptune: note: {note}")
    say(f"ddptune: {len(r.train_set)} training examples, {len(r.train_set) / r.plan.global_batch:.1f} steps per epoch, "
        f"{r.total_steps} steps" + (f", resuming after step {r.start}" if r.start else ""))


# ---------------------------------------------------------------------------------------------
# fit: the loop and one optimizer step


def fit(r: Run) -> tuple[list[dict], list[tuple[dict, dict]]]:
    """Run the optimizer steps; return metrics.jsonl's rows and this process's (times, share) per step."""
    cfg = r.cfg
    # From here on a process that hangs or dies ends the run within train.timeout_minutes (setup keeps
    # torch's default: rank 0 may validate, download and tokenize for long while the others wait).
    dist.set_timeout(cfg.train.timeout_minutes)
    if cfg.eval.enabled and cfg.eval.zero_shot and cfg.train.method != "full" and not r.start:
        t0 = time.perf_counter()
        with r.model.disable_adapter():  # the base model, before any step
            evaluate.evaluate(r.model, r.tokenizer, evaluate.eval_rows(cfg), cfg, r.accelerator, r.out / "eval-base",
                              "zero-shot")
        r.eval_s += time.perf_counter() - t0
    book = Bookkeeping(r)
    r.ddp_model.train()
    gc.disable()  # Python's collector would pause each process at its own moment: collect on all at once instead
    step = r.start
    try:
        with profiling(r) as profiler:
            for step in range(r.start, r.total_steps):
                book.launched(train_step(r, step))  # and the previous step is read while this one runs
                profiler.step()
                if step == r.start:
                    gc.freeze()  # the model, data and compiled graphs live all run: never scan them again
                if step % GC_EVERY == 0:
                    gc.collect(1)
                book.between_steps(step + 1)
            book.read_pending()
    except RuntimeError as e:
        if not dist.collective_failed(e):
            raise
        saved = checkpoint.list_checkpoints(r.out / "checkpoints")
        raise dist.Stalled(f"step {step + 1}: {dist.first_line(e)}: another process hung (it waited more than "
                           f"train.timeout_minutes={cfg.train.timeout_minutes:g}) or died; newest checkpoint: "
                           f"{saved[-1] if saved else 'none'} (see that process's output, then continue with --resume)") from None
    finally:
        book.close()
        gc.unfreeze()
        gc.enable()
        if r.step_graphs:  # their memory pool goes back for evaluation
            r.step_graphs = None
            torch.cuda.empty_cache()
    return book.history, book.times


class Bookkeeping:
    """Everything fit does around the steps, on every process: read each launched step one step
    late and log it (rank 0: metrics.jsonl, trackers, the bar); between steps, agree with the other
    processes (dist.ControlChannel) on stopping, on a checkpoint falling due and on who straggles,
    then validate, save or stop, all at the same step everywhere."""

    def __init__(self, r: Run):
        self.r, main = r, r.accelerator.is_main_process
        self.log = metrics.JsonlWriter(r.out / "metrics.jsonl", keep_until_step=r.start) if main else None
        start_trackers(r)
        self.bar = tqdm(total=r.total_steps, initial=r.start, desc="train", disable=not main, dynamic_ncols=True)
        self.history, self.times, self.pending = [], [], None
        self.peak = metrics.peak_tflops(r.accelerator.device)
        self.control = dist.ControlChannel(r.cfg.train.timeout_minutes)  # SIGINT/SIGTERM, checkpoint times
        self.last_save, self.asked = time.monotonic(), 0

    def launched(self, p: dict) -> None:
        previous, self.pending = self.pending, p
        if previous:
            self.record(previous)

    def read_pending(self) -> None:
        if self.pending:
            self.record(self.pending)
            self.pending = None

    def record(self, p: dict) -> None:
        """Read a launched step's figures (waits for the device to finish it) and log them."""
        r = self.r
        row, mine = read_step(r, p, self.peak)
        if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
            saved = checkpoint.list_checkpoints(r.out / "checkpoints")
            raise NonFinite(f"step {row['step']}: loss {row['loss']}, gradient norm {row['grad_norm']}: stopping before "
                            f"anything non-finite is saved; newest checkpoint: {saved[-1] if saved else 'none'} "
                            "(lower train.lr or train.max_grad_norm, or look at the data)")
        self.history.append(row)
        self.times.append(mine)
        if self.log:
            self.log.write(row)
            track(r, row)
        self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", lr=f"{row['lr']:.2e}")
        self.bar.update(1)

    def between_steps(self, done: int) -> None:
        r, t = self.r, self.r.cfg.train
        # every process's busy time in its newest recorded step (its step less its wait for the others
        # at the all-reduce): they all wait for the slowest, so step times are alike; busy names it
        busy = self.times[-1][0]["step_s"] - self.times[-1][0]["wait_s"] if self.times else 0.0
        due = t.save_every_minutes > 0 and time.monotonic() - self.last_save >= 60 * t.save_every_minutes
        stop, due, seconds = self.control.agree(due, busy)
        self.asked, answered = (self.history[-1]["step"] if self.history else 0), self.asked
        if self.log and (slow := metrics.slow_rank(seconds)):
            self.log.write({"step": answered, "slow_rank": slow[0], "slow_busy_s": slow[1], "others_median_s": slow[2]})
            self.bar.write(f"ddptune: warning: step {answered}: rank {slow[0]} was busy for {slow[1]:.2f} s, the others "
                           f"{slow[2]:.2f} s (a slow or busy machine, or a straggling GPU?)")
        validate = t.val_every and r.val_set and done % t.val_every == 0 and done < r.total_steps
        save = (t.save_every and done % t.save_every == 0) or due or stop
        if validate or save:
            self.read_pending()
        if validate:
            t0 = time.perf_counter()
            val = validation_loss(r.loss_model, r.val_set, t.micro_batch_size, r.tokenizer.pad_token_id, r.accelerator)
            r.eval_s += time.perf_counter() - t0
            if self.log:
                self.log.write({"step": done, "val_loss": val})
                track(r, {"step": done, "val_loss": val})
                self.bar.write(f"step {done}: val_loss {val:.4f}")
        if save:
            save_checkpoint(r, done)
            self.last_save = time.monotonic()
        if validate or save:
            r.clock.pause()  # their time is eval or saving, not the next step's
        if stop:
            raise Interrupted(stop, f"stopped by {signal.Signals(stop).name} after step {done} of {r.total_steps}; "
                              f"saved {r.out / 'checkpoints' / f'{checkpoint.PREFIX}{done:06d}'} (continue with "
                              "the same command and --resume)")

    def close(self) -> None:
        self.control.close()
        self.bar.close()  # whatever is printed next starts on a line of its own
        if self.log:
            self.log.close()


def train_step(r: Run, step: int) -> dict:
    """One optimizer step over this process's share of the step's global batch.

    Forward and backward per packed row (or padded micro-batch); DDP all-reduces the gradients
    in the last backward only (no_sync before it); clip, update, zero. Nothing here waits for
    the device: the loss and gradient norm come back as a copy to the host still in flight, the
    times as events, all read a step later (so the host can queue the next step while the device
    still runs this one).
    """
    acc, world = r.accelerator, r.accelerator.num_processes
    share = split_step(r, step)
    forwards = share.forwards[acc.process_index]
    r.clock.start()
    lr = current_lr(r)
    if r.step_graphs:  # the same step, recorded whole
        figures = to_host(r.step_graphs.replay(r, share, forwards))
        r.scheduler.step()
        return {"step": step, "share": share, "lr": lr, "figures": figures, "marks": r.clock.finish()}
    loss_sum = torch.zeros((), device=acc.device)
    # DDP all-reduces in the last backward only. FSDP reduce-scatters in every one: skipping it would
    # keep whole unsharded fp32 gradients on each GPU until the last forward (twice the memory plan counts).
    sharded = dist.sharded(r.loss_model)
    for k, group in enumerate(forwards):
        # an empty group (sharded runs only, see lockstep): a forward in step with the others that counts nothing
        rows = group or forwards[0][:1]
        batch = to_device(forward_batch(r, rows), acc.device)
        if r.graphs:  # a new forward: the previous replay's outputs are no longer needed
            torch.compiler.cudagraph_mark_step_begin()
        sync = sharded or k == len(forwards) - 1
        with (nullcontext() if sync else acc.no_sync(r.ddp_model)), acc.autocast():
            loss = r.ddp_model(**batch, num_items=share.targets)
        # DDP's all-reduce averages gradients over processes, and so does FSDP2's reduce-scatter
        # (its default divide factor is the process count); scaling by their number makes it a sum.
        acc.backward(loss * (world if group else 0))
        if group:
            loss_sum += loss.detach()
    r.clock.mark("synced")
    grad_norm = acc.clip_grad_norm_(r.optimizer.param_groups[0]["params"], r.cfg.train.max_grad_norm or float("inf"))
    grad_norm = dist.full_tensor(grad_norm)  # sharded gradients give a DTensor norm: the whole one
    r.optimizer.step()
    r.scheduler.step()
    # DDP's gradients are views of its all-reduce buckets (and graphs' must stay put): zero them in place
    r.optimizer.zero_grad(set_to_none=not (r.graphs or dist.ddp_wrapper(r.ddp_model)))
    figures = to_host(torch.stack([acc.reduce(loss_sum, "sum").float(), grad_norm.detach().float()]))
    marks = r.clock.finish()  # after the copy: once the step's end has passed, `figures` holds its loss and norm
    return {"step": step, "share": share, "lr": lr, "figures": figures, "marks": marks}


def current_lr(r: Run) -> float:
    """The learning rate of the step about to run, on the host. A capturable optimizer keeps it on
    the GPU, where reading it would wait for the device: it is the schedule's factor times the base."""
    lr = r.scheduler.get_last_lr()[0]
    if not torch.is_tensor(lr):
        return lr
    base = r.scheduler.base_lrs[0]
    return (r.cfg.train.lr if torch.is_tensor(base) else base) * r.scheduler.lr_lambdas[0](r.scheduler.last_epoch)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` copied to the host as the device's next piece of work, without waiting for it. Read a step
    later (after the step's end event), it waits for that step alone: `.item()` synchronizes the
    whole stream, so it also waited for the step queued since, and the host began each step only
    when the device had run out of work. (On an H200, 8B QLoRA with CUDA graphs, the host now starts
    a step about 100 ms ahead of the device, but the step time did not change: the device still waits
    for the host later in the forward, which launches 32 layers' graphs.)"""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def read_step(r: Run, p: dict, peak: float | None) -> tuple[dict, tuple[dict, dict]]:
    """metrics.jsonl's row for a launched step (waits until the device has finished it)."""
    share, world = p["share"], r.accelerator.num_processes
    times = r.clock.read(p["marks"])  # waits for the step's end: its figures are on the host by then
    loss, grad_norm = p["figures"].tolist()
    mean_cost = sum(share.cost) / world
    row = metrics.step_row(
        p["step"] + 1, loss, p["lr"], grad_norm, r.plan.global_batch, sum(share.tokens),
        share.targets, sum(share.computed), max(len(f) for f in share.forwards), sum(share.cost), times,
        max(share.cost) / mean_cost if mean_cost else 1.0, world, peak, metrics.peak_memory_gib(r.accelerator.device))
    return row, (times, {"tokens": share.tokens, "cost": share.cost, "computed": share.computed})


def split_step(r: Run, step: int) -> Share:
    """The step's global batch split into one share per process, of equal cost (equal sample
    counts too with padded batches, whose micro-batches must line up). Same on every process."""
    world = r.accelerator.num_processes
    idx = data.step_samples(len(r.train_set), r.plan.global_batch, step, r.cfg.train.seed)
    groups = data.balance([r.costs[i] for i in idx], world, equal_sizes=not r.cfg.train.packing)
    ranks = [[idx[j] for j in g] for g in groups]
    forwards = [layout(r.cfg, [r.train_set[i] for i in rank]) for rank in ranks]
    if dist.sharded(r.loss_model):
        forwards = lockstep(forwards)
    tokens = [sum(len(r.train_set[i]["input_ids"]) for i in rank) for rank in ranks]
    if r.graph_lengths:  # every packed row padded to a length the graphs are recorded at
        computed = [sum(padded_length(r, tokens_of(g)) for g in rank) for rank in forwards]
    elif r.cfg.train.packing:
        computed = tokens
    else:
        computed = [sum(len(g) * max(len(e["input_ids"]) for e in g) for g in rank) for rank in forwards]
    return Share(forwards, sum(r.targets[i] for i in idx), tokens, computed, [sum(r.costs[i] for i in rank) for rank in ranks])


def lockstep(forwards: list[list[list[dict]]]) -> list[list[list[dict]]]:
    """Every process's forwards, as many for each as the busiest has. Sharded (FSDP), each forward
    and backward gathers weights from all processes, so they must run the same number (DDP only
    meets them at the last backward). A process with fewer splits its rows of the most samples in
    two (the same samples, in smaller forwards); one left with rows of single samples gets empty
    groups: forwards that count nothing."""
    n = max(len(rows) for rows in forwards)
    out = []
    for rows in forwards:
        rows = list(rows)
        while len(rows) < n:
            i = max(range(len(rows)), key=lambda j: len(rows[j]))
            half = len(rows[i]) // 2
            rows[i:i + 1] = [rows[i][:half], rows[i][half:]] if half else [rows[i]]
            if not half:
                rows.append([])
        out.append(rows)
    return out


def layout(cfg: Config, examples: list[dict]) -> list[list[dict]]:
    """The examples of each forward pass: packed rows of at most tokens_per_forward tokens, or
    padded micro-batches of similar lengths."""
    t = cfg.train
    if t.packing:
        return data.pack(examples, t.tokens_per_forward)
    ordered = sorted(examples, key=lambda e: -len(e["input_ids"]))
    return [ordered[i:i + t.micro_batch_size] for i in range(0, len(ordered), t.micro_batch_size)]


def tokens_of(group: list[dict]) -> int:
    return sum(len(e["input_ids"]) for e in group)


def padded_length(r: Run, tokens: int) -> int:
    """With graphs: the shortest of the run's recorded lengths that holds a row of `tokens`; else 0."""
    return min((n for n in r.graph_lengths if n >= tokens), default=0)


def forward_batch(r: Run, group: list[dict]) -> dict:
    """One forward's examples collated on the host (with graphs, packed to a recorded length)."""
    return collate(r.cfg, group, r.tokenizer.pad_token_id, padded_length(r, tokens_of(group)))


def collate(cfg: Config, group: list[dict], pad_id: int, pad_to: int = 0) -> dict:
    if not cfg.train.packing:
        return data.collate(group, pad_id)
    if pad_to:  # a length the graphs are recorded at
        return data.collate_packed(group, pad_to=pad_to, max_length=cfg.data.max_length)
    return data.collate_packed(group)


def to_device(batch: dict, device: torch.device) -> dict:
    """Tensors to `device` without making the host wait: from pinned memory, asynchronously."""
    if device.type != "cuda":
        return batch
    return {k: v.pin_memory().to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


class _NoProfiler:
    def step(self) -> None:
        pass


def profiling(r: Run):
    """torch.profiler over train.profile_steps steps after the first train.profile_after, or nothing."""
    n = r.cfg.train.profile_steps
    if not n:
        return nullcontext(_NoProfiler())
    activities = [torch.profiler.ProfilerActivity.CPU]
    if r.accelerator.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def write(prof) -> None:  # every process its timeline: a step waits for the slowest, often not rank 0
        if not r.accelerator.is_main_process:
            r.out.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(timeline.trace_path(r.out, r.accelerator.process_index)))
            return
        device = "self_device_time_total" if r.accelerator.device.type == "cuda" else "cpu_time_total"
        tables = [prof.key_averages().table(sort_by=key, row_limit=30) for key in ("self_cpu_time_total", device)]
        (r.out / "profile.txt").write_text("\n\n".join(tables))
        prof.export_chrome_trace(str(timeline.trace_path(r.out, 0)))

    schedule = torch.profiler.schedule(wait=r.cfg.train.profile_after - 1, warmup=1, active=n, repeat=1)
    return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=write)


@torch.no_grad()
@torch.compiler.set_stance("force_eager")  # padded batches without gradients: not what train.compile compiled
def validation_loss(loss_model, examples: list[dict], micro: int, pad_id: int, accelerator: Accelerator) -> float:
    """Token-weighted loss over all validation examples: each process sums its share's token
    losses and counts, the sums are reduced, then divided (never an average of averages).
    `loss_model` is not the DDP wrapper: processes may run different numbers of batches. Sharded
    (FSDP), every forward gathers weights from all processes: each runs as many forwards as the
    busiest one, the extra ones (on one validation example) counting nothing."""
    was_training = loss_model.training
    loss_model.eval()
    world = accelerator.num_processes
    mine = examples[accelerator.process_index::world]
    chunks = [mine[i:i + micro] for i in range(0, len(mine), micro)]
    rounds = math.ceil(math.ceil(len(examples) / world) / micro) if dist.sharded(loss_model) else len(chunks)
    loss_total = torch.zeros((), dtype=torch.float64, device=accelerator.device)  # summed on the device: no sync a batch
    targets = 0  # counted on the host
    for k in tqdm(range(rounds), desc="validation", unit="batch", disable=not accelerator.is_main_process, leave=False,
                  dynamic_ncols=True):
        chunk = chunks[k] if k < len(chunks) else None
        batch = to_device(data.collate(chunk or examples[:1], pad_id), accelerator.device)
        with accelerator.autocast():
            loss = loss_model(**batch, num_items=1).double()
        if chunk:
            loss_total += loss
            targets += data.target_tokens(chunk)
    loss_model.train(was_training)
    sums = torch.stack([loss_total, torch.tensor(float(targets), dtype=torch.float64, device=accelerator.device)])
    sums = accelerator.reduce(sums, "sum")
    return (sums[0] / sums[1]).item()


def save_checkpoint(r: Run, step: int) -> None:
    """Rank 0 writes the checkpoint; sharded (FSDP), every process first writes its own part of the
    weights and optimizer states into the folder rank 0 made, which rank 0 then completes."""
    acc, folder = r.accelerator, r.out / "checkpoints"
    rngs = dist.gather(checkpoint.rng_state())  # every process's RNG, in rank order
    extra = {"world_size": acc.num_processes, "global_batch": r.plan.global_batch}
    weights, optimizer, tmp = model_lib.trainable_state(r.model), r.optimizer, None
    if dist.sharded(r.loss_model):
        tmp = dist.on_main(acc, lambda: checkpoint.atomic_dir(checkpoint.path_of(folder, step)))
        checkpoint.save_shard(tmp, acc.process_index, weights, optimizer)
        acc.wait_for_everyone()
        weights, optimizer, extra["shards"] = None, None, acc.num_processes
    if acc.is_main_process:
        checkpoint.save(folder, step, weights, optimizer, r.scheduler, rngs, extra, tmp)
        checkpoint.prune(folder, r.cfg.train.keep_checkpoints)
    acc.wait_for_everyone()


# ---------------------------------------------------------------------------------------------
# finish


def finish(r: Run, history: list[dict], times: list[tuple[dict, dict]]):
    """Check the replicas agree, write the processes' times, save, evaluate, summarize."""
    cfg, acc, out = r.cfg, r.accelerator, r.out
    train_s = sum(row["step_time_s"] for row in history)
    val_loss = None  # no validation set: null in summary.json (NaN is not JSON)
    t0 = time.perf_counter()
    if r.val_set:
        val_loss = validation_loss(r.loss_model, r.val_set, cfg.train.micro_batch_size, r.tokenizer.pad_token_id, acc)
        if acc.is_main_process:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": r.total_steps, "val_loss": val_loss}) + "\n")
            track(r, {"step": r.total_steps, "val_loss": val_loss})
    r.eval_s += time.perf_counter() - t0
    sharded = dist.sharded(r.loss_model)  # FSDP: each process holds a part, there are no replicas to compare
    fingerprints = None if sharded else dist.gather(replica_fingerprint(r.model))
    peaks = dist.gather(metrics.peak_memory_gib(acc.device))
    per_rank = dist.gather([t for t, _ in times])
    if fingerprints and len(set(fingerprints)) != 1:
        raise RuntimeError(f"replicas diverged: weight hashes per process {fingerprints}")
    final = save_final(r)
    scores = None
    if cfg.eval.enabled:
        t0 = time.perf_counter()
        scores = evaluate.evaluate(r.model, r.tokenizer, evaluate.eval_rows(cfg), cfg, acc, out / "eval", "fine-tuned")
        r.eval_s += time.perf_counter() - t0
    if not acc.is_main_process:
        acc.wait_for_everyone()
        return {}, r.model
    trainable, total = model_lib.count_params(r.model)
    ranks = metrics.rank_rows(r.start, per_rank, [s for _, s in times])
    (out / "ranks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ranks))
    warm = min(metrics.WARMUP_STEPS, max(len(history) - 1, 0))
    summary = {
        "steps": r.total_steps, "world_size": acc.num_processes, "global_batch": r.plan.global_batch,
        "per_process": r.plan.per_process, "grad_accum": r.plan.grad_accum, "micro_batch_size": r.plan.micro_batch_size,
        "packing": cfg.train.packing, "final_loss": history[-1]["loss"] if history else None, "val_loss": val_loss,
        "load_time_s": r.load_s, "train_time_s": train_s, **metrics.summarize_steps(history, warm, acc.num_processes),
        "eval_time_s": r.eval_s, "wall_time_s": time.perf_counter() - r.started,
        "time_split": metrics.split(ranks[warm:]),
        "peak_mem_gib": max(peaks) if None not in peaks else None, "peak_mem_gib_per_process": peaks,
        "train_rows": len(r.train_set), "steps_per_epoch": len(r.train_set) / r.plan.global_batch,
        "method": cfg.train.method, "strategy": cfg.train.strategy, "mixed_precision": acc.mixed_precision,
        # the gradient all-reduces of the last step (DDP's buckets); null: none (one process, or FSDP)
        "ddp_bucket_mb": cfg.train.ddp_bucket_mb,
        "grad_buckets": r.clock.buckets if dist.ddp_wrapper(r.ddp_model) and acc.num_processes > 1 else None,
        "gradient_checkpointing": r.checkpointing, "compiled": r.compiled, "cuda_graphs": r.graphs,
        "cuda_graph_scope": ("step" if whole_step(cfg, acc) else "layers") if r.graphs else None,
        "base_4bit": model_lib.holds_4bit(r.model),
        "trainable_params": trainable, "total_params": total,
        "output": str(final), "replica_fingerprints": fingerprints,
    }
    if scores:
        summary["rouge"] = {k: scores[k] for k in evaluate.ROUGE_KEYS}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    acc.print("\n".join(closing_lines(r, summary, final)))
    acc.wait_for_everyone()
    return summary, r.model


def closing_lines(r: Run, summary: dict, final: Path) -> list[str]:
    """What the end of a run prints: its wall time and where it went, its figures, where each
    output is, and one command to try next."""
    wall, load, train_s, eval_s = summary["wall_time_s"], r.load_s, summary["train_time_s"], r.eval_s
    out = r.out
    lines = [f"ddptune: done in {_duration(wall)}: load {load:.1f}s, train {train_s:.1f}s, eval {eval_s:.1f}s "
             f"(validation and generation), other {max(wall - load - train_s - eval_s, 0):.1f}s (setup, checks, saving)",
             "ddptune: final loss " + ("n/a (no step left to run)" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}")
             + (f", val loss {summary['val_loss']:.4f}" if r.val_set else "")
             + f", {summary['tokens_per_s_per_gpu']:.0f} tokens/s per process"
             + (f", ROUGE-1 {summary['rouge']['rouge1']:.1f}" if "rouge" in summary else "")]
    wrote = [("metrics.jsonl", "a line per step"), ("summary.json", "the run's figures"),
             (final.name + "/", "the trained " + ("model" if r.cfg.train.method == "full" else "adapter")),
             ("eval/", "fine-tuned predictions and ROUGE"), ("eval-base/", "zero-shot predictions and ROUGE"),
             ("tensorboard/", "tensorboard --logdir " + str(out)), ("checkpoints/", "resumable with --resume")]
    lines.append(f"ddptune: wrote {out}/: " + ", ".join(f"{name} ({what})" for name, what in wrote
                                                        if (out / name).exists()))
    if r.cfg.eval.enabled or not r.cfg.data.val:
        lines.append(f"ddptune: next: summarize a dialogue with it: echo '{{\"dialogue\": \"Ann: lunch at 1?\\nBo: sure\"}}' "
                     f"| ddptune predict {out} -")
    else:
        lines.append(f"ddptune: next: score it with ROUGE: ddptune eval {out}")
    return lines


def _duration(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def replica_fingerprint(model) -> str:
    """A hash of this process's trained weights: all processes' are equal when the replicas took
    identical steps (checked at the end of every run)."""
    h = hashlib.sha256()
    for name, p in sorted(model_lib.trainable_state(model).items()):
        h.update(name.encode())
        h.update(p.float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def save_final(r: Run) -> Path:
    """The adapter (PEFT format) or full model, with tokenizer and resolved config, renamed into place.
    Sharded (FSDP), the trained weights are first gathered whole onto rank 0: one plain file set."""
    final = model_lib.trained_weights_dir(r.out, r.cfg.train.method)
    state = None
    if dist.sharded(r.loss_model):
        state = dist.gathered_state_dict(r.model, trainable_only=r.cfg.train.method != "full")
    if r.accelerator.is_main_process:
        tmp = checkpoint.atomic_dir(final)
        model_lib.save_trained(r.model, tmp, state)
        r.tokenizer.save_pretrained(tmp)
        (tmp / "ddptune.yaml").write_text(config_lib.dump(r.cfg))
        checkpoint.commit(tmp, final)
    r.accelerator.wait_for_everyone()
    return final
