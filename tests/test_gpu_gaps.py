"""benchmarks/gpu_gaps.py: idle time of the device in a profiler trace, per step and between steps."""
from __future__ import annotations

import importlib.util

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("gpu_gaps", ROOT / "benchmarks" / "gpu_gaps.py")
gpu_gaps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_gaps)


def kernel(ts, dur, name="k"):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_gaps_inside_and_between_steps():
    events = [
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#2", "ts": 1300, "dur": 1000},
        kernel(0, 400, "fwd"), kernel(300, 300, "overlapping"), kernel(800, 200, "optimizer"),  # idle 600-800 inside
        kernel(1300, 1000, "next forward"),  # 300 µs between the steps: the host stall
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},  # host activity is not device activity
    ]
    out = gpu_gaps.analyse({"traceEvents": events})
    assert out["window_ms"] == pytest.approx(2.3) and out["busy_ms"] == pytest.approx(1.8)
    assert out["idle_fraction"] == pytest.approx(0.5 / 2.3) and out["gaps_over_100us"] == 2
    assert out["largest_gaps"][0] == {"ms": pytest.approx(0.3), "after": "optimizer", "before": "next forward"}
    first, second = out["steps"]
    assert first["idle_inside_ms"] == pytest.approx(0.2) and first["gap_before_ms"] is None
    assert second["gap_before_ms"] == pytest.approx(0.3) and second["idle_inside_ms"] == 0


def test_a_trace_without_device_activity_says_so():
    assert "error" in gpu_gaps.analyse({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]})
