"""Several finished `ddptune train` runs side by side in one JSON, each beside `ddptune plan`'s prediction for it.

    python benchmarks/train_runs.py --warmup 5 --out runs.json NAME=RUN_DIR[:PLAN.json] ...

For each run (its summary.json and metrics.jsonl): strategy, processes, samples a step, every step's
loss, the median and mean step after the first `--warmup` steps, real tokens a second per GPU, the
speed decider's choices and reasons, and the peak memory of each process (max_memory_allocated).
With a plan (`ddptune plan ... --json PLAN.json` for the same config and GPU count), its
as-configured option's `allocated` and `total` GiB beside the peak, and `plan_error` (measured
largest peak / allocated - 1) where the run kept the 4-bit base the option assumes; the plan's
`dequantized_base_gib` (a total) is given for a run whose base the decider kept dequantized.

Runs of the same config, seed and global batch train on the same samples: each run after the first
gets `loss_max_abs_diff`, the largest difference of its per-step losses from the first run's over
the steps both ran. A run folder without summary.json (a run that failed) is listed with `missing`.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

SPEED_KEYS = ("compiled", "graphs", "lengths", "checkpointing", "dequantize", "bucket_mb", "reasons", "forced")


def parse_spec(spec: str) -> tuple[str, Path, Path | None]:
    """NAME=RUN_DIR[:PLAN.json] -> (name, run folder, plan file or None)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"train_runs.py: {spec!r} is not NAME=RUN_DIR[:PLAN.json]")
    folder, _, plan = rest.partition(":")
    return name, Path(folder), Path(plan) if plan else None


def plan_part(plan: dict, peak: float | None, dequantized: bool) -> dict:
    option = plan["options"][0]  # as configured
    out = {"option": option["option"], "allocated_gib": option["allocated"], "total_gib": option["total"],
           "dequantized_base_gib": plan.get("dequantized_base_gib"), "verdict": plan["verdict"],
           "recommendation": plan["recommendation"]}
    out["plan_error"] = peak / option["allocated"] - 1 if peak is not None and not dequantized else None
    return out


def run_row(name: str, folder: Path, plan: Path | None, warmup: int) -> dict:
    """One run's figures (module docstring)."""
    if not (folder / "summary.json").is_file():
        return {"name": name, "folder": str(folder), "missing": "no summary.json (the run did not finish)"}
    summary = json.loads((folder / "summary.json").read_text())
    steps = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if '"step_time_s"' in line]
    measured = steps[warmup:] or steps
    seconds = sum(r["step_time_s"] for r in measured)
    world = summary["world_size"]
    speed = summary.get("speed") or {}
    peaks = [p for p in summary.get("peak_mem_gib_per_process") or [] if p is not None]
    row = {"name": name, "folder": str(folder), "strategy": summary["strategy"], "method": summary["method"],
           "world_size": world, "global_batch": summary["global_batch"], "per_process": summary["per_process"],
           "steps": len(steps), "measured_steps": len(measured), "warmup_steps_excluded": len(steps) - len(measured),
           "median_step_s": statistics.median(r["step_time_s"] for r in measured), "mean_step_s": seconds / len(measured),
           "tokens_per_s_per_gpu": sum(r["tokens"] for r in measured) / seconds / world,
           "losses": [r["loss"] for r in steps], "final_loss": summary["final_loss"], "val_loss": summary["val_loss"],
           "peak_mem_gib": max(peaks) if peaks else None, "peak_mem_gib_per_process": summary.get("peak_mem_gib_per_process"),
           "speed": {k: speed.get(k) for k in SPEED_KEYS}, "load_time_s": summary["load_time_s"],
           "wall_time_s": summary["wall_time_s"]}
    if plan is not None:
        row["plan"] = plan_part(json.loads(plan.read_text()), row["peak_mem_gib"], bool(speed.get("dequantize")))
    return row


def collect(specs: list[str], warmup: int) -> dict:
    rows = [run_row(*parse_spec(s), warmup) for s in specs]
    first = next((r for r in rows if "losses" in r), None)
    for r in rows:
        if first is not None and r is not first and "losses" in r:
            pairs = list(zip(first["losses"], r["losses"]))
            r["loss_max_abs_diff"] = max(abs(a - b) for a, b in pairs) if pairs else None
            r["loss_compared_with"] = first["name"]
    return {"warmup_steps_excluded": warmup, "runs": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", metavar="NAME=RUN_DIR[:PLAN.json]")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step-time figures")
    p.add_argument("--out", required=True, help="the JSON file to write")
    args = p.parse_args()
    result = collect(args.runs, args.warmup)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in result["runs"]:
        if "missing" in r:
            print(f"{r['name']}: {r['missing']}")
            continue
        plan = r.get("plan") or {}
        print(f"{r['name']}: {r['strategy']} x {r['world_size']}, median step {r['median_step_s']:.4f} s, "
              f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, peak {r['peak_mem_gib']} GiB (plan allocated "
              f"{plan.get('allocated_gib')}), final loss {r['final_loss']:.4f}, loss gap {r.get('loss_max_abs_diff')}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
