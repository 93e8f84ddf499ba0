"""Raw files of finished multi-process runs: `ddptune scale` results into benchmarks/results/<prefix>_<model>_<mode><suffix>.json,
or (`runs`) several finished `ddptune train` runs side by side, each beside `ddptune plan`'s prediction.

    python benchmarks/scaling_report.py --scale R1.json R2.json --runs R1_runs R2_runs \
        --recipe-1 RECIPE_N1.json --recipe-2 RECIPE_N2.json --model llama31_8b_qlora --suffix _defaults \
        --device "2x NVIDIA H200 (NVLink NV18), nvidia-h200-x2" --date 2026-12-02 --commit COMMIT

One file per scaling mode: device, mode, model, steps, and for each process count a row with nproc,
speedup and efficiency (by mean steps over the sample window, and by median steps), where the lost
efficiency went (compute, imbalance, exposed communication, rest) and `ddptune scale`'s findings
(`notes`: codes and numbers; `note`: the sentences), from the first `--scale` file. With several
`--scale` files (repeats of the same command) `repeats` holds each one's rows and `spread`, for each
count, each repeat's efficiency and lost parts side by side with their range. `--runs` (each
repeat's *_runs.tgz unpacked, in the same order) adds the speed decider's choices and reasons for
every run (its summary.json's `speed`). The reference recipe's rows go beside same-per-device ones
(the recipe keeps its per-device batch, as the tutorial does), with their efficiency from real
tokens a second per GPU.

A `ddptune scale` run cut short (a time limit ran out before its last run) leaves no scaling.json,
but every finished run left its ranks.jsonl: `--ranks N1.jsonl N2.jsonl --mode same-per-device --steps 20
--warmup 3` rebuilds the rows from them, over the same sample window and with the same accounting as
`ddptune scale` (tokens a second from the per-process token counts).

Each file records the measurement's commit (what `ddptune scale` recorded, or --commit where its checkout carried
no history), date, command and device, and under `report` this script's own command line, commit, date and machine.

`runs` (the runs' folders, each NAME=RUN_DIR[:PLAN.json], and the file to write):

    python benchmarks/scaling_report.py runs --warmup 5 --out runs.json NAME=RUN_DIR[:PLAN.json] ...

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
The file records this command's commit, date, command line and device (the runs' own are in their folders).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ddptune import provenance

ROOT = Path(__file__).resolve().parents[1]
KEEP = ("nproc", "per_process", "batch", "global_batch", "steps", "samples_measured", "step_s", "median_step_s",
        "tokens_per_s_per_gpu", "samples_per_s", "speedup", "efficiency", "efficiency_median", "efficiency_computed",
        "compute_s", "imbalance_s", "imbalance_costed_s", "exposed_comm_s", "rest_s", "lost_compute", "lost_imbalance",
        "lost_comm", "lost_rest", "balance", "padding", "computed_per_process", "strategy", "cuda_graphs",
        "peak_mem_gib", "final_loss", "val_loss", "rouge1", "rouge2", "rougeL", "rougeLsum", "stall_steps", "stall_s",
        "slowest_steps", "compute_offset_s", "host_cpu_busy", "host_cpu_steal", "notes", "note")
SPREAD = ("efficiency", "efficiency_median", "speedup", "lost_compute", "lost_imbalance", "lost_comm", "lost_rest",
          "median_step_s")
SPEED = ("compiled", "graphs", "lengths", "checkpointing", "dequantize", "bucket_mb", "reasons", "forced")


def with_median_efficiency(rows: list[dict]) -> list[dict]:
    """Each row's efficiency from median steps beside the one from means over the window (a one-time
    stall inside the window moves the means): ideal time over measured, as `scaling.account` has it."""
    base = rows[0]
    for r in rows:
        r["efficiency_median"] = base["median_step_s"] * r["per_process"] / (r["median_step_s"] * base["per_process"])
    return rows


def kept(rows: list[dict]) -> list[dict]:
    """The rows as a raw file keeps them: the KEEP figures of each, with its efficiency by median steps."""
    return [{k: r[k] for k in KEEP if k in r} for r in with_median_efficiency(rows)]


def recipe_rows(one: dict, two: dict) -> list[dict]:
    rows = []
    for r in (one, two):
        rows.append({"nproc": r["world_size"], "median_step_s": r["median_step_time_s"],
                     "tokens_per_s_per_gpu": r["real_tok_s_per_gpu"], "samples_per_step": r["samples_per_step"],
                     "steps": r["steps"], "warmup_steps_excluded": r["warmup_steps_excluded"],
                     "measured_steps": r["steps"] - r["warmup_steps_excluded"], "peak_mem_gib": r["peak_mem_gib"],
                     "final_loss": r["final_loss"], "speedup": r["real_tok_s"] / one["real_tok_s"],
                     "efficiency": r["real_tok_s_per_gpu"] / one["real_tok_s_per_gpu"]})
    return rows


def rows_from_ranks(files: list[str], mode: str, per_process_at_1: int, steps: int, warmup: int) -> tuple[list[dict], tuple]:
    """Rows as `ddptune scale` measures them, from each run's ranks.jsonl (one per process count)."""
    from ddptune import scaling

    runs = [[json.loads(line) for line in Path(f).read_text().splitlines()] for f in files]
    counts = [len(r[0]["step_s"]) for r in runs]
    per = [per_process_at_1 if mode == scaling.SAME_PER_DEVICE else per_process_at_1 // n for n in counts]
    batches = [p * n for p, n in zip(per, counts)]
    window = scaling.sample_window(batches, warmup, steps)
    rows, base = [], None
    for ranks, n, p, b in zip(runs, counts, per, batches):
        inside = ranks[window[0] // b:window[1] // b]
        row = {"mode": mode, "nproc": n, "per_process": p, "global_batch": b, "batch": f"{p} x {n} = {b}",
               "steps": len(inside), **scaling.timing([r["step_s"][0] for r in inside], sum(sum(r["tokens"]) for r in inside),
                                                      window[1] - window[0], n, inside)}
        row = scaling.account(row, base, cuda=True)
        base = base or row
        rows.append(row)
    return rows, window


def speed_choices(runs: Path) -> dict:
    """{run name: its summary.json's speed choices} for the runs of one scale folder."""
    out = {}
    for summary in sorted(runs.glob("*/summary.json")):
        speed = json.loads(summary.read_text()).get("speed") or {}
        out[summary.parent.name] = {k: speed.get(k) for k in SPEED}
    return out


def spread(repeats: list[list[dict]]) -> list[dict]:
    """For each process count: each repeat's figures (SPREAD) side by side, and their range."""
    out = []
    for rows in zip(*repeats):
        entry = {"nproc": rows[0]["nproc"]}
        for key in SPREAD:
            values = [r.get(key) for r in rows]
            known = [v for v in values if v is not None]
            entry[key] = values
            entry[key + "_range"] = max(known) - min(known) if len(known) > 1 else None
        out.append(entry)
    return out


def from_scale(args) -> list[dict]:
    """One output per mode from the --scale files (the first file's rows, and the repeats beside them)."""
    scales = [json.loads(Path(f).read_text()) for f in args.scale]
    runs = [speed_choices(Path(d)) for d in args.runs or []]
    first = scales[0]
    manifest = first["manifest"]
    outs = []
    for mode in first["modes"]:
        repeats = [kept([r for r in s["rows"] if r["mode"] == mode]) for s in scales]
        out = {"device": args.device, "date": args.date, "mode": mode, "model": args.model, "command": manifest["command"],
               "sample_window": manifest["sample_window"][mode], "steps": {str(r["nproc"]): r["steps"] for r in repeats[0]},
               "interconnect": first["interconnect"], "peak_busbw_GBps": first["bandwidth"].get("peak_busbw_GBps"),
               "versions": manifest["versions"], "rows": repeats[0], "scale_commit": manifest.get("commit"),
               "predicted": [x for x in first["predictions"]["measured"] if x["mode"] == mode]}
        if len(scales) > 1:
            out["repeats"] = [{"file": Path(f).name, "date": s["manifest"]["date"], "rows": rows}
                              for f, s, rows in zip(args.scale, scales, repeats)]
            out["spread"] = spread(repeats)
        if runs:
            out["speed"] = [{k: v for k, v in r.items() if k == "n1" or k.startswith(mode)} for r in runs]
        outs.append(out)
    return outs


def parse_spec(spec: str) -> tuple[str, Path, Path | None]:
    """NAME=RUN_DIR[:PLAN.json] -> (name, run folder, plan file or None)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"scaling_report.py runs: {spec!r} is not NAME=RUN_DIR[:PLAN.json]")
    folder, _, plan = rest.partition(":")
    return name, Path(folder), Path(plan) if plan else None


def plan_part(plan: dict, peak: float | None, dequantized: bool) -> dict:
    """The plan's as-configured option beside a run's peak: `plan_error` only where the run kept the 4-bit
    base the option assumes (`dequantized` False), else None."""
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
           "speed": {k: speed.get(k) for k in SPEED}, "load_time_s": summary["load_time_s"],
           "wall_time_s": summary["wall_time_s"]}
    if plan is not None:
        row["plan"] = plan_part(json.loads(plan.read_text()), row["peak_mem_gib"], bool(speed.get("dequantize")))
    return row


def collect(specs: list[str], warmup: int) -> dict:
    """Every run of `specs` (NAME=RUN_DIR[:PLAN.json]) as a row, each after the first with its largest loss
    difference from the first run's."""
    rows = [run_row(*parse_spec(s), warmup) for s in specs]
    first = next((r for r in rows if "losses" in r), None)
    for r in rows:
        if first is not None and r is not first and "losses" in r:
            pairs = list(zip(first["losses"], r["losses"]))
            r["loss_max_abs_diff"] = max(abs(a - b) for a, b in pairs) if pairs else None
            r["loss_compared_with"] = first["name"]
    return {"warmup_steps_excluded": warmup, "runs": rows}


def runs_main(argv: list[str]) -> int:
    """`scaling_report.py runs ...` (module docstring)."""
    p = argparse.ArgumentParser(prog="scaling_report.py runs", description="finished ddptune train runs side by side")
    p.add_argument("runs", nargs="+", metavar="NAME=RUN_DIR[:PLAN.json]")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step-time figures")
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--commit", help="this checkout's commit, where the machine's copy does not carry its history")
    args = p.parse_args(argv)
    result = {**provenance.record(args.commit, __file__, ["runs", *argv]), **collect(args.runs, args.warmup)}
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


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring): `runs ...` for train runs, anything else for `ddptune scale` results."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["runs"]:
        return runs_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", nargs="+", help="scaling.json written by ddptune scale; several: repeats of one command")
    p.add_argument("--runs", nargs="+", help="with --scale: each repeat's runs folder (its *_runs.tgz unpacked), in order")
    p.add_argument("--ranks", nargs="+", help="instead of --scale: each run's ranks.jsonl, 1 process first")
    p.add_argument("--mode", help="with --ranks: same-per-device or same-global")
    p.add_argument("--per-process", type=int, default=16, help="with --ranks: samples per process at 1 process")
    p.add_argument("--steps", type=int, default=20, help="with --ranks: as given to ddptune scale")
    p.add_argument("--warmup", type=int, default=3, help="with --ranks: as given to ddptune scale")
    p.add_argument("--command", help="with --ranks: the command that made the runs")
    p.add_argument("--suffix", default="", help="file name ending, e.g. _defaults_2026-12-02")
    p.add_argument("--prefix", default="h200x2", help="file name start: the device kind")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="the folder the files go to")
    p.add_argument("--recipe-1")
    p.add_argument("--recipe-2")
    p.add_argument("--model", required=True, help="file name part, e.g. llama31_8b_qlora")
    p.add_argument("--device", required=True)
    p.add_argument("--date", required=True)
    p.add_argument("--note", default=None)
    p.add_argument("--commit", help="the commit the measurement ran at, where ddptune scale could not say (no git history)")
    args = p.parse_args(argv)
    report = provenance.record(None, __file__, argv)
    if bool(args.scale) == bool(args.ranks):
        p.error("give --scale or --ranks")
    if args.runs and len(args.runs) != len(args.scale or []):
        p.error("--runs: one folder for each --scale file")
    if args.ranks:
        rows, window = rows_from_ranks(args.ranks, args.mode, args.per_process, args.steps, args.warmup)
        outs = [{"device": args.device, "date": args.date, "mode": args.mode, "model": args.model, "command": args.command,
                 "sample_window": list(window), "steps": {str(r["nproc"]): r["steps"] for r in rows}, "rows": kept(rows)}]
    else:
        outs = from_scale(args)
    for out in outs:
        out.update(commit=args.commit or out.pop("scale_commit", None), report=report)
        print(write(out, args))
    return 0


def write(out: dict, args) -> Path:
    """benchmarks/results/<prefix>_<model>_<mode><suffix>.json, with the recipe's rows beside
    same-per-device ones (the recipe keeps its per-device batch, as the tutorial does)."""
    if out["mode"] == "same-per-device" and args.recipe_1 and args.recipe_2:
        out["reference_recipe"] = recipe_rows(json.loads(Path(args.recipe_1).read_text()),
                                              json.loads(Path(args.recipe_2).read_text()))
    if args.note:
        out["note"] = args.note
    path = Path(args.results) / f"{args.prefix}_{args.model}_{out['mode']}{args.suffix}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    return path


if __name__ == "__main__":
    raise SystemExit(main())
