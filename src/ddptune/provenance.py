"""Where a figure came from: the commit, the date, the exact command line and the device of a raw file.

The benchmark scripts (benchmarks/) write these into every raw file under benchmarks/results; the
command is written as typed from a source checkout's root. Every run's summary.json holds the version,
the commit (from a source checkout) and the device.
"""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # a source checkout's root (src/ddptune/..)


def commit(tree: Path = ROOT) -> str | None:
    """The tree's commit: its COMMIT file (a copy of an older src/ carried without its history), else git's
    short hash, ending in `-dirty` where tracked files differ from it; None where neither says."""
    if (tree / "COMMIT").is_file():
        return (tree / "COMMIT").read_text().strip()
    if not (tree / "src" / "ddptune").is_dir():  # an installed package: the git repository around it is another's
        return None
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        return None
    changed = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("-dirty" if changed else "")


def command(script: str | None = None, argv: list[str] | None = None) -> str:
    """The command line as typed from the repository root, `python benchmarks/x.py ...`, each word quoted where
    a shell needs it: `script` with `argv`, by default this process's own."""
    path = Path(script or sys.argv[0]).resolve()
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(script or sys.argv[0])
    return shlex.join(["python", name, *(sys.argv[1:] if argv is None else argv)])


def device() -> str:
    """The machine: the GPUs torch sees (count and name) or `cpu`, then the host's CPU model and the cores
    this process may use."""
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        accel = f"{gpus}x {torch.cuda.get_device_name(0)}" if gpus else "cpu"
    except ImportError:
        accel = "cpu"
    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{accel}; {model}, {len(os.sched_getaffinity(0))} cores"


def version() -> str | None:
    """The installed ddptune's version (its package metadata); None where it runs from a bare src/."""
    from importlib import metadata

    try:
        return metadata.version("ddptune")
    except metadata.PackageNotFoundError:
        return None


def record(commit_given: str | None = None, script: str | None = None, argv: list[str] | None = None) -> dict:
    """{"commit", "date", "command", "device"} for a raw file. `commit_given` replaces git's answer where the
    machine's copy of the checkout does not carry the history it was made from; `script` and `argv` as for
    `command`."""
    return {"commit": commit_given or commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": command(script, argv), "device": device()}
