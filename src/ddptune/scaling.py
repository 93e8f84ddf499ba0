"""Scaling arithmetic: each run's row over a common sample window, and where a step's time goes.

Same work at every count: the data is one stream of samples (`batches.step_samples`), so a step of
a 2x larger batch covers exactly two steps of the smaller one. Every run trains over the same sample
window, [start, end) of the stream; figures are means over the window's steps. Speedup = samples/s
at n over samples/s at 1; efficiency = speedup / n. Where rows are padded (CUDA graphs, padded
micro-batches) the efficiency per computed token counts the tokens the GPUs computed instead.

Where the time goes, per step (each process times its own compute and its wait for the gradient
all-reduce, `dist.StepClock`):
    step = mean compute + imbalance (slowest - mean compute)
         + exposed communication (the slowest process's wait: it waits for nobody) + rest.
The efficiency lost at n, against the ideal time k·t1 (k = per-process samples at n / at 1), part by
part: 1 - efficiency = Σ (part_n - k·part_1) / t_n. A part smaller than twice its standard error
over the window is noise, never a negative time. The lost parts add up to 1 - efficiency: a negative
one (time n saved against n = 1) offsets the others, and one left blank as noise still counts; the
`lost_sum` finding writes the sum out wherever either happens.

`account` returns every finding as data (`notes`: a code and its numbers); `render` turns one into
a sentence for scaling.md.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from ddptune import batchplan  # (comm and metrics import torch: only where used, so --nproc is parsed without it)
from ddptune.report import seconds_text
from ddptune.batchplan import BatchPlan
from ddptune.config import ConfigError

SAME_PER_DEVICE, SAME_GLOBAL = "same-per-device", "same-global"
MODES = {SAME_PER_DEVICE: [SAME_PER_DEVICE], SAME_GLOBAL: [SAME_GLOBAL], "both": [SAME_PER_DEVICE, SAME_GLOBAL]}
PART_KEYS = ("compute_s", "imbalance_s", "exposed_comm_s", "rest_s")
LOST = dict(zip(("lost_compute", "lost_imbalance", "lost_comm", "lost_rest"), PART_KEYS))
ONE_SLOW_GPU = 0.75  # the share of the steps in which one process must be the slowest for its GPU to be named
STALL_FACTOR = 3     # a step this many times the run's median is a stall
STEAL_NOTE = 0.01    # a share of the host's CPU time stolen by the hypervisor worth naming
PADDING_NOTE = 0.02  # a difference in padding share from n = 1 worth naming


# ---------------------------------------------------------------------------------------------
# Counts, batches and the window


def parse_counts(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]: whole numbers, each once, 1 among them."""
    parts = [p.strip() for p in text.split(",")]
    counts = [int(p) for p in parts if p.isdigit()]
    if not parts or len(counts) != len(parts) or len(set(counts)) != len(counts) or min(counts) < 1:
        raise ConfigError([f"--nproc: {text[:80]!r} is not a list of distinct process counts (write e.g. 1,2,4)"])
    if 1 not in counts:
        raise ConfigError([f"--nproc: include 1, the baseline every speedup is measured against (e.g. 1,{text})"])
    return sorted(counts)


def count_problems(counts: list[int], n_rows: int | None) -> list[str]:
    """Each process takes at least one sample a step, so a process count above the training rows
    cannot run whatever the batch keys say: one line naming those counts (none while the rows are
    not known, as for hub data before it loads)."""
    over = [n for n in counts if n_rows is not None and n > n_rows]
    if not over:
        return []
    return [f"--nproc: {', '.join(map(str, over))} processes are more than the {n_rows} training rows (each process takes "
            f"at least one sample a step: give counts up to {n_rows}, or more rows in data.train)"]


def parse_sizes(text: str) -> list[int]:
    """All-reduce sizes to time; "none" times none (no bandwidth, so no predictions)."""
    from ddptune import comm

    if text.strip().lower() == "none":
        return []
    try:
        return [comm.parse_size(s) for s in text.split(",") if s.strip()] or [comm.MiB]
    except ValueError as e:
        raise ConfigError([f"--bandwidth-sizes: {e}"]) from None


