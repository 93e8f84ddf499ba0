"""benchmarks/layer_kernels.py: a variant's settings, and the packed row every variant is timed on."""
from __future__ import annotations

import importlib.util

import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("layer_kernels", ROOT / "benchmarks" / "layer_kernels.py")
layer_kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layer_kernels)


def test_a_variants_settings_split_into_environment_inductor_switches_and_options():
    env, options = layer_kernels.settings("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1,inductor.fallback_random=true,"
                                          "dropout=0,combo=false")
    assert env == {"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"}
    assert options == {"dropout": 0.0, "combo": False, "inductor": {"fallback_random": True}}
    assert layer_kernels.settings("") == ({}, {"dropout": None, "combo": True, "inductor": {}})


def test_an_unknown_setting_stops_before_any_run(monkeypatch):
    ran = []
    monkeypatch.setattr(layer_kernels, "run_variant", lambda name, *_: ran.append(name) or {"rc": 0})
    with pytest.raises(SystemExit) as stop:
        layer_kernels.main(["--variant", "shipped=", "--variant", "bad=lora_rank=8"])
    assert stop.value.code not in (0, None) and ran == []


@pytest.mark.parametrize("tokens", [120, 3324])
def test_the_packed_row_holds_exactly_the_tokens_asked_for_with_30_percent_of_each_sample_trained(tokens):
    row = layer_kernels.packed_row(tokens, vocab=320, seed=tokens)
    cu = row["cu_seq_lens_q"].tolist()
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    assert row["input_ids"].shape == (1, tokens) and cu[-1] == tokens
    assert all(1 <= n <= 400 for n in lengths) and all(n >= 120 for n in lengths[:-1])
    # each sample trains its last max(1, 30 %) tokens, each predicted by the token before it
    assert len(row["targets"]) == sum(max(1, int(0.3 * n)) for n in lengths)
    assert row["targets"].tolist() == row["input_ids"][0, row["target_index"] + 1].tolist()
