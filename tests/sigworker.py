"""Run by test_faults under `dist.torchrun`: note every signal this worker receives, then exit 128 + it."""
import os
import pathlib
import signal
import sys
import time

out = pathlib.Path(os.environ["SIGWORKER_DIR"])
got: list[int] = []
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, lambda signum, _frame: got.append(signum))
(out / f"ready-{os.environ['RANK']}").write_text(str(os.getpid()))
deadline = time.time() + 60
while not got and time.time() < deadline:
    time.sleep(0.02)
time.sleep(1.0)  # a second copy of the signal (from a terminal, or from torchrun) would arrive meanwhile
(out / f"got-{os.environ['RANK']}").write_text(",".join(map(str, got)))
sys.exit(128 + got[0] if got else 1)
