"""`ddptune scale` end to end (real torchrun + gloo processes through the CLI, on CPU), and its arithmetic."""
from __future__ import annotations

import csv
import json
import shutil
import types

import pytest

from conftest import ROOT, check, ddptune, gpu_trace, metrics
from ddptune import config, scale
from ddptune.config import BatchPlan, ConfigError, TrainConfig

TINY = str(ROOT / "configs" / "tiny.yaml")
FAST = ["data.val=null", "--steps", "3", "--warmup", "1", "--bandwidth-sizes", "64KB,1MB"]


@pytest.fixture(scope="module")
def both_modes(tmp_path_factory):
    """One `ddptune scale` of both modes with --alone (four runs), read by two tests."""
    out = tmp_path_factory.mktemp("both") / "scale"
    return out, check(ddptune("scale", TINY, *FAST, "--nproc", "1,2", "--mode", "both", "--alone", "--out", str(out)))


def test_scale_both_modes_on_the_same_samples(both_modes):
    out, proc = both_modes

    for name in ("scaling.json", "scaling.csv", "scaling.md", "scaling.png", "manifest.json"):
        assert (out / name).is_file(), name
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((out / "scaling.json").read_text())  # strict JSON: no NaN
    assert result["modes"] == ["same-per-device", "same-global"]
    # three runs: n = 1 is shared by both modes and runs the longer of their windows; --alone adds one
    # process at same-global n = 2's share (2 samples a step)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["alone-n2", "n1", "same-global-n2", "same-per-device-n2"]
    assert result["manifest"]["sample_window"] == {"same-per-device": [8, 32], "same-global": [4, 16]}
    rows = {(r["mode"], r["nproc"]): r for r in result["rows"]}
    assert [r["global_batch"] for r in result["rows"]] == [4, 8, 4, 4]
    for (mode, n), r in rows.items():
        base = rows[mode, 1]
        assert r["samples_per_s"] == pytest.approx(r["samples_measured"] / (r["step_s"] * r["steps"]))
        assert r["speedup"] is None or r["speedup"] == pytest.approx(r["samples_per_s"] / base["samples_per_s"])
        assert r["efficiency"] is None or r["efficiency"] == pytest.approx(r["speedup"] / n)
        assert r["samples_measured"] == base["samples_measured"]  # the same samples at every count
        parts = r["parts"]  # the split adds up to the step
        assert r["step_s"] == pytest.approx(sum(parts.values()))
        if n > 1 and None not in (r["lost_compute"], r["lost_imbalance"], r["lost_comm"], r["lost_rest"]) and r["efficiency"]:
            lost = r["lost_compute"] + r["lost_imbalance"] + r["lost_comm"] + r["lost_rest"]
            assert lost == pytest.approx(1 - r["efficiency"], abs=1e-6)
    # the window's steps are the same samples: tokens per window agree across counts
    tokens = lambda run, a, b: sum([x["tokens"] for x in metrics(out / run) if "tokens" in x][a:b])  # noqa: E731
    assert tokens("n1", 2, 8) == tokens("same-per-device-n2", 1, 4)
    assert tokens("n1", 1, 4) == tokens("same-global-n2", 1, 4) == tokens("alone-n2", 2, 8)
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
    # --alone: the same-global count's compute beside one process's alone at its share, and the ceiling
    two = rows["same-global", 2]
    assert two["alone_compute_s"] > 0 and two["ceiling"] == pytest.approx(0.5 * rows["same-global", 1]["step_s"] / two["alone_step_s"])
    assert "one process alone at 2 samples a step" in two["note"]
    assert "alone_compute_s" not in rows["same-per-device", 2]

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
    assert "| same-global | 2 |" in proc.stdout  # the table is printed at the end
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == result["manifest"] and manifest["threads_per_process"] >= 1
    # the host's CPU during each run, read from /proc/stat: busy (the runs themselves at least) and stolen
    assert all(0 < r["host_cpu_busy"] <= 1 and 0 <= r["host_cpu_steal"] <= 1 for r in result["rows"])
    assert "--nproc 1,2" in manifest["command"] and manifest["date"]

    # the folder is never overwritten
    again = ddptune("scale", TINY, *FAST, "--nproc", "1,2", "--out", str(out))
    assert again.returncode == 2 and "already holds files" in again.stderr


