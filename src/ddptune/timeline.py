"""Each process's own GPU time per step, read from its torch.profiler timeline.

With the whole step recorded as CUDA graphs (train.cuda_graph_scope=step) no timing event can be
placed between a process's last backward kernel and its gradient all-reduce, so its host clock
(dist.StepClock) sees compute and the wait for the other processes as one. The profiler sees
every kernel of the replayed graphs. `train.profile_steps` writes one timeline per process
(rank 0 `trace.json`, the others `trace-rankK.json`); for each profiled step this reads:

    compute_s  the time the GPU ran anything but a collective (kernels, copies and memsets,
               overlapping ones counted once): this process's own work
    wait_s     the time it ran collectives and nothing else: the all-reduce this process could
               not hide behind its own work, waiting for slower processes included
    idle_s     the time inside the step it ran nothing

A step's work is found through the launch calls: a kernel belongs to the step whose
`ProfilerStep#k` span on the host holds the call that launched it (a graph replay launches all of
its kernels at once), whenever the GPU ran it. With these in place of the host's compute and wait,
`metrics.split` splits the step as it does for eager steps: the slowest process's own work sets
the step, the others wait for it in the all-reduce (imbalance), and what the slowest process
waits is the all-reduce it could not hide (exposed communication).
"""
from __future__ import annotations

import bisect
import json
import re
from pathlib import Path

STEPS = 8  # steps `ddptune scale` profiles after each run's window when it reads timelines (enough to name a slow GPU)
DEVICE_WORK = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCHES = {"cuda_runtime", "cuda_driver"}
STEP = re.compile(r"ProfilerStep#(\d+)$")


def trace_files(folder: Path, world: int) -> list[Path] | None:
    """The timelines of a run's `world` processes in rank order, or None if any is missing."""
    paths = [folder / ("trace.json" if k == 0 else f"trace-rank{k}.json") for k in range(world)]
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
    """{step: {"compute_s", "wait_s", "idle_s", "span_s", "kernels"}} for each profiled step of one
    process's trace events (step numbers 1-based, as in metrics.jsonl: ProfilerStep#k is step
    first_step + k + 1, `first_step` being the step a resumed run started after)."""
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
        compute = union([(a, b) for a, b, collective in items if not collective])
        span = max(b for _, b, _ in items) - min(a for a, _, _ in items)
        out[first_step + k + 1] = {"compute_s": compute / 1e6, "wait_s": (busy - compute) / 1e6,
                                   "idle_s": (span - busy) / 1e6, "span_s": span / 1e6, "kernels": len(items)}
    return out


def load(path: Path, first_step: int = 0) -> dict[int, dict]:
    """step_times of one trace file (torch.profiler's Chrome trace JSON: data, never code)."""
    return step_times(json.loads(path.read_text())["traceEvents"], first_step)


def rank_lines(lines: list[dict], per_rank: list[dict[int, dict]]) -> list[dict]:
    """ranks.jsonl `lines` of the steps every process's timeline holds (with GPU work on each),
    their compute_s and wait_s replaced by the timelines': input for metrics.split."""
    out = []
    for line in lines:
        got = [steps.get(line["step"]) for steps in per_rank]
        if None in got or not all(g["kernels"] for g in got):
            continue
        out.append({**line, "compute_s": [g["compute_s"] for g in got], "wait_s": [g["wait_s"] for g in got],
                    "idle_s": [g["idle_s"] for g in got], "span_s": [g["span_s"] for g in got]})
    return out
