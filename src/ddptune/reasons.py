"""Why each speed choice is what it is: a code with its numbers (the record), and the one place it becomes prose.

`speed.decide` gives every choice a `Reason`; summary.json's `speed` and `ddptune plan --json` hold each as
{"code": ..., **numbers}, and the run's banner and `ddptune plan` print `render`'s line for it. A code names
one case and keeps its meaning; its numbers are the ones its line shows (seconds a step, GiB, MiB) and the
setting or cause it names. Nothing else turns a reason into words.
"""
from __future__ import annotations

from dataclasses import dataclass, field

FORCED_BY = "DDPTUNE_SPEED"  # speed.FORCE_ENV: what a benchmark sets to force a choice
SETTINGS = {"compiled layers": "train.compile", "gradient checkpointing": "train.gradient_checkpointing",
            "CUDA graphs": "train.cuda_graphs"}  # the config key a `set_by_config` reason names
RECORDED = {"step": "the whole step", "layers": "each layer (an 8-bit optimizer cannot be recorded)"}


@dataclass(frozen=True, kw_only=True)
class Reason:
    """A choice's reason: a stable snake_case code and the numbers its line shows (plain floats, ints,
    strings, bools; None where a figure does not exist)."""
    code: str
    numbers: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """The record: {"code": ..., **numbers}."""
        return {"code": self.code, **self.numbers}


def render(name: str, reason: Reason) -> str:
    """The line the banner prints for choice `name` and its `reason`: `name: choice (why)`."""
    n, code = reason.numbers, reason.code
    if code == "forced":
        return f"{name}: {_choice(name, n)} ({FORCED_BY})"
    if code == "set_by_config":
        return f"{name}: {_choice(name, n)} ({SETTINGS[name]}={n['setting']})"
    line = LINES[code]
    return f"{name}: {line(n) if callable(line) else line.format(**n)}"


def _choice(name: str, n: dict) -> str:
    """What was chosen, in the words of the choice's line (a forced or configured one)."""
    if name == "4-bit base":
        return "kept dequantized in bf16" if n["dequantized"] else "4-bit"
    if name == "CUDA graphs":
        return n["graphs"] + (f", {_lengths(n['lengths'])}" if n["lengths"] else "")
    if name == "DDP gradient buckets":
        return f"{n['bucket_mb']:g} MiB"
    return "on" if n["on"] else "off"


def _lengths(k: int) -> str:
    return f"{k} padded length{'s' if k > 1 else ''}"


def _against(n: dict, words: str) -> str:
    return "" if n.get("other_step_s") is None else f" against {n['other_step_s']:.3g} s {words}"


def _dequantized(n: dict) -> str:
    return (f"kept dequantized in bf16 (no dequantizing in every pass: an estimated {n['step_s']:.3g} s a step"
            f"{_against(n, 'with the 4-bit one')}; about {n['memory_gib']:.1f} GiB)")


def _recorded(n: dict) -> str:
    return (f"{RECORDED[n['graphs']]}, {_lengths(n['lengths'])} (an estimated {n['step_s']:.3g} s a step"
            f"{_against(n, 'without')}; about {n['setup_s']:.0f} s to compile and record before the first step)")


LINES = {  # code: its line after the choice's name (a str.format template of its numbers, or a function of them)
    # compiled layers
    "cuda": "on (CUDA)",
    "cpu": "off (CPU: compiling costs more than a short run saves; train.compile=true compiles)",
    "dynamic_layers": "off ({why}: compiled, they would break into pieces and compile again; train.compile=true compiles)",
    "compile_failed": "off ({why}: fell back to eager layers)",
    # gradient checkpointing
    "no_budget": "off (no memory budget known)",
    "does_not_fit_without": ("on (without it the run needs about {memory_gib:.1f} GiB, more than {share:.0%} of the "
                             "{free_gib:.1f} GiB free)"),
    "fits_without": "off (about {memory_gib:.1f} GiB of the {free_gib:.1f} GiB free)",
    # 4-bit base
    "fsdp_shards_4bit": ("4-bit (train.strategy=fsdp shards the 4-bit base: dequantized, every process would first "
                         "hold it whole in bf16)"),
    "cpu_base_as_loaded": "4-bit (CPU: the base stays as it loaded)",
    "dequantized_faster": _dequantized,
    "not_tried_with_both": "4-bit (a dequantized base is not tried with checkpointing and CUDA graphs together: measured slower)",
    "dequantized_does_not_fit": "4-bit (dequantized it would need about {memory_gib:.1f} GiB, more than {budget_gib:.1f} GiB)",
    "four_bit_faster": "4-bit (an estimated {step_s:.3g} s a step against {other_step_s:.3g} s dequantized)",
    # CUDA graphs
    "unrecordable": "off ({why})",
    "graphs_faster": _recorded,
    "graphs_only_option": _recorded,
    "graphs_do_not_fit": "off (with them the run would not fit the free memory)",
    "graphs_not_faster": "off (an estimated {step_s:.3g} s a step without them against {other_step_s:.3g} s with them)",
    "recording_failed": "off ({why}: compiled layers launched one by one)",
    "eager_layers": "off (eager layers)",
    # combined kernels
    "launched_one_by_one": ("on (layers launched one by one: Inductor launches independent kernels together, "
                            "fewer launches a step)"),
    "not_compiled": "off (compiled layers are off)",
    "no_cuda": "off (no CUDA device)",
    "step_recorded": "off (the step is recorded: its launches cost the host nothing)",
    "combo_failed": "off ({why}: compiled layers without them)",
    # DDP gradient buckets
    "fsdp_reduce_scatters": "none (FSDP reduce-scatters each layer's gradients)",
    "one_process": "none (one process: nothing to all-reduce)",
    "nvlink_one_bucket": ("one of {bucket_mb:g} MiB after the backward (NVLink: one all-reduce of {gradients_mib:.0f} MiB "
                          "of gradients)"),
    "overlapping_buckets": "torch's 25 MiB buckets, all-reduced while the backward runs",
    "cpu_processes": "torch's 25 MiB buckets, all-reduced while the backward runs (CPU processes)",
}
