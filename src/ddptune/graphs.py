"""CUDA graphs: the padded lengths, the compile-and-record warm-up, and whole steps recorded.

Graphs replay fixed shapes, so every packed row is padded to one of a few lengths chosen before the
first step: the speed decider's (speed.Speed.sizes, those that leave the least padding over its
sample of the rows), with one more where the run meets a row longer than the longest of them. Before the first step every layer is compiled (and, for layer graphs, recorded) at every length
(`warm_layers`), so no step pays for a new shape. With the whole step recorded (`StepGraphs`), each
step shape this process will meet is recorded too: the forwards and backwards (step.forward_backward,
DDP's all-reduce inside the last), and one graph for all shapes of step.clip_and_update. Nothing of
the warm-up stays: no gradient is all-reduced, gradients are zeroed after, and the random state is
put back. Recording can fail (an operation that cannot be captured): `Unrecordable` says why, what
the failed capture left (the current stream, the random generator) is put back,
and the whole step falls back to compiled layers launched one by one.
"""
from __future__ import annotations

import array
import dataclasses
import functools
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from accelerate.utils import AutocastKwargs

from ddptune import batches, dist, step as step_lib
from ddptune.batches import Stream
from ddptune.speed import DDP_WARMUP


class Unrecordable(RuntimeError):
    """Recording the whole step failed."""


