"""`ddptune env` collects a bug-report block; with --nproc 2 on CPU it measures gloo all-reduce."""
from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from ddptune import env, system

SRC = str(Path(__file__).resolve().parents[1] / "src")
KEYS = {"python", "platform", "cpu", "cpu_count", "ram_GiB", "torch", "cuda", "cudnn", "nccl", "gpus",
        "topology", "interconnect", "packages", "env_vars", "bandwidth"}


def test_env_no_bandwidth(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    out = tmp_path / "env.json"
    assert env.main(["--no-bandwidth", "--json", str(out)]) == 0
    info = json.loads(out.read_text())
    assert KEYS <= info.keys()
    assert set(info["packages"]) == set(system.PACKAGES)
    assert info["env_vars"]["NCCL_DEBUG"] == "INFO"
    assert info["bandwidth"]["status"].startswith("skipped")
    assert info["ddptune"] == importlib.metadata.version("ddptune")
    from ddptune import cli

    capsys.readouterr()
    assert cli.main(["--version"]) == 0 and capsys.readouterr().out == f"ddptune {info['ddptune']}\n"
    assert env.main(["--no-bandwidth"]) == 0
    text = capsys.readouterr().out
    assert "## ddptune env" in text and f"- ddptune: {info['ddptune']}" in text and "torch" in text and "NCCL_DEBUG=INFO" in text


def test_env_single_device(tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    assert env.main(["--nproc", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["bandwidth"]["status"] == "single device: no all-reduce to measure"


def test_env_bandwidth_two_cpu_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU test: measures gloo all-reduce between two CPU processes")
    monkeypatch.setenv("PYTHONPATH", SRC)
    out = tmp_path / "env.json"
    assert env.main(["--nproc", "2", "--json", str(out)]) == 0
    bw = json.loads(out.read_text())["bandwidth"]
    assert bw["status"] == "measured" and bw["backend"] == "gloo"
    assert len(bw["rows"]) == 3 and bw["peak_busbw_GBps"] > 0
    assert "peak busbw" in capsys.readouterr().out


def test_host_cpu_share_counts_the_busy_time_between_two_readings() -> None:
    before = system.cpu_times()
    assert before and 0 <= before["steal"] <= before["total"] and 0 < before["busy"] <= before["total"]
    spin = before["total"]
    while (after := system.cpu_times())["total"] < spin + 20:  # at least 20 ticks of host time pass
        sum(range(10_000))
    share = system.cpu_share(before, after)
    assert 0 < share["busy"] <= 1 and 0 <= share["steal"] <= 1
    assert system.cpu_share(before, before) is None and system.cpu_share(None, after) is None
    assert system.cpu_model()
