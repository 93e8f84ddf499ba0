"""`ddptune train`: data-parallel fine-tuning, one process per device, the same code for 1 and N.

Read top to bottom: validate → set up processes → data → model → loop → save.
Each optimizer step takes a fixed global batch of samples (per-device batch × processes ×
accumulation). Every process computes its share; gradients are all-reduced once, on the last
micro-step only. The loss is the sum over summary tokens divided by the number of summary tokens
in the whole global batch (all processes, all micro-steps), so N processes take exactly the step
that one process would take with N times the accumulation.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from tqdm.auto import tqdm

from ddptune import checkpoint, config as config_lib, data, evaluate, metrics, model as model_lib
from ddptune.config import Config, ConfigError


WARMUP_STEPS = 2  # steps left out of steady-state speed figures (allocator, kernel selection)


def setup(cfg: Config) -> Accelerator:
    """Join the process group the launcher described (a group of one without a launcher).

    Accelerator sets this process's CUDA device (cuda:LOCAL_RANK) before any CUDA work.
    """
    cuda = torch.cuda.is_available()
    if cuda:
        # cuDNN's attention spends ~25 ms of CPU per call building a plan for every new sequence
        # length (measured on H200, torch 2.11): with varying lengths it dominated the step.
        # Flash and memory-efficient attention have no such cost.
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = model_lib.compute_dtype(cfg.train.precision, torch.device("cuda" if cuda else "cpu"))
    accelerator = Accelerator(cpu=not cuda, mixed_precision="bf16" if dtype == torch.bfloat16 else "no")
    if not accelerator.is_main_process:  # only rank 0 writes to the console
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        logging.disable(logging.WARNING)
        warnings.filterwarnings("ignore")
    return accelerator


def load_data(cfg: Config, tokenizer, accelerator: Accelerator) -> tuple[list[dict], list[dict]]:
    """Tokenized train and validation examples; the main process tokenizes, the others read its cache."""
    cache = Path(cfg.output_dir) / "cache"
    tok_id = model_lib.fingerprint(tokenizer)
    with accelerator.main_process_first():
        train_rows = data.load_split(cfg.data.train, cfg.data.train_rows, cfg.data)
        train = data.tokenize_cached(train_rows, tokenizer, cfg.data, cache, tok_id)
        val = []
        if cfg.data.val:
            val_rows = data.load_split(cfg.data.val, cfg.data.val_rows, cfg.data)
            val = data.tokenize_cached(val_rows, tokenizer, cfg.data, cache, tok_id)
    return train, val


def build_model(cfg: Config, accelerator: Accelerator):
    """The model with adapters, whether gradient checkpointing is on, and whether layers are compiled."""
    t = cfg.train
    with accelerator.main_process_first():  # a preset checkpoint or hub download is made once
        base = model_lib.load_model(cfg.model, t.method, accelerator.device, t.precision, t.seed)
    tokens = t.tokens_per_forward if t.packing else t.micro_batch_size * cfg.data.max_length
    checkpointing = model_lib.use_checkpointing(t.gradient_checkpointing, base, tokens, accelerator.device)
    set_seed(t.seed)  # adapters start equal on every process
    model = model_lib.add_adapters(base, t.method, cfg.lora, checkpointing)
    compiled = t.compile is True or (t.compile == "auto" and accelerator.device.type == "cuda")
    if compiled:
        model_lib.compile_layers(model)
    return model, checkpointing, compiled


def build_optimizer(cfg: Config, model, total_steps: int):
    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    if t.optimizer == "adamw":
        fused = params[0].is_cuda
        opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, fused=fused)
    else:
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if t.optimizer == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        opt = cls(params, lr=t.lr, weight_decay=t.weight_decay)
    sched = transformers.get_scheduler(t.lr_schedule, opt, num_warmup_steps=t.warmup_steps, num_training_steps=total_steps)
    return opt, sched


@torch.no_grad()
@torch.compiler.set_stance("force_eager")  # padded batches without gradients: not what train.compile compiled
def validation_loss(loss_model, examples: list[dict], micro: int, pad_id: int, accelerator: Accelerator) -> float:
    """Token-weighted loss over all validation examples: each process sums its share's token
    losses and counts, the sums are reduced, then divided (never an average of averages).
    `loss_model` is not the DDP wrapper: processes may run different numbers of batches."""
    was_training = loss_model.training
    loss_model.eval()
    mine = examples[accelerator.process_index::accelerator.num_processes]
    sums = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for i in range(0, len(mine), micro):
        chunk = mine[i:i + micro]
        batch = {k: v.to(accelerator.device) for k, v in data.collate(chunk, pad_id).items()}
        with accelerator.autocast():
            loss_sum = loss_model(**batch, num_items=1)
        sums += torch.stack([loss_sum.double(), torch.tensor(data.target_tokens(chunk), device=sums.device, dtype=torch.float64)])
    loss_model.train(was_training)
    sums = accelerator.reduce(sums, "sum")
    return (sums[0] / sums[1]).item()


def save_final(cfg: Config, model, tokenizer, accelerator: Accelerator) -> Path:
    """The adapter (PEFT format) or full model, with tokenizer and resolved config, renamed into place."""
    name = "model" if cfg.train.method == "full" else "adapter"
    final = Path(cfg.output_dir) / name
    if accelerator.is_main_process:
        tmp = checkpoint.atomic_dir(final)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "ddptune.yaml").write_text(config_lib.dump(cfg))
        checkpoint.commit(tmp, final)
    accelerator.wait_for_everyone()
    return final


def replica_fingerprints(model, accelerator: Accelerator) -> list[str]:
    """A hash of this process's trained weights, gathered from every process: all equal when
    the replicas took identical steps (checked at the end of every run)."""
    h = hashlib.sha256()
    for name, p in sorted(model_lib.trainable_state(model).items()):
        h.update(name.encode())
        h.update(p.float().cpu().numpy().tobytes())
    return gather_object([h.hexdigest()[:16]])


def run(cfg: Config, resume: bool = False):
    """Train as configured; every process calls this. Returns (summary, trained model)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan = config_lib.validate(cfg, world, resume=resume)
    accelerator = setup(cfg)
    accelerator.wait_for_everyone()  # every process has validated before anything is written
    out = Path(cfg.output_dir)
    say = accelerator.print
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(config_lib.dump(cfg))
    t0 = time.perf_counter()

    tokenizer = model_lib.load_tokenizer(cfg.model)
    train_set, val_set = load_data(cfg, tokenizer, accelerator)
    if len(train_set) < plan.global_batch:
        raise ConfigError([f"data.train: {len(train_set)} rows are fewer than one global batch of {plan.global_batch} (lower train.micro_batch_size or the accumulation)"])
    steps_per_epoch = len(train_set) // plan.global_batch
    total_steps = cfg.train.max_steps or max(1, math.floor(cfg.train.epochs * steps_per_epoch))

    model, checkpointing, compiled = build_model(cfg, accelerator)
    optimizer, scheduler = build_optimizer(cfg, model, total_steps)
    trainable, total = model_lib.count_params(model)
    n_matrix, n_head = metrics.matrix_weights(model)
    n_adapter = trainable if cfg.train.method != "full" else 0
    n_layers, hidden = model_lib.shape(model)
    # DDP wraps the loss module; `model` inside it is what is saved, checkpointed and evaluated.
    loss_model = model_lib.CausalLMLoss(model)
    engine, optimizer = accelerator.prepare(loss_model, optimizer)

    start = 0
    if resume:
        last = checkpoint.list_checkpoints(out / "checkpoints")[-1]
        state = checkpoint.load(last, model, optimizer, scheduler, accelerator.process_index)
        if state["world_size"] != accelerator.num_processes:
            raise ConfigError([f"--resume: {last} was written by {state['world_size']} processes; resume with --nproc {state['world_size']}"])
        start = state["step"]
    load_s = time.perf_counter() - t0

    say(f"ddptune: {cfg.model.source} | {cfg.train.method} | {trainable:,} of {total:,} parameters trained"
        f" | gradient checkpointing {'on' if checkpointing else 'off'} | compiled layers {'on' if compiled else 'off'}")
    say(f"ddptune: {accelerator.num_processes} process(es) on {accelerator.device.type} "
        f"({accelerator.distributed_type.value}, mixed precision {accelerator.mixed_precision})")
    say(f"ddptune: {plan.describe()}" + (f", packed into rows of <= {cfg.train.tokens_per_forward} tokens"
                                         f" ({cfg.model.attn_implementation} attention)" if cfg.train.packing else ""))
    say(f"ddptune: {len(train_set)} training examples, {steps_per_epoch} steps per epoch, "
        f"{total_steps} steps" + (f", resuming after step {start}" if start else ""))
    if cfg.eval.enabled and cfg.eval.zero_shot and cfg.train.method != "full" and not resume:
        with model.disable_adapter():  # the base model, before any step
            evaluate.evaluate(model, tokenizer, evaluate.eval_rows(cfg), cfg, accelerator, out / "eval-base", "zero-shot")

    log = metrics.JsonlWriter(out / "metrics.jsonl", keep_until_step=start) if accelerator.is_main_process else None
    lengths = [len(e["input_ids"]) for e in train_set]
    peak = metrics.peak_tflops(accelerator.device)
    pad_id = tokenizer.pad_token_id
    bar = tqdm(total=total_steps, initial=start, desc="train", disable=not accelerator.is_main_process, dynamic_ncols=True)
    engine.train()
    t_train = time.perf_counter()
    last_loss = val_loss = float("nan")
    history = []
    profiler = None
    for step in range(start, total_steps):
        if cfg.train.profile_steps and step == start + WARMUP_STEPS:
            profiler = start_profiler()
        t_step = time.perf_counter()
        mine = my_share(cfg, plan, train_set, lengths, step, accelerator)
        batches = forward_batches(cfg, mine, pad_id)
        # All summary tokens of the global batch: every forward divides its token-loss sum by it.
        n_target = accelerator.reduce(torch.tensor(data.target_tokens(mine), device=accelerator.device), "sum")
        loss_sum = torch.zeros((), device=accelerator.device)
        for k, batch in enumerate(batches):
            batch = {key: v.to(accelerator.device, non_blocking=True) if torch.is_tensor(v) else v for key, v in batch.items()}
            sync = k == len(batches) - 1 and cfg.train.grad_sync  # all-reduce on the last forward only
            with (nullcontext() if sync else accelerator.no_sync(engine)), accelerator.autocast():
                loss = engine(**batch, num_items=n_target)
            # DDP averages gradients over processes; scaling by their number makes it a sum.
            accelerator.backward(loss * accelerator.num_processes)
            loss_sum += loss.detach().float()
        grad_norm = accelerator.clip_grad_norm_(engine.parameters(), cfg.train.max_grad_norm or float("inf"))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        real = sum(len(e["input_ids"]) for e in mine)
        computed = sum(b["input_ids"].numel() for b in batches)
        attended = metrics.attended_keys([len(e["input_ids"]) for e in mine])
        counts = torch.tensor([real, computed, attended], device=accelerator.device, dtype=torch.float64)
        stats = accelerator.reduce(torch.cat([loss_sum.double().reshape(1), counts]), "sum").tolist()
        loss_v, real_g, padded_g, attended_g = stats[0], int(stats[1]), int(stats[2]), stats[3]
        dt = time.perf_counter() - t_step
        row = {
            "step": step + 1, "loss": loss_v, "lr": lr, "grad_norm": float(grad_norm),
            "samples": plan.global_batch, "tokens": real_g, "target_tokens": int(n_target), "padded_tokens": padded_g,
            "forwards": len(batches), "step_time_s": dt, "tokens_per_s": real_g / dt,
            "tokens_per_s_per_gpu": real_g / dt / accelerator.num_processes,
        }
        if peak:
            fpt = metrics.flops_per_token(n_matrix, n_head, n_adapter, n_layers, hidden, attended_g / real_g,
                                          cfg.train.method, head_fraction=row["target_tokens"] / real_g)
            row["mfu"] = fpt * row["tokens_per_s_per_gpu"] / (peak * 1e12)
            row["peak_mem_gib"] = metrics.peak_memory_gib(accelerator.device)
        if profiler and step + 1 == start + WARMUP_STEPS + cfg.train.profile_steps:
            stop_profiler(profiler, out / "profile.txt", accelerator)
            profiler = None
        last_loss = loss_v
        history.append(row)
        if log:
            log.write(row)
        bar.set_postfix(loss=f"{loss_v:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", lr=f"{lr:.2e}")
        bar.update(1)
        done = step + 1
        if cfg.train.val_every and val_set and done % cfg.train.val_every == 0 and done < total_steps:
            val_loss = validation_loss(loss_model, val_set, cfg.train.micro_batch_size, pad_id, accelerator)
            if log:
                log.write({"step": done, "val_loss": val_loss})
            if accelerator.is_main_process:
                bar.write(f"step {done}: val_loss {val_loss:.4f}")
        if cfg.train.save_every and done % cfg.train.save_every == 0:
            save_checkpoint(cfg, model, optimizer, scheduler, accelerator, done)
    bar.close()
    train_s = time.perf_counter() - t_train
    if val_set:
        val_loss = validation_loss(loss_model, val_set, cfg.train.micro_batch_size, pad_id, accelerator)
        if log:
            log.write({"step": total_steps, "val_loss": val_loss})
    fingerprints = replica_fingerprints(model, accelerator)
    peaks = gather_object([metrics.peak_memory_gib(accelerator.device)])
    if len(set(fingerprints)) != 1 and cfg.train.grad_sync:
        raise RuntimeError(f"replicas diverged: weight hashes per process {fingerprints}")
    final = save_final(cfg, model, tokenizer, accelerator)
    if cfg.eval.enabled:
        scores = evaluate.evaluate(model, tokenizer, evaluate.eval_rows(cfg), cfg, accelerator, out / "eval", "fine-tuned")
    if log:
        log.close()
    warm = min(WARMUP_STEPS, len(history) - 1)
    steady = sorted(r["step_time_s"] for r in history[warm:]) or [0.0]
    summary = {
        "steps": total_steps, "world_size": accelerator.num_processes, "global_batch": plan.global_batch,
        "grad_accum": plan.grad_accum, "micro_batch_size": plan.micro_batch_size, "packing": cfg.train.packing,
        "final_loss": last_loss, "val_loss": val_loss, "load_time_s": load_s, "train_time_s": train_s,
        "warmup_steps_excluded": warm, "median_step_time_s": steady[len(steady) // 2],
        "tokens_per_s_per_gpu": (sum(r["tokens"] for r in history[warm:]) / max(sum(r["step_time_s"] for r in history[warm:]), 1e-9)
                                 / accelerator.num_processes) if history else 0.0,
        "mfu": (sum(r.get("mfu", 0) for r in history[warm:]) / len(history[warm:])) if peak and history else None,
        "peak_mem_gib": max(peaks) if None not in peaks else None, "peak_mem_gib_per_process": peaks,
        "train_rows": len(train_set), "steps_per_epoch": steps_per_epoch, "method": cfg.train.method,
        "gradient_checkpointing": checkpointing, "compiled": compiled, "grad_sync": cfg.train.grad_sync,
        "trainable_params": trainable, "total_params": total, "output": str(final), "replica_fingerprints": fingerprints,
    }
    if cfg.eval.enabled and accelerator.is_main_process:
        summary["rouge"] = {k: scores[k] for k in evaluate.ROUGE_KEYS}
    if accelerator.is_main_process:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        say(f"ddptune: done in {summary['train_time_s']:.1f}s: final loss {last_loss:.4f}"
            + (f", val loss {val_loss:.4f}" if val_set else "")
            + f", {summary['tokens_per_s_per_gpu']:.0f} tokens/s per process; saved {final}")
    accelerator.wait_for_everyone()
    return summary, model


def start_profiler():
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    profiler.__enter__()
    return profiler


def stop_profiler(profiler, path: Path, accelerator: Accelerator) -> None:
    profiler.__exit__(None, None, None)
    if accelerator.is_main_process:
        table = profiler.key_averages()
        text = "\n\n".join(table.table(sort_by=key, row_limit=30)
                            for key in ("self_cpu_time_total", "self_device_time_total" if torch.cuda.is_available() else "cpu_time_total"))
        path.write_text(text)


def my_share(cfg: Config, plan, train_set: list[dict], lengths: list[int], step: int, accelerator: Accelerator) -> list[dict]:
    """This process's samples of optimizer step `step`: the step's global batch is cut into
    processes × accumulation micro-batches of similar lengths, dealt out in turn."""
    idx = data.step_samples(len(train_set), plan.global_batch, step, cfg.train.seed)
    micro = data.split_step(idx, lengths, accelerator.num_processes * plan.grad_accum)
    return [train_set[i] for m in micro[accelerator.process_index::accelerator.num_processes] for i in m]


def forward_batches(cfg: Config, examples: list[dict], pad_id: int) -> list[dict]:
    """The inputs of each forward pass: padded micro-batches, or one packed row each."""
    t = cfg.train
    if t.packing:
        return [data.collate_packed(group) for group in data.pack(examples, t.tokens_per_forward)]
    return [data.collate(examples[i:i + t.micro_batch_size], pad_id) for i in range(0, len(examples), t.micro_batch_size)]


def save_checkpoint(cfg: Config, model, optimizer, scheduler, accelerator: Accelerator, step: int) -> None:
    rngs = gather_object([checkpoint.rng_state()])  # every process's RNG, in rank order
    if accelerator.is_main_process:
        folder = Path(cfg.output_dir) / "checkpoints"
        weights = model_lib.trainable_state(model)
        checkpoint.save(folder, step, weights, optimizer, scheduler, rngs, {"world_size": accelerator.num_processes})
        checkpoint.prune(folder, cfg.train.keep_checkpoints)
    accelerator.wait_for_everyone()

