"""`ddptune env`: describe this machine for a bug report (versions, GPUs, the card's figures, interconnect, bandwidth)."""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from ddptune import card as card_lib, comm, report, system


def format_report(info: dict[str, Any]) -> str:
    """Markdown block to paste into a bug report."""
    gpus = info["gpus"]
    lines = [
        "## ddptune env", "",
        f"- ddptune: {info['ddptune']}",
        f"- Python: {info['python']}",
        f"- Platform: {info['platform']}",
        f"- CPUs: {info['cpu_count']} ({info.get('cpu', 'unknown')}), RAM: "
        + (f"{info['ram_GiB']} GiB" if info["ram_GiB"] is not None else "unknown"),
        f"- torch: {info['torch']}, CUDA: {info['cuda'] or 'none'}, cuDNN: {info['cudnn'] or 'none'}, "
        f"NCCL: {info['nccl'] or 'none'}",
        f"- GPUs: {len(gpus)}, interconnect: {info['interconnect']}",
    ]
    lines += [f"  - GPU {g['index']}: {g['name']}, {g['memory_GiB']} GiB, "
              f"compute capability {g['compute_capability']}" for g in gpus]
    if info.get("card"):  # what the speed decider times GPU 0's steps by (card.py)
        c = info["card"]
        lines += [f"- card figures ({c['source']}): {c['matrix_tflops']:.0f} TFLOP/s bf16, a kernel {c['kernel_s'] * 1e6:.2f} µs, "
                  + (f"{c['dequant_bytes_s'] / 1e12:.2f} TB/s dequantizing 4-bit, " if c["dequant_bytes_s"] else "")
                  + f"{c['host_op_s'] * 1e6:.1f} µs to issue an op"
                  + (f", {c['host_4bit_s'] * 1e6:.1f} µs a 4-bit matmul call" if c["host_4bit_s"] else "")
                  + "; against the reference " + ", ".join(f"{k} x{v:.2f}" for k, v in c["factors"].items())]
    lines += ["- packages: " + ", ".join(f"{k} {v}" for k, v in info["packages"].items())]
    env_vars = info["env_vars"]
    lines += ["- env: " + (", ".join(f"{k}={v}" for k, v in env_vars.items()) or "(none set)")]
    lines += ["", "### Topology (nvidia-smi topo -m)", "", "```", info["topology"], "```", ""]
    bw = info["bandwidth"]
    lines.append(f"### All-reduce bandwidth ({bw['nproc']} process{'es' if bw['nproc'] != 1 else ''})")
    lines.append("")
    if bw["status"] == "measured":
        lines.append(comm.format_rows(bw["rows"]).rstrip())
        peak = bw["peak_busbw_GBps"]
        lines += ["", f"peak busbw: {peak:.3g} GB/s ({bw['backend']})" if peak is not None
                  else "peak busbw: n/a"]
    else:
        lines.append(bw["status"])
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """`ddptune env [--no-bandwidth] [--nproc N] [--json PATH]`; prints the report, returns 0."""
    p = argparse.ArgumentParser(prog="ddptune env", description=__doc__)
    p.add_argument("--bandwidth", action=argparse.BooleanOptionalAction, default=True,
                   help="measure all-reduce bandwidth across --nproc processes (default: on)")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes for the bandwidth test (default: CUDA devices, or 2 on CPU)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON here")
    args = p.parse_args(argv)
    info = system.collect(bandwidth=args.bandwidth, nproc=args.nproc)
    if info["gpus"]:
        import torch

        measured = card_lib.of(torch.device("cuda", 0))
        info["card"] = {**dataclasses.asdict(measured), "factors": measured.factors()}
    print(format_report(info), flush=True)
    if args.json:
        report.write_json(args.json, info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
