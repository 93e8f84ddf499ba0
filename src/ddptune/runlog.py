"""The run log: opening lines, metrics.jsonl, ranks.jsonl, summary.json, trackers, progress and closing lines.

Rank 0 writes; every function here is called by the process that writes.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from ddptune import arch, batchplan, config as config_lib, dist, metrics, model as model_lib, provenance
from ddptune.batchplan import BatchPlan
from ddptune.config import ModelConfig, TrainConfig
from ddptune.speed import Speed


@dataclass(frozen=True)
class Outline:
    """What a run is, as its opening lines and summary.json say it."""
    plan: BatchPlan
    train_rows: int  # training examples
    steps: int       # optimizer steps in all
    start: int       # optimizer steps done before this process started (resume)
    speed: Speed     # the speed choices, each with its reason
    padded_lengths: tuple[int, ...]  # the lengths packed rows are padded to for CUDA graphs; () without


@dataclass(frozen=True)
class Measured:
    """What a run measured, as summary.json reports it."""
    history: list[dict]              # metrics.jsonl's step rows (a resumed run's earlier steps too)
    ranks: list[dict]                # ranks.jsonl's rows: each process's times and work per step
    val_loss: float | None           # the final validation loss; None without a validation set
    peaks: list[float | None]        # each process's peak GPU memory, GiB (None on CPU)
    fingerprints: list[str] | None   # each replica's weights hash; None when sharded (no replicas)
    grad_buckets: int | None         # the gradient all-reduces of the last step (DDP's buckets); None: one process, or FSDP


def opening_lines(outline: Outline, m: ModelConfig, t: TrainConfig, accelerator: Accelerator, model: torch.nn.Module) -> list[str]:
    """What the start of a run prints: the model and what trains, the speed choices and their reasons,
    the processes, the batch plan and its notes, and the steps the data makes."""
    acc, plan = accelerator, outline.plan
    trainable, total = model_lib.count_params(model)
    lines = [f"{m.source} | {t.method} | {trainable:,} of {total:,} parameters trained", *outline.speed.lines(),
             f"{acc.num_processes} process(es) on {acc.device.type} ({acc.distributed_type.value}, mixed precision "
             f"{acc.mixed_precision}){', ' + m.attn_implementation + ' attention' if t.packing else ''}"
             + (f", {torch.get_num_threads()} CPU thread(s) each ({dist.threads_why})" if acc.device.type == "cpu" else ""),
             plan.describe() + ("; each step's samples split into shares of equal cost" if acc.num_processes > 1 else ""),
             *architecture_lines(model),
             *(f"note: {note}" for note in batchplan.batch_notes(t)),
             f"{outline.train_rows} training examples, {outline.train_rows / plan.global_batch:.1f} steps per epoch, "
             f"{outline.steps} steps" + (f", resuming after step {outline.start}" if outline.start else "")]
    return [f"ddptune: {line}" for line in lines]


def architecture_lines(model) -> list[str]:
    """What the model defines beyond a plain causal decoder, and how it trains here (none for a plain one)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    a = arch.of(base.config)
    if not a.features():
        return []
    slow = a.slow_attention()
    how = (f"{' and '.join(slow)} through {a.family}'s own attention, sample by sample (exact, slower)" if slow
           else "every feature in the packed kernels")
    return [f"architecture: {a.family}: {'; '.join(a.features())} ({how})"]


def _step(line: str) -> int | None:
    """The step of a metrics.jsonl line; None for a line a kill cut short."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


class JsonlWriter:
    """Append one JSON object per line; flushed at once so a crash loses nothing written."""

    def __init__(self, path: Path, keep_until_step: int | None = None):
        self.path = Path(path)
        if keep_until_step is not None and self.path.exists():  # resume: drop steps to be redone, and a torn last line
            lines = [l for l in self.path.read_text().splitlines() if (_step(l) or keep_until_step + 1) <= keep_until_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(l + "\n" for l in lines))
            os.replace(tmp, self.path)
        self.f = open(self.path, "a")

    def write(self, row: dict) -> None:
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def step_rows(out: Path) -> list[dict]:
    """The run's step lines in metrics.jsonl: a resumed run's figures count the steps before it too."""
    path = out / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [row for row in lines if "loss" in row and "step_time_s" in row]


def write_ranks(out: Path, rows: list[dict]) -> None:
    (out / "ranks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


class Trackers:
    """train.log_with: accelerate's tracker on the main process, with the resolved config as its
    hyperparameters. TensorBoard writes output_dir/tensorboard/; W&B and MLflow log to project /
    experiment `ddptune`, the run named after output_dir. Closed also after an error (not with
    accelerator.end_training, which would also destroy the process group)."""

    def __init__(self, accelerator, log_with: str, settings: dict, out: Path):
        """`settings`: the resolved config, flattened (config.flatten)."""
        self.accelerator, self.on = accelerator, log_with != "none"
        if not self.on:
            return
        # hyperparameters must be numbers, strings or booleans (TensorBoard's add_hparams)
        flat = {key: value if isinstance(value, (int, float, str, bool)) else str(value) for key, value in settings.items()}
        name = out.resolve().name
        init = {"wandb": {"name": name}, "mlflow": {"run_name": name}}
        accelerator.init_trackers("tensorboard" if log_with == "tensorboard" else "ddptune", config=flat, init_kwargs=init)

    def log(self, row: dict) -> None:
        """One metrics.jsonl row's numbers, at its step (accelerate logs on the main process only)."""
        if self.on:
            values = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
            self.accelerator.log(values, step=row["step"])

    def close(self) -> None:
        for tracker in self.accelerator.trackers:
            tracker.finish()
        self.accelerator.trackers.clear()


