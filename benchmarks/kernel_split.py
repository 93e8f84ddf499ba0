"""Which of the GPU's work does not halve when the batch does: two torch.profiler traces of the same
job, one process at a global batch against one of n processes at its 1/n share (same-global).

    python benchmarks/kernel_split.py N1/trace.json N2/trace.json [--n 2] [--json split.json]

Each trace is rank 0's `output_dir/trace.json` from `ddptune train ... train.profile_steps=K`. For
every kernel family (its name without template arguments, launch numbers or inductor's trailing
index) it sums the GPU time per profiled step at 1 process (t1) and at n (tn). With a step taken as
fixed + per-sample work, t1 = F + V and tn = F + V/n, so the family's fixed part is
F = (n tn - t1) / (n - 1): the time that stays when each process gets fewer samples, the part that
holds a same-global speedup under n. Kernels only one side runs (NCCL at n > 1) count wholly.
The GPU's idle time inside the steps is reported the same way.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

DEVICE = {"kernel", "gpu_memcpy", "gpu_memset"}


def family(name: str) -> str:
    """A kernel's name without what changes between launches of the same code."""
    name = re.split(r"[<(]", name, maxsplit=1)[0].strip()
    name = re.sub(r"^void ", "", name)
    if name.startswith("triton_"):
        return re.sub(r"_\d+$", "", name)
    if name.startswith("nvjet_"):  # cuBLAS's Hopper kernels: tile sizes in the name
        return "nvjet (cuBLAS GEMM)"
    return name


def category(name: str, cat: str) -> str:
    low = name.lower()
    if cat != "kernel":
        return cat
    if "nccl" in low:
        return "nccl"
    if any(k in low for k in ("flash", "fmha", "attention")):
        return "attention"
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma", "splitk", "cublas")):
        return "gemm"
    if any(k in low for k in ("adam", "multi_tensor", "foreach")):
        return "optimizer and foreach"
    if low.startswith("triton_"):
        return "triton (inductor, fused)"
    return "other"


def load(path: Path) -> dict:
    """Per-step GPU time and launches by family and category, and the idle inside the profiled span."""
    events = json.loads(path.read_text())["traceEvents"]
    steps = max(1, len({e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}))
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE), key=lambda e: e["ts"])
    fams: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0, ""])
    busy, end = 0.0, None
    for e in device:
        f = fams[family(e.get("name", ""))]
        f[0] += e.get("dur", 0)
        f[1] += 1
        f[2] = category(e.get("name", ""), e["cat"])
        start, stop = e["ts"], e["ts"] + e.get("dur", 0)
        if end is None or start >= end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    span = (device[-1]["ts"] + device[-1].get("dur", 0) - device[0]["ts"]) if device else 0.0
    ms = 1e-3 / steps
    return {"steps": steps, "span_ms": span * ms, "busy_ms": busy * ms, "idle_ms": (span - busy) * ms,
            "families": {k: {"ms": v[0] * ms, "launches": v[1] / steps, "category": v[2]} for k, v in fams.items()}}


def split(one: dict, many: dict, n: int) -> dict:
    """Each family's and category's fixed part F = (n tn - t1) / (n - 1), per step, ms."""
    def fixed(t1: float, tn: float) -> float:
        return (n * tn - t1) / (n - 1)

    rows = []
    for name in sorted(set(one["families"]) | set(many["families"])):
        a = one["families"].get(name, {"ms": 0.0, "launches": 0.0})
        b = many["families"].get(name, {"ms": 0.0, "launches": 0.0})
        cat = b.get("category") or a.get("category")
        rows.append({"family": name, "category": cat, "t1_ms": a["ms"], "tn_ms": b["ms"], "fixed_ms": fixed(a["ms"], b["ms"]),
                     "launches_1": a["launches"], "launches_n": b["launches"]})
    cats: dict[str, dict] = {}
    for r in rows:
        c = cats.setdefault(r["category"], {"category": r["category"], "t1_ms": 0.0, "tn_ms": 0.0, "launches_1": 0.0,
                                            "launches_n": 0.0})
        for k in ("t1_ms", "tn_ms", "launches_1", "launches_n"):
            c[k] += r[k]
    for c in cats.values():
        c["fixed_ms"] = fixed(c["t1_ms"], c["tn_ms"])
    totals = {k: {"t1_ms": one[k], "tn_ms": many[k], "fixed_ms": fixed(one[k], many[k])} for k in ("span_ms", "busy_ms", "idle_ms")}
    return {"n": n, "steps": [one["steps"], many["steps"]], "totals": totals,
            "categories": sorted(cats.values(), key=lambda c: -c["fixed_ms"]),
            "families": sorted(rows, key=lambda r: -r["fixed_ms"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("one", type=Path, help="trace.json of 1 process at the global batch")
    p.add_argument("many", type=Path, help="rank 0's trace.json of n processes at 1/n of it each")
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    s = split(load(a.one), load(a.many), a.n)
    print(f"per step, ms (profiled steps {s['steps'][0]} and {s['steps'][1]}); fixed = ({a.n} t{a.n} - t1) / {a.n - 1}")
    print(f"{'':38} {'t1':>8} {'t' + str(a.n):>8} {'fixed':>8} {'launches':>15}")
    for k, v in s["totals"].items():
        print(f"{k:38} {v['t1_ms']:8.2f} {v['tn_ms']:8.2f} {v['fixed_ms']:8.2f}")
    for c in s["categories"]:
        print(f"{c['category'][:38]:38} {c['t1_ms']:8.2f} {c['tn_ms']:8.2f} {c['fixed_ms']:8.2f} "
              f"{c['launches_1']:7.0f}/{c['launches_n']:<7.0f}")
    print("families with the largest fixed part:")
    for r in s["families"][:a.top]:
        print(f"  {r['family'][:36]:36} {r['t1_ms']:8.2f} {r['tn_ms']:8.2f} {r['fixed_ms']:8.2f} "
              f"{r['launches_1']:7.0f}/{r['launches_n']:<7.0f}")
    if a.json:
        a.json.write_text(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()
