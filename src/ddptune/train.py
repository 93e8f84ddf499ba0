"""`ddptune train`: data-parallel fine-tuning, one process per device, the same code for 1 and N.

Read top to bottom: `setup()` (validate, join the process group, data, the speed choices, model,
optimizer) → `fit()` (the loop; `train_step()` is one optimizer step) → `finish()` (check, save,
evaluate, summarize).

Each optimizer step takes a fixed global batch of samples, split into shares of equal cost
(batches.Stream), one per process, computed the same on every process. The loss is the sum over
summary tokens divided by the summary tokens of the whole global batch (counted on the host), so N
processes take exactly the step one process would take with all N shares (step.py). Nothing in a
step waits for the device: its figures are read one step later, while the next step runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import set_seed
from transformers import PreTrainedTokenizerBase

from ddptune import admission, arch, batches, batchplan, checkpoint, comm, config as config_lib, data, dist, fallback, generation, graphs
from ddptune import launch, loss as loss_lib, memory, metrics, model as model_lib, report, rundir, runlog, saving, speed as speed_lib
from ddptune import step as step_lib, system
from ddptune.data import store, tokenized
from ddptune.batchplan import BatchPlan
from ddptune.config import Config, ConfigError
from ddptune.stops import Diverged, Interrupted, NonFinite  # how a run stops (start.py gives each its exit code)

GC_EVERY = 50  # optimizer steps between collections of Python's young generations (every process at once)


@dataclass(kw_only=True)
class Run:
    """What setup() builds and the loop uses."""
    cfg: Config
    plan: BatchPlan
    accelerator: Accelerator
    out: Path
    tokenizer: PreTrainedTokenizerBase
    train_set: store.Examples  # a step's examples are read when the step is built
    val_set: store.Examples    # empty without data.val
    model: torch.nn.Module     # what is saved, checkpointed and evaluated (a PEFT model, or the full model)
    loss_model: loss_lib.CausalLMLoss  # around `model`
    optimizer: AcceleratedOptimizer     # accelerate's wrapper (checkpoints hold its state)
    scheduler: AcceleratedScheduler
    level: fallback.Level  # what runs a step: speed choices, the step's parts, the recorded step, the stream
    clock: dist.StepClock
    flops: metrics.FlopModel
    start: int            # optimizer steps already done (resume)
    total_steps: int
    times: dict = field(default_factory=dict)  # started (perf_counter), started_at (time.time), startup_s, load_s, eval_s
    side: torch.cuda.Stream | None = None  # the CUDA stream a recorded step runs on (DDP is built on it)
    trackers: runlog.Trackers | None = None

    def outline(self) -> runlog.Outline:
        """What the run is, as its opening lines and summary.json say it."""
        return runlog.Outline(self.plan, len(self.train_set), self.total_steps, self.start, self.level.speed,
                              self.level.stream.graph_lengths)

    def checkpoints(self) -> saving.Checkpoints:
        """Where the run's checkpoints go and what they hold."""
        return saving.Checkpoints(self.out / "checkpoints", self.model, self.optimizer, self.scheduler,
                                  dist.sharded(self.loss_model), self.plan.global_batch)


# ---------------------------------------------------------------------------------------------
# setup


def run(cfg: Config, resume: bool = False, started: float | None = None, admit=None):
    """Train as configured; every process calls this. Returns (summary, trained model). `started`: when
    the user's command began (time.time() seconds), what its wall time counts from; default: now.
    `admit`: how start.py admits the run on its launch path (called by rank 0 with the process count,
    it decides `resume`); default: validated here, `resume` as given."""
    r = setup(cfg, resume, started, admit)
    try:
        history, times = fit(r)
        with dist.stops_heard():  # a stop heard from the last step on lets the run finish; a second aborts
            return finish(r, history, times)
    finally:
        r.trackers.close()


