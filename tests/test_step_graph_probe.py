"""benchmarks/step_graph_probe.py: on CPU (gloo, two real processes) its eager steps run and train;
the capture and replay are for the GPU (benchmarks/scaling_x2.sh step-graph)."""
from __future__ import annotations

import importlib.util
import json

import pytest

import multiproc
from conftest import ROOT, SHARED_DATA

SAMSUM = SHARED_DATA / "samsum_validation.json"


def probe_part(argv: list[str]) -> dict:
    spec = importlib.util.spec_from_file_location("step_graph_probe", ROOT / "benchmarks" / "step_graph_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe.main(argv)


def test_two_processes_take_eager_steps_on_their_shares(tmp_path):
    if not SAMSUM.is_file():
        pytest.skip("../shared/data is not beside this checkout")
    out = tmp_path / "probe.json"
    first, second = multiproc.run(probe_part, 2, ["--preset", "tiny", "--data", str(SAMSUM), "--samples", "4",
                                                   "--max-length", "256", "--steps", "3", "--json", str(out)])
    assert json.loads(out.read_text()) == first  # rank 0 writes what it returns
    assert first["processes"] == 2 and first["samples_per_step"] == 4 and first["tokens_per_process"] % 256 == 0
    # the same batch every step: the loss falls (each process reports its own share's loss)
    assert first["losses"]["eager"][-1] < first["losses"]["eager"][0]
    assert "graph_ms_per_step" not in first and first["eager_ms_per_step"] > 0 and len(first["losses"]["eager"]) == 3
    assert second["tokens_per_process"] % 256 == 0