def test_gpu_timelines_of_profiled_steps_split_them(both_modes, tmp_path):
    """With the whole step recorded on GPUs, each run profiles --timeline-steps steps after its window
    (after one for the profiler's warm-up) and every process's GPU timeline gives compute, imbalance
    and exposed comm. Here: a 2-process CPU run's folder with GPU timelines written into it for the
    window's last two steps (process 1's GPU 40 µs slower, process 0 waiting for it in the all-reduce)."""
    assert scale.timeline_overrides(4, 0) == ["train.max_steps=4"]
    assert scale.timeline_overrides(4, 2) == ["train.profile_steps=2", "train.profile_after=5",
                                              f"train.max_steps={4 + 1 + 2 + scale.TIMELINE_TAIL}"]
    out, _ = both_modes
    result = json.loads((out / "scaling.json").read_text())
    assert result["manifest"]["timeline_steps"] == 0  # CPU processes: no GPU timeline to read
    run_dir = tmp_path / "n2"
    shutil.copytree(out / "same-global-n2", run_dir)
    steps = result["manifest"]["runs"]["same-global-n2"]["steps"]
    for k, slow in enumerate((0, 40)):  # ProfilerStep#k is step k + 1
        (run_dir / ("trace.json" if k == 0 else f"trace-rank{k}.json")).write_text(
            json.dumps(gpu_trace(slow, profiler_steps=(steps - 2, steps - 1))))
    plan = scale.plan_for(config.load(TINY, ["data.val=null"]).train, "same-global", 2)
    run = {"nproc": 2, "dir": run_dir, "plan": plan, "timeline": 2}
    row = scale.account(dict(scale.measure(run, tuple(result["manifest"]["sample_window"]["same-global"])),
                             mode="same-global"), None, cuda=True)
    assert row["timeline_steps"] == 2 and row["slowest_steps"] == [0, 2]
    # each part is its share of the profiled steps (the host timed them), of the window's step
    ratio = row["step_s"] / row["timeline_step_s"]
    assert (row["compute_s"], row["imbalance_s"], row["exposed_comm_s"]) == pytest.approx(
        (190e-6 * ratio, 20e-6 * ratio, 120e-6 * ratio))
    assert row["rest_s"] == pytest.approx((row["timeline_step_s"] - 330e-6) * ratio)
    assert sum(row["parts"].values()) == pytest.approx(row["step_s"])
    assert "from every process's GPU timeline over 2 steps profiled after the window" in row["note"]
    # a process's timeline missing: the host clock's parts, and the note says why
    (run_dir / "trace-rank1.json").unlink()
    row = scale.account(dict(scale.measure(run, tuple(result["manifest"]["sample_window"]["same-global"])),
                             mode="same-global"), None, cuda=True)
    assert row["timeline_steps"] == 0 and "no profiled step with GPU work in every process's timeline" in row["note"]


def test_timeline_steps_on_cpu_are_refused_before_any_run(tmp_path):
    args = types.SimpleNamespace(config=TINY, overrides=["data.val=null"], nproc="1,2", mode="same-global", steps=3,
                                 warmup=1, out=str(tmp_path / "scale"), bandwidth_sizes="none", numa_binding=None,
                                 alone=False, alone_only=False, timeline_steps=2)
    with pytest.raises(ConfigError, match="--timeline-steps 2: it reads the GPUs' kernels"):
        scale.main(args)
    assert not (tmp_path / "scale").exists()


