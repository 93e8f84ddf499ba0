"""timeline: each process's own GPU time per step, from torch.profiler's Chrome traces."""
import json

import pytest

from conftest import gpu_trace
from ddptune import timeline


def test_each_step_is_the_work_its_launches_queued_split_into_own_work_collectives_alone_and_idle():
    fast, slow = (timeline.step_times(gpu_trace(s)["traceEvents"]) for s in (0, 40))
    assert sorted(fast) == [4, 5]  # ProfilerStep#3 is the fourth step; the early launch's kernel is in none
    # fast: compute 0-100 and 120-170 = 150 µs (the copy inside the GEMM counts once); collectives alone
    # 170-330 = 160 µs (the first all-reduce hid behind compute until 170); idle 100-120
    assert fast[4] == pytest.approx({"compute_s": 150e-6, "wait_s": 160e-6, "idle_s": 20e-6, "span_s": 330e-6, "kernels": 5})
    assert slow[5] == pytest.approx({"compute_s": 190e-6, "wait_s": 120e-6, "idle_s": 20e-6, "span_s": 330e-6, "kernels": 5})
    # a resumed run numbers its steps after the one it started from
    assert sorted(timeline.step_times(gpu_trace()["traceEvents"], first_step=10)) == [14, 15]


def test_rank_lines_put_the_gpu_times_of_steps_every_process_profiled_into_ranks_jsonl_lines(tmp_path):
    for k, slow in enumerate((0, 40)):
        (tmp_path / ("trace.json" if k == 0 else f"trace-rank{k}.json")).write_text(json.dumps(gpu_trace(slow)))
    assert timeline.trace_files(tmp_path, 3) is None
    paths = timeline.trace_files(tmp_path, 2)
    lines = [{"step": s, "compute_s": [1.0, 1.0], "wait_s": [0.0, 0.0], "step_s": [2.0, 2.0], "cost": [5, 5]} for s in (3, 4, 5, 6)]
    got = timeline.rank_lines(lines, [timeline.load(p) for p in paths])
    assert [g["step"] for g in got] == [4, 5] and all(g["cost"] == [5, 5] and g["step_s"] == [2.0, 2.0] for g in got)
    assert got[0]["compute_s"] == pytest.approx([150e-6, 190e-6]) and got[0]["wait_s"] == pytest.approx([160e-6, 120e-6])
    # one process without GPU work in a step: that step is not read
    one = timeline.load(paths[1])
    assert [g["step"] for g in timeline.rank_lines(lines, [timeline.load(paths[0]), {**one, 4: {**one[4], "kernels": 0}}])] == [5]