def plan_for(t, mode: str, n: int) -> BatchPlan:
    """The batch plan of `n` processes in `mode`, anchored on the config's plan for one process.
    With padded batches in same-global mode the micro-batch shrinks where n would not divide it."""
    one = batchplan.batch_plan(t, 1)
    per_process = one.per_process if mode == SAME_PER_DEVICE else one.global_batch // n
    if mode == SAME_GLOBAL and one.global_batch % n:
        raise ConfigError([f"--nproc {n} (same-global): the global batch of {one.global_batch} samples does not split "
                           f"over {n} processes (set train.effective_batch_size to a multiple of {n})"])
    if one.micro_batch_size:  # padded: the largest micro-batch <= the configured one that divides the share
        micro = max(m for m in range(1, one.micro_batch_size + 1) if per_process % m == 0)
        return BatchPlan(n, per_process, micro, None)
    return BatchPlan(n, per_process, None, one.tokens_per_forward)


def batch_overrides(plan: BatchPlan, t) -> list[str]:
    """The overrides that make `ddptune train` run exactly `plan`."""
    micro = plan.micro_batch_size or t.micro_batch_size
    return [f"train.micro_batch_size={micro}", "train.grad_accum=null", f"train.effective_batch_size={plan.global_batch}"]


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


# ---------------------------------------------------------------------------------------------
# One run's row


def measure(folder: Path, plan: BatchPlan, window: tuple[int, int], host_cpu: dict | None = None) -> dict:
    """A row for one run over the sample window: means over its steps in the window."""
    steps = window_lines(folder, "metrics.jsonl", plan.global_batch, window)
    ranks = window_lines(folder, "ranks.jsonl", plan.global_batch, window)
    summary = json.loads((folder / "summary.json").read_text())
    peaks = [p for p in summary.get("peak_mem_gib_per_process") or [] if p is not None]
    tokens, computed = sum(r["tokens"] for r in steps), sum(r["padded_tokens"] for r in steps)
    return {"nproc": plan.world_size, "per_process": plan.per_process, "global_batch": plan.global_batch,
            "batch": f"{plan.per_process} x {plan.world_size} = {plan.global_batch}", "steps": len(steps),
            **timing([r["step_time_s"] for r in steps], tokens, window[1] - window[0], plan.world_size, ranks),
            "strategy": summary.get("strategy", "ddp"), "cuda_graphs": summary.get("cuda_graphs", "off"),
            "balance": statistics.fmean(r["balance"] for r in steps),
            "padding": 1 - tokens / computed, "computed_per_process": computed / len(steps) / plan.world_size,
            "peak_mem_gib": max(peaks) if peaks else None, "final_loss": summary["final_loss"],
            "val_loss": summary["val_loss"], **(summary.get("rouge") or {}),
            **{f"host_cpu_{k}": (host_cpu or {}).get(k) for k in ("busy", "steal")}}


def timing(times: list[float], tokens: int, samples: int, nproc: int, ranks: list[dict]) -> dict:
    """A run's figures over the steps of the window: their step `times`, the real `tokens` and
    `samples` they trained on, and their ranks.jsonl lines (each step split into its parts)."""
    from ddptune import metrics

    seconds = sum(times)
    split = metrics.split(ranks)
    median = statistics.median(times)
    slow = [t - median for t in times if t > STALL_FACTOR * median]
    return {"samples_measured": samples, "step_s": seconds / len(times), "median_step_s": median,
            "stall_steps": len(slow), "stall_s": sum(slow), "tokens_per_s": tokens / seconds,
            "tokens_per_s_per_gpu": tokens / seconds / nproc, "samples_per_s": samples / seconds,
            **{f"{k}{se}": split[k + se] for k in PART_KEYS for se in ("", "_se")},
            "imbalance_costed_s": split["imbalance_costed_s"], "slowest_steps": split["slowest_steps"],
            "compute_offset_s": split["compute_offset_s"]}


# ---------------------------------------------------------------------------------------------
# Accounting: every finding as a code and its numbers


def verdict(rows: list[dict], modes: list[str]) -> str:
    """The study in one line: per mode, what its largest process count gives against one process, and the
    part (`lost:` column) that took most of the rest."""
    said = []
    for mode in modes:
        top = max((row for row in rows if row["mode"] == mode), key=lambda row: row["nproc"])
        n, lost = top["nproc"], {k.removeprefix("lost_"): top[k] for k in LOST if top.get(k) is not None}
        worst = max(lost, key=lost.get) if lost else None
        if n == 1:
            said.append(f"{mode}: one process only, nothing to compare")
        elif top["speedup"] is None:
            said.append(f"{mode}: {n} processes: no speedup published (they fought over the CPU cores; see the note)")
        else:
            said.append(f"{mode}: {n} processes train {top['speedup']:.2f}x the samples a second of 1 ({top['efficiency']:.0%} "
                        "efficiency" + (f"; most lost to {worst}, {lost[worst]:.0%} of the step" if worst and lost[worst] > 0
                                        else "") + ")")
    return "; ".join(said)


