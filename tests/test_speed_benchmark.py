"""benchmarks/speed.py --epoch: every ddptune run trains the tutorial's epoch and is timed end to end;
the recipe's epoch is extrapolated from its measured steps and recorded as such."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import ROOT, metrics

_spec = importlib.util.spec_from_file_location("speed_bench", ROOT / "benchmarks" / "speed.py")
speed_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(speed_bench)


def test_the_tutorials_epoch_is_921_steps_of_16():
    assert speed_bench.epoch_steps() == 921 and speed_bench.epoch_steps(14_736, 16) == 921
    assert speed_bench.epoch_steps(14_737, 16) == 922


def test_epoch_runs_train_every_step_of_it_and_are_timed_whole(tmp_path, monkeypatch):
    """On the CPU with the tiny preset and a 5-step 'epoch' (--epoch-steps)."""
    from ddptune import model

    model.byte_tokenizer().save_pretrained(tmp_path / "tok")
    argv = ["--epoch", "--epoch-steps", "5", "--name", "epoch", "--preset", "tiny", "--method", "lora",
            "--tokenizer", str(tmp_path / "tok"), "--data", "demo", "--rows", "0:64", "--steps", "2", "--warmup", "1",
            "--skip-reference", "--runs", "", "--run",
            "shipped=train.grad_accum=1,env:DDPTUNE_SPEED=compile=false,env:DDPTUNE_SPEED=combo=false",
            "--work", str(tmp_path / "work"), "--results", str(tmp_path)]
    monkeypatch.delenv("OUT", raising=False)
    assert speed_bench.main(argv) == 0
    result = json.loads((tmp_path / "epoch.json").read_text())
    assert result["command"].startswith("python benchmarks/speed.py --epoch --epoch-steps 5 --name epoch")
    assert result["date"] and result["device"] and "commit" in result
    assert len([r for r in metrics(Path(result["runs_folder"]) / "shipped") if "step_time_s" in r]) == 5
    shipped, epoch = result["shipped"], result["epoch"]
    assert shipped["steps"] == 5 and result["ddptune_steps"] == 5 and epoch["steps"] == 5
    assert len(shipped["step_times_s"]) == len(shipped["tokens"]) == 5 and min(shipped["tokens"]) > 0
    assert shipped["padded_tokens"] == shipped["tokens"]  # packed rows on the CPU: nothing padded
    run = epoch["runs"]["shipped"]
    assert run["extrapolated"] is False and run["wall_s"] == shipped["wall_s"] > shipped["train_time_s"] > 0
    assert run["samples"] == 5 * 4 and "reference" not in epoch["runs"]
    # two env: values for one variable reach the run joined, the way DDPTUNE_SPEED takes several choices
    assert shipped["speed"]["forced"] == {"compile": False, "combo": False}


def test_the_recipes_epoch_is_its_measured_wall_plus_its_median_step_for_each_step_it_did_not_run():
    result = {"reference": {"steps": 30, "wall_s": 200.0, "median_step_time_s": 3.0, "samples_per_step": 16},
              "shipped": {"wall_s": 300.0, "samples_per_step": 16, "load_time_s": 11.0, "train_time_s": 250.0,
                          "median_step_time_s": 0.207}}
    out = speed_bench.epoch(result, ["shipped"], ["reference"])["runs"]
    ref = out["reference"]
    assert ref["extrapolated"] is True and ref["measured_steps"] == 30
    assert ref["wall_s"] == pytest.approx(200 + (921 - 30) * 3.0)
    assert out["shipped"]["against_reference"] == pytest.approx(ref["wall_s"] / 300.0)
    assert out["shipped"]["samples"] == 921 * 16 and out["shipped"]["extrapolated"] is False


def test_ddptune_runs_take_their_own_step_count_unless_timing_the_epoch():
    from argparse import Namespace

    assert speed_bench.steps_of(Namespace(epoch=False, ddptune_steps=None, steps=30)) == 30
    assert speed_bench.steps_of(Namespace(epoch=False, ddptune_steps=150, steps=30)) == 150
    assert speed_bench.steps_of(Namespace(epoch=True, epoch_steps=921, ddptune_steps=150, steps=30)) == 921


def test_a_second_call_on_the_same_machine_runs_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """Runs of an earlier call with the same name stay where they are: a run's output_dir that holds a run
    is refused, so each call gets a new folder of runs and deletes nothing."""
    argv = ["--name", "again", "--preset", "tiny", "--skip-reference", "--runs", "", "--tokenizer", "-",
            "--data", "demo", "--work", str(tmp_path / "work"), "--results", str(tmp_path)]
    monkeypatch.delenv("OUT", raising=False)
    folders = []
    for _ in range(2):
        assert speed_bench.main(argv) == 0
        folders.append(Path(json.loads((tmp_path / "again.json").read_text())["runs_folder"]))
        (folders[-1] / "shipped").mkdir()  # what a run leaves behind
    assert folders[0] != folders[1] and all(f.parent == tmp_path / "work" and (f / "shipped").is_dir() for f in folders)
