"""The ways a job can run and the first that fits: `ddptune plan`'s table, from memory.py's byte model.

Each way (`ways`: the config's strategy as set, with checkpointing, sharded, on the other base) is sized
by `memory.estimate`; `plan` recommends the first that fits GPUs of a given size, or says how many GPUs
would hold it, or why none does. The speed decider names that way out where a run does not fit.
"""
from __future__ import annotations

import dataclasses

from ddptune import memory
from ddptune.batchplan import batch_plan
from ddptune.config import Config, ConfigError


WHAT = {"lora": "LoRA on the bf16 base", "qlora": "QLoRA (a 4-bit base)", "full": "full fine-tuning"}


def ways(cfg: Config, gpus: int):
    """The ways `plan` tries, in its order: (name, method, checkpointing, shards, fsdp). The config's
    own strategy, then with checkpointing; then sharded over `gpus`. LoRA and QLoRA then try each
    other's base: QLoRA the bf16 one sharded before its own sharded (exact weights, nothing to
    dequantize in every pass), LoRA the 4-bit one with DDP, then sharded. Each without
    checkpointing first."""
    t, fsdp_set = cfg.train, cfg.train.strategy == "fsdp"
    gcs = (True,) if t.gradient_checkpointing is True else (False, True)
    with_gc = lambda gc: " with gradient checkpointing" if gc else ""  # noqa: E731
    here, shards = (f"FSDP over {gpus} GPUs", gpus) if fsdp_set else ("DDP", 1)
    yield f"{here} as configured", t.method, t.gradient_checkpointing is True, shards, fsdp_set
    if t.gradient_checkpointing is not True:
        yield f"{here} with gradient checkpointing", t.method, True, shards, fsdp_set
    shard_too = gpus > 1 and not fsdp_set
    tried = [(t.method, "fsdp")] if shard_too else []
    if t.method == "qlora" and shard_too:
        tried = [("lora", "fsdp"), ("qlora", "fsdp")]
    elif t.method == "lora":
        tried += [("qlora", "ddp")] + ([("qlora", "fsdp")] if gpus > 1 else [])
    for method, strategy in tried:
        label = "" if method == t.method else f"{WHAT[method]}: "
        for gc in gcs:
            if strategy == "ddp":
                yield f"{label}DDP{with_gc(gc)}", method, gc, 1, False
            else:
                yield f"{label}FSDP over {gpus} GPUs{with_gc(gc)}", method, gc, gpus, True


def plan(cfg: Config, shape: memory.Shape, gpus: int = 1, gpu_gib: float = memory.DEFAULT_GPU_GIB) -> dict:
    """Predict each way of running `cfg` on GPUs of `gpu_gib` (`ways`, in order) and recommend the
    first that fits; a sharded way fits only where each process can first load the whole model onto
    its GPU (`memory.load_gib`). Else it does not fit, with the smallest GPU count that would (FSDP), or
    none when the load or one forward's activations alone exceed a GPU."""
    budget = gpu_gib * memory.GIB
    world = gpus
    try:
        batch_plan(cfg.train, world)
    except ConfigError:  # the batch does not divide over `gpus`: size the forward for one process
        world = 1
    options, chosen = [], None

    def option(name: str, method: str, checkpointing: bool, shards: int, fsdp: bool) -> dict:
        c = cfg if method == cfg.train.method else dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, method=method))
        est = memory.estimate(shape, memory.job_of(c, world, checkpointing=checkpointing, shards=shards, fsdp=fsdp))
        load = memory.load_gib(shape, method) if fsdp else None
        row = {"option": name, "method": method, "gradient_checkpointing": checkpointing, "shards": shards, "fsdp": fsdp,
               **{k: v / memory.GIB for k, v in est.items()}, "load_gib": load,
               "fits": est["total"] <= budget and (load is None or load <= gpu_gib)}
        options.append(row)
        return row

    for way in ways(cfg, gpus):
        if (row := option(*way))["fits"]:
            chosen = row
            break
    needed, needed_gc = (None, None) if chosen else gpus_needed(cfg, shape, gpus, gpu_gib)
    verdict, action = recommendation(cfg=cfg, shape=shape, gpus=gpus, gpu_gib=gpu_gib, chosen=chosen, as_is=options[0],
                                     needed=needed, needed_gc=needed_gc)
    if not chosen and needed:
        option(f"FSDP over {needed} GPUs{' with gradient checkpointing' if needed_gc else ''}", cfg.train.method,
               needed_gc, needed, True)
    # QLoRA that fits with DDP: whether its base would fit dequantized too (the speed decider keeps it so where it does)
    faster = chosen and chosen["method"] == "qlora" and not chosen["fsdp"] and memory.estimate(
        shape, dataclasses.replace(memory.job_of(cfg, world, checkpointing=chosen["gradient_checkpointing"], fsdp=False),
                                   method="qlora", dequantized=True))["total"]
    faster = faster / memory.GIB if faster and faster <= budget else None
    job = memory.job_of(cfg, world)
    return {"model": cfg.model.source, "method": cfg.train.method, "optimizer": cfg.train.optimizer,
            "gpus": gpus, "gpu_memory_gib": gpu_gib, "tokens_per_forward": job.tokens, "targets_assumed": job.targets,
            "compiled": job.compiled, "params": shape.params, "trained_params": shape.params if cfg.train.method == "full"
            else shape.lora_params(cfg.lora.r, list(cfg.lora.target_modules)) + shape.saved_params(cfg.lora.modules_to_save),
            "shape": dataclasses.asdict(shape), "options": options, "verdict": verdict, "recommendation": action,
            "recommended_method": chosen["method"] if chosen else None, "load_gib": memory.load_gib(shape, cfg.train.method),
            "margin": options[0]["total"] / gpu_gib - 1,  # as configured: over (+) or under (-) the GPU's memory
            "fsdp_gpus_needed": needed, "cuda_graphs": cfg.train.cuda_graphs, "dequantized_base_gib": faster,
            "constants": {"cuda_context_gib": memory.CUDA_CONTEXT_GIB, "allocator_slack": memory.ALLOCATOR_SLACK,
                          "compiled_activations": memory.COMPILED_ACTIVATIONS, "target_share": memory.TARGET_SHARE}}


