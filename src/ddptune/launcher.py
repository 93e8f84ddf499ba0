"""`python -m ddptune.launcher TORCHRUN_ARGS...`: torch's own launcher (`torch.distributed.run`,
what `torchrun` runs), without its tracebacks. When a worker fails, the worker has already told the
user why in one line; torchrun would add 30-40 lines of its own (ChildFailedError, SignalException)
around it. This exits with the first failed worker's exit code instead (2: bad input, 130/143:
stopped by SIGINT/SIGTERM after a checkpoint, 1: anything else), prints a worker's one line that
rank 0 has not printed (a process's own bad input, or every line on a node without rank 0), names
a worker that a signal killed, and keeps the elastic agent's warnings out of the console.
`dist.torchrun` starts it for `--nproc N`.
"""
from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str]) -> int:
    os.environ.setdefault("LOGLEVEL", "CRITICAL")  # the elastic agent's own logger (workers inherit it, harmlessly)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # "Sending process ... SIGTERM", "failed (exitcode: 2)"

    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        for line in untold(e.failures) + killed(rank, failure):
            print(line, file=sys.stderr)
        code = failure.exitcode
        return code if 0 < code < 256 else 128 - code if code < 0 else 1  # a worker killed by signal N: 128 + N
    except SignalException as e:  # torchrun itself was signalled (e.g. its parent died): workers got it too
        return 128 + int(e.sigval)
    return 0


def untold(failures: dict) -> list[str]:
    """The lines failed workers left in their error files (dist.tell_launcher) that rank 0 has not
    printed itself, each once: rank 0 prints its own; another rank's differs only when that process
    alone met it, and on another node than rank 0's every line is untold."""
    lines = {rank: f.message.get("message") if isinstance(f.message, dict) else None for rank, f in failures.items()}
    told = lines.get(0)
    return list(dict.fromkeys(line for rank, line in sorted(lines.items()) if line and line != told))


def killed(rank: int, failure) -> list[str]:
    """A line when the first worker to fail was killed by a signal (SIGKILL from the kernel's
    out-of-memory killer or a user, SIGSEGV from a crash): such a worker says nothing itself, and
    torchrun may stop the others before they notice that it is gone."""
    if failure.exitcode >= 0:
        return []
    return [f"ddptune: rank {rank} was killed by {failure.signal_name()} and the job stopped (the kernel's "
            "out-of-memory killer sends SIGKILL: see dmesg); continue from the newest checkpoint with --resume"]


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
