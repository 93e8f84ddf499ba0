"""One run per output folder: a lock file in it for as long as the run lasts.

`acquire(folder)` creates `folder/.ddptune.lock` atomically (O_CREAT | O_EXCL) with the pid and host
of this process, so a second run or `--resume` into the same folder is refused with one line (a
`ConfigError`). A lock whose processes have all ended on this host (a killed process that its parent
has not reaped yet, a zombie, has ended) is stale: it is taken over with a warning, under a second
O_EXCL file so that of two runs finding it at once only one takes it over.
A lock written on another host cannot be checked there: it is refused with the path to remove,
unless an earlier start of the same SLURM job wrote it (SLURM_JOB_ID, a lower SLURM_RESTART_COUNT):
a requeued job starts only once its earlier start has ended, so that lock is stale wherever it was.
`add_holder(folder)`: the worker that writes the run (rank 0 under `--nproc`) adds its pid, so the lock
stays live while the worker runs even if the launching process is killed.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import stat
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

from ddptune.config import ConfigError

NAME = ".ddptune.lock"  # in output_dir; rundir.py counts neither it nor its helper files (NAME.*) as files of the run
STALE_GUARD_S = 30.0  # a takeover guard older than this was left by a process that died taking over
YOUNG_S = 10.0  # an unreadable lock younger than this is still being written by its owner


class Lock:
    """The held lock; `release()` (or leaving the `with` block) removes it, and the folder if
    `acquire` made it and the run left nothing in it."""

    def __init__(self, path: Path, token: str, made_folder: bool):
        self.path, self.token, self.made_folder = path, token, made_folder

    def release(self) -> None:
        raw, holder = _read(self.path)
        if holder and holder.get("token") == self.token:
            os.unlink(self.path)
        if self.made_folder:
            try:
                self.path.parent.rmdir()  # only if empty: a failed start leaves nothing behind
            except OSError:
                pass

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(folder: str | os.PathLike) -> Lock:
    """Lock `folder` (made if missing) for this process, or raise ConfigError saying who holds it."""
    folder = Path(folder)
    made = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError([f"output_dir: {folder} cannot be made ({e.strerror}; choose a folder you can write to)"]) from None
    path = folder / NAME
    token = uuid.uuid4().hex
    info = {"pids": [os.getpid()], "host": socket.gethostname(), "started": time.time(), "token": token, **_slurm()}
    try:
        for _ in range(5):
            if _create(path, info):
                return Lock(path, token, made)
            if kind := _not_a_file(path):  # a folder or a FIFO there would break (or block) every read of it
                raise ConfigError([f"output_dir: {path} is {kind}, not a lock file: nothing can lock {folder} while it "
                                   f"is there (remove {path}, then start again)"])
            raw, holder = _read(path)
            if raw is None:  # removed meanwhile: try again
                continue
            if holder is None and time.time() - _mtime(path) < YOUNG_S:
                raise ConfigError([f"output_dir: {folder} is being locked by another run right now (choose another output_dir)"])
            holder = holder or {}
            earlier = _earlier_start(holder, info)  # ended, wherever it ran (its pids may have been reused since)
            if holder.get("host", info["host"]) != info["host"] and not earlier:
                raise ConfigError([f"output_dir: {folder} is locked by pid {_pids(holder)} on host {holder['host']} "
                                   f"(if no run is writing there any more, remove {path})"])
            if not earlier and any(alive(pid) for pid in holder.get("pids", [])):
                raise ConfigError([f"output_dir: {folder} is in use by the run of pid {_pids(holder)} on {holder.get('host')}, "
                                   f"started {_when(holder)} (wait for it to end, or choose another output_dir)"])
            _take_over(path, raw, holder)
        raise ConfigError([f"output_dir: could not lock {folder}: other runs keep taking it (choose another output_dir)"])
    except BaseException:
        if made:
            try:
                folder.rmdir()
            except OSError:
                pass
        raise


def held(folder: str | os.PathLike) -> bool:
    """Whether a run holds `folder` locked now: one of its processes on this host is alive, it was
    written on another host (which cannot be checked from here), or it is still being written."""
    path = Path(folder) / NAME
    try:
        if _not_a_file(path):
            return False
        raw, holder = _read(path)
    except OSError:
        return False
    if raw is None:
        return False
    if holder is None:
        return time.time() - _mtime(path) < YOUNG_S
    if holder.get("host", socket.gethostname()) != socket.gethostname():
        return True
    pids = holder.get("pids")
    return isinstance(pids, list) and any(alive(pid) for pid in pids)


def add_holder(folder: str | os.PathLike) -> None:
    """Add this process to the lock its launcher holds on `folder` (nothing if there is none)."""
    path = Path(folder) / NAME
    _, holder = _read(path)
    if not holder or holder.get("host") != socket.gethostname():
        return
    holder["pids"] = sorted(set(holder.get("pids", [])) | {os.getpid()})
    tmp = path.with_name(f"{NAME}.{os.getpid()}.tmp")
    _write(os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644), holder)
    os.replace(tmp, path)  # the lock file never disappears meanwhile


def _take_over(path: Path, raw: bytes, holder: dict) -> None:
    """Remove the stale lock `raw`, unless another process changed it first."""
    guard = path.with_name(NAME + ".takeover")
    try:
        fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        if kind := _not_a_file(guard):
            raise ConfigError([f"output_dir: {guard} is {kind}, not a lock file (remove {guard}, then start again)"]) from None
        if time.time() - _mtime(guard) > STALE_GUARD_S:
            guard.unlink(missing_ok=True)
            return
        raise ConfigError([f"output_dir: {path.parent} is being taken over by another run right now "
                           "(choose another output_dir)"]) from None
    try:
        _write(fd, {"pids": [os.getpid()]})
        if _read(path)[0] == raw:  # still the stale lock we judged
            os.unlink(path)
            print(f"ddptune: warning: output_dir: took over the lock of a run that is no longer running "
                  f"(pid {_pids(holder) or '?'}, started {_when(holder)})", file=sys.stderr)
    finally:
        guard.unlink(missing_ok=True)


def _slurm() -> dict:
    """This process's SLURM job and how often it was requeued before (nothing outside SLURM)."""
    job, restarts = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "0")
    return {"slurm_job": job, "slurm_restart": int(restarts) if restarts.isdigit() else 0} if job else {}