def account(row: dict, base: dict | None, cuda: bool) -> dict:
    """Speedup, efficiency and the lost efficiency split into its parts; `row["notes"]` lists the
    findings (noise, how the lost parts add up, imbalance from the devices, host-bound steps, padding, stalls...)."""
    base = base or row
    n = row["nproc"]
    row["speedup"] = row["samples_per_s"] / base["samples_per_s"]
    row["efficiency"] = row["speedup"] / n
    k = row["per_process"] / base["per_process"]
    row["parts"] = raw = {key: row[key] for key in PART_KEYS}  # before noise blanks any
    row["parts_se"] = se = {key: row.get(key + "_se") or 0.0 for key in PART_KEYS}
    one = base.get("parts", raw)
    notes = lost_parts(row, one, base.get("parts_se", se), k)
    for key in PART_KEYS[1:]:
        if se[key] and row[key] < 2 * se[key]:
            notes.append({"code": "noise", "part": key, "ms": 2 * se[key] * 1e3})
            row[key + "_noise_s"], row[key] = 2 * se[key], None
    costed = row.get("imbalance_costed_s")
    if n > 1 and row["imbalance_s"] is not None and costed is not None and row["imbalance_s"] > 2 * costed:
        notes.append({"code": "device_imbalance", "device": "GPU" if cuda else "CPU", "ms": row["imbalance_s"] * 1e3,
                      "shares_ms": costed * 1e3, **slow_gpu(row)})
    if not cuda and n > 1 and row["speedup"] > n * 1.05:
        notes = [x for x in notes if x["code"] != "lost_sum"] + [{"code": "cpu_contention", "speedup": row["speedup"]}]
        row["speedup"] = row["efficiency"] = None  # (and 1 - efficiency is not written out either)
    if cuda and k < 1 and row["compute_s"] > (1 + k) / 2 * one["compute_s"]:  # less work, compute barely shrank
        notes.append({"code": "host_bound", "change": row["compute_s"] / one["compute_s"] - 1, "fewer": 1 - k,
                      "graphs": row.get("cuda_graphs", "off")})
    padding, padding_1 = row.get("padding", 0.0), base.get("padding", 0.0)
    if n > 1 and row["efficiency"] is not None and (padding or padding_1):
        row["efficiency_computed"] = row["efficiency"] * (1 - padding_1) / (1 - padding)
    if n > 1 and abs(padding - padding_1) >= PADDING_NOTE:
        notes.append({"code": "padding", "share": padding, "share_1": padding_1})
    if n > 1 and row.get("strategy") == "fsdp":
        notes.append({"code": "fsdp_comm"})
    elif n > 1 and row.get("cuda_graphs") == "step":
        notes.append({"code": "recorded_comm"})
    notes += host_notes(base, row)
    if n > 1 and (row.get("stall_steps") or base.get("stall_steps")):
        row["efficiency_median"] = base["median_step_s"] * row["per_process"] / (row["median_step_s"] * base["per_process"])
        notes.append({"code": "median_efficiency", "efficiency": row["efficiency_median"]})
    row["notes"] = notes
    row["note"] = "; ".join(map(render, notes)) or None
    return row


def lost_parts(row: dict, one: dict, one_se: dict, k: float) -> list[dict]:
    """The `lost:` columns, each part's (part_n - k·part_1) / t_n, None where it is within noise (twice its
    standard error); and, where a part is negative or blank, a `lost_sum` finding that writes out how all
    of them (the blank ones' values too) add up to 1 - efficiency."""
    n, raw, se = row["nproc"], row["parts"], row["parts_se"]
    parts = []
    for name, key in LOST.items():
        seconds, err = raw[key] - k * one[key], math.hypot(se[key], k * one_se[key])
        blank = n > 1 and abs(seconds) < 2 * err  # noise: neither a loss nor a gain can be told apart from zero
        row[name] = None if blank else seconds / row["step_s"] if n > 1 else 0.0
        parts.append({"part": name, "share": seconds / row["step_s"], "ms": seconds * 1e3, "blank": blank,
                      "noise": 2 * err / row["step_s"]})
    if n > 1 and any(p["blank"] or p["share"] < 0 for p in parts):
        return [{"code": "lost_sum", "lost": 1 - row["efficiency"], "parts": parts}]
    return []