def record(work, pool, side: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """`work()` recorded as a CUDA graph on the stream `side`, its memory from `pool`. A recording
    that fails raises Unrecordable and leaves the process as it found it (`_end_failed_recording`)."""
    graph, current = torch.cuda.CUDAGraph(), torch.cuda.current_stream(side.device)
    try:
        with torch.cuda.graph(graph, pool=pool, stream=side):
            work()
    except RuntimeError as e:
        _end_failed_recording(graph, side, current)
        raise Unrecordable(f"recording the step failed ({dist.first_line(e)})") from e
    return graph


def _end_failed_recording(graph: torch.cuda.CUDAGraph, side: torch.cuda.Stream, current: torch.cuda.Stream) -> None:
    """Undo what a failed recording left. An operation a capture cannot hold (a synchronization, say)
    invalidates it, and then torch.cuda.graph's exit raises in CUDAGraph.capture_end at
    cudaStreamEndCapture (which ends the stream's capture all the same), before the rest of it runs:
    - the current stream stays `side` (the exit never reaches its stream context): put back;
    - the caching allocator goes on allocating to the capture's pool (torch 2.11: a later recording
      into that pool raises "already recording to mempool_id"): the pool is left behind, never
      recorded into again (the fallback records nothing more, and a later run makes its own pool);
    - the device's default generator stays in capture mode (torch 2.11: the next random operation
      outside a recording raises "Offset increment outside graph capture encountered unexpectedly"):
      it takes a copy of its state (the same seed and offset), which is not capturing. Graphs recorded
      before hold the old state, so they must not be replayed: StepGraphs drops them all with the engine.
    A capture still under way on `side` (an error that came before capture_end did) is ended first.
    The pinned-memory allocator's own note of the capture has no Python handle; its filter no longer
    matches any stream once the capture has ended."""
    device = side.device.index if side.device.index is not None else torch.cuda.current_device()
    with torch.cuda.stream(side):
        if torch.cuda.is_current_stream_capturing():
            try:
                graph.capture_end()
            except RuntimeError:
                pass  # invalidated: the capture has ended all the same, and the rest is undone below
    torch.cuda.set_stream(current)
    generator = torch.cuda.default_generators[device]
    generator.graphsafe_set_state(generator.clone_state())


def prepare(parts: step_lib.Parts, loss_model, stream: Stream, first: int, last: int, speed, process: int,
            pad_id: int, side, clock: dist.StepClock) -> tuple[Stream, "StepGraphs | None", str, str | None]:
    """For the run's steps [first, last): the stream with the decider's padded lengths, gradients allocated once outside the graphs' memory (every replay writes them), every
    layer compiled at every length the run meets, and with the whole step recorded every step shape
    this process will meet (`Layout`); what was done, in words; and why recording failed (None: it did not)."""
    lay = Layout.of(stream, first, last, speed.sizes, speed.graphs == "step", process, dist.gather)
    for p in parts.params:
        p.grad = torch.zeros_like(p)
    warm_layers(parts, loss_model, lay.stream, lay.by_length, lay.target_rows, pad_id)
    engine, recorded, failed = None, "compiled and recorded", None
    try:
        engine = StepGraphs(parts, lay.stream, lay.shapes, pad_id, side, clock) if lay.shapes else None  # none: no step left
        recorded = f"{len(engine.graphs)} step shapes recorded whole" if engine else recorded
    except Unrecordable as e:  # the layers are compiled and warm at every length: they are launched one by one
        failed = str(e)
        recorded = f"compiled; {e}: the layers are launched one by one instead"
    return lay.stream, engine, (f"packed rows padded to {', '.join(map(str, lay.stream.graph_lengths))} tokens "
                                f"({1 - lay.tokens / max(lay.padded, 1):.0%} of the computed tokens are padding), {recorded}"), failed


@dataclass(frozen=True)
class Layout:
    """What the graphs of steps [first, last) are prepared with: the stream with the padded lengths
    `sizes` (and the longest row of those steps, of every process, rounded up, where it is longer than
    all of them), one row of each length those steps meet to compile the layers on (the last of that length),
    every padded target count, each step shape this process will meet with its first step's rows,
    and the rows' real and padded tokens. The steps are surveyed as numbers (`survey`), each process
    its share of them where `gather` is given (every process's value, in rank order: a collective that
    every process of the run calls); only the rows warmed on and recorded are read."""
    stream: Stream
    by_length: dict[int, list[dict]]
    target_rows: list[int]
    shapes: dict[tuple, list[list[dict]]]
    tokens: int
    padded: int

    @classmethod
    def of(cls, stream: Stream, first: int, last: int, sizes: tuple[int, ...], whole_step: bool, process: int,
           gather=None) -> "Layout":
        part, parts = (process, stream.parts) if gather else (0, 1)
        rows = survey(stream, first, last, part, parts)
        if gather:  # each process surveyed every parts-th step: all of them, in step order
            rows = np.concatenate(gather(rows))
            rows = rows[np.argsort(rows[:, 3], kind="stable")]
        longest = -(-int(rows[:, 0].max(initial=0)) // batches.GRAPH_PAD) * batches.GRAPH_PAD
        stream = stream.with_lengths(sorted({*sizes, *([longest] if longest > max(sizes, default=0) else [])}))
        tokens, samples, targets, steps, procs, _ = rows.T
        sizes = np.asarray(stream.graph_lengths)
        padded = sizes[np.searchsorted(sizes, tokens)]  # each row's: the shortest length that holds it
        lengths_met, at = np.unique(padded[::-1], return_index=True)  # each length's last row
        forwards = functools.lru_cache(maxsize=None)(lambda step: stream.share(step).forwards)
        where = rows[len(rows) - 1 - at, 3:].tolist()  # (step, process, row) of each
        by_length = {n: forwards(s)[p][i] for n, (s, p, i) in zip(lengths_met.tolist(), where)}
        first_of = {}  # each step shape this process meets: its first step
        if whole_step:
            mine = procs == process
            shape = zip(*(a.tolist() for a in batches.row_shape(tokens[mine], samples[mine], targets[mine], padded[mine],
                                                                 stream.max_length)))
            per_step: dict[int, list] = {}
            for step, row in zip(steps[mine].tolist(), shape):
                per_step.setdefault(step, []).append(row)
            for step, rows_shape in per_step.items():
                first_of.setdefault(tuple(rows_shape), step)
        return cls(stream, by_length, np.unique(batches.target_rows(targets)).tolist(),
                   {shape: forwards(step)[process] for shape, step in first_of.items()},
                   int(tokens.sum(dtype=np.int64)), int(padded.sum(dtype=np.int64)))


def survey(stream: Stream, first: int, last: int, part: int = 0, parts: int = 1) -> np.ndarray:
    """Every packed row of the steps [first, last) (a share of the work: every `parts`-th of them, from
    first + part), of every process, in order, as numbers: an array of a line per row, (tokens,
    samples, loss targets, step, process, its place in the process's rows), 24 bytes a row. Read
    from the examples' lengths (Stream.row_sizes): a million-row run's steps as rows of examples
    would hold their tokens as Python lists (1.46 GiB a process for 100,000 rows measured), and
    reading them took most of the walk's time."""
    out = array.array("i")
    for s in range(first + part, last, parts):
        for p, mine in enumerate(stream.row_sizes(s)):
            for i, (t, n, targets) in enumerate(mine):
                out.extend((t, n, targets, s, p, i))
    return np.frombuffer(out, dtype=np.int32).reshape(-1, 6)


@contextmanager
def on_stream(stream):
    """Work issued inside runs on `stream`, after what the current stream has queued, and the current
    stream waits for it afterwards. None: nothing changes."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream(stream.device).wait_stream(stream)


def warm_layers(parts: step_lib.Parts, loss_model, stream: Stream, by_length: dict[int, list[dict]],
                target_rows: list[int], pad_id: int) -> None:
    """Compile (and with layer graphs record) the layers at every padded length, twice each (a new
    shape's first call warms up, the second records), each with one packed row of the run of that
    length (`by_length`); then the output head (not in a graph) forward and backward at each padded
    target count of the run (`target_rows`)."""
    acc = parts.accelerator
    parts.model.train()  # a model from from_pretrained is in eval mode, and dynamo guards on it
    devices = [acc.device] if acc.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), acc.no_sync(parts.model):
        for _, group in sorted(by_length.items()):
            for _ in range(2):
                batch = step_lib.to_device(stream.collate(group, pad_id), acc.device)
                torch.compiler.cudagraph_mark_step_begin()
                with parts.autocast():
                    loss = parts.model(**batch, num_items=1)
                acc.backward(loss * 0)
        head = loss_model.head.weight
        for n in target_rows:  # the head's matrix products at each count
            hidden = torch.zeros(n, head.shape[1], device=head.device, dtype=head.dtype, requires_grad=True)
            with parts.autocast():
                loss = loss_model.head_loss(hidden, torch.zeros(n, dtype=torch.long, device=head.device))
            torch.autograd.grad(loss, hidden)
    torch._foreach_zero_([p.grad for p in parts.params if p.grad is not None])


class StepGraphs:
    """This process's optimizer steps as two recorded CUDA graphs each: for every step shape the
    forwards and backwards, and one graph for all shapes of clipping and the update. Their inputs
    live at fixed addresses; a step copies its rows there and replays both. The recordings share
    one memory pool (they never run at once; what outlives a replay is allocated outside it).

    Recorded in this order (PyTorch's notes on whole-network capture): every layer compiled at
    every length (warm_layers), DDP_WARMUP forwards and backwards through DDP whose all-reduces sum
    zeros, the optimizer's state created by an update that moves nothing, then the recordings.
    Processes record different shapes at their own pace: a recording runs nothing."""

    def __init__(self, parts: step_lib.Parts, stream: Stream, shapes: dict[tuple, list[list[dict]]], pad_id: int,
                 side: torch.cuda.Stream, clock: dist.StepClock):
        device = parts.accelerator.device
        # without autocast's cache, which would outlive a recording
        autocast = lambda: parts.accelerator.autocast(autocast_handler=AutocastKwargs(cache_enabled=False))  # noqa: E731
        self.parts = dataclasses.replace(parts, autocast=autocast, keep_grads=True)
        self.stream, self.pad_id, self.side, self.pool = stream, pad_id, side, torch.cuda.graph_pool_handle()
        self.num_items = torch.ones((), device=device)   # summary tokens of the global batch
        self.loss_sum = torch.zeros((), device=device)   # this process's loss, out of the backward graphs
        self.inputs: dict[tuple, list[dict]] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.buckets: dict[tuple, int] = {}  # DDP's gradient buckets in each shape's backward (its hook runs while recording)
        self.warm_ddp(next(iter(shapes.values()))[0])
        self.start_optimizer(device)
        for shape, forwards in shapes.items():
            inputs = [step_lib.to_device(stream.collate(g, pad_id), device) for g in forwards]
            clock.buckets = 0
            self.graphs[shape] = self.record(lambda: step_lib.forward_backward(
                self.parts, [(b, True) for b in inputs], self.num_items, self.loss_sum))
            self.inputs[shape], self.buckets[shape] = inputs, clock.buckets
        self.figures = None
        self.update = self.record(self._update)

    def _update(self) -> None:
        self.figures = step_lib.clip_and_update(self.parts, self.loss_sum)

    def record(self, work) -> torch.cuda.CUDAGraph:
        return record(work, self.pool, self.side)

    def warm_ddp(self, group: list[dict]) -> None:
        """DDP_WARMUP forwards and backwards of one row through DDP, every process as many: the
        all-reduces sum zeros (DDP settles its buckets), the gradients are zeroed after."""
        batch = step_lib.to_device(self.stream.collate(group, self.pad_id), self.parts.accelerator.device)
        for _ in range(DDP_WARMUP):
            with self.parts.autocast():
                loss = self.parts.model(**batch, num_items=1)
            self.parts.accelerator.backward(loss * 0)
        torch._foreach_zero_([p.grad for p in self.parts.params])

    def start_optimizer(self, device: torch.device) -> None:
        """The fused AdamW creates its state in its first update: one at learning rate 0 with zero
        gradients (it moves no weight), then its step counts back to 0. A resumed run has its state.
        Its learning rate becomes a tensor on the GPU (a resumed one may have come back as a number)."""
        optimizer = self.parts.optimizer
        for group in optimizer.param_groups:
            if not (torch.is_tensor(group["lr"]) and group["lr"].device == device):
                group["lr"] = torch.tensor(float(group["lr"]), device=device)
        if optimizer.state:
            return
        rates = [group["lr"].clone() for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"].zero_()
        optimizer.step()
        for group, lr in zip(optimizer.param_groups, rates):
            group["lr"].copy_(lr)
        for state in optimizer.state.values():
            state["step"].zero_()

    def replay(self, forwards: list[list[dict]], targets: int, clock: dist.StepClock) -> torch.Tensor:
        """One optimizer step on these rows: copy them to the inputs of their shape and replay."""
        shape = self.stream.shape(forwards)
        for inputs, group in zip(self.inputs[shape], forwards):
            for name, t in self.stream.collate(group, self.pad_id).items():
                if torch.is_tensor(t):
                    inputs[name].copy_(t.pin_memory(), non_blocking=True)
        self.num_items.fill_(targets)
        self.graphs[shape].replay()
        clock.mark("synced")
        self.update.replay()
        clock.buckets = self.buckets[shape]
        return self.figures
