"""benchmarks/kernel_split.py: the GPU work that does not halve with the share, over whole steps."""
from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("kernel_split", ROOT / "benchmarks" / "kernel_split.py")
kernel_split = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel_split)


def trace(path, gemm_us, nccl_us=0, steps=3):
    """`steps` steps, each: the marker, 10 GEMMs of gemm_us, 10 fused kernels of 2 µs (the same at
    any share), an all-reduce of nccl_us; and half a step more, cut off as the profiler cuts it."""
    events, t = [], 0
    for step in range(steps + 1):
        events.append({"ph": "X", "cat": "kernel", "name": "void at::native::indexFuncLargeIndex<float>(x)", "ts": t, "dur": 1})
        t += 1
        for i in range(10 if step < steps else 5):
            events.append({"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_128x256_h_bz_TNT", "ts": t, "dur": gemm_us})
            events.append({"ph": "X", "cat": "kernel", "name": f"triton_poi_fused_add_{i}", "ts": t + gemm_us, "dur": 2})
            t += gemm_us + 2
        if nccl_us and step < steps:
            events.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", "ts": t, "dur": nccl_us})
            t += nccl_us
        t += 4  # idle
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": t})  # the host's, not the device's
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_fixed_part_and_tax_per_family_over_whole_steps(tmp_path):
    one = kernel_split.load(trace(tmp_path / "1.json", gemm_us=20), "indexFuncLargeIndex")
    two = kernel_split.load(trace(tmp_path / "2.json", gemm_us=10, nccl_us=30), "indexFuncLargeIndex")
    alone = kernel_split.load(trace(tmp_path / "a.json", gemm_us=10), "indexFuncLargeIndex")
    assert one["steps"] == 3  # the fourth step, cut short, does not count
    assert one["families"]["nvjet (cuBLAS GEMM)"] == {"ms": pytest.approx(0.2), "launches": 10, "category": "gemm"}
    assert one["families"]["triton_poi_fused_add"]["launches"] == 10  # one family whatever inductor's index
    assert one["span_ms"] == pytest.approx((1 + 10 * 22 + 4) / 1e3) and one["idle_ms"] == pytest.approx(4 / 1e3)
    s = kernel_split.split(one, two, 2, alone)
    fams = {r["family"]: r for r in s["families"]}
    assert fams["nvjet (cuBLAS GEMM)"]["fixed_ms"] == pytest.approx(0.0)  # halves with the share
    assert fams["triton_poi_fused_add"]["fixed_ms"] == pytest.approx(0.02)  # does not
    nccl = fams["ncclDevKernel_AllReduce_Sum_f32_RING_LL"]
    assert nccl["fixed_ms"] == pytest.approx(0.06) and nccl["tax_ms"] == pytest.approx(0.03) and nccl["category"] == "nccl"
    assert s["totals"]["span_ms"]["tax_ms"] == pytest.approx(0.03)
    assert s["categories"][0]["category"] == "nccl"  # the largest fixed part first


def test_collectives_say_who_entered_last(tmp_path):
    def one_rank(path, start_us):  # a kernel at 0, then all-reduces entered at start_us, each ending together
        events = [{"ph": "X", "cat": "kernel", "name": "fwd", "ts": 0, "dur": 5}]
        events += [{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", "ts": s,
                    "dur": 1000 * (k + 1) + 500 - s} for k, s in enumerate(start_us)]
        path.write_text(json.dumps({"traceEvents": events}))
        return path

    rows = kernel_split.collectives([one_rank(tmp_path / "0.json", [200, 1400]), one_rank(tmp_path / "1.json", [900, 1100])])
    assert [r["last_in"] for r in rows] == [1, 0]
    assert rows[0]["start_ms"] == pytest.approx([0.2, 0.9]) and rows[0]["dur_ms"] == pytest.approx([1.3, 0.6])


def test_timeline_splits_each_step_as_scale_does(tmp_path, monkeypatch, capsys):
    from conftest import gpu_trace

    paths = [tmp_path / "trace.json", tmp_path / "trace-rank1.json"]
    for path, slow in zip(paths, (0, 40)):
        path.write_text(json.dumps(gpu_trace(slow)))
    monkeypatch.setattr("sys.argv", ["kernel_split.py", "--timeline", *map(str, paths), "--json", str(tmp_path / "t.json")])
    kernel_split.main()
    got = json.loads((tmp_path / "t.json").read_text())
    assert [s["step"] for s in got["steps"]] == [4, 5] and got["split"]["slowest_steps"] == [0, 2]
    assert (got["split"]["imbalance_s"], got["split"]["exposed_comm_s"]) == pytest.approx((20e-6, 120e-6))
    assert "imbalance 0.020, exposed_comm 0.120" in capsys.readouterr().out
