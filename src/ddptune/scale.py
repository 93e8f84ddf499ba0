"""`ddptune scale`: the same training at each process count, and where every lost percent went.

Read top to bottom: plan (check every run first) → bandwidth → runs → rows → predictions → files.
Modes (named in every output; `both` runs each, sharing the n = 1 run): same-per-device, each
process takes the samples per step that n = 1 takes, so the global batch grows with n (the
tutorial's way); same-global, the global batch of n = 1 at every n, each process taking 1/n of it.
Every run trains over the same window of the sample stream (scaling.py: rows, the time split and
its findings), after --warmup steps of the largest batch. Each run is the config as a user runs it:
the speed decider's choices do not depend on how many steps a run takes, so a window runs the
program of the whole job, and with the same batch a process (same-per-device) n = 1 and n = 2 run
one program apart from what the count itself changes (DDP's buckets, FSDP's shards).

Gradient bytes per optimizer step = trainable parameters x 4 (DDP all-reduces fp32 gradients);
comm.predict models the all-reduce overlapped with backward (a FLOP share of the step:
metrics.per_weight_flops) with the peak measured bus bandwidth.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml

from ddptune import admission, checks, comm, config as config_lib, launch, metrics, provenance, report, rundir, scaling, system
from ddptune.config import ConfigError
from ddptune.scaling import MODES, SAME_PER_DEVICE

WARMUP, MEASURED = 3, 30  # default steps of the largest batch before and inside the measured window
WHAT_IF_N = (2, 4, 8)
COLUMNS = [  # (row key, header): scaling.csv uses the keys (seconds), scaling.md the headers (times with their unit)
    ("mode", "mode"), ("nproc", "n"), ("batch", "samples per step"), ("steps", "steps measured"),
    ("step_s", "step"), ("compute_s", "compute"), ("imbalance_s", "imbalance"),
    ("exposed_comm_s", "exposed comm"), ("rest_s", "rest"), ("tokens_per_s_per_gpu", "tokens/s/GPU"),
    ("samples_per_s", "samples/s"), ("speedup", "speedup"), ("efficiency", "efficiency"),
    ("efficiency_computed", "efficiency per computed token"),
    ("lost_compute", "lost: compute"), ("lost_imbalance", "lost: imbalance"), ("lost_comm", "lost: comm"),
    ("lost_rest", "lost: rest"), ("balance", "predicted max/mean share"), ("padding", "padding"),
    ("peak_mem_gib", "peak mem/GPU (GiB)"), ("final_loss", "final loss"), ("val_loss", "val loss"), ("note", "note"),
]
PRED_COLUMNS = [
    ("mode", "mode"), ("nproc", "n"), ("busbw_GBps", "busbw (GB/s)"), ("pred_comm_s", "pred. all-reduce"),
    ("pred_exposed_s", "pred. exposed"), ("meas_exposed_s", "meas. exposed"),
    ("pred_speedup", "pred. speedup"), ("meas_speedup", "meas. speedup"),
]
WHAT_IF_COLUMNS = [("gradients", "gradients"), ("link", "link"), ("nproc", "n"), ("comm_s", "comm"),
                   ("exposed_comm_s", "exposed"), ("step_s", "step"), ("speedup", "speedup"),
                   ("efficiency", "efficiency")]


def main(args) -> int:
    counts, modes = scaling.parse_counts(args.nproc), MODES[args.mode]
    cfg = config_lib.load(args.config, list(args.overrides))
    out = Path(args.out) if args.out else default_out(cfg.output_dir)
    warmup = WARMUP if args.warmup is None else args.warmup
    measured = MEASURED if args.steps is None else args.steps
    sizes = scaling.parse_sizes(args.bandwidth_sizes)
    cuda = torch.cuda.is_available()
    runs, windows = plan_runs(args=args, cfg=cfg, out=out, counts=counts, modes=modes, warmup=warmup, measured=measured, cuda=cuda)
    print("\n".join(plan_lines(cfg, args.overrides, runs, modes)), flush=True)
    bandwidth = measure_bandwidth(max(counts), sizes, cuda)
    # as many threads per process at every count, those of the largest count, so that n = 1 is not
    # measured with threads that n = N could not have
    child_env = dict(os.environ, OMP_NUM_THREADS=str(launch.default_threads(max(counts), cuda)))
    for run in runs.values():
        child = ["ddptune", "train", args.config, *args.overrides, *run["overrides"]]
        run["command"] = shlex.join(child)
        print(f"ddptune scale: {run['nproc']} process(es), {run['steps']} steps: {shlex.join(child[1:])}", flush=True)
        before = system.cpu_times()
        with launch.standby(preload=launch.TRAIN_MODULES) as waiting:  # its workers fork ready-imported
            rc = launch.torchrun(run["nproc"], child, env=child_env, standby=waiting)
        run["host_cpu"] = system.cpu_share(before, system.cpu_times())  # a busy or stolen host explains lost compute
        if rc != 0:
            print(f"ddptune scale: the run with {run['nproc']} process(es) failed (exit {rc}); see {run['dir']}", file=sys.stderr)
            return rc or 1
    rows = []
    for m in modes:
        base = None
        for n in counts:
            run = runs["n1" if n == 1 else f"{m}-n{n}"]
            row = scaling.account(dict(scaling.measure(run["dir"], run["plan"], windows[m], run["host_cpu"]), mode=m),
                                  base, cuda)
            base = base or row
            rows.append(row)
    write(args=args, cfg=cfg, out=out, rows=rows, runs=runs, windows=windows, bandwidth=bandwidth, modes=modes, warmup=warmup,
          measured=measured, threads=int(child_env["OMP_NUM_THREADS"]))
    return 0


def default_out(output_dir: str) -> Path:
    """Where scale writes without --out: `<output_dir>-scale`, or output_dir itself where its name says scale already."""
    path = Path(output_dir)
    return path if path.name.endswith("scale") else path.with_name(f"{path.name}-scale")


def plan_lines(cfg, overrides: list[str], runs: dict, modes: list[str]) -> list[str]:
    """What scale is about to do: its runs, and what each does beyond its measured steps (ROUGE with
    eval.enabled, minutes at every count); the note train gives where data.val is still the config file's."""
    e = cfg.eval
    rows = f"the first {e.max_samples} data.val rows" if e.max_samples else "every data.val row"
    base = " and the base model's, zero-shot" if e.zero_shot and cfg.train.method != "full" else ""
    scored = (f"each run then generates for {rows} and scores ROUGE{base} (eval.enabled=true: outside the measured "
              "steps, in each run's wall time; eval.enabled=false skips it)") if e.enabled else "no ROUGE (eval.enabled=false)"
    lines = [f"ddptune scale: plan: {len(runs)} runs ({', '.join(str(r['nproc']) for r in runs.values())} process(es); "
             f"{' and '.join(modes)}); {scored}"]
    if note := config_lib.kept_validation(cfg, overrides):
        lines.append(f"ddptune: note: {note}")
    return lines