def test_scale_four_processes_report_their_balance(tmp_path):
    out = tmp_path / "scale"  # in this process (the CLI's own run is both_modes'): its runs are 1 and 4 processes
    args = types.SimpleNamespace(config=TINY, overrides=["data.val=null", "train.micro_batch_size=2", "train.grad_accum=4"],
                                 nproc="1,4", mode="same-global", steps=3, warmup=1, out=str(out), bandwidth_sizes="none",
                                 numa_binding=None, alone=False, alone_only=False, timeline_steps=None)
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
    assert scale.plan_for(packed, "same-global", 2) == BatchPlan(2, 2, None, 8192)  # no extra overrides needed
    assert scale.plan_for(packed, "same-per-device", 4) == BatchPlan(4, 4, None, 8192)
    padded = TrainConfig(micro_batch_size=4, grad_accum=1, packing=False)
    assert scale.plan_for(padded, "same-global", 2) == BatchPlan(2, 2, 2, None)  # the micro-batch shrinks to fit
    assert scale.batch_overrides(BatchPlan(2, 2, 2, None), padded) == [
        "train.micro_batch_size=2", "train.grad_accum=null", "train.effective_batch_size=4"]
    with pytest.raises(ConfigError, match="does not split over 3"):
        scale.plan_for(packed, "same-global", 3)
    # the measured window: whole steps of every batch, `warmup` steps of the largest before it
    assert scale.sample_window([16, 32], warmup=3, measured=30) == (96, 1056)
    assert scale.sample_window([12, 8], warmup=1, measured=2) == (24, 48)
    assert scale.parse_counts("4,1,2,2") == [1, 2, 4]
    for bad in ("2,4", "0,1", "one"):
        with pytest.raises(ConfigError):
            scale.parse_counts(bad)
    assert scale.backward_fraction("lora", False) == pytest.approx(1 / 2)
    assert scale.backward_fraction("qlora", True) == pytest.approx(2 / 3)


def _row(n, per_process, step, compute, imbalance, comm, rest, se=0.001):
    row = {"nproc": n, "per_process": per_process, "samples_per_s": per_process * n / step, "step_s": step,
           "compute_s": compute, "imbalance_s": imbalance, "exposed_comm_s": comm, "rest_s": rest}
    row.update({f"{k}_se": se for k in scale.PART_KEYS})
    return row


def test_every_lost_percent_is_accounted_and_noise_is_named():
    one = scale.account(_row(1, 8, 1.0, 0.9, 0.0, 0.0, 0.1), None, cuda=True)
    # same-per-device at 2: compute grew 0.05, imbalance 0.04, comm 0.01; efficiency = 1 / 1.1
    two = scale.account(_row(2, 8, 1.1, 0.95, 0.04, 0.01, 0.1), one, cuda=True)
    assert two["efficiency"] == pytest.approx(1 / 1.1)
    assert two["lost_compute"] == pytest.approx(0.05 / 1.1) and two["lost_imbalance"] == pytest.approx(0.04 / 1.1)
    assert two["lost_comm"] == pytest.approx(0.01 / 1.1) and two["lost_rest"] is None  # 0 within noise
    # a part below twice its standard error is blank and named, never a negative time
    noisy = scale.account(_row(2, 8, 1.0, 0.9, 0.0005, -0.0004, 0.1), one, cuda=True)
    assert noisy["exposed_comm_s"] is None and noisy["imbalance_s"] is None
    assert "exposed comm within noise" in noisy["note"]
    # on CPU a speedup above n is contention: flagged, not published
    cpu = scale.account(_row(2, 8, 0.4, 0.35, 0.0, 0.0, 0.05), scale.account(_row(1, 8, 1.0, 0.9, 0, 0, 0.1), None, False), cuda=False)
    assert cpu["speedup"] is None and "fought over the CPU cores" in cpu["note"]
    # a virtual machine whose hypervisor gave its cores to other guests during a run says so
    stolen = scale.account({**_row(2, 8, 1.1, 0.95, 0.04, 0.01, 0.1), "host_cpu_steal": 0.05}, one, cuda=True)
    assert "n = 2: the hypervisor took 5% of this host's CPU time during the run (steal)" in stolen["note"]
    assert "hypervisor" not in (two["note"] or "")


def test_an_imbalance_that_even_shares_do_not_explain_is_named_as_the_gpus_spread():
    """The 8B job at 16 samples per GPU on 2 H200s (2026-11-30): shares within 0.02 % of each other,
    yet 1.3 ms a step between the slower GPU and the mean: the GPUs' own spread."""
    one = scale.account(_row(1, 16, 0.2653, 0.2643, 0, 0, 0.001, se=0.0002), None, cuda=True)
    spread = scale.account({**_row(2, 16, 0.2682, 0.2652, 0.00133, 0.00068, 0.001, se=0.0002),
                            "imbalance_costed_s": 0.00005, "slowest_steps": [17, 23], "compute_offset_s": [-0.0001, 0.0001]},
                           one, cuda=True)
    assert "imbalance 1.3 ms a step, of which unequal shares 0.05 ms" in spread["note"]
    assert "own spread" in spread["note"]
    # a row without the count (a run before it was recorded) says where the rest comes from, not which GPU
    older = scale.account({**_row(2, 16, 0.2682, 0.2652, 0.00133, 0.00068, 0.001, se=0.0002),
                           "imbalance_costed_s": 0.00005}, one, cuda=True)
    assert "the rest comes from the GPUs on work of equal cost (every step waits for the slowest)" in older["note"]
    assert "own spread" not in older["note"] and "was the slowest in" not in older["note"]
    shares = scale.account({**_row(2, 16, 0.2682, 0.2652, 0.00133, 0.00068, 0.001, se=0.0002),
                            "imbalance_costed_s": 0.001}, one, cuda=True)
    assert "own spread" not in (shares["note"] or "")
    # the eleventh session's machine: GPU 1 the slower in 35 of 39 steps of equal work (2.7 ms: 1.4 behind the mean)
    one_gpu = scale.account({**_row(2, 16, 0.2697, 0.2666, 0.00142, 0.00068, 0.001, se=0.0002), "imbalance_costed_s": 0.00035,
                             "slowest_steps": [4, 35], "compute_offset_s": [-0.00137, 0.00137]}, one, cuda=True)
    assert ("process 1 was the slowest in 35 of 39 steps, 1.4 ms a step behind the mean: its GPU is slower than the "
            "others on the same work") in one_gpu["note"]
    assert "own spread" not in one_gpu["note"]
    either = scale.account({**_row(2, 16, 0.2697, 0.2666, 0.00142, 0.00068, 0.001, se=0.0002), "imbalance_costed_s": 0.00035,
                            "slowest_steps": [21, 18], "compute_offset_s": [0.0001, -0.0001]}, one, cuda=True)
    assert "a different GPU was the slowest from step to step (each GPU's own spread)" in either["note"]


def test_bad_nproc_is_one_line_error(tmp_path):
    args = types.SimpleNamespace(config=TINY, overrides=[], nproc="2,4", mode="same-per-device", steps=None, warmup=None,
                                 out=str(tmp_path / "x"), bandwidth_sizes="1MB", numa_binding=None, alone=False,
                                 alone_only=False, timeline_steps=None)
    with pytest.raises(ConfigError, match="include 1"):
        scale.main(args)
    args.nproc, args.alone = "1,2", True  # one process at the share of a count only means something at a fixed global batch
    with pytest.raises(ConfigError, match="--alone: it compares same-global counts"):
        scale.main(args)
    args.alone, args.alone_only, args.mode = False, True, "both"  # one process says nothing of same-per-device counts
    with pytest.raises(ConfigError, match="--alone-only: it runs one process only"):
        scale.main(args)
    assert not (tmp_path / "x").exists()


def test_a_stall_inside_the_window_is_named_with_the_median_efficiency():
    """One 4 s step among 0.11 s ones (seen on an H200: the 1-process run of a full fine-tune) makes
    the means say 152 %: the note names the stall and gives the efficiency of the median steps."""
    times = [0.11] * 23 + [4.5]
    one = scale.account({**_row(1, 16, sum(times) / 24, 0.28, 0, 0, 0.02), "median_step_s": 0.11,
                         **scale.stalls(times)}, None, cuda=True)
    assert one["stall_steps"] == 1 and one["stall_s"] == pytest.approx(4.39)
    two = scale.account({**_row(2, 16, 0.2, 0.17, 0.01, 0.004, 0.016), "median_step_s": 0.2,
                         **scale.stalls([0.2] * 12)}, one, cuda=True)
    assert two["efficiency"] > 1 and two["efficiency_median"] == pytest.approx(0.55)
    assert "n = 1: 1 step(s) over 3x the median, 4.4 s in all" in two["note"] and "55.0%" in two["note"]
    steady = scale.account({**_row(2, 16, 0.2, 0.17, 0.01, 0.004, 0.016), "median_step_s": 0.2,
                            **scale.stalls([0.2] * 12)}, scale.account({**_row(1, 16, 0.11, 0.1, 0, 0, 0.01),
                            "median_step_s": 0.11, **scale.stalls([0.11] * 24)}, None, cuda=True), cuda=True)
    assert "efficiency_median" not in steady and "median" not in (steady["note"] or "")


def test_a_count_that_pads_less_says_so():
    """Rows padded for CUDA graphs: a count whose longest row is shorter computes fewer padded tokens
    per real token (efficiency can pass 100 %); the note names it, equal padding goes unnamed."""
    one = scale.account({**_row(1, 16, 0.341, 0.338, 0, 0, 0.003), "padding": 0.27}, None, cuda=True)
    two = scale.account({**_row(2, 16, 0.309, 0.305, 0.001, 0.0001, 0.003), "padding": 0.18}, one, cuda=True)
    assert two["efficiency"] > 1 and "padding 18% of the computed tokens against 27% at n = 1" in two["note"]
    # counted in computed tokens: (1 - 0.27) / (1 - 0.18) of it, under 100 %
    assert two["efficiency_computed"] == pytest.approx(two["efficiency"] * 0.73 / 0.82) and two["efficiency_computed"] < 1
    assert "each GPU computes -11% tokens per real token" in two["note"]
    same = scale.account({**_row(2, 16, 0.35, 0.34, 0.001, 0.0001, 0.003), "padding": 0.26}, one, cuda=True)
    assert "padding" not in (same["note"] or "")


def test_a_host_bound_step_is_named_when_less_work_per_process_does_not_shrink_compute():
    """Same-global on GPUs: half the samples per process should about halve compute. Measured on 2 H200s,
    the 8B QLoRA job's compute stayed at 0.447 -> 0.444 s without graphs, and fell 0.339 -> 0.190 s with them."""
    one = scale.account(_row(1, 16, 0.456, 0.447, 0, 0, 0.009), None, cuda=True)
    host = scale.account(_row(2, 8, 0.480, 0.444, 0.02, 0.005, 0.011), one, cuda=True)
    assert "compute per process fell 1% with 50% fewer samples per process: the step is bound by the host" in host["note"]
    assert "(try train.cuda_graphs=true)" in host["note"]
    still = scale.account({**_row(2, 8, 0.075, 0.057, 0.005, 0.002, 0.011), "cuda_graphs": True},
                          scale.account(_row(1, 16, 0.051, 0.043, 0, 0, 0.008), None, cuda=True), cuda=True)
    assert "compute per process grew 33% with 50% fewer" in still["note"]
    assert "(try train.cuda_graph_scope=step with train.optimizer=adamw: the whole step as recorded CUDA graphs)" in still["note"]
    # with the whole step recorded, its all-reduce is inside the graph: counted in compute, and said so
    whole = scale.account({**_row(2, 8, 0.075, 0.057, 0.005, 0.002, 0.011), "cuda_graphs": True, "cuda_graph_scope": "step"},
                          scale.account(_row(1, 16, 0.051, 0.043, 0, 0, 0.008), None, cuda=True), cuda=True)
    # ... and no host launches are left to blame: the GPU's kernels at their minimum time (the SmolLM2 shape's 5.3 µs GEMMs)
    assert "the GPU's own kernels set the pace" in whole["note"] and "bound by the host" not in whole["note"]
    assert "all-reduce and the wait for the other processes run inside the recorded step" in whole["note"]
    one = scale.account(_row(1, 16, 0.342, 0.339, 0, 0, 0.003), None, cuda=True)
    gpu = scale.account({**_row(2, 8, 0.192, 0.190, 0.0005, 0.0001, 0.002), "cuda_graphs": True}, one, cuda=True)
    assert "bound by the host" not in (gpu["note"] or "")
    per_device = scale.account(_row(2, 16, 0.475, 0.454, 0.011, 0.001, 0.009), one, cuda=True)  # same work: no claim
    assert "bound by the host" not in (per_device["note"] or "")
    # with --alone the guess is checked: one process alone at the share barely faster too, or clearly faster
    one = scale.account(_row(1, 16, 0.051, 0.043, 0, 0, 0.008), None, cuda=True)
    host = scale.account({**_row(2, 8, 0.075, 0.057, 0.005, 0.002, 0.011), "cuda_graphs": True, "alone_compute_s": 0.040,
                          "alone_compute_s_se": 0.0005, "alone_step_s": 0.048}, one, cuda=True)
    assert "with 50% fewer samples per process (one process alone too): the step is bound by the host" in host["note"]
    beside = scale.account({**_row(2, 8, 0.075, 0.057, 0.005, 0.002, 0.011), "cuda_graphs": True, "alone_compute_s": 0.030,
                            "alone_compute_s_se": 0.0005, "alone_step_s": 0.038}, one, cuda=True)
    assert "bound by the host" not in beside["note"]
    assert "36.0% running beside the other process(es)" in beside["note"]


