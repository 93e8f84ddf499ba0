"""Run folders: what one holds, which run may start or resume in one, and whether a folder or file can be written.

A run writes its marker first; RUN_ENTRIES names everything it writes there; `is_run` tells a run
folder from any other, and `--overwrite` deletes a run's own files and nothing else. `untrained`
tells a run that stopped or failed before its first step (a plain re-run starts it again), and
`saved_line` says what a stopped run left. `resume_mode` reads --resume (auto starts, continues or
starts again by what the folder holds); `output_problems` says whether a new run may start in
output_dir, or whether the run there may continue (a readable checkpoint, the same process count or
global batch, the config of its config.yaml). Nothing here imports torch: a refusal needs none of it.
"""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from ddptune import batchplan, checkpoint, config as config_lib, data, lock, report
from ddptune.config import Config, ConfigError

MARKER = ".ddptune-run"  # written before anything else of a run; a folder without one is not treated as a run
DATA_RECORD = "data.json"  # beside config.yaml: the formats data.format `auto` resolved to (data.record)
# Everything a run writes into its output_dir (names, or fnmatch patterns). `--overwrite` deletes these only.
RUN_ENTRIES = (
    MARKER, "config.yaml", DATA_RECORD, "metrics.jsonl", "ranks.jsonl", "summary.json", "profile.txt", "trace.json",
    "trace-rank*.json", "checkpoints", "adapter", "model", "eval", "eval-*", "cache", "tensorboard", "torch.log",
    ".adapter.tmp-*", ".model.tmp-*", ".adapter.old", ".model.old", ".summary.json.tmp-*",
)
# what a run folder made before the marker existed held, besides a config.yaml: one of these
_OLD_RUN_SIGNS = ("metrics.jsonl", "checkpoints", "summary.json", "adapter", "model")
# what a run writes before its first step: a folder holding only these trained nothing
BEFORE_TRAINING = (MARKER, "config.yaml", DATA_RECORD, "cache", "eval-base", "tensorboard", "torch.log")


def mark(folder: Path) -> None:
    """Make `folder` a run folder: the marker first, so that even a run that stops at once is one."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text(json.dumps({"ddptune_run": True, "created": time.time()}) + "\n")


def write_config(out: Path, cfg: Config) -> None:
    """The run's resolved config (config.yaml) and what its data resolved to (DATA_RECORD)."""
    (out / "config.yaml").write_text(config_lib.dump(cfg))
    report.write_json(out / DATA_RECORD, data.record(cfg.data))


