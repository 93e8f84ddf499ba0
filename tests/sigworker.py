"""Run by test_faults under `launch.torchrun`: note every signal this worker receives, then exit 128 + it.

No worker exits before every worker has written down what it got: once one worker exits, torchrun
sends SIGTERM to the rest (its own handling of a failed worker), which is not a copy of the signal."""
import os
import pathlib
import signal
import sys
import time

out = pathlib.Path(os.environ["SIGWORKER_DIR"])
rank, world = os.environ["RANK"], int(os.environ["WORLD_SIZE"])
got: list[int] = []
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, lambda signum, _frame: got.append(signum))
(out / f"ready-{rank}").write_text(str(os.getpid()))
deadline = time.time() + 60
while not got and time.time() < deadline:
    time.sleep(0.02)
time.sleep(1.0)  # a second copy of the signal (from a terminal, or from torchrun) would arrive meanwhile
(out / f"got-{rank}.tmp").write_text(",".join(map(str, got)))
os.replace(out / f"got-{rank}.tmp", out / f"got-{rank}")
deadline = time.time() + 30
while not all((out / f"got-{r}").exists() for r in range(world)) and time.time() < deadline:
    time.sleep(0.02)
sys.exit(128 + got[0] if got else 1)