def _earlier_start(holder: dict, info: dict) -> bool:
    """Whether `holder` is the lock of an earlier start of this SLURM job (which has ended)."""
    restart = holder.get("slurm_restart")
    return ("slurm_job" in info and holder.get("slurm_job") == info["slurm_job"] and type(restart) is int
            and restart < info["slurm_restart"])


def _create(path: Path, info: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    _write(fd, info)
    return True


def _not_a_file(path: Path) -> str | None:
    """What stands at `path` when it is not a regular file of its own (a symlink counts as not one,
    loop or not); None for a regular file or nothing."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        try:
            os.stat(path)
        except OSError as e:
            return "a symlink loop" if e.errno == errno.ELOOP else "a symlink to nothing"
        return "a symlink"
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _write(fd: int, obj: dict) -> None:
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _read(path: Path) -> tuple[bytes | None, dict | None]:
    """(the lock's bytes or None if there is no lock, its content or None if it is not a lock)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, None
    try:
        holder = json.loads(raw)
    except ValueError:
        return raw, None
    return raw, holder if isinstance(holder, dict) else None


def alive(pid) -> bool:
    """Whether process `pid` of this host still runs. A process killed but not yet reaped by its
    parent (a zombie: a launcher or shell that has not waited for it yet) still answers a signal
    check, yet writes nothing more: it counts as ended, read from its state in /proc (where there
    is no /proc, the signal check alone answers)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return _state(pid) not in ("Z", "X")  # zombie, or dead while being reaped


def _state(pid: int) -> str | None:
    """The one-letter state of `pid` in /proc/PID/stat (R, S, D, Z, ...); None where it cannot be read."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # "PID (COMMAND) STATE ...": the command may hold spaces and parentheses, so read after the last ")"
    rest = stat_line[stat_line.rfind(b")") + 1:].split()
    return rest[0].decode("ascii", "replace") if rest else None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return time.time()


def _pids(holder: dict) -> str:
    return ",".join(str(p) for p in holder.get("pids", []))


def _when(holder: dict) -> str:
    started = holder.get("started")
    return datetime.fromtimestamp(started).strftime("%Y-%m-%d %H:%M:%S") if isinstance(started, (int, float)) else "at an unknown time"
