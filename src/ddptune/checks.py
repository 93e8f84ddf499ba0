"""The config's values, checked section by section: every problem as 'field: what is wrong (fix)'.

`check_values(cfg)` answers what needs nothing but the config; every command asks it before it
starts work and raises its problems together in one ConfigError.
"""
from __future__ import annotations

import math

from ddptune.config import FLOORED, PACKED_ATTENTION, PROFILE_AFTER, Config, is_template_path, parse_rows, schedule_problems
from ddptune.yamlsafe import quoted


def check_values(cfg: Config) -> list[str]:
    """Problems with the config's values alone, each 'field: what is wrong (fix)', section by section."""
    problems = train_problems(cfg) + lora_problems(cfg) + data_problems(cfg) + eval_problems(cfg)
    t, d = cfg.train, cfg.data
    for spec, where in ((d.train_rows, "data.train_rows"), (d.val_rows, "data.val_rows")):
        try:
            parse_rows(spec)
        except ValueError:
            problems.append(f"{where}: {quoted(spec)} is not a row slice (write START:STOP, e.g. \"0:700\")")
    if t.profile_steps and t.max_steps is not None and t.max_steps < PROFILE_AFTER + t.profile_steps:
        problems.append(f"train.profile_steps: {t.profile_steps} steps after the first {PROFILE_AFTER} need "
                        f"train.max_steps >= {PROFILE_AFTER + t.profile_steps} (got {t.max_steps}; profile fewer steps or train longer)")
    return problems


def train_problems(cfg: Config) -> list[str]:
    """The train section's values (with the model's attention and eval.enabled that they must suit)."""
    problems: list[str] = []
    t, d = cfg.train, cfg.data
    if t.micro_batch_size < 1:
        problems.append("train.micro_batch_size: must be at least 1")
    if t.grad_accum is not None and t.effective_batch_size is not None:
        problems.append("train.grad_accum: set grad_accum or effective_batch_size, not both (e.g. add train.grad_accum=null)")
    if t.grad_accum is not None and t.grad_accum < 1:
        problems.append("train.grad_accum: must be at least 1")
    if t.effective_batch_size is not None and t.effective_batch_size < 1:
        problems.append("train.effective_batch_size: must be at least 1")
    if t.max_steps is not None and t.max_steps < 1:
        problems.append("train.max_steps: must be at least 1 (or null to train for `epochs`)")
    if not (math.isfinite(t.epochs) and t.epochs > 0):
        problems.append("train.epochs: must be a positive number")
    if not (math.isfinite(t.lr) and t.lr > 0):
        problems.append("train.lr: must be a positive number, e.g. 2e-4")
    if not 0 <= t.min_lr_ratio < 1:
        problems.append("train.min_lr_ratio: must be in [0, 1), e.g. 0.1")
    elif t.min_lr_ratio and t.lr_schedule not in FLOORED:
        problems.append(f"train.min_lr_ratio: {t.lr_schedule} has no floor (use train.lr_schedule=cosine_with_min_lr "
                        "or warmup_stable_decay, or set train.min_lr_ratio=0)")
    if not 0 < t.decay_ratio <= 1:
        problems.append("train.decay_ratio: must be in (0, 1], e.g. 0.1")
    if t.max_steps is not None and t.max_steps >= 1:
        problems += schedule_problems(t, t.max_steps)
    if not (math.isfinite(t.weight_decay) and t.weight_decay >= 0):
        problems.append("train.weight_decay: must be 0 or a positive number")
    if not (math.isfinite(t.max_grad_norm) and t.max_grad_norm >= 0):
        problems.append("train.max_grad_norm: must be 0 (off) or a positive number")
    for name in ("warmup_steps", "save_every", "val_every", "profile_steps"):
        if getattr(t, name) < 0:
            problems.append(f"train.{name}: must be 0 or more")
    if t.keep_checkpoints < 1:
        problems.append("train.keep_checkpoints: must be at least 1")
    if not (math.isfinite(t.timeout_minutes) and t.timeout_minutes > 0):
        problems.append("train.timeout_minutes: must be a positive number of minutes, e.g. 10")
    if not (math.isfinite(t.save_every_minutes) and t.save_every_minutes >= 0):
        problems.append("train.save_every_minutes: must be 0 (off) or a positive number of minutes")
    if t.save_lead_seconds is not None and not (math.isfinite(t.save_lead_seconds) and t.save_lead_seconds > 0):
        problems.append("train.save_lead_seconds: must be a positive number of seconds, e.g. 120 (or null: no check)")
    if not 0 <= t.seed < 2**32:
        problems.append(f"train.seed: {t.seed} is outside 0..{2**32 - 1} (numpy and torch seeds are 32-bit)")
    if t.packing and t.tokens_per_forward < d.max_length:
        problems.append(f"train.tokens_per_forward: {t.tokens_per_forward} is shorter than data.max_length {d.max_length} (raise it)")
    if t.cuda_graphs is True and (not t.packing or t.compile is False or t.strategy == "fsdp"):
        problems.append("train.cuda_graphs: needs train.packing=true, train.compile not false and train.strategy=ddp "
                        "(graphs replay the compiled layers at a few padded lengths; FSDP gathers weights around each layer), "
                        "or set train.cuda_graphs=auto")
    if t.packing and cfg.model.attn_implementation not in PACKED_ATTENTION:
        problems.append(f"train.packing: needs model.attn_implementation in {list(PACKED_ATTENTION)} "
                        f"({cfg.model.attn_implementation} would attend across the whole packed row): use varlen, or set train.packing=false")
    if t.strategy == "fsdp" and cfg.eval.enabled:
        problems.append("eval.enabled: generation is not run under train.strategy=fsdp (the processes' greedy "
                        "decodes would have to stay in step); set eval.enabled=false and score the saved model "
                        "afterwards with `ddptune eval OUTPUT_DIR`")
    return problems


