"""The workers of `--nproc`, forked ready-imported from a server that imported their modules meanwhile.

torch's launcher starts each worker as a fork of a server process (multiprocessing's fork server) that
imported torch, transformers and ddptune while the launching process checked the run and prepared its
data. A worker then starts in milliseconds instead of importing all of that again, once per process
(12-13 s of the start-up at 8 processes on the 2-core CPU machine; 18-20 s on a 16-core GPU host whose
imports are slow: BENCHMARKS.md).

Imported first in the fork server (launch.Standby asks for it): the server dies with its launcher,
and the environment it had is kept. Run as a worker's script (torchrun's --run-path, this file): the
worker takes the environment the launching process sent, with torch's per-worker variables (RANK,
LOCAL_RANK, ...) over it, then runs `python -m MODULE ARGS...` in this process, exit code included.
A preloaded module reads the environment the launching process had when its Standby started; the
worker's own code reads the one sent.
"""
from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import traceback

from ddptune import launch

CUDA_SUCCESS, CUDA_ERROR_NO_DEVICE = 0, 100  # cuInit's results (cuda.h's CUresult) that a fork does not cause
server_env: dict[str, str] | None = None  # the fork server's environment, where this module was imported there
if os.environ.pop(launch.FORK_SERVER, None) == "1":
    launch.term_when_parent_dies()  # a dismissed or killed launcher leaves no server behind
    server_env = dict(os.environ)


def become(sent: dict[str, str]) -> None:
    """This forked worker's environment: `sent` (the launching process's), then what torch's launcher set
    for this worker after the fork (what differs from the server's); PYTHONPATH's folders, output
    written at once and OpenMP threads as a new interpreter would have them from `sent`."""
    if server_env is None:
        raise RuntimeError("ddptune.forked: this worker was not forked from a fork server that imported ddptune.forked")
    own = {k: v for k, v in os.environ.items() if server_env.get(k) != v}
    os.environ.clear()
    os.environ.update(sent)
    os.environ.update(own)
    paths = [p for p in sent.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = paths  # where a new interpreter puts PYTHONPATH: after the working directory
    for stream in (sys.stdout, sys.stderr):  # as torchrun's `python -u` workers write: at once
        stream.reconfigure(write_through=True)
    torch = sys.modules.get("torch")  # imported in the server: its threads were set from the server's environment
    if torch is not None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))


def cuda_started() -> bool:
    """Whether CUDA was started before this process was forked, so that it could not use a GPU here.
    torch's CUDA builds load CUDA's driver library when imported without starting it, and a fork of
    such a server uses the GPU; only a started driver (torch.cuda.is_available() does start it) is
    lost to a fork. So where the library is loaded, this process starts it: cuInit fails (with
    CUDA_ERROR_NOT_INITIALIZED) where the server had started it. It fails with CUDA_ERROR_NO_DEVICE
    where CUDA_VISIBLE_DEVICES hides every GPU (a CPU job on a GPU host), as it would in a new
    interpreter: the fork is kept. Any other failure: a new interpreter, the safe side. The GPU tests
    check all three."""
    try:
        with open("/proc/self/maps") as f:
            loaded = [line.split(None, 5)[-1].strip() for line in f if "/libcuda.so" in line]
    except OSError:
        return False
    if not loaded:
        return False
    import ctypes

    try:
        return ctypes.CDLL(loaded[0]).cuInit(0) not in (CUDA_SUCCESS, CUDA_ERROR_NO_DEVICE)
    except (OSError, AttributeError):
        return True  # loaded but not callable here: a new interpreter is the safe side


def fresh(argv: list[str]) -> int:
    """`python -u -m ARGV...` in a new interpreter under this worker, with this worker's environment;
    its exit code. Stops reach it directly (launch.torchrun passes them to what the workers started):
    this process only waits, and the new one ends with it."""
    def child() -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)
        launch.term_when_parent_dies()

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    code = subprocess.Popen([sys.executable, "-u", "-m", *argv], preexec_fn=child).wait()
    return code if code >= 0 else 128 - code


def run(argv: list[str]) -> int:
    """`argv`: the sent environment (JSON), the module, its arguments. The module's exit code; an error
    that escapes it is printed as Python prints it, with exit code 1 (not handed to the launcher as a
    pickled traceback), and Ctrl-C's KeyboardInterrupt gives 130, as a new interpreter's would."""
    from ddptune import forked  # the server's copy (this file runs as __main__)

    forked.become(json.loads(argv[0]))
    if forked.cuda_started():  # a fork could not use the GPU: run the module in a new interpreter, as torchrun would
        return fresh(argv[1:])
    sys.argv = [argv[1], *argv[2:]]
    try:
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # as Python does with sys.exit("message")
        return 1
    except KeyboardInterrupt:  # (torch's process wrapper would turn it into exit code 0)
        traceback.print_exc()
        return 128 + signal.SIGINT
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    code = run(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)
