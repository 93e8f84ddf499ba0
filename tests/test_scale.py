"""`ddptune scale` end to end: real torchrun + gloo processes through the real CLI, on CPU."""
from __future__ import annotations

import csv
import json
import statistics
import types

import pytest

from conftest import ROOT, check, ddptune, metrics
from ddptune import scale
from ddptune.config import ConfigError, TrainConfig

TINY = str(ROOT / "configs" / "tiny.yaml")
FAST = ["train.max_steps=5", "data.val=null", "--bandwidth-sizes", "64KB,1MB"]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    """One BLAS thread per process: the step times stay sane on a small, busy machine."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def steady_median(run_dir, warmup=2) -> float:
    return statistics.median([r["step_time_s"] for r in metrics(run_dir) if "step_time_s" in r][warmup:])


def test_scale_same_per_device_writes_every_output(tmp_path):
    out = tmp_path / "scale"
    proc = check(ddptune("scale", TINY, *FAST, "--nproc", "1,2", "--out", str(out)))

    for name in ("scaling.json", "scaling.csv", "scaling.md", "scaling.png", "manifest.json"):
        assert (out / name).is_file(), name
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((out / "scaling.json").read_text())  # strict JSON: no NaN
    assert result["mode"] == "same-per-device"
    rows = result["rows"]
    assert [r["nproc"] for r in rows] == [1, 2]
    one, two = rows
    # the global batch grows with n; speedup compares throughput, efficiency = speedup / n
    assert [r["global_batch"] for r in rows] == [4, 8] and [r["grad_accum"] for r in rows] == [1, 1]
    for r in rows:
        assert r["samples_per_s"] == pytest.approx(r["global_batch"] / r["step_s"])
        assert r["speedup"] == pytest.approx(r["samples_per_s"] / one["samples_per_s"])
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["nproc"])
        assert r["epoch_s"] == pytest.approx(r["steps_per_epoch"] * r["step_s"])
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / r["nproc"])
        assert r["val_loss"] is None and r["final_loss"] > 0
    # step times are the medians after the warm-up, read from each run's metrics
    assert one["step_s"] == pytest.approx(steady_median(out / "n1")) and one["comm_s"] == 0
    assert two["step_s"] == pytest.approx(steady_median(out / "n2"))
    assert two["comm_s"] == pytest.approx(two["step_s"] - steady_median(out / "n2-nosync"))
    nosync = json.loads((out / "n2-nosync" / "summary.json").read_text())
    assert nosync["grad_sync"] is False and nosync["world_size"] == 2

    # communication: bandwidth over 2 processes, predictions beside the measurements
    assert result["bandwidth"]["status"] == "measured" and result["bandwidth"]["peak_busbw_GBps"] > 0
    assert result["grad_bytes"] == 4 * json.loads((out / "n1" / "summary.json").read_text())["trainable_params"]
    assert [p["nproc"] for p in result["predictions"]["measured"]] == [1, 2]
    what_if = result["predictions"]["other_interconnects"]
    assert {p["nproc"] for p in what_if} == {2, 4, 8} and any("PCIe" in p["link"] for p in what_if)
    assert {p["gradients"].split()[0] for p in what_if} == {"lora", "full"}

    with open(out / "scaling.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["nproc"] for r in csv_rows] == ["1", "2"] and {r["mode"] for r in csv_rows} == {"same-per-device"}
    md = (out / "scaling.md").read_text()
    assert "## Scaling, mode same-per-device" in md and "Predicted vs measured" in md and "PCIe" in md
    assert "## Scaling, mode same-per-device" in proc.stdout  # the table is printed at the end

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == result["manifest"] and manifest["mode"] == "same-per-device"
    assert [b["arithmetic"] for b in manifest["batch"]] == ["4 x 1 x 1 = 4", "4 x 2 x 1 = 8"]
    assert manifest["seed"] == 0 and "torch" in manifest["versions"] and manifest["interconnect"] == "CPU (gloo)"
    assert "--nproc 1,2" in manifest["command"] and manifest["date"]

    # the folder is never overwritten
    again = ddptune("scale", TINY, *FAST, "--nproc", "1,2", "--out", str(out))
    assert again.returncode == 2 and "already holds files" in again.stderr


def test_scale_same_global_adapts_accumulation_up_to_four_processes(tmp_path):
    out = tmp_path / "scale"
    check(ddptune("scale", TINY, *FAST, "train.micro_batch_size=2", "train.grad_accum=null",
                  "train.effective_batch_size=8", "--nproc", "1,2,4", "--mode", "same-global", "--out", str(out)))
    result = json.loads((out / "scaling.json").read_text())
    rows = result["rows"]
    assert [r["nproc"] for r in rows] == [1, 2, 4]
    assert [r["global_batch"] for r in rows] == [8, 8, 8] and [r["grad_accum"] for r in rows] == [4, 2, 1]
    for r in rows:
        summary = json.loads((out / f"n{r['nproc']}" / "summary.json").read_text())
        assert summary["world_size"] == r["nproc"] and summary["global_batch"] == 8
        assert r["speedup"] == pytest.approx(r["samples_per_s"] / rows[0]["samples_per_s"])
        assert r["speedup"] == pytest.approx(rows[0]["step_s"] / r["step_s"])  # same batch: step-time ratio
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["nproc"])
    assert (out / "n4-nosync" / "summary.json").is_file()
    assert result["bandwidth"]["nproc"] == 4 and result["bandwidth"]["status"] == "measured"
    assert [b["arithmetic"] for b in result["manifest"]["batch"]] == ["2 x 1 x 4 = 8", "2 x 2 x 2 = 8", "2 x 4 x 1 = 8"]
    assert "same-global" in (out / "scaling.md").read_text()


def test_scale_count_that_does_not_divide_fails_before_any_run(tmp_path):
    out = tmp_path / "scale"
    proc = ddptune("scale", TINY, "train.micro_batch_size=2", "train.grad_accum=null", "train.effective_batch_size=8",
                   "--nproc", "1,3", "--mode", "same-global", "--out", str(out))
    assert proc.returncode == 2
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("ddptune: invalid config")
    assert "--nproc 3" in errors[0] and "effective_batch_size" in errors[0]
    assert not out.exists()


def test_batch_arithmetic_per_mode():
    t = TrainConfig(micro_batch_size=2, grad_accum=None, effective_batch_size=8)
    # same-per-device keeps the accumulation the effective batch gives at n = 1
    assert scale.batch_overrides(t, "same-per-device") == ["train.grad_accum=4", "train.effective_batch_size=null"]
    assert scale.batch_overrides(t, "same-global") == ["train.grad_accum=null", "train.effective_batch_size=8"]
    assert scale.batch_overrides(TrainConfig(micro_batch_size=4, grad_accum=3), "same-global")[1] == "train.effective_batch_size=12"
    assert scale.parse_counts("4,1,2,2") == [1, 2, 4]
    for bad in ("2,4", "0,1", "one"):
        with pytest.raises(ConfigError):
            scale.parse_counts(bad)
    assert scale.backward_fraction("lora", False) == pytest.approx(1 / 2)
    assert scale.backward_fraction("qlora", True) == pytest.approx(2 / 3)
    assert scale.backward_fraction("full", False) == pytest.approx(2 / 3)


def test_bad_nproc_is_one_line_error(tmp_path):
    args = types.SimpleNamespace(config=TINY, overrides=[], nproc="2,4", mode="same-per-device",
                                 out=str(tmp_path / "x"), bandwidth_sizes="1MB")
    with pytest.raises(ConfigError, match="include 1"):
        scale.main(args)