def setup(cfg: Config, resume: bool = False, started: float | None = None, admit=None) -> Run:
    now, started_at, setup_at = time.perf_counter(), time.time() if started is None else started, time.time()
    began = now - max(setup_at - started_at, 0.0)  # the command's start on this clock: imports, launching counted
    acc = dist.setup(cfg.train.precision, cfg.train.strategy, log_with=cfg.train.log_with, logging_dir=cfg.output_dir)
    world = acc.num_processes
    # admitted once, as start.py's launch path says (by the process that talks to the user); the others take its answer
    admitted = dist.on_main(acc, lambda: admit(world) if admit else admission.validated(cfg, resume, world))
    resume, plan = admitted.resume, admitted.plan
    free = system.free_gib(acc.device, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    out = Path(cfg.output_dir)
    if acc.is_main_process:
        rundir.mark(out)  # first: whatever happens next, this folder is a run that --overwrite may clear
        rundir.write_config(out, cfg)  # config.yaml, and the formats its data resolved to
    t0 = time.perf_counter()
    with model_lib.loading(cfg.model, "tokenizer"):  # a hub that cannot be reached: one line, not a traceback
        tokenizer = model_lib.load_tokenizer(cfg.model, cfg.data)
    # the first process of each machine finds the tokenized data (validation made it) or makes it, checking
    # every row (a refusal stops every process); every process then maps it and holds its index
    prepared = dist.on_node(acc, lambda: tokenized.prepare(cfg.data, tokenizer, progress=sys.stderr.isatty()))
    train_set, val_set = tokenized.load(prepared)
    said = [f"data: {data.selection(cfg.data)}"] if acc.is_main_process else []  # acc.print prints the main process's
    said += [*prepared.notes, f"data ready in {time.perf_counter() - t0:.1f}s; loading {cfg.model.source} ..."]
    acc.print("\n".join(f"ddptune: {line}" for line in said))
    if problems := batchplan.rows_problems(len(train_set), plan):  # hub data, or rows dropped as too long
        raise ConfigError(problems)
    total = batchplan.total_steps(cfg.train, len(train_set), plan.global_batch)
    if problems := batchplan.profile_problems(cfg.train, total) + config_lib.schedule_problems(cfg.train, total):
        raise ConfigError(problems)
    # the speed choices, once, before any weight is loaded: from the model's config, the device, sampled steps
    with model_lib.loading(cfg.model, "model"):
        shape = memory.model_shape(cfg)
    flops = speed_lib.flops_of(cfg, shape)
    stream = speed_lib.stream_of(cfg, train_set, flops, world, plan.global_batch)
    chosen = dist.on_main(acc, lambda: speed_lib.for_device(
        cfg=cfg, shape=shape, work=speed_lib.Work.of(stream), world=world, device=acc.device, free_gib=free,
        link=comm.link(acc.device, world), one_machine=dist.one_machine()))
    if acc.device.type == "cuda" and (problems := speed_lib.memory_problems(cfg, shape, world, chosen)):
        raise ConfigError(problems)  # before any weight is loaded: the way out, in one line
    t1 = time.perf_counter()
    # what loading downloads or writes is made once, by the first process, before the others read it;
    # otherwise every process loads at once
    once = acc.main_process_first() if model_lib.writes_once(cfg.model, cfg.train.method) else contextlib.nullcontext()
    with once, model_lib.loading(cfg.model, "model"):
        base = model_lib.load_model(cfg.model, cfg.train.method, acc.device, cfg.train.precision, cfg.train.seed,
                                    sharded=cfg.train.strategy == "fsdp")
    if problems := model_lib.arch_problems(arch.of(base.config), cfg.lora, cfg.train.method, cfg.train.packing):
        raise ConfigError(problems)  # a hub model's or a GGUF file's architecture, known only now
    model = build_model(cfg, base, chosen, acc.device)
    acc.print(f"ddptune: model loaded in {time.perf_counter() - t1:.1f}s")
    r = prepare(cfg=cfg, plan=plan, acc=acc, out=out, tokenizer=tokenizer, train_set=train_set, val_set=val_set, model=model,
                stream=stream, chosen=chosen, flops=flops, total=total)
    r.times.update(started=began, started_at=started_at, startup_s=t0 - began, load_s=time.perf_counter() - t0, eval_s=0.0,
                   startup_split={**launch.startup_split(started_at, setup_at), "setup_s": t0 - now})
    if resume:
        r.start = saving.resume_from(acc, r.checkpoints(), total)
    if chosen.graphs != "off":
        prepare_graphs(r)
    acc.print("\n".join(runlog.opening_lines(r.outline(), cfg.model, cfg.train, acc, r.model)))
    r.trackers = runlog.Trackers(acc, cfg.train.log_with, config_lib.flatten(config_lib.to_dict(cfg)), out)
    return r


def prepare(cfg, plan, acc, out, tokenizer, train_set, val_set, model, stream, chosen, flops, total) -> Run:
    """The optimizer and schedule, DDP's wrapper (or FSDP2's sharding), the clock and the step's parts."""
    optimizer, scheduler = step_lib.build_optimizer(cfg.train, model, total, capturable=chosen.graphs == "step")
    loss_model = loss_lib.CausalLMLoss(model)
    dist.set_bucket_mb(acc, chosen.bucket_mb)
    # The scheduler stays outside accelerator.prepare: accelerate's wrapper would step it once per
    # process for every optimizer step; this loop counts optimizer steps itself. A step recorded
    # whole needs DDP built on the stream that records.
    side = torch.cuda.Stream(acc.device) if chosen.graphs == "step" else None
    with graphs.on_stream(side):
        ddp_model, optimizer = dist.prepare(acc, loss_model, optimizer)
    clock = dist.StepClock(acc.device)
    dist.time_gradient_sync(ddp_model, clock)
    params = [p for p in model.parameters() if p.requires_grad]
    parts = step_lib.Parts(accelerator=acc, model=ddp_model, params=params, optimizer=getattr(optimizer, "optimizer", optimizer),
                           max_grad_norm=cfg.train.max_grad_norm, sharded=dist.sharded(loss_model), autocast=acc.autocast,
                           layer_graphs=chosen.graphs == "layers", keep_grads=chosen.graphs != "off" or dist.ddp_wrapper(ddp_model) is not None)
    return Run(cfg=cfg, plan=plan, accelerator=acc, out=out, tokenizer=tokenizer, train_set=train_set, val_set=val_set,
               model=model, loss_model=loss_model, optimizer=optimizer, scheduler=scheduler,
               level=fallback.Level(chosen, parts, None, stream), clock=clock, flops=flops, start=0, total_steps=total, side=side)


def build_model(cfg: Config, base, chosen: speed_lib.Speed, device: torch.device):
    """The loaded base as the speed choices have it: dequantized or not, with adapters (and
    checkpointing), its layers compiled for the graphs' static shapes, dynamic ones, or not at all."""
    if chosen.dequantize:
        base = model_lib.dequantize_base(base, cfg.train.precision, device)
    set_seed(cfg.train.seed)  # adapters start equal on every process
    model = model_lib.add_adapters(base, cfg.train.method, cfg.lora, chosen.checkpointing)
    if chosen.compiled:
        model_lib.compile_layers(model, chosen.graphs == "layers", static=chosen.graphs == "step", combo=chosen.combo)
    return model


def prepare_graphs(r: Run) -> None:
    """Pad, compile and record (graphs.prepare). Where compiling or recording fails the run falls
    back one level (whole step → compiled layers launched one by one → eager), one line saying why."""
    acc, level, t0 = r.accelerator, r.level, time.perf_counter()
    try:
        with graphs.on_stream(r.side):
            stream, engine, note, failed = graphs.prepare(
                parts=level.parts, loss_model=r.loss_model, stream=level.stream, first=r.start, last=r.total_steps, speed=level.speed,
                process=acc.process_index, pad_id=r.tokenizer.pad_token_id, side=r.side, clock=r.clock)
    except RuntimeError as e:  # compiling (or recording a layer) failed
        why = f"compiling the layers for CUDA graphs failed ({dist.first_line(e)})"
        r.level = fallback.to_eager(level, r.model, why, acc.print)
        return
    speed = level.speed.unrecorded(failed) if failed else level.speed  # summary.json and the banner say what runs
    r.level = dataclasses.replace(level, speed=speed, stream=stream, engine=engine)
    warm = time.perf_counter() - t0
    r.times["load_s"] += warm
    acc.print(f"ddptune: CUDA graphs: {note} in {warm:.1f}s")


# ---------------------------------------------------------------------------------------------
# fit: the loop and one optimizer step


def fit(r: Run) -> tuple[list[dict], list[tuple[dict, dict]]]:
    """Run the optimizer steps; return metrics.jsonl's rows and this process's (times, share) per step."""
    cfg = r.cfg
    # From here on a process that hangs or dies ends the run within train.timeout_minutes (setup keeps
    # torch's default: rank 0 may validate, download and tokenize for long while the others wait).
    dist.set_timeout(cfg.train.timeout_minutes)
    if cfg.eval.enabled and cfg.eval.zero_shot and cfg.train.method != "full" and not r.start:
        with r.model.disable_adapter():  # the base model, before any step
            scored(r, r.out / "eval-base", "zero-shot")
    loop = Loop(r)
    r.level.parts.model.train()
    gc.disable()  # Python's collector would pause each process at its own moment: collect on all at once instead
    step = r.start
    try:
        with runlog.profiling(r.out, cfg.train.profile_steps, r.total_steps - r.start, r.accelerator.process_index,
                              r.accelerator.device.type == "cuda") as profiler:
            for step in range(r.start, r.total_steps):
                loop.launched(first_step(r, step) if step == r.start else train_step(r, step))  # the previous step is read meanwhile
                profiler.step()
                if step == r.start:  # the model, data and compiled graphs live all run: never scan them again,
                    gc.collect()     # once what is already garbage is gone (frozen, cycles would live all run)
                    gc.freeze()
                if step % GC_EVERY == 0:
                    gc.collect(1)
                loop.between_steps(step + 1)
            loop.read_pending()
    except RuntimeError as e:
        if not dist.collective_failed(e):
            raise
        log = launch.raw_log(r.out, r.accelerator.process_index, f"step {step + 1}: {e}")  # gloo's whole text
        raise dist.Stalled(f"step {step + 1}: {dist.collective_error(e)}: another process hung (it waited more than "
                           f"train.timeout_minutes={cfg.train.timeout_minutes:g}) or died (see that process's output); "
                           f"{rundir.saved_line(r.out)}" + (f"; torch's own message: {log}" if log else "")) from None
    finally:
        loop.close()
        gc.unfreeze()
        gc.enable()
        if r.level.engine:  # their memory pool goes back for evaluation
            r.level = dataclasses.replace(r.level, engine=None)
            torch.cuda.empty_cache()
    return loop.history, loop.times


class Loop:
    """Around the steps, on every process: read each launched step one step late and log it; between
    steps, agree with the other processes (dist.ControlChannel) on stopping, on a checkpoint falling
    due and on who straggles, then validate, save or stop, all at the same step everywhere."""

    def __init__(self, r: Run):
        self.r = r
        self.progress = runlog.Progress(r.out, r.accelerator.is_main_process, r.start, r.total_steps, r.trackers)
        self.history, self.times, self.pending = [], [], None
        self.peak = metrics.peak_tflops(r.accelerator.device)
        self.control = dist.ControlChannel(r.cfg.train.timeout_minutes)  # SIGINT/SIGTERM, checkpoint times
        self.last_save, self.asked = time.monotonic(), 0
        self.saves = saving.SaveTimes(r.cfg.train.save_lead_seconds)

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
        row, mine = read_step(self.r, p, self.peak)
        if why := step_lib.broken(row["loss"], row["grad_norm"]):
            saved = checkpoint.list_checkpoints(self.r.out / "checkpoints")
            raise NonFinite(f"step {row['step']}: loss {row['loss']}, gradient norm {row['grad_norm']}: {why[0]}; newest "
                            f"checkpoint: {saved[-1] if saved else 'none'} ({why[1]})")
        self.history.append(row)
        self.times.append(mine)
        self.progress.step(row)

    def between_steps(self, done: int) -> None:
        r, t = self.r, self.r.cfg.train
        # every process's busy time in its newest recorded step (its step less its wait for the others
        # at the all-reduce): they all wait for the slowest, so step times are alike; busy names it
        busy = self.times[-1][0]["step_s"] - self.times[-1][0]["wait_s"] if self.times else 0.0
        due = t.save_every_minutes > 0 and time.monotonic() - self.last_save >= 60 * t.save_every_minutes
        stop, due, seconds = self.control.agree(due, busy)
        stop = stop if done < r.total_steps else 0  # heard at the last step: the run finishes as usual
        self.asked, answered = (self.history[-1]["step"] if self.history else 0), self.asked
        if slow := metrics.slow_rank(seconds):
            self.progress.line({"step": answered, "slow_rank": slow[0], "slow_busy_s": slow[1], "others_median_s": slow[2]},
                               f"ddptune: warning: step {answered}: rank {slow[0]} was busy for {slow[1]:.2f} s, the others "
                               f"{slow[2]:.2f} s (a slow or busy machine, or a straggling GPU?)")
        validate = t.val_every and r.val_set and done % t.val_every == 0 and done < r.total_steps
        # with a lead time set, the first step is saved at once: its save's time is checked against it
        save = (t.save_every and done % t.save_every == 0) or due or stop or (t.save_lead_seconds and done == r.start + 1)
        if validate or save:
            self.read_pending()
        if validate:
            t0 = time.perf_counter()
            val = step_lib.validation_loss(r.accelerator, r.loss_model, r.val_set, t.micro_batch_size, r.tokenizer.pad_token_id,
                                           each := {})
            r.times["eval_s"] += time.perf_counter() - t0
            self.progress.line({"step": done, "val_loss": val, **{f"val_loss/{k}": v for k, v in each.items()}},
                               f"step {done}: val_loss {val:.4f}" + "".join(f", {k} {v:.4f}" for k, v in each.items()))
        if save:
            seconds = saving.save_checkpoint(r.accelerator, r.checkpoints(), done, t.keep_checkpoints)
            self.progress.say(self.saves.note(done, seconds, [row["step_time_s"] for row in self.history]))
            self.last_save = time.monotonic()
        if validate or save:
            r.clock.pause()  # their time is eval or saving, not the next step's
        if stop:
            raise Interrupted(stop, f"stopped by {signal.Signals(stop).name} after step {done} of {r.total_steps}; "
                              f"saved {checkpoint.path_of(r.out / 'checkpoints', done)} (continue with "
                              "the same command and --resume)")

    def close(self) -> None:
        self.control.close()
        self.progress.close()


def first_step(r: Run, step: int) -> dict:
    """train_step() for the run's first step; where compiling the layers fails there, the same step
    again one level down (fallback.py)."""
    while True:
        try:
            return train_step(r, step)
        except torch._dynamo.exc.TorchDynamoException as e:
            lower = fallback.level_for_retry(r.level, r.model, e, r.accelerator.print)
            if lower is None:
                raise
            r.level = lower


def train_step(r: Run, step: int) -> dict:
    """One optimizer step over this process's share of the step's global batch (step.py), replayed
    when it is recorded. Nothing here waits for the device: the loss and gradient norm come back as
    a copy to the host still in flight, the times as events, all read a step later."""
    acc, level = r.accelerator, r.level
    share = level.stream.share(step)
    forwards = share.forwards[acc.process_index]
    r.clock.start()
    lr = step_lib.current_lr(r.scheduler, r.cfg.train.lr)
    if level.engine:
        figures = level.engine.replay(forwards, share.targets, r.clock)
    else:
        pad = r.tokenizer.pad_token_id
        # an empty group (sharded runs only, batches.lockstep): a forward in step with the others that counts nothing
        work = [(step_lib.to_device(level.stream.collate(g or forwards[0][:1], pad), acc.device), bool(g)) for g in forwards]
        loss_sum = step_lib.forward_backward(level.parts, work, share.targets, torch.zeros((), device=acc.device))
        r.clock.mark("synced")
        figures = step_lib.clip_and_update(level.parts, loss_sum)
    figures = step_lib.to_host(figures)
    r.scheduler.step()
    marks = r.clock.finish()  # after the copy: once the step's end has passed, `figures` holds its loss and norm
    return {"step": step, "share": share, "lr": lr, "figures": figures, "marks": marks}


def read_step(r: Run, p: dict, peak: float | None) -> tuple[dict, tuple[dict, dict]]:
    """metrics.jsonl's row for a launched step (waits until the device has finished it)."""
    share, world = p["share"], r.accelerator.num_processes
    times = r.clock.read(p["marks"])  # waits for the step's end: its figures are on the host by then
    loss, grad_norm = p["figures"].tolist()
    mean_cost = sum(share.cost) / world
    row = metrics.step_row(
        step=p["step"] + 1, loss=loss, lr=p["lr"], grad_norm=grad_norm, samples=r.plan.global_batch, tokens=sum(share.tokens),
        targets=share.targets, computed=sum(share.computed), forwards=max(len(f) for f in share.forwards), flops=sum(share.cost),
        times=times, balance=max(share.cost) / mean_cost if mean_cost else 1.0, world=world, peak=peak,
        peak_mem=metrics.peak_memory_gib(r.accelerator.device))
    return row, (times, {"tokens": share.tokens, "cost": share.cost, "computed": share.computed})


# ---------------------------------------------------------------------------------------------
# finish


def scored(r: Run, folder: Path, label: str) -> dict:
    """ROUGE of the model as it stands on the validation rows (generation.evaluate); its time counts as evaluation."""
    t0, cfg = time.perf_counter(), r.cfg
    scores = generation.evaluate(model=r.model, tokenizer=r.tokenizer, rows=generation.eval_rows(cfg.data, cfg.eval.max_samples),
                                 e=cfg.eval, d=cfg.data, source=cfg.model.source, accelerator=r.accelerator, out_dir=folder, label=label)
    r.times["eval_s"] += time.perf_counter() - t0
    return scores


def finish(r: Run, history: list[dict], times: list[tuple[dict, dict]]):
    """Check the replicas agree, write the figures, save, evaluate."""
    cfg, acc, out = r.cfg, r.accelerator, r.out
    val_loss = None  # no validation set: null in summary.json (NaN is not JSON)
    t0 = time.perf_counter()
    if r.val_set:
        val_loss = step_lib.validation_loss(acc, r.loss_model, r.val_set, cfg.train.micro_batch_size, r.tokenizer.pad_token_id,
                                            each := {})
        if acc.is_main_process:
            row = {"step": r.total_steps, "val_loss": val_loss, **{f"val_loss/{k}": v for k, v in each.items()}}
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            r.trackers.log(row)
    r.times["eval_s"] += time.perf_counter() - t0
    sharded = dist.sharded(r.loss_model)  # FSDP: each process holds a part, there are no replicas to compare
    fingerprints = None if sharded else dist.gather(model_lib.weights_fingerprint(r.model))
    peaks = dist.gather(metrics.peak_memory_gib(acc.device))
    per_rank = dist.gather([t for t, _ in times])
    if fingerprints and len(set(fingerprints)) != 1:
        raise Diverged(f"replicas diverged: weight hashes per process {fingerprints}")
    final = rundir.trained_weights_dir(out, cfg.train.method)
    summary = {}
    if acc.is_main_process:
        ranks = metrics.rank_rows(r.start, per_rank, [s for _, s in times])
        runlog.write_ranks(out, ranks)
        buckets = r.clock.buckets if dist.ddp_wrapper(r.level.parts.model) and acc.num_processes > 1 else None
        measured = runlog.Measured(runlog.step_rows(out) or history, ranks, val_loss, peaks, fingerprints, buckets)
        summary = runlog.summary(r.outline(), measured, cfg.train, acc, r.model, r.times, final)
        report.write_json(out / "summary.json", summary)  # first: a kill in the saves below keeps the figures
    saving.save_final(accelerator=acc, final=final, model=r.model, tokenizer=r.tokenizer, m=cfg.model, method=cfg.train.method,
                      config_yaml=config_lib.dump(cfg), sharded=sharded)
    if acc.is_main_process:
        saving.remove_checkpoints(out)
    if cfg.eval.enabled:
        scores = scored(r, out / "eval", "fine-tuned")
        if acc.is_main_process:
            summary["rouge"] = {k: scores[k] for k in generation.ROUGE_KEYS}
    if acc.is_main_process:
        summary.update(eval_time_s=r.times["eval_s"], **runlog.wall_time(r.times, history))
        report.write_json(out / "summary.json", summary)
        acc.print("\n".join(runlog.closing_lines(out, summary, final, cfg.train.method, bool(r.val_set), cfg.eval.enabled,
                                                 data.asked_sample(cfg.data))))
    acc.wait_for_everyone()
    return summary, r.model
