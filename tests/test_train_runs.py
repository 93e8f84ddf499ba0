"""benchmarks/scaling_report.py runs: finished `ddptune train` runs side by side, each beside `ddptune plan`'s
prediction, read from a real tiny run on the CPU."""
from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys

import pytest

from conftest import ROOT, metrics
from ddptune import cli

_spec = importlib.util.spec_from_file_location("scaling_report", ROOT / "benchmarks" / "scaling_report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def test_runs_side_by_side_with_their_plan_their_loss_gap_and_a_run_that_did_not_finish(tmp_path):
    run, plan = tmp_path / "run", tmp_path / "plan.json"
    job = [str(ROOT / "configs" / "tiny.yaml"), "train.max_steps=6", "data.val=null"]
    # one process each, through the CLI in this process: a `python -m ddptune` costs 7 s of imports
    assert cli.main(["train", *job, f"output_dir={run}"]) == 0
    assert cli.main(["plan", *job, "--json", str(plan)]) == 0
    out = tmp_path / "runs.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scaling_report.py"), "runs", "--warmup", "2", "--out", str(out),
                           f"one={run}:{plan}", f"again={run}", f"gone={tmp_path / 'never'}"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    written = json.loads(out.read_text())
    one, again, gone = written["runs"]
    assert written["command"].startswith("python benchmarks/scaling_report.py runs --warmup 2 --out ")
    assert written["date"] and written["device"] and "commit" in written
    steps = [r for r in metrics(run) if "step_time_s" in r]
    times = [r["step_time_s"] for r in steps[2:]]
    assert (one["steps"], one["measured_steps"], one["warmup_steps_excluded"]) == (6, 4, 2)
    assert one["median_step_s"] == statistics.median(times)
    assert one["tokens_per_s_per_gpu"] == pytest.approx(sum(r["tokens"] for r in steps[2:]) / sum(times))
    assert one["losses"] == [r["loss"] for r in steps] and one["world_size"] == 1 and one["global_batch"] == 4
    assert one["speed"]["graphs"] == "off" and "CUDA graphs" in one["speed"]["reasons"]
    predicted = json.loads(plan.read_text())["options"][0]
    assert one["plan"]["allocated_gib"] == predicted["allocated"] and one["plan"]["total_gib"] == predicted["total"]
    assert one["plan"]["plan_error"] is None  # no GPU: no peak to set against it
    assert again["loss_max_abs_diff"] == 0 and again["loss_compared_with"] == "one" and "plan" not in again
    assert "missing" in gone and "losses" not in gone


def test_the_plan_error_is_given_only_for_the_base_the_plan_assumed():
    plan = {"options": [{"option": "DDP as configured", "allocated": 40.0, "total": 44.0}], "verdict": "ddp",
            "recommendation": "DDP as is", "dequantized_base_gib": 58.0}
    assert report.plan_part(plan, 42.0, dequantized=False)["plan_error"] == pytest.approx(0.05)
    kept = report.plan_part(plan, 52.0, dequantized=True)
    assert kept["plan_error"] is None and kept["dequantized_base_gib"] == 58.0
