"""Starting `ddptune train` on every launch path, and how its end becomes the exit code.

`train` starts a run whichever way this process came to be: alone (no launcher, no --nproc: the run
trains here); as the launcher of --nproc, --nnodes or --max-restarts (its processes come back here
through torchrun); as one of those processes; or under an external launcher (torchrun, accelerate
launch). Its run is admitted once (admission.admit): by the process that talks to the user before
any process starts (torch's launcher, launch.Standby, imports torch meanwhile and waits for the
admitted command), or, under an external launcher, by rank 0 in train.setup while the others wait.
Node 0's launching process (rank 0 under an external launcher) holds output_dir's lock until the
run ends (lock.py); rank 0 of --nproc's processes joins it.

Exit codes: 0; 1 for a run that stopped with one line (NonFinite, a stalled or failed collective)
or died; 128 + the signal for one stopped by SIGINT or SIGTERM (after saving its step, when the loop
was running); 2, bad input, is the CLI's (a ConfigError from here). The errors a training run stops
with (stops.py) are raised by train.py. This module imports no command: the CLI hands it train.run,
what each process trains.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import sys
from pathlib import Path

from ddptune import admission, batchplan, checks, config as config_lib, launch, lock, rundir
from ddptune.admission import Admission
from ddptune.config import Config, ConfigError
from ddptune.stops import Interrupted, NonFinite


def train(args, started: float, trainer) -> int:
    """`ddptune train ARGS` in this process, whichever way it was launched; the exit code. `started`:
    when the command began (launch.command_started); `trainer`: train.run. Bad input raises ConfigError."""
    cfg = config_lib.load(args.config, args.overrides)
    nproc = 1 if args.nproc is None else args.nproc
    problems = checks.check_values(cfg)  # what needs nothing but the config: answered before torch is imported
    if not launch.in_launched_process():
        if nproc < 1:
            problems.append(f"--nproc: must be at least 1 (got {nproc})")
        problems += launch.launch_problems(args.nnodes, args.node_rank, args.master, args.max_restarts)
    if args.gpu_memory is not None and not (math.isfinite(args.gpu_memory) and args.gpu_memory > 0):
        problems.append(f"--gpu-memory: must be a positive number of GiB (got {args.gpu_memory})")
    if problems:
        raise ConfigError(problems)
    # SIGINT or SIGTERM outside the training loop (which stops after a saved step): end through the
    # lock's release and say what the run saved, instead of dying silently with the lock left behind
    code = None
    try:
        with launch.stops_raise():
            try:
                code = _start(cfg, args, nproc, started, trainer)
            except Exception:
                # a worker whose peer left on the same stop: its collective fails before its own handler ran
                if not (launch.in_launched_process() and launch.received is not None):
                    raise
                code = _stopped(cfg, launch.received)
    except launch.Stopped as e:  # raised anywhere in the block, also while an error above is handled
        if code is None:  # (one that comes as the block ends, after the run ended, leaves the run's outcome)
            code = _stopped(cfg, e.signum)
    return code


def _start(cfg: Config, args, nproc: int, started: float, trainer) -> int:
    """A valid config's run, admitted once and started on this process's launch path."""
    if launch.in_launched_process():
        if launch.validated_by_parent():  # a worker of --nproc: the parent admitted the run and holds the lock
            if launch.is_main_process():
                lock.add_holder(cfg.output_dir)  # the lock stays live while this worker writes, whatever befalls the parent
            return _trained(trainer, cfg, started, functools.partial(_admitted_by_parent, cfg, args.resume is not None))
        # under torchrun or accelerate launch: rank 0 locks output_dir, then admits the run (in train.setup)
        with lock.acquire(cfg.output_dir) if launch.is_main_process() else contextlib.nullcontext():
            return _trained(trainer, cfg, started, functools.partial(_admitted_here, cfg, args.resume, args.overwrite))
    launches = not (args.nproc is None and args.nnodes == 1 and not args.max_restarts)
    first = args.node_rank == 0  # node 0 holds rank 0, which writes: it alone checks and locks output_dir
    world = nproc * args.nnodes
    # torch's launcher imports torch while the run is checked; it starts no process before the run is admitted
    with launch.standby(launches, preload=launch.TRAIN_MODULES) as standby:
        # once per node, here, before any process starts
        admitted = admission.admit(cfg, args.resume, args.overwrite, world, output=first)
        if args.gpu_memory is not None:  # on CUDA train.setup checks the GPU's own free memory
            from ddptune import speed  # (torch)

            if problems := speed.gpu_memory_problems(cfg, world, args.gpu_memory):
                raise ConfigError(problems)
        if note := config_lib.kept_validation(cfg, args.overrides):  # a valid run that validates on another source
            print(f"ddptune: note: {note}", file=sys.stderr)
        # held until the run ends; a second run or --resume is refused
        with lock.acquire(cfg.output_dir) if first else contextlib.nullcontext():
            if admitted.overwrite and first:
                rundir.clear(Path(cfg.output_dir))
            if first and (problems := rundir.output_problems(cfg, admitted.resume, world)):  # a run that ended since
                raise ConfigError(problems)
            if not launches:
                return _trained(trainer, cfg, started, lambda _world: admitted)
            child = ["train", args.config, *args.overrides] + (["--resume"] if admitted.resume else [])
            return launch.torchrun(nproc=nproc, module_args=["ddptune", *child], nnodes=args.nnodes, node_rank=args.node_rank,
                                   master=args.master, max_restarts=args.max_restarts, output_dir=cfg.output_dir, started=started, standby=standby)


def _admitted_by_parent(cfg: Config, resume: bool, world_size: int) -> Admission:
    """A worker of --nproc: the parent admitted the run (and passed --resume when it continues); a
    worker torchrun restarted (--max-restarts) after another failed continues from the newest checkpoint."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    return Admission(resume or (restarted and rundir.has_checkpoint(cfg.output_dir)), False,
                     batchplan.batch_plan(cfg.train, world_size))


def _admitted_here(cfg: Config, resume: str | None, overwrite: bool, world_size: int) -> Admission:
    """Under an external launcher: rank 0, holding output_dir's lock, admits the run, then clears what
    --overwrite (or a run that never took a step) leaves to delete."""
    admitted = admission.admit(cfg, resume, overwrite, world_size)
    if admitted.overwrite:
        rundir.clear(Path(cfg.output_dir))
    return admitted


def _trained(trainer, cfg: Config, started: float, admit) -> int:
    """This process's share of the run (`trainer`: train.run, admitted through `admit`), its end as the exit code."""
    from ddptune import dist  # (torch: this process trains)

    try:
        trainer(cfg, started=started, admit=admit)
    except (NonFinite, dist.ShardingFailed, dist.ReplicasDiffer) as e:
        if launch.is_main_process():
            print(f"ddptune: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:  # the step was finished and saved
        if launch.is_main_process():
            print(f"ddptune: {e}", file=sys.stderr)
        return 128 + e.signum
    except dist.Stalled as e:  # every process that saw it says so, unless ddptune's launcher names a worker that died
        launch.say_stalled(f"ddptune: rank {os.environ.get('RANK', '0')}: {e}")
        return 1
    return 0


def _stopped(cfg: Config, signum: int) -> int:
    if launch.is_main_process():
        print(f"ddptune: stopped by {signal.Signals(signum).name}; "
              f"{rundir.saved_line(Path(cfg.output_dir))}", file=sys.stderr)
    return 128 + signum
