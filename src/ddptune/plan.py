"""`ddptune plan CONFIG [--gpus N] [--gpu-memory GiB] [--json PATH]`: the memory table and the way to run it.

Peak memory per GPU for each way of running the config (memory.py's estimate, from the model's
config alone: no weights are loaded), then the first that fits, or the smallest GPU count that would.
Then the run's own choices (speed.decide: checkpointing, the base, compiled layers, graphs, padded
lengths, buckets), made as `ddptune train` makes them on this machine's device (or on GPUs of
--gpu-memory GiB), from the same sample of the steps: the plan's JSON `speed` and the run's
summary.json `speed` are one record.
"""
from __future__ import annotations

import math

from ddptune import checks, config as config_lib, memory, report, rundir, ways
from ddptune.config import ConfigError


def main(args) -> int:
    cfg = config_lib.load(args.config, args.overrides)
    problems = checks.check_values(cfg)
    if args.gpus < 1:
        problems.append(f"--gpus: must be at least 1 (got {args.gpus})")
    if args.gpu_memory is not None and not (math.isfinite(args.gpu_memory) and args.gpu_memory > 0):
        problems.append(f"--gpu-memory: must be a positive number of GiB (got {args.gpu_memory})")
    if problems := problems + rundir.report_file_problems("--json", args.json, "plan.json"):
        raise ConfigError(problems)
    try:
        shape = memory.model_shape(cfg)
    except Exception as e:  # noqa: BLE001 - no config.json, an unreadable GGUF header, an unknown architecture
        raise ConfigError([f"model.source: the model's config cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:200]})"])
    from ddptune import speed  # (torch: only once the config and the model's are read)

    chosen, where = speed.run_choices(cfg, shape, args.gpus, args.gpu_memory)
    print(f"ddptune plan: the run's choices {where}" + "".join(f"\n  {line}" for line in chosen.lines()) if chosen else
          f"ddptune plan: {where}")
    if chosen and chosen.fits is not None and (free := chosen.estimate.get("free_gib")) is not None:
        print(f"  fits: {'yes' if chosen.fits else 'no'} (the least memory of the options costed, "
              f"{chosen.estimate['least_gib']:.1f} GiB, "
              f"against {free:.1f} GiB free)")
    if shape.experts:
        print(f"ddptune plan: {cfg.model.source} is a mixture of {shape.experts} experts a layer, which the memory "
              "estimate does not model: no estimate (the run measures its own peak; `ddptune train` then says it)")
        result = {"model": cfg.model.source, "estimate": None, "experts": shape.experts}
    else:
        result = ways.plan(cfg, shape, args.gpus, args.gpu_memory or local_gpu_gib() or memory.DEFAULT_GPU_GIB)
        print(table(result))
    if args.json:
        report.write_json(args.json, {**result, "speed": chosen.as_dict() if chosen else None, "speed_where": where})
    return 0


def local_gpu_gib() -> float | None:
    """Memory of this machine's first GPU in GiB, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / memory.GIB


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,}"


def table(p: dict) -> str:
    """The plan as a readable table (GiB per GPU), then the recommendation."""
    cols = ("weights", "adapters", "gradients", "optimizer", "activations", "overhead", "total")
    width = max(52, *(len(o["option"]) + 2 for o in p["options"]))
    head = f"{'option':<{width}}" + "".join(f"{c:>12}" for c in cols) + "   fits"
    lines = [f"ddptune plan: {p['model']} | {p['method']} | {p['optimizer']} | {_count(p['params'])} parameters, "
             f"{_count(p['trained_params'])} trained | {p['tokens_per_forward']} tokens per forward "
             f"({p['targets_assumed']} loss targets assumed){' | compiled layers' if p['compiled'] else ''}",
             f"GiB per GPU, {p['gpus']} GPU{'s' if p['gpus'] > 1 else ''} of {p['gpu_memory_gib']:g} GiB "
             f"(overhead: {memory.CUDA_CONTEXT_GIB} GiB CUDA context + {memory.ALLOCATOR_SLACK:.0%} allocator slack)", head]
    for o in p["options"]:
        lines.append(f"{o['option']:<{width}}" + "".join(f"{o[c]:>12.2f}" for c in cols) + f"   {'yes' if o['fits'] else 'no'}")
    loads = {o["method"]: o["load_gib"] for o in p["options"] if o.get("load_gib") is not None}
    if loads:
        lines.append("FSDP: each process first loads the whole model onto its GPU, then shards it: " + ", ".join(
            f"{v:.1f} GiB for {m}" for m, v in loads.items()) + " (a way fits only where that fits too)")
    lines.append(f"recommendation: {p['recommendation']}")
    if 0 < p["margin"] < memory.PLAN_OVER:
        lines.append(f"close: as configured it needs {p['margin']:.0%} more than the GPU holds, and the plan has been up to "
                     f"{memory.PLAN_OVER:.0%} over measured peaks: a run settles it (train.memory_check=false lets it try)")
    elif -memory.PLAN_UNDER < p["margin"] <= 0:
        lines.append(f"close: as configured it leaves {-p['margin']:.0%} of the GPU free, and the plan has been up to "
                     f"{memory.PLAN_UNDER:.0%} under measured peaks: it may not fit")
    if p.get("dequantized_base_gib"):
        lines.append(f"faster: the base fits dequantized too ({p['dequantized_base_gib']:.1f} GiB per GPU): ddptune keeps it so "
                     "where that leaves room (the same NF4-rounded weights, no dequantizing in every pass)")
    return "\n".join(lines)
