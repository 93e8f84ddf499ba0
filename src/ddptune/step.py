"""One optimizer step's body, the optimizer and its schedule, and the validation loss.

The body: forwards and backwards, then clipping, the loss's sum over the processes and the update;
`broken` says which of a step's figures stop the run.

Eager steps call these two functions directly; the CUDA-graph engine (graphs.py) records the very
same functions and replays them, so loss scaling, `no_sync` and clipping exist once.

- Each forward divides its summed token losses by the summary tokens of the whole global batch
  (`num_items`, counted on the host). DDP's all-reduce averages gradients over the processes, and
  so does FSDP2's reduce-scatter: each backward scales its loss by the process count, which makes
  that average a sum, so N processes take exactly the step one process takes with all N shares.
- DDP all-reduces in the last backward only (`no_sync` before it); FSDP reduce-scatters in every
  one (skipping it would keep whole unsharded gradients on each GPU until the last forward).
- Nothing here waits for the device: the figures come back as a tensor still on it.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
import transformers
from tqdm.auto import tqdm

from ddptune import batches, config, dist


@dataclass(frozen=True)
class Parts:
    """What a step touches."""
    accelerator: Any        # for no_sync and backward
    model: Any              # what forwards run through: DDP's wrapper, or the FSDP2-sharded module
    params: list            # the trained parameters
    optimizer: Any          # torch's optimizer (not accelerate's wrapper: its step adds nothing here)
    max_grad_norm: float    # 0: no clipping (the norm is still computed)
    sharded: bool           # FSDP2: every backward reduce-scatters
    autocast: Callable      # the mixed-precision context of a forward
    layer_graphs: bool = False  # compiled layers replayed as CUDA graphs: each forward starts a new replay
    keep_grads: bool = False    # gradients stay where they are (DDP's bucket views, recorded graphs): zeroed in place


def forward_backward(p: Parts, batches: list[tuple[dict, bool]], num_items, loss_sum: torch.Tensor) -> torch.Tensor:
    """Forward and backward of each (batch, counts) of this process's share, `loss_sum` (zeroed
    first) accumulating the losses of the batches that count. A batch that does not count is a
    forward in step with the other processes (FSDP) whose gradients are scaled to nothing."""
    world = p.accelerator.num_processes
    loss_sum.zero_()
    for k, (batch, counts) in enumerate(batches):
        if p.layer_graphs:  # a new forward: the previous replay's outputs are no longer needed
            torch.compiler.cudagraph_mark_step_begin()
        sync = p.sharded or k == len(batches) - 1
        with (nullcontext() if sync else p.accelerator.no_sync(p.model)), p.autocast():
            loss = p.model(**batch, num_items=num_items)
        p.accelerator.backward(loss * (world if counts else 0))
        if counts:
            loss_sum.add_(loss.detach())
    return loss_sum


def clip_and_update(p: Parts, loss_sum: torch.Tensor) -> torch.Tensor:
    """Clip the gradients' global norm, sum the loss over the processes, update, zero the
    gradients; returns [loss, gradient norm] on the device."""
    norm = torch.nn.utils.clip_grad_norm_(p.params, p.max_grad_norm or float("inf"))
    norm = dist.full_tensor(norm)  # sharded gradients give a DTensor norm: the whole one
    total = loss_sum.clone()
    if p.accelerator.num_processes > 1:
        torch.distributed.all_reduce(total)
    figures = torch.stack([total.float(), norm.detach().float()])
    p.optimizer.step()
    if p.keep_grads:
        torch._foreach_zero_([q.grad for q in p.params if q.grad is not None])
    else:
        p.optimizer.zero_grad(set_to_none=True)
    return figures


def broken(loss: float, grad_norm: float) -> tuple[str, str] | None:
    """Why a step's figures must stop the run, and the way out, or None. A loss or gradient norm that
    is not a finite number; or a loss of exactly 0, which real targets give only when every one of
    them is predicted with certainty: far more often a step that scored nothing, or broken outputs
    (what 4-bit bases sharded by other tools trained on, silently, when their weights were lost)."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return "stopping before anything non-finite is saved", "lower train.lr or train.max_grad_norm, or look at the data"
    if loss == 0:
        return ("a loss of exactly 0 means nothing was scored or the outputs are broken: stopping before it is saved",
                "check that the data's summaries reach the loss (data.summary_column), or compare with train.strategy=ddp")
    return None


