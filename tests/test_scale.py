"""`ddptune scale` end to end (real torchrun + gloo processes through the CLI, on CPU), and its arithmetic."""
from __future__ import annotations

import csv
import json
import math
import subprocess
import types

import pytest

from conftest import ROOT, check, ddptune, field, metrics, words
from ddptune import cli, scale, scaling
from ddptune.batchplan import BatchPlan
from ddptune.config import ConfigError, TrainConfig

TINY = str(ROOT / "configs" / "tiny.yaml")
FAST = ["data.val=null", "--steps", "3", "--warmup", "1", "--bandwidth-sizes", "64KB,1MB"]


@pytest.fixture(scope="module")
def both_modes(tmp_path_factory):
    """One `ddptune scale` of both modes (three runs), through the whole CLI."""
    out = tmp_path_factory.mktemp("both") / "scale"
    return out, check(ddptune("scale", TINY, *FAST, "--nproc", "1,2", "--mode", "both", "--out", str(out)))


def test_scale_both_modes_on_the_same_samples(both_modes, capsys):
    out, proc = both_modes

    for name in ("scaling.json", "scaling.csv", "scaling.md", "scaling.png", "manifest.json"):
        assert (out / name).is_file(), name
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((out / "scaling.json").read_text())  # strict JSON: no NaN
    assert result["modes"] == ["same-per-device", "same-global"]
    # three runs: n = 1 is shared by both modes and runs the longer of their windows
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["n1", "same-global-n2", "same-per-device-n2"]
    assert result["manifest"]["sample_window"] == {"same-per-device": [8, 32], "same-global": [4, 16]}
    rows = {(r["mode"], r["nproc"]): r for r in result["rows"]}
    assert [r["global_batch"] for r in result["rows"]] == [4, 8, 4, 4]
    accounted = 0  # rows of 2 processes whose lost parts were summed (or whose CPU contention was named instead)
    for (mode, n), r in rows.items():
        base = rows[mode, 1]
        assert r["samples_per_s"] == pytest.approx(r["samples_measured"] / (r["step_s"] * r["steps"]))
        assert r["speedup"] is None or r["speedup"] == pytest.approx(r["samples_per_s"] / base["samples_per_s"])
        assert r["efficiency"] is None or r["efficiency"] == pytest.approx(r["speedup"] / n)
        assert r["samples_measured"] == base["samples_measured"]  # the same samples at every count
        parts = r["parts"]  # the split adds up to the step
        assert r["step_s"] == pytest.approx(sum(parts.values()))
        if n == 1:
            continue
        found = [x["code"] for x in r["notes"]]
        if r["efficiency"] is None:  # faster than n times one process on shared cores: that is named, not split up
            assert found.count("cpu_contention") == 1 and r["speedup"] is None
        else:  # every lost percent is accounted: the parts add up to 1 - efficiency
            lost = [r[k] for k in scaling.LOST]
            if None in lost:  # a part within noise is blank in the row: the lost_sum finding writes out each part's share
                (note,) = [x for x in r["notes"] if x["code"] == "lost_sum"]
                assert [p["part"] for p in note["parts"]] == list(scaling.LOST)
                lost = [p["share"] for p in note["parts"]]
            assert sum(lost) == pytest.approx(1 - r["efficiency"], abs=1e-6), (mode, lost, r["efficiency"])
        accounted += 1
    assert accounted == 2  # same-per-device and same-global at 2 processes
    # the window's steps are the same samples: tokens per window agree across counts
    tokens = lambda run, a, b: sum([x["tokens"] for x in metrics(out / run) if "tokens" in x][a:b])  # noqa: E731
    assert tokens("n1", 2, 8) == tokens("same-per-device-n2", 1, 4)
    assert tokens("n1", 1, 4) == tokens("same-global-n2", 1, 4)
    # each process's computed tokens are in ranks.jsonl (for the imbalance its share predicts); together
    # they are the step's
    ranks = [json.loads(line) for line in (out / "same-per-device-n2" / "ranks.jsonl").read_text().splitlines()]
    steps = [x for x in metrics(out / "same-per-device-n2") if "padded_tokens" in x]
    assert [sum(r["computed"]) for r in ranks] == [x["padded_tokens"] for x in steps]
    assert all(r["imbalance_costed_s"] is not None for r in result["rows"] if r["nproc"] > 1)
    # which process was the slowest, step by step: every measured step counted once, offsets around the mean
    for r in (r for r in result["rows"] if r["nproc"] > 1):
        assert sum(r["slowest_steps"]) == r["steps"] and len(r["slowest_steps"]) == 2
        assert sum(r["compute_offset_s"]) == pytest.approx(0, abs=1e-9)
    # every finding is data: a code and its numbers, rendered into the note
    for r in result["rows"]:
        assert r["note"] == ("; ".join(scaling.render(n) for n in r["notes"]) or None)

    # communication: bandwidth over 2 processes, predictions beside the measurements
    assert result["bandwidth"]["status"] == "measured" and result["bandwidth"]["peak_busbw_GBps"] > 0
    assert result["grad_bytes"] == 4 * json.loads((out / "n1" / "summary.json").read_text())["trainable_params"]
    what_if = result["predictions"]["other_interconnects"]
    assert {p["nproc"] for p in what_if} == {2, 4, 8} and any("PCIe" in p["link"] for p in what_if)

    with open(out / "scaling.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert [(r["mode"], r["nproc"]) for r in csv_rows] == [("same-per-device", "1"), ("same-per-device", "2"),
                                                            ("same-global", "1"), ("same-global", "2")]
    md = (out / "scaling.md").read_text()
    assert "lost: imbalance" in md and "Predicted against measured" in md and "PCIe" in md
    # the study in one line, at the top of the report and in its JSON; no ROUGE ran (evaluation off), and the plan said so
    assert result["verdict"] and md.split("\n\n")[1] == f"**Verdict:** {result['verdict']}"
    assert result["manifest"]["evaluation"] is None and "eval.enabled=false" in proc.stdout.split("\n")[0]
    assert "| same-global | 2 |" in proc.stdout  # the table is printed at the end
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == result["manifest"] and manifest["threads_per_process"] >= 1
    # the host's CPU during each run, read from /proc/stat: busy (the runs themselves at least) and stolen
    assert all(0 < r["host_cpu_busy"] <= 1 and 0 <= r["host_cpu_steal"] <= 1 for r in result["rows"])
    assert "--nproc 1,2" in manifest["command"] and manifest["date"]
    assert manifest["commit"].split("-")[0] == subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"],
                                                               capture_output=True, text=True).stdout.strip()
    # every run is the config as a user runs it (no speed keys set); with the same batch a process, n = 1 and
    # n = 2 run one program: the same choices, made from the same sample of one process's work
    chosen = {}
    for key in ("n1", "same-per-device-n2", "same-global-n2"):
        assert set(manifest["runs"][key]) == {"nproc", "steps", "dir", "command"}
        chosen[key] = json.loads((out / key / "summary.json").read_text())["speed"]
    program = lambda c: ({k: c[k] for k in ("compiled", "graphs", "lengths", "sizes", "checkpointing", "dequantize", "combo")},  # noqa: E731
                         c["estimate"]["step_s"])
    assert program(chosen["n1"]) == program(chosen["same-per-device-n2"])

    # the folder is never overwritten (in this process: a refusal before any run needs no new one)
    assert cli.main(["scale", TINY, *FAST, "--nproc", "1,2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()  # the folder that holds the report
    assert field(err) == "--out" and str(out) in words(err), err


def test_scale_four_processes_report_their_balance(tmp_path):
    out = tmp_path / "scale"  # in this process (the CLI's own run is both_modes'): its runs are 1 and 4 processes
    args = types.SimpleNamespace(config=TINY, overrides=["data.val=null", "train.micro_batch_size=2", "train.grad_accum=4"],
                                 nproc="1,4", mode="same-global", steps=3, warmup=1, out=str(out), bandwidth_sizes="none")
    assert scale.main(args) == 0
    result = json.loads((out / "scaling.json").read_text())
    assert result["bandwidth"]["status"] == "not measured (--bandwidth-sizes none)"  # and no predictions
    assert result["predictions"]["measured"] == [r for r in result["predictions"]["measured"] if r["nproc"] == 1]
    rows = result["rows"]
    assert [(r["nproc"], r["global_batch"], r["per_process"]) for r in rows] == [(1, 8, 8), (4, 8, 2)]
    four = rows[1]
    assert 1.0 <= four["balance"] < 1.3  # 2 samples a process: the longest sample decides
    assert four["imbalance_s"] is None or four["imbalance_s"] >= 0
    ranks = [json.loads(l) for l in (out / "same-global-n4" / "ranks.jsonl").read_text().splitlines()]
    assert all(len(r["compute_s"]) == 4 for r in ranks)


def test_batch_plans_per_mode_work_with_every_shipped_config():
    packed = TrainConfig(micro_batch_size=4, grad_accum=1)  # tiny.yaml
    assert scaling.plan_for(packed, "same-global", 2) == BatchPlan(2, 2, None, 8192)  # no extra overrides needed
    assert scaling.plan_for(packed, "same-per-device", 4) == BatchPlan(4, 4, None, 8192)
    padded = TrainConfig(micro_batch_size=4, grad_accum=1, packing=False)
    assert scaling.plan_for(padded, "same-global", 2) == BatchPlan(2, 2, 2, None)  # the micro-batch shrinks to fit
    assert scaling.batch_overrides(BatchPlan(2, 2, 2, None), padded) == [
        "train.micro_batch_size=2", "train.grad_accum=null", "train.effective_batch_size=4"]
    with pytest.raises(ConfigError) as e:
        scaling.plan_for(packed, "same-global", 3)
    assert field(e.value.problems[0]) == "--nproc 3 (same-global)", e.value.problems
    # the measured window: whole steps of every batch, `warmup` steps of the largest before it
    assert scaling.sample_window([16, 32], warmup=3, measured=30) == (96, 1056)
    assert scaling.sample_window([12, 8], warmup=1, measured=2) == (24, 48)
    assert scaling.parse_counts("4,1,2") == [1, 2, 4]
    for bad in ("2,4", "0,1", "one"):
        with pytest.raises(ConfigError):
            scaling.parse_counts(bad)
    assert scale.backward_fraction("lora", False) == pytest.approx(1 / 2)
    assert scale.backward_fraction("qlora", True) == pytest.approx(2 / 3)


def _row(n, per_process, step, compute, imbalance, comm, rest, se=0.001):
    row = {"nproc": n, "per_process": per_process, "samples_per_s": per_process * n / step, "step_s": step,
           "compute_s": compute, "imbalance_s": imbalance, "exposed_comm_s": comm, "rest_s": rest}
    row.update({f"{k}_se": se for k in scaling.PART_KEYS})
    return row


def codes(row: dict) -> dict:
    """The row's findings by code."""
    return {n["code"]: n for n in row["notes"]}


def test_every_lost_percent_is_accounted_and_noise_is_named():
    one = scaling.account(_row(1, 8, 1.0, 0.9, 0.0, 0.0, 0.1), None, cuda=True)
    # same-per-device at 2: compute grew 0.05, imbalance 0.04, comm 0.01; efficiency = 1 / 1.1
    two = scaling.account(_row(2, 8, 1.1, 0.95, 0.04, 0.01, 0.1), one, cuda=True)
    assert two["efficiency"] == pytest.approx(1 / 1.1)
    assert two["lost_compute"] == pytest.approx(0.05 / 1.1) and two["lost_imbalance"] == pytest.approx(0.04 / 1.1)
    assert two["lost_comm"] == pytest.approx(0.01 / 1.1) and two["lost_rest"] is None  # 0 within its noise
    assert sum(two[k] or 0 for k in scaling.LOST) == pytest.approx(1 - two["efficiency"])
    noisy = scaling.account(_row(2, 8, 1.0, 0.9, 0.0005, -0.0004, 0.1), one, cuda=True)
    assert noisy["exposed_comm_s"] is None and codes(noisy)["noise"]["part"] == "exposed_comm_s"
    assert codes(noisy)["noise"]["ms"] == pytest.approx(2.0)  # twice the standard error
    cpu = scaling.account(_row(2, 8, 0.4, 0.35, 0.0, 0.0, 0.05), scaling.account(_row(1, 8, 1.0, 0.9, 0, 0, 0.1), None, False), cuda=False)
    assert cpu["speedup"] is None and codes(cpu)["cpu_contention"]["speedup"] == pytest.approx(5.0)
    stolen = scaling.account({**_row(2, 8, 1.1, 0.95, 0.04, 0.01, 0.1), "host_cpu_steal": 0.05}, one, cuda=True)
    assert codes(stolen)["steal"] == {"code": "steal", "nproc": 2, "share": 0.05} and "steal" not in codes(two)


def test_lost_parts_that_a_gain_or_noise_hides_are_written_out_as_the_sum_they_make():
    """Imbalance and communication lose more than 1 - efficiency when compute got faster at n = 2 and
    the rest is within noise: the row's lost_sum finding names every part, blank ones with their values."""
    one = scaling.account(_row(1, 8, 1.0, 0.9, 0.0, 0.0, 0.1), None, cuda=True)
    two = scaling.account(_row(n=2, per_process=8, step=1.035, compute=0.868, imbalance=0.037, comm=0.030, rest=0.1, se=0.0005),
                          one, cuda=True)
    assert two["efficiency"] == pytest.approx(1 / 1.035)
    assert (two["lost_compute"], two["lost_imbalance"], two["lost_comm"], two["lost_rest"]) == pytest.approx(
        (-0.032 / 1.035, 0.037 / 1.035, 0.030 / 1.035, None))  # shown: 0.036 + 0.029 - 0.031 = 0.034
    found = codes(two)["lost_sum"]
    assert found["lost"] == pytest.approx(1 - two["efficiency"])
    assert sum(p["share"] for p in found["parts"]) == pytest.approx(found["lost"])
    assert [(p["part"], p["blank"]) for p in found["parts"]] == [
        ("lost_compute", False), ("lost_imbalance", False), ("lost_comm", False), ("lost_rest", True)]
    rest = found["parts"][3]
    assert rest["share"] == pytest.approx(0.0, abs=1e-12) and rest["noise"] == pytest.approx(2 * math.hypot(0.0005, 0.001) / 1.035)
    assert found["parts"][0]["ms"] == pytest.approx(-32.0)
    text = scaling.render(found)
    assert [x in text for x in ("0.034 =", "-0.031 (", "0.036 +", "0.029 +", "0.000 (", "±0.002", "32 ms")] == [True] * 7
    clean = scaling.account(_row(n=2, per_process=8, step=1.1, compute=0.95, imbalance=0.04, comm=0.01, rest=0.2, se=0.0001), one,
                            cuda=True)  # every part shown, all losses
    assert "lost_sum" not in codes(clean) and None not in [clean[k] for k in scaling.LOST]


def test_an_imbalance_on_cpu_names_the_cores_and_times_read_in_their_unit():
    one = scaling.account(_row(n=1, per_process=16, step=0.2653, compute=0.2643, imbalance=0, comm=0, rest=0.001, se=0.0002),
                          None, cuda=False)
    two = scaling.account({**_row(n=2, per_process=16, step=0.4, compute=0.3, imbalance=0.15, comm=0.00068, rest=0.001, se=0.0002),
                           "imbalance_costed_s": 0.00005,
                           "slowest_steps": [1, 9], "compute_offset_s": [-0.07, 0.07]}, one, cuda=False)
    found = codes(two)["device_imbalance"]
    assert found["device"] == "CPU" and found["ms"] == pytest.approx(150.0)
    assert "150 ms a step, of which unequal shares 50 µs" in scaling.render(found) and "70 ms" in scaling.render(found)
    assert codes(scaling.account({**_row(n=2, per_process=16, step=0.4, compute=0.3, imbalance=0.15, comm=0.00068, rest=0.001, se=0.0002),
                                  "imbalance_costed_s": 0.00005},
                                 one, cuda=True))["device_imbalance"]["device"] == "GPU"
    noise = scaling.render({"code": "noise", "part": "rest_s", "ms": 150.0})
    assert noise.endswith("(±150 ms)")


def test_scale_tables_write_times_in_their_unit():
    rows = [{"mode": "same-global", "nproc": n, "busbw_GBps": None, "pred_comm_s": s, "pred_exposed_s": s,
             "meas_exposed_s": 0.2456, "pred_speedup": 1.0, "meas_speedup": 1.0} for n, s in ((2, 6.871e-05), (4, 1.82e-07))]
    table = scale.markdown_table(rows, scale.PRED_COLUMNS)
    cells = [line.split(" | ")[3:6] for line in table.splitlines()[2:]]
    assert cells == [["68.7 µs", "68.7 µs", "246 ms"], ["182 ns", "182 ns", "246 ms"]]
    header, _, line = scale.markdown_table([{"step_s": 0.0943, "samples_per_s": 42.4, "tokens_per_s_per_gpu": 14297.0}],
                                           scale.COLUMNS).splitlines()
    cell = dict(zip(header[2:-2].split(" | "), line[2:-2].split(" | ")))
    assert (cell["step"], cell["samples/s"], cell["tokens/s/GPU"]) == ("94.3 ms", "42.4", "14,297")  # rates stay numbers


def test_an_imbalance_that_even_shares_do_not_explain_is_named_with_the_slow_gpu():
    """Measured on 2 H200s: even shares (0.05 ms predicted) and 1.3 ms of imbalance a step: the GPUs'
    own. With the steps each process was the slowest in, one slow GPU is named, or none."""
    one = scaling.account(_row(n=1, per_process=16, step=0.2653, compute=0.2643, imbalance=0, comm=0, rest=0.001, se=0.0002),
                          None, cuda=True)
    base = {**_row(n=2, per_process=16, step=0.2682, compute=0.2652, imbalance=0.00133, comm=0.00068, rest=0.001, se=0.0002),
            "imbalance_costed_s": 0.00005}
    spread = codes(scaling.account({**base, "slowest_steps": [5, 5], "compute_offset_s": [0.0, 0.0]}, one, cuda=True))
    assert spread["device_imbalance"]["ms"] == pytest.approx(1.33) and spread["device_imbalance"]["shares_ms"] == pytest.approx(0.05)
    assert spread["device_imbalance"]["process"] is None
    slow = codes(scaling.account({**base, "slowest_steps": [1, 9], "compute_offset_s": [-0.0007, 0.0007]}, one, cuda=True))
    assert (slow["device_imbalance"]["process"], slow["device_imbalance"]["slowest_steps"]) == (1, 9)
    assert slow["device_imbalance"]["behind_ms"] == pytest.approx(0.7)
    few = codes(scaling.account({**base, "slowest_steps": [1, 2], "compute_offset_s": [0.0, 0.0]}, one, cuda=True))
    assert "process" not in few["device_imbalance"]  # 3 steps say nothing of which GPU
    shares = scaling.account({**base, "imbalance_costed_s": 0.001}, one, cuda=True)  # the shares explain it
    assert "device_imbalance" not in codes(shares)


def test_a_stall_inside_the_window_is_named_with_the_median_efficiency():
    """One 4.5 s step (a recompilation) in n = 1's window of 24: the means say 152 %; the finding
    names the stall and gives the efficiency of the median steps."""
    times = [0.11] * 23 + [4.5]
    window = {k: v for k, v in scaling.timing(times, 1, 1, 1, []).items() if k in ("median_step_s", "stall_steps", "stall_s")}
    one = scaling.account({**_row(1, 16, sum(times) / 24, 0.28, 0, 0, 0.02), **window}, None, cuda=True)
    assert one["stall_steps"] == 1 and one["stall_s"] == pytest.approx(4.39)
    two = scaling.account({**_row(2, 16, 0.2, 0.17, 0.01, 0.004, 0.016), "median_step_s": 0.2, "stall_steps": 0}, one, cuda=True)
    found = codes(two)
    assert found["stall"] == {"code": "stall", "nproc": 1, "steps": 1, "seconds": pytest.approx(4.39)}
    assert found["median_efficiency"]["efficiency"] == pytest.approx(0.55) == two["efficiency_median"]
    steady_one = scaling.account({**_row(1, 16, 0.11, 0.1, 0, 0, 0.01), "median_step_s": 0.11, "stall_steps": 0}, None, cuda=True)
    steady = scaling.account({**_row(2, 16, 0.2, 0.17, 0.01, 0.004, 0.016), "median_step_s": 0.2, "stall_steps": 0},
                             steady_one, cuda=True)
    assert "efficiency_median" not in steady and not {"stall", "median_efficiency"} & set(codes(steady))


def test_a_count_that_pads_less_says_so():
    """Rows padded for CUDA graphs: 2 GPUs pad 18 % where one pads 27 %, so each computes fewer tokens
    per real token (efficiency can pass 100 %); per computed token it is lower."""
    one = scaling.account({**_row(1, 16, 0.341, 0.338, 0, 0, 0.003), "padding": 0.27}, None, cuda=True)
    two = scaling.account({**_row(2, 16, 0.309, 0.305, 0.001, 0.0001, 0.003), "padding": 0.18}, one, cuda=True)
    assert two["efficiency"] > 1 and codes(two)["padding"] == {"code": "padding", "share": 0.18, "share_1": 0.27}
    assert two["efficiency_computed"] == pytest.approx(two["efficiency"] * 0.73 / 0.82)
    same = scaling.account({**_row(2, 16, 0.35, 0.34, 0.001, 0.0001, 0.003), "padding": 0.26}, one, cuda=True)
    assert "padding" not in codes(same)


def test_a_host_bound_step_is_named_when_less_work_per_process_does_not_shrink_compute():
    """Half the samples per process, compute 1 % lower: the host launching kernels sets the pace."""
    one = scaling.account(_row(1, 16, 0.456, 0.447, 0, 0, 0.009), None, cuda=True)
    host = codes(scaling.account(_row(2, 8, 0.480, 0.444, 0.02, 0.005, 0.011), one, cuda=True))["host_bound"]
    assert host["change"] == pytest.approx(0.444 / 0.447 - 1) and host["fewer"] == 0.5 and host["graphs"] == "off"
    whole = scaling.account({**_row(2, 8, 0.075, 0.057, 0.005, 0.002, 0.011), "cuda_graphs": "step"},
                            scaling.account(_row(1, 16, 0.051, 0.043, 0, 0, 0.008), None, cuda=True), cuda=True)
    assert codes(whole)["host_bound"]["graphs"] == "step" and "recorded_comm" in codes(whole)
    gpu = scaling.account(_row(2, 8, 0.192, 0.190, 0.0005, 0.0001, 0.002), scaling.account(
        _row(1, 16, 0.342, 0.339, 0, 0, 0.003), None, cuda=True), cuda=True)
    assert "host_bound" not in codes(gpu)
    per_device = scaling.account(_row(2, 16, 0.475, 0.454, 0.011, 0.001, 0.009), one, cuda=True)  # same work: no claim
    assert "host_bound" not in codes(per_device)


def test_every_code_renders_as_one_sentence():
    lost = [{"part": name, "share": share, "ms": share * 100, "blank": blank, "noise": 0.004}
            for name, share, blank in zip(scaling.LOST, (-0.031, 0.036, 0.029, 0.0), (False, False, False, True))]
    notes = [{"code": "lost_sum", "lost": 0.034, "parts": lost}, {"code": "noise", "part": "imbalance_s", "ms": 0.2},
             {"code": "device_imbalance", "device": "GPU", "ms": 1.3, "shares_ms": 0.05, "process": None, "steps": 10},
             {"code": "device_imbalance", "device": "CPU", "ms": 1.3, "shares_ms": 0.05, "process": 1, "steps": 10,
              "slowest_steps": 9, "behind_ms": 0.7},
             {"code": "cpu_contention", "speedup": 2.5}, {"code": "host_bound", "change": -0.01, "fewer": 0.5, "graphs": "off"},
             {"code": "padding", "share": 0.18, "share_1": 0.27}, {"code": "fsdp_comm"}, {"code": "recorded_comm"},
             {"code": "stall", "nproc": 1, "steps": 1, "seconds": 4.4}, {"code": "steal", "nproc": 2, "share": 0.05},
             {"code": "median_efficiency", "efficiency": 0.55}]
    assert all(isinstance(scaling.render(n), str) and "\n" not in scaling.render(n) for n in notes)
    with pytest.raises(ValueError):
        scaling.render({"code": "nothing"})


def test_fsdp_rows_say_their_communication_is_counted_in_compute():
    one = scaling.account({**_row(1, 8, 1.0, 0.9, 0, 0, 0.1), "strategy": "fsdp"}, None, cuda=True)
    two = scaling.account({**_row(2, 8, 1.2, 1.1, 0.01, 0.0, 0.1), "strategy": "fsdp"}, one, cuda=True)
    assert "fsdp_comm" in codes(two) and "fsdp_comm" not in codes(one)


def test_one_bucket_exposes_the_whole_all_reduce_in_the_prediction():
    """scale's cost model hides every bucket's all-reduce behind the backward but the last; with
    one bucket as large as the gradients (the speed decider's choice on NVLink) the last bucket is all of them."""
    from ddptune import comm

    grads = 25_000_000  # trainable parameters: 100 MB of fp32 gradients
    summary = {"method": "lora", "gradient_checkpointing": False, "trainable_params": grads, "total_params": 10 * grads,
               "strategy": "ddp", "speed": {"bucket_mb": None}}
    rows = [{"mode": "same-global", "nproc": n, "per_process": 8 // n, "step_s": 10.0 / n, "exposed_comm_s": 0.0,
             "speedup": n} for n in (1, 2)]
    bw = {"peak_busbw_GBps": 100.0}
    exposed = lambda s: [m for m in scale.communication(rows, s, bw, "NVLink", "same-global")["measured"]  # noqa: E731
                         if m["nproc"] == 2][0]["pred_exposed_s"]
    assert exposed(summary) == pytest.approx(comm.ring_allreduce_s(comm.DDP_BUCKET_BYTES, 2, 100e9))
    one_bucket = exposed(dict(summary, speed={"bucket_mb": 96}))
    assert one_bucket == pytest.approx(comm.ring_allreduce_s(grads * 4, 2, 100e9))


def test_scale_names_its_folder_once_and_says_before_it_starts_what_every_run_evaluates():
    """Without --out, scale writes beside output_dir (a folder named for scale already: into it, not
    scale-scale); its plan line says that every run also scores ROUGE where eval.enabled, and it gives
    the note train gives where data.val is still the config file's while data.train was replaced."""
    from ddptune import config
    from pathlib import Path

    assert scale.default_out("runs/tiny") == Path("runs/tiny-scale") and scale.default_out("runs/scale") == Path("runs/scale")
    runs = {"n1": {"nproc": 1}, "same-per-device-n2": {"nproc": 2}}
    for enabled in (True, False):
        cfg = config.load(TINY, [f"eval.enabled={str(enabled).lower()}"])
        (plan,) = scale.plan_lines(cfg, [], runs, ["same-per-device"])
        assert ("eval.enabled=true" in plan) == enabled, plan
    overrides = ["data.train=mine.jsonl"]
    lines = scale.plan_lines(config.load(TINY, overrides), overrides, runs, ["same-per-device"])
    assert [field(line.replace("note: ", "")) for line in lines[1:]] == ["data.val"], lines