class Progress:
    """What the loop shows and writes as it goes: the bar and, on the main process, metrics.jsonl
    and the trackers (a resumed run first drops the lines of the steps it will redo)."""

    def __init__(self, out: Path, main: bool, start: int, total: int, trackers: Trackers):
        self.log = JsonlWriter(out / "metrics.jsonl", keep_until_step=start) if main else None
        self.trackers = trackers
        self.bar = tqdm(total=total, initial=start, desc="train", disable=not main, dynamic_ncols=True)

    def step(self, row: dict) -> None:
        if self.log:
            self.log.write(row)
            self.trackers.log(row)
        self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", lr=f"{row['lr']:.2e}")
        self.bar.update(1)

    def line(self, row: dict, text: str | None = None) -> None:
        """A row that is not a step's (a validation loss, a straggler), and a line above the bar."""
        if self.log:
            self.log.write(row)
            self.trackers.log(row)
            if text:
                self.bar.write(text)

    def say(self, text: str | None) -> None:
        """A line above the bar, on the main process (nothing for None)."""
        if text and self.log:
            self.bar.write(text)

    def close(self) -> None:
        self.bar.close()  # whatever is printed next starts on a line of its own
        if self.log:
            self.log.close()


def summary(outline: Outline, measured: Measured, train: TrainConfig, accelerator: Accelerator, model: torch.nn.Module,
            times: dict[str, float], final: Path) -> dict:
    """summary.json: the run's figures, its speed choices and where its output (`final`) is. `times`: the
    seconds spent loading (load_s) and evaluating (eval_s), and the start wall_time counts from."""
    acc, plan, speed = accelerator, outline.plan, outline.speed
    history, ranks, peaks = measured.history, measured.ranks, measured.peaks
    trainable, total = model_lib.count_params(model)
    warm = min(metrics.WARMUP_STEPS, max(len(history) - 1, 0))
    return {
        "steps": outline.steps, "world_size": acc.num_processes, "global_batch": plan.global_batch,
        "per_process": plan.per_process, "grad_accum": plan.grad_accum, "micro_batch_size": plan.micro_batch_size,
        "packing": train.packing, "final_loss": history[-1]["loss"] if history else None, "val_loss": measured.val_loss,
        "load_time_s": times["load_s"], "train_time_s": sum(row["step_time_s"] for row in history),
        **metrics.summarize_steps(history, warm, acc.num_processes), "mfu_denominator_tflops": metrics.peak_tflops(acc.device),
        "eval_time_s": times["eval_s"], **wall_time(times, [row for row in history if row["step"] > outline.start]),
        "time_split": metrics.split(ranks[min(warm, max(len(ranks) - 1, 0)):]),
        "peak_mem_gib": max(peaks) if None not in peaks else None, "peak_mem_gib_per_process": peaks,
        "train_rows": outline.train_rows, "steps_per_epoch": outline.train_rows / plan.global_batch,
        "method": train.method, "strategy": train.strategy, "mixed_precision": acc.mixed_precision,
        "grad_buckets": measured.grad_buckets,
        "speed": speed.as_dict(), "gradient_checkpointing": speed.checkpointing, "compiled": speed.compiled,
        "cuda_graphs": speed.graphs, "padded_lengths": list(outline.padded_lengths), "base_4bit": model_lib.holds_4bit(model),
        "trainable_params": trainable, "total_params": total,
        "output": str(final), "replica_fingerprints": measured.fingerprints,
        "ddptune": {"version": provenance.version(), "commit": provenance.commit()}, "device": provenance.device(),
    }


