"""A LoRA step's forward and backward under Inductor's settings, without the rest of a run.

The path of ddptune's compiled decoder layers without CUDA graphs (`model.compile_layers`, combined
kernels as the decider turns them on), on a preset's shape with random bf16 weights (a QLoRA base
kept dequantized runs the same kernels), LoRA on every linear layer, bf16 autocast, one packed row of
synthetic samples (120-400 tokens each, the last 30 % of each trained). It times the forward and
backward of the whole model at each `--tokens` count: the wall time of `--repeat` back-to-back steps
(the median of 5 such timings), and from a profile of one step the kernels' own time and the largest kernels. The
optimizer, the data and the host's other work are left out; they are the same whatever Inductor does.

Each `--variant NAME=SETTINGS` runs in a process of its own with an empty compiler cache of its own,
so compile times compare and Inductor reads its environment afresh. SETTINGS is a comma-separated list:
`ENV_NAME=value` (an environment variable, such as TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1),
`inductor.<name>=true|false` (one of torch._inductor.config's switches, such as fallback_random),
`dropout=<p>` (LoRA's dropout; the config's 0.05 otherwise) and `combo=false`.

    python benchmarks/layer_kernels.py --preset llama-3.1-8b --tokens 2900 3324 3800 --json out.json \\
        --variant shipped= --variant coordinate=TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _on(value: str) -> bool:
    return value.lower() in ("1", "true", "on")


def settings(text: str) -> tuple[dict, dict]:
    """(environment, options) of a variant's SETTINGS."""
    env, options = {}, {"dropout": None, "combo": True, "inductor": {}}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key == "dropout":
            options["dropout"] = float(value)
        elif key == "combo":
            options["combo"] = _on(value)
        elif key.startswith("inductor."):
            options["inductor"][key.split(".", 1)[1]] = _on(value)
        elif key.isupper():
            env[key] = value
        else:
            raise SystemExit(f"--variant: unknown setting {key!r} (an UPPERCASE environment variable, inductor.<name>, dropout or combo)")
    return env, options


def packed_row(tokens: int, vocab: int, seed: int) -> dict:
    """One packed row of synthetic samples, `tokens` long, as ddptune's collate_packed makes it."""
    from ddptune import batches
    from ddptune.tokens import IGNORE

    rng, examples, left = random.Random(seed), [], tokens
    while left:
        n = min(left, rng.randint(120, 400))
        ids = [rng.randrange(vocab) for _ in range(n)]
        cut = n - max(1, int(0.3 * n))
        examples.append({"input_ids": ids, "labels": [IGNORE] * cut + ids[cut:]})
        left -= n
    return batches.collate_packed(examples)


def measure(preset: str, tokens: list[int], layers: int, dropout: float | None, combo: bool, repeat: int,
            inductor: dict) -> dict:
    """One variant, in this process."""
    import torch
    import torch._inductor.config
    from transformers import AutoModelForCausalLM

    from ddptune import config as C, model as M

    for name, value in inductor.items():
        if not hasattr(torch._inductor.config, name):
            raise SystemExit(f"inductor.{name}: torch {torch.__version__} has no such Inductor setting")
        setattr(torch._inductor.config, name, value)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a smoke test only
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cfg = M.preset_config(preset, "varlen")
    cfg.num_hidden_layers = layers or cfg.num_hidden_layers
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    lora = C.LoraConfig() if dropout is None else C.LoraConfig(dropout=dropout)
    model = M.add_adapters(model, "lora", lora, gradient_checkpointing=False)
    net = M.CausalLMLoss(model).to(device)
    M.compile_layers(model, combo=combo)
    rows = {n: {k: v.to(device) if torch.is_tensor(v) else v for k, v in packed_row(n, cfg.vocab_size, n).items()}
            for n in tokens}

    def step(row):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = net(**row, num_items=len(row["targets"]))
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    torch.manual_seed(1)
    start = time.perf_counter()
    first_loss = step(rows[tokens[0]]).item()
    out = {"first_step_s": round(time.perf_counter() - start, 2), "first_loss": first_loss, "tokens": {}}
    for n in tokens:  # every shape met once more before timing
        step(rows[n])
    sync()
    for n in tokens:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeat):
                step(rows[n])
            sync()
            times.append((time.perf_counter() - start) * 1e3 / repeat)
        out["tokens"][n] = {"step_ms": round(statistics.median(times), 3), "step_ms_all": [round(t, 3) for t in times]}
    n = tokens[len(tokens) // 2]
    kind = "CUDA" if device.type == "cuda" else "CPU"
    with torch.profiler.profile(activities=[getattr(torch.profiler.ProfilerActivity, kind)]) as prof:
        step(rows[n])
        sync()
    kernels = [e for e in prof.key_averages() if e.device_type == getattr(torch.autograd.DeviceType, kind)]
    total = sum(e.self_device_time_total for e in kernels) / 1e3
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]
    out["profiled"] = {"tokens": n, "kernel_ms": round(total, 3), "launches": sum(e.count for e in kernels),
                       "top": [{"kernel": e.key[:110], "ms": round(e.self_device_time_total / 1e3, 3),
                                "launches": e.count} for e in top]}
    out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None
    return out


def run_variant(name: str, text: str, args) -> dict:
    """A variant in a process of its own, with an empty compiler cache."""
    env, options = settings(text)
    with tempfile.TemporaryDirectory(prefix=f"layer-{name}-") as cache:
        child_env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton"), **env}
        cmd = [sys.executable, __file__, "--one", json.dumps({**options, "preset": args.preset, "tokens": args.tokens,
                                                              "layers": args.layers, "repeat": args.repeat})]
        start = time.perf_counter()
        done = subprocess.run(cmd, env=child_env, capture_output=True, text=True)
    result = {"settings": text, "wall_s": round(time.perf_counter() - start, 1), "rc": done.returncode}
    if done.returncode == 0:
        result.update(json.loads(done.stdout.strip().splitlines()[-1]))
    else:
        result["stderr_tail"] = done.stderr[-2000:]
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[3324])
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the preset's)")
    ap.add_argument("--repeat", type=int, default=10, help="steps in each of 5 timings")
    ap.add_argument("--variant", action="append", default=[], help="NAME=SETTINGS (see the docstring)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        o = json.loads(args.one)
        print(json.dumps(measure(o["preset"], o["tokens"], o["layers"], o["dropout"], o["combo"], o["repeat"], o["inductor"])))
        return 0
    results = {"preset": args.preset, "layers": args.layers, "repeat": args.repeat, "variants": {}}
    variants = [v.partition("=")[::2] for v in args.variant or ["shipped="]]
    for _, text in variants:
        settings(text)  # a bad setting stops before any run
    for name, text in variants:
        r = results["variants"][name] = run_variant(name, text, args)
        print(name, json.dumps({k: r.get(k) for k in ("rc", "wall_s", "first_step_s", "first_loss", "tokens", "peak_gib")}), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["rc"] == 0 for r in results["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
