"""Run a function in N real processes joined over gloo (a free port on localhost), in-process
style: no CLI, no torchrun. Each process gets the environment a launcher would give it (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), so `Accelerator()` inside forms the group itself."""
from __future__ import annotations

import os
import queue
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank: int, world: int, port: int, args: tuple, results) -> None:
    import torch

    torch.set_num_threads(threads(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    try:
        results.put((rank, None, fn(*args)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}", None))


def threads(nproc: int) -> int:
    """BLAS threads per process: the cores shared out, or N processes fight over them (spinning
    OpenMP threads slowed 2-process steps here from 0.05 s to 4 s)."""
    return max(1, (os.cpu_count() or 1) // nproc)


def run(fn, nproc: int, *args, timeout: float = 600) -> list:
    """fn(*args) in `nproc` processes; its return values in rank order. Raises if any process failed."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, rank, nproc, port, args, results)) for rank in range(nproc)]
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads(nproc))  # read by the children's torch as they import it
    try:
        for p in procs:
            p.start()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    out, errors = {}, {}
    try:
        for _ in procs:
            rank, error, value = results.get(timeout=timeout)
            (errors if error else out)[rank] = error or value
    except queue.Empty:
        errors[-1] = f"timed out after {timeout}s"
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [out[r] for r in range(nproc)]
