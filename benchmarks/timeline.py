"""Each process's GPU time per step, read from its torch.profiler timeline (a lab tool, not part of ddptune).

With the whole step recorded as CUDA graphs (summary.json's `cuda_graphs` is "step": the speed
decider's choice where it pays, or DDPTUNE_SPEED=graphs=step) no timing event can be placed
between a process's last backward kernel and its gradient all-reduce, so its host clock
(dist.StepClock) sees compute and the wait for the other processes as one. The profiler sees
every kernel of the replayed graphs. `train.profile_steps` writes one timeline per process
(rank 0 `trace.json`, the others `trace-rankK.json`); for each profiled step, on each GPU:

    work_s   the time it ran anything but a collective (kernels, copies and memsets, overlapping
             ones counted once)
    wait_s   the time it ran collectives and nothing else: the all-reduce it could not hide
             behind its own work, and its wait for the processes that came to it later
    idle_s   the time inside the step it ran nothing

A step's work is found through the launch calls: a kernel belongs to the step whose
`ProfilerStep#k` span on the host holds the call that launched it (a graph replay launches all of
its kernels at once), whenever the GPU ran it.

Across processes (`rank_lines`, their timelines on one machine's clock): a step starts when the
first GPU starts it, and a process's compute is the time from there until its GPU finished the
step, less its wait: its own work, the idle inside it and a late start. The process that came last
to the all-reduce waits least and has the most compute; it waits for nobody, so its wait is the
all-reduce itself. With these in place of the host's compute and wait, `metrics.split` splits the
step as it does for eager steps: mean compute, imbalance (slowest - mean: the others' wait for the
last) and exposed communication (the last one's wait).
"""
from __future__ import annotations

import bisect
import json
import re
from pathlib import Path

DEVICE_WORK = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCHES = {"cuda_runtime", "cuda_driver"}
STEP = re.compile(r"ProfilerStep#(\d+)$")


def trace_path(folder: Path, rank: int) -> Path:
    """Where process `rank` of a run writes its timeline (train.profile_steps)."""
    return folder / ("trace.json" if rank == 0 else f"trace-rank{rank}.json")


def trace_files(folder: Path, world: int) -> list[Path] | None:
    """The timelines of a run's `world` processes in rank order, or None if any is missing."""
    paths = [trace_path(folder, k) for k in range(world)]
    return paths if all(p.is_file() for p in paths) else None


def union(intervals: list[tuple[float, float]]) -> float:
    """The length covered by `intervals` (start, end), overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def is_collective(event: dict) -> bool:
    return event.get("cat") == "kernel" and "nccl" in event.get("name", "").lower()


def step_times(events: list[dict], first_step: int = 0) -> dict[int, dict]:
    """{step: {"work_s", "wait_s", "idle_s", "start_us", "end_us", "kernels"}} for each profiled
    step of one process's trace events (the step's first and last GPU work on the trace's clock);
    step numbers are 1-based, as in metrics.jsonl: ProfilerStep#k is step first_step + k + 1,
    `first_step` being the step a resumed run started after."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0), int(m.group(1))) for e in events
                   if e.get("ph") == "X" and e.get("cat") == "user_annotation" and (m := STEP.match(str(e.get("name", "")))))
    starts = [s[0] for s in spans]

    def step_of(ts: float) -> int | None:
        i = bisect.bisect_right(starts, ts) - 1
        return spans[i][2] if i >= 0 and ts <= spans[i][1] else None

    launched = {e["args"]["correlation"]: step_of(e["ts"]) for e in events
                if e.get("ph") == "X" and e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    work: dict[int, list[tuple[float, float, bool]]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in DEVICE_WORK:
            continue
        k = launched.get(e.get("args", {}).get("correlation"))
        if k is not None:
            work.setdefault(k, []).append((e["ts"], e["ts"] + e.get("dur", 0), is_collective(e)))
    out = {}
    for k, items in sorted(work.items()):
        busy = union([(a, b) for a, b, _ in items])
        own = union([(a, b) for a, b, collective in items if not collective])
        start, end = min(a for a, _, _ in items), max(b for _, b, _ in items)
        out[first_step + k + 1] = {"work_s": own / 1e6, "wait_s": (busy - own) / 1e6, "idle_s": (end - start - busy) / 1e6,
                                   "start_us": start, "end_us": end, "kernels": len(items)}
    return out


def load(path: Path, first_step: int = 0) -> dict[int, dict]:
    """step_times of one trace file (torch.profiler's Chrome trace JSON: data, never code)."""
    return step_times(json.loads(path.read_text())["traceEvents"], first_step)


def rank_lines(lines: list[dict], per_rank: list[dict[int, dict]]) -> list[dict]:
    """ranks.jsonl `lines` of the steps every process's timeline holds, their compute_s and wait_s
    replaced by the timelines' (module docstring; work_s and idle_s beside them): metrics.split's input."""
    out = []
    for line in lines:
        got = [steps.get(line["step"]) for steps in per_rank]
        if None in got:
            continue
        origin = min(g["start_us"] for g in got)
        out.append({**line, "compute_s": [(g["end_us"] - origin) / 1e6 - g["wait_s"] for g in got],
                    **{key: [g[key] for g in got] for key in ("wait_s", "work_s", "idle_s")}})
    return out
