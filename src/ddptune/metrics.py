"""The FLOP cost model, and the figures a run logs, from plain numbers (no collectives here).

FLOPs of one sample of n tokens, t of them loss targets (what MFU counts, and what balances the
processes' shares of a step; recomputation is not counted):
- N: weights of the decoder's linear layers; H: the output head's. A token that attends to c keys
  costs 4·c·h per layer forward (QK^T: 2·c·h, AV: 2·c·h; h = heads × head dim); in a causal sample
  of n tokens the tokens attend to Σ c = n(n+1)/2 keys (`attended_keys`); in a layer with a sliding
  window of w keys, to Σ min(i, w) over i = 1..n. Never across samples.
- The head runs only at summary positions (the loss needs no other logits): H per target token.
- full fine-tuning: forward 2 + backward 4 (input and weight gradients) = 6 per weight, attention ×3.
- LoRA / QLoRA: frozen weights need forward 2 and input gradients 2 = 4 per weight; the adapters
  (r·(d_in+d_out) each) 6 per weight; attention ×3.
- A mixture of experts: N counts the experts a token meets (experts per token × one expert's weights).
So sample_flops = w·(N·n + H·t) + 6·A·n + 3·4·h·Σ_layers keys(n), with w = 4 (LoRA) or 6 (full).
"""
from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass

import numpy as np
import torch

WARMUP_STEPS = 2  # steps left out of steady-state speed figures (compilation, allocator, kernel selection)
# MFU's denominator: the datasheet's dense bf16 rate (TFLOP/s); DDPTUNE_PEAK_TFLOPS overrides it.
DATASHEET_TFLOPS = {"NVIDIA H200": 989.0, "NVIDIA H100 80GB HBM3": 989.0, "NVIDIA A100-SXM4-80GB": 312.0}


def per_weight_flops(method: str, checkpointing: bool = False) -> int:
    """FLOPs per weight and token of one training step: forward 2, backward 2 (frozen weights:
    input gradients) or 4 (weight gradients too), plus 2 for the forward that checkpointing repeats."""
    return 2 + (4 if method == "full" else 2) + (2 if checkpointing else 0)


def attended_keys(lengths: list[int], window: int | None = None) -> int:
    """Keys attended, summed over all tokens of causal samples of these lengths (Σ n(n+1)/2), or within a
    sliding window of `window` keys."""
    return int(sum(keys(n, window) for n in lengths))


def keys(n, window: int | None = None):
    """Keys the n tokens of one causal sample attend to, all together (n may be an array of lengths): n(n+1)/2,
    or within a sliding window of w keys, Σ min(i, w) = m(m+1)/2 + (n - m)·w with m = min(n, w)."""
    if window is None:
        return n * (n + 1) / 2
    m = np.minimum(n, window)
    return m * (m + 1) / 2 + (n - m) * window


