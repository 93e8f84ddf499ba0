"""benchmarks/gemm_shapes.py: one decoder layer's GEMMs at several token counts, and the line through them."""
from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("gemm_shapes", ROOT / "benchmarks" / "gemm_shapes.py")
gemm_shapes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gemm_shapes)


def test_the_8b_layer_has_llamas_projections():
    # grouped-query attention: k and v project to 8 heads of 128, not 32
    assert gemm_shapes.layer_shapes(gemm_shapes.PRESETS["llama-3.1-8b"]) == [
        (4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)]


def test_the_fit_recovers_a_line():
    fixed, per_token = gemm_shapes.fit([(1000, 16.8 + 80.2), (2000, 16.8 + 160.4), (4000, 16.8 + 320.8)])
    assert fixed == pytest.approx(16.8) and per_token == pytest.approx(80.2)


def test_a_run_times_every_count_and_writes_its_fit(tmp_path):
    out = tmp_path / "gemm.json"
    result = gemm_shapes.main(["--preset", "tiny", "--tokens", "64,32,128", "--repeats", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert [r["tokens"] for r in result["rows"]] == [32, 64, 128]
    assert all(r["gemm_ms"] > 0 and r["us_per_token"] == pytest.approx(r["gemm_ms"] / r["tokens"] * 1000)
               for r in result["rows"])
    assert result["layers"] == 2 and set(result["fit"]) == {"fixed_ms", "per_token_us"}


def test_one_count_is_refused():
    with pytest.raises(SystemExit):
        gemm_shapes.main(["--preset", "tiny", "--tokens", "64"])
