"""Where the GPU sat idle in a torch.profiler trace (`train.profile_steps` writes output_dir/trace.json).

    python benchmarks/gpu_gaps.py runs/x/trace.json [--json gaps.json]

Every kernel, copy and memset on the device is a busy interval; the GPU is idle wherever no
interval covers time between the first and last of them. For each profiled step (torch's
ProfilerStep#N, as the GPU ran it) it reports the idle time inside the step and the gap before
the step's first kernel since the previous step's last one: the host stall this project
removes shows up as that gap (the device waiting for the host to queue the next step).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def busy_intervals(events: list[dict]) -> list[tuple[float, float, str]]:
    """Device activity as (start µs, end µs, name), sorted by start."""
    return sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "")) for e in events
                  if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES)


def idle_gaps(intervals: list[tuple[float, float, str]], lo: float, hi: float) -> list[tuple[float, float, str, str]]:
    """(start, end, kernel before, kernel after) of each stretch in [lo, hi] covered by no interval."""
    gaps, reach, last = [], lo, "(window start)"
    for start, end, name in intervals:
        if end <= lo or start >= hi:
            continue
        if start > reach:
            gaps.append((reach, start, last, name))
        if end > reach:
            reach, last = end, name
    if reach < hi:
        gaps.append((reach, hi, last, "(window end)"))
    return gaps


def analyse(trace: dict) -> dict:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    intervals = busy_intervals(events)
    if not intervals:
        return {"error": "no device activity in the trace (was it profiled on a GPU?)"}
    steps = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                   if e.get("cat") == "gpu_user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#"))
    lo, hi = intervals[0][0], max(end for _, end, _ in intervals)
    gaps = idle_gaps(intervals, lo, hi)
    idle = sum(b - a for a, b, _, _ in gaps)
    out = {"window_ms": (hi - lo) / 1e3, "busy_ms": (hi - lo - idle) / 1e3, "idle_fraction": idle / (hi - lo),
           "gaps_over_100us": sum(1 for a, b, _, _ in gaps if b - a > 100),
           "largest_gaps": [{"ms": (b - a) / 1e3, "after": x[:80], "before": y[:80]}
                            for a, b, x, y in sorted(gaps, key=lambda g: g[0] - g[1])[:8]],
           "steps": []}
    for k, (s0, s1, name) in enumerate(steps):
        inside = [i for i in intervals if s0 <= i[0] < s1]
        if not inside:
            continue
        first = inside[0][0]
        previous = [end for start, end, _ in intervals if start < first]
        step_gaps = idle_gaps(intervals, first, max(e for _, e, _ in inside))
        out["steps"].append({"step": name, "gpu_ms": (max(e for _, e, _ in inside) - first) / 1e3,
                             "idle_inside_ms": sum(b - a for a, b, _, _ in step_gaps) / 1e3,
                             "gap_before_ms": (first - max(previous)) / 1e3 if previous and k else None})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--json", help="also write the analysis here")
    args = p.parse_args()
    result = analyse(json.loads(Path(args.trace).read_text()))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
