"""Folders ddptune writes: what a run folder holds, and whether a folder or report file can be written.

A run writes its marker first; RUN_ENTRIES names everything it writes there; `is_run` tells a run
folder from any other, and `--overwrite` deletes a run's own files and nothing else. `untrained`
tells a run that stopped or failed before its first step (a plain re-run starts it again), and
`saved_line` says what a stopped run left. Nothing here imports torch: a refusal needs none of it.
"""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from ddptune import checkpoint

MARKER = ".ddptune-run"  # written before anything else of a run; a folder without one is not treated as a run
# Everything a run writes into its output_dir (names, or fnmatch patterns). `--overwrite` deletes these only.
RUN_ENTRIES = (
    MARKER, "config.yaml", "metrics.jsonl", "ranks.jsonl", "summary.json", "profile.txt", "trace.json",
    "trace-rank*.json", "checkpoints", "adapter", "model", "eval", "eval-base", "cache", "tensorboard",
    ".adapter.tmp-*", ".model.tmp-*", ".adapter.old", ".model.old", ".summary.json.tmp-*",
)
LOCK = ".ddptune.lock"  # the lock a live run holds (lock.py), with its helper files beside it
# what a run folder made before the marker existed held, besides a config.yaml: one of these
_OLD_RUN_SIGNS = ("metrics.jsonl", "checkpoints", "summary.json", "adapter", "model")
# what a run writes before its first step: a folder holding only these trained nothing
BEFORE_TRAINING = (MARKER, "config.yaml", "cache", "eval-base", "tensorboard")


def mark(folder: Path) -> None:
    """Make `folder` a run folder: the marker first, so that even a run that stops at once is one."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text(json.dumps({"ddptune_run": True, "created": time.time()}) + "\n")


def entries(folder: Path) -> list[Path]:
    """What `folder` holds, besides a run's lock (and its helper files)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if not p.name.startswith(LOCK))


def is_own(path: Path) -> bool:
    """Whether `path` (an entry of a run folder) is a name ddptune writes there."""
    return any(fnmatch.fnmatchcase(path.name, pattern) for pattern in RUN_ENTRIES)


def is_run(folder: Path) -> bool:
    """Whether `folder` holds a ddptune run: its marker, or (a run written before markers existed)
    a config.yaml that reads as a ddptune config beside what a run writes."""
    if (folder / MARKER).is_file():
        return True
    if not (folder / "config.yaml").is_file() or not any((folder / name).exists() for name in _OLD_RUN_SIGNS):
        return False
    from ddptune import config as config_lib

    try:
        config_lib.from_dict(config_lib.read_yaml(folder / "config.yaml", "output_dir"))
    except (config_lib.ConfigError, RecursionError):
        return False
    return True


def foreign(folder: Path) -> list[Path]:
    """The entries of a run folder that ddptune did not write (a user's own files)."""
    return [p for p in entries(folder) if not is_own(p)]


def named(paths: list[Path], most: int = 3) -> str:
    """'a, b/ and 2 more': a few entries by name, folders with a slash."""
    names = [p.name + ("/" if p.is_dir() else "") for p in paths[:most]]
    return ", ".join(names) + (f" and {len(paths) - most} more" if len(paths) > most else "")


def clear(folder: Path) -> None:
    """Delete the run's own entries (never anything else, never the lock this run holds)."""
    for p in entries(folder):
        if not is_own(p):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def folder_problems(where: str, folder: Path) -> list[str]:
    """`folder` is, or can be made, a writable folder (nothing is created but a probe, removed at once)."""
    if os.path.lexists(folder) and not folder.is_dir():  # a file, or a FIFO, a symlink loop or to nothing
        from ddptune import config as config_lib

        kind = "is a file" if folder.is_file() else config_lib.not_a_file(folder).split(",")[0]
        return [f"{where}: {folder} {kind}, not a folder (choose a folder path)"]
    parent = folder
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return [f"{where}: {folder} cannot be made: {parent} is a file (choose a folder path)"]
    try:
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".ddptune-probe-"))
    except OSError as e:
        return [f"{where}: {parent} is not writable ({e.strerror}; choose a folder you can write to)"]
    return []


def report_file_problems(flag: str, value: str | None, example: str) -> list[str]:
    """A report file's path (`compare --json/--plot`, `plan --json`) can be written: not a folder,
    its folder is or can be made (report.write_* make it). An existing file is replaced whole."""
    if not value:
        return []
    target = Path(value)
    if target.is_dir():
        return [f"{flag}: {target} is a folder (give a file path, e.g. {target / example})"]
    return folder_problems(flag, target.parent)


def untrained(folder: Path) -> bool:
    """Whether `folder` holds a run that stopped or failed before its first step: nothing of it
    but what a run writes first (BEFORE_TRAINING), so a new run there loses nothing."""
    found = entries(folder)
    return bool(found) and is_run(folder) and all(p.name in BEFORE_TRAINING for p in found)


def finished(folder: Path) -> Path | None:
    """The final weights of the run in `folder` when it finished (its summary.json and its `adapter/` or
    `model/`, whichever method it used), else None: judged by what the run wrote, never by a new config."""
    if not (Path(folder) / "summary.json").is_file():
        return None
    return next((w for w in (Path(folder) / "adapter", Path(folder) / "model") if w.is_dir()), None)


def trained_weights_dir(run_dir: Path, method: str) -> Path:
    """Where a finished run keeps what it trained: `model/` (full fine-tuning) or `adapter/`."""
    return Path(run_dir) / ("model" if method == "full" else "adapter")


def saved_line(out: Path) -> str:
    """What a run that stopped left in `out`, and the command that goes on from there."""
    if weights := finished(out):
        return f"the run had finished training and saved {weights} (score it with: ddptune eval {out})"
    saved = checkpoint.list_checkpoints(out / "checkpoints")
    if saved:
        return f"newest checkpoint: {saved[-1]} (continue with the same command and --resume, or --resume auto)"
    if not entries(out) or untrained(out):
        return "nothing was saved (run the same command again to start the run)"
    return ("no checkpoint was saved (start the run again with the same command and --resume auto, which clears "
            "this run's files, or --overwrite)")