def taken_formats(run_dir: Path) -> tuple[str, ...] | None:
    """The row formats the run in `run_dir` trained and validated on (its DATA_RECORD): what predict and eval
    take from it. None for a run saved before it recorded them (or whose record cannot be read): the rows'
    keys name their format then, as they always did."""
    try:
        saved = json.loads((Path(run_dir) / DATA_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data.recorded_formats(saved) if isinstance(saved, dict) else None


def entries(folder: Path) -> list[Path]:
    """What `folder` holds, besides a run's lock (and its helper files)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if not p.name.startswith(lock.NAME))  # its helper files too


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


def resume_mode(cfg: Config, resume: str | None, overwrite: bool) -> tuple[bool, bool]:
    """(resume, overwrite) for `--resume` (yes), `--resume auto` and neither. auto starts the run when
    output_dir holds none, continues it from its newest checkpoint when it holds an unfinished one,
    and starts it again when that one saved no checkpoint yet (its own files cleared, nothing else),
    but only with the config it was started with: what a job a scheduler requeued after preempting it
    needs. A finished run (by what it wrote) is never started again: output_problems refuses it. Without
    --resume, a run that stopped or failed before its first step (untrained) is started again
    over its own files."""
    if resume is None:
        return False, overwrite or untrained(Path(cfg.output_dir))
    if resume == "yes":
        return True, overwrite
    if overwrite:
        raise ConfigError(["--resume auto: cannot be combined with --overwrite (auto continues a run or starts it)"])
    out = Path(cfg.output_dir)
    if not entries(out) or not is_run(out):
        return False, False  # a new run (and output_problems refuses a folder of someone else's files)
    if finished(out) or has_checkpoint(out):
        return True, False  # complete (output_problems says so) or continued
    if problems := config_changes(out, cfg):  # its files would be cleared for a run of another config
        raise ConfigError(problems)
    return False, True


def has_checkpoint(output_dir: str | Path) -> bool:
    return bool(checkpoint.list_checkpoints(Path(output_dir) / "checkpoints"))


def output_problems(cfg: Config, resume: bool, world_size: int | None = None, overwrite: bool = False) -> list[str]:
    out = Path(cfg.output_dir)
    if problems := folder_problems("output_dir", out):
        return problems
    if resume and overwrite:
        return ["--overwrite: cannot be combined with --resume (continue the run, or start it again, not both)"]
    if not resume:
        return fresh_start_problems(out, overwrite)
    if weights := finished(out):
        try:
            changed = ", ".join(changed_keys(out, cfg))
        except ConfigError:
            changed = ""  # its config.yaml cannot be read: the run is complete all the same
        return [f"output_dir: the run in {out} is complete (it wrote summary.json and its weights, {weights.name}/): "
                "nothing to resume" + (f"; this config differs from its config.yaml in {changed}" if changed else "")
                + " (choose a new output_dir to train again; nothing was deleted)"]
    if untrained(out):
        return [f"output_dir: --resume found no checkpoints in {out}: its run stopped before its first step (run the "
                "same command without --resume to start it)"]
    if not (out / "checkpoints").is_dir():
        return [f"output_dir: --resume found no checkpoints in {out} (train with train.save_every or train.save_every_minutes > 0 first)"]
    states, damaged = [], []
    for path in reversed(checkpoint.list_checkpoints(out / "checkpoints")):
        try:
            state = json.loads((path / "state.json").read_text())
        except (OSError, ValueError, RecursionError) as e:
            damaged.append(f"{path}/state.json cannot be read ({type(e).__name__})")
            continue  # resume falls back past it
        if problem := checkpoint.state_problem(path, state):  # a step or process count of 0, text...: damaged likewise
            damaged.append(f"{path} {problem}")
        else:
            states.append((path, state))
    if not states:
        why = f"the newest, {damaged[0]}" if damaged else "a run stopped during its first save leaves none"
        return [f"--resume: no checkpoint in {out / 'checkpoints'} can be read back ({why}): start afresh into a new "
                "output_dir"]
    path, state = states[0]
    if world_size is not None and state.get("shards", world_size) != world_size:  # train.strategy=fsdp
        return [f"--resume: {path} holds the weights and optimizer states of {state['shards']} FSDP processes, "
                f"one part each, not {world_size} (resume with --nproc {state['shards']})"]
    same_batch = False  # whether the new process count and batch keys give the run's global batch
    if world_size is not None and "global_batch" in state:
        try:
            same_batch = batchplan.batch_plan(cfg.train, world_size).global_batch == state["global_batch"]
        except ConfigError:
            pass  # the batch keys' own problem is reported by validate
    if world_size is not None and state.get("world_size", world_size) != world_size and not same_batch:
        if "global_batch" not in state:
            return [f"--resume: {path} was written by {state['world_size']} processes, not {world_size} "
                    f"(resume with --nproc {state['world_size']})"]
        return [f"--resume: {path} was written by {state['world_size']} processes with {state['global_batch']} samples "
                f"per optimizer step; {world_size} process(es) would not take the same: set "
                f"train.effective_batch_size={state['global_batch']} (or resume with --nproc {state['world_size']})"]
    return config_changes(out, cfg, same_batch)


def config_changes(out: Path, cfg: Config, same_batch: bool = False) -> list[str]:
    """A line per key whose value in `cfg` is not the one the run in `out` was made with (its
    config.yaml), leaving out the keys that change no result (and the batch keys where the global batch
    is the same); none when the run has no config.yaml. A run continues or starts again only as itself."""
    try:
        changed = changed_keys(out, cfg, same_batch)
    except ConfigError as e:
        return [f"{e.problems[0]} (resume needs the run's own config.yaml)"]
    return [f"{key}: is {new!r} but the run being resumed used {old!r} (resume with the same config)"
            for key, (new, old) in changed.items()]


def changed_keys(out: Path, cfg: Config, same_batch: bool = False) -> dict[str, tuple]:
    """{key: (value in cfg, value in the run's config.yaml)} for config_changes; ConfigError when that
    file cannot be read."""
    if not (out / "config.yaml").exists():
        return {}
    saved = config_lib.flatten(config_lib.read_yaml(out / "config.yaml", "output_dir"))
    defaults = config_lib.flatten(config_lib.to_dict(Config()))
    return {key: (value, saved.get(key)) for key, value in config_lib.flatten(config_lib.to_dict(cfg)).items()
            if saved.get(key) != value and key not in RESUME_MAY_CHANGE and not (same_batch and key in BATCH_KEYS)
            and not (key not in saved and value == defaults[key])}  # a key newer than the run, at its default


def fresh_start_problems(out: Path, overwrite: bool) -> list[str]:
    """A new run needs an empty output_dir; --overwrite empties one that holds a ddptune run and
    nothing else. A folder of anything else is never offered --overwrite: it deletes nothing there."""
    if problems := enclosing_run_problems(out):
        return problems
    found = entries(out)
    if not found:
        return []
    if not is_run(out):
        return [f"output_dir: {out} holds files that are not a ddptune run ({named(found)}): choose a new "
                "or empty output_dir (nothing was deleted)"]
    if overwrite and (theirs := foreign(out)):
        return [f"output_dir: {out} holds a ddptune run and files it did not write ({named(theirs)}): move them "
                "out or choose another output_dir (--overwrite deletes only a run's own files; nothing was deleted)"]
    if not overwrite and (weights := finished(out)):  # nothing of it is left to resume
        return [f"output_dir: {out} already holds a finished ddptune run (it saved {weights.name}/ and summary.json): choose "
                "a new output_dir, or pass --overwrite to delete it and train again (nothing was deleted)"]
    if not overwrite:
        return [f"output_dir: {out} already holds a ddptune run (choose a new output_dir, pass --resume to continue "
                "that run, or --overwrite to delete it and start again)"]
    return []


def enclosing_run_problems(out: Path) -> list[str]:
    """A new run may not lie inside a folder that holds a ddptune run (which its --overwrite would
    clear, and whose files it would mix with) or that a live run holds locked."""
    for parent in Path(os.path.realpath(out)).parents:
        if is_run(parent):
            return [f"output_dir: {out} lies inside {parent}, which holds a ddptune run (choose an output_dir "
                    "outside it; nothing was written)"]
        if lock.held(parent):
            return [f"output_dir: {out} lies inside {parent}, which a running ddptune run holds locked (choose an "
                    "output_dir outside it; nothing was written)"]
    return []


# keys that change no result: a resume may set them anew (output_dir: the run's folder may have been moved)
RESUME_MAY_CHANGE = {"train.timeout_minutes", "train.save_every", "train.save_every_minutes", "train.keep_checkpoints",
                     "train.save_lead_seconds", "output_dir"}
# How the global batch is split among processes and forwards: a resume (at another process count too)
# may change them while the samples per optimizer step stay the same (the loss is a sum over them).
BATCH_KEYS = {"train.micro_batch_size", "train.grad_accum", "train.effective_batch_size"}
