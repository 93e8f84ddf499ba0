"""The FLOP cost model behind MFU and the shares, the step's time split, and the metrics file on resume."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ddptune import metrics, model as model_lib, runlog


def test_sample_flops_follow_the_written_formula():
    # LoRA: 4 per frozen weight and token, the head only at targets, 6 per adapter weight, attention 3 x 4h per key
    f = metrics.FlopModel(n_matrix=1000, n_head=200, n_adapter=10, n_layers=2, hidden=8, method="lora")
    assert f.sample(tokens=3, targets=1) == pytest.approx(4 * (1000 * 3 + 200 * 1) + 6 * 10 * 3 + 3 * 4 * 8 * 2 * 6)
    full = metrics.FlopModel(1000, 200, 0, 2, 8, "full")
    assert full.sample(3, 1) == pytest.approx(6 * (1000 * 3 + 200) + 3 * 4 * 8 * 2 * 6)
    # samples of 1 and 3 tokens: keys attended 1 | 1 + 2 + 3 -> 7
    assert metrics.attended_keys([1, 3]) == 7
    assert [metrics.per_weight_flops(m, c) for m, c in (("lora", False), ("qlora", True), ("full", False), ("full", True))] == [4, 6, 6, 8]


def test_a_sliding_window_counts_the_keys_each_token_sees():
    # window 2: tokens 1..5 see 1, 2, 2, 2, 2 keys; a sample shorter than the window is causal
    assert metrics.attended_keys([5], window=2) == 9 and metrics.attended_keys([2, 1], window=4) == 4
    lengths = np.array([1, 5, 40])
    assert list(metrics.keys(lengths, 3)) == [sum(min(i, 3) for i in range(1, n + 1)) for n in lengths]
    # one of two layers windowed: its attention term counts the window's keys, the other's all earlier keys
    f = metrics.FlopModel(1000, 200, 10, 2, 8, "lora", windows=(2, None))
    assert f.sample(5, 1) == pytest.approx(4 * (1000 * 5 + 200) + 6 * 10 * 5 + 3 * 4 * 8 * (9 + 15))
    assert list(f.sample(np.array([5, 1]), np.array([1, 1]))) == pytest.approx([f.sample(5, 1), f.sample(1, 1)])


@pytest.mark.parametrize("name", ["gemma3", "qwen3-moe", "gpt-oss"])
def test_the_flop_model_of_a_loaded_family_is_the_one_its_config_gives(name):
    """Before any weight is loaded (from the config's shape, as a run balances and reports) and from the
    loaded model: the same FLOPs for windowed layers and for the experts a token meets."""
    from test_architectures import family_config, family_model

    from ddptune import arch, memory

    loaded = metrics.FlopModel.of(family_model(name), "full", arch.of(family_config(name)))
    planned = metrics.FlopModel.of_shape(memory.shape_of(family_config(name)), "full", 8, ["all-linear"])
    assert loaded.windows == planned.windows
    for n in (4, 30, 200):
        assert loaded.sample(n, 1) == pytest.approx(planned.sample(n, 1), rel=0.02), n  # routers: outside the shape


def test_flop_model_of_a_real_model_splits_body_head_and_adapters():
    m = model_lib.build_preset("tiny", 0, torch.float32, torch.device("cpu"))
    f = metrics.FlopModel.of(m, "full")
    assert f.n_head == 64 * 320 and f.n_adapter == 0 and (f.n_layers, f.hidden) == (2, 64)
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128  # q,o + k,v (2 kv heads of 16) + gate,up,down
    assert f.n_matrix == 2 * per_layer


def test_time_split_adds_up_to_the_step():
    rows = [{"compute_s": [0.50, 0.40], "wait_s": [0.01, 0.11], "step_s": [0.53, 0.53]},
            {"compute_s": [0.45, 0.55], "wait_s": [0.12, 0.02], "step_s": [0.60, 0.60]}]
    s = metrics.split(rows)
    assert s["slowest_compute_s"] == pytest.approx(0.525) and s["compute_s"] == pytest.approx(0.475)
    assert s["imbalance_s"] == pytest.approx(0.05) and s["exposed_comm_s"] == pytest.approx(0.015)
    assert s["step_s"] == pytest.approx(s["compute_s"] + s["imbalance_s"] + s["exposed_comm_s"] + s["rest_s"])
    assert s["rest_s"] == pytest.approx(0.025)
    assert s["imbalance_costed_s"] is None  # no shares in these lines


def test_the_imbalance_the_shares_predict_counts_padding_as_work():
    """Equal costs and equal computed tokens predict no imbalance; a process whose rows were padded
    to a longer length computes more, though its samples cost the same; without `computed` (older
    ranks.jsonl files) the costs alone decide."""
    even = {"cost": [10.0, 10.0], "tokens": [100, 100], "computed": [128, 128]}
    padded = {"cost": [10.0, 10.0], "tokens": [100, 100], "computed": [128, 192]}
    uneven = {"cost": [9.0, 11.0], "tokens": [90, 110]}
    assert metrics.predicted_excess(even) == 0
    assert metrics.predicted_excess(padded) == pytest.approx(192 / 160 - 1)
    assert metrics.predicted_excess(uneven) == pytest.approx(11 / 10 - 1)
    assert metrics.predicted_excess({"tokens": [1, 2]}) is None
    times = {"compute_s": [0.50, 0.52], "wait_s": [0.02, 0.0], "step_s": [0.53, 0.53]}
    s = metrics.split([{**even, **times}, {**padded, **times}])
    assert s["imbalance_s"] == pytest.approx(0.01)
    assert s["imbalance_costed_s"] == pytest.approx((0 + 0.51 * 0.2) / 2)


def test_split_tells_one_slower_gpu_from_a_different_one_each_step():
    """As measured on one pair of H200s: on the same padded work GPU 1 was slower in most steps.
    split counts the steps each process was the slowest in and its mean offset from the step's mean."""
    steady = [{"compute_s": [0.230, 0.233 + 0.001 * (k % 3)], "wait_s": [0.003, 0.0], "step_s": [0.24, 0.24]}
              for k in range(12)]
    s = metrics.split(steady)
    assert s["slowest_steps"] == [0, 12]
    assert s["compute_offset_s"] == pytest.approx([-0.0020, 0.0020], abs=1e-6)
    alternating = [{"compute_s": [0.230, 0.232][::1 if k % 2 else -1], "wait_s": [0.0, 0.0], "step_s": [0.24, 0.24]}
                   for k in range(12)]
    assert metrics.split(alternating)["slowest_steps"] == [6, 6]
    assert metrics.split(alternating)["compute_offset_s"] == pytest.approx([0.0, 0.0], abs=1e-9)


def test_metrics_file_drops_steps_that_a_resume_redoes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)))
    w = runlog.JsonlWriter(path, keep_until_step=3)
    w.write({"step": 4, "loss": 0.5})
    w.close()
    assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_a_step_after_validation_or_a_save_is_timed_from_its_own_start():
    """Validation and checkpoint saves between steps are eval and saving time, not the next step's
    (a tiny run validating 560 rows once showed a 2 s step among 0.05 s ones and a tenth of its tok/s)."""
    import time

    from ddptune import dist

    clock = dist.StepClock(torch.device("cpu"))

    def step():
        clock.start()
        clock.mark("synced")
        return clock.finish()

    step()
    time.sleep(0.2)  # between two steps with nothing else: the host's own gap, part of the step
    assert clock.read(step())["step_s"] >= 0.2
    time.sleep(0.6)  # validation
    clock.pause()
    assert clock.read(step())["step_s"] < 0.5  # an empty step, even on a busy machine; 0.6 s more with the validation


def test_a_steps_host_time_is_the_hosts_own_time_to_issue_it():
    """host_s counts the host's time from a step's start to its end, not the time between steps:
    well under step_s, the host kept ahead of the device."""
    import time

    from ddptune import dist

    clock = dist.StepClock(torch.device("cpu"))

    def step(issuing: float) -> dict:
        clock.start()
        time.sleep(issuing)  # the host issuing work
        clock.mark("synced")
        return clock.finish()

    clock.read(step(0.0))
    time.sleep(0.6)  # between steps: part of the next step's time, not of its issuing
    times = clock.read(step(0.05))
    assert times["step_s"] >= 0.65 and 0.05 <= times["host_s"] < 0.6  # 0.05 s and some; 0.65 s with the gap
    row = metrics.step_row(step=1, loss=1.0, lr=0.1, grad_norm=1.0, samples=4, tokens=100, targets=50, computed=100, forwards=1,
                           flops=1e9, times=times, balance=1.0, world=1, peak=None, peak_mem=None)
    assert row["host_s"] == times["host_s"]