def plan_runs(args, cfg, out: Path, counts: list[int], modes: list[str], warmup: int, measured: int,
              cuda: bool) -> tuple[dict, dict]:
    """Every run's plan, folder and overrides, each validated before anything runs or any folder is made."""
    problems = checks.check_values(cfg) + rundir.folder_problems("--out", out)
    if out.is_dir() and any(out.iterdir()):
        problems.append(f"--out: {out} already holds files (choose another --out, or remove it)")
    if warmup < 0 or measured < 1:
        problems.append(f"--warmup {warmup} / --steps {measured}: need warm-up >= 0 and at least 1 measured step")
    if cuda and max(counts) > torch.cuda.device_count():
        problems.append(f"--nproc: {max(counts)} processes but only {torch.cuda.device_count()} GPUs (one process per GPU)")
    if problems or (problems := scaling.count_problems(counts, admission.input_problems(cfg, [])[1])):
        raise ConfigError(problems)  # (a count above the rows would otherwise be refused for its batch, not its count)
    plans = {(m, n): scaling.plan_for(cfg.train, m, n) for m in modes for n in counts}  # raises for a count that does not divide
    windows = {m: scaling.sample_window([plans[m, n].global_batch for n in counts], warmup, measured) for m in modes}
    runs = {}
    for (m, n), plan in plans.items():
        key = "n1" if n == 1 else f"{m}-n{n}"
        steps = max(windows[mm][1] // plan.global_batch for mm in modes) if n == 1 else windows[m][1] // plan.global_batch
        run = runs.setdefault(key, {"nproc": n, "dir": out / key, "plan": plan, "steps": 0})
        run["steps"] = max(run["steps"], steps)
    for run in runs.values():
        run["overrides"] = [f"train.max_steps={run['steps']}", *scaling.batch_overrides(run["plan"], cfg.train),
                            f"output_dir={as_yaml(run['dir'])}"]
        try:
            admission.validate(config_lib.load(args.config, [*args.overrides, *run["overrides"]]), run["nproc"])
        except ConfigError as e:
            problems += [f"--nproc {run['nproc']}: {p}" for p in e.problems]
    if problems:
        raise ConfigError(sorted(set(problems), key=problems.index))
    return runs, windows


def measure_bandwidth(nproc: int, sizes: list[int], cuda: bool) -> dict:
    """All-reduce bandwidth over the largest count (the cost model's busbw)."""
    bandwidth = {"nproc": nproc, "status": "single process: no all-reduce to measure"}
    if nproc >= 2 and not sizes:
        bandwidth["status"] = "not measured (--bandwidth-sizes none)"
    elif nproc >= 2:
        iters, bw_warmup = (20, 5) if cuda else (5, 2)
        try:
            result = comm.measure_bandwidth(nproc, sizes, iters=iters, warmup=bw_warmup)
            busbws = [r["busbw_GBps"] for r in result["rows"] if r["busbw_GBps"]]
            bandwidth.update(status="measured", backend=result["backend"], device=result["device"],
                             rows=result["rows"], peak_busbw_GBps=max(busbws) if busbws else None)
        except RuntimeError as exc:  # the runs still give measured times; predictions need busbw
            bandwidth["status"] = f"failed: {exc}"
    return bandwidth


def write(args, cfg, out: Path, rows: list[dict], runs: dict, windows: dict, bandwidth: dict, modes: list[str],
          warmup: int, measured: int, threads: int) -> None:
    """scaling.json, .csv, .md and .png and manifest.json, each written once and atomically; the table on the console."""
    topo = comm.topology()
    summary = json.loads((runs["n1"]["dir"] / "summary.json").read_text())
    predictions = communication(rows, summary, bandwidth, comm.interconnect(topo), modes[0])
    info = system.collect(bandwidth=False)
    command = ["ddptune", "scale", args.config, *args.overrides, "--nproc", args.nproc, "--mode", args.mode,
               "--steps", str(measured), "--warmup", str(warmup), "--out", str(out), "--bandwidth-sizes", args.bandwidth_sizes]
    manifest = {
        "command": shlex.join(command), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": provenance.commit(), "modes": modes,
        "config": args.config, "overrides": list(args.overrides), "seed": cfg.train.seed,
        "sample_window": {m: list(w) for m, w in windows.items()},
        "threads_per_process": threads,  # what every run's processes were given
        "evaluation": {"rouge": cfg.eval.enabled, "zero_shot": cfg.eval.enabled and cfg.eval.zero_shot,
                       "max_samples": cfg.eval.max_samples} if cfg.eval.enabled else None,
        "batch": [{"nproc": r["nproc"], **dataclasses.asdict(r["plan"]), "global_batch": r["plan"].global_batch,
                   "describe": r["plan"].describe()} for r in runs.values()],
        "runs": {k: {"nproc": r["nproc"], "steps": r["steps"], "dir": str(r["dir"]),
                     "command": r["command"]} for k, r in runs.items()},
        "devices": info["gpus"] or f"cpu ({info['cpu_count']} cores)", "interconnect": info["interconnect"],
        "versions": {"python": info["python"], "torch": info["torch"], "cuda": info["cuda"], "nccl": info["nccl"], **info["packages"]},
        "environment": {k: v for k, v in info.items() if k != "bandwidth"},
    }
    result = {"verdict": scaling.verdict(rows, modes), "modes": modes, "rows": rows, "bandwidth": bandwidth, "interconnect": comm.interconnect(topo),
              "topology": topo, "grad_bytes": predictions["grad_bytes"], "all_params": predictions["all_params"],
              "backward_fraction": predictions["backward_fraction"],
              "predictions": {k: predictions[k] for k in ("measured", "other_interconnects")}, "manifest": manifest}
    columns = COLUMNS + [(k, k) for k in ("rouge1", "rouge2", "rougeL", "rougeLsum") if k in rows[0]]
    table = markdown_table(rows, columns)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(out / "scaling.json", scaling.clean(result))
    report.write_csv(out / "scaling.csv", rows, columns)
    report.write_text(out / "scaling.md", markdown(table, bandwidth, result))
    report.plot_scaling(out / "scaling.png", {m: [r for r in rows if r["mode"] == m] for m in modes},
                        title=f"Data-parallel scaling ({predictions['method']}, {info['gpus'][0]['name'] if info['gpus'] else 'CPU'})",
                        gpus=bool(info["gpus"]))
    report.write_json(out / "manifest.json", scaling.clean(manifest))
    print("\n" + table + f"\nddptune scale: {result['verdict']}\nddptune scale: wrote {out}/scaling.{{json,csv,md,png}} "
          "and manifest.json", flush=True)


def communication(rows: list[dict], summary: dict, bandwidth: dict, link_label: str, mode: str) -> dict:
    """The cost model (comm.predict; comm.predict_fsdp for train.strategy=fsdp) beside each measured
    row, and what other links would give (DDP's all-reduce)."""
    method, ckpt = summary["method"], summary["gradient_checkpointing"]
    grad_bytes = comm.grad_bytes(summary["trainable_params"], 4)
    frac = backward_fraction(method, ckpt)
    if summary.get("strategy") == "fsdp":  # every weight travels too: all-gathered for forward and backward
        param_bytes = summary["total_params"] * (2 if summary.get("mixed_precision") == "bf16" else 4)
        model = lambda c, nbytes, n, bps: comm.predict_fsdp(c, param_bytes, nbytes, n, bps)  # noqa: E731
    else:
        bucket = (summary.get("speed") or {}).get("bucket_mb")  # the last bucket's all-reduce is never hidden
        last = int(bucket * comm.MiB) if bucket else comm.DDP_BUCKET_BYTES
        model = lambda c, nbytes, n, bps: comm.predict(c, frac * c, nbytes, n, bps, last_bucket_bytes=last)  # noqa: E731
    busbw = (bandwidth.get("peak_busbw_GBps") or 0) * 1e9
    measured = []
    for r in rows:
        if r["nproc"] > 1 and busbw <= 0:
            continue
        base = next(b for b in rows if b["mode"] == r["mode"] and b["nproc"] == 1)
        c = base["step_s"] * r["per_process"] / base["per_process"]  # the n = 1 step, scaled to this count's share
        pred = model(c, grad_bytes, r["nproc"], busbw if busbw > 0 else 1.0)
        r["predicted_speedup"] = pred["speedup"]
        measured.append({"mode": r["mode"], "nproc": r["nproc"], "busbw_GBps": busbw / 1e9 if r["nproc"] > 1 else None,
                         "pred_comm_s": pred["comm_s"], "pred_exposed_s": pred["exposed_comm_s"],
                         "meas_exposed_s": r["exposed_comm_s"], "pred_speedup": pred["speedup"],
                         "meas_speedup": r["speedup"]})
    links = other_links(bandwidth, link_label)
    all_params = summary["total_params"]
    step1 = rows[0]["step_s"]
    cases = [(f"{method} ({comm.human_size(grad_bytes)})", step1, frac, grad_bytes)]
    if method != "full":
        full_step = step1 * metrics.per_weight_flops("full", ckpt) / metrics.per_weight_flops(method, ckpt)
        cases.append((f"full ({comm.human_size(all_params * 4)})", full_step, backward_fraction("full", ckpt), all_params * 4))
    what_if = []
    for label, c1, f, nbytes in cases:
        case = []
        for n in WHAT_IF_N:  # per-process compute at n: as at n = 1 (same-per-device), or 1/n of it
            c = c1 if mode == SAME_PER_DEVICE else c1 / n
            case += [{"gradients": label, **p} for p in comm.predict_table(c, f * c, nbytes, (n,), links)]
        what_if += sorted(case, key=lambda p: (list(links).index(p["link"]), p["nproc"]))
    return {"grad_bytes": grad_bytes, "all_params": all_params, "backward_fraction": frac, "method": method,
            "measured": measured, "other_interconnects": what_if}


def backward_fraction(method: str, checkpointing: bool) -> float:
    """The share of a step that backward takes (bucket all-reduces can hide behind it)."""
    return 1 - 2 / metrics.per_weight_flops(method, checkpointing)


def other_links(bandwidth: dict, label: str) -> dict[str, float]:
    """PCIe preset; NVLink measured when GPUs were measured over it, else the preset."""
    pcie, nvlink = (next(k for k in comm.INTERCONNECTS if word in k) for word in ("PCIe", "NVLink"))
    links = {pcie: comm.INTERCONNECTS[pcie]}
    if bandwidth.get("backend") == "nccl" and bandwidth.get("peak_busbw_GBps"):
        links[f"this machine: {label}, measured ({bandwidth['peak_busbw_GBps']:.0f} GB/s busbw)"] = bandwidth["peak_busbw_GBps"] * 1e9
    if label != "NVLink" or len(links) == 1:
        links[nvlink] = comm.INTERCONNECTS[nvlink]
    return links


def as_yaml(path: Path) -> str:
    """A path as an override value: plain where YAML reads it back as the same text, else quoted."""
    text = str(path)
    try:
        plain = yaml.safe_load(text) == text
    except yaml.YAMLError:
        plain = False
    return text if plain else json.dumps(text)


TIMES = {"step_s", "compute_s", "imbalance_s", "exposed_comm_s", "rest_s", "pred_comm_s", "pred_exposed_s", "meas_exposed_s",
         "comm_s"}  # the tables' columns of seconds


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A table of scaling.md: times (TIMES, in seconds) in the unit that reads best (68.7 µs, 246 ms)."""
    return report.markdown_table(rows, columns, formats={k: report.seconds_text for k, _ in columns if k in TIMES})


def markdown(table: str, bandwidth: dict, result: dict) -> str:
    m = result["manifest"]
    window = "; ".join(f"{mode}: samples {a}-{b}" for mode, (a, b) in m["sample_window"].items())
    parts = [f"# ddptune scale: {m['config']}, {' and '.join(result['modes'])}\n", f"**Verdict:** {result['verdict']}\n",
             f"`{m['command']}`, {m['date']}. Every count trains on the same samples ({window} of the stream, after "
             f"{m['command'].split('--warmup ')[1].split()[0]} warm-up steps of the largest batch); figures are means over "
             "those steps. step = compute (mean process) + imbalance (slowest - mean) + exposed comm (the slowest process's "
             "wait for the all-reduce) + rest (optimizer, data, gaps). speedup = samples/s at n over samples/s at 1; "
             "efficiency = speedup / n; the `lost:` columns split 1 - efficiency into its parts (fractions of the step at n), "
             "each measured against n = 1's part for as many samples per process, and add up to it: a negative part is time "
             "n saved against n = 1, offsetting the others. A part below twice its standard error is left blank and named in "
             "the note, with its value where the `lost:` parts do not add up without it.\n",
             table]
    parts.append(f"## All-reduce bandwidth, {bandwidth['nproc']} processes ({bandwidth.get('backend', 'none')})\n")
    parts.append(f"Interconnect: {result['interconnect']}.\n")
    parts.append(comm.format_rows(bandwidth["rows"]) if bandwidth["status"] == "measured" else bandwidth["status"] + "\n")
    parts.append("## Predicted against measured communication\n")
    parts.append(f"Gradients all-reduced per optimizer step: {comm.human_size(result['grad_bytes'])} (trainable parameters "
                 f"x 4 bytes, fp32); backward = {result['backward_fraction']:.2f} of the step; busbw = the peak measured. "
                 "pred. speedup: the n = 1 step scaled to each count's share, plus the predicted exposed all-reduce.\n")
    parts.append(markdown_table(result["predictions"]["measured"], PRED_COLUMNS))
    parts.append("## Predicted scaling on other interconnects\n")
    parts.append("From the n = 1 step time; full fine-tuning assumes its step costs 6 (8 with checkpointing) FLOPs per "
                 "weight and token against LoRA's 4 (6), and all-reduces every parameter (x 4 bytes).\n")
    parts.append(markdown_table(result["predictions"]["other_interconnects"], WHAT_IF_COLUMNS))
    return "\n".join(parts)
