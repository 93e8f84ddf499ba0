"""Which of the GPU's work does not halve when the batch does: two torch.profiler traces of the same
job, one process at a global batch against one of n processes at its 1/n share (same-global).

    python benchmarks/kernel_split.py N1/trace.json N2/trace.json [--alone A/trace.json] [--n 2] [--json split.json]
    python benchmarks/kernel_split.py --collectives N2/trace.json N2/trace-rank1.json [--json c.json]
    python benchmarks/kernel_split.py --timeline N2/trace.json N2/trace-rank1.json [--json t.json]

Each trace is rank 0's `output_dir/trace.json` from `ddptune train ... train.profile_steps=K`. For
every kernel family (its name without template arguments, launch numbers or inductor's trailing
index) it sums the GPU time per profiled step at 1 process (t1) and at n (tn). With a step taken as
fixed + per-sample work, t1 = F + V and tn = F + V/n, so the family's fixed part is
F = (n tn - t1) / (n - 1): the time that stays when each process gets fewer samples, the part that
holds a same-global speedup under n. Kernels only one side runs (NCCL at n > 1) count wholly.
The GPU's idle time inside the steps is reported the same way. With --alone (one process alone
at the n-process share), `tax` = tn - t_alone is what running beside the others added.

The profiler's window does not start or end at a step's edge on the GPU (graphs run behind the
host), so each trace is cut at the launches of a kernel that runs once a step (--marker, by
default the embedding's backward, `indexFuncLargeIndex`): only whole steps between the first and
the last of them count.

--collectives lines up the processes' NCCL kernels (their traces share the host's clock): when
each process entered each collective and how long its kernel ran. The one that entered last ran
its kernel for about the transfer alone; the others' kernels also waited for it.

--timeline splits each profiled step as `ddptune scale` does with the whole step recorded
(`ddptune.timeline`): every process's compute, wait and idle, and the step's mean compute,
imbalance and exposed communication.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_gaps import DEVICE_CATEGORIES as DEVICE, idle_gaps  # noqa: E402


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


def load(path: Path, marker: str) -> dict:
    """Per-step GPU time and launches by family and category, and the idle, over whole steps."""
    events = json.loads(path.read_text())["traceEvents"]
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE), key=lambda e: e["ts"])
    marks = [e["ts"] for e in device if marker in e.get("name", "")]
    if len(marks) < 2:
        raise SystemExit(f"{path}: the marker {marker!r} ran {len(marks)} times; a whole step needs two (pick --marker)")
    steps = len(marks) - 1
    device = [e for e in device if marks[0] <= e["ts"] < marks[-1]]
    fams: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0, ""])
    for e in device:
        f = fams[family(e.get("name", ""))]
        f[0] += e.get("dur", 0)
        f[1] += 1
        f[2] = category(e.get("name", ""), e["cat"])
    span = marks[-1] - marks[0]
    idle = sum(b - a for a, b, *_ in idle_gaps([(e["ts"], e["ts"] + e.get("dur", 0), "") for e in device], marks[0], marks[-1]))
    ms = 1e-3 / steps
    return {"steps": steps, "span_ms": span * ms, "busy_ms": (span - idle) * ms, "idle_ms": idle * ms,
            "families": {k: {"ms": v[0] * ms, "launches": v[1] / steps, "category": v[2]} for k, v in fams.items()}}


def collectives(paths: list[Path]) -> list[dict]:
    """Each collective kernel of each trace, in order: when it started (ms after the first trace's
    first kernel) and how long it ran, side by side by launch index; `last_in` is who entered last."""
    launches, origin = [], None
    for path in paths:
        events = json.loads(path.read_text())["traceEvents"]
        launches.append(sorted((e["ts"], e.get("dur", 0), family(e.get("name", ""))) for e in events
                               if e.get("ph") == "X" and e.get("cat") == "kernel" and "nccl" in e.get("name", "").lower()))
        if origin is None:
            origin = min(e["ts"] for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE)
    rows = []
    for i in range(min(len(l) for l in launches)):
        starts = [(l[i][0] - origin) / 1e3 for l in launches]
        rows.append({"index": i, "family": launches[0][i][2], "start_ms": starts, "dur_ms": [l[i][1] / 1e3 for l in launches],
                     "last_in": starts.index(max(starts))})
    return rows


def split(one: dict, many: dict, n: int, alone: dict | None = None) -> dict:
    """Each family's and category's fixed part F = (n tn - t1) / (n - 1), per step, ms (and with
    `alone`, tax = tn - t_alone)."""
    traces = {"t1": one, "tn": many} | ({"ta": alone} if alone else {})
    none = {"ms": 0.0, "launches": 0.0}

    def derive(row: dict) -> dict:
        row["fixed_ms"] = (n * row["tn_ms"] - row["t1_ms"]) / (n - 1)
        if alone:
            row["tax_ms"] = row["tn_ms"] - row["ta_ms"]
        return row

    rows = []
    for name in sorted(set().union(*(t["families"] for t in traces.values()))):
        got = {k: t["families"].get(name, none) for k, t in traces.items()}
        row = {"family": name, "category": next(g["category"] for g in got.values() if "category" in g)}
        for k, g in got.items():
            row[k + "_ms"], row["launches_" + k[1:]] = g["ms"], g["launches"]
        rows.append(derive(row))
    cats: dict[str, dict] = {}
    for r in rows:
        c = cats.setdefault(r["category"], {"category": r["category"]})
        for k, v in r.items():
            if k.startswith(("t", "launches")) and not k.endswith(("fixed_ms", "tax_ms")):
                c[k] = c.get(k, 0.0) + v
    for c in cats.values():
        derive(c)
    totals = {k: derive({f"{name}_ms": t[k] for name, t in traces.items()}) for k in ("span_ms", "busy_ms", "idle_ms")}
    return {"n": n, "steps": [t["steps"] for t in traces.values()], "totals": totals,
            "categories": sorted(cats.values(), key=lambda c: -c["fixed_ms"]),
            "families": sorted(rows, key=lambda r: -r["fixed_ms"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("one", type=Path, help="trace.json of 1 process at the global batch")
    p.add_argument("many", type=Path, nargs="+", help="rank 0's trace.json of n processes at 1/n of it each "
                   "(with --collectives: every process's trace)")
    p.add_argument("--collectives", action="store_true", help="line up the traces' collectives instead")
    p.add_argument("--timeline", action="store_true", help="split each step from every process's timeline instead")
    p.add_argument("--alone", type=Path, help="trace.json of 1 process alone at the n-process share")
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--marker", default="indexFuncLargeIndex", help="a kernel that runs once a step")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if a.timeline:
        from ddptune import metrics, timeline

        per_rank = [timeline.load(path) for path in [a.one, *a.many]]
        lines = timeline.rank_lines([{"step": k, "step_s": [0.0]} for k in sorted(per_rank[0])], per_rank)  # no host step: no rest
        split = metrics.split(lines)
        for line in lines:
            print(f"step {line['step']:4}" + "".join(f"  {k.removesuffix('_s')} " + " ".join(f"{t * 1e3:8.3f}" for t in line[k])
                                                     for k in ("compute_s", "wait_s", "work_s", "idle_s")))
        print("ms a step: " + ", ".join(f"{k.removesuffix('_s')} {split[k] * 1e3:.3f}" for k in ("compute_s", "imbalance_s", "exposed_comm_s"))
              + f"; slowest in steps per process {split['slowest_steps']}")
        if a.json:
            a.json.write_text(json.dumps({"steps": lines, "split": split}, indent=1))
        return
    if a.collectives:
        rows = collectives([a.one, *a.many])
        for r in rows:
            print(f"{r['index']:3} {r['family'][:40]:40} start " + " ".join(f"{t:9.2f}" for t in r["start_ms"])
                  + "  ran " + " ".join(f"{t:7.3f}" for t in r["dur_ms"]) + f"  last in: {r['last_in']}")
        if a.json:
            a.json.write_text(json.dumps(rows, indent=1))
        return
    s = split(load(a.one, a.marker), load(a.many[0], a.marker), a.n, load(a.alone, a.marker) if a.alone else None)
    cols = ["t1", "tn", "fixed"] + (["ta", "tax"] if a.alone else [])
    print(f"per step, ms (whole steps {s['steps']}); fixed = ({a.n} tn - t1) / {a.n - 1}"
          + (", tax = tn - ta (ta: alone at the share)" if a.alone else ""))

    def line(label: str, r: dict, launches: bool) -> str:
        text = f"{label[:38]:38}" + "".join(f" {r[c + '_ms']:8.2f}" for c in cols)
        return text + (f" {r['launches_1']:7.0f}/{r['launches_n']:<7.0f}" if launches else "")

    print(f"{'':38}" + "".join(f" {c:>8}" for c in cols) + f" {'launches 1/n':>15}")
    for k, v in s["totals"].items():
        print(line(k, v, False))
    for c in s["categories"]:
        print(line(c["category"], c, True))
    print("families with the largest fixed part:")
    for r in s["families"][:a.top]:
        print(line("  " + r["family"], r, True))
    if a.alone:
        print("families with the largest tax:")
        for r in sorted(s["families"], key=lambda r: -r["tax_ms"])[:a.top]:
            print(line("  " + r["family"], r, True))
    if a.json:
        a.json.write_text(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()
