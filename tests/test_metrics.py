"""The FLOP count behind MFU, and the metrics file on resume."""
from __future__ import annotations

import json

import pytest
import torch

from ddptune import metrics, model as model_lib


def test_flops_per_token_follows_the_written_formula():
    # LoRA: 4 per frozen weight, the head only on the target fraction, 6 per adapter weight, attention 3 x 4ch per layer
    f = metrics.flops_per_token(n_matrix=1000, n_head=200, n_adapter=10, n_layers=2, hidden=8, mean_context=5,
                                method="lora", head_fraction=0.25)
    assert f == pytest.approx(4 * (1000 + 50) + 60 + 3 * 4 * 5 * 8 * 2)
    full = metrics.flops_per_token(1000, 200, 0, 2, 8, 5, "full")
    assert full == pytest.approx(6 * 1200 + 3 * 4 * 5 * 8 * 2)
    # samples of 1 and 3 tokens: keys attended 1 | 1 + 2 + 3 -> 7
    assert metrics.attended_keys([1, 3]) == 7


def test_matrix_weights_split_body_and_head():
    m = model_lib.build_preset("tiny", 0, torch.float32, torch.device("cpu"))
    body, head = metrics.matrix_weights(m)
    assert head == 64 * 320
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128  # q,o + k,v (2 kv heads of 16) + gate,up,down
    assert body == 2 * per_layer


def test_metrics_file_drops_steps_that_a_resume_redoes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)))
    w = metrics.JsonlWriter(path, keep_until_step=3)
    w.write({"step": 4, "loss": 0.5})
    w.close()
    assert [r["step"] for r in metrics.read_jsonl(path)] == [1, 2, 3, 4]
