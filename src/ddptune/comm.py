"""All-reduce bandwidth measurement, interconnect detection and the DDP communication cost model.

Measurement follows nccl-tests: for a buffer of S bytes all-reduced in t seconds over n ranks,
    algbw = S / t                  busbw = algbw * 2(n-1)/n
busbw is the per-GPU unidirectional link bandwidth a ring all-reduce achieves, independent of n.

Cost model (ring all-reduce, DDP):
    ring_allreduce_s(S, n, B) = 2(n-1)/n * S / B        (B = busbw in bytes/s; 0 when n == 1)
    comm_s      = ring_allreduce_s(grad_bytes, n, B)
    last_s      = ring_allreduce_s(min(grad_bytes, last_bucket_bytes), n, B)
    exposed_s   = last_s + max(0, comm_s - last_s - backward_s)   if overlap else comm_s
    step_s      = step_compute_s + exposed_s
    efficiency  = step_compute_s / step_s,   speedup = n * efficiency
DDP all-reduces gradient buckets (25 MiB by default) while backward is still running, so only
the part of the communication that outlasts backward is exposed; the last bucket is ready only
when backward ends, so its all-reduce is always exposed. (With last_bucket_bytes = 0 this is
max(0, comm_s - backward_s).) The model is optimistic: it assumes the first bucket is ready at
the start of backward and ignores per-call latency.

Run `python -m ddptune.comm --sizes 1MB,64MB --iters 20 --out bw.json` under torchrun.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddptune import dist as ddp_dist, launch, report

MiB = 2**20
DEFAULT_SIZES = [s * MiB for s in (1, 4, 16, 64, 256, 1024)]
DDP_BUCKET_BYTES = 25 * MiB  # torch DDP's default bucket_cap_mb
NO_GPU_TOPOLOGY = "no GPU: processes talk over gloo on this host (shared memory / loopback)"
# Nominal busbw presets (bytes/s). Pass a measured busbw (measure_bandwidth) where you have one.
INTERCONNECTS: dict[str, float] = {
    "PCIe (16 GB/s)": 16e9,  # PCIe 3.0 x16 per direction, nominal
    "NVLink H100/H200 (assumed ~360 GB/s busbw)": 360e9,  # typical NCCL busbw, 8x H100 NVLink4
}
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str | int) -> int:
    """Parse "512KB", "1MB", "1GB", "4MiB" or a byte count (binary units: 1 MB = 2**20)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise ValueError(f"cannot parse size {text!r} (expected e.g. 512KB, 1MB, 1GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def human_size(nbytes: int) -> str:
    """1048576 -> "1 MB" (binary units, as parse_size reads them)."""
    for unit in ("GB", "MB", "KB"):
        scale = _UNITS[unit[0]]
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def allreduce_bandwidth(sizes_bytes: Sequence[int], iters: int = 20, warmup: int = 5,
                        dtype: torch.dtype | None = None) -> list[dict[str, Any]]:
    """Time `dist.all_reduce` for each size inside an initialised process group.

    Device: this process's current CUDA device under NCCL, else CPU. dtype defaults to bf16 on CUDA, fp32 on CPU.
    Each time is the median over `iters` (barrier before each), then the max over ranks.
    """
    if not dist.is_initialized():
        raise RuntimeError("allreduce_bandwidth needs an initialised torch.distributed group")
    n = dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    for size in sizes_bytes:
        x = torch.zeros(max(1, size // elem), dtype=dtype, device=device)  # zeros: no overflow
        for _ in range(warmup):
            dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize(device)
        times = []
        for _ in range(iters):
            dist.barrier()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dist.all_reduce(x)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        nbytes, secs = x.numel() * elem, float(t.item())
        algbw = nbytes / secs / 1e9 if secs > 0 else None
        busbw = algbw * 2 * (n - 1) / n if (algbw is not None and n > 1) else None
        rows.append({"size_bytes": nbytes, "time_s": secs, "algbw_GBps": algbw, "busbw_GBps": busbw})
        del x
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `python -m ddptune.comm` (one process per device under torchrun)."""
    p = argparse.ArgumentParser(prog="python -m ddptune.comm", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=",".join(human_size(s).replace(" ", "") for s in DEFAULT_SIZES))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", help="write the results here as JSON (rank 0)")
    p.add_argument("--quiet", action="store_true", help="print no table")
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]

    accelerator = ddp_dist.setup("fp32")  # the process group (NCCL on GPUs, gloo on CPU), this process's device
    use_cuda = accelerator.device.type == "cuda"
    if not dist.is_initialized():
        raise SystemExit("python -m ddptune.comm: no process group to time (start it under torchrun with 2 or more processes)")
    try:
        rows = allreduce_bandwidth(sizes, iters=args.iters, warmup=args.warmup)
        if accelerator.is_main_process:
            result = {"world_size": accelerator.num_processes, "backend": dist.get_backend(),
                      "device": torch.cuda.get_device_name(accelerator.device) if use_cuda else "cpu",
                      "rows": rows}
            if args.out:
                report.write_json(args.out, result)
            if not args.quiet:
                title = f"all-reduce, {result['world_size']} x {result['device']} ({result['backend']})"
                print(format_rows(rows, title), flush=True)
    finally:
        accelerator.end_training()
    return 0


def format_rows(rows: Sequence[dict[str, Any]], title: str = "") -> str:
    """Markdown table of bandwidth rows with human-readable sizes and milliseconds."""
    table = [{"size": human_size(r["size_bytes"]), "time_ms": r["time_s"] * 1e3,
              "algbw": r["algbw_GBps"], "busbw": r["busbw_GBps"]} for r in rows]
    cols = [("size", "size"), ("time_ms", "time (ms)"), ("algbw", "algbw (GB/s)"),
            ("busbw", "busbw (GB/s)")]
    return (f"{title}\n\n" if title else "") + report.markdown_table(table, cols)


def measure_bandwidth(nproc: int, sizes: Sequence[int | str] = tuple(DEFAULT_SIZES), iters: int = 20,
                      warmup: int = 5, quiet: bool = False) -> dict[str, Any]:
    """Run the all-reduce benchmark in `nproc` fresh processes; return rank 0's result dict
    ({"world_size", "backend", "device", "rows"}). `quiet` stops rank 0 printing its table."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1])  # make `ddptune` importable when not installed
    if Path(src).name not in ("site-packages", "dist-packages"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="ddptune-comm-") as tmp:
        out = Path(tmp) / "bandwidth.json"
        args = ["ddptune.comm", "--sizes", ",".join(str(parse_size(s)) for s in sizes),
                "--iters", str(iters), "--warmup", str(warmup), "--out", str(out), *(["--quiet"] if quiet else [])]
        rc = launch.torchrun(nproc, args, env=env)
        if rc != 0 or not out.exists():
            raise RuntimeError(f"all-reduce benchmark over {nproc} processes failed (exit code {rc}, "
                               f"{'no' if not out.exists() else 'a'} result file); see its output above")
        return json.loads(out.read_text())


def topology() -> str:
    """`nvidia-smi topo -m` output, or a note saying why there is none. Never raises."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return NO_GPU_TOPOLOGY
    try:
        r = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            return f"nvidia-smi topo -m failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()}"
        return re.sub(r"\x1b\[[0-9;]*m", "", r.stdout).rstrip()
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not fail
        return f"nvidia-smi topo -m failed: {exc}"


def link(device, world: int) -> str:
    """How this machine's GPUs are linked (NVLink, PCIe), where several processes run on GPUs; else ""."""
    return interconnect(topology()) if device.type == "cuda" and world > 1 else ""


def interconnect(topo_text: str) -> str:
    """Short label for a `nvidia-smi topo -m` matrix: "NVLink", "PCIe", "single GPU",
    "CPU (gloo)" (for the no-GPU note) or "unknown"."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", topo_text)
    if text.strip().startswith("no GPU"):
        return "CPU (gloo)"
    rows = [line.split() for line in text.splitlines() if re.match(r"GPU\d+\s", line)]
    rows = [r for r in rows if len(r) < 2 or not re.fullmatch(r"GPU\d+", r[1])]  # not a header
    if len(rows) == 1:
        return "single GPU"
    entries = [e for r in rows for e in r[1:1 + len(rows)] if e != "X"]  # GPU columns come first
    if not entries:
        return "unknown"
    if any(re.fullmatch(r"NV\d+", e) for e in entries):
        return "NVLink"
    if all(e in {"PIX", "PXB", "PHB", "NODE", "SYS", "SOC"} for e in entries):
        return "PCIe"
    return "unknown"


def ring_allreduce_s(nbytes: float, n: int, link_Bps: float) -> float:
    """Seconds for a ring all-reduce of `nbytes` over `n` ranks at busbw `link_Bps` (bytes/s)."""
    if n < 1 or link_Bps <= 0:
        raise ValueError(f"need n >= 1 and a positive bandwidth (got n={n}, link_Bps={link_Bps})")
    return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / link_Bps


def grad_bytes(trainable_params: int, dtype_bytes: int) -> int:
    """Bytes of gradient DDP all-reduces per step: trainable parameters x bytes per element."""
    return trainable_params * dtype_bytes


def predict(step_compute_s: float, backward_s: float, grad_bytes: int, n: int, busbw_Bps: float,
            overlap: bool = True, last_bucket_bytes: int = DDP_BUCKET_BYTES) -> dict[str, float]:
    """Predicted step time and speedup for `n` data-parallel processes (formula: module doc).

    step_compute_s is the single-process step time (forward + backward + optimizer), of which
    backward_s is the backward pass that bucket all-reduces can hide behind.
    """
    comm = ring_allreduce_s(grad_bytes, n, busbw_Bps)
    if overlap:
        last = ring_allreduce_s(min(grad_bytes, last_bucket_bytes), n, busbw_Bps)
        exposed = last + max(0.0, comm - last - backward_s)
    else:
        exposed = comm
    step = step_compute_s + exposed
    efficiency = step_compute_s / step if step > 0 else 1.0
    return {"comm_s": comm, "exposed_comm_s": exposed, "step_s": step,
            "efficiency": efficiency, "speedup": n * efficiency}


def fsdp_traffic(param_bytes: int, grad_bytes: int, n: int, busbw_Bps: float, forwards: int = 1,
                 reshard_after_forward: bool = True) -> dict[str, float]:
    """FSDP's communication in one optimizer step over `n` processes (FSDP2, ring collectives).

    Every shard unit's parameters are all-gathered before its forward, and once more before its
    backward when the forward freed them again (reshard_after_forward, ddptune's setting): each
    process receives the (n-1)/n of `param_bytes` it does not hold. The gradients are then
    reduce-scattered once a step (no_sync defers it to the last backward): each process sends
    (n-1)/n of `grad_bytes`. With B the bus bandwidth in bytes/s:
        all_gather_s     = (n-1)/n * param_bytes / B                        (one gather of every unit)
        reduce_scatter_s = (n-1)/n * grad_bytes / B
        comm_s = forwards * (2 if reshard_after_forward else 1) * all_gather_s + reduce_scatter_s
    param_bytes counts every parameter, frozen ones too (the base weights are gathered for compute),
    in the dtype they travel in (bf16 under mixed precision, else fp32); grad_bytes the trainable
    ones in the reduce dtype (fp32). A ring all-reduce is one reduce-scatter plus one all-gather,
    so full fine-tuning in fp32 moves 1.5x the bytes of DDP's all-reduce (1x without resharding),
    while LoRA moves the whole frozen base every pass: far more than DDP's adapter gradients.
    """
    if n < 1 or busbw_Bps <= 0 or forwards < 1:
        raise ValueError(f"need n >= 1, forwards >= 1 and a positive bandwidth (got n={n}, forwards={forwards}, "
                         f"busbw_Bps={busbw_Bps})")
    share = (n - 1) / n
    gathers = forwards * (2 if reshard_after_forward else 1)
    all_gather = share * param_bytes / busbw_Bps
    reduce_scatter = share * grad_bytes / busbw_Bps
    return {"all_gather_s": all_gather, "all_gathers": gathers, "reduce_scatter_s": reduce_scatter,
            "comm_s": gathers * all_gather + reduce_scatter,
            "bytes_per_process": share * (gathers * param_bytes + grad_bytes)}


def predict_fsdp(step_compute_s: float, param_bytes: int, grad_bytes: int, n: int, busbw_Bps: float,
                 forwards: int = 1) -> dict[str, float]:
    """predict()'s figures for FSDP: traffic from fsdp_traffic; FSDP2 prefetches the next unit's
    all-gather while the current one computes, so only what outlasts the step's compute is exposed
    (optimistic: the first unit's gather and the last reduce-scatter, which nothing hides, and
    per-call latency are left out)."""
    t = fsdp_traffic(param_bytes, grad_bytes, n, busbw_Bps, forwards)
    exposed = max(0.0, t["comm_s"] - step_compute_s)
    step = step_compute_s + exposed
    efficiency = step_compute_s / step if step > 0 else 1.0
    return {"comm_s": t["comm_s"], "exposed_comm_s": exposed, "step_s": step, "efficiency": efficiency,
            "speedup": n * efficiency}


def predict_table(step_compute_s: float, backward_s: float, grad_bytes: int,
                  ns: Sequence[int] = (2, 4, 8), links: dict[str, float] | None = None,
                  overlap: bool = True) -> list[dict[str, Any]]:
    """One predict() row per (link, n); `links` maps a label to busbw in bytes/s."""
    rows = []
    for label, bps in (INTERCONNECTS if links is None else links).items():
        for n in ns:
            rows.append({"link": label, "busbw_GBps": bps / 1e9, "nproc": n,
                         **predict(step_compute_s, backward_s, grad_bytes, n, bps, overlap)})
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