@dataclass(frozen=True)
class FlopModel:
    n_matrix: int   # decoder linear weights (4-bit ones unpacked)
    n_head: int     # output head weights
    n_adapter: int  # trained adapter weights (0 for full fine-tuning)
    n_layers: int
    hidden: int     # attention width: heads × head dim
    method: str
    windows: tuple = ()  # each layer's sliding window in keys (None: every earlier key); empty: none anywhere

    @classmethod
    def of(cls, model, method: str, a=None) -> "FlopModel":
        """The counts of a loaded model; `a`: its arch.Arch (sliding windows, experts), where it defines them."""
        head = model.get_output_embeddings()
        n_head = head.in_features * head.out_features
        n_matrix = sum(m.in_features * m.out_features for name, m in model.named_modules()
                       if isinstance(m, torch.nn.Linear) and "lora_" not in name and m is not head)
        n_adapter = 0 if method == "full" else sum(p.numel() for p in model.parameters() if p.requires_grad)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        hidden = cfg.num_attention_heads * getattr(cfg, "head_dim", None) if getattr(cfg, "head_dim", None) else cfg.hidden_size
        if a is not None and a.moe:  # the experts' stacked (3-D) weights: a token meets experts_per_token of them
            n_matrix += sum(p.numel() for p in model.parameters() if p.dim() == 3) * a.experts_per_token // a.experts
        windows = a.windows if a is not None and a.windowed else ()
        return cls(n_matrix, n_head, n_adapter, cfg.num_hidden_layers, hidden, method, windows)

    @classmethod
    def of_shape(cls, shape, method: str, lora_r: int, lora_targets: list[str]) -> "FlopModel":
        """The same counts from a memory.Shape (a Llama-style decoder), before any weight is loaded."""
        adapter = 0 if method == "full" else shape.lora_params(lora_r, lora_targets)
        return cls(shape.matrix_params, shape.vocab * shape.hidden, adapter, shape.layers, shape.attn_width, method,
                   shape.windows)

    def sample(self, tokens: int, targets: int) -> float:
        """Model FLOPs of training on one sample (the module docstring's formula)."""
        w = per_weight_flops(self.method)
        windows = self.windows or (None,) * self.n_layers
        attention = 3 * 4 * self.hidden * sum(windows.count(w) * keys(tokens, w) for w in set(windows))
        return w * (self.n_matrix * tokens + self.n_head * targets) + 6 * self.n_adapter * tokens + attention


def peak_tflops(device: torch.device) -> float | None:
    """MFU's denominator: the GPU's datasheet dense bf16 rate in TFLOP/s (None on CPU and for a GPU
    not in DATASHEET_TFLOPS: MFU is then not reported)."""
    if os.environ.get("DDPTUNE_PEAK_TFLOPS"):
        return float(os.environ["DDPTUNE_PEAK_TFLOPS"])
    if device.type != "cuda":
        return None
    return DATASHEET_TFLOPS.get(torch.cuda.get_device_name(device))


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


# ---------------------------------------------------------------------------------------------
# What a run logs: one row per optimizer step, the processes' times, and the summary.


def step_row(step: int, loss: float, lr: float, grad_norm: float, samples: int, tokens: int, targets: int,
             computed: int, forwards: int, flops: float, times: dict, balance: float, world: int,
             peak: float | None, peak_mem: float | None) -> dict:
    """metrics.jsonl's line for one optimizer step. `times` are rank 0's (`dist.StepClock`), the
    counts are over all processes, `balance` = the busiest process's predicted cost / the mean."""
    dt = times["step_s"]
    row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "samples": samples, "tokens": tokens,
           "target_tokens": targets, "padded_tokens": computed, "forwards": forwards, "step_time_s": dt,
           "tokens_per_s": tokens / dt, "tokens_per_s_per_gpu": tokens / dt / world,
           "compute_s": times["compute_s"], "wait_s": times["wait_s"], "optimizer_s": times["optimizer_s"],
           "host_s": times["host_s"], "balance": balance}
    if peak:
        row["mfu"] = flops / dt / world / (peak * 1e12)
        row["peak_mem_gib"] = peak_mem
    return row


def slow_rank(seconds: list[float], factor: float = 2.0, margin_s: float = 0.5) -> tuple[int, float, float] | None:
    """(rank, its seconds, the others' median) when one process's step took more than `factor`
    times the others' median and `margin_s` longer (a slow or busy machine), else None."""
    if len(seconds) < 2:
        return None
    rank = max(range(len(seconds)), key=seconds.__getitem__)
    others = statistics.median(s for i, s in enumerate(seconds) if i != rank)
    if seconds[rank] > factor * others and seconds[rank] - others > margin_s:
        return rank, seconds[rank], others
    return None


