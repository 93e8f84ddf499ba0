"""When compiling fails, the run goes on one level down instead of ending, one line saying why.

The levels: the whole step recorded (graphs.py: a length that cannot be recorded runs its compiled
layers launched one by one) → compiled layers with combined kernels → compiled layers without them →
eager layers. Compiled layers without graphs compile in the run's first step, so that step is the one
tried again (train.first_step); layers compiled for recording compile before it (train.prepare_graphs).
Each function here takes the level a run is at and returns the one below; the caller runs on with it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from ddptune import dist, model as model_lib
from ddptune.batches import Stream
from ddptune.graphs import StepGraphs
from ddptune.reasons import Reason
from ddptune.speed import Speed
from ddptune.step import Parts


@dataclass(frozen=True)
class Level:
    """What runs a step, which falling back changes."""
    speed: Speed               # the choices and their reasons (the banner, summary.json's `speed`)
    parts: Parts               # what a step touches
    engine: StepGraphs | None  # the whole step recorded, or None
    stream: Stream             # the shares of each step (their padded lengths, with graphs)


def level_for_retry(level: Level, model: torch.nn.Module, error: Exception, say: Callable[[str], None]) -> Level | None:
    """The level to run the first step again at, where compiling the layers in that step raised
    `error`: without combined kernels where they were on, else eager layers. None where no layer
    compiled in that step (nothing to fall back from: the error stands)."""
    if not level.speed.compiled or level.engine is not None or level.stream.graph_lengths:
        return None
    why = f"compiling the layers failed ({dist.first_line(error)})"
    return uncombined(level, model, why, say) if level.speed.combo else to_eager(level, model, why, say)


def uncombined(level: Level, model: torch.nn.Module, why: str, say: Callable[[str], None]) -> Level:
    """The level below `level` where combined kernels fail to compile: the layers compiled again without them."""
    _reset(level.parts, model)
    model_lib.compile_layers(model)
    reasons = {**level.speed.reasons, "combined kernels": Reason(code="combo_failed", numbers={"why": why})}
    say(f"ddptune: {why}: compiling the layers without combined kernels")
    return dataclasses.replace(level, speed=dataclasses.replace(level.speed, combo=False, reasons=reasons))


def to_eager(level: Level, model: torch.nn.Module, why: str, say: Callable[[str], None]) -> Level:
    """The level below every compiled one: the layers run uncompiled from here on, with no graphs and no padded lengths."""
    _reset(level.parts, model)
    eager = Reason(code="eager_layers")
    reasons = {**level.speed.reasons, "compiled layers": Reason(code="compile_failed", numbers={"why": why}),
               "CUDA graphs": eager, "combined kernels": eager}
    speed = dataclasses.replace(level.speed, compiled=False, graphs="off", lengths=0, combo=False, reasons=reasons)
    say(f"ddptune: {why}: falling back to eager layers")
    return Level(speed, dataclasses.replace(level.parts, layer_graphs=False), None, level.stream.with_lengths([]))


def _reset(parts: Parts, model: torch.nn.Module) -> None:
    """Nothing compiled is left, nor any gradient of the failed try."""
    model_lib.uncompile_layers(model)
    torch._dynamo.reset()
    for p in parts.params:
        p.grad = None
