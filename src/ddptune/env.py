"""`ddptune env`: describe this machine for a bug report (versions, GPUs, interconnect, bandwidth)."""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from ddptune import comm, report, system


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
    print(format_report(info), flush=True)
    if args.json:
        report.write_json(args.json, info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