def lora_problems(cfg: Config) -> list[str]:
    """The lora section's values (with train.method and train.strategy that they must suit)."""
    t, lo = cfg.train, cfg.lora
    return [line for bad, line in (
        (lo.r < 1, "lora.r: must be at least 1"),
        (lo.dropout is not None and not 0 <= lo.dropout < 1, "lora.dropout: must be in [0, 1) or null"),
        (not (math.isfinite(lo.alpha) and lo.alpha > 0), "lora.alpha: must be a positive number, e.g. 2 x lora.r"),
        (not lo.target_modules, 'lora.target_modules: empty (name modules, e.g. [q_proj, v_proj], or ["all-linear"])'),
        (lo.modules_to_save and t.method == "full", "lora.modules_to_save: full fine-tuning trains every module already "
         "(set lora.modules_to_save=[])"),
        (lo.use_dora and t.method == "qlora" and t.strategy == "fsdp", "lora.use_dora: not with qlora under FSDP (DoRA reads "
         "each gathered 4-bit weight without its quantization state): use train.strategy=ddp or train.method=lora")) if bad]


def data_problems(cfg: Config) -> list[str]:
    """The data section's values: its chat template and its length."""
    problems: list[str] = []
    d = cfg.data
    if d.chat_template is not None and not is_template_path(d.chat_template) and not ("{{" in d.chat_template or "{%" in d.chat_template):
        problems.append("data.chat_template: neither a .jinja file's path nor a Jinja template (give one, or null)")
    if d.template == "none" and (d.system_prompt is not None or d.chat_template is not None):
        problems.append(f"data.{'system_prompt' if d.system_prompt is not None else 'chat_template'}: no chat template "
                        "with data.template=none (set data.template=chat, or write it into the prompts)")
    if d.max_length < 16:
        problems.append("data.max_length: must be at least 16 tokens")
    return problems


def eval_problems(cfg: Config) -> list[str]:
    """The eval section's values, and the validation set that evaluation needs."""
    problems: list[str] = []
    t, d = cfg.train, cfg.data
    if cfg.eval.max_new_tokens < 1 or cfg.eval.batch_size < 1:
        problems.append("eval: max_new_tokens and batch_size must be at least 1")
    if cfg.eval.max_samples is not None and cfg.eval.max_samples < 1:
        problems.append("eval.max_samples: must be at least 1 (or null for every row)")
    if (cfg.eval.enabled or t.val_every) and d.val is None:
        problems.append("data.val: evaluation and val_every need a validation set (set data.val, e.g. to the train file with val_rows)")
    return problems
