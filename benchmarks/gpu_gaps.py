"""Where the GPU sat idle in a torch.profiler trace (`train.profile_steps` writes output_dir/trace.json).

`train.profile_steps=N` profiles N steps after the first two, one trace per process: rank 0's
trace.json, the others' trace-rankK.json (benchmarks/timeline.py reads them together).

    python benchmarks/gpu_gaps.py runs/x/trace.json [--json gaps.json]

Every kernel, copy and memset on the device is a busy interval; the GPU is idle wherever no
interval covers time between the first and last of them. For each profiled step (torch's
ProfilerStep#N, as the GPU ran it) it reports the idle time inside the step and the gap before
the step's first kernel since the previous step's last one: a host stall between steps shows
up as that gap (the device waiting for the host to queue the next step).

`idle_by_launcher` names who ended each idle stretch: the host code that queued the work run
right after it (through the kernel's correlation id to its launch call, then the innermost
enclosing Python function from ddptune's sources, when the trace has stacks, else the outermost
host op), with the idle summed per launcher and how late the launch came. `busy_by_launcher`
sums the device's time the same way, and `syncs` lists the host's waits for the device
(stream, event and device synchronizations) by who waited. `beside_nccl` compares each kernel's
duration alone and while a NCCL kernel (a gradient all-reduce) ran beside it.

`kernels` splits the device's busy time per profiled step into kinds (GEMMs, Inductor's fused Triton
kernels, attention, NCCL, the rest) with the busiest kernel names; `host` lists, for each host thread,
its outermost ops' time per step (the main thread's forward, the autograd thread's backward). The
profiler's own cost for each host op inflates `host`; the device's times are the kernels' own.
"""
from __future__ import annotations

import argparse
import bisect
import itertools
import json
import re
from pathlib import Path

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATEGORIES = {"cpu_op", "user_annotation", "python_function"}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
KINDS = (("nccl", ("nccl",)), ("attention", ("flash", "fmha", "attention")),
         ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "splitk", "cublas")), ("fused (triton)", ("triton",)))


def busy_intervals(events: list[dict]) -> list[tuple[float, float, str]]:
    """Device activity as (start µs, end µs, name), sorted by start."""
    return sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "")) for e in events
                  if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES)


class Host:
    """The host side of a trace: launch calls by correlation id, and host ops by thread."""

    def __init__(self, events: list[dict]):
        self.launches, self.threads, self.syncs, self.names = {}, {}, [], {}
        for e in events:
            if e.get("ph") != "X":
                continue
            cat = e.get("cat")
            if cat in ("cuda_runtime", "cuda_driver"):
                if "correlation" in e.get("args", {}):
                    self.launches[e["args"]["correlation"]] = e
                if e.get("name") in SYNC_CALLS:
                    self.syncs.append(e)
            elif cat in HOST_CATEGORIES and not str(e.get("name", "")).startswith("ProfilerStep#"):
                self.threads.setdefault(e.get("tid"), []).append(e)

    def who(self, e: dict) -> str:
        """Who made host call `e`: the innermost ddptune Python function around it, else the outermost op."""
        key = (e.get("tid"), e["ts"])
        if key not in self.names:  # a graph's kernels share one launch: find its caller once
            around = [o for o in self.threads.get(e.get("tid"), []) if o["ts"] <= e["ts"] <= o["ts"] + o.get("dur", 0)]
            ours = [o for o in around if o.get("cat") == "python_function" and "ddptune" in o.get("name", "")]
            self.names[key] = (max(ours, key=lambda o: o["ts"])["name"][-80:] if ours else
                               min(around, key=lambda o: o["ts"])["name"][:80] if around else "(no host op)")
        return self.names[key]

    def launcher(self, k: dict | None) -> tuple[dict | None, str]:
        """Device event `k`'s launch call (None if the trace lacks it) and who made that call."""
        launch = self.launches.get((k or {}).get("args", {}).get("correlation"))
        return launch, self.who(launch) if launch else "(launch not in the trace)"


def by_launcher(gaps: list[tuple[float, float, dict | None]], host: Host) -> list[dict]:
    """Idle stretches summed by who launched the work that ended them, largest first."""
    rows: dict[str, dict] = {}
    for start, end, after in gaps:
        launch, name = host.launcher(after)
        row = rows.setdefault(name, {"launcher": name, "idle_ms": 0.0, "gaps": 0, "launched_late_ms": 0.0})
        row["idle_ms"] += (end - start) / 1e3
        row["gaps"] += 1
        if launch:  # > 0: the host queued the work only after the device had run out of it
            row["launched_late_ms"] += max(0.0, min(launch["ts"], end) - start) / 1e3
    return sorted(rows.values(), key=lambda r: -r["idle_ms"])


def busy_by_launcher(kernels: list[dict], host: Host) -> list[dict]:
    """GPU time summed by who launched it (a replayed CUDA graph counts as one launch), largest first."""
    rows: dict[str, dict] = {}
    for k in kernels:
        launch, name = host.launcher(k)
        if launch and launch.get("name") == "cudaGraphLaunch":
            name = f"graph replayed by {name}"
        row = rows.setdefault(name, {"launcher": name, "busy_ms": 0.0, "kernels": 0})
        row["busy_ms"] += k.get("dur", 0) / 1e3
        row["kernels"] += 1
    return sorted(rows.values(), key=lambda r: -r["busy_ms"])


