"""Saving and restoring a run over its processes: checkpoints, the final weights, resume.

Rank 0 writes checkpoints (sharded, every process its own part first); the final weights are gathered
whole onto rank 0 when sharded; resume takes the newest checkpoint that reads back whole and fits
the run (checkpoint.py holds the files' format). Once the final weights are saved the checkpoints are
removed: nothing resumes a finished run.
"""
from __future__ import annotations

import math
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch.optim.lr_scheduler import LRScheduler
from transformers import PreTrainedTokenizerBase

from ddptune import checkpoint, dist, model as model_lib, rundir, sources
from ddptune.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class Checkpoints:
    """Where a run's checkpoints go and what they hold."""
    folder: Path                     # output_dir/checkpoints
    model: torch.nn.Module           # whose trained weights are saved (a PEFT model, or the full model)
    optimizer: AcceleratedOptimizer  # accelerate's wrapper
    scheduler: LRScheduler
    sharded: bool                    # FSDP: each process holds a part of the weights and optimizer states
    global_batch: int                # samples per optimizer step, which a resumed run must keep


def resume_from(accelerator: Accelerator, saved: Checkpoints, total_steps: int) -> int:
    """Restore the newest checkpoint that reads back whole and fits the run of `total_steps` steps (an
    older one, with a warning, when the newest is damaged); return its step. Any process count may
    resume it with the run's global batch; on a CPU, the same count takes the CPU threads it was written with."""
    acc, problems = accelerator, []
    for path in reversed(checkpoint.list_checkpoints(saved.folder)):
        try:
            state = checkpoint.load(path, saved.model, saved.optimizer, saved.scheduler, acc.process_index, total_steps)
            error = None
        except ValueError as e:
            state, error = None, str(e)
        # All processes move on together: FSDP's parts are read one per process, so one damaged part
        # fails on its process only, and the others must not resume from a later step than it.
        if errors := list(dict.fromkeys(e for e in dist.gather(error) if e)):
            problems += errors
            acc.print(f"ddptune: warning: {errors[0]}; trying the one before")
            continue
        if state.get("global_batch", saved.global_batch) != saved.global_batch or (
                "global_batch" not in state and state["world_size"] != acc.num_processes):
            raise ConfigError([f"--resume: {path} was written by {state['world_size']} processes with "
                               f"{state.get('global_batch', '?')} samples per optimizer step: set train.effective_batch_size to "
                               f"that, or resume with --nproc {state['world_size']}"])
        if acc.device.type == "cpu" and state.get("world_size") == acc.num_processes:
            if note := dist.take_threads(state.get("threads")):
                acc.print(f"ddptune: note: {note}")
        return state["step"]
    raise ConfigError([f"--resume: no checkpoint in {saved.folder} can be read back"] + problems)


def save_checkpoint(accelerator: Accelerator, saved: Checkpoints, step: int, keep: int) -> float:
    """Rank 0 writes the checkpoint of `step` and keeps the newest `keep` (train.keep_checkpoints);
    sharded (FSDP), every process first writes its own part of the weights and optimizer states into
    the folder rank 0 made, which rank 0 then completes. Returns the seconds it took, until every
    process had it."""
    t0 = time.perf_counter()
    acc, folder = accelerator, saved.folder
    rngs = dist.gather(checkpoint.rng_state())  # every process's RNG, in rank order
    # the thread count too: on a CPU a resume takes it again, for the same sums (dist.take_threads)
    extra = {"world_size": acc.num_processes, "global_batch": saved.global_batch, "threads": torch.get_num_threads()}
    weights, optimizer, tmp = model_lib.trainable_state(saved.model), saved.optimizer, None
    if saved.sharded:
        tmp = dist.on_main(acc, lambda: checkpoint.atomic_dir(checkpoint.path_of(folder, step)))
        checkpoint.save_shard(tmp, acc.process_index, weights, optimizer)
        acc.wait_for_everyone()
        weights, optimizer, extra["shards"] = None, None, acc.num_processes
    if acc.is_main_process:
        checkpoint.save(folder=folder, step=step, weights=weights, optimizer=optimizer, scheduler=saved.scheduler,
                        rng_states=rngs, extra=extra, tmp=tmp)
        checkpoint.prune(folder, keep)
    acc.wait_for_everyone()
    return time.perf_counter() - t0


