"""Start N processes through torch's own launcher (torchrun), one per device.

`ddptune train --nproc N` and friends re-run themselves under `torch.distributed.run --standalone`,
which picks a free rendezvous port on this host. Each child reads RANK, LOCAL_RANK and WORLD_SIZE
from the environment that torchrun sets; nothing here knows about models or data.
For several machines, call torchrun (or `accelerate launch`) yourself with --nnodes/--rdzv-endpoint.
"""
from __future__ import annotations

import os
import subprocess
import sys


def in_launched_process() -> bool:
    """True inside a process started by torchrun or accelerate launch."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def is_main_process() -> bool:
    """True in the process that talks to the user (rank 0, or no launcher)."""
    return os.environ.get("RANK", "0") == "0"


def torchrun(nproc: int, module_args: list[str], env: dict[str, str] | None = None) -> int:
    """Run `python -m <module_args...>` in `nproc` processes on this host; return the exit code.

    `module_args` starts with the module name, e.g. ["ddptune", "train", "cfg.yaml"].
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc_per_node={nproc}",
        "-m", *module_args,
    ]
    child_env = dict(os.environ if env is None else env)
    # One BLAS thread pool per process would oversubscribe the cores; torchrun sets 1 if unset.
    child_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(cmd, env=child_env)
