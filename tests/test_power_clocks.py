"""benchmarks/power_clocks.py: each GPU's clock and power while it worked, from nvidia-smi's log."""
from __future__ import annotations

import importlib.util

from conftest import ROOT

spec = importlib.util.spec_from_file_location("power_clocks", ROOT / "benchmarks" / "power_clocks.py")
power_clocks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(power_clocks)

LOG = """\
2026/12/01 00:13:15.717, 0, 1980 MHz, 125.42 W, 41, 0x0000000000000000
2026/12/01 00:13:15.720, 1, 345 MHz, 76.45 W, 36, 0x0000000000000001
2026/12/01 00:13:15.976, 0, 1695 MHz, 690.10 W, 63, 0x0000000000000004
2026/12/01 00:13:15.977, 1, 1800 MHz, 660.00 W, 57, 0x0000000000000004
2026/12/01 00:13:16.226, 0, 1755 MHz, 684.00 W, 64, 0x0000000000000004
2026/12/01 00:13:16.227, 1, [N/A], 70.00 W, 36, 0x0000000000000001
2026/12/01 00:13:16.476, 0, 1980 MHz, 450.00 W, 64, 0x0000000000000000
"""


def test_busy_samples_per_gpu_with_the_power_cap_named():
    s = power_clocks.summarize(power_clocks.parse(LOG), busy_w=400)
    zero, one = s["gpus"]
    assert zero["busy_samples"] == 3 and zero["sm_mhz"] == {"median": 1755, "min": 1695, "max": 1980}
    assert zero["reasons"] == {"software power cap": 2, "none": 1}
    assert one["busy_samples"] == 1 and one["power_w"]["max"] == 660.0 and one["reasons"] == {"software power cap": 1}
