"""`ddptune scale`: the same training at each process count, then a scaling table with the
communication it costs, measured and predicted.

Read top to bottom: plan (check every count first) → bandwidth → runs → rows → predictions → files.

For each n: `ddptune train` through torchrun in OUT/n{n}; for n > 1 also a short run with
`train.grad_sync=false` in OUT/n{n}-nosync, whose step time is the compute without the gradient
all-reduce, so communication per step = median step time (sync) - median step time (no sync).
Steady state = the median over the steps after the first `warmup`.

Modes (named in every output):
- same-per-device: micro batch and accumulation as configured (an effective_batch_size becomes
  the accumulation it gives at n=1), so the global batch grows with n;
- same-global: the global batch is the one n=1 would use at every n; the accumulation adapts.
Speedup compares throughput: samples/s at n / samples/s at n=1 (never step times, since in
same-per-device mode a step holds n times the samples); efficiency = speedup / n.

Gradient bytes per optimizer step = trainable parameters x 4: DDP all-reduces fp32 gradients
(LoRA adapters are fp32, full fine-tuning keeps fp32 master weights; bf16 is autocast only).
Cost model (comm.predict) with the peak measured busbw; backward time = a FLOP fraction of the
no-sync step: forward 2, backward 2 (LoRA/QLoRA: input gradients only) or 4 (full: weight
gradients too), +2 with gradient checkpointing (recomputed forward) per weight and token, i.e.
LoRA 1/2, LoRA+checkpointing 2/3, full 2/3. Peak busbw is reached at large buffers only, so for
small (LoRA) gradients the prediction is optimistic.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shlex
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml

from ddptune import comm, config as config_lib, env, launch, report
from ddptune.config import BatchPlan, ConfigError
from ddptune.train import WARMUP_STEPS

SAME_PER_DEVICE, SAME_GLOBAL = "same-per-device", "same-global"
WHAT_IF_N = (2, 4, 8)
COLUMNS = [  # (row key, header): scaling.csv uses the keys, scaling.md the headers
    ("nproc", "n"), ("batch", "micro x n x accum = global"), ("step_s", "step (s)"),
    ("compute_s", "compute (s)"), ("comm_s", "comm (s)"), ("tokens_per_s", "tokens/s"),
    ("tokens_per_s_per_gpu", "tokens/s/GPU"), ("samples_per_s", "samples/s"),
    ("samples_per_s_per_gpu", "samples/s/GPU"), ("epoch_s", "epoch (s)"), ("speedup", "speedup"),
    ("efficiency", "efficiency"), ("peak_mem_gib", "peak mem/GPU (GiB)"),
    ("final_loss", "final loss"), ("val_loss", "val loss"),
]
PRED_COLUMNS = [
    ("nproc", "n"), ("busbw_GBps", "busbw (GB/s)"), ("pred_comm_s", "pred. comm (s)"),
    ("pred_exposed_s", "pred. exposed (s)"), ("meas_comm_s", "meas. comm (s)"),
    ("pred_step_s", "pred. step (s)"), ("meas_step_s", "meas. step (s)"),
    ("pred_efficiency", "pred. compute/step"), ("meas_efficiency", "meas. compute/step"),
    ("pred_speedup", "pred. speedup"), ("meas_speedup", "meas. speedup"),
]
WHAT_IF_COLUMNS = [("gradients", "gradients"), ("link", "link"), ("nproc", "n"), ("comm_s", "comm (s)"),
                   ("exposed_comm_s", "exposed (s)"), ("step_s", "step (s)"), ("speedup", "speedup"),
                   ("efficiency", "efficiency")]


def main(args) -> int:
    counts = parse_counts(args.nproc)
    base_overrides = list(args.overrides)
    cfg = config_lib.load(args.config, base_overrides)
    out = Path(args.out or f"{cfg.output_dir}-scale")
    warmup = WARMUP_STEPS if args.warmup is None else args.warmup
    sizes = parse_sizes(args.bandwidth_sizes)

    # 1. Plan and validate every count before anything runs or any folder is made.
    if out.exists() and any(out.iterdir()):
        raise ConfigError([f"--out: {out} already holds files (choose another --out, or remove it)"])
    if cfg.train.grad_accum is not None and cfg.train.effective_batch_size is not None:
        raise ConfigError(["train.grad_accum: set grad_accum or effective_batch_size, not both (e.g. add train.grad_accum=null)"])
    batch = batch_overrides(cfg.train, args.mode)
    nosync_steps = max(warmup + 3, min(cfg.train.max_steps or math.inf, warmup + 10))
    runs, problems = {}, []
    for n in counts:
        runs[n] = {"dir": out / f"n{n}", "overrides": [*batch, f"output_dir={as_yaml(out / f'n{n}')}"]}
        if n > 1:
            runs[n]["nosync_dir"] = out / f"n{n}-nosync"
            runs[n]["nosync_overrides"] = [*batch, "train.grad_sync=false", f"train.max_steps={nosync_steps}",
                                           "data.val=null", "train.val_every=0", "train.save_every=0",
                                           "eval.enabled=false", f"output_dir={as_yaml(out / f'n{n}-nosync')}"]
        try:
            runs[n]["plan"] = config_lib.validate(config_lib.load(args.config, base_overrides + runs[n]["overrides"]), n)
            if n > 1:
                config_lib.validate(config_lib.load(args.config, base_overrides + runs[n]["nosync_overrides"]), n)
        except ConfigError as e:
            problems += [f"--nproc {n} ({args.mode}): {p}" for p in e.problems]
    if warmup < 0:
        problems.append(f"--warmup: {warmup} must be 0 or more")
    if cfg.train.max_steps is not None and cfg.train.max_steps <= warmup:
        problems.append(f"train.max_steps: {cfg.train.max_steps} leaves no step after the {warmup} warm-up steps (raise it)")
    if torch.cuda.is_available() and max(counts) > torch.cuda.device_count():
        problems.append(f"--nproc: {max(counts)} processes but only {torch.cuda.device_count()} GPUs (one process per GPU)")
    if problems:
        raise ConfigError(sorted(set(problems), key=problems.index))

    # 2. All-reduce bandwidth over the largest count, then the runs.
    topo = comm.topology()
    bandwidth = {"nproc": max(counts), "status": "single process: no all-reduce to measure"}
    if max(counts) >= 2:
        iters, bw_warmup = (20, 5) if torch.cuda.is_available() else (5, 2)
        try:
            result = comm.measure_bandwidth(max(counts), sizes, iters=iters, warmup=bw_warmup)
            busbws = [r["busbw_GBps"] for r in result["rows"] if r["busbw_GBps"]]
            bandwidth.update(status="measured", backend=result["backend"], device=result["device"],
                             rows=result["rows"], peak_busbw_GBps=max(busbws) if busbws else None)
        except RuntimeError as exc:  # the runs still give measured comm times; predictions need busbw
            bandwidth["status"] = f"failed: {exc}"
    for n in counts:
        for key in ("", "nosync_"):
            if f"{key}overrides" in runs[n]:
                child = ["ddptune", "train", args.config, *base_overrides, *runs[n][f"{key}overrides"]]
                runs[n][f"{key}command"] = shlex.join(child)
                print(f"ddptune scale: {n} process(es){', no gradient sync' if key else ''}: {shlex.join(child[1:])}", flush=True)
                rc = launch.torchrun(n, child)
                if rc != 0:
                    print(f"ddptune scale: the run with {n} process(es) failed (exit {rc}); see {runs[n][f'{key}dir']}", file=sys.stderr)
                    return rc or 1

    # 3. One row per count, read back from each run's summary.json and metrics.jsonl.
    rows = [clean(measure(n, runs[n], warmup)) for n in counts]
    base = rows[0]  # n = 1 (parse_counts insists)
    for r in rows:
        r["speedup"] = r["samples_per_s"] / base["samples_per_s"]
        r["efficiency"] = r["speedup"] / r["nproc"]

    # 4. Communication: measured beside the cost model; what-if tables for other links.
    summary = json.loads((runs[1]["dir"] / "summary.json").read_text())
    method, ckpt = summary["method"], summary["gradient_checkpointing"]
    grad_bytes = comm.grad_bytes(summary["trainable_params"], 4)
    busbw = (bandwidth.get("peak_busbw_GBps") or 0) * 1e9
    frac = backward_fraction(method, ckpt)
    compute1 = base["step_s"]
    measured = []
    for r in rows:
        n, plan = r["nproc"], runs[r["nproc"]]["plan"]
        link = busbw if busbw > 0 else 1.0  # n = 1 has no all-reduce, any positive bandwidth
        if n > 1 and busbw <= 0:
            continue
        now = comm.predict(r["compute_s"], frac * r["compute_s"], grad_bytes, n, link)
        c = compute1 * plan.per_process / runs[1]["plan"].per_process  # compute at n predicted from n = 1
        ideal = comm.predict(c, frac * c, grad_bytes, n, link)
        r["predicted_speedup"] = ideal["speedup"]
        measured.append({"nproc": n, "busbw_GBps": busbw / 1e9 if n > 1 else None,
                         "pred_comm_s": now["comm_s"], "pred_exposed_s": now["exposed_comm_s"],
                         "meas_comm_s": r["comm_s"], "pred_step_s": now["step_s"], "meas_step_s": r["step_s"],
                         "pred_efficiency": now["efficiency"], "meas_efficiency": r["compute_s"] / r["step_s"],
                         "pred_speedup": ideal["speedup"], "meas_speedup": r["speedup"]})
    links = other_links(bandwidth, comm.interconnect(topo))
    all_params = summary["total_params"]
    cases = [(f"{method} ({comm.human_size(grad_bytes)})", compute1, frac, grad_bytes)]
    if method != "full":
        full_compute = compute1 * step_flops("full", ckpt) / step_flops(method, ckpt)
        cases.append((f"full ({comm.human_size(all_params * 4)})", full_compute, backward_fraction("full", ckpt), all_params * 4))
    what_if = []
    for label, c1, f, nbytes in cases:
        case = []
        for n in WHAT_IF_N:  # per-process compute at n: as at n=1, or 1/n of it with a fixed global batch
            c = c1 if args.mode == SAME_PER_DEVICE else c1 / n
            case += [{"gradients": label, **p} for p in comm.predict_table(c, f * c, nbytes, (n,), links)]
        what_if += sorted(case, key=lambda p: (list(links).index(p["link"]), p["nproc"]))

    # 5. Files, each written once and atomically; then the table on the console.
    info = env.collect(bandwidth=False)
    manifest = {
        "command": shlex.join(["ddptune", "scale", args.config, *base_overrides, "--nproc", args.nproc,
                               "--mode", args.mode, "--out", str(out), "--bandwidth-sizes", args.bandwidth_sizes]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "mode": args.mode, "config": args.config,
        "overrides": base_overrides, "seed": cfg.train.seed, "warmup_steps_excluded": warmup,
        "batch": [{"nproc": n, **dataclasses.asdict(runs[n]["plan"]), "global_batch": runs[n]["plan"].global_batch,
                   "arithmetic": arithmetic(runs[n]["plan"])} for n in counts],
        "runs": {str(n): {k: str(v) for k, v in runs[n].items() if k.endswith(("dir", "command"))} for n in counts},
        "devices": info["gpus"] or f"cpu ({info['cpu_count']} cores)", "interconnect": info["interconnect"],
        "versions": {"python": info["python"], "torch": info["torch"], "cuda": info["cuda"], "nccl": info["nccl"], **info["packages"]},
        "environment": {k: v for k, v in info.items() if k != "bandwidth"},  # measured above, in scaling.json
    }
    result = {"mode": args.mode, "rows": rows, "bandwidth": bandwidth, "interconnect": comm.interconnect(topo),
              "topology": topo, "grad_bytes": grad_bytes, "all_params": all_params,
              "backward_fraction": frac, "predictions": {"measured": measured, "other_interconnects": what_if},
              "manifest": manifest}
    columns = COLUMNS + [(k, k) for k in ("rouge1", "rouge2", "rougeL", "rougeLsum") if k in base]
    table = f"## Scaling, mode {args.mode}\n\n" + report.markdown_table(rows, columns)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(out / "scaling.json", clean(result))
    report.write_csv(out / "scaling.csv", [dict(r, mode=args.mode) for r in rows], [("mode", "mode")] + columns)
    report.write_text(out / "scaling.md", markdown(args.mode, table, bandwidth, result))
    report.plot_scaling(out / "scaling.png", [dict(r, compute_s=min(r["compute_s"], r["step_s"]),
                                                   comm_s=max(0.0, r["comm_s"])) for r in rows],
                        title=f"Data-parallel scaling ({args.mode}, {method})")
    report.write_json(out / "manifest.json", clean(manifest))
    print("\n" + table + f"\nddptune scale: wrote {out}/scaling.{{json,csv,md,png}} and manifest.json", flush=True)
    return 0


def parse_counts(text: str) -> list[int]:
    try:
        counts = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise ConfigError([f"--nproc: {text!r} is not a list of process counts (write e.g. 1,2,4)"])
    if counts[0] != 1:
        raise ConfigError([f"--nproc: include 1, the baseline every speedup is measured against (e.g. 1,{text})"])
    return counts


def parse_sizes(text: str) -> list[int]:
    try:
        return [comm.parse_size(s) for s in text.split(",") if s.strip()] or [comm.MiB]
    except ValueError as e:
        raise ConfigError([f"--bandwidth-sizes: {e}"]) from None


def batch_overrides(t: config_lib.TrainConfig, mode: str) -> list[str]:
    """The overrides that give every count the mode's batch arithmetic (n=1's plan as the anchor)."""
    one = config_lib.batch_plan(t, 1)
    if mode == SAME_PER_DEVICE:
        return [f"train.grad_accum={one.grad_accum}", "train.effective_batch_size=null"]
    return ["train.grad_accum=null", f"train.effective_batch_size={one.global_batch}"]


def measure(n: int, run: dict, warmup: int) -> dict:
    """A scaling row for n processes from the run folders (and the no-sync run for n > 1)."""
    summary = json.loads((run["dir"] / "summary.json").read_text())
    step_s, tokens = steady_state(run["dir"], warmup)
    compute_s = steady_state(run["nosync_dir"], warmup)[0] if n > 1 else step_s
    plan: BatchPlan = run["plan"]
    peaks = [p for p in summary.get("peak_mem_gib_per_process") or [] if p is not None]
    return {
        "nproc": n, "micro_batch_size": plan.micro_batch_size, "grad_accum": plan.grad_accum,
        "global_batch": plan.global_batch, "batch": arithmetic(plan), "steps": summary["steps"],
        "step_s": step_s, "compute_s": compute_s, "comm_s": step_s - compute_s,
        "tokens_per_s": tokens / step_s, "tokens_per_s_per_gpu": tokens / step_s / n,
        "samples_per_s": plan.global_batch / step_s, "samples_per_s_per_gpu": plan.global_batch / step_s / n,
        "steps_per_epoch": summary["steps_per_epoch"], "epoch_s": summary["steps_per_epoch"] * step_s,
        "peak_mem_gib": max(peaks) if peaks else None, "final_loss": summary["final_loss"],
        "val_loss": summary["val_loss"], **(summary.get("rouge") or {}),
    }


def steady_state(run_dir: Path, warmup: int) -> tuple[float, float]:
    """(median step time, mean real tokens per step) over the steps after the first `warmup`."""
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"step_time_s"' in line]
    kept = steps[warmup:] or steps[-1:]
    return statistics.median(r["step_time_s"] for r in kept), statistics.fmean(r["tokens"] for r in kept)


def step_flops(method: str, checkpointing: bool) -> int:
    """FLOPs per weight and token of one training step: forward 2, backward 2 (frozen weights:
    input gradients) or 4 (weight gradients too), recomputed forward 2."""
    return 2 + (4 if method == "full" else 2) + (2 if checkpointing else 0)


def backward_fraction(method: str, checkpointing: bool) -> float:
    """The share of a step that backward takes (bucket all-reduces can hide behind it)."""
    return 1 - 2 / step_flops(method, checkpointing)


def other_links(bandwidth: dict, label: str) -> dict[str, float]:
    """PCIe preset; NVLink measured when GPUs were measured over it, else the preset."""
    pcie, nvlink = (next(k for k in comm.INTERCONNECTS if word in k) for word in ("PCIe", "NVLink"))
    links = {pcie: comm.INTERCONNECTS[pcie]}
    if bandwidth.get("backend") == "nccl" and bandwidth.get("peak_busbw_GBps"):
        links[f"this machine: {label}, measured ({bandwidth['peak_busbw_GBps']:.0f} GB/s busbw)"] = bandwidth["peak_busbw_GBps"] * 1e9
    if label != "NVLink" or len(links) == 1:
        links[nvlink] = comm.INTERCONNECTS[nvlink]
    return links


def as_yaml(path: Path) -> str:
    """A path as an override value: plain where YAML reads it back as the same text, else quoted."""
    text = str(path)
    try:
        plain = yaml.safe_load(text) == text
    except yaml.YAMLError:
        plain = False
    return text if plain else json.dumps(text)


def arithmetic(plan: BatchPlan) -> str:
    return f"{plan.micro_batch_size} x {plan.world_size} x {plan.grad_accum} = {plan.global_batch}"


def clean(obj):
    """NaN and infinities become null, so the JSON files are strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def markdown(mode: str, table: str, bandwidth: dict, result: dict) -> str:
    m = result["manifest"]
    parts = [f"# ddptune scale: {m['config']}, mode {mode}\n",
             f"`{m['command']}`, {m['date']}. Step times are medians after {m['warmup_steps_excluded']} warm-up steps; "
             "compute = the step without gradient sync, comm = step - compute; speedup = samples/s at n over samples/s at 1.\n",
             table]
    parts.append(f"## All-reduce bandwidth, {bandwidth['nproc']} processes ({bandwidth.get('backend', 'none')})\n")
    parts.append(f"Interconnect: {result['interconnect']}.\n")
    parts.append(comm.format_rows(bandwidth["rows"]) if bandwidth["status"] == "measured" else bandwidth["status"] + "\n")
    parts.append(f"## Predicted vs measured communication, mode {mode}\n")
    parts.append(f"Gradients all-reduced per optimizer step: {comm.human_size(result['grad_bytes'])} (trainable parameters x 4 bytes, fp32); "
                 f"backward = {result['backward_fraction']:.2f} of the no-sync step; busbw = the peak measured. "
                 "pred. speedup: the n = 1 compute scaled to each n's samples per process (ideal compute scaling) plus the "
                 "predicted exposed comm. A negative measured comm is timing noise larger than the communication.\n")
    parts.append(report.markdown_table(result["predictions"]["measured"], PRED_COLUMNS))
    parts.append(f"## Predicted scaling on other interconnects, mode {mode}\n")
    parts.append("From the n = 1 step time; full fine-tuning assumes its step costs 6 (8 with checkpointing) FLOPs per "
                 "weight and token against LoRA's 4 (6), and all-reduces every parameter (x 4 bytes).\n")
    parts.append(report.markdown_table(result["predictions"]["other_interconnects"], WHAT_IF_COLUMNS))
    return "\n".join(parts)
