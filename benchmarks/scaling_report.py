"""Turn the raw 2-GPU results of benchmarks/scaling_x2.sh into benchmarks/results/h200x2_<model>_<mode>.json
(--prefix h200 for a one-GPU machine's: `scale --alone-only`).

    python benchmarks/scaling_report.py --scale SCALING.json --recipe-1 RECIPE_N1.json --recipe-2 RECIPE_N2.json \
        --model llama31_8b_qlora --device "2x NVIDIA H200 (NVLink NV18), nvidia-h200-x2" --date 2026-11-29

A `ddptune scale` run cut short (a time limit ran out before its last run) leaves no scaling.json,
but every finished run left its ranks.jsonl: `--ranks N1.jsonl N2.jsonl --mode same-per-device --steps 20
--warmup 3` rebuilds the rows from them, over the same sample window and with the same accounting as
`ddptune scale` (tokens per second from the per-process token counts).

`--runs DIR` (a scale_*_runs.tgz unpacked) accounts the rows of `--scale` again with this checkout's
`ddptune scale`, reading each run's computed tokens per process from its metrics.jsonl: for runs made
before scale recorded them (the --alone split moves the alone run to the count's computed tokens).

One file per scaling mode: device, mode, model, steps, and for each process count a row with nproc,
speedup and efficiency (ddptune's, from `ddptune scale`), with the reference recipe's rows beside it
(same-per-device only: the recipe keeps its per-device batch, as the tutorial does).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEEP = ("nproc", "per_process", "batch", "steps", "samples_measured", "step_s", "median_step_s", "tokens_per_s_per_gpu", "samples_per_s",
        "speedup", "efficiency", "efficiency_computed", "compute_s", "imbalance_s", "imbalance_costed_s", "exposed_comm_s", "rest_s", "lost_compute",
        "lost_imbalance", "lost_comm", "lost_rest", "balance", "peak_mem_gib", "final_loss", "val_loss", "note",
        "rouge1", "rouge2", "rougeL", "rougeLsum", "stall_steps", "stall_s", "efficiency_median", "padding",
        "computed_per_process", "alone_compute_s", "speedup_ceiling", "alone_step_measured_s", "timeline_steps", "timeline_step_s", "alone_compute_measured_s", "alone_step_s",
        "alone_computed_per_process", "lost_smaller_batch", "ceiling", "slowest_steps", "compute_offset_s")


def with_median_efficiency(rows: list[dict]) -> list[dict]:
    """Each row's efficiency from median steps beside the one from means over the window (a one-time
    stall inside the window moves the means). None for a --alone-only count, which ran no n processes."""
    from ddptune import scale

    for r in rows:
        r["efficiency_median"] = scale.median_efficiency(r, rows[0]) if "median_step_s" in r else None
    return rows


def recipe_rows(one: dict, two: dict) -> list[dict]:
    rows = []
    for r in (one, two):
        n = r["world_size"]
        rows.append({"nproc": n, "median_step_s": r["median_step_time_s"], "tokens_per_s_per_gpu": r["real_tok_s_per_gpu"],
                     "samples_per_step": r["samples_per_step"], "steps": r["steps"],
                     "warmup_steps_excluded": r["warmup_steps_excluded"], "peak_mem_gib": r["peak_mem_gib"],
                     "final_loss": r["final_loss"],
                     "speedup": r["real_tok_s"] / one["real_tok_s"],
                     "efficiency": r["real_tok_s_per_gpu"] / one["real_tok_s_per_gpu"]})
    return rows


def rows_from_ranks(files: list[str], mode: str, per_process_at_1: int, steps: int, warmup: int) -> tuple[list[dict], list]:
    """Rows as `ddptune scale` measures them, from each run's ranks.jsonl (one per process count)."""
    from ddptune import scale

    runs = [[json.loads(line) for line in Path(f).read_text().splitlines()] for f in files]
    counts = [len(r[0]["step_s"]) for r in runs]
    per = [per_process_at_1 if mode == scale.SAME_PER_DEVICE else per_process_at_1 // n for n in counts]
    batches = [p * n for p, n in zip(per, counts)]
    window = scale.sample_window(batches, warmup, steps)
    rows, base = [], None
    for ranks, n, p, b in zip(runs, counts, per, batches):
        kept = ranks[window[0] // b:window[1] // b]
        row = {"mode": mode, "nproc": n, "per_process": p, "batch": f"{p} x {n} = {b}", "steps": len(kept),
               **scale.timing([r["step_s"][0] for r in kept], sum(sum(r["tokens"]) for r in kept),
                              window[1] - window[0], n, kept)}
        base = base or row
        rows.append(scale.account(row, None if row is base else base, cuda=True))
    return rows, window


def account_again(rows: list[dict], runs: Path, mode: str, window: list[int]) -> list[dict]:
    """`ddptune scale`'s accounting of `rows` (one mode's, n = 1 first) redone, with each run's computed
    tokens per process read from its metrics.jsonl under `runs`, and which process was the slowest
    in each step from its ranks.jsonl."""
    from ddptune import metrics, scale

    def computed(name: str, batch: int, nproc: int) -> float:
        return scale.computed_per_process(scale.window_lines(runs / name, "metrics.jsonl", batch, window), nproc)

    again, base = [], None
    for r in rows:
        n = r["nproc"]
        r = {k: v for k, v in r.items() if k not in ("note", "lost_smaller_batch", "ceiling")}
        r.update(r["parts"], **{k + "_se": v for k, v in r["parts_se"].items()})  # before noise blanked any
        name = "n1" if n == 1 else f"{mode}-n{n}"
        r["computed_per_process"] = computed(name, r["global_batch"], n)
        split = metrics.split(scale.window_lines(runs / name, "ranks.jsonl", r["global_batch"], window))
        r["slowest_steps"], r["compute_offset_s"] = split["slowest_steps"], split["compute_offset_s"]
        if "alone_compute_s" in r:  # as measured (scale moves it to the count's tokens)
            r["alone_compute_s"] = r.pop("alone_compute_measured_s", r["alone_compute_s"])
            r["alone_computed_per_process"] = computed(f"alone-n{n}", r["per_process"], 1)
        again.append(scale.account(r, base, cuda=True))
        base = base or again[-1]
    return again


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", help="scaling.json written by ddptune scale")
    p.add_argument("--ranks", nargs="+", help="instead of --scale: each run's ranks.jsonl, 1 process first")
    p.add_argument("--runs", type=Path, help="with --scale: the runs' folder (scale_*_runs.tgz unpacked): account again")
    p.add_argument("--mode", help="with --ranks: same-per-device or same-global")
    p.add_argument("--per-process", type=int, default=16, help="with --ranks: samples per process at 1 process")
    p.add_argument("--steps", type=int, default=20, help="with --ranks: as given to ddptune scale")
    p.add_argument("--warmup", type=int, default=3, help="with --ranks: as given to ddptune scale")
    p.add_argument("--command", help="with --ranks: the command that made the runs")
    p.add_argument("--suffix", default="", help="file name ending, e.g. _2026-11-30")
    p.add_argument("--prefix", default="h200x2", help="file name start: the device kind, e.g. h200 for one GPU")
    p.add_argument("--recipe-1")
    p.add_argument("--recipe-2")
    p.add_argument("--model", required=True, help="file name part, e.g. llama31_8b_qlora")
    p.add_argument("--device", required=True)
    p.add_argument("--date", required=True)
    p.add_argument("--note", default=None)
    args = p.parse_args()
    if args.ranks:
        rows, window = rows_from_ranks(args.ranks, args.mode, args.per_process, args.steps, args.warmup)
        out = {"device": args.device, "date": args.date, "mode": args.mode, "model": args.model, "command": args.command,
               "sample_window": list(window), "steps": {str(r["nproc"]): r["steps"] for r in rows},
               "rows": [{k: r.get(k) for k in KEEP if k in r} for r in with_median_efficiency(rows)]}
        write(out, args)
        return 0
    scale = json.loads(Path(args.scale).read_text())
    manifest = scale["manifest"]
    for mode in scale["modes"]:
        rows = [r for r in scale["rows"] if r["mode"] == mode]
        if args.runs:
            rows = account_again(rows, args.runs, mode, manifest["sample_window"][mode])
        rows = [{k: r.get(k) for k in KEEP if k in r} for r in with_median_efficiency(rows)]
        out = {"device": args.device, "date": args.date, "mode": mode, "model": args.model, "command": manifest["command"],
               "sample_window": manifest["sample_window"][mode], "steps": {str(r["nproc"]): r["steps"] for r in rows},
               "interconnect": scale["interconnect"], "peak_busbw_GBps": scale["bandwidth"].get("peak_busbw_GBps"),
               "versions": manifest["versions"], "rows": rows,
               "predicted": [x for x in scale["predictions"]["measured"] if x["mode"] == mode]}
        write(out, args)
    return 0


def write(out: dict, args) -> None:
    """benchmarks/results/<prefix>_<model>_<mode><suffix>.json, with the recipe's rows beside
    same-per-device ones (the recipe keeps its per-device batch, as the tutorial does)."""
    if out["mode"] == "same-per-device" and args.recipe_1 and args.recipe_2:
        out["reference_recipe"] = recipe_rows(json.loads(Path(args.recipe_1).read_text()),
                                              json.loads(Path(args.recipe_2).read_text()))
    if args.note:
        out["note"] = args.note
    path = ROOT / "benchmarks" / "results" / f"{args.prefix}_{args.model}_{out['mode']}{args.suffix}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(path)


if __name__ == "__main__":
    raise SystemExit(main())
