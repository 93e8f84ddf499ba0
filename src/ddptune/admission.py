"""Whether a training run may start, and how: decided once, before its processes train.

`admit` is a run's one admission: --resume read against output_dir (rundir.resume_mode: start,
continue, or start again over its own files) and every problem found (`validate`); its
`Admission` (resume, overwrite, batch plan) is what every
process of the run uses. start.py calls it in the process that talks to the user, before any process
starts, or, under an external launcher, in rank 0 while the others wait (train.setup, `dist.on_main`).

`validate(cfg, world_size, resume)` collects every problem (values, the model source and tokenizer,
the data files and their columns, the output folder and a resume's saved config (rundir), rows
against the global batch (batchplan); then what needs the model's code: its layers against
lora.target_modules (model), bitsandbytes for QLoRA) and raises them together as one `ConfigError`,
or returns the batch plan. The first checks import neither torch nor transformers, so a refusal they
find comes at once; the model's code is imported only when they all pass.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass

from ddptune import batchplan, checks, data as data_lib, memory, rundir
from ddptune import sources
from ddptune.data import tokenized
from ddptune.batchplan import BatchPlan
from ddptune.config import Config, ConfigError


@dataclass(frozen=True)
class Admission:
    """What admitting a run decided, the same for every process."""
    resume: bool      # continue from the newest checkpoint in output_dir
    overwrite: bool   # delete the run's own files in output_dir first (--overwrite, or a run that never took a step)
    plan: BatchPlan


def admit(cfg: Config, resume: str | None, overwrite: bool, world_size: int, output: bool = True) -> Admission:
    """The run's admission for `world_size` processes: --resume (`resume`: None, "yes" or "auto") and
    --overwrite read against output_dir, and every problem of the run (`output`: see validate). One
    ConfigError lists what is wrong. (Whether it fits GPUs of a given size: plan.memory_problems.)"""
    resuming, overwrite = rundir.resume_mode(cfg, resume, overwrite)
    plan = validate(cfg, world_size, resume=resuming, overwrite=overwrite, output=output)
    return Admission(resuming, overwrite, plan)


def validated(cfg: Config, resume: bool, world_size: int) -> Admission:
    """train.run called from Python, not through start.py: `resume` as given, the run validated."""
    return Admission(resume, False, validate(cfg, world_size, resume))


def validate(cfg: Config, world_size: int, resume: bool = False, overwrite: bool = False,
             output: bool = True) -> BatchPlan:
    """Every problem of a run's config, its data, its model source and (unless `output` is false: a
    node other than the first of a multi-node job, which writes nothing) its output_dir. Where all of
    that holds, the data is prepared (tokenized.prepare, every row checked) when it and its tokenizer
    are here (hub data or a hub tokenizer: train.setup prepares it)."""
    problems = checks.check_values(cfg)
    if cfg.train.method == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        problems.append("train.method: qlora needs bitsandbytes (pip install bitsandbytes) or use method=lora")
    if cfg.train.log_with != "none":
        if importlib.util.find_spec(cfg.train.log_with) is None:  # the tracker's package, found without importing it
            problems.append(f"train.log_with: {cfg.train.log_with} is not installed (pip install {cfg.train.log_with}) "
                            "or use train.log_with=none")
    problems, n_train = input_problems(cfg, problems)
    if output:
        problems += rundir.output_problems(cfg, resume, world_size, overwrite)
    plan = None
    try:
        plan = batchplan.batch_plan(cfg.train, world_size)
    except ConfigError as e:
        problems += e.problems
    if not problems:  # the rest imports torch and transformers: only once everything above holds
        problems += code_problems(cfg)
    local = not any(s.source.startswith("hub:") for split in ("train", "val") for s in data_lib.sources(cfg.data, split))
    if not problems and local:
        from ddptune import model as model_lib  # (the model's code: only once the light checks have passed)

        if (tokenizer := model_lib.local_tokenizer(cfg.model, cfg.data)) is not None:
            problems += data_lib.template_problems(cfg.data, tokenizer)
            if not problems:  # every row checked and tokenized, once: the run reads what this made
                n_train = len(tokenized.load(tokenized.prepare(cfg.data, tokenizer, progress=sys.stderr.isatty()))[0])
    if plan and n_train is not None and not problems:
        problems += batchplan.rows_problems(n_train, plan)
    if problems:
        raise ConfigError(problems)
    return plan


def input_problems(cfg: Config, problems: list[str]) -> tuple[list[str], int | None]:
    """`problems` found so far, then the model source and tokenizer and the data paths, then (where
    nothing is wrong yet) the data's first rows and row counts: what a run and `ddptune data` check
    before tokenizing. Returns them with the number of training rows (None where they were not read)."""
    problems = problems + sources.source_problems(cfg.model) + data_lib.data_file_problems(cfg.data)
    if problems:
        return problems, None
    return data_lib.check(cfg.data)


def code_problems(cfg: Config) -> list[str]:
    """What needs the model's code: its layers against lora.target_modules, bitsandbytes importing
    for QLoRA, and the choices a benchmark forces through DDPTUNE_SPEED."""
    problems = []
    if cfg.train.method == "qlora":
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:  # noqa: BLE001 - installed but broken (a missing CUDA library, say)
            problems.append(f"train.method: qlora needs bitsandbytes, which cannot be imported ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:160]}) (reinstall it, or use method=lora)")
    if os.environ.get("DDPTUNE_SPEED", "").strip():  # what a benchmark forces (speed.FORCE_ENV; speed imports torch)
        from ddptune import speed

        try:
            speed.forced()
        except ConfigError as e:
            problems += e.problems
    from ddptune import model as model_lib

    return problems + model_lib.model_problems(cfg.model, cfg.lora, cfg.train.method, cfg.train.packing)
