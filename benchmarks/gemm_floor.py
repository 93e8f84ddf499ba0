"""The frozen base's GEMMs alone: the floor under a LoRA step's GPU time.

A LoRA or QLoRA step (base kept in bf16) multiplies every token by each frozen projection twice: the
forward (x @ W.T) and the input's gradient (dy @ W); the base's weights get no gradient. This times
those two bf16 GEMMs for every projection of a preset's decoder layer at a step's token count, alone
on the GPU (CUDA events, the median of `--repeat` timings of 20 calls each), and gives the layer's sum,
the model's (times its layers) and the rate they reach. Nothing else of a step (LoRA's own small
GEMMs, the output head, attention, the fused elementwise kernels, the host) is in it.

    python benchmarks/gemm_floor.py --preset llama-3.1-8b --tokens 3324 3328 4096 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def timed(fn, repeat: int) -> float:
    """Median seconds of one call of `fn`, over `repeat` timings of 20 calls."""
    import torch

    for _ in range(5):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / 20)
    return statistics.median(times)


def floor(preset: str, tokens: int, repeat: int) -> dict:
    import torch

    from ddptune import memory, model as model_lib

    shape = memory.shape_of(model_lib.preset_config(preset, "sdpa"))
    rows, layer_s, flops = [], 0.0, 0
    for name, size in memory.PROJECTIONS.items():
        d_in, d_out = size(shape)
        x, w, dy = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((tokens, d_in), (d_out, d_in), (tokens, d_out)))
        forward, grad_input = timed(lambda: x @ w.t(), repeat), timed(lambda: dy @ w, repeat)
        rows.append({"projection": name, "d_in": d_in, "d_out": d_out, "forward_ms": forward * 1e3,
                     "grad_input_ms": grad_input * 1e3})
        layer_s += forward + grad_input
        flops += 4 * tokens * d_in * d_out
    return {"tokens": tokens, "layer_ms": layer_s * 1e3, "layers": shape.layers, "model_ms": layer_s * shape.layers * 1e3,
            "tflops": flops / layer_s / 1e12, "projections": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--tokens", type=int, nargs="+", required=True, help="tokens a forward (a step's packed row)")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gemm_floor: needs a CUDA GPU", file=sys.stderr)
        return 2
    result = {"preset": args.preset, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "runs": [floor(args.preset, n, args.repeat) for n in args.tokens]}
    for r in result["runs"]:
        print(f"{r['tokens']} tokens: {r['layer_ms']:.3f} ms a layer, {r['model_ms']:.1f} ms for {r['layers']} layers, "
              f"{r['tflops']:.0f} TFLOP/s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
