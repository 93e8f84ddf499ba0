"""Throughput, memory and model-FLOP figures from plain numbers (no collectives here).

FLOPs per real token (what MFU counts; activation recomputation is not counted):
- N: weights of the decoder's linear layers; H: the output head's. A token that attends to c
  keys costs 4·c·h per layer forward (QK^T: 2·c·h, AV: 2·c·h; h = heads × head dim). Within a
  causal sample of length n a token attends to (n+1)/2 keys on average, so over a step
  c = Σ n(n+1)/2 / Σ n (`attended_keys` / tokens). Attention never spans two packed samples.
- The head runs only at summary positions (the loss needs no other logits), so it counts for
  the fraction f of real tokens that are loss targets: H·f instead of H.
- full fine-tuning: forward 2 + backward 4 (input and weight gradients) = 6 per weight, attention ×3.
- LoRA / QLoRA: frozen weights need forward 2 and input gradients 2 = 4 per weight; the adapters
  (r·(d_in+d_out) each) 6 per weight; attention ×3.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

# bf16 dense matrix rate measured on the H200s this project benchmarks on (see BENCHMARKS.md);
# override with DDPTUNE_PEAK_TFLOPS for other GPUs.
MEASURED_PEAK_TFLOPS = {"NVIDIA H200": 780.0, "NVIDIA H100 80GB HBM3": 780.0}


def matrix_weights(model) -> tuple[int, int]:
    """(decoder linear weights, output head weights) of the base model; 4-bit ones unpacked."""
    head = model.get_output_embeddings()
    n_head = head.in_features * head.out_features
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lora_" not in name and mod is not head:
            n += mod.in_features * mod.out_features
    return n, n_head


def flops_per_token(n_matrix: int, n_head: int, n_adapter: int, n_layers: int, hidden: int, mean_context: float,
                    method: str, head_fraction: float = 1.0) -> float:
    attn_fwd = 4.0 * mean_context * hidden * n_layers
    per_weight = 6.0 if method == "full" else 4.0
    return per_weight * (n_matrix + n_head * head_fraction) + 6.0 * n_adapter + 3 * attn_fwd


def attended_keys(lengths: list[int]) -> int:
    """Keys attended, summed over all tokens of causal samples of these lengths (Σ n(n+1)/2)."""
    return sum(n * (n + 1) // 2 for n in lengths)


def peak_tflops(device: torch.device) -> float | None:
    """The GPU's bf16 matrix rate in TFLOP/s (None on CPU: MFU is a GPU figure)."""
    if os.environ.get("DDPTUNE_PEAK_TFLOPS"):
        return float(os.environ["DDPTUNE_PEAK_TFLOPS"])
    if device.type != "cuda":
        return None
    return MEASURED_PEAK_TFLOPS.get(torch.cuda.get_device_name(device))


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


class JsonlWriter:
    """Append one JSON object per line; flushed at once so a crash loses nothing written."""

    def __init__(self, path: Path, keep_until_step: int | None = None):
        self.path = Path(path)
        if keep_until_step is not None and self.path.exists():  # resume: drop steps to be redone
            lines = [l for l in self.path.read_text().splitlines() if l and json.loads(l)["step"] <= keep_until_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(l + "\n" for l in lines))
            os.replace(tmp, self.path)
        self.f = open(self.path, "a")

    def write(self, row: dict) -> None:
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]
