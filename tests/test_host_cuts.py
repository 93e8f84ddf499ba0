"""benchmarks/host_cuts.py: its cuts take effect, and its summary's medians leave out the first steps."""
from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("host_cuts", ROOT / "benchmarks" / "host_cuts.py")
host_cuts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_cuts)


def test_the_summary_takes_medians_after_the_warmup_steps(tmp_path):
    run = tmp_path / "hc-base"
    run.mkdir()
    rows = [{"step": i + 1, "loss": 2.0 - i / 10, "step_time_s": 5.0 if i < host_cuts.WARMUP else 0.2 + i / 100,
             "host_s": 0.1, "tokens": 1000} for i in range(9)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "val_loss": 1.0}\n')
    out = host_cuts.summary([str(run)])["hc-base"]
    assert out["steps"] == 9 and out["measured"] == 9 - host_cuts.WARMUP
    assert out["median_step_time_s"] == pytest.approx(0.265) and out["median_host_s"] == 0.1
    assert out["real_tok_s_per_gpu"] == pytest.approx(4000 / sum(0.2 + i / 100 for i in range(5, 9)))
    assert out["final_loss"] == pytest.approx(1.2) and len(out["step_times_s"]) == 9


def test_the_asserts_cut_turns_inductors_asserts_off_and_an_unknown_cut_is_refused(monkeypatch):
    import torch._inductor.config as inductor

    for name in ("size_asserts", "alignment_asserts", "scalar_asserts"):
        monkeypatch.setattr(inductor, name, True)
    host_cuts.apply("asserts")
    assert not (inductor.size_asserts or inductor.alignment_asserts or inductor.scalar_asserts)
    with pytest.raises(SystemExit):
        host_cuts.apply("everything")