def rank_rows(first_step: int, per_rank: list[list[dict]], shares: list[dict]) -> list[dict]:
    """ranks.jsonl: for each step, every process's times and share side by side (lists in rank order)."""
    rows = []
    for k, share in enumerate(shares):
        row = {"step": first_step + k + 1, **share}  # tokens, cost and computed tokens per process
        for key in ("compute_s", "wait_s", "optimizer_s", "step_s"):
            row[key] = [times[k][key] for times in per_rank]
        rows.append(row)
    return rows


def split(rows: list[dict]) -> dict:
    """Where a step's time goes, averaged over `rows` (ranks.jsonl lines), with standard errors:
    step = mean compute + imbalance (slowest - mean compute) + exposed communication (the slowest
    process's wait: it waits for nobody) + rest (optimizer, data, gaps between steps).
    imbalance_costed_s: the imbalance the processes' shares predict (`predicted_excess`), as
    seconds of the mean compute; what the measured imbalance has beyond it comes from the GPUs on
    work of equal cost. Which: slowest_steps counts, for each process, the steps it was the slowest
    in, and compute_offset_s is its mean compute minus the step's mean. The same process slowest
    step after step is one GPU slower than the others; a different one each time, their spread."""
    parts = {k: [] for k in ("step_s", "compute_s", "slowest_compute_s", "imbalance_s", "imbalance_costed_s",
                             "exposed_comm_s", "rest_s")}
    world = len(rows[0]["compute_s"]) if rows else 0
    slowest_steps, offsets = [0] * world, [[] for _ in range(world)]
    for r in rows:
        slowest = max(range(len(r["compute_s"])), key=lambda i: r["compute_s"][i])
        step = r["step_s"][0]
        mean = statistics.fmean(r["compute_s"])
        slowest_steps[slowest] += 1
        for i, t in enumerate(r["compute_s"]):
            offsets[i].append(t - mean)
        parts["step_s"].append(step)
        parts["compute_s"].append(mean)
        parts["slowest_compute_s"].append(r["compute_s"][slowest])
        parts["imbalance_s"].append(r["compute_s"][slowest] - mean)
        excess = predicted_excess(r)
        if excess is not None:
            parts["imbalance_costed_s"].append(mean * excess)
        parts["exposed_comm_s"].append(r["wait_s"][slowest])
        parts["rest_s"].append(step - r["compute_s"][slowest] - r["wait_s"][slowest])
    out = {"steps": len(rows), "slowest_steps": slowest_steps,
           "compute_offset_s": [statistics.fmean(v) if v else None for v in offsets]}
    for k, v in parts.items():
        out[k] = statistics.fmean(v) if v else None
        out[k + "_se"] = statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else None
    return out


def predicted_excess(rank_row: dict) -> float | None:
    """How much more work the busiest process had than the mean in one ranks.jsonl line, from its
    shares: each process's model FLOPs (cost, real tokens) scaled by the tokens it computed over
    its real ones (padding does the work of real tokens, near enough). None for lines without costs."""
    cost, tokens, computed = (rank_row.get(k) for k in ("cost", "tokens", "computed"))
    if not cost:
        return None
    work = [c * (p / t if t else 1.0) for c, t, p in zip(cost, tokens, computed)] if computed and tokens else cost
    mean = statistics.fmean(work)
    return max(work) / mean - 1 if mean > 0 else None


def summarize_steps(history: list[dict], warmup: int, world: int) -> dict:
    """Steady-state figures over the steps after the first `warmup`."""
    kept = history[min(warmup, max(len(history) - 1, 0)):]
    times = sorted(r["step_time_s"] for r in kept) or [0.0]
    seconds = sum(r["step_time_s"] for r in kept)
    mfus = [r["mfu"] for r in kept if "mfu" in r]
    return {"warmup_steps_excluded": len(history) - len(kept), "median_step_time_s": times[len(times) // 2],
            "tokens_per_s_per_gpu": sum(r["tokens"] for r in kept) / seconds / world if seconds else 0.0,
            "mfu": statistics.fmean(mfus) if mfus else None}
