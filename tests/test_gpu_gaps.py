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


def test_idle_is_charged_to_the_host_code_that_ended_it():
    """The kernel after a gap leads, through its correlation id, to its launch call and the ddptune
    function around that call; the host's waits for the device are listed by who waited."""
    def host(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}
    events = [
        {**kernel(0, 100, "backward"), "args": {"correlation": 1}},
        {**kernel(400, 100, "adamw"), "args": {"correlation": 2}},  # idle 100-400, launched at 350: 250 µs late
        host("python_function", "src/ddptune/train.py(460): train_step", 0, 1000),
        host("python_function", "torch/optim/adamw.py(10): step", 340, 20),
        host("cpu_op", "aten::_fused_adamw_", 345, 10),
        host("cuda_runtime", "cudaLaunchKernel", 5, 2, correlation=1),
        host("cuda_runtime", "cudaLaunchKernel", 350, 2, correlation=2),
        host("cuda_runtime", "cudaStreamSynchronize", 120, 200),
    ]
    out = gpu_gaps.analyse({"traceEvents": events})
    [row] = out["idle_by_launcher"]
    assert row["launcher"] == "src/ddptune/train.py(460): train_step"
    assert row["idle_ms"] == pytest.approx(0.3) and row["gaps"] == 1 and row["launched_late_ms"] == pytest.approx(0.25)
    assert out["busy_by_launcher"] == [{"launcher": "src/ddptune/train.py(460): train_step", "busy_ms": pytest.approx(0.2),
                                        "kernels": 2}]
    [sync] = out["syncs"]
    assert sync == {"sync": "cudaStreamSynchronize in src/ddptune/train.py(460): train_step", "count": 1,
                    "waited_ms": pytest.approx(0.2)}


def test_kernels_beside_an_all_reduce_are_compared_with_themselves_alone():
    events = [
        kernel(0, 100, "gemm"), kernel(100, 100, "gemm"),  # alone: 100 µs
        {**kernel(250, 500, "ncclDevKernel_AllReduce"), "args": {}},
        kernel(300, 150, "gemm"), kernel(450, 250, "gemm"),  # beside it: 200 µs on average
        kernel(800, 100, "gemm"),
        kernel(900, 40, "only_alone"),
    ]
    out = gpu_gaps.analyse({"traceEvents": events})["beside_nccl"]
    assert out["nccl_ms"] == pytest.approx(0.5)
    [row] = out["kernels"]
    assert row == {"kernel": "gemm", "alone_us": 100, "beside_us": 200, "beside_count": 2, "extra_ms": pytest.approx(0.2)}
    assert out["extra_ms"] == pytest.approx(0.2)


def test_device_time_is_split_by_kind_per_profiled_step_and_host_time_by_outermost_op():
    events = [
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#2", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#3", "ts": 1000, "dur": 1000},
        kernel(0, 400, "nvjet_sm90_tst_192x192_NNN"), kernel(400, 100, "triton_poi_fused_add_3"),
        kernel(1000, 400, "nvjet_sm90_tst_192x192_NNN"), kernel(1400, 300, "triton_poi_fused_add_7"),
        kernel(1700, 200, "pytorch_flash::flash_fwd_kernel"), kernel(1900, 50, "Memset"),
        kernel(5000, 999, "after the profiled steps"),
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "ts": 0, "dur": 1000, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 1000, "dur": 1000, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "Torch-Compiled Region: 0/1", "ts": 10, "dur": 600, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 20, "dur": 100, "tid": 1},  # inside the region
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1010, "dur": 200, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "CompiledFunctionBackward", "ts": 700, "dur": 800, "tid": 2},
    ]
    out = gpu_gaps.analyse({"traceEvents": events})
    split = out["kernels"]
    assert split["steps"] == 2 and split["busy_ms"] == pytest.approx(0.725)
    assert split["kinds"]["gemm"] == {"ms": pytest.approx(0.4), "launches": 1.0}
    assert split["kinds"]["fused (triton)"] == {"ms": pytest.approx(0.2), "launches": 1.0}
    assert split["kinds"]["attention"]["ms"] == pytest.approx(0.1) and split["kinds"]["other"]["ms"] == pytest.approx(0.025)
    assert split["top"][1] == {"kernel": "triton_poi_fused_add", "ms": pytest.approx(0.2), "launches": 1.0}
    main, autograd = out["host"]
    assert main["thread"] == 1 and main["busy_ms"] == pytest.approx(0.4)
    assert main["ops"] == [{"op": "Torch-Compiled Region: 0/1", "ms": pytest.approx(0.3)}, {"op": "aten::mm", "ms": pytest.approx(0.1)}]
    assert autograd == {"thread": 2, "busy_ms": pytest.approx(0.4), "ops": [{"op": "CompiledFunctionBackward", "ms": pytest.approx(0.4)}]}
