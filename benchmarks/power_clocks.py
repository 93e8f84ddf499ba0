"""Each GPU's SM clock, power and throttle reasons while it worked, from nvidia-smi's log.

    nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
        --format=csv,noheader -lms 250 > smi.csv &      # beside a run (older drivers: clocks_throttle_reasons.active)
    python benchmarks/power_clocks.py smi.csv [--busy-w 400] [--json clocks.json]

Samples above --busy-w watts count as working. Reasons are nvidia-smi's bit mask: 0x4 is the
software power cap (the board's power limit holds the clock down), 0x0 none. When both GPUs of a
data-parallel step sit at the power cap, each one's clock follows its own power draw, and the same
kernels take longer on whichever runs slower in that step: the step waits for it.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import statistics
from pathlib import Path

REASONS = {0x1: "idle", 0x4: "software power cap", 0x8: "hardware slowdown", 0x20: "software thermal",
           0x40: "hardware thermal", 0x80: "hardware power brake"}


def parse(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 6:
            continue
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc)
            rows.append({"t": t.timestamp(), "gpu": int(parts[1]), "mhz": int(parts[2].split()[0]),
                         "w": float(parts[3].split()[0]), "c": int(parts[4]), "reasons": int(parts[5], 16)})
        except ValueError:  # a header, or "[N/A]"
            continue
    return rows


def summarize(rows: list[dict], busy_w: float) -> dict:
    out = {"busy_w": busy_w, "gpus": []}
    for gpu in sorted({r["gpu"] for r in rows}):
        busy = [r for r in rows if r["gpu"] == gpu and r["w"] > busy_w]
        if not busy:
            out["gpus"].append({"gpu": gpu, "busy_samples": 0})
            continue
        reasons = collections.Counter(r["reasons"] for r in busy)
        out["gpus"].append({
            "gpu": gpu, "busy_samples": len(busy),
            "sm_mhz": {"median": statistics.median(r["mhz"] for r in busy), "min": min(r["mhz"] for r in busy),
                       "max": max(r["mhz"] for r in busy)},
            "power_w": {"median": statistics.median(r["w"] for r in busy), "max": max(r["w"] for r in busy)},
            "temp_c": {"median": statistics.median(r["c"] for r in busy), "max": max(r["c"] for r in busy)},
            "reasons": {", ".join(v for b, v in REASONS.items() if m & b) or "none": k for m, k in reasons.most_common()}})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", type=Path)
    p.add_argument("--busy-w", type=float, default=400.0)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    s = summarize(parse(a.log.read_text()), a.busy_w)
    for g in s["gpus"]:
        if not g["busy_samples"]:
            print(f"GPU {g['gpu']}: never above {a.busy_w:.0f} W")
            continue
        print(f"GPU {g['gpu']}: {g['busy_samples']} samples above {a.busy_w:.0f} W: SM {g['sm_mhz']['median']:.0f} MHz median "
              f"({g['sm_mhz']['min']}-{g['sm_mhz']['max']}), {g['power_w']['median']:.0f} W median, "
              f"{g['temp_c']['max']} C max; reasons {g['reasons']}")
    if a.json:
        a.json.write_text(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()
