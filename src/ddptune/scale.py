"""`ddptune scale`: the same training at each process count, and where every lost percent went.

Read top to bottom: plan (check every run first) → bandwidth → runs → rows → predictions → files.

Modes (named in every output; `both` runs each, sharing the n = 1 run):
- same-per-device: each process takes the samples per step that n = 1 takes, so the global batch
  grows with n (the tutorial's way);
- same-global: the global batch of n = 1 at every n, each process taking 1/n of it.

Same work at every count: the data is one stream of samples (`data.step_samples`), so a step of
a 2x larger batch covers exactly two steps of the smaller one. Every run trains over the same
sample window, [start, end) of the stream, with `--warmup` steps of the largest batch before it;
figures are means over the window's steps. Speedup = samples/s at n over samples/s at 1;
efficiency = speedup / n. Where rows are padded (CUDA graphs, padded micro-batches), the efficiency
per computed token counts the tokens the GPUs computed instead: a count whose rows pad less can
pass 100 % by samples with no GPU working any faster.

Where the time goes: each process times its own compute (forwards and backwards until its last
gradient bucket is ready) and its wait for the gradient all-reduce (`dist.StepClock`). Per step:
    step = mean compute + imbalance (slowest - mean compute)
         + exposed communication (the slowest process's wait: it waits for nobody) + rest.
With the whole step recorded as CUDA graphs (train.cuda_graph_scope=step) no mark can be placed
inside it, and the host's clock counts the wait for the others as compute. Each run then trains
--timeline-steps more steps after the window under torch.profiler (after one for the profiler's
warm-up, and before TIMELINE_TAIL more), and compute, imbalance and exposed communication come
from every process's GPU timeline over them (`timeline`: a process's compute runs from the first
GPU's start of the step until its GPU came to the all-reduce; the last to come waits only for the
transfer) and the rest from the host's step less those three; each part is its share of the
profiled step, applied to the window's mean step (the profiler slows the steps it records).
Where the shares' work (metrics.predicted_excess) explains less than half the imbalance, the note
says the rest comes from the GPUs: equal work, and still one GPU slower each step. It names the
process when the same one was the slowest in most steps (that GPU is slower), else the GPUs' spread.
And the efficiency lost at n, against the ideal time k·t1 (k = per-process samples at n / at 1),
part by part: 1 - efficiency = Σ (part_n - k·part_1) / t_n over compute, imbalance, comm and rest.
A part smaller than twice its standard error over the window is reported as noise, never as a
negative time. On CPU, a speedup above the process count means the runs fought over the cores:
it is flagged as contention and not published.

On GPUs, a count with fewer samples per process whose compute shrank by less than half as much
is named as bound by the host (launching kernels), not the GPU: more GPUs cannot help that step,
fewer launches (train.cuda_graphs) can. With --alone that guess is checked: it stands only where one
process alone at the share barely shrank too; otherwise running beside the others is the cause.

--alone (same-global): one process also trains alone at each count's per-process share, over the
same window. Its compute splits the lost compute into what the smaller batch costs on any GPU
(work a step does whatever its size: dequantizing weights, kernels too small to fill the GPU)
and what running beside the other processes costs (contention for the host, memory, the links);
its step gives the ceiling, the efficiency a count could reach at that share if data parallelism
itself cost nothing: k·t1 / t_alone. Where rows are padded (CUDA graphs pad every row of a run to
its longest), the alone run's consecutive shares reach a longer row than the count's balanced
ones; its compute is then moved to the count's computed tokens per process along the line through
n = 1 and it (compute = fixed + per-token x tokens, both read from the two runs).

--alone-only (same-global): n = 1 and the alone runs only, on one GPU: each count's row holds its
ceiling and the batch advice, and no measured speedup. What a second GPU could buy at this global
batch, asked before there is one.

Padding: the share of the computed tokens that are padding (padded batches, or packed rows padded
to one length for CUDA graphs, whose longest row depends on how the samples were split) is a column,
and named in the note where it differs from n = 1's: it moves compute without moving real tokens.

Gradient bytes per optimizer step = trainable parameters x 4 (DDP all-reduces fp32 gradients);
comm.predict models the all-reduce overlapped with backward (a FLOP share of the step:
metrics.per_weight_flops) with the peak measured bus bandwidth.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml

from ddptune import checks, comm, config as config_lib, dist, env, metrics, report, timeline
from ddptune.config import BatchPlan, ConfigError

SAME_PER_DEVICE, SAME_GLOBAL = "same-per-device", "same-global"
MODES = {SAME_PER_DEVICE: [SAME_PER_DEVICE], SAME_GLOBAL: [SAME_GLOBAL], "both": [SAME_PER_DEVICE, SAME_GLOBAL]}
WARMUP, MEASURED = 3, 30  # default steps of the largest batch before and inside the measured window
WHAT_IF_N = (2, 4, 8)
PART_KEYS = ("compute_s", "imbalance_s", "exposed_comm_s", "rest_s")
ONE_SLOW_GPU = 0.75  # the share of the steps in which one process must be the slowest for `scale` to name its GPU
STALL_FACTOR = 3  # a step this many times the run's median is a stall, named in the row's note
STEAL_NOTE = 0.01  # a share of the host's CPU time stolen by the hypervisor worth naming beside a row
PADDING_NOTE = 0.02  # a difference in padding share from n = 1 worth naming (it moves compute per real token)
# steps after the profiled ones: a process that ends right after profiling can abort at exit (kineto's
# threads; pytorch/kineto#1051 "profiling near the end of training"; seen once here, on CPU)
TIMELINE_TAIL = 3
CEILING_ADVICE = 0.97  # scale --alone: below this ceiling, the note gives the global batch that would reach it
COLUMNS = [  # (row key, header): scaling.csv uses the keys, scaling.md the headers
    ("mode", "mode"), ("nproc", "n"), ("batch", "samples per step"), ("steps", "steps measured"),
    ("step_s", "step (s)"), ("compute_s", "compute (s)"), ("imbalance_s", "imbalance (s)"),
    ("exposed_comm_s", "exposed comm (s)"), ("rest_s", "rest (s)"), ("tokens_per_s_per_gpu", "tokens/s/GPU"),
    ("samples_per_s", "samples/s"), ("speedup", "speedup"), ("efficiency", "efficiency"),
    ("efficiency_computed", "efficiency per computed token"),
    ("lost_compute", "lost: compute"), ("lost_imbalance", "lost: imbalance"), ("lost_comm", "lost: comm"),
    ("lost_rest", "lost: rest"), ("alone_compute_s", "compute alone (s)"), ("lost_smaller_batch", "lost: smaller batch"),
    ("ceiling", "ceiling"), ("balance", "predicted max/mean share"), ("padding", "padding"),
    ("peak_mem_gib", "peak mem/GPU (GiB)"),
    ("final_loss", "final loss"), ("val_loss", "val loss"), ("note", "note"),
]
PRED_COLUMNS = [
    ("mode", "mode"), ("nproc", "n"), ("busbw_GBps", "busbw (GB/s)"), ("pred_comm_s", "pred. all-reduce (s)"),
    ("pred_exposed_s", "pred. exposed (s)"), ("meas_exposed_s", "meas. exposed (s)"),
    ("pred_speedup", "pred. speedup"), ("meas_speedup", "meas. speedup"),
]
WHAT_IF_COLUMNS = [("gradients", "gradients"), ("link", "link"), ("nproc", "n"), ("comm_s", "comm (s)"),
                   ("exposed_comm_s", "exposed (s)"), ("step_s", "step (s)"), ("speedup", "speedup"),
                   ("efficiency", "efficiency")]


def main(args) -> int:
    counts, modes = parse_counts(args.nproc), MODES[args.mode]
    overrides = list(args.overrides)
    cfg = config_lib.load(args.config, overrides)
    out = Path(args.out or f"{cfg.output_dir}-scale")
    warmup = WARMUP if args.warmup is None else args.warmup
    measured = MEASURED if args.steps is None else args.steps
    sizes = parse_sizes(args.bandwidth_sizes)
    cuda = torch.cuda.is_available()
    # the whole step recorded as CUDA graphs hides the all-reduce from the host's clock: read the GPU's timelines
    profiled = args.timeline_steps
    if profiled is None:
        profiled = timeline.STEPS if cuda and config_lib.records_whole_step(cfg.train) else 0
    # as many threads per process at every count, those of the largest count, so that n = 1 is not
    # measured with threads that n = N could not have
    threads = dist.default_threads(max(counts), cuda)

    # 1. Plan and validate every run before anything runs or any folder is made.
    problems = config_lib.check_values(cfg)
    problems += checks.folder_problems("--out", out)
    problems += checks.numa_problems(args.numa_binding, launches=True)
    if out.is_dir() and any(out.iterdir()):
        problems.append(f"--out: {out} already holds files (choose another --out, or remove it)")
    if warmup < 0 or measured < 1:
        problems.append(f"--warmup {warmup} / --steps {measured}: need warm-up >= 0 and at least 1 measured step")
    if profiled < 0:
        problems.append(f"--timeline-steps {profiled}: must be 0 (off) or more")
    elif profiled and not cuda:
        problems.append(f"--timeline-steps {profiled}: it reads the GPUs' kernels from the profiler's timelines, and "
                        "these processes run on CPU (leave it out)")
    alone_only = args.alone_only
    with_alone = args.alone or alone_only  # the alone runs
    if with_alone and SAME_GLOBAL not in modes:
        flag = "--alone-only" if alone_only else "--alone"
        problems.append(f"{flag}: it compares same-global counts with one process at their share; add --mode same-global"
                        + ("" if alone_only else " (or both)"))
    elif alone_only and SAME_PER_DEVICE in modes:
        problems.append("--alone-only: it runs one process only, which says nothing of same-per-device counts; use --mode same-global")
    if cuda and max(counts) > torch.cuda.device_count() and not alone_only:
        problems.append(f"--nproc: {max(counts)} processes but only {torch.cuda.device_count()} GPUs (one process per GPU; "
                        "--alone-only measures a same-global count's ceiling on one)")
    if problems:
        raise ConfigError(problems)
    plans = {(m, n): plan_for(cfg.train, m, n) for m in modes for n in counts}  # raises for a count that does not divide
    windows = {m: sample_window([plans[m, n].global_batch for n in counts], warmup, measured) for m in modes}
    runs = {}
    for (m, n), plan in plans.items():
        key = "n1" if n == 1 else f"{m}-n{n}"
        steps = max(windows[mm][1] // plan.global_batch for mm in modes) if n == 1 else windows[m][1] // plan.global_batch
        if n == 1 or not alone_only:
            run = runs.setdefault(key, {"nproc": n, "dir": out / key, "plan": plan, "steps": 0})
            run["steps"] = max(run["steps"], steps)
        if with_alone and m == SAME_GLOBAL and n > 1:  # one process, the share of one of the n
            share = dataclasses.replace(plan, world_size=1)
            runs[f"alone-n{n}"] = {"nproc": 1, "dir": out / f"alone-n{n}", "plan": share,
                                   "steps": windows[m][1] // share.global_batch}
    for key, run in runs.items():
        run["timeline"] = profiled
        run["overrides"] = [*timeline_overrides(run["steps"], profiled), *batch_overrides(run["plan"], cfg.train),
                            f"output_dir={as_yaml(run['dir'])}"]
        try:
            checks.validate(config_lib.load(args.config, overrides + run["overrides"]), run["nproc"])
        except ConfigError as e:
            problems += [f"--nproc {run['nproc']}: {p}" for p in e.problems]
    if problems:
        raise ConfigError(sorted(set(problems), key=problems.index))

    # 2. All-reduce bandwidth over the largest count, then the runs.
    topo = comm.topology()
    bandwidth = {"nproc": max(counts), "status": "single process: no all-reduce to measure"}
    if alone_only:
        bandwidth["status"] = "not measured (--alone-only: one process at a time)"
    elif max(counts) >= 2 and not sizes:
        bandwidth["status"] = "not measured (--bandwidth-sizes none)"
    elif max(counts) >= 2:
        iters, bw_warmup = (20, 5) if cuda else (5, 2)
        try:
            result = comm.measure_bandwidth(max(counts), sizes, iters=iters, warmup=bw_warmup)
            busbws = [r["busbw_GBps"] for r in result["rows"] if r["busbw_GBps"]]
            bandwidth.update(status="measured", backend=result["backend"], device=result["device"],
                             rows=result["rows"], peak_busbw_GBps=max(busbws) if busbws else None)
        except RuntimeError as exc:  # the runs still give measured times; predictions need busbw
            bandwidth["status"] = f"failed: {exc}"
    child_env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for key, run in runs.items():
        child = ["ddptune", "train", args.config, *overrides, *run["overrides"]]
        run["command"] = shlex.join(child)
        print(f"ddptune scale: {run['nproc']} process(es), {run['steps']} steps: {shlex.join(child[1:])}", flush=True)
        before = env.cpu_times()
        rc = dist.torchrun(run["nproc"], child, env=child_env, numa_binding=args.numa_binding)
        run["host_cpu"] = env.cpu_share(before, env.cpu_times())  # a busy or stolen host explains lost compute
        if rc != 0:
            print(f"ddptune scale: the run with {run['nproc']} process(es) failed (exit {rc}); see {run['dir']}", file=sys.stderr)
            return rc or 1

    # 3. One row per (mode, count), each over the same sample window.
    rows = []
    for m in modes:
        base = None
        for n in counts:
            if n > 1 and alone_only:
                rows.append(ceiling_row(measure(runs[f"alone-n{n}"], windows[m]), base, n))
                continue
            run = runs["n1" if n == 1 else f"{m}-n{n}"]
            row = dict(measure(run, windows[m]), mode=m)
            if f"alone-n{n}" in runs and m == SAME_GLOBAL:
                alone = measure(runs[f"alone-n{n}"], windows[m])
                row.update({f"alone_{k}": alone[k] for k in ("compute_s", "compute_s_se", "step_s", "computed_per_process")})
            row = account(row, base, cuda)
            base = base or row
            rows.append(row)

    # 4. Communication: the cost model beside the measurements; what-if tables for other links.
    summary = json.loads((runs["n1"]["dir"] / "summary.json").read_text())
    predictions = communication(rows, summary, bandwidth, comm.interconnect(topo), modes[0])

    # 5. Files, each written once and atomically; then the table on the console.
    info = env.collect(bandwidth=False)
    manifest = {
        "command": shlex.join(["ddptune", "scale", args.config, *overrides, "--nproc", args.nproc, "--mode", args.mode,
                               "--steps", str(measured), "--warmup", str(warmup), "--out", str(out),
                               "--bandwidth-sizes", args.bandwidth_sizes]
                              + (["--numa-binding", args.numa_binding] if args.numa_binding else [])
                              + (["--alone"] if args.alone else []) + (["--alone-only"] if alone_only else [])
                              + ([] if args.timeline_steps is None else ["--timeline-steps", str(args.timeline_steps)])),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "modes": modes, "config": args.config,
        "overrides": overrides, "seed": cfg.train.seed, "sample_window": {m: list(w) for m, w in windows.items()},
        "threads_per_process": threads, "numa_binding": args.numa_binding, "alone": args.alone, "alone_only": alone_only,
        "timeline_steps": profiled,
        "batch": [{"mode": m, "nproc": n, **dataclasses.asdict(p), "global_batch": p.global_batch, "describe": p.describe()}
                  for (m, n), p in plans.items()],
        "runs": {k: {"nproc": r["nproc"], "steps": r["steps"], "dir": str(r["dir"]), "command": r["command"]} for k, r in runs.items()},
        "devices": info["gpus"] or f"cpu ({info['cpu_count']} cores)", "interconnect": info["interconnect"],
        "versions": {"python": info["python"], "torch": info["torch"], "cuda": info["cuda"], "nccl": info["nccl"], **info["packages"]},
        "environment": {k: v for k, v in info.items() if k != "bandwidth"},
    }
    result = {"modes": modes, "rows": rows, "bandwidth": bandwidth, "interconnect": comm.interconnect(topo),
              "topology": topo, "grad_bytes": predictions["grad_bytes"], "all_params": predictions["all_params"],
              "backward_fraction": predictions["backward_fraction"],
              "predictions": {k: predictions[k] for k in ("measured", "other_interconnects")}, "manifest": manifest}
    columns = COLUMNS + [(k, k) for k in ("rouge1", "rouge2", "rougeL", "rougeLsum") if k in rows[0]]
    table = report.markdown_table(rows, columns)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(out / "scaling.json", clean(result))
    report.write_csv(out / "scaling.csv", rows, columns)
    report.write_text(out / "scaling.md", markdown(table, bandwidth, result))
    report.plot_scaling(out / "scaling.png", {m: [r for r in rows if r["mode"] == m] for m in modes},
                        title=f"Data-parallel scaling ({predictions['method']}, {info['gpus'][0]['name'] if info['gpus'] else 'CPU'})")
    report.write_json(out / "manifest.json", clean(manifest))
    print("\n" + table + f"\nddptune scale: wrote {out}/scaling.{{json,csv,md,png}} and manifest.json", flush=True)
    return 0


def communication(rows: list[dict], summary: dict, bandwidth: dict, link_label: str, mode: str) -> dict:
    """The cost model (comm.predict; comm.predict_fsdp for train.strategy=fsdp) beside each measured
    row, and what other links would give (DDP's all-reduce)."""
    method, ckpt = summary["method"], summary["gradient_checkpointing"]
    grad_bytes = comm.grad_bytes(summary["trainable_params"], 4)
    frac = backward_fraction(method, ckpt)
    if summary.get("strategy") == "fsdp":  # every weight travels too: all-gathered for forward and backward
        param_bytes = summary["total_params"] * (2 if summary.get("mixed_precision") == "bf16" else 4)
        model = lambda c, nbytes, n, bps: comm.predict_fsdp(c, param_bytes, nbytes, n, bps)  # noqa: E731
    else:
        bucket = summary.get("ddp_bucket_mb")  # the last bucket's all-reduce is never hidden
        last = int(bucket * comm.MiB) if bucket else comm.DDP_BUCKET_BYTES
        model = lambda c, nbytes, n, bps: comm.predict(c, frac * c, nbytes, n, bps, last_bucket_bytes=last)  # noqa: E731
    busbw = (bandwidth.get("peak_busbw_GBps") or 0) * 1e9
    measured = []
    for r in rows:
        if r["nproc"] > 1 and busbw <= 0:
            continue
        base = next(b for b in rows if b["mode"] == r["mode"] and b["nproc"] == 1)
        c = base["step_s"] * r["per_process"] / base["per_process"]  # the n = 1 step, scaled to this count's share
        pred = model(c, grad_bytes, r["nproc"], busbw if busbw > 0 else 1.0)
        r["predicted_speedup"] = pred["speedup"]
        measured.append({"mode": r["mode"], "nproc": r["nproc"], "busbw_GBps": busbw / 1e9 if r["nproc"] > 1 else None,
                         "pred_comm_s": pred["comm_s"], "pred_exposed_s": pred["exposed_comm_s"],
                         "meas_exposed_s": r["exposed_comm_s"], "pred_speedup": pred["speedup"],
                         "meas_speedup": r["speedup"]})
    links = other_links(bandwidth, link_label)
    all_params = summary["total_params"]
    step1 = rows[0]["step_s"]
    cases = [(f"{method} ({comm.human_size(grad_bytes)})", step1, frac, grad_bytes)]
    if method != "full":
        full_step = step1 * metrics.per_weight_flops("full", ckpt) / metrics.per_weight_flops(method, ckpt)
        cases.append((f"full ({comm.human_size(all_params * 4)})", full_step, backward_fraction("full", ckpt), all_params * 4))
    what_if = []
    for label, c1, f, nbytes in cases:
        case = []
        for n in WHAT_IF_N:  # per-process compute at n: as at n = 1 (same-per-device), or 1/n of it
            c = c1 if mode == SAME_PER_DEVICE else c1 / n
            case += [{"gradients": label, **p} for p in comm.predict_table(c, f * c, nbytes, (n,), links)]
        what_if += sorted(case, key=lambda p: (list(links).index(p["link"]), p["nproc"]))
    return {"grad_bytes": grad_bytes, "all_params": all_params, "backward_fraction": frac, "method": method,
            "measured": measured, "other_interconnects": what_if}


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
    """All-reduce sizes to time; "none" times none (no bandwidth, so no predictions)."""
    if text.strip().lower() == "none":
        return []
    try:
        return [comm.parse_size(s) for s in text.split(",") if s.strip()] or [comm.MiB]
    except ValueError as e:
        raise ConfigError([f"--bandwidth-sizes: {e}"]) from None


def plan_for(t: config_lib.TrainConfig, mode: str, n: int) -> BatchPlan:
    """The batch plan of `n` processes in `mode`, anchored on the config's plan for one process.
    With padded batches in same-global mode the micro-batch shrinks where n would not divide it."""
    one = config_lib.batch_plan(t, 1)
    per_process = one.per_process if mode == SAME_PER_DEVICE else one.global_batch // n
    if mode == SAME_GLOBAL and one.global_batch % n:
        raise ConfigError([f"--nproc {n} (same-global): the global batch of {one.global_batch} samples does not split "
                           f"over {n} processes (set train.effective_batch_size to a multiple of {n})"])
    if one.micro_batch_size:  # padded: the largest micro-batch <= the configured one that divides the share
        micro = max(m for m in range(1, one.micro_batch_size + 1) if per_process % m == 0)
        return BatchPlan(n, per_process, micro, None)
    return BatchPlan(n, per_process, None, one.tokens_per_forward)


def batch_overrides(plan: BatchPlan, t: config_lib.TrainConfig) -> list[str]:
    """The overrides that make `ddptune train` run exactly `plan`."""
    micro = plan.micro_batch_size or t.micro_batch_size
    return [f"train.micro_batch_size={micro}", "train.grad_accum=null", f"train.effective_batch_size={plan.global_batch}"]


def timeline_overrides(steps: int, profiled: int) -> list[str]:
    """A run's length: its `steps` up to the window's end, and with `profiled` timeline steps, one
    more for the profiler's own warm-up, the profiled ones, and TIMELINE_TAIL more (the window's
    steps untouched)."""
    if not profiled:
        return [f"train.max_steps={steps}"]
    return [f"train.profile_steps={profiled}", f"train.profile_after={steps + 1}",
            f"train.max_steps={steps + 1 + profiled + TIMELINE_TAIL}"]


def sample_window(global_batches: list[int], warmup: int, measured: int) -> tuple[int, int]:
    """[start, end) in the sample stream that every run measures: `warmup` steps of the largest
    batch before it, `measured` such steps inside it, both ends whole steps of every batch."""
    unit = math.lcm(*global_batches)
    big = max(global_batches)
    start = math.ceil(warmup * big / unit) * unit
    return start, start + math.ceil(measured * big / unit) * unit


def window_lines(folder: Path, name: str, global_batch: int, window: tuple[int, int]) -> list[dict]:
    """A run's per-step lines (metrics.jsonl's step lines, or ranks.jsonl) inside the sample window."""
    lines = [json.loads(l) for l in (folder / name).read_text().splitlines()]
    if name == "metrics.jsonl":
        lines = [r for r in lines if "step_time_s" in r]
    return lines[window[0] // global_batch:window[1] // global_batch]  # steps [first, last), 0-based


def computed_per_process(steps: list[dict], nproc: int) -> float:
    """Tokens each process computed a step, padding included (metrics.jsonl counts all processes)."""
    return sum(r["padded_tokens"] for r in steps) / len(steps) / nproc


def measure(run: dict, window: tuple[int, int]) -> dict:
    """A row for one run over the sample window: means over its steps in the window."""
    plan: BatchPlan = run["plan"]
    steps = window_lines(run["dir"], "metrics.jsonl", plan.global_batch, window)
    ranks = window_lines(run["dir"], "ranks.jsonl", plan.global_batch, window)
    gpu = gpu_lines(run["dir"], plan.world_size) if run.get("timeline") else []
    summary = json.loads((run["dir"] / "summary.json").read_text())
    peaks = [p for p in summary.get("peak_mem_gib_per_process") or [] if p is not None]
    return {"nproc": plan.world_size, "per_process": plan.per_process, "global_batch": plan.global_batch,
            "batch": f"{plan.per_process} x {plan.world_size} = {plan.global_batch}", "steps": len(steps),
            **timing([r["step_time_s"] for r in steps], sum(r["tokens"] for r in steps), window[1] - window[0],
                     plan.world_size, ranks, gpu),
            "strategy": summary.get("strategy", "ddp"), "cuda_graphs": summary.get("cuda_graphs", False),
            "cuda_graph_scope": summary.get("cuda_graph_scope"), "timeline_asked": bool(run.get("timeline")),
            "balance": statistics.fmean(r["balance"] for r in steps),
            # of the tokens the GPUs computed: padded batches, or rows padded for CUDA graphs
            "padding": 1 - sum(r["tokens"] for r in steps) / sum(r["padded_tokens"] for r in steps),
            "computed_per_process": computed_per_process(steps, plan.world_size),
            "peak_mem_gib": max(peaks) if peaks else None, "final_loss": summary["final_loss"],
            "val_loss": summary["val_loss"], **(summary.get("rouge") or {}),
            # the whole run's, loading and compilation included
            **{f"host_cpu_{k}": (run.get("host_cpu") or {}).get(k) for k in ("busy", "steal")}}


def gpu_lines(folder: Path, world: int) -> list[dict]:
    """The ranks.jsonl lines of the steps profiled after the window, their compute and wait read
    from every process's GPU timeline (`timeline`); [] where the timelines hold no GPU work."""
    paths = timeline.trace_files(folder, world)
    if paths is None:
        return []
    lines = [json.loads(line) for line in (folder / "ranks.jsonl").read_text().splitlines()]
    return timeline.rank_lines(lines, [timeline.load(p) for p in paths])


def timing(times: list[float], tokens: int, samples: int, nproc: int, ranks: list[dict], gpu: list[dict] = ()) -> dict:
    """A run's figures over the steps of the window: their step `times`, the real `tokens` and
    `samples` they trained on, and their ranks.jsonl lines (the split of each step into its parts).
    With `gpu` (gpu_lines) the parts come from those profiled steps' GPU timelines, as shares of
    their step applied to the window's mean step: the profiler slows the steps it records (SmolLM2's
    shape on one H200: 28.59 ms a step against 27.53 in the window), and the window's step less
    unscaled parts would leave a negative rest."""
    seconds = sum(times)
    split = metrics.split(gpu or ranks)
    if gpu:
        ratio = seconds / len(times) / split["step_s"]
        for k in (*PART_KEYS, "imbalance_costed_s"):
            for key in (k, k + "_se"):
                if split.get(key) is not None:
                    split[key] *= ratio
    return {"samples_measured": samples, "step_s": seconds / len(times), "median_step_s": statistics.median(times),
            **stalls(times), "tokens_per_s": tokens / seconds, "tokens_per_s_per_gpu": tokens / seconds / nproc,
            "samples_per_s": samples / seconds,
            **{f"{k}{se}": split[k + se] for k in PART_KEYS for se in ("", "_se")},
            "imbalance_costed_s": split["imbalance_costed_s"], "slowest_steps": split["slowest_steps"],
            "compute_offset_s": split["compute_offset_s"],
            "timeline_steps": len(gpu), "timeline_step_s": split["step_s"] if gpu else None}


def which_gpu(row: dict) -> str | None:
    """Whether one process was the slowest step after step (its GPU slower than the others on the
    same work: clocks, power or cooling) or a different one each time (the GPUs' own spread); None
    for rows without the count (older runs) or with fewer than 8 steps."""
    counts, offsets = row.get("slowest_steps"), row.get("compute_offset_s")
    steps = sum(counts or [])
    if steps < 8:
        return None
    k = max(range(len(counts)), key=counts.__getitem__)
    if counts[k] >= ONE_SLOW_GPU * steps:
        return (f"process {k} was the slowest in {counts[k]} of {steps} steps, {offsets[k] * 1e3:.2g} ms a step behind "
                "the mean: its GPU is slower than the others on the same work (clocks, power or cooling: "
                "`nvidia-smi -q -d PERFORMANCE` names what holds a GPU back)")
    return "a different GPU was the slowest from step to step (each GPU's own spread)"


def median_efficiency(row: dict, base: dict) -> float:
    """Efficiency from the median steps of `row` and of the one-process `base` (a one-time stall
    inside the window moves the means, not the medians)."""
    return base["median_step_s"] * row["per_process"] / (row["median_step_s"] * base["per_process"])


def stalls(times: list[float]) -> dict:
    """Steps over STALL_FACTOR times the median (a recompilation, a first use of a kernel, the
    allocator growing): how many, and the seconds they added beyond a median step."""
    median = statistics.median(times)
    slow = [t - median for t in times if t > STALL_FACTOR * median]
    return {"stall_steps": len(slow), "stall_s": sum(slow)}


def account(row: dict, base: dict | None, cuda: bool) -> dict:
    """Speedup, efficiency and the lost efficiency split into its parts (module docstring);
    parts lost in noise and CPU speedups above n are reported as such."""
    base = base or row
    n = row["nproc"]
    row["speedup"] = row["samples_per_s"] / base["samples_per_s"]
    row["efficiency"] = row["speedup"] / n
    k = row["per_process"] / base["per_process"]
    row["parts"] = raw = {key: row[key] for key in PART_KEYS}  # before noise blanks any
    one = base.get("parts", raw)
    se = {key: row.get(key + "_se") or 0.0 for key in PART_KEYS}
    one_se = base.get("parts_se", se)
    lost = {f"lost_{name}": (raw[key] - k * one[key], math.hypot(se[key], k * one_se[key]))
            for name, key in zip(("compute", "imbalance", "comm", "rest"), PART_KEYS)}
    row["parts_se"] = se
    notes = []
    for key, (seconds, err) in lost.items():
        row[key] = seconds / row["step_s"] if n > 1 else 0.0
        if n > 1 and abs(seconds) < 2 * err:  # noise: neither a loss nor a gain can be told apart from zero
            row[key] = None
        elif n > 1 and seconds < 0:
            notes.append(f"{key.replace('_', ' ')}: faster than at n = 1 by {-seconds * 1e3:.2g} ms a step")
    for key in PART_KEYS[1:]:
        if se[key] and row[key] < 2 * se[key]:
            notes.append(f"{key.removesuffix('_s').replace('_', ' ')} within noise (±{2 * se[key] * 1e3:.2g} ms)")
            row[key + "_noise_s"], row[key] = 2 * se[key], None
    costed = row.get("imbalance_costed_s")
    if n > 1 and row["imbalance_s"] is not None and costed is not None and row["imbalance_s"] > 2 * costed:
        # the shares were even: the GPUs themselves made the difference
        which = which_gpu(row)
        notes.append(f"imbalance {row['imbalance_s'] * 1e3:.2g} ms a step, of which unequal shares {costed * 1e3:.2g} ms: "
                     "the rest comes from the GPUs on work of equal cost (every step waits for the slowest)"
                     + (f": {which}" if which else ""))
    if not cuda and n > 1 and row["speedup"] > n * 1.05:
        notes.append(f"speedup {row['speedup']:.2f} above {n}: the processes fought over the CPU cores; not published")
        row["speedup"] = row["efficiency"] = None
    if n > 1 and row.get("alone_compute_s") is not None:  # measured: it supersedes the guess below
        notes.append(alone_split(row, base, k))
    barely = (1 + k) / 2 * one["compute_s"]  # compute that shrank by less than half as much as the samples
    alone = row.get("alone_compute_s")
    if cuda and k < 1 and row["compute_s"] > barely and (alone is None or alone > barely):
        # less work per process, yet compute barely shrank (one process alone at the share too, where measured):
        # the host issuing kernels sets the pace. Where alone did shrink, running beside the others is the cause.
        change = row["compute_s"] / one["compute_s"] - 1
        notes.append(f"compute per process {'fell' if change < 0 else 'grew'} {abs(change):.0%} with {1 - k:.0%} fewer "
                     "samples per process" + (" (one process alone too)" if alone is not None else "")
                     + (": with the whole step recorded no launch is left to the host, so the GPU's own kernels set the pace, "
                        "each at its minimum time whatever the tokens (more samples per process would use them better)"
                        if row.get("cuda_graph_scope") == "step"
                        else ": the step is bound by the host launching kernels, not by the GPU"
                        + (" (try train.cuda_graph_scope=step with train.optimizer=adamw: the whole step as recorded CUDA graphs)"
                           if row.get("cuda_graphs") else " (try train.cuda_graphs=true)")))
    padding, padding_1 = row.get("padding", 0.0), base.get("padding", 0.0)
    if n > 1 and row["efficiency"] is not None and (padding or padding_1):
        # the same efficiency counted in the tokens the GPUs computed, padding included: a count whose
        # rows pad less gets over 100 % by samples without any GPU working faster
        row["efficiency_computed"] = row["efficiency"] * (1 - padding_1) / (1 - padding)
    if n > 1 and abs(padding - padding_1) >= PADDING_NOTE:
        # the GPUs compute padding too: a count whose rows pad less does less work per real token
        notes.append(f"padding {padding:.0%} of the computed tokens against {padding_1:.0%} at n = 1: "
                     f"each GPU computes {(1 - padding_1) / (1 - padding) - 1:+.0%} tokens per real token")
    if n > 1 and row.get("strategy") == "fsdp":
        # FSDP's all-gathers and reduce-scatters run inside forward and backward: no mark separates them
        notes.append("fsdp: its communication runs inside forward and backward and is counted in compute")
    if row.get("timeline_steps"):
        notes.append(f"compute, imbalance and exposed comm from every process's GPU timeline over {row['timeline_steps']} "
                     f"steps profiled after the window ({row['timeline_step_s'] * 1e3:.4g} ms a step there, "
                     f"{row['step_s'] * 1e3:.4g} ms in the window: each part is its share of the profiled step, "
                     "of the window's step here): compute runs until each GPU came to the all-reduce, "
                     "exposed comm is what the last to come spent in it")
    elif row.get("timeline_asked"):
        notes.append("--timeline-steps: no profiled step with GPU work in every process's timeline: the parts are each "
                     "process's own clock's")
    elif n > 1 and row.get("cuda_graph_scope") == "step":  # no timing event can be recorded inside a graph
        notes.append("cuda_graph_scope=step: the gradient all-reduce and the wait for the other processes run "
                     "inside the recorded step and are counted in compute (--timeline-steps splits them)")
    for r, who in ((base, "n = 1"), (row, f"n = {n}")) if n > 1 else ((row, "n = 1"),):
        if r.get("stall_steps"):
            notes.append(f"{who}: {r['stall_steps']} step(s) over {STALL_FACTOR:g}x the median, {r['stall_s']:.1f} s in all")
        if (r.get("host_cpu_steal") or 0) >= STEAL_NOTE:  # a virtual machine's cores, partly given to other guests
            notes.append(f"{who}: the hypervisor took {r['host_cpu_steal']:.0%} of this host's CPU time during the run (steal)")
    if n > 1 and (row.get("stall_steps") or base.get("stall_steps")):
        # a one-time stall inside the window moves the means; the medians show the steady state beside them
        row["efficiency_median"] = median_efficiency(row, base)
        notes.append(f"by median steps the efficiency is {row['efficiency_median']:.1%}")
    row["note"] = "; ".join(notes) or None
    return row


def alone_split(row: dict, base: dict, k: float) -> str:
    """Split a count's lost compute with its --alone run (module docstring), given the accounted
    n = 1 row; sets the row's `lost_smaller_batch` (blank when noise swamps it) and `ceiling`,
    and returns the note. Where the two runs' computed tokens per process differ, a step is fixed
    time + time per token (the line through n = 1 and alone), and the note gives the global batch
    whose ceiling at this count would be CEILING_ADVICE."""
    alone, n = row["alone_compute_s"], row["nproc"]
    compute_1, compute_1_se = base["parts"]["compute_s"], base["parts_se"]["compute_s"]
    tokens, tokens_alone, tokens_1 = (r.get(key) for r, key in ((row, "computed_per_process"),
                                      (row, "alone_computed_per_process"), (base, "computed_per_process")))
    lines = None not in (tokens, tokens_alone, tokens_1) and tokens_alone != tokens_1
    moved = advice = ""
    if lines and abs(tokens_alone - tokens) >= PADDING_NOTE * tokens:
        fixed, per_token = line(tokens_1, compute_1, tokens_alone, alone)
        moved = (f" (alone computed {tokens_alone:,.0f} tokens a step against {tokens:,.0f} per process here, padding "
                 f"included: its compute moved to {tokens:,.0f} tokens along the line through n = 1 and alone, "
                 f"{alone * 1e3:.4g} → {(fixed + per_token * tokens) * 1e3:.4g} ms)")
        alone = fixed + per_token * tokens
    row["alone_compute_measured_s"], row["alone_compute_s"] = row["alone_compute_s"], alone  # the column: what is compared
    smaller = alone - k * compute_1
    err = math.hypot(row.get("alone_compute_s_se") or 0.0, k * compute_1_se)
    row["lost_smaller_batch"] = None if abs(smaller) < 2 * err else smaller / row["step_s"]
    step_alone = row["alone_step_s"] + alone - row["alone_compute_measured_s"]
    row["ceiling"] = k * base["step_s"] / step_alone
    beside = row["parts"]["compute_s"] - alone
    kept = f", and data parallelism kept {row['efficiency'] / row['ceiling']:.1%} of that" if row["efficiency"] else ""
    if lines:
        advice = batch_advice(base, *line(tokens_1, base["step_s"], tokens_alone, row["alone_step_s"]), row["ceiling"], n)
    return (f"one process alone at {row['per_process']} samples a step: compute {alone * 1e3:.4g} ms, step "
            f"{step_alone * 1e3:.4g} ms, so {row['ceiling']:.1%} is the most n = {n} can keep at this share{kept}; of "
            f"the lost compute {smaller / row['step_s']:.1%} is the smaller batch (one GPU alone loses it too) and "
            f"{beside / row['step_s']:.1%} running beside the other process(es)" + moved + advice)


def batch_advice(base: dict, fixed: float, per_token: float, ceiling: float, n: int) -> str:
    """Where a ceiling is under CEILING_ADVICE: a step as `fixed` time + `per_token` time a computed
    token (the line through n = 1's steps and the alone run's), and the global batch whose ceiling at
    n would be CEILING_ADVICE. Empty where the line says nothing (no slope, or no fixed part)."""
    tokens_1 = base["computed_per_process"]
    if not (fixed > 0 and per_token > 0 and ceiling < CEILING_ADVICE):
        return ""
    # ceiling = (fixed + per_token * T) / (n * (fixed + per_token * T / n)) >= e, T = n = 1's tokens a step
    needed = fixed * (CEILING_ADVICE * n - 1) / (per_token * (1 - CEILING_ADVICE))
    batch = math.ceil(needed * base["per_process"] / tokens_1 / n) * n
    return (f"; a step is {fixed * 1e3:.3g} ms fixed + {per_token * 1e6:.3g} µs a computed token, so a global "
            f"batch of about {batch} samples would raise that ceiling to {CEILING_ADVICE:.0%}")


def ceiling_row(alone: dict, base: dict, n: int) -> dict:
    """--alone-only: count `n`, not run, as one process alone at its share says it could be
    (`alone`: that run's measured row; `base`: the accounted n = 1 row). Balanced shares compute
    1/n of n = 1's tokens a step (padding as at n = 1); where the alone run's consecutive shares
    computed more than that (padded rows), its step and compute are moved there along the line
    through n = 1 and it, as --alone does."""
    k = alone["per_process"] / base["per_process"]
    tokens_1, tokens_alone = base["computed_per_process"], alone["computed_per_process"]
    share = tokens_1 / n
    step, compute, moved = alone["step_s"], alone["compute_s"], ""
    fixed, per_token = line(tokens_1, base["step_s"], tokens_alone, alone["step_s"]) if tokens_alone != tokens_1 else (0, 0)
    if abs(tokens_alone - share) >= PADDING_NOTE * share:
        step = fixed + per_token * share
        compute += step - alone["step_s"]
        moved = (f"; it computed {tokens_alone:,.0f} tokens a step (padding included) against {share:,.0f}, 1/{n} of "
                 f"n = 1's, which the line through n = 1 and it puts at {step * 1e3:.4g} ms")
    ceiling = k * base["step_s"] / step
    row = {"mode": SAME_GLOBAL, "nproc": n, "per_process": alone["per_process"], "global_batch": base["global_batch"],
           "batch": f"{alone['per_process']} x {n} = {base['global_batch']}", "steps": alone["steps"],
           "samples_measured": alone["samples_measured"], "speedup": None, "efficiency": None,
           "alone_compute_s": compute, "alone_compute_measured_s": alone["compute_s"], "alone_step_s": step,
           "alone_step_measured_s": alone["step_s"], "alone_computed_per_process": tokens_alone,
           "ceiling": ceiling, "speedup_ceiling": n * ceiling}
    advice = batch_advice(base, fixed, per_token, ceiling, n)  # empty without a line (fixed = 0)
    row["note"] = (f"not run (--alone-only): one process alone at {alone['per_process']} samples a step took "
                   f"{alone['step_s'] * 1e3:.4g} ms{moved}; against {base['step_s'] * 1e3:.4g} ms at n = 1, n = {n} can keep at "
                   f"most {ceiling:.1%} at this global batch, a speedup of at most {n * ceiling:.2f}x, before data "
                   "parallelism's own costs" + advice)
    return row


def line(x1: float, y1: float, x2: float, y2: float) -> tuple[float, float]:
    """The line through two points: (value at 0, slope)."""
    slope = (y1 - y2) / (x1 - x2)
    return y1 - slope * x1, slope


def backward_fraction(method: str, checkpointing: bool) -> float:
    """The share of a step that backward takes (bucket all-reduces can hide behind it)."""
    return 1 - 2 / metrics.per_weight_flops(method, checkpointing)


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


def clean(obj):
    """NaN and infinities become null, so the JSON files are strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def markdown(table: str, bandwidth: dict, result: dict) -> str:
    m = result["manifest"]
    window = "; ".join(f"{mode}: samples {a}-{b}" for mode, (a, b) in m["sample_window"].items())
    parts = [f"# ddptune scale: {m['config']}, {' and '.join(result['modes'])}\n",
             f"`{m['command']}`, {m['date']}. Every count trains on the same samples ({window} of the stream, after "
             f"{m['command'].split('--warmup ')[1].split()[0]} warm-up steps of the largest batch); figures are means over "
             "those steps. step = compute (mean process) + imbalance (slowest - mean) + exposed comm (the slowest process's "
             "wait for the all-reduce) + rest (optimizer, data, gaps). speedup = samples/s at n over samples/s at 1; "
             "efficiency = speedup / n; the `lost:` columns split 1 - efficiency into its parts (fractions of the step at n). "
             "A part below twice its standard error is left blank and named in the note."
             + (f" Where the whole step is recorded as CUDA graphs, compute, imbalance and exposed comm come from every "
                f"process's GPU timeline over {m['timeline_steps']} steps profiled after the window (the notes say which rows)."
                if m.get("timeline_steps") else "") + "\n",
             table]
    parts.append(f"## All-reduce bandwidth, {bandwidth['nproc']} processes ({bandwidth.get('backend', 'none')})\n")
    parts.append(f"Interconnect: {result['interconnect']}.\n")
    parts.append(comm.format_rows(bandwidth["rows"]) if bandwidth["status"] == "measured" else bandwidth["status"] + "\n")
    parts.append("## Predicted against measured communication\n")
    parts.append(f"Gradients all-reduced per optimizer step: {comm.human_size(result['grad_bytes'])} (trainable parameters "
                 f"x 4 bytes, fp32); backward = {result['backward_fraction']:.2f} of the step; busbw = the peak measured. "
                 "pred. speedup: the n = 1 step scaled to each count's share, plus the predicted exposed all-reduce.\n")
    parts.append(report.markdown_table(result["predictions"]["measured"], PRED_COLUMNS))
    parts.append("## Predicted scaling on other interconnects\n")
    parts.append("From the n = 1 step time; full fine-tuning assumes its step costs 6 (8 with checkpointing) FLOPs per "
                 "weight and token against LoRA's 4 (6), and all-reduces every parameter (x 4 bytes).\n")
    parts.append(report.markdown_table(result["predictions"]["other_interconnects"], WHAT_IF_COLUMNS))
    return "\n".join(parts)
