"""benchmarks/scaling_report.py: the published 2-GPU rows rebuilt from their raw per-step files, and
repeats of one `ddptune scale` command side by side with their spread."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import ROOT
from ddptune import speed
from ddptune.reasons import Reason

_spec = importlib.util.spec_from_file_location("scaling_report", ROOT / "benchmarks" / "scaling_report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

RESULTS = ROOT / "benchmarks" / "results"
RANKS = "h200x2_llama31_8b_qlora_scale_ranks_{}.jsonl"


def ranks(mode: str) -> list[str]:
    return [str(RESULTS / RANKS.format("n1")), str(RESULTS / RANKS.format(f"{mode}-n2"))]


@pytest.mark.parametrize("mode", ["same-per-device", "same-global"])
def test_rows_rebuilt_from_the_ranks_files_are_the_published_rows(mode):
    rows, window = report.rows_from_ranks(ranks(mode), mode, 16, 20, 3)
    published = json.loads((RESULTS / f"h200x2_llama31_8b_qlora_{mode}.json").read_text())
    assert list(window) == published["sample_window"]
    for got, want in zip(report.kept(rows), published["rows"], strict=True):
        assert got["steps"] == want["steps"]
        assert got["step_s"] == pytest.approx(want["step_s"], rel=1e-12)
        assert got["efficiency"] == pytest.approx(want["efficiency"], rel=1e-12)
    assert rows[1]["efficiency_median"] == pytest.approx(
        rows[0]["median_step_s"] * rows[1]["per_process"] / (rows[1]["median_step_s"] * rows[0]["per_process"]))


def slower(src: str, dst, factor: float) -> None:
    """A repeat whose 2-process steps all took `factor` times as long."""
    lines = [json.loads(line) for line in open(src)]
    for line in lines:
        for key in ("step_s", "compute_s"):
            line[key] = [t * factor for t in line[key]]
    dst.write_text("".join(json.dumps(line) + "\n" for line in lines))


def scaling_json(path, mode: str, files: list[str]) -> list[dict]:
    rows, window = report.rows_from_ranks(files, mode, 16, 20, 3)
    path.write_text(json.dumps({
        "modes": [mode], "rows": rows, "interconnect": "NVLink", "bandwidth": {"peak_busbw_GBps": 320.0},
        "predictions": {"measured": []},
        "manifest": {"command": "ddptune scale ...", "date": str(path), "sample_window": {mode: list(window)}, "versions": {}}}))
    return rows


def test_repeats_give_each_ones_figures_their_range_the_speed_choices_and_the_recipe_beside(tmp_path):
    mode = "same-per-device"
    first = scaling_json(tmp_path / "r1.json", mode, ranks(mode))
    slower(ranks(mode)[1], tmp_path / "n2.jsonl", 1.05)
    second = scaling_json(tmp_path / "r2.json", mode, [ranks(mode)[0], str(tmp_path / "n2.jsonl")])
    runs = []
    for k, graphs in enumerate(("off", "step")):
        folder = tmp_path / f"runs{k}" / f"{mode}-n2"
        folder.mkdir(parents=True)
        why = Reason(code="forced", numbers={"graphs": graphs, "lengths": 1})
        choice = speed.Speed(compiled=True, graphs=graphs, lengths=1, sizes=(1024,), checkpointing=False, dequantize=True,
                             bucket_mb=256.0, reasons={"CUDA graphs": why})
        (folder / "summary.json").write_text(json.dumps({"speed": choice.as_dict()}))
        runs.append(str(folder.parent))
    recipe = {"median_step_time_s": 3.3, "samples_per_step": 16, "steps": 30, "warmup_steps_excluded": 5,
              "peak_mem_gib": 12.6, "final_loss": 9.8}
    (tmp_path / "ref1.json").write_text(json.dumps(dict(recipe, world_size=1, real_tok_s=900.0, real_tok_s_per_gpu=900.0)))
    (tmp_path / "ref2.json").write_text(json.dumps(dict(recipe, world_size=2, real_tok_s=1700.0, real_tok_s_per_gpu=850.0)))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scaling_report.py"), "--scale", str(tmp_path / "r1.json"),
                           str(tmp_path / "r2.json"), "--runs", *runs, "--recipe-1", str(tmp_path / "ref1.json"),
                           "--recipe-2", str(tmp_path / "ref2.json"), "--model", "m", "--device", "d", "--date", "x",
                           "--commit", "abc1234", "--results", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads((tmp_path / f"h200x2_m_{mode}.json").read_text())
    assert (out["commit"], out["date"], out["device"], out["command"]) == ("abc1234", "x", "d", "ddptune scale ...")
    assert out["report"]["command"].startswith("python benchmarks/scaling_report.py --scale ") and out["report"]["date"]
    assert [r["efficiency"] for r in out["rows"]] == pytest.approx([r["efficiency"] for r in first])
    one, two = out["spread"]
    assert one["efficiency"] == [1.0, 1.0] and one["efficiency_range"] == 0
    assert two["efficiency"] == pytest.approx([first[1]["efficiency"], second[1]["efficiency"]])
    assert second[1]["efficiency"] == pytest.approx(first[1]["efficiency"] / 1.05)
    assert two["efficiency_range"] == pytest.approx(first[1]["efficiency"] - second[1]["efficiency"])
    assert [len(r["rows"]) for r in out["repeats"]] == [2, 2]
    assert [s[f"{mode}-n2"]["graphs"] for s in out["speed"]] == ["off", "step"]
    assert out["speed"][0][f"{mode}-n2"]["bucket_mb"] == 256.0
    ref = out["reference_recipe"]
    assert [r["efficiency"] for r in ref] == pytest.approx([1.0, 850 / 900]) and ref[1]["measured_steps"] == 25