def gpus_needed(cfg: Config, shape: memory.Shape, gpus: int, gpu_gib: float) -> tuple[int | None, bool | None]:
    """The smallest GPU count above `gpus` over which FSDP would hold the config's method, and whether
    that needs checkpointing (off where that is enough); (None, None) where no count does: the whole
    model does not load onto one GPU, or one forward's activations alone exceed it."""
    if memory.load_gib(shape, cfg.train.method) > gpu_gib:
        return None, None
    for n in range(max(gpus, 1) + 1, memory.MAX_GPUS + 1):
        fits = [gc for gc in (False, True)
                if memory.estimate(shape, memory.job_of(cfg, 1, checkpointing=gc, shards=n))["total"] <= gpu_gib * memory.GIB]
        if fits:
            return n, fits[0]
    return None, None


def recommendation(cfg: Config, shape: memory.Shape, gpus: int, gpu_gib: float, chosen: dict | None, as_is: dict,
                   needed: int | None, needed_gc: bool | None) -> tuple[str, str]:
    """(verdict, the way to run it in words) for the option `plan` chose, or for none."""
    t, fsdp_set = cfg.train, cfg.train.strategy == "fsdp"
    if chosen is as_is:
        verdict = "fsdp" if fsdp_set else "ddp"
        return verdict, ("FSDP as configured" if fsdp_set else "DDP as is") + (
            " (gradient checkpointing stays off)" if t.gradient_checkpointing == "auto" else "")
    if chosen:
        with_gc = " with gradient checkpointing" if chosen["gradient_checkpointing"] else ""
        switch = "" if chosen["method"] == t.method else f"{WHAT[chosen['method']]} (train.method={chosen['method']}), "
        if not chosen["fsdp"]:
            if not switch:
                return "ddp_checkpointing", "DDP with gradient checkpointing (train.gradient_checkpointing=true)"
            return ("ddp_checkpointing" if with_gc else "ddp"), f"{switch}DDP{with_gc}" + (
                " (train.strategy=ddp)" if fsdp_set else "")
        return "fsdp", f"{switch}FSDP (full shard) over {gpus} GPUs{with_gc}" + (
            "" if fsdp_set else " (train.strategy=fsdp)")
    load, gpus_word = memory.load_gib(shape, t.method), f"{gpus} GPU{'s' if gpus > 1 else ''}"
    if gpu_gib <= memory.CUDA_CONTEXT_GIB:
        tail = f"the CUDA context alone takes {memory.CUDA_CONTEXT_GIB} GiB of each GPU (use GPUs with more memory)"
    elif needed:
        tail = f"FSDP (full shard) over {needed} GPUs{' with gradient checkpointing' if needed_gc else ''} would fit"
    elif load > gpu_gib:
        tail = (f"each process loads the whole model onto its GPU before FSDP shards it, {load:.1f} GiB for "
                f"{t.method}, more than a GPU holds (use GPUs with more memory"
                + (", or train.method=qlora: a 4-bit base" if t.method != "qlora" else "") + ")")
    else:
        tail = ("no GPU count fits: what each GPU holds whatever the count (one forward's activations, the gathered "
                "embeddings and head) exceeds it (lower train.tokens_per_forward or micro_batch_size)")
    return "does_not_fit", f"does not fit on {gpus_word} of {gpu_gib:g} GiB: {tail}"
