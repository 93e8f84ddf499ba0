"""Run a function in N real processes joined over gloo (a free port on localhost), in-process
style: no CLI, no torchrun. Each process gets the environment a launcher would give it (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), so `Accelerator()` inside forms the group itself.

The processes are forked from a server that imported ddptune, transformers and peft once (the
forkserver start method): a spawned process spent 6-7 s of a 2-core CI machine's CPU importing
them again, each time. The server imports only; it never runs a test, so every process starts from
the same untouched modules, and it gets the caller's environment as a spawned one would."""
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


# what the server imports before it forks any process: what every test's processes import anyway
PRELOAD = ["ddptune.train", "ddptune.evaluate", "ddptune.predict", "peft"]


def _worker(fn, rank: int, world: int, port: int, env: dict, args: tuple, results) -> None:
    import torch

    os.environ.clear()  # the caller's environment as it was at run(), not the server's from its start
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(threads(world))
    try:
        results.put((rank, None, fn(*args)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}", None))


def xdist_workers() -> int:
    """pytest-xdist's worker processes, each running tests at once (`make test` runs 2); 1 without it."""
    return max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def threads(nproc: int) -> int:
    """BLAS threads per process: this test worker's share of the cores (`xdist_workers`) shared out, or
    N processes fight over them (spinning OpenMP threads slowed 2-process steps here from 0.05 s to 4 s)."""
    return max(1, (os.cpu_count() or 1) // xdist_workers() // nproc)


def context():
    """The processes' start method: forked from the server (started at this process's first call,
    with PRELOAD imported); for tests that start processes of their own too."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start(fn, nproc: int, *args) -> tuple[list, object]:
    """fn(*args) started in `nproc` processes: the processes, and the queue on which each puts
    (rank, error or None, return value) when fn ends (for tests that signal or watch them)."""
    ctx = context()
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads(nproc)))  # as a launcher sets it
    procs = [ctx.Process(target=_worker, args=(fn, rank, nproc, port, env, args, results)) for rank in range(nproc)]
    for p in procs:
        p.start()
    return procs, results


def run(fn, nproc: int, *args, timeout: float = 600) -> list:
    """fn(*args) in `nproc` processes; its return values in rank order. Raises if any process failed."""
    procs, results = start(fn, nproc, *args)
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
