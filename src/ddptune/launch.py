"""Starting N processes: `--nproc N` re-runs a command through torch's own launcher, and passes signals on.

`torchrun(nproc, args)` runs torch's launcher (`torch.distributed.run`, what `torchrun` runs) in a
`Standby` that a run starts early, so that torch is imported meanwhile and the arguments come through
a pipe; its workers are forked from a fork server that imported what they need meanwhile too
(ddptune.forked, which runs `python -m ddptune ...` in each). It is torch's launcher without its tracebacks:
when a worker fails, the worker has already told the user why in one line; torchrun would add 30-40
lines of its own (ChildFailedError, SignalException) around it. `main` exits with the exit code of
the worker that failed first (`cause`) instead (2: bad input, 130/143: stopped by SIGINT/SIGTERM after a checkpoint,
1: anything else), prints a worker's one line that rank 0 has not printed (a process's own bad
input, or every line on a node without rank 0), names in one line a worker that a signal killed or
that exited without a word (and what its run saved) while the others' failed collectives go to the
run's RAW_LOG (they are said only where no worker died first: a hang), and keeps torch's own
warnings out of the console (a training run's go to its RAW_LOG too).

`stops_raise()`: while a command has no loop of its own that catches SIGINT and SIGTERM
(dist.ControlChannel), either signal raises `Stopped`, so that the process ends through its
`finally` blocks (its lock released) and says what it saved, instead of dying silently.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

VALIDATED = "DDPTUNE_VALIDATED"  # set by `torchrun` below: the parent process has validated the config
RUN = "DDPTUNE_RUN"  # set by `torchrun` for training: its output_dir, what a killed worker's line reports on
STARTED = "DDPTUNE_STARTED"  # set by `torchrun` for training: when the launching command began (time.time() seconds)
SPAWNED = "DDPTUNE_SPAWNED"  # set by `torchrun`: when it gave torch's launcher its command (time.time() seconds)
TRAIN_MODULES = ("ddptune.cli", "ddptune.train")  # what a training worker imports: its fork server imports them first
FORK_SERVER = "DDPTUNE_FORK_SERVER"  # set by `serve` for the fork server alone (ddptune.forked)
THREADS_WHY = "DDPTUNE_THREADS_WHY"  # set by `torchrun` where it chose OMP_NUM_THREADS: why, in words (none: the user set it)
FOLLOWS = "ddptune_follows"  # in a worker's error file (`tell_launcher`): its line tells of a failed collective
SAME_FAILURE_S = 5  # workers that failed this close together failed of one cause (torchrun SIGKILLs a hung one 30 s later)
RAW_LOG = "torch.log"  # in a training run's output_dir: torch's and gloo's own words when a process fails (`raw_log`)
WORKER_SCRIPT = os.path.join(os.path.dirname(__file__), "forked.py")  # each worker's: it takes the environment sent


class Stopped(BaseException):
    """SIGINT or SIGTERM reached this process outside the training loop (which catches them itself).
    A BaseException, as KeyboardInterrupt is: code that turns its errors into one line lets it pass."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


received: int | None = None  # the stop signal this process got inside stops_raise, once it got one


def _stop(signum, _frame) -> None:
    stop_now(signum)


def stop_now(signum: int) -> None:
    """End this process through its `finally` blocks, as stopped by `signum` (raises Stopped)."""
    global received
    received = signum
    raise Stopped(signum)


def heard_line(signum: int) -> str:
    """What a training run says the moment a stop signal reaches it: what happens next, and how to abort."""
    name = signal.Signals(signum).name
    again = "Ctrl-C again" if signum == signal.SIGINT else f"a second {name}"
    return (f"ddptune: {name}: stopping: training finishes the step under way and the next, saves a checkpoint and "
            f"stops (a stop at the last step lets the run finish); {again} aborts at once, without saving")


