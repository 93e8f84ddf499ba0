"""Speed benchmark: the tutorial's recipe against ddptune on the same GPU, model shape, data and optimization.

One run does, in order:
  1. the GPU's bf16 matrix rate (the MFU denominator), measured on random data;
  2. the reference recipe (HF Trainer + accelerate launch + PEFT + bitsandbytes QLoRA, gradient
     checkpointing, dynamic padding: benchmarks/reference_recipe.py), unless --skip-reference; with
     --reference-best also the recipe with its own best switches (no checkpointing, cuDNN attention off);
  3. the ddptune runs named by --runs (RUNS below) and --run: the same job (same samples per optimizer
     step, learning rate, LoRA, 4-bit base, optimizer) as configs/samsum_qlora_llama31_8b.yaml ships it,
     the speed decider choosing how it runs (src/ddptune/speed.py); the same with gradient checkpointing
     forced on; bf16 LoRA (no quantization) for MFU. An override such as `env:DDPTUNE_SPEED=graphs=off`
     forces the decider's choices.
It writes benchmarks/results/<name>.json (--results: another folder; raw figures of every run) and prints the headline figures.
An 8B run of all three plus the reference takes over 10 minutes: split it with --runs if that is too long.

    python benchmarks/speed.py --name h200_llama31_8b_qlora_v2 --preset llama-3.1-8b \
        --tokenizer .tok/smollm2 --data .devdata/samsum_validation.json --steps 25 --warmup 5 --runs ddptune,ddptune_gc

--epoch times the tutorial's whole job end to end instead: its 14,732 SAMSum training dialogues in one
epoch are 921 steps of 16 samples, so every ddptune run trains train.max_steps=921 on the --rows given
(the 818 rows of the SAMSum validation file: the sample stream runs on through 18 passes over them,
14,736 samples), and `epoch` records each command's wall time, Python's start, loading and compiling
included. The recipe still runs --steps steps: its epoch is extrapolated, its measured command's wall
time plus its median step for each of the remaining steps, and recorded as an extrapolation. The 8B
job takes about 8 minutes on an H200 with the recipe at --steps 30:

    python benchmarks/speed.py --epoch --name h200_llama31_8b_qlora_epoch --preset llama-3.1-8b \
        --tokenizer .tok/smollm2 --data .devdata/samsum_validation.json --steps 30 --warmup 5 --runs "" --run shipped=

A run of --steps steps gets the speed decider's choices for that many steps (for 30, one recorded padded
length). `--run tutorial=env:DDPTUNE_SPEED=samples=14736` times --steps steps of the choices it makes for the
tutorial's epoch instead, as `ddptune scale` does for its windows. Several `env:` values for one variable
are joined with commas: `--run plain=env:DDPTUNE_SPEED=samples=14736,env:DDPTUNE_SPEED=graphs=off`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "samsum_qlora_llama31_8b.yaml"
TUTORIAL_SAMPLES = 14_732  # SAMSum's training dialogues: the tutorial trains one epoch of them
EPOCH_STEPS = 921          # that epoch in steps of 16 samples (4 a forward x 4 accumulated), the last one full


def sh(cmd: list[str], log: Path, env: dict | None = None) -> float:
    """Run a command, tee its output to `log`; return wall seconds. Raises on failure."""
    print("$", " ".join(cmd), *(f"({k}={v})" for k, v in (env or {}).items()), flush=True)
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ, **(env or {})))
    if proc.returncode:
        print(log.read_text()[-6000:])
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}")
    return time.perf_counter() - t


def matmul_tflops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


# ddptune's runs: the recipe's job as the config ships it (packing; the speed decider keeps gradient
# checkpointing off where the run fits without it), the same with gradient checkpointing forced on
# (the recipe's memory class), and bf16 LoRA without quantization (the MFU target), 64 samples per step.
RUNS = {
    "ddptune": ["train.gradient_checkpointing=auto", "train.packing=true"],
    "ddptune_gc": ["train.gradient_checkpointing=true", "train.packing=true"],
    "ddptune_lora_bf16": ["train.gradient_checkpointing=auto", "train.packing=true", "train.method=lora",
                          "train.grad_accum=16"],
}


def steps_of(args) -> int:
    """Steps of each ddptune run: the epoch's, --ddptune-steps, or the recipe's --steps."""
    return EPOCH_STEPS if args.epoch else args.ddptune_steps or args.steps


def ddptune_run(args, name: str, overrides: list[str], work: Path) -> dict:
    """One `ddptune train` of the shipped config on the benchmark's data; an override `env:NAME=VALUE`
    sets an environment variable for the run instead (DDPTUNE_SPEED forces speed choices); the values
    of several for one NAME are joined with commas (`env:DDPTUNE_SPEED=samples=14736,env:DDPTUNE_SPEED=graphs=off`)."""
    out = work / name
    env: dict[str, str] = {}
    for o in overrides:
        if o.startswith("env:"):
            key, value = o[4:].split("=", 1)
            env[key] = f"{env[key]},{value}" if key in env else value
    overrides = [o for o in overrides if not o.startswith("env:")]
    cmd = [sys.executable, "-m", "ddptune", "train", str(CONFIG), f"output_dir={out}",
           f"model.source=preset:{args.preset}", f"model.tokenizer={args.tokenizer}", f"data.train={args.data}",
           f"data.train_rows={args.rows}", "data.val=null", f"train.max_steps={steps_of(args)}",
           f"train.warmup_steps={args.lr_warmup}", f"train.method={args.method}", *args.override, *overrides, "--nproc", "1"]
    wall = sh(cmd, work / f"{name}.log", env)
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    measured = rows[args.warmup:]
    real = sum(r["tokens"] for r in measured)
    padded = sum(r["padded_tokens"] for r in measured)
    return {
        "tool": "ddptune", "overrides": overrides, "wall_s": wall,
        "median_step_time_s": statistics.median(r["step_time_s"] for r in measured),
        "median_host_s": statistics.median(r["host_s"] for r in measured),
        "real_tok_s_per_gpu": real / sum(r["step_time_s"] for r in measured),
        "padding_fraction": 1 - real / padded,
        "peak_mem_gib": summary["peak_mem_gib"], "mfu": summary["mfu"],
        "mfu_denominator_tflops": summary.get("mfu_denominator_tflops"), "speed": summary.get("speed"),
        "padded_lengths": summary.get("padded_lengths"), "wall_time_s": summary.get("wall_time_s"),
        "train_time_s": summary.get("train_time_s"), "steps": len(rows),
        "gradient_checkpointing": summary["gradient_checkpointing"], "compiled": summary.get("compiled"),
        "losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows],
        "step_times_s": [r["step_time_s"] for r in rows], "tokens": [r["tokens"] for r in rows],  # every step's
        "padded_tokens": [r["padded_tokens"] for r in rows], "host_s": [r["host_s"] for r in rows],
        "final_loss": rows[-1]["loss"], "load_time_s": summary["load_time_s"],
        "samples_per_step": summary["global_batch"],
    }


def epoch(result: dict, runs: list[str], references: list[str]) -> dict:
    """The tutorial's epoch end to end: each ddptune run's measured wall time (it trained every step),
    and each recipe run's extrapolated from its shorter run: its wall time plus its median step for
    each step it did not run."""
    out = {"steps": EPOCH_STEPS, "tutorial_samples": TUTORIAL_SAMPLES, "runs": {}}
    for name in runs:
        r = result[name]
        out["runs"][name] = {"wall_s": r["wall_s"], "extrapolated": False, "samples": EPOCH_STEPS * r["samples_per_step"],
                             "load_time_s": r["load_time_s"], "train_time_s": r["train_time_s"],
                             "median_step_time_s": r["median_step_time_s"]}
    for key in references:
        r = result[key]
        missing = EPOCH_STEPS - r["steps"]
        out["runs"][key] = {"wall_s": r["wall_s"] + missing * r["median_step_time_s"], "extrapolated": True,
                            "how": f"measured wall time of {r['steps']} steps + {missing} x the median step",
                            "measured_steps": r["steps"], "measured_wall_s": r["wall_s"],
                            "median_step_time_s": r["median_step_time_s"], "samples": EPOCH_STEPS * r["samples_per_step"]}
    if "reference" in out["runs"]:
        for name in runs:
            out["runs"][name]["against_reference"] = out["runs"]["reference"]["wall_s"] / out["runs"][name]["wall_s"]
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--name", required=True)
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--rows", default="0:818")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ddptune-steps", type=int, help="steps of each ddptune run, when not --steps: its median over more "
                   "steps than the recipe's (ddptune's are about 15x shorter)")
    p.add_argument("--warmup", type=int, default=5, help="optimizer steps left out of speed figures")
    p.add_argument("--lr-warmup", type=int, default=1)
    p.add_argument("--method", choices=["qlora", "lora"], default="qlora", help="lora: for a CPU smoke test")
    p.add_argument("--override", action="append", default=[], help="extra key=value for every ddptune run")
    p.add_argument("--skip-reference", action="store_true")
    p.add_argument("--reference-best", action="store_true", help="also the recipe without checkpointing, cuDNN attention off")
    p.add_argument("--runs", default="ddptune,ddptune_gc,ddptune_lora_bf16",
                   help=f"comma-separated ddptune runs, of: {', '.join(RUNS)}")
    p.add_argument("--run", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                   help="a run of its own: NAME=section.key=value,section.key=value (repeatable; after --runs)")
    p.add_argument("--epoch", action="store_true",
                   help=f"ddptune runs train the tutorial's epoch, {EPOCH_STEPS} steps, timed end to end; the recipe's is extrapolated")
    p.add_argument("--work", default="/tmp/ddptune-bench", help="the compiler and preset cache, and a new folder of this call's runs")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="the folder <name>.json goes to")
    args = p.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DDPTUNE_CACHE", str(Path(args.work) / "cache"))
    # this call's runs and logs in a folder of their own: a run's output_dir from an earlier call on the same
    # machine would be refused (it holds a run), and nothing here deletes one
    work = Path(tempfile.mkdtemp(prefix=f"{args.name}-", dir=args.work))

    from ddptune import model as model_lib

    result = {"name": args.name, "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
              "preset": args.preset, "steps": args.steps, "warmup_steps_excluded": args.warmup,
              "ddptune_steps": steps_of(args), "runs_folder": str(work)}
    result["matmul_tflops_bf16"] = matmul_tflops()  # the second MFU column's denominator (ddptune's is the datasheet's)
    import torch

    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    t = time.perf_counter()
    folder = model_lib.preset_folder(args.preset, 0)
    result["preset_save_s"] = time.perf_counter() - t

    variants = {"reference": []} if not args.skip_reference else {}
    if args.reference_best:  # the recipe with its own best switches: no checkpointing, cuDNN attention off
        variants["reference_best"] = ["--no-gradient-checkpointing", "--no-cudnn-attention"]
    for key, extra in variants.items():
        ref_json = work / f"{key}.json"
        wall = sh(["accelerate", "launch", "--num_processes", "1", "--mixed_precision", "bf16",
            str(ROOT / "benchmarks" / "reference_recipe.py"), "--model-dir", str(folder), "--tokenizer-dir", args.tokenizer,
            "--data", args.data, "--method", args.method, "--max-steps", str(args.steps), "--warmup-steps-excluded", str(args.warmup),
            "--out", str(ref_json), *extra], work / f"{key}.log")
        result[key] = dict(json.loads(ref_json.read_text()), wall_s=wall)
        if os.environ.get("OUT"):  # what is measured so far, should a later run not finish in time
            Path(os.environ["OUT"], f"{args.name}.json").write_text(json.dumps(result, indent=2))

    out = Path(args.results) / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    named = [(n, RUNS[n]) for n in args.runs.split(",") if n]
    named += [(spec.split("=", 1)[0], [o for o in spec.split("=", 1)[1].split(",") if o]) for spec in args.run]
    for name, overrides in named:
        result[name] = ddptune_run(args, name, overrides, work)
        if os.environ.get("OUT"):  # what is measured so far, should a later run not finish in time
            Path(os.environ["OUT"], out.name).write_text(json.dumps(result, indent=2))

    if args.epoch:
        result["epoch"] = epoch(result, [n for n, _ in named], list(variants))
    d = result.get("ddptune")
    if d:
        result.update({"ddptune_tok_s": d["real_tok_s_per_gpu"], "mfu": d["mfu"], "peak_mem_gib": d["peak_mem_gib"]})
    if "ddptune_lora_bf16" in result:
        result["mfu_lora_bf16"] = result["ddptune_lora_bf16"]["mfu"]
    if "reference" in result:
        r = result["reference"]
        result.update({"reference_tok_s": r["real_tok_s_per_gpu"], "reference_peak_mem_gib": r["peak_mem_gib"]})
        # each QLoRA run that was made, against the recipe (bf16 LoRA is a different job)
        for run, key in (("ddptune", "speedup"), ("ddptune_gc", "speedup_gc")):
            if run in result:
                result[key] = result[run]["real_tok_s_per_gpu"] / r["real_tok_s_per_gpu"]
    # every ddptune run's real tok/s against every recipe run of this call (bf16 LoRA is a different job)
    result["tok_s_against"] = {ref: {n: result[n]["real_tok_s_per_gpu"] / result[ref]["real_tok_s_per_gpu"] for n, _ in named}
                               for ref in variants}
    out.write_text(json.dumps(result, indent=2))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out.name).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=2))
    for name, run in result.get("epoch", {}).get("runs", {}).items():
        print(f"epoch of {EPOCH_STEPS} steps, {name}: {run['wall_s']:.1f} s{' (extrapolated)' if run['extrapolated'] else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
