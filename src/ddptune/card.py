"""The card a run is on, in the figures the speed decider's time model scales by.

Its bf16 matrix rate, a small kernel's time, the 4-bit dequantization's bandwidth and the host's time to issue work.

The decider's constants (speed.py) hold on the reference card, `REFERENCE`: an H100 (80 GB HBM3,
torch 2.11), where the 8B step they estimate was measured. A run on any CUDA card measures the same
five figures once (about two seconds, by `measure` below) and scales each time constant by its figure
over the reference's (`Card.factors`); the matrix rate enters as measured. The figures are cached under
`$DDPTUNE_CACHE/cards/`, one file a card name, torch and CUDA version and host CPU. Where nothing can be
measured (`ddptune plan --gpu-memory` on a machine without that GPU) the reference's figures stand in.
"""
from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import dataclass

import torch

from ddptune import report, system
from ddptune.cache import cache_root

FORMAT = 1  # the cached file's layout; another number means measure again


@dataclass(frozen=True, kw_only=True)
class Card:
    name: str
    matrix_tflops: float          # bf16 GEMM of 8192^3 on random data, TFLOP/s
    kernel_s: float               # a small kernel, launch to launch on the GPU (a recorded graph of 1,000)
    dequant_bytes_s: float | None  # bitsandbytes' NF4 dequantization of a 4096x14336 weight, 2.5 bytes a weight (None: no bitsandbytes)
    host_op_s: float              # the host's time to issue one small eager kernel
    host_4bit_s: float | None     # the host's time of one bitsandbytes 4-bit matmul call (None: no bitsandbytes)
    source: str = "measured"      # measured (here, or read back from the cache), or reference

    def factors(self) -> dict[str, float]:
        """Each time constant's factor against REFERENCE: > 1 where this card takes longer."""
        ref = REFERENCE
        ratio = lambda mine, theirs: 1.0 if mine is None or theirs is None else mine / theirs  # noqa: E731
        return {"kernel": ratio(self.kernel_s, ref.kernel_s), "dequant": ratio(ref.dequant_bytes_s, self.dequant_bytes_s),
                "host": ratio(self.host_op_s, ref.host_op_s), "host_4bit": ratio(self.host_4bit_s, ref.host_4bit_s)}


# `measure` on an H100 80GB HBM3 (Xeon host, torch 2.11, CUDA 12), the median of three: 752-779 TFLOP/s,
# a kernel 0.99-1.00 µs, 1.21-1.23 TB/s dequantizing, 6.4-9.7 µs an eager op, 27-28 µs a 4-bit matmul call
REFERENCE = Card(name="NVIDIA H100 80GB HBM3", matrix_tflops=776.4, kernel_s=0.992e-6, dequant_bytes_s=1.216e12,
                 host_op_s=6.41e-6, host_4bit_s=27.6e-6, source="reference")


def cached_path(device: torch.device):
    key = "-".join([torch.cuda.get_device_name(device), f"torch{torch.__version__}", f"cuda{torch.version.cuda}",
                    system.cpu_model()])
    return cache_root() / "cards" / (re.sub(r"[^A-Za-z0-9.]+", "_", key)[:200] + ".json")


def of(device: torch.device) -> Card:
    """The card `device` is: its cached figures, else measured now and cached; REFERENCE off CUDA."""
    if device.type != "cuda":
        return REFERENCE
    path = cached_path(device)
    try:
        raw = json.loads(path.read_text())
        if raw.pop("format", None) == FORMAT:
            return Card(**raw)
    except (OSError, ValueError, TypeError):
        pass  # none yet, or damaged: measure again
    card = measure(device)
    try:
        report.write_json(path, {"format": FORMAT, **dataclasses.asdict(card)})
    except OSError:
        pass  # a read-only cache: measured again next time
    return card


def _gpu_s(device, fn, repeat: int) -> float:
    """Seconds one `fn()` takes on the GPU, the median of `repeat` timed with CUDA events after a warm-up."""
    fn(); torch.cuda.synchronize(device)  # noqa: E702
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); fn(); end.record(); end.synchronize()  # noqa: E702
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _host_s(device, fn, calls: int) -> float:
    """The host's seconds for one of `calls` back-to-back `fn()` (the GPU keeps up), the best of seven:
    a host's other work only ever adds to it (three runs of three gave 6.4, 6.4 and 9.7 µs an op)."""
    fn(); torch.cuda.synchronize(device)  # noqa: E702
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
        torch.cuda.synchronize(device)
    return best


def measure(device: torch.device) -> Card:
    """The five figures on `device` (CUDA), about two seconds; the memory they took goes back to the GPU
    (the run's free memory was read before, and its model is loaded after)."""
    try:
        return _measure(device)
    finally:
        torch.cuda.empty_cache()


def _measure(device: torch.device) -> Card:
    with torch.cuda.device(device):
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        matrix = 2 * 8192 ** 3 / _gpu_s(device, lambda: a @ b, 10) / 1e12
        del a, b
        x = torch.zeros(1024, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            x.add_(1.0)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(1000):
                x.add_(1.0)
        kernel = _gpu_s(device, graph.replay, 5) / 1000
        host_op = _host_s(device, lambda: x.add_(1.0), 2000)
        dequant, host_4bit = _four_bit(device)
    return Card(name=torch.cuda.get_device_name(device), matrix_tflops=matrix, kernel_s=kernel, dequant_bytes_s=dequant,
                host_op_s=host_op, host_4bit_s=host_4bit)


def _four_bit(device) -> tuple[float | None, float | None]:
    """(dequantization bytes a second, host seconds a 4-bit matmul call) through bitsandbytes, or Nones without it."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return None, None
    w = torch.randn(14336, 4096, device=device, dtype=torch.bfloat16)
    q, state = bnb.functional.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
    dequant = 2.5 * w.numel() / _gpu_s(device, lambda: bnb.functional.dequantize_4bit(q, state), 10)
    x = torch.randn(4, 4096, device=device, dtype=torch.bfloat16)
    host = _host_s(device, lambda: bnb.matmul_4bit(x, q.t(), quant_state=state), 100)
    return dequant, host
