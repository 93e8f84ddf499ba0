"""The frozen base's GEMMs alone: the floor under a LoRA step's GPU time.

A LoRA or QLoRA step (base kept in bf16) multiplies every token by each frozen projection twice: the
forward (x @ W.T) and the input's gradient (dy @ W); the base's weights get no gradient. This times
those two bf16 GEMMs for every projection of a preset's decoder layer at a step's token count, alone
on the GPU (CUDA events, the median of `--repeat` timings of 20 calls each), and gives the layer's sum,
the model's (times its layers) and the rate they reach. Nothing else of a step (LoRA's own small
GEMMs, the output head, attention, the fused elementwise kernels, the host) is in it.

It also times the host side of each GEMM's call (the wall time the call takes to return, the GPU idle
before it): the first call at a shape never multiplied before, and a repeated call. A training step
whose packed rows take a new length meets every first call once a layer shape. `--blas cublaslt` asks
torch for cuBLASLt instead of its default library.

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


def host_s(fn) -> tuple[float, float]:
    """Host seconds of `fn`'s first call and the median of 10 later ones, the GPU idle before each."""
    import time

    import torch

    times = []
    for _ in range(11):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return times[0], statistics.median(times[1:])


def floor(preset: str, tokens: int, repeat: int) -> dict:
    import torch

    from ddptune import memory, model as model_lib

    shape = memory.shape_of(model_lib.preset_config(preset, "sdpa"))
    rows, layer_s, flops = [], 0.0, 0
    for name, size in memory.PROJECTIONS.items():
        d_in, d_out = size(shape)
        x, w, dy = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((tokens, d_in), (d_out, d_in), (tokens, d_out)))
        host = {"forward": host_s(lambda: x @ w.t()), "grad_input": host_s(lambda: dy @ w)}
        forward, grad_input = timed(lambda: x @ w.t(), repeat), timed(lambda: dy @ w, repeat)
        rows.append({"projection": name, "d_in": d_in, "d_out": d_out, "forward_ms": forward * 1e3,
                     "grad_input_ms": grad_input * 1e3,
                     **{f"{k}_host_{w}_ms": v[i] * 1e3 for k, v in host.items() for i, w in enumerate(("first", "repeat"))}})
        layer_s += forward + grad_input
        flops += 4 * tokens * d_in * d_out
    return {"tokens": tokens, "layer_ms": layer_s * 1e3, "layers": shape.layers, "model_ms": layer_s * shape.layers * 1e3,
            "tflops": flops / layer_s / 1e12, "projections": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--tokens", type=int, nargs="+", required=True, help="tokens a forward (a step's packed row)")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--blas", choices=["default", "cublas", "cublaslt"], default="default")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gemm_floor: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    result = {"preset": args.preset, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "blas": args.blas,
              "runs": [floor(args.preset, n, args.repeat) for n in args.tokens]}
    for r in result["runs"]:
        print(f"{r['tokens']} tokens: {r['layer_ms']:.3f} ms a layer, {r['model_ms']:.1f} ms for {r['layers']} layers, "
              f"{r['tflops']:.0f} TFLOP/s")
        for row in r["projections"]:
            print("  " + row["projection"], *(f"{k[:-3]} {v:.3f} ms" for k, v in row.items() if "_host_" in k))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
