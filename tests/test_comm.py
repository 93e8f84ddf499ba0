"""Interconnect parsing, cost-model arithmetic and a real gloo all-reduce benchmark."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddptune import comm

SRC = str(Path(__file__).resolve().parents[1] / "src")

TOPO_8X_H100 = """\
\x1b[4m\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tPIX\tNODE\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNODE\tNODE\t0-55,112-167\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNODE\tNODE\t0-55,112-167\t0\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNODE\tPIX\t0-55,112-167\t0\t\tN/A
GPU4\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tSYS\tSYS\t56-111,168-223\t1\t\tN/A
GPU5\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tSYS\tSYS\t56-111,168-223\t1\t\tN/A
GPU6\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tSYS\tSYS\t56-111,168-223\t1\t\tN/A
GPU7\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tSYS\tSYS\t56-111,168-223\t1\t\tN/A
NIC0\tPIX\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t X \tNODE
NIC1\tNODE\tNODE\tNODE\tPIX\tSYS\tSYS\tSYS\tSYS\tNODE\t X \n
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
"""

TOPO_2X_PCIE = """\
\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tPHB\t0-31\t0\t\tN/A
GPU1\tPHB\t X \t0-31\t0\t\tN/A

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""

TOPO_1_GPU = """\
\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \t0-15\t0\t\tN/A

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""


@pytest.mark.parametrize("text,label", [
    (TOPO_8X_H100, "NVLink"),
    (TOPO_2X_PCIE, "PCIe"),
    (TOPO_1_GPU, "single GPU"),
    (comm.NO_GPU_TOPOLOGY, "CPU (gloo)"),
    ("nvidia-smi topo -m failed (exit 9): NVIDIA-SMI has failed", "unknown"),
])
def test_interconnect(text: str, label: str) -> None:
    assert comm.interconnect(text) == label


def test_parse_and_format_sizes() -> None:
    assert comm.parse_size("512KB") == 512 * 1024
    assert comm.parse_size("1MB") == 2**20
    assert comm.parse_size("1GB") == 2**30
    assert comm.parse_size("4MiB") == 4 * 2**20
    assert comm.parse_size("1024") == 1024
    assert comm.human_size(2**30) == "1 GB"
    with pytest.raises(ValueError):
        comm.parse_size("lots")


def test_ring_allreduce_arithmetic() -> None:
    # n=2, 100 MB at 10 GB/s busbw: 2*1/2 * 1e8 / 1e10 = 0.01 s
    assert comm.ring_allreduce_s(1e8, 2, 10e9) == pytest.approx(0.01)
    # n=4: 2*3/4 * 1e8 / 1e10 = 0.015 s
    assert comm.ring_allreduce_s(1e8, 4, 10e9) == pytest.approx(0.015)
    assert comm.ring_allreduce_s(1e8, 1, 10e9) == 0.0
    assert comm.grad_bytes(7_000_000, 2) == 14_000_000


def test_predict_no_overlap() -> None:
    p = comm.predict(step_compute_s=0.09, backward_s=0.06, grad_bytes=100_000_000, n=2,
                     busbw_Bps=10e9, overlap=False)
    assert p["comm_s"] == pytest.approx(0.01)
    assert p["exposed_comm_s"] == pytest.approx(0.01)
    assert p["step_s"] == pytest.approx(0.10)
    assert p["efficiency"] == pytest.approx(0.9)
    assert p["speedup"] == pytest.approx(1.8)


def test_predict_overlap_hidden_except_last_bucket() -> None:
    # comm 0.01 s < backward 0.06 s: only the last bucket (10 MB -> 0.001 s) is exposed
    p = comm.predict(0.09, 0.06, 100_000_000, 2, 10e9, overlap=True, last_bucket_bytes=10_000_000)
    assert p["exposed_comm_s"] == pytest.approx(0.001)
    assert p["step_s"] == pytest.approx(0.091)
    assert p["speedup"] == pytest.approx(2 * 0.09 / 0.091)
    # without a last bucket everything hides behind backward: perfect scaling
    p0 = comm.predict(0.09, 0.06, 100_000_000, 2, 10e9, overlap=True, last_bucket_bytes=0)
    assert p0["exposed_comm_s"] == 0.0 and p0["speedup"] == pytest.approx(2.0)


def test_predict_overlap_comm_longer_than_backward() -> None:
    # 1 GB over n=2 at 10 GB/s = 0.1 s; backward 0.06 s; last bucket 10 MB = 0.001 s
    # exposed = 0.001 + max(0, 0.1 - 0.001 - 0.06) = 0.04 s
    p = comm.predict(0.09, 0.06, 1_000_000_000, 2, 10e9, last_bucket_bytes=10_000_000)
    assert p["comm_s"] == pytest.approx(0.1)
    assert p["exposed_comm_s"] == pytest.approx(0.04)
    assert p["step_s"] == pytest.approx(0.13)
    # a gradient smaller than one bucket is all "last bucket": fully exposed
    small = comm.predict(0.09, 0.06, 1_000_000, 2, 10e9)
    assert small["exposed_comm_s"] == pytest.approx(small["comm_s"]) == pytest.approx(1e-4)


def test_predict_single_process_and_table() -> None:
    p = comm.predict(0.1, 0.05, 10**9, 1, 16e9)
    assert p["comm_s"] == 0.0 and p["speedup"] == pytest.approx(1.0)
    rows = comm.predict_table(0.1, 0.05, 10**9, ns=[2, 4, 8], links=comm.INTERCONNECTS)
    assert len(rows) == 3 * len(comm.INTERCONNECTS)
    assert {r["nproc"] for r in rows} == {2, 4, 8}
    pcie = [r for r in rows if r["link"].startswith("PCIe")]
    assert [r["comm_s"] for r in pcie] == pytest.approx([2 * (n - 1) / n * 1e9 / 16e9 for n in (2, 4, 8)])
    assert all(r["speedup"] <= r["nproc"] for r in rows)


def test_measure_bandwidth_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", SRC)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CPU test: gloo even on a GPU machine
    result = comm.measure_bandwidth(2, sizes=["1MB", "4MB"], iters=3)
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    rows = result["rows"]
    assert [r["size_bytes"] for r in rows] == [2**20, 4 * 2**20]
    for r in rows:
        assert r["time_s"] > 0 and r["busbw_GBps"] > 0
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])  # 2(n-1)/n == 1 for n = 2


def test_measure_bandwidth_failure_is_clear(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("PYTHONPATH", SRC)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeError) as e:  # iters=0: no timings to take the median of -> the child fails
        comm.measure_bandwidth(1, sizes=["1MB"], iters=0)
    assert re.search(r"\(exit code (\d+), no result file\)", str(e.value)).group(1) == "1", str(e.value)
    # the child failed for that reason (the median of no timings), not for any other that exits non-zero
    assert "statistics.StatisticsError" in capfd.readouterr().err
