"""The built-in default run (configs/demo.yaml) timed whole, for one or more checkouts, in turn.

    python benchmarks/cpu_demo.py --out benchmarks/results/cpu_demo_DATE.json [--repeat 2] [TREE ...]

Each TREE (default: this checkout) runs `python -m ddptune train configs/demo.yaml` with its own
src/ on PYTHONPATH and this interpreter, so that two commits are compared on the same machine, the
same packages and the same data. The runs alternate between the trees (a, b, a, b) so that a
machine that slows down over time weighs on both alike. Recorded per run: the wall time of the
whole command (imports, load, training, evaluation, saving) and the run's own summary.json figures.
`--cache fresh` gives every run an empty DDPTUNE_CACHE (a first run on a new machine: the GGUF is
converted); `--cache warm` (the default) shares one cache across the runs, which the first fills.
`--threads both --beside 0,1`: each run with ddptune's own thread count and with every core's thread
(torch's default), on an idle machine and beside one other process spinning on a core.
`--variant NAME=OVERRIDES` (repeatable; OVERRIDES space-separated config overrides, empty: the demo as
shipped) runs each variant in turn, e.g. `--variant shipped= --variant gc=train.gradient_checkpointing=true`.
Every run records its process's peak resident memory (the kernel's, from wait4).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddptune import provenance

ROOT = Path(__file__).resolve().parents[1]
KEEP = ("load_time_s", "train_time_s", "eval_time_s", "wall_time_s", "median_step_time_s", "final_loss", "val_loss",
        "rouge", "steps", "tokens_per_s_per_gpu")


def run_once(tree: Path, out: Path, cache: Path, threads: str = "chosen", beside: int = 0,
             overrides: tuple[str, ...] = ()) -> dict:
    """One demo run; `threads`: "chosen" (ddptune's own choice) or "all" (OMP_NUM_THREADS set to every
    core, torch's default); `beside`: that many other processes each spinning on a core meanwhile."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), HF_HUB_OFFLINE="1", DDPTUNE_CACHE=str(cache))
    env.pop("OMP_NUM_THREADS", None)
    if threads == "all":
        env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(beside)]
    try:
        time.sleep(1.0 if beside else 0)
        started = time.perf_counter()
        with tempfile.TemporaryFile("w+") as log:
            child = subprocess.Popen([sys.executable, "-m", "ddptune", "train", "configs/demo.yaml", f"output_dir={out}",
                                      *overrides], cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            _, status, usage = os.wait4(child.pid, 0)
            child.returncode = os.waitstatus_to_exitcode(status)
            wall = time.perf_counter() - started
            log.seek(0)
            said = log.read()
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    if child.returncode != 0:
        raise SystemExit(f"{tree}: exit {child.returncode}\n{said[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    chosen = re.search(r"(\d+) CPU thread\(s\) each", said)
    return {"command_wall_s": round(wall, 2), "threads_said": int(chosen.group(1)) if chosen else None,
            "peak_rss_gib": round(usage.ru_maxrss / 2**20, 3), **{k: summary[k] for k in KEEP if k in summary}}


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="*", type=Path, default=[ROOT])
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cache", choices=["warm", "fresh"], default="warm")
    p.add_argument("--threads", default="chosen", help="chosen, all, or both (alternating): ddptune's thread count "
                   "or every core (OMP_NUM_THREADS set to them, torch's default)")
    p.add_argument("--beside", default="0", help="other processes spinning on a core during each run, e.g. 0,1 (each in turn)")
    p.add_argument("--commit", help="this checkout's commit, where the machine's copy does not carry its history")
    p.add_argument("--variant", action="append", default=[], help="NAME=OVERRIDES (space-separated), run in turn")
    args = p.parse_args(argv)
    runs = []
    ways = ["chosen", "all"] if args.threads == "both" else [args.threads]
    variants = [(v.partition("=")[0], tuple(v.partition("=")[2].split())) for v in args.variant] or [("shipped", ())]
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeat):
            for beside in map(int, args.beside.split(",")):
                for (name, overrides), threads in itertools.product(variants, ways):
                    for i, tree in enumerate(args.trees):
                        cache = Path(tmp) / (f"cache-{k}-{i}" if args.cache == "fresh" else "cache")
                        out = Path(tmp) / f"run-{k}-{i}-{beside}-{threads}-{name}"
                        row = {"tree": str(tree), "commit": provenance.commit(tree), "repeat": k, "cache": args.cache,
                               "threads": threads, "beside": beside, "variant": name, "overrides": list(overrides),
                               **run_once(tree.resolve(), out, cache, threads, beside, overrides)}
                        print(json.dumps(row), flush=True)
                        runs.append(row)
    result = {**provenance.record(args.commit, __file__, argv), "cpus": os.cpu_count(),
              "python": platform.python_version(), "runs": runs}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