def slow_gpu(row: dict) -> dict:
    """Whether one process was the slowest step after step (its GPU slower on the same work)."""
    counts, offsets = row.get("slowest_steps") or [], row.get("compute_offset_s") or []
    steps = sum(counts)
    if steps < 8:
        return {}
    k = max(range(len(counts)), key=counts.__getitem__)
    if counts[k] >= ONE_SLOW_GPU * steps:
        return {"process": k, "slowest_steps": counts[k], "steps": steps, "behind_ms": offsets[k] * 1e3}
    return {"process": None, "steps": steps}


def host_notes(base: dict, row: dict) -> list[dict]:
    """Stalls in the window, and CPU time the hypervisor took, for n = 1 and this count."""
    notes = []
    for r, who in ((base, 1), (row, row["nproc"])) if row["nproc"] > 1 else ((row, 1),):
        if r.get("stall_steps"):
            notes.append({"code": "stall", "nproc": who, "steps": r["stall_steps"], "seconds": r["stall_s"]})
        if (r.get("host_cpu_steal") or 0) >= STEAL_NOTE:  # a virtual machine's cores, partly given to other guests
            notes.append({"code": "steal", "nproc": who, "share": r["host_cpu_steal"]})
    return notes


def render(note: dict) -> str:
    """One finding as a sentence."""
    c = note["code"]
    if c == "lost_sum":
        return lost_sum_text(note)
    if c == "noise":
        return f"{note['part'].removesuffix('_s').replace('_', ' ')} within noise (±{seconds_text(note['ms'] / 1e3)})"
    if c == "device_imbalance":
        return imbalance_text(note)
    if c == "cpu_contention":
        return f"speedup {note['speedup']:.2f} above n: the processes fought over the CPU cores; not published"
    if c == "host_bound":
        by = ("the GPU's own kernels, each at its minimum time" if note["graphs"] == "step" else
              "the host launching kernels, not the GPU")
        return (f"compute per process {'fell' if note['change'] < 0 else 'grew'} {abs(note['change']):.0%} with "
                f"{note['fewer']:.0%} fewer samples per process: the step is set by {by}")
    if c == "padding":
        return (f"padding {note['share']:.0%} of the computed tokens against {note['share_1']:.0%} at n = 1: each GPU "
                f"computes {(1 - note['share_1']) / (1 - note['share']) - 1:+.0%} tokens per real token")
    if c == "fsdp_comm":
        return "fsdp: its communication runs inside forward and backward and is counted in compute"
    if c == "recorded_comm":
        return "the whole step is recorded: the all-reduce and the wait for the other processes are counted in compute"
    if c == "stall":
        return f"n = {note['nproc']}: {note['steps']} step(s) over {STALL_FACTOR:g}x the median, {note['seconds']:.1f} s in all"
    if c == "steal":
        return f"n = {note['nproc']}: the hypervisor took {note['share']:.0%} of this host's CPU time during the run"
    if c == "median_efficiency":
        return f"by median steps the efficiency is {note['efficiency']:.1%}"
    raise ValueError(f"unknown note {c!r}")


def lost_sum_text(note: dict) -> str:
    """1 - efficiency as the sum of its parts, each signed; a negative one named as time saved, a blank one with its noise."""
    terms = []
    for p in note["parts"]:
        why = (f" (blank: within noise, ±{p['noise']:.3f})" if p["blank"] else
               f" (faster than at n = 1 by {seconds_text(-p['ms'] / 1e3)} a step)" if p["share"] < 0 else "")
        terms.append(f"{p['part'].removeprefix('lost_')} {p['share']:.3f}{why}")
    return f"1 - efficiency {note['lost']:.3f} = " + " + ".join(terms)


def imbalance_text(note: dict) -> str:
    """An imbalance the processes' shares do not explain: it comes from the devices (GPUs, or the CPU cores the
    processes run on, shared with each other and the host), and which process was the slowest."""
    on = "GPUs" if note["device"] == "GPU" else "CPU cores (shared by the processes and anything else on the host)"
    own = "its GPU is slower" if note["device"] == "GPU" else "its cores were slower or busier"
    which = ("" if "process" not in note else
             ": a different process was the slowest from step to step" if note["process"] is None else
             f": process {note['process']} was the slowest in {note['slowest_steps']} of {note['steps']} steps, "
             f"{seconds_text(note['behind_ms'] / 1e3)} a step behind the mean ({own} on the same work)")
    return (f"imbalance {seconds_text(note['ms'] / 1e3)} a step, of which unequal shares {seconds_text(note['shares_ms'] / 1e3)}: "
            f"the rest comes from the {on} on work of equal cost{which}")


def clean(obj):
    """NaN and infinities become null, so the JSON files are strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj
