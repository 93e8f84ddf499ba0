"""benchmarks/timeline.py: each process's GPU time per step, from torch.profiler's Chrome traces."""
import importlib.util
import json

import pytest

from conftest import ROOT, gpu_trace
from ddptune import metrics

_spec = importlib.util.spec_from_file_location("timeline", ROOT / "benchmarks" / "timeline.py")
timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timeline)


def test_each_step_is_the_work_its_launches_queued_split_into_own_work_collectives_alone_and_idle():
    fast, slow = (timeline.step_times(gpu_trace(s)["traceEvents"]) for s in (0, 40))
    assert sorted(fast) == [4, 5]  # ProfilerStep#3 is the fourth step; the early launch's kernel is in none
    # fast: work 0-100 and 120-170 = 150 µs (the copy inside the GEMM counts once); collectives alone
    # 170-330 = 160 µs (the first all-reduce hid behind work until 170); idle 100-120
    assert fast[4] == pytest.approx({"work_s": 150e-6, "wait_s": 160e-6, "idle_s": 20e-6, "start_us": 1000, "end_us": 1330, "kernels": 5})
    assert slow[5] == pytest.approx({"work_s": 190e-6, "wait_s": 120e-6, "idle_s": 20e-6, "start_us": 2000, "end_us": 2330, "kernels": 5})
    # a resumed run numbers its steps after the one it started from
    assert sorted(timeline.step_times(gpu_trace()["traceEvents"], first_step=10)) == [14, 15]


def test_the_process_that_came_last_to_the_all_reduce_is_the_slowest_whether_it_worked_longer_or_started_late(tmp_path):
    lines = [{"step": s, "compute_s": [1.0] * 3, "wait_s": [0.0] * 3, "step_s": [0.01] * 3, "cost": [5] * 3} for s in (3, 4, 5, 6)]
    # process 1 works 40 µs longer; process 2 does the work of process 0, 60 µs late
    for k, (slow, late) in enumerate(((0, 0), (40, 0), (0, 60))):
        (tmp_path / ("trace.json" if k == 0 else f"trace-rank{k}.json")).write_text(json.dumps(gpu_trace(slow, late=late)))
    assert timeline.trace_files(tmp_path, 4) is None
    got = timeline.rank_lines(lines, [timeline.load(p) for p in timeline.trace_files(tmp_path, 3)])
    assert [g["step"] for g in got] == [4, 5] and all(g["cost"] == [5] * 3 and g["step_s"] == [0.01] * 3 for g in got)
    # compute: from the first GPU's start to this one's end (330 µs), less its wait
    assert got[0]["wait_s"] == pytest.approx([160e-6, 120e-6, 100e-6]) and got[0]["work_s"] == pytest.approx([150e-6, 190e-6, 150e-6])
    assert got[0]["compute_s"] == pytest.approx([170e-6, 210e-6, 230e-6])
    split = metrics.split(got)  # process 2 came last: its 100 µs are the all-reduce itself, the others waited for it
    assert split["slowest_steps"] == [0, 0, 2]
    assert (split["compute_s"], split["imbalance_s"], split["exposed_comm_s"]) == pytest.approx((610e-6 / 3, 230e-6 - 610e-6 / 3, 100e-6))
    assert split["compute_s"] + split["imbalance_s"] + split["exposed_comm_s"] == pytest.approx(330e-6)  # the step on the GPUs
