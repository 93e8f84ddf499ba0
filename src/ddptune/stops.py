"""How a training run stops before its end: the errors train.py raises, each of which start.py turns into an exit code."""
from __future__ import annotations


class NonFinite(RuntimeError):
    """The loss or gradient norm of a step is not a finite number, or the loss is exactly 0: training stops."""


class Diverged(RuntimeError):
    """The processes' trained weights differ at the end of a run: the replicas did not take the same steps."""


class Interrupted(Exception):
    """SIGINT or SIGTERM reached a process: the step was finished and checkpointed, then training stopped."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
