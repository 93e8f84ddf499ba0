"""A trained QLoRA run exported to a bf16 GGUF file, timed, and read back by transformers' own GGUF loader.

    python benchmarks/export_gguf.py --config configs/samsum_qlora_llama31_8b.yaml --tokenizer TOKENIZER_DIR \
        --work DIR --out benchmarks/results/NAME.json --step train|export|read [--commit C] [key=value ...]

- train: `ddptune train CONFIG model.tokenizer=TOKENIZER_DIR data.train=demo data.val=null
  train.max_steps=2 output_dir=DIR/run` and the key=value overrides given (the preset's random weights
  in the real shape: the export handles every tensor as it would real ones);
- export: `ddptune export DIR/run DIR/gguf --format gguf --outtype bf16`: its wall time and the peak
  resident memory of its process (os.wait4's ru_maxrss), and the file's size;
- read: in a fresh process, `AutoModelForCausalLM.from_pretrained(DIR/gguf, gguf_file=..., dtype=bf16)`
  and the tokenizer from the same file: parameters read, one forward of a demo row (finite logits),
  the row's token ids against the run's tokenizer, wall time and peak resident memory.
One step a command, in that order (so that the peak memory of a step's process is its own: the
largest ru_maxrss of this process's children); each appends its record to --out, with the commit,
date, command and device.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from ddptune import provenance

ROOT = Path(__file__).resolve().parents[1]
READ = """
import json, math, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, name, tokenizer = sys.argv[1:4]
from importlib import resources
row = json.loads(resources.files("ddptune").joinpath("demo_data/demo.jsonl").read_text().splitlines()[0])["dialogue"]
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
ids = tok(row)["input_ids"]
with torch.no_grad():
    logits = model(torch.tensor([ids[:64]])).logits
print(json.dumps({"parameters": sum(p.numel() for p in model.parameters()), "finite": bool(torch.isfinite(logits).all()),
                  "ids_equal": ids == AutoTokenizer.from_pretrained(tokenizer)(row)["input_ids"], "row_tokens": len(ids)}))
"""


def run(cmd: list[str], env: dict) -> dict:
    """cmd in a child whose peak resident memory is read from its own rusage."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()  # reaps it: its rusage is read from the children's total below
    wall = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:5])}...: exit {proc.returncode}\n{err[-3000:]}")
    return {"wall_s": round(wall, 1), "stdout": out, "stderr_tail": err[-1200:]}


def peak_gib() -> float:
    """The largest peak resident memory of any child reaped so far (ru_maxrss is a maximum, in KiB)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2)


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--step", required=True, choices=["train", "export", "read"])
    p.add_argument("--commit")
    args, overrides = p.parse_known_args(argv)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")
    run_dir, gguf = args.work / "run", args.work / "gguf"
    record = {"step": args.step, **provenance.record(args.commit, __file__, argv), "host": platform.node(),
              "cores": len(os.sched_getaffinity(0))}
    if args.step == "train":
        cmd = [sys.executable, "-m", "ddptune", "train", args.config, f"model.tokenizer={args.tokenizer}", "data.train=demo",
               "data.val=null", "train.max_steps=2", f"output_dir={run_dir}", *overrides]
        record["train"] = {k: v for k, v in run(cmd, env).items() if k != "stdout"}
    if args.step == "export":
        cmd = [sys.executable, "-m", "ddptune", "export", str(run_dir), str(gguf), "--format", "gguf", "--outtype", "bf16"]
        done = run(cmd, env)
        files = sorted(gguf.glob("*.gguf"))
        record["export"] = {"wall_s": done["wall_s"], "peak_rss_gib": peak_gib(),
                            "file": files[0].name, "bytes": files[0].stat().st_size, "stderr_tail": done["stderr_tail"]}
    if args.step == "read":
        name = sorted(gguf.glob("*.gguf"))[0].name
        done = run([sys.executable, "-c", READ, str(gguf), name, args.tokenizer], env)
        record["read"] = {"wall_s": done["wall_s"], "peak_rss_gib": peak_gib(), **json.loads(done["stdout"].splitlines()[-1])}
    runs = json.loads(args.out.read_text()) if args.out.is_file() else []
    args.out.write_text(json.dumps([*runs, record], indent=1) + "\n")
    print(json.dumps(record, indent=1)[:3000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
