"""When compiling fails, the run goes on one level down instead of ending, one line saying why.

The levels: the whole step recorded (graphs.py: a length that cannot be recorded runs its compiled
layers launched one by one) → compiled layers with combined kernels → compiled layers without them →
eager layers. Compiled layers without graphs compile in the run's first step, so that step is the one
tried again; layers compiled for recording compile before it (train.prepare_graphs).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ddptune import dist, model as model_lib


def first_step(r: Any, step: int, train_step: Callable[[Any, int], dict]) -> dict:
    """`train_step(r, step)` for the run's first step; where compiling the layers fails there, the
    same step again one level down."""
    while True:
        try:
            return train_step(r, step)
        except torch._dynamo.exc.TorchDynamoException as e:
            if not r.speed.compiled or r.engine is not None or r.stream.graph_lengths:
                raise
            why = f"compiling the layers failed ({dist.first_line(e)})"
            uncombined(r, why) if r.speed.combo else to_eager(r, why)


def uncombined(r: Any, why: str) -> None:
    """The layers compile again without combined kernels."""
    _reset(r)
    model_lib.compile_layers(r.model)
    reasons = {**r.speed.reasons, "combined kernels": f"off ({why}: compiled layers without them)"}
    r.speed = dataclasses.replace(r.speed, combo=False, reasons=reasons)
    r.accelerator.print(f"ddptune: {why}: compiling the layers without combined kernels")


def to_eager(r: Any, why: str) -> None:
    """The layers run uncompiled from here on."""
    _reset(r)
    r.engine, r.stream = None, r.stream.with_lengths([])
    r.parts = dataclasses.replace(r.parts, layer_graphs=False)
    reasons = {**r.speed.reasons, "compiled layers": f"off ({why}: fell back to eager layers)", "CUDA graphs": "off (eager layers)",
               "combined kernels": "off (eager layers)"}
    r.speed = dataclasses.replace(r.speed, compiled=False, graphs="off", lengths=0, combo=False, reasons=reasons)
    r.accelerator.print(f"ddptune: {why}: falling back to eager layers")


def _reset(r: Any) -> None:
    """Nothing compiled is left, nor any gradient of the failed try."""
    model_lib.uncompile_layers(r.model)
    torch._dynamo.reset()
    for p in r.parts.params:
        p.grad = None