def beside_collectives(kernels: list[dict]) -> dict:
    """How much slower the other kernels ran while a NCCL kernel ran beside them: for each kernel name
    seen both ways, the mean duration alone and beside one, and the extra time in all (µs → ms)."""
    nccl = sorted((k["ts"], k["ts"] + k.get("dur", 0)) for k in kernels if "nccl" in k.get("name", "").lower())
    if not nccl:
        return {"nccl_ms": 0.0, "extra_ms": 0.0, "kernels": []}
    starts = [a for a, _ in nccl]
    reach = list(itertools.accumulate((b for _, b in nccl), max))  # the furthest end among the first i+1

    def beside(k: dict) -> bool:  # does any NCCL kernel overlap this one?
        i = bisect.bisect_left(starts, k["ts"] + k.get("dur", 0)) - 1  # the last that starts before k ends
        return i >= 0 and reach[i] > k["ts"]
    runs: dict[str, tuple[list[float], list[float]]] = {}
    for k in kernels:
        if "nccl" not in k.get("name", "").lower():
            runs.setdefault(k.get("name", "")[:80], ([], []))[beside(k)].append(k.get("dur", 0))
    rows = [{"kernel": name, "alone_us": sum(a) / len(a), "beside_us": sum(b) / len(b), "beside_count": len(b),
             "extra_ms": (sum(b) / len(b) - sum(a) / len(a)) * len(b) / 1e3} for name, (a, b) in runs.items() if a and b]
    rows.sort(key=lambda r: -r["extra_ms"])
    return {"nccl_ms": sum(b - a for a, b in nccl) / 1e3, "extra_ms": sum(r["extra_ms"] for r in rows), "kernels": rows[:12]}


def sync_sites(host: Host) -> list[dict]:
    rows: dict[str, dict] = {}
    for e in host.syncs:
        name = host.who(e)
        row = rows.setdefault(f"{e['name']} in {name}", {"sync": f"{e['name']} in {name}", "count": 0, "waited_ms": 0.0})
        row["count"] += 1
        row["waited_ms"] += e.get("dur", 0) / 1e3
    return sorted(rows.values(), key=lambda r: -r["waited_ms"])


def kind_of(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, keys in KINDS if any(key in lower for key in keys)), "other")


def kernel_split(kernels: list[dict], steps: int) -> dict:
    """The GPU's busy ms and launches per step by kind, and the 12 busiest kernel names
    (Inductor's numbered suffixes dropped, so that one fused kernel's copies add up)."""
    kinds: dict[str, dict] = {}
    names: dict[str, dict] = {}
    for k in kernels:
        for table, key in ((kinds, kind_of(k.get("name", ""))), (names, re.sub(r"_\d+$", "", k.get("name", ""))[:100])):
            row = table.setdefault(key, {"ms": 0.0, "launches": 0.0})
            row["ms"] += k.get("dur", 0) / 1e3 / steps
            row["launches"] += 1 / steps
    top = sorted(names.items(), key=lambda kv: -kv[1]["ms"])[:12]
    return {"steps": steps, "busy_ms": sum(r["ms"] for r in kinds.values()),
            "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["ms"])),
            "top": [{"kernel": name, **row} for name, row in top]}


def host_split(host: Host, lo: float, hi: float, steps: int) -> list[dict]:
    """Each host thread's outermost ops (Python frames left out) in [lo, hi]: busy ms per step, and the
    10 largest by name."""
    out = []
    for tid, events in host.threads.items():
        ops = sorted((e for e in events if e.get("cat") != "python_function" and lo <= e["ts"] <= hi),
                     key=lambda e: (e["ts"], -e.get("dur", 0)))
        if not ops:
            continue
        outer, reach = [], float("-inf")
        for e in ops:
            if e["ts"] >= reach:
                outer.append(e)
                reach = e["ts"] + e.get("dur", 0)
        by_name: dict[str, float] = {}
        for e in outer:
            by_name[e["name"][:80]] = by_name.get(e["name"][:80], 0.0) + e.get("dur", 0) / 1e3 / steps
        out.append({"thread": tid, "busy_ms": sum(by_name.values()),
                    "ops": [{"op": n, "ms": ms} for n, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:10]]})
    return sorted(out, key=lambda t: -t["busy_ms"])


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
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    starts = [e["ts"] for e in kernels]
    # each idle stretch longer than 20 µs with the device event that ended it (None: the window's end)
    ended = [(a, b, (kernels[i:i + 1] or [None])[0]) for a, b, _, _ in gaps if b - a > 20
             for i in [bisect.bisect_left(starts, b)]]
    host = Host(events)
    out = {"window_ms": (hi - lo) / 1e3, "busy_ms": (hi - lo - idle) / 1e3, "idle_fraction": idle / (hi - lo),
           "gaps_over_100us": sum(1 for a, b, _, _ in gaps if b - a > 100),
           "largest_gaps": [{"ms": (b - a) / 1e3, "after": x[:80], "before": y[:80]}
                            for a, b, x, y in sorted(gaps, key=lambda g: g[0] - g[1])[:8]],
           "idle_by_launcher": by_launcher(ended, host)[:12],
           "busy_by_launcher": busy_by_launcher(kernels, host)[:12],
           "beside_nccl": beside_collectives([k for k in kernels if k.get("cat") == "kernel"]), "syncs": sync_sites(host)[:12], "steps": []}
    window = [k for k in kernels if not steps or any(s0 <= k["ts"] < s1 for s0, s1, _ in steps)]
    out["kernels"] = kernel_split(window, max(len(steps), 1))
    host_steps = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#")]
    if host_steps:
        h0, h1 = min(e["ts"] for e in host_steps), max(e["ts"] + e.get("dur", 0) for e in host_steps)
        out["host"] = host_split(host, h0, h1, len(host_steps))
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
