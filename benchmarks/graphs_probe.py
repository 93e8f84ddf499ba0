"""Why do CUDA graphs over the compiled layers give NaN gradients under DDP? (issue 11, part 3)

On torch 2.11 / H200, decoder layers compiled with mode="reduce-overhead" at one static packed shape
replayed correctly without DDP (the tiny preset: 6 ms a step against 11-13 ms compiled without
graphs), but under DDP the gradient norm turned NaN at step 3-4 (BENCHMARKS.md, "CUDA graphs over
the compiled layers"). This probe trains one LoRA model per variant, the same seeded batches each,
and prints, per variant, the step where the gradient norm first stops being finite (or "finite"),
how far its gradient norms drift from the plain compiled run's, and its median step time:

    torchrun --nproc_per_node 1 benchmarks/graphs_probe.py --preset smollm2-135m --out probe.json
    torchrun --nproc_per_node 2 benchmarks/graphs_probe.py --preset smollm2-135m --out probe.json

Variants (comma-separated in --variants):
  compiled        layers compiled as ddptune compiles them today (no graphs): the reference
  graphs          + mode="reduce-overhead", DDP with gradient_as_bucket_view=True (as on main)
  graphs-nobv     gradients not views of DDP's buckets (DDP rebuilds its buckets after step 1)
  graphs-keep     gradients allocated once and zeroed in place (never None, so autograd never
                  adopts a graph-owned output as .grad)
  graphs-nodrop   LoRA dropout 0 (random numbers inside a replayed graph)
  graphs-nomark   no torch.compiler.cudagraph_mark_step_begin() at the start of each step
  graphs-noddp    no DDP wrapper at all (1 process only)
  compiled-empty, graphs-empty
                  the boundaries padded with empty samples (cu_seq_lens repeated up to a multiple of
                  64), as the branch wip/cuda-graphs padded them to keep one shape: is it the kernel?
  graphs-decoder  the whole decoder stack compiled as one graph (not layer by layer) and replayed:
                  a handful of replays a step instead of one per layer and direction, for steps whose
                  time is the host's (small models; 2 processes side by side). Its first step is the
                  compile: see first_step_s.
(Found with this probe and call 2 of 2026-11-30's fourth session: none of these caused the NaN; an
over-long pad sample did. See BENCHMARKS.md, "CUDA graphs under DDP, fixed".)
On CPU every variant runs without graphs (inductor skips them for CPU tensors): a smoke test.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel

from ddptune import config as config_lib, data, model as model_lib

VARIANTS = ("compiled", "graphs", "graphs-nobv", "graphs-keep", "graphs-nodrop", "graphs-nomark", "graphs-noddp",
            "compiled-empty", "graphs-empty", "graphs-decoder")


def batch(step: int, rank: int, tokens: int, samples: int, vocab: int, device: torch.device, empty: bool) -> dict:
    """One packed row of `samples` equal samples, random ids: the same shape every step (static);
    `empty`: the boundaries repeated up to a multiple of 64 entries (empty samples)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    n = tokens // samples
    examples = [{"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist()} for _ in range(samples)]
    for e in examples:  # the last half of each sample is its "summary"
        e["labels"] = [data.IGNORE] * (n // 2) + e["input_ids"][n // 2:]
    b = data.collate_packed(examples)
    if empty:
        cu = b["cu_seq_lens_q"]
        b["cu_seq_lens_q"] = b["cu_seq_lens_k"] = torch.cat([cu, cu[-1:].expand(-len(cu) % 64)])
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in b.items()}


def run_variant(name: str, args, rank: int, world: int, device: torch.device) -> list[dict]:
    torch._dynamo.reset()
    cuda = device.type == "cuda"
    graphs = name.startswith("graphs")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = model_lib.build_preset(args.preset, 0, dtype, device, "varlen" if cuda else "sdpa")
    lora = config_lib.LoraConfig(r=16, alpha=32, dropout=0.0 if name == "graphs-nodrop" else args.dropout)
    model = model_lib.add_adapters(model, "lora", lora, gradient_checkpointing=False)
    decoder = model.get_base_model().get_decoder()
    if name == "graphs-decoder":
        decoder.compile(dynamic=False, mode="reduce-overhead")
    else:
        for layer in decoder.layers:
            layer.compile(dynamic=False, mode="reduce-overhead" if graphs else None)
    net = model_lib.CausalLMLoss(model).to(device)
    if name != "graphs-noddp":
        net = DistributedDataParallel(net, device_ids=[device.index] if cuda else None, broadcast_buffers=False,
                                      gradient_as_bucket_view=name != "graphs-nobv")
    params = [p for p in net.parameters() if p.requires_grad]
    if name == "graphs-keep":
        for p in params:
            p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=args.lr, fused=cuda)
    vocab = model.get_base_model().config.vocab_size
    rows = []
    for step in range(1, args.steps + 1):
        b = batch(step, rank, args.tokens, args.samples, vocab, device, name.endswith("-empty"))
        num_items = torch.tensor(float(len(b["targets"]) * world), device=device)
        if graphs and name != "graphs-nomark":
            torch.compiler.cudagraph_mark_step_begin()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = net(num_items=num_items, **b)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=name != "graphs-keep")
        if cuda:
            torch.cuda.synchronize()
        rows.append({"variant": name, "step": step, "loss": float(loss.detach()) * world, "grad_norm": float(norm),
                     "step_s": time.perf_counter() - t0})
    del net, opt, model
    if cuda:
        torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict], reference: list[dict] | None) -> dict:
    bad = next((r["step"] for r in rows if not math.isfinite(r["grad_norm"]) or not math.isfinite(r["loss"])), None)
    drift = None
    if reference and bad is None:
        drift = max(abs(a["grad_norm"] - b["grad_norm"]) / max(abs(b["grad_norm"]), 1e-12) for a, b in zip(rows, reference))
    times = [r["step_s"] for r in rows[3:]] or [r["step_s"] for r in rows]
    return {"variant": rows[0]["variant"], "first_nonfinite_step": bad, "max_rel_grad_norm_drift": drift,
            "median_step_ms": 1000 * statistics.median(times), "first_step_s": rows[0]["step_s"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tokens", type=int, default=3072, help="tokens in each process's packed row")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    torch_dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model_lib.register_attention()
    results, reference = [], None
    for name in args.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"--variants: unknown {name!r} (known: {', '.join(VARIANTS)})")
        if name == "graphs-noddp" and world > 1:
            continue
        try:
            rows = run_variant(name, args, rank, world, device)
        except Exception as e:  # noqa: BLE001 - a variant that crashes is a finding, not the end of the probe
            rows = [{"variant": name, "step": 0, "loss": math.nan, "grad_norm": math.nan, "step_s": math.nan,
                     "error": f"{type(e).__name__}: {str(e)[:300]}"}]
        reference = rows if name == "compiled" else reference
        s = summary(rows, reference)
        s["error"] = rows[0].get("error")
        results.append({"summary": s, "steps": rows})
        if rank == 0:
            print(json.dumps(s), flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "world_size": world, "tokens": args.tokens, "samples": args.samples,
                       "torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
                       "results": results}, f, indent=2)
    torch_dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