def build_optimizer(t, model, total_steps: int, capturable: bool = False):
    """AdamW (torch's fused one on a GPU) or bitsandbytes' 8-bit AdamW, and the learning-rate schedule.
    `capturable`: the update can be recorded in a CUDA graph; its learning rate is then a tensor on
    the GPU, which the schedule fills in place each step."""
    params = [p for p in model.parameters() if p.requires_grad]
    if t.optimizer == "adamw":
        lr = torch.tensor(t.lr, device=params[0].device) if capturable else t.lr
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=t.weight_decay, fused=params[0].is_cuda, capturable=capturable)
    else:  # bitsandbytes' 8-bit states (they synchronize the GPU after every parameter)
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if t.optimizer == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        opt = cls(params, lr=t.lr, weight_decay=t.weight_decay)
    sched = transformers.get_scheduler(t.lr_schedule, opt, num_warmup_steps=t.warmup_steps, num_training_steps=total_steps,
                                       scheduler_specific_kwargs=schedule_kwargs(t, total_steps))
    return opt, sched


def schedule_kwargs(t, total_steps: int) -> dict:
    """What train.lr_schedule's transformers schedule takes beyond its warm-up and length: the floor
    (train.min_lr_ratio) and, for warmup_stable_decay, its decay steps (train.decay_ratio of the run)."""
    if t.lr_schedule == "cosine_with_min_lr":
        return {"min_lr_rate": t.min_lr_ratio}
    if t.lr_schedule == "warmup_stable_decay":
        return {"num_decay_steps": config.decay_steps(t, total_steps), "min_lr_ratio": t.min_lr_ratio}
    return {}


def current_lr(scheduler, base_lr: float) -> float:
    """The learning rate of the step about to run, on the host. A capturable optimizer keeps it on
    the GPU, where reading it would wait for the device: it is the schedule's factor times the base."""
    lr = scheduler.get_last_lr()[0]
    if not torch.is_tensor(lr):
        return lr
    base = scheduler.base_lrs[0]
    return (base_lr if torch.is_tensor(base) else base) * scheduler.lr_lambdas[0](scheduler.last_epoch)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` copied to the host as the device's next piece of work, without waiting for it. Read a step
    later (after the step's end event), it waits for that step alone: `.item()` would synchronize the
    whole stream, so that the host began each step only when the device had run out of work."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def to_device(batch: dict, device: torch.device) -> dict:
    """Tensors to `device` without making the host wait: from pinned memory, asynchronously."""
    if device.type != "cuda":
        return batch
    return {k: v.pin_memory().to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


@torch.no_grad()
@torch.compiler.set_stance("force_eager")  # padded batches without gradients: not what train.compile compiled
def validation_loss(accelerator, net, examples: list[dict], micro: int, pad_id: int, by_source: dict | None = None) -> float:
    """Token-weighted loss over all validation examples: each process sums its share's token
    losses and counts, the sums are reduced, then divided (never an average of averages). Runs
    through the loss model, not the DDP wrapper: processes may run different numbers of batches.
    Sharded (FSDP), every forward gathers weights from all processes: each runs as many forwards as
    the busiest one, the extra ones (on one validation example) counting nothing. Examples of several
    sources (each naming its `"source"`) are batched source by source, and `by_source` gets each one's loss."""
    acc = accelerator
    was_training = net.training
    net.eval()
    world = acc.num_processes
    names = list(dict.fromkeys(e.get("source") for e in examples))
    groups = [[e for e in examples if e.get("source") == name] for name in names]
    chunks = []  # (source index, the examples of one forward)
    for j, group in enumerate(groups):
        mine = group[acc.process_index::world]
        chunks += [(j, mine[i:i + micro]) for i in range(0, len(mine), micro)]
    rounds = sum(math.ceil(math.ceil(len(g) / world) / micro) for g in groups) if dist.sharded(net) else len(chunks)
    loss_total = torch.zeros(len(groups), dtype=torch.float64, device=acc.device)  # summed on the device: no sync a batch
    targets = [0] * len(groups)  # counted on the host
    for k in tqdm(range(rounds), desc="validation", unit="batch", disable=not acc.is_main_process, leave=False,
                  dynamic_ncols=True):
        j, chunk = chunks[k] if k < len(chunks) else (0, None)
        batch = to_device(batches.collate(chunk or examples[:1], pad_id), acc.device)
        with acc.autocast():
            loss = net(**batch, num_items=1).double()
        if chunk:
            loss_total[j] += loss
            targets[j] += batches.target_tokens(chunk)
    net.train(was_training)
    sums = torch.cat([loss_total, torch.tensor(targets, dtype=torch.float64, device=acc.device)])
    sums = acc.reduce(sums, "sum")
    losses, counts = sums[:len(groups)], sums[len(groups):]
    if by_source is not None and len(groups) > 1:
        by_source.update({name: (loss / count).item() for name, loss, count in zip(names, losses, counts)})
    return (losses.sum() / counts.sum()).item()
