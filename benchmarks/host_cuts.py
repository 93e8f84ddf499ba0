"""Does cutting the host's work shorten a step? `ddptune train` in this process, with host-side cuts.

A step whose host time (metrics.jsonl's host_s) equals its step time is either bound by the host, or
bound by the GPU with the host blocked on a full launch queue. Cutting the host's work tells them
apart where the cut is large enough to show: only a step bound by the host gets shorter (on the 8B
step these cuts were too small to; a profile tells it directly: a host blocked on the queue spends
that time inside launch calls, and gpu_gaps.py counts the GPU's waits for late launches). The cuts,
for this measurement only (ddptune ships neither):
- `asserts`: Inductor's size, alignment and scalar asserts off (checks in the compiled code's
  wrapper, before each call);
- `asserts_guards`: the same, and from the fourth step on, Dynamo evaluates only the guards that tell
  its cache entries apart (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`: unsafe if an input
  could need a new compile; here every shape the run meets compiled in its first steps);
- `base`: neither.

    for v in base asserts asserts_guards; do
      DDPTUNE_SPEED=samples=14736 python benchmarks/host_cuts.py $v train configs/samsum_qlora_llama31_8b.yaml \
        output_dir=runs/hc-$v model.source=preset:llama-3.1-8b model.tokenizer=.tok/smollm2 \
        data.train=.devdata/samsum_validation.json data.train_rows=0:818 data.val=null \
        train.max_steps=80 train.warmup_steps=1
    done
    python benchmarks/host_cuts.py --summary runs/hc-base runs/hc-asserts runs/hc-asserts_guards --json out.json
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
CUTS = ("base", "asserts", "asserts_guards")
WARMUP = 5  # steps left out of the medians


def apply(cut: str) -> None:
    import torch

    if cut not in CUTS:
        raise SystemExit(f"host_cuts: the first argument is one of {', '.join(CUTS)} (got {cut!r})")
    if cut != "base":
        import torch._inductor.config as inductor

        inductor.size_asserts = inductor.alignment_asserts = inductor.scalar_asserts = False
    if cut == "asserts_guards":
        from ddptune import train

        original, calls = train.train_step, [0]

        def train_step(r, step):
            calls[0] += 1
            if calls[0] == 4:  # after three steps every cache entry exists
                torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
            return original(r, step)

        train.train_step = train_step


def summary(folders: list[str]) -> dict:
    """Each run's median step and host time over its steps after the first WARMUP, and every step's."""
    out = {}
    for folder in folders:
        rows = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
        measured = rows[WARMUP:]
        out[Path(folder).name] = {
            "steps": len(rows), "measured": len(measured),
            "median_step_time_s": statistics.median(r["step_time_s"] for r in measured),
            "median_host_s": statistics.median(r["host_s"] for r in measured),
            "real_tok_s_per_gpu": sum(r["tokens"] for r in measured) / sum(r["step_time_s"] for r in measured),
            "final_loss": rows[-1]["loss"], "step_times_s": [r["step_time_s"] for r in rows],
            "host_s": [r["host_s"] for r in rows], "tokens": [r["tokens"] for r in rows]}
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--summary"]:
        folders, out = argv[1:], None
        if "--json" in folders:
            i = folders.index("--json")
            folders, out = folders[:i], folders[i + 1]
        result = summary(folders)
        for name, r in result.items():
            print(f"{name}: {r['median_step_time_s']:.4f} s a step, host {r['median_host_s']:.4f} s, "
                  f"{r['real_tok_s_per_gpu']:,.0f} tok/s, loss {r['final_loss']:.4f}")
        if out:
            Path(out).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    apply(argv[0])
    from ddptune.cli import main as ddptune

    return ddptune(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