def raw_log(run_dir: str | os.PathLike, rank: int | None, text: str) -> Path | None:
    """Append `text` (torch's or gloo's own words: a failed collective's whole message, the launcher's
    warnings) to the run's RAW_LOG, which ddptune's one line then names; its path, or None where the
    run's folder cannot be written here (a node without it)."""
    path = Path(run_dir, RAW_LOG)
    who = "launcher" if rank is None else f"rank {rank}"
    try:
        with open(path, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {who}: {text.rstrip()}\n")
    except OSError:
        return None
    return path


@contextlib.contextmanager
def stops_raise():
    """SIGINT and SIGTERM raise Stopped inside this block (in the main thread; elsewhere, nothing
    changes). The training loop's own handlers take over while it runs and give these back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global received
    received = None
    old = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def in_launched_process() -> bool:
    """True inside a process started by torchrun or accelerate launch."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def is_main_process() -> bool:
    """True in the process that talks to the user (rank 0, or no launcher); needs no process group."""
    return os.environ.get("RANK", "0") == "0"


def validated_by_parent() -> bool:
    return os.environ.get(VALIDATED) == "1"


def tell_launcher(line: str, follows: bool = False) -> None:
    """Leave `line`, why this worker fails, where torchrun looks for it: the error file it names in
    TORCHELASTIC_ERROR_FILE (torchrun's own `@record` writes a traceback there). `accelerate launch`
    runs torchrun's agent too. Its closing ChildFailedError report then shows `line` as the failed
    rank's "traceback" rather than a pointer to its docs, so the reason is also at the end of the
    output. `follows`: the line tells of a failed collective, which follows from another process's
    failure (`follows`, `cause`). A no-op without such a launcher."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # the layout torchrun's @record writes, with the line where it puts the traceback
    info = {"py_callstack": line, "timestamp": str(int(time.time()))} | ({FOLLOWS: "1"} if follows else {})
    data = {"message": {"message": line, "extraInfo": info}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the line is on stderr already


def say_stalled(line: str) -> None:
    """This process's line for a collective that failed (dist.Stalled: another process hung or died).
    Under ddptune's own launcher it is left to the launcher (`tell_launcher`), which says it unless a
    worker died first: then the launcher's one line names that worker, and this line goes to the RAW_LOG.
    Elsewhere, or where torch's launcher may restart the workers (it reports only their last round),
    it is printed here: every process that saw it says so, as the one that hung may be rank 0."""
    if validated_by_parent() and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":
        tell_launcher(line, follows=True)
    else:
        print(line, file=sys.stderr)


def process_started() -> float:
    """When this process began, in time.time() seconds: from /proc/self/stat's start time in clock ticks
    after boot, to a tick (psutil's create_time adds boot time rounded to the second); psutil elsewhere."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22, starttime (the name may hold spaces)
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(age, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        import psutil

        return psutil.Process().create_time()


def command_started(program: bool) -> float:
    """When the user's command began, in time.time() seconds: for --nproc's workers the launching
    process's start (STARTED); for the program itself (`ddptune ...`) this process's start, its imports
    included; for main called from Python, in a process that may have begun long before, now."""
    if validated_by_parent() and STARTED in os.environ:
        try:
            return float(os.environ[STARTED])
        except ValueError:
            pass
    return process_started() if program else time.time()


def startup_split(started_at: float, setup_at: float) -> dict[str, float]:
    """Where this process's start-up went before its setup began (`setup_at`; `started_at`: the
    command's start; time.time() seconds): the launching process's imports, checks and preparation
    before it started torch's launcher (0 without one), the launcher starting this process, then this
    process's own imports up to its setup (for a process that was not launched: its checks and
    preparation too). Each at least 0; together setup_at - started_at."""
    spawned = float(os.environ.get(SPAWNED, started_at)) if validated_by_parent() else started_at
    spawned = min(max(spawned, started_at), setup_at)
    own = min(max(process_started(), spawned), setup_at)
    return {"before_launch_s": spawned - started_at, "launch_s": own - spawned, "process_s": setup_at - own}


def launch_problems(nnodes: int, node_rank: int, master: str | None, max_restarts: int) -> list[str]:
    """The multi-node and restart flags of `ddptune train`."""
    if nnodes < 1:
        return [f"--nnodes: must be at least 1 (got {nnodes})"]
    if not 0 <= node_rank < nnodes:
        return [f"--node-rank: must be in 0..{nnodes - 1} (got {node_rank}; node 0 is the one that writes output_dir)"]
    if max_restarts < 0:
        return [f"--max-restarts: must be 0 or more (got {max_restarts})"]
    if nnodes > 1 and master is None:
        return [f"--master: needed with --nnodes {nnodes} (HOST:PORT of node 0, e.g. --master 10.0.0.1:29500, "
                "the same on every node)"]
    if master is not None:
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return [f"--master: {master!r} is not HOST:PORT (e.g. 10.0.0.1:29500)"]
        if nnodes == 1:
            return ["--master: only with --nnodes 2 or more (one machine finds a free port itself)"]
    return []


def default_threads(nproc: int, cuda: bool | None = None) -> int:
    """OpenMP threads for each of `nproc` processes on this host: OMP_NUM_THREADS when set, else 1
    on GPUs and, on CPUs, this process's cores less those other work keeps busy, shared out.

    A GPU process does no CPU math worth a thread pool, and its workers spin after each parallel
    region: on 2 H200s (32 cores) the 8B QLoRA step at 2 processes took 0.397 s median with 1
    thread each and 0.411 s with 16 (1 process alone: 0.402 s; BENCHMARKS.md, 2026-11-30). torchrun
    also gives 1 thread when it is the launcher, and `setup` gives it to an in-process GPU run. On CPUs
    the threads do the training: share the cores that are free. A thread on a core another program
    holds makes every parallel region wait for it: on 2 cores beside one program spinning on a core,
    the demo's median step took 15.4 s with torch's default 2 threads and 7.1 s with the 1 chosen
    here; on the idle machine both took 4.3-4.5 s (BENCHMARKS.md, the CPU demo).
    """
    return cpu_threads(nproc, cuda)[0]


def cpu_threads(nproc: int, cuda: bool | None = None) -> tuple[int, str]:
    """default_threads(nproc, cuda), and why, in words."""
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    if _cuda() if cuda is None else cuda:
        return 1, "a GPU process"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = busy_cores()
    why = f"{cores} cores, {busy:.1f} busy with other work at the start" + (f", {nproc} processes" if nproc > 1 else "")
    return max(1, (cores - round(busy)) // nproc), why + "; OMP_NUM_THREADS=N sets it"


def busy_cores(seconds: float = 0.2) -> float:
    """How many of this process's cores other processes kept busy over `seconds` (the kernel's
    per-core counters in /proc/stat, less this process's own CPU time); 0.0 where they cannot be read."""
    mine = {f"cpu{c}" for c in (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ())}

    def sample() -> tuple[float, float]:
        with open("/proc/stat") as f:
            fields = [line.split() for line in f if line.split()[0] in mine]
        busy = sum(sum(map(int, v[1:8])) - int(v[4]) - int(v[5]) for v in fields)  # all but idle and iowait
        own = os.times()
        return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system

    try:
        (b0, own0), start = sample(), time.monotonic()
        time.sleep(seconds)
        (b1, own1), span = sample(), time.monotonic() - start
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, (b1 - b0 - (own1 - own0)) / span)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class Standby:
    """torch's launcher (`launch.main(["--standby", FD, "--preload", MODULES])`), started before its
    command is known, so that it imports torch, and its fork server the modules `preload` names (the
    workers are forked from it: ddptune.forked), while this process checks the run and prepares its
    data. It starts no worker until `torchrun(..., standby=it)` sends it its command and environment
    through a pipe; `dismiss()` ends one that got none (it started no worker). Started apart from the
    terminal's Ctrl-C, with SIGTERM when this process dies, as torchrun says."""

    def __init__(self, preload: tuple[str, ...] = ()):
        read, write = os.pipe()
        try:
            # (-c, not -m: workers forked for torch's launcher would import a __main__ module again)
            # (-W: a worker killed by a signal leaves its semaphores to multiprocessing's resource tracker,
            # which the launcher starts with its own warning filters: it would warn of them on the console)
            self.proc = subprocess.Popen([sys.executable, "-W", "ignore:resource_tracker:UserWarning", "-c",
                                          "import sys; from ddptune.launch import main; sys.exit(main(sys.argv[1:]))",
                                          "--standby", str(read), "--preload", ",".join(preload)],
                                         pass_fds=(read,), start_new_session=True, preexec_fn=term_when_parent_dies)
        finally:
            os.close(read)
        self.orders = os.fdopen(write, "w")

    def send(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        try:
            with self.orders as orders:
                json.dump({"argv": argv, "env": env}, orders)
        except BrokenPipeError:  # it ended before its command (its own error is on stderr): its exit code tells
            pass
        return self.proc

    def dismiss(self) -> None:
        if not self.orders.closed:
            self.orders.close()
            self.proc.terminate()  # it exits at once, through multiprocessing's clean-up (its temporary folder)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def standby(needed: bool = True, preload: tuple[str, ...] = ()):
    """A Standby while the block runs (None where not `needed`; `preload`: the modules its workers
    will need, imported meanwhile), dismissed at its end unless the block gave it its command: a
    refused or stopped run leaves no launcher behind."""
    waiting = Standby(preload) if needed else None
    try:
        yield waiting
    finally:
        if waiting is not None:
            waiting.dismiss()


def torchrun(nproc: int, module_args: list[str], env: dict[str, str] | None = None,
             nnodes: int = 1, node_rank: int = 0, master: str | None = None, max_restarts: int = 0,
             output_dir: str | None = None, started: float | None = None, standby: Standby | None = None) -> int:
    """Run `python -m <module_args...>` in `nproc` processes on this host; return the exit code.

    One machine: torchrun's standalone rendezvous on a free local port. Several (`nnodes`, the same
    command on each with its `node_rank`): torchrun's static rendezvous at `master` (HOST:PORT of
    node 0), so global rank 0, the one that writes, is on node 0. `max_restarts`: torchrun restarts
    every worker after one fails, up to that many times (they resume from the newest checkpoint).

    `module_args` starts with the module name, e.g. ["ddptune", "train", "cfg.yaml"]. Each child gets
    `default_threads(nproc)` OpenMP threads unless OMP_NUM_THREADS is set (in `env` or here).
    `output_dir`: a training run's, so that a killed worker's line says whether it saved a checkpoint;
    `started`: when its command began (command_started), so that the workers count its start-up too;
    `standby`: torch's launcher started earlier (Standby), else one is started now.

    Signals: torchrun runs in a session of its own, so a Ctrl-C at the terminal reaches this process
    only, and SIGINT or SIGTERM sent to this process is passed to every worker exactly once (each
    then finishes its step, saves and stops; torchrun's own handling would SIGKILL them 30 s later);
    for training (`output_dir`) the first is answered at once with `heard_line`, a second aborts.
    If this process dies even by SIGKILL, the kernel sends torchrun SIGTERM, which it passes on.
    """
    if nnodes == 1:
        rendezvous = ["--standalone"]
    else:
        host, _, port = master.rpartition(":")
        rendezvous = [f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--master_addr={host}", f"--master_port={port}"]
    argv = [*rendezvous, f"--nproc_per_node={nproc}", f"--max_restarts={max_restarts}", "--start_method=forkserver", "--run_path"]
    child_env = dict(os.environ if env is None else env)
    if child_env.get("OMP_NUM_THREADS"):  # the caller's choice
        child_env.pop(THREADS_WHY, None)
    else:
        threads, why = cpu_threads(nproc)
        child_env.update({"OMP_NUM_THREADS": str(threads), THREADS_WHY: why})
    child_env.update({VALIDATED: "1", SPAWNED: repr(time.time())})
    if output_dir:
        child_env.update({RUN: output_dir} if started is None else {RUN: output_dir, STARTED: repr(started)})
    if max_restarts:
        # torchrun (torch 2.13) shares one TCP store across rendezvous rounds without a per-round
        # prefix: restarted workers read the dead round's gloo/NCCL addresses and cannot connect.
        # A store per round (torch's documented opt-out) gives them fresh ones.
        child_env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    argv += [WORKER_SCRIPT, json.dumps(child_env), *module_args]
    proc = (standby or Standby()).send(argv, child_env)
    heard = []

    def stop(signum, _frame) -> None:
        if output_dir and not heard:  # training: say at once that the stop was heard, and what comes
            print("\n" + heard_line(signum), file=sys.stderr, flush=True)  # below a worker's progress bar
        heard.append(signum)
        _forward(proc, signum)

    old = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
        old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _forward(proc: subprocess.Popen, signum: int) -> None:
    """`signum` to every worker under torch's launcher `proc`, and to what each started; to `proc`
    itself where it has none yet. Not to the fork server: it would die of SIGTERM, and its death
    sends each worker SIGINT too (nor to multiprocessing's resource tracker, which ignores it)."""
    import psutil

    try:
        everyone = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        everyone = []
    helpers = _helpers(everyone)
    for w in [p for p in everyone if p not in helpers] or [proc]:
        try:
            w.send_signal(signum)
        except psutil.Error:
            pass


def _helpers(processes: list, kinds: tuple[str, ...] = ("forkserver", "resource_tracker")) -> list:
    """Among `processes` (psutil.Process), multiprocessing's fork servers and resource trackers (`kinds`):
    not the workers forked from a server, which show its command line."""
    def helper(p) -> bool:
        try:
            return any(f"multiprocessing.{kind}" in " ".join(p.cmdline()) for kind in kinds)
        except Exception:  # psutil.Error: gone, or not ours to read
            return False

    return [p for p in processes if helper(p) and not helper(p.parent())]


def workers(pid: int) -> list:
    """The worker processes (psutil.Process) that torch's launcher forked under process `pid` (a
    `ddptune ... --nproc N` command, or the launcher itself): the fork server's children."""
    import psutil

    try:
        return [w for s in _helpers(psutil.Process(pid).children(recursive=True), ("forkserver",)) for w in s.children()]
    except psutil.Error:
        return []


def serve(preload: list[str]) -> bool:
    """Start multiprocessing's fork server now, importing `preload` after ddptune.forked (which makes it
    die with this process and keeps its environment): torch's launcher forks the workers from it. False
    where it cannot start (its socket's path under TMPDIR longer than a socket's path may be, say):
    the workers are then started as new interpreters (`unforked`)."""
    import multiprocessing.forkserver as server

    server.set_forkserver_preload(["ddptune.forked", *preload])
    os.environ[FORK_SERVER] = "1"  # for the server alone: ddptune.forked takes it out there
    try:
        server.ensure_running()
        return True
    except OSError:
        return False
    finally:
        del os.environ[FORK_SERVER]


def unforked(argv: list[str]) -> list[str]:
    """torchrun's arguments as `torchrun` builds them, with each worker a new interpreter running
    `python -m MODULE ...` instead of a fork that runs ddptune.forked's script."""
    i = argv.index("--run_path")  # then the script, the environment sent, the module and its arguments
    return [a for a in argv[:i] if a != "--start_method=forkserver"] + ["-m", *argv[i + 3:]]


def term_when_parent_dies() -> None:
    """In the child before exec (Linux): SIGTERM when the parent dies, however it died."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def main(argv: list[str]) -> int:
    waiting = argv[:1] == ["--standby"]
    if waiting:  # dismissed (or its launcher gone) before its command: exit now, through the clean-up of what it started
        signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(0))
    forking = serve([m for m in argv[3].split(",") if m] if waiting else [])  # its imports go on beside torch's below
    os.environ.setdefault("LOGLEVEL", "WARNING")  # the elastic agent's own loggers: what reaches `torch_logs`
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if waiting:  # a Standby: its command comes once torch is imported, or nothing (dismissed)
        with os.fdopen(int(argv[1])) as f:
            sent = f.read()
        if not sent:
            return 0
        order = json.loads(sent)
        os.environ.clear()
        os.environ.update(order["env"])
        argv = order["argv"]
    torch_logs(os.environ.get(RUN))
    if not forking and "--run_path" in argv:
        argv = unforked(argv)

    # torch's launcher keeps each worker's error file in a log folder, by default one it leaves under TMPDIR
    with tempfile.TemporaryDirectory(prefix="ddptune-launch-") as logs:
        try:
            run(parse_args(["--log-dir", logs, *argv]))
        except ChildFailedError as e:
            rank, failure = cause(e.failures)
            for line in report(e.failures, rank, failure):
                print(line, file=sys.stderr)
            code = failure.exitcode
            return code if 0 < code < 256 else 128 - code if code < 0 else 1  # a worker killed by signal N: 128 + N
        except SignalException as e:  # torchrun itself was signalled (e.g. its parent died): workers got it too
            return 128 + int(e.sigval)
    return 0


class _RawLog(logging.Handler):
    def __init__(self, run_dir: str):
        super().__init__()
        self.run_dir = run_dir

    def emit(self, record: logging.LogRecord) -> None:
        raw_log(self.run_dir, None, f"{record.levelname} {record.name}: {record.getMessage()}")


def torch_logs(run_dir: str | None) -> None:
    """Where the launcher's torch loggers write: the elastic agent's ("Sending process ... SIGTERM",
    "failed (exitcode: 2)", "Unable to shutdown process ... forcefully exiting via SIGKILL") and
    multiprocessing's ("Terminating process N via signal SIGTERM") go to the run's RAW_LOG (for
    training, `run_dir`: its output_dir), never to the console, whose lines about a failed worker are
    ddptune's own (`killed`, the workers' lines); without a run, nowhere."""
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.multiprocessing"):
        logger = logging.getLogger(name)
        logger.handlers = [_RawLog(run_dir) if run_dir else logging.NullHandler()]
        logger.propagate = False


def follows(failure) -> bool:
    """Whether a failed worker's line (`say_stalled`) tells of a collective that failed: of another's failure."""
    return isinstance(failure.message, dict) and failure.message.get("extraInfo", {}).get(FOLLOWS) == "1"


def cause(failures: dict) -> tuple:
    """The failed worker (rank, ProcessFailure) that the others' failures follow from: the first to fail,
    except that workers whose collective failed (`follows`) give way to one that failed within
    SAME_FAILURE_S of the first without such a line (killed by a signal, say): a collective fails
    because a peer died, and torch's launcher may notice the death after it (a poll later; whole seconds).
    Among those, one that torchrun's own SIGTERM did not end."""
    first = min(f.timestamp for f in failures.values())
    pool = {r: f for r, f in failures.items() if f.timestamp - first <= SAME_FAILURE_S and not follows(f)} or failures
    rank = min(pool, key=lambda k: (pool[k].timestamp, pool[k].exitcode == -signal.SIGTERM, k))
    return rank, failures[rank]


def report(failures: dict, rank: int, failure) -> list[str]:
    """The console's lines once workers failed, `rank` (`failure`) first (`cause`). Where it was a
    collective that failed (a process hung), every line of a failed collective, as each worker would
    have said it. Otherwise the lines that rank 0 has not printed (`untold`), and ddptune's one line for
    a worker that died without a word (`killed`, `exited`); the lines of the collectives that failed
    after it go to the run's RAW_LOG (console noise: they say no more than that a peer died)."""
    after = {r: f for r, f in failures.items() if follows(f)}
    own = untold({r: f for r, f in failures.items() if r not in after})
    if rank in after:
        return own + [said(f) for _, f in sorted(after.items())]
    if run := os.environ.get(RUN):
        for r, f in sorted(after.items()):
            raw_log(run, r, said(f))
    return own + (killed(rank, failure) or (exited(rank, failure) if after else []))


def untold(failures: dict) -> list[str]:
    """The lines failed workers left in their error files (dist.tell_launcher) that rank 0 has not
    printed itself, each once: rank 0 prints its own; another rank's differs only when that process
    alone met it, and on another node than rank 0's every line is untold."""
    lines = {rank: said(f) for rank, f in failures.items()}
    told = lines.get(0)
    return list(dict.fromkeys(line for rank, line in sorted(lines.items()) if line and line != told))


def said(failure) -> str | None:
    """The line a failed worker left for the launcher (`tell_launcher`); None where it left none."""
    return failure.message.get("message") if isinstance(failure.message, dict) else None


def killed(rank: int, failure) -> list[str]:
    """A line when the first worker to fail was killed by a signal (SIGKILL from the kernel's
    out-of-memory killer or a user, SIGSEGV from a crash): such a worker says nothing itself, and
    torchrun may stop the others before they notice that it is gone."""
    if failure.exitcode >= 0:
        return []
    return [_ended(f"ddptune: rank {rank} was killed by {failure.signal_name()} and the job stopped (the kernel's "
                   "out-of-memory killer sends SIGKILL: see dmesg)")]


def exited(rank: int, failure) -> list[str]:
    """A line when the first worker to fail exited with an error of its own and left no line for the
    launcher (a crash its own output shows), while the others' collectives failed after it."""
    if failure.exitcode <= 0 or said(failure) or failure.exitcode in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        return []
    return [_ended(f"ddptune: rank {rank} exited with code {failure.exitcode} and the job stopped (its own output "
                   "above says why)")]


def _ended(line: str) -> str:
    """`line` with, for training, what its run saved to go on from and where torch's own words are."""
    if run := os.environ.get(RUN):  # training: whether its run saved a checkpoint to go on from
        saved = sorted(p.parent for p in Path(run, "checkpoints").glob("step-*/state.json"))
        line += (f"; newest checkpoint: {saved[-1]} (continue with the same command and --resume)" if saved else
                 "; no checkpoint was saved (start the run again with the same command and --resume auto)")
        if (log := Path(run, RAW_LOG)).is_file():
            line += f"; torch's own messages: {log}"
    return line


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
