"""Run by test_gpu under `launch.torchrun`: write down whether this worker started with ddptune.cli
imported (forked from the server), the device it found and what a sum there gave it, then exit 0."""
import json
import os
import pathlib
import sys

cli_preloaded = "ddptune.cli" in sys.modules

import torch  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
total = torch.ones(2, device=device).sum().item()
out = pathlib.Path(os.environ["CUDAWORKER_DIR"])
(out / f"rank-{os.environ['RANK']}.json").write_text(json.dumps({"cli_preloaded": cli_preloaded, "device": device,
                                                                  "sum": total}))
