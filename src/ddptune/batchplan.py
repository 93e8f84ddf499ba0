"""Batch arithmetic: the one place where samples, processes, forwards and accumulation meet.

global batch = samples per process x processes; padded batches run those samples as grad_accum
forwards of micro_batch_size; packed ones concatenate them into forwards of at most
tokens_per_forward tokens. Derived and checked once, for any process count; once the data is counted,
`rows_problems` and `profile_problems` check its rows and the run's steps against the plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ddptune.config import PROFILE_AFTER, ConfigError, TrainConfig


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


def total_steps(t: TrainConfig, examples: int, global_batch: int) -> int:
    """A run's optimizer steps: train.max_steps, else train.epochs passes over its `examples` training examples."""
    return t.max_steps or max(1, math.floor(t.epochs * examples / global_batch))


def rows_problems(n_rows: int, plan: BatchPlan) -> list[str]:
    """Training rows against one global batch (hub data is counted only once loaded: train calls this too)."""
    if n_rows < plan.world_size:  # no batch setting can help: each process takes a sample a step
        return [f"--nproc: {plan.world_size} processes are more than the {n_rows} training rows (each process takes "
                f"at least one sample a step: use at most {n_rows} processes, or more rows in data.train)"]
    if n_rows < plan.global_batch:
        return [f"data.train: {n_rows} rows are fewer than one global batch of {plan.global_batch} "
                "(select more rows, or lower train.micro_batch_size, the accumulation or effective_batch_size)"]
    return []


def profile_problems(t: TrainConfig, total: int) -> list[str]:
    """train.profile_steps after the first PROFILE_AFTER must fit the run's `total` steps (known once the data is)."""
    if t.profile_steps and total < PROFILE_AFTER + t.profile_steps:
        return [f"train.profile_steps: {t.profile_steps} steps after the first {PROFILE_AFTER} "
                f"do not fit a run of {total} steps (profile fewer steps or train longer)"]
    return []
