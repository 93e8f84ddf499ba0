"""How much of a step's fixed part the base model's matrix multiplies own: one decoder layer's
GEMMs, as LoRA training runs them on a frozen base, timed alone at several token counts.

    python benchmarks/gemm_shapes.py --preset llama-3.1-8b --tokens 1843,1926,2304,3622,4608 --json out.json

`ddptune scale --alone` fits a step as fixed time + time per computed token, through n = 1 and one
process alone at 1/n of its samples. On 2 H200s (8B QLoRA, dequantized base, 4 graph lengths) the
line was 16.8 ms + 80.2 µs a token. It caps a fixed global batch's efficiency: half the
tokens, the same fixed time. If the GEMMs run less efficiently on fewer tokens, the same line
through their own times has an intercept too. This script measures it. The fixed part less that
intercept is everything else: host launches, the optimizer, the device waiting for the host.

Each token count M times, for every decoder layer:
- the forward's x @ W.T for q, k, v, o, gate, up and down;
- the backward's input gradients, dy @ W. The frozen base has no weight gradients.

Each is a bf16 matrix multiply timed with CUDA events, on random data. LoRA's own small GEMMs,
attention and the element-wise work are left out. Prints a line per M and the fit, and writes
them to --json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from ddptune.model import PRESETS  # noqa: E402


def layer_shapes(preset: dict) -> list[tuple[int, int]]:
    """(in, out) of each linear of one decoder layer."""
    h, i = preset["hidden_size"], preset["intermediate_size"]
    kv = h // preset["num_attention_heads"] * preset["num_key_value_heads"]
    return [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q k v o gate up down


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares line through (tokens, ms): (fixed ms, µs per token)."""
    slope, intercept = statistics.linear_regression(*zip(*points))
    return intercept, slope * 1000


def time_layer(shapes, m: int, device: torch.device, repeats: int) -> float:
    """Milliseconds for one layer's forward and input-gradient GEMMs at m tokens (median of repeats)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weights = [torch.randn(o, i, device=device, dtype=dtype) for i, o in shapes]
    inputs = [torch.randn(m, i, device=device, dtype=dtype) for i, _ in shapes]
    grads = [torch.randn(m, o, device=device, dtype=dtype) for _, o in shapes]

    def once():
        for w, x, g in zip(weights, inputs, grads):
            x @ w.t()  # forward
            g @ w      # backward: gradient of the input

    for _ in range(3):
        once()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            once()
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    p.add_argument("--tokens", default="1843,1926,2304,3622,4608",
                   help="token counts per forward (comma-separated; the defaults are the 8B runs' of 2026-11-30)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    tokens = sorted({int(t) for t in args.tokens.split(",")})
    if len(tokens) < 2:
        p.error("--tokens: give at least two counts to fit a line through")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset = PRESETS[args.preset]
    shapes, layers = layer_shapes(preset), preset["num_hidden_layers"]
    rows = []
    for m in tokens:
        ms = time_layer(shapes, m, device, args.repeats) * layers
        rows.append({"tokens": m, "gemm_ms": ms, "us_per_token": ms / m * 1000})
        print(f"{m:6d} tokens: {ms:8.2f} ms of GEMMs a step ({ms / m * 1000:.2f} µs a token)")
    fixed, per_token = fit([(r["tokens"], r["gemm_ms"]) for r in rows])
    print(f"fit: {fixed:.2f} ms fixed + {per_token:.2f} µs a token "
          f"(the GEMMs of {layers} layers' forward and input gradients, {args.preset}, {device})")
    result = {"preset": args.preset, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "layers": layers, "repeats": args.repeats, "rows": rows,
              "fit": {"fixed_ms": fixed, "per_token_us": per_token}}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
