"""Everything that must hold before a run starts, checked once, by the process that talks to the user.

`validate(cfg, world_size, resume)` collects every problem (values, the model source, the data
files and their columns, bitsandbytes for QLoRA, the output folder, a resume's saved config, rows
against the global batch) and raises them together as one `ConfigError`, or returns the batch plan.
The CLI calls it in the parent before `--nproc` starts any process; under an external launcher,
rank 0 calls it and the others wait for its answer (`dist.on_main`).
"""
from __future__ import annotations

from pathlib import Path

import yaml

from ddptune import config as config_lib, data as data_lib, model as model_lib
from ddptune.config import BatchPlan, Config, ConfigError


def validate(cfg: Config, world_size: int, resume: bool = False) -> BatchPlan:
    problems = config_lib.check_values(cfg)
    if cfg.train.method == "qlora":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            problems.append("train.method: qlora needs bitsandbytes (pip install bitsandbytes) or use method=lora")
    try:
        model_lib.resolve_source(cfg.model)
    except ValueError as e:
        problems.append(f"model.source: {e}")
    n_train = None
    if not problems:
        data_problems, n_train = data_lib.check(cfg.data)
        problems += data_problems
    problems += output_problems(cfg, resume)
    plan = None
    try:
        plan = config_lib.batch_plan(cfg.train, world_size)
    except ConfigError as e:
        problems += e.problems
    if plan and n_train is not None and not problems:
        problems += rows_problems(n_train, plan)
    if problems:
        raise ConfigError(problems)
    return plan


def rows_problems(n_rows: int, plan: BatchPlan) -> list[str]:
    """Training rows against one global batch (hub data is counted only once loaded: train calls this too)."""
    if n_rows < plan.global_batch:
        return [f"data.train: {n_rows} rows are fewer than one global batch of {plan.global_batch} "
                "(select more rows, or lower train.micro_batch_size, the accumulation or effective_batch_size)"]
    return []


def output_problems(cfg: Config, resume: bool) -> list[str]:
    out = Path(cfg.output_dir)
    if not resume:
        if out.exists() and any(out.iterdir()):
            return [f"output_dir: {out} already holds files (choose a new output_dir, or pass --resume to continue that run)"]
        return []
    if (out / "summary.json").is_file():
        return [f"output_dir: the run in {out} is complete (it wrote summary.json): nothing to resume "
                "(raise train.max_steps into a new output_dir to train on)"]
    if not (out / "checkpoints").is_dir():
        return [f"output_dir: --resume found no checkpoints in {out} (train with train.save_every > 0 first)"]
    if not (out / "config.yaml").exists():
        return []
    saved = config_lib.flatten(yaml.safe_load((out / "config.yaml").read_text()))
    return [f"{key}: is {value!r} but the run being resumed used {saved.get(key)!r} (resume with the same config)"
            for key, value in config_lib.flatten(config_lib.to_dict(cfg)).items() if saved.get(key) != value]
