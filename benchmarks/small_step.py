"""What a small model's optimizer step costs on one GPU, and where the time goes.

    python benchmarks/small_step.py --tokenizer .tok/smollm2 --data .devdata/samsum_validation.json \
        --variants layers,eager,decoder --steps 40 --name h200_smollm2_step

Each variant trains SmolLM2-135M's shape (LoRA, random weights: the same compute as the real
ones) on 16 SAMSum samples a step through `torchrun --nproc_per_node 1` (DDP around one process,
as `ddptune scale` runs n = 1), profiles 5 steps, and reports the median step after 5 warm-up
steps, with the recompiles torch logged. Variants: layers = the shipped default (each decoder
layer compiled); graphs = compiled layers replayed as CUDA graphs (train.cuda_graphs); eager =
nothing compiled; decoder = the whole decoder stack compiled as one graph.
Writes benchmarks/results/<name>.json (and $OUT/<name>.json on the device machine).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 5


def child(args) -> None:
    """One variant, inside the launched process: ddptune's own setup → fit → finish."""
    from ddptune import config, train

    cfg = config.load(ROOT / "configs" / "demo.yaml", [
        "model.source=preset:smollm2-135m", f"model.tokenizer={args.tokenizer}", f"data.train={args.data}",
        "data.train_rows=0:700", "data.val=null", "eval.enabled=false", "train.effective_batch_size=16",
        "train.grad_accum=null", f"train.max_steps={args.steps}", "train.warmup_steps=2", "train.lr=1e-3",
        f"train.compile={'false' if args.variant in ('eager', 'decoder') else 'true'}",
        f"train.cuda_graphs={'true' if args.variant == 'graphs' else 'false'}",
        f"train.profile_steps={args.profile}", f"output_dir={args.out}"])
    r = train.setup(cfg)
    if args.variant == "decoder":
        r.loss_model.decoder.compile(dynamic=True)
    history, times = train.fit(r)
    train.finish(r, history, times)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profile", type=int, default=5)
    p.add_argument("--variants", default="layers,eager,decoder")
    p.add_argument("--name", default="h200_smollm2_step")
    p.add_argument("--work", default="/tmp/ddptune-small")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        child(args)
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result = {"name": args.name, "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
              "model": "preset:smollm2-135m (LoRA r=16, all linear layers)", "samples_per_step": 16,
              "warmup_steps_excluded": WARMUP, "variants": {}}
    for variant in args.variants.split(","):
        out = work / variant
        log = work / f"{variant}.log"
        env = dict(os.environ, TORCH_LOGS="recompiles,perf_hints", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", __file__,
               "--tokenizer", args.tokenizer, "--data", args.data, "--steps", str(args.steps), "--profile", str(args.profile),
               "--variant", variant, "--out", str(out)]
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
        text = log.read_text()
        if rc:
            print(text[-5000:])
            result["variants"][variant] = {"error": f"exit {rc}"}
            continue
        rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
        kept = rows[WARMUP:]
        result["variants"][variant] = {
            "median_step_s": statistics.median(r["step_time_s"] for r in kept),
            "median_compute_s": statistics.median(r["compute_s"] for r in kept),
            "median_optimizer_s": statistics.median(r["optimizer_s"] for r in kept),
            "tokens_per_step": statistics.fmean(r["tokens"] for r in kept),
            "mfu": statistics.fmean(r["mfu"] for r in kept) if "mfu" in kept[0] else None,
            "first_step_s": rows[0]["step_time_s"], "losses": [r["loss"] for r in rows],
            "recompiles": text.count("Recompiling function"),
            "cudagraph_skips": sorted({l.strip()[:300] for l in text.splitlines() if "skipping cudagraphs" in l})[:12],
            "recompile_reasons": [l.strip()[:300] for l in text.splitlines() if "triggered by the following guard" in l
                                  or l.strip().startswith("- ")][:12],
        }
        if (out / "profile.txt").exists():
            (work / f"{variant}_profile.txt").write_text((out / "profile.txt").read_text())
        print(variant, json.dumps({k: v for k, v in result["variants"][variant].items() if k != "losses"}), flush=True)
    path = ROOT / "benchmarks" / "results" / f"{args.name}.json"
    path.write_text(json.dumps(result, indent=2))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
