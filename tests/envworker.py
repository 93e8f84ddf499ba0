"""Run by test_faults under `launch.torchrun`: write down this worker's rank and what its launcher set,
whether it started with ddptune.cli imported, then exit 0."""
import json
import os
import pathlib
import sys

cli_preloaded = "ddptune.cli" in sys.modules

names = ("RANK", "WORLD_SIZE", "DDPTUNE_VALIDATED", "DDPTUNE_SPAWNED", "ENVWORKER_DIR", "OMP_NUM_THREADS")
out = pathlib.Path(os.environ["ENVWORKER_DIR"])
(out / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(
    {**{n: os.environ.get(n) for n in names}, "cli_preloaded": cli_preloaded}))