def wall_time(times: dict, steps: list[dict]) -> dict:
    """summary.json's wall time so far, from the command's start (started_at, time.time() seconds), and where it
    went: start-up (imports, validation, launching the processes, joining them; `startup_split`, this
    process's: launch.startup_split's parts, then its setup to the loading), loading the data and
    model, the training steps run since this process started (`steps`: their metrics rows), evaluation, and the rest (saving,
    checkpoints, the loop between steps). The parts add up to the wall time."""
    wall = time.perf_counter() - times["started"]
    split = {"startup_s": times["startup_s"], "load_s": times["load_s"],
             "train_s": sum(row["step_time_s"] for row in steps), "eval_s": times["eval_s"]}
    return {"started_at": times["started_at"], "wall_time_s": wall,
            "wall_split": {**split, "other_s": wall - sum(split.values())}, "startup_split": times.get("startup_split")}


def closing_lines(out: Path, summary: dict, final: Path, method: str, has_val: bool, eval_enabled: bool,
                  asked: str) -> list[str]:
    """What the end of a run prints: its wall time and where it went, its figures, where each
    output is, and one command to try next (`asked`: a row of the format it trained on, as a JSON line,
    data.asked_sample: predict takes that format from this run, and no other)."""
    part = {k: max(v, 0.0) for k, v in summary["wall_split"].items()}
    lines = [f"ddptune: done in {_duration(summary['wall_time_s'])}: start-up {part['startup_s']:.1f}s (imports, checks, "
             f"processes), load {part['load_s']:.1f}s, train {part['train_s']:.1f}s, eval {part['eval_s']:.1f}s "
             f"(validation and generation), other {part['other_s']:.1f}s (saving, checkpoints)",
             "ddptune: final loss " + ("n/a (no step left to run)" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}")
             + (f", val loss {summary['val_loss']:.4f}" if has_val else "")
             + f", {summary['tokens_per_s_per_gpu']:.0f} tokens/s per process"
             + (f", ROUGE-1 {summary['rouge']['rouge1']:.1f}" if "rouge" in summary else "")]
    wrote = [("metrics.jsonl", "a line per step"), ("summary.json", "the run's figures"),
             (final.name + "/", "the trained " + ("model" if method == "full" else "adapter")),
             ("eval/", "fine-tuned predictions and ROUGE"), ("eval-base/", "zero-shot predictions and ROUGE"),
             ("tensorboard/", "tensorboard --logdir " + str(out)), ("checkpoints/", "resumable with --resume")]
    lines.append(f"ddptune: wrote {out}/: " + ", ".join(f"{name} ({what})" for name, what in wrote if (out / name).exists()))
    if eval_enabled or not has_val:
        lines.append(f"ddptune: next: ask it with a row like those it trained on: echo '{asked}' | ddptune predict {out} -")
    else:
        lines.append(f"ddptune: next: score it with ROUGE: ddptune eval {out}")
    return lines


def _duration(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def trace_path(folder: Path, rank: int) -> Path:
    """Where process `rank` of a run writes its timeline (train.profile_steps)."""
    return folder / ("trace.json" if rank == 0 else f"trace-rank{rank}.json")


class _NoProfiler:
    def step(self) -> None:
        pass


def profile_wait(steps_left: int, n: int) -> int:
    """Steps before the `n` profiled ones of a run with `steps_left` steps to go: PROFILE_STEADY where
    the run is long enough, else as many as leave room for them, and at least PROFILE_AFTER. Early
    steps meet row lengths for the first time, whose first matrix multiplies cost milliseconds of host
    time each: a profile of them reads as host-bound where the run's steady steps are not."""
    return max(config_lib.PROFILE_AFTER, min(config_lib.PROFILE_STEADY, steps_left - n))


def profiling(out: Path, n: int, steps_left: int, rank: int, cuda: bool):
    """torch.profiler over `n` (train.profile_steps) steps after the first profile_wait ones, or nothing."""
    if not n:
        return nullcontext(_NoProfiler())
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def write(prof) -> None:  # every process its timeline: a step waits for the slowest, often not rank 0
        if rank == 0:
            device = "self_device_time_total" if cuda else "cpu_time_total"
            tables = [prof.key_averages().table(sort_by=key, row_limit=30) for key in ("self_cpu_time_total", device)]
            (out / "profile.txt").write_text("\n\n".join(tables))
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path(out, rank)))

    schedule = torch.profiler.schedule(wait=profile_wait(steps_left, n) - 1, warmup=1, active=n, repeat=1)
    return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=write)
