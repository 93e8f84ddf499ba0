"""An all-reduce launched eagerly against the same all-reduce recorded in a CUDA graph and replayed
(as `train.cuda_graph_scope=step` records DDP's), at a few sizes, in ms.

    torchrun --nproc_per_node 2 benchmarks/graph_allreduce.py [--sizes 1,42,168] [--json out.json]

Sizes are MB of fp32 (168 MB: the 8B job's LoRA gradients). Each timing is the median over
--iters launches, each bracketed by CUDA events on the current stream after a barrier.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist


def timed(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,42,168")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json")
    a = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rows = []
    for mb in (float(s) for s in a.sizes.split(",")):
        x = torch.ones(int(mb * 2**20 // 4), device="cuda")
        for _ in range(3):
            dist.all_reduce(x)
        eager = timed(lambda: dist.all_reduce(x), a.iters)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm the communicator on the capturing stream, as PyTorch's notes ask
            for _ in range(3):
                dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dist.all_reduce(x)
        replay = timed(graph.replay, a.iters)
        gbps = lambda ms: mb * 2**20 / 1e6 / ms * 2 * (dist.get_world_size() - 1) / dist.get_world_size()  # bus GB/s
        rows.append({"mb": mb, "eager_ms": eager, "graph_ms": replay, "eager_busbw_GBps": gbps(eager),
                     "graph_busbw_GBps": gbps(replay)})
        del graph
    if dist.get_rank() == 0:
        for r in rows:
            print(f"{r['mb']:7.1f} MB  eager {r['eager_ms']:7.3f} ms ({r['eager_busbw_GBps']:6.1f} GB/s)  "
                  f"graph {r['graph_ms']:7.3f} ms ({r['graph_busbw_GBps']:6.1f} GB/s)")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"world_size": dist.get_world_size(), "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                           "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