def test_the_alone_run_splits_lost_compute_and_gives_the_ceiling():
    """scale --alone on packed rows without padding: the alone run computes the count's tokens per process."""
    one = scale.account({**_row(1, 16, 0.456, 0.447, 0, 0, 0.009), "computed_per_process": 3400}, None, cuda=True)
    two = scale.account({**_row(2, 8, 0.250, 0.240, 0.004, 0.001, 0.005), "computed_per_process": 1700,
                         "alone_compute_s": 0.235, "alone_compute_s_se": 0.001, "alone_step_s": 0.244,
                         "alone_computed_per_process": 1700}, one, cuda=True)
    assert two["lost_smaller_batch"] == pytest.approx((0.235 - 0.2235) / 0.250)
    assert two["lost_compute"] == pytest.approx((0.240 - 0.2235) / 0.250)  # the whole lost compute is unchanged
    assert two["ceiling"] == pytest.approx(0.228 / 0.244) and two["alone_compute_s"] == 0.235
    assert "93.4% is the most n = 2 can keep at this share" in two["note"]
    assert "4.6% is the smaller batch (one GPU alone loses it too) and 2.0% running beside" in two["note"]
    assert "moved" not in two["note"]
    # within noise: the split is left blank, the ceiling stays
    close = scale.account({**_row(2, 8, 0.250, 0.240, 0.004, 0.001, 0.005), "computed_per_process": 1700,
                           "alone_compute_s": 0.224, "alone_compute_s_se": 0.002, "alone_step_s": 0.233,
                           "alone_computed_per_process": 1700}, one, cuda=True)
    assert close["lost_smaller_batch"] is None and close["ceiling"] == pytest.approx(0.228 / 0.233)


def test_the_alone_run_is_moved_to_the_tokens_of_the_count_when_rows_are_padded():
    """Measured on 2 H200s (8B QLoRA, CUDA graphs, same-global): n = 1 pads its rows of 16 samples to 4,608
    tokens, n = 2's balanced halves to 2,304, the alone run's consecutive 8-sample rows to 2,816. Its compute
    is moved to 2,304 tokens along the line through n = 1 and it: 64 µs a token, 38 ms a step fixed."""
    one = scale.account({**_row(1, 16, 0.3362, 0.3335, 0, 0, 0.0027), "computed_per_process": 4608}, None, cuda=True)
    two = scale.account({**_row(2, 8, 0.1918, 0.1887, 0.0004, 0.0001, 0.0026), "computed_per_process": 2304,
                         "alone_compute_s": 0.2187, "alone_compute_s_se": 0.0005, "alone_step_s": 0.2212,
                         "alone_computed_per_process": 2816}, one, cuda=True)
    per_token = (0.3335 - 0.2187) / (4608 - 2816)
    moved = 0.2187 - per_token * 512
    assert two["alone_compute_s"] == pytest.approx(moved) and two["alone_compute_measured_s"] == 0.2187
    assert two["lost_smaller_batch"] == pytest.approx((moved - 0.5 * 0.3335) / 0.1918)  # 10.0 %
    assert two["ceiling"] == pytest.approx(0.5 * 0.3362 / (0.2212 - 0.2187 + moved))  # 89.2 %
    assert "89.2% is the most n = 2 can keep at this share, and data parallelism kept 98.2% of that" in two["note"]
    assert "10.0% is the smaller batch" in two["note"]
    assert "1.5% running beside" in two["note"]
    assert "alone computed 2,816 tokens a step against 2,304 per process here" in two["note"]
    # a step: 40.5 ms fixed + 64.2 µs a token (n = 1 and alone); a ceiling of 97 % at 2 needs 19,776 tokens a step
    # at n = 1, 68.7 samples of 288 tokens: rounded up to what splits over 2 processes
    assert "a step is 40.5 ms fixed + 64.2 µs a computed token, so a global batch of about 70 samples" in two["note"]