@dataclass
class SaveTimes:
    """What a run says of its checkpoints' save times: the first one's, and a warning (once) when a
    stop would outlast train.save_lead_seconds. A stop signal is acted on after the step it reaches
    and the next (every process must agree on it, one step late), then that step is saved: a stop
    takes a save and two steps, timed as the median of this run's recent steps (its first step, which
    warms up and may compile, is not one of them; until another is timed, the save alone counts)."""
    lead: float | None
    said: bool = False
    warned: bool = False

    def note(self, step: int, seconds: float, step_times: list[float]) -> str | None:
        typical = statistics.median(step_times[1:][-20:]) if len(step_times) > 1 else 0.0
        stop_s = seconds + 2 * typical
        steps = f"two more steps of {typical:.2f} s, then a save" if typical else "a save"
        if self.lead is not None and stop_s > self.lead and not self.warned:
            self.said = self.warned = True
            return (f"ddptune: warning: saving step {step} took {seconds:.1f} s: a stop ({steps}) needs about "
                    f"{stop_s:.1f} s, more than train.save_lead_seconds={self.lead:g}; send the stop signal earlier "
                    f"(sbatch --signal=TERM@{math.ceil(1.5 * stop_s)}) or save less")
        if self.said:
            return None
        self.said = True
        spare = (f"; a stop ({steps}) needs about {stop_s:.1f} s of the {self.lead:g} s train.save_lead_seconds gives"
                 if self.lead is not None else "")
        return f"ddptune: a checkpoint (step {step}) took {seconds:.2f} s to save{spare}"


def save_final(accelerator: Accelerator, final: Path, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
               m: ModelConfig, method: str, config_yaml: str, *, sharded: bool) -> None:
    """The adapter (PEFT format) or full model into `final`, with tokenizer and the run's resolved config
    (`config_yaml`, as ddptune.yaml), renamed into place. Sharded (FSDP), the trained weights are first
    gathered whole onto rank 0: one plain file set."""
    state = None
    if sharded:
        state = dist.gathered_state_dict(model, trainable_only=method != "full")
    if accelerator.is_main_process:
        checkpoint.remove_leftovers(final)  # what a save killed before left beside it (for full fine-tuning, a model's size)
        tmp = checkpoint.atomic_dir(final)
        model_lib.save_trained(model, tmp, state)
        if (tmp / "README.md").is_file():  # peft's model card (an adapter's)
            name_the_base(tmp / "README.md", m, method)
        tokenizer.save_pretrained(tmp)
        (tmp / "ddptune.yaml").write_text(config_yaml)
        checkpoint.commit(tmp, final)
    accelerator.wait_for_everyone()


def remove_checkpoints(out: Path) -> None:
    """A finished run's checkpoints, once its summary.json and final weights are written: --resume
    refuses a finished run, and eval, export, predict and compare read its final weights. The
    caller is the one process that writes."""
    if rundir.finished(out):
        shutil.rmtree(out / "checkpoints", ignore_errors=True)


def name_the_base(card_path: Path, m: ModelConfig, method: str) -> None:
    """peft's model card takes its `base_model` (front matter the hub reads as the base's id, and
    the tag `base_model:adapter:...`) from the folder the base was loaded from: for a GGUF source
    its conversion in the cache, for a preset nothing. Both are set to the hub id where the source
    is one and left out otherwise; the card's text names the source as configured."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(card_path)
    hub = m.source if sources.resolve_source(m).kind == "hub" else None
    card.data.base_model = hub
    card.data.tags = [t for t in card.data.tags or [] if not t.startswith("base_model:")] + (
        [f"base_model:adapter:{hub}"] if hub else [])
    said = f"A {method} adapter trained by ddptune on `{sources.base_reference(m)}` (model.source)." + (
        "" if hub else " No hub id names that base: `ddptune export` writes a copy whose README.md says how to build it.")
    lines = card.text.splitlines()
    title = next((i + 1 for i, line in enumerate(lines) if line.startswith("# ")), 0)
    card.text = "\n".join([*lines[:title], "", said, *lines[title:]]) + "\n"
    card.save(card_path)
