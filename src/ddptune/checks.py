"""Everything that must hold before a run starts, checked once, by the process that talks to the user.

`validate(cfg, world_size, resume)` collects every problem (values, the model source and tokenizer,
the data files and their columns, the output folder, a resume's saved config, rows against the
global batch; then what needs the model's code: its layers against lora.target_modules,
bitsandbytes for QLoRA) and raises them together as one `ConfigError`, or returns the batch plan.
The first checks import neither torch nor transformers, so a refusal they find comes at once; the
model's code is imported only when they all pass. The CLI calls it in the parent before `--nproc`
starts any process; under an external launcher, rank 0 calls it and the others wait for its
answer (`dist.on_main`).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

from ddptune import batchplan, config as config_lib, data as data_lib, launch, rundir
from ddptune import sources, tokenized
from ddptune.batchplan import BatchPlan
from ddptune.config import Config, ConfigError


def validate(cfg: Config, world_size: int, resume: bool = False, overwrite: bool = False,
             output: bool = True) -> BatchPlan:
    """Every problem of a run's config, its data, its model source and (unless `output` is false: a
    node other than the first of a multi-node job, which writes nothing) its output_dir. Where all of
    that holds, the data is prepared (tokenized.prepare, every row checked) when it and its tokenizer
    are here (hub data or a hub tokenizer: train.setup prepares it)."""
    problems = config_lib.check_values(cfg)
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
    if not problems and local and (tokenizer := local_tokenizer(cfg)) is not None:
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
    return problems + model_problems(cfg)


@contextlib.contextmanager
def loading(m: config_lib.ModelConfig, what: str):
    """Around loading the tokenizer or the model after validation: what the files or the hub make
    fail (a hub that cannot be reached, files that are not a tokenizer's or a model's) becomes one
    line naming the field, not a traceback. For the model only OSError, ValueError and a damaged
    safetensors file: others (out of memory, say) are not the config's."""
    from safetensors import SafetensorError  # a weights file that is cut or not safetensors

    kinds = Exception if what == "tokenizer" else (OSError, ValueError, SafetensorError)
    try:
        yield
    except (ConfigError, launch.Stopped):
        raise
    except kinds as e:
        field = "model.tokenizer" if what == "tokenizer" and m.tokenizer else "model.source"
        name = m.tokenizer if field == "model.tokenizer" else m.source
        raise ConfigError([f"{field}: the {what} of {name} cannot be loaded ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:200]}) (check the files, the network or HF_HUB_OFFLINE)"]) from None


def model_problems(cfg: Config) -> list[str]:
    """The model source can be used, and every lora.target_modules and lora.modules_to_save name matches one of
    its layers (read from its config on the meta device: no weights are loaded). Hub models are not fetched here."""
    if problems := sources.source_problems(cfg.model):
        return problems
    src, lo = sources.resolve_source(cfg.model), cfg.lora
    listed = [("target_modules", n) for n in lo.target_modules if lo.target_modules != ["all-linear"]]
    listed += [("modules_to_save", n) for n in lo.modules_to_save]
    layers = None if cfg.train.method == "full" or not listed else layer_names(src, cfg)
    if isinstance(layers, str):
        return [layers]
    problems = []
    for key, target in listed if layers is not None else []:
        found = [kind for n, kind in layers.items() if n == target or n.endswith("." + target)]
        if not found:
            hint = " (all-linear works only alone: [all-linear])" if target == "all-linear" else ""
            leaves = sorted({n.rsplit(".", 1)[-1] for n in layers})
            problems.append(f"lora.{key}: {target!r} matches no layer of {cfg.model.source}{hint} "
                            f"(its layers: {', '.join(leaves)})")
        elif key == "modules_to_save" and cfg.train.method == "qlora" and "linear" in found:
            problems.append(f"lora.modules_to_save: {target!r} is a 4-bit layer under qlora, which cannot be trained whole "
                            "(save the embeddings or output head only, e.g. [lm_head], or adapt it through lora.target_modules)")
    return problems


def layer_names(src, cfg: Config) -> dict[str, str] | str | None:
    """The layers LoRA can adapt or train whole, by name: "linear", "embedding" or "head" (the output head, which
    QLoRA leaves unquantized), from the model's config alone; a problem line when that config cannot be read;
    None for hub models (not fetched to validate)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ddptune import model as model_lib

    try:
        if src.kind == "preset":
            arch = model_lib.preset_config(src.path, "sdpa")
        elif src.kind in ("local", "gguf"):
            arch = AutoConfig.from_pretrained(src.path, gguf_file=src.gguf_file, trust_remote_code=cfg.model.trust_remote_code)
        else:
            return None
        with torch.device("meta"):
            net = AutoModelForCausalLM.from_config(arch, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a broken config.json or GGUF header, an unknown architecture
        reason = " ".join(str(e).split())[:200]
        return f"model.source: the model's config cannot be read ({type(e).__name__}: {reason})"
    head = net.get_output_embeddings()
    return {n: "head" if m is head else "linear" if isinstance(m, torch.nn.Linear) else "embedding"
            for n, m in net.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}


def local_tokenizer(cfg: Config):
    """The run's tokenizer where it can be read here (not a hub id, which the run fetches), else None."""
    m = cfg.model
    if not (Path(m.tokenizer).is_dir() if m.tokenizer else sources.resolve_source(m).kind != "hub"):
        return None
    from ddptune import model as model_lib  # (the model's code: only once the light checks have passed)

    with loading(m, "tokenizer"):
        return model_lib.load_tokenizer(m, cfg.data)
