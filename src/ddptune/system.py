"""What this machine is: versions, GPUs, interconnect, CPU time, and a quick all-reduce bandwidth figure."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from typing import Any

import torch

from ddptune import comm, memory

PACKAGES = ("transformers", "accelerate", "peft", "bitsandbytes", "rouge_score", "datasets")
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TORCH_DISTRIBUTED_DEBUG",
             "PYTORCH_CUDA_ALLOC_CONF")
QUICK_SIZES = [1 * comm.MiB, 64 * comm.MiB, 256 * comm.MiB]


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        # distribution names sometimes differ from import names (rouge_score -> rouge-score)
        try:
            return importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            return "not installed"


def _ram_gib() -> float | None:
    """Total RAM from /proc/meminfo (Linux); None where unreadable."""
    total = meminfo_gib("MemTotal")
    return None if total is None else round(total, 1)


def meminfo_gib(field: str) -> float | None:
    """A /proc/meminfo field in GiB (MemTotal, MemAvailable: what new work can take without swapping);
    None where unreadable (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024 / 2**30
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_gib(device: torch.device, processes_here: int) -> float | None:
    """The memory a run's process may use: the GPU's free memory (with the CUDA context the process
    already holds), or on a CPU its share of what the host has available (None where the host does not say)."""
    if device.type != "cuda":
        available = meminfo_gib("MemAvailable")
        return None if available is None else available / processes_here
    return torch.cuda.mem_get_info(device)[0] / memory.GIB + memory.CUDA_CONTEXT_GIB


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_times() -> dict[str, int] | None:
    """The host's CPU time since boot, all cores, in clock ticks (Linux's /proc/stat): `busy`,
    `steal` (time a virtual machine's cores waited while the hypervisor ran other guests) and
    `total`; None where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
    return {"busy": user + nice + system + irq + softirq, "steal": steal, "total": sum(fields)}


def cpu_share(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, float] | None:
    """The share of the host's CPU time between two `cpu_times()` readings that was busy and
    that was stolen by the hypervisor; None without both readings or without time between them."""
    if not before or not after or after["total"] <= before["total"]:
        return None
    total = after["total"] - before["total"]
    return {"busy": (after["busy"] - before["busy"]) / total, "steal": (after["steal"] - before["steal"]) / total}


def _gpus() -> list[dict[str, Any]]:
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_GiB": round(p.total_memory / 2**30, 1),
                     "compute_capability": f"{p.major}.{p.minor}"})
    return gpus


def collect(bandwidth: bool = True, nproc: int | None = None) -> dict[str, Any]:
    """Gather the environment report as a plain dict (runs the quick all-reduce if asked)."""
    cuda = torch.cuda.is_available()
    nccl = None
    if cuda:
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - best effort
            nccl = "unknown"
    topo = comm.topology()
    info: dict[str, Any] = {
        "ddptune": _version("ddptune"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "ram_GiB": _ram_gib(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": nccl,
        "gpus": _gpus() if cuda else [],
        "interconnect": comm.interconnect(topo),
        "topology": topo,
        "packages": {name: _version(name) for name in PACKAGES},
        "env_vars": {k: v for k, v in sorted(os.environ.items())
                     if k in ENV_NAMES or k.startswith(ENV_PREFIXES)},
    }
    n = nproc if nproc is not None else (torch.cuda.device_count() if cuda else 2)
    bw: dict[str, Any] = {"nproc": n, "status": "skipped (--no-bandwidth)"}
    if bandwidth:
        if n < 2:
            bw["status"] = "single device: no all-reduce to measure"
        elif cuda and n > torch.cuda.device_count():
            bw["status"] = f"skipped: {n} processes but only {torch.cuda.device_count()} GPUs"
        else:
            try:
                result = comm.measure_bandwidth(n, sizes=QUICK_SIZES, iters=5, warmup=2, quiet=True)
                busbws = [r["busbw_GBps"] for r in result["rows"] if r["busbw_GBps"] is not None]
                bw.update(status="measured", backend=result["backend"], rows=result["rows"],
                          peak_busbw_GBps=max(busbws) if busbws else None)
            except RuntimeError as exc:
                bw["status"] = f"failed: {exc}"
    info["bandwidth"] = bw
    return info