def test_alone_only_measures_the_ceiling_of_two_gpus_on_one(tmp_path):
    """--alone-only: n = 1 and one process alone at n = 2's share, nothing in parallel (one GPU is enough)."""
    out = tmp_path / "ceiling"
    args = types.SimpleNamespace(config=TINY, overrides=["data.val=null"], nproc="1,2", mode="same-global", steps=3,
                                 warmup=1, out=str(out), bandwidth_sizes="1MB", numa_binding=None, alone=False,
                                 alone_only=True, timeline_steps=None)
    assert scale.main(args) == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["alone-n2", "n1"]
    result = json.loads((out / "scaling.json").read_text())
    one, two = result["rows"]
    assert result["bandwidth"]["status"].startswith("not measured (--alone-only")
    assert two["speedup"] is None and two["samples_measured"] == one["samples_measured"]  # the same samples
    assert two["ceiling"] == pytest.approx(0.5 * one["step_s"] / two["alone_step_s"])
    assert two["speedup_ceiling"] == pytest.approx(2 * two["ceiling"])
    assert "not run (--alone-only): one process alone at 2 samples a step" in two["note"]
    assert "--alone-only" in result["manifest"]["command"] and (out / "scaling.png").is_file()


def test_alone_only_moves_a_padded_alone_run_to_n_1_s_tokens_split_evenly():
    """The 8B QLoRA numbers above without the n = 2 run: the alone run's 2,816 computed tokens a step
    are moved to 2,304 (half of n = 1's) along the line through n = 1 and it: the same 89 % ceiling
    as --alone's with the n = 2 run (89.2 %: there the compute is moved, here the step)."""
    one = scale.account({**_row(1, 16, 0.3362, 0.3335, 0, 0, 0.0027), "computed_per_process": 4608,
                         "global_batch": 16}, None, cuda=True)
    alone = {"per_process": 8, "steps": 40, "samples_measured": 320, "step_s": 0.2212, "compute_s": 0.2187,
             "computed_per_process": 2816}
    two = scale.ceiling_row(alone, one, 2)
    step = 0.2212 - (0.3362 - 0.2212) / (4608 - 2816) * 512
    assert two["alone_step_s"] == pytest.approx(step) and two["ceiling"] == pytest.approx(0.5 * 0.3362 / step)
    assert two["alone_compute_s"] == pytest.approx(0.2187 + step - 0.2212) and two["alone_step_measured_s"] == 0.2212
    assert "n = 2 can keep at most 89.3% at this global batch, a speedup of at most 1.79x" in two["note"]
    assert "against 2,304, 1/2 of n = 1's, which the line through n = 1 and it puts at 188.3 ms" in two["note"] and "a global batch of about 70 samples" in two["note"]
    even = scale.ceiling_row({**alone, "computed_per_process": 2304, "step_s": 0.19}, one, 2)  # unpadded: as measured
    assert even["alone_step_s"] == 0.19 and "the line through" not in even["note"]


def test_fsdp_rows_say_their_communication_is_counted_in_compute():
    one = scale.account({**_row(1, 8, 1.0, 0.9, 0, 0, 0.1), "strategy": "fsdp"}, None, cuda=True)
    two = scale.account({**_row(2, 8, 1.2, 1.1, 0.01, 0.0, 0.1), "strategy": "fsdp"}, one, cuda=True)
    assert "counted in compute" in two["note"] and "counted in compute" not in (one["note"] or "")


def test_one_bucket_exposes_the_whole_all_reduce_in_the_prediction():
    """scale's cost model hides every bucket's all-reduce behind the backward but the last; with
    train.ddp_bucket_mb as large as the gradients the last bucket is all of them."""
    from ddptune import comm

    grads = 25_000_000  # trainable parameters: 100 MB of fp32 gradients
    summary = {"method": "lora", "gradient_checkpointing": False, "trainable_params": grads, "total_params": 10 * grads,
               "strategy": "ddp"}
    rows = [{"mode": "same-global", "nproc": n, "per_process": 8 // n, "step_s": 10.0 / n, "exposed_comm_s": 0.0,
             "speedup": n} for n in (1, 2)]
    bw = {"peak_busbw_GBps": 100.0}
    exposed = lambda s: [m for m in scale.communication(rows, s, bw, "NVLink", "same-global")["measured"]  # noqa: E731
                         if m["nproc"] == 2][0]["pred_exposed_s"]
    assert exposed(summary) == pytest.approx(comm.ring_allreduce_s(comm.DDP_BUCKET_BYTES, 2, 100e9))
    assert exposed(dict(summary, ddp_bucket_mb=None)) == exposed(summary)
    assert exposed(dict(summary, ddp_bucket_mb=256)) == pytest.approx(comm.ring_allreduce_s(4 * grads, 2, 100e9))
