"""Whether a whole LoRA training step fits one CUDA graph under DDP, and what that buys a model
whose step is the host issuing kernels (SmolLM2-135M at a global batch of 16).

    torchrun --nproc_per_node N benchmarks/step_graph_probe.py --preset smollm2-135m \\
        --tokenizer .tok/smollm2 --data .devdata/samsum_validation.json --samples 16 --json out.json

`ddptune train` with train.cuda_graphs replays each compiled decoder layer as a graph of its own:
on an H200 the SmolLM2 shape still left the GPU idle most of each step, and 2 GPUs ran it no
faster than one. This probe takes the other end: the whole step (forward, backward with DDP's
all-reduce, gradient clipping, a fused AdamW) captured once and replayed, as PyTorch documents
for whole-network capture (DDP built on a side stream, 11 eager steps before the capture,
autocast without its cache, a capturable optimizer). It is a probe, not a training loop: every
step trains on the same batch, `--samples` SAMSum samples split evenly over the processes, packed
into one row each, padded to a multiple of 256 tokens; LoRA dropout is off so that eager and
replayed steps compute the same thing.

From one state (after the warm-up), it runs --steps eager steps, puts the state back, captures
the step and replays it --steps times. It prints and writes the milliseconds a step of each
(steps back to back, as training runs them), and both runs' losses, which must agree. On
CPU (gloo) only the eager steps run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from ddptune import data, model as model_lib, train  # noqa: E402
from ddptune.config import DataConfig, LoraConfig, ModelConfig  # noqa: E402

WARMUP = 11  # eager DDP steps before a capture (PyTorch's notes on whole-network capture with DDP)


def batch_of(args, rank: int, world: int, device: torch.device) -> tuple[dict, int]:
    """This process's packed row and every process's target count together (the loss's divisor)."""
    tokenizer = model_lib.load_tokenizer(ModelConfig(source=f"preset:{args.preset}", tokenizer=args.tokenizer))
    d = DataConfig(max_length=args.max_length)
    rows = data.tokenize(data.load_split(args.data, f"0:{args.samples}", d), tokenizer, d)
    share = len(rows) // world
    mine = rows[rank * share:(rank + 1) * share]
    batch = data.collate_packed(mine, pad_to=256, max_length=args.max_length)
    return train.to_device(batch, device), data.target_tokens(rows[:share * world])


def build(args, device: torch.device):
    """ddptune's loss around a LoRA'd preset (bf16 on CUDA), in DDP with one gradient bucket, built
    on a side stream; a fused, capturable AdamW on CUDA."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = model_lib.build_preset(args.preset, 0, dtype, device, "varlen")
    model = model_lib.add_adapters(base, "lora", LoraConfig(dropout=0.0), False)
    if args.compile and device.type == "cuda":
        model_lib.compile_layers(model)  # without reduce-overhead: the capture records their kernels
    loss_model = model_lib.CausalLMLoss(model).train()
    params = [p for p in loss_model.parameters() if p.requires_grad]
    side = torch.cuda.Stream() if device.type == "cuda" else None
    with on(side):
        ddp = DistributedDataParallel(loss_model, device_ids=[device.index] if side else None, bucket_cap_mb=1024)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda, capturable=cuda)
    return ddp, params, opt, side, dtype


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the presets' byte tokenizer)")
    p.add_argument("--data", required=True, help="SAMSum-style .json or .jsonl")
    p.add_argument("--samples", type=int, default=16, help="samples a step over all processes")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the decoder layers (CUDA only)")
    p.add_argument("--json")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # the watchdog's event queries would break a capture (PyTorch's notes on graphs with DDP)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    torch_dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        result = probe(args, rank, world, device)
    finally:
        torch_dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "losses"}))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def probe(args, rank: int, world: int, device: torch.device) -> dict:
    batch, num_items = batch_of(args, rank, world, device)
    ddp, params, opt, side, dtype = build(args, device)
    cuda = device.type == "cuda"

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=cuda, cache_enabled=False):
            loss = ddp(**batch, num_items=num_items)
        (loss * world).backward()  # DDP averages over processes: a sum, as in ddptune
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.detach()

    def timed(run_one, n: int) -> tuple[list[float], float]:
        """n steps back to back, as training runs them (the host queues a step while the device runs
        the one before): their losses, and milliseconds a step from the first launch to the last
        step's end."""
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses = [run_one().clone() for _ in range(n)]  # a replay overwrites its output: keep a copy
        if cuda:
            torch.cuda.synchronize()
        return torch.stack(losses).tolist(), (time.perf_counter() - t0) * 1000 / n

    def eager_one():
        opt.zero_grad(set_to_none=True)
        return step()

    with on(side):
        for _ in range(WARMUP):
            eager_one()
    if side:
        torch.cuda.current_stream().wait_stream(side)
    saved = snapshot(params, opt)
    eager_losses, eager_ms = timed(eager_one, args.steps)
    result = {"preset": args.preset, "processes": world, "samples_per_step": args.samples,
              "tokens_per_process": batch["input_ids"].numel(), "compiled": bool(args.compile and cuda),
              "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "eager_ms_per_step": eager_ms, "losses": {"eager": eager_losses}}
    if cuda:
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph, stream=side):  # the stream DDP was built and warmed up on
            static_loss = step()
        restore(saved)  # a capture records the step without running it: the replays start from the eager run's state
        graph_losses, graph_ms = timed(lambda: (graph.replay(), static_loss)[1], args.steps)
        result.update(graph_ms_per_step=graph_ms, losses={"eager": eager_losses, "graph": graph_losses},
                      largest_loss_difference=max(abs(a - b) for a, b in zip(eager_losses, graph_losses)))
    return result


def snapshot(params, opt) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, copy) of every trained weight and optimizer state: put back in place, since a
    captured graph keeps the addresses it recorded."""
    tensors = list(params) + [v for p in params for v in opt.state[p].values() if torch.is_tensor(v)]
    return [(t, t.detach().clone()) for t in tensors]


def restore(saved) -> None:
    with torch.no_grad():
        for t, copy in saved:
            t.copy_(copy)


def on(stream):
    """Work queued on `stream` (CUDA), or as it is (CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


if __name__ == "__main__":
    main()
