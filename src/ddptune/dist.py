"""Processes: the one place that knows about ranks, launchers and process groups.

- Under `accelerate launch`, `torchrun` or `--nproc` (launch.py) the launcher has set RANK,
  LOCAL_RANK and WORLD_SIZE; without one, a process is a group of one.
- `setup(precision, strategy)`: joins the process group the launcher described (a group of one
  without a launcher) through an Accelerator, which also sets this process's CUDA device before any
  CUDA work; with strategy fsdp the Accelerator shards the model with FSDP2 in `prepare`, which
  then checks that each process holds only its share of the frozen base.
- `on_main(accelerator, fn)`: the process that talks to the user does something (validation), the
  others wait for its answer.
- `StepClock`: each process times its own share of an optimizer step on its device's clock:
  its compute, how long it then waited for the gradient all-reduce, its optimizer, its step.
Model and data code never see any of this.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import warnings
from datetime import timedelta

import torch
import transformers
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, broadcast_object_list, gather_object

from ddptune import launch
from ddptune.launch import THREADS_WHY, cpu_threads, in_launched_process, is_main_process, validated_by_parent

# what setup() wrote into os.environ, for teardown(): name -> (value before, or None; value written, or None)
_env_written: dict[str, tuple[str | None, str | None]] = {}
_made_state = False  # setup() made accelerate's process-wide state: teardown() clears it
threads_why = "OMP_NUM_THREADS"  # why this process has torch.get_num_threads() threads, in words (setup)


def setup(precision: str = "auto", strategy: str = "ddp", log_with: str = "none", logging_dir=None) -> Accelerator:
    """This process's Accelerator: the process group (NCCL on GPUs, gloo on CPU), its device, bf16
    autocast when `precision` resolves to bf16, and a quiet console on every process but rank 0.
    With strategy fsdp, `accelerator.prepare(model, optimizer)` shards them (`fsdp_plugin`).
    `log_with` (tensorboard, wandb, mlflow; none: no tracker): accelerate's tracker, which
    `init_trackers` starts on the main process only, TensorBoard's in `logging_dir`.
    What it writes into os.environ (a launcher's variables for a group of one, accelerate's
    ACCELERATE_USE_FSDP) and accelerate's process-wide state, if it made it, `teardown` undoes."""
    global _made_state
    before = dict(os.environ)
    if _made_state:  # an earlier command in this process (the Python API) left its state: its FSDP plugin, its type
        _reset_accelerate()
    _made_state = not PartialState._shared_state
    try:
        return _setup(precision, strategy, log_with, logging_dir)
    finally:  # also after a failure: teardown then restores what was written before it
        for name in before.keys() | os.environ.keys():
            if before.get(name) != os.environ.get(name):
                _env_written[name] = (_env_written.get(name, (before.get(name),))[0], os.environ.get(name))


def _setup(precision: str, strategy: str, log_with: str, logging_dir) -> Accelerator:
    cuda = torch.cuda.is_available()
    if cuda:
        # cuDNN's attention spends ~25 ms of CPU per call building a plan for every new sequence
        # length (measured on H200, torch 2.11): with varying lengths it dominated the step.
        torch.backends.cuda.enable_cudnn_sdp(False)
    global threads_why
    if not os.environ.get("OMP_NUM_THREADS"):  # in-process (no launcher set it): what --nproc 1 gives
        threads, threads_why = cpu_threads(1, cuda)
        torch.set_num_threads(threads)
    else:  # the user's, or chosen by ddptune's launcher, which says why
        threads_why = os.environ.get(THREADS_WHY, "OMP_NUM_THREADS")
    bf16 = precision == "bf16" or (precision == "auto" and cuda)
    # Buffers (rotary frequencies) never change: broadcasting them before every forward would be a
    # collective that makes every process wait for the slowest at each micro-step, not once a step.
    # (torch 2.13 renames the switch forward_sync_buffers, which accelerate does not pass yet.)
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
    # Gradients as views of the all-reduce buckets: no copy of every gradient into its bucket.
    ddp = DistributedDataParallelKwargs(broadcast_buffers=False, gradient_as_bucket_view=True)
    plugin = fsdp_plugin(bf16) if strategy == "fsdp" else None
    if plugin is not None and not in_launched_process():
        # FSDP shards over a process group, also over a group of one: form it as a launcher would
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                          WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    if not cuda and "RANK" in os.environ:
        # accelerate takes this for a launched CPU job and, without OMP_NUM_THREADS, warns and sets 2
        # threads: keep the threads this process already has (ddptune's --nproc gives its children theirs)
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    accelerator = Accelerator(cpu=not cuda, mixed_precision="bf16" if bf16 else "no", kwargs_handlers=[ddp],
                              fsdp_plugin=plugin, log_with=None if log_with == "none" else log_with,
                              project_dir=logging_dir)
    if plugin is not None and not accelerator.is_fsdp2:
        # accelerate (1.15) takes up an FSDP plugin only for accelerator device types (its state.py
        # switches MULTI_GPU, MULTI_NPU, ... to FSDP, not MULTI_CPU) and drops it silently on CPU,
        # though torch's fully_shard runs over gloo there. Say FSDP so that prepare, no_sync and
        # clip_grad_norm_ take their FSDP2 paths on CPU too: the same code the GPUs run. Both states
        # are set, as accelerate does for GPUs (each new AcceleratorState copies PartialState's).
        accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    if not accelerator.is_main_process:
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        logging.disable(logging.WARNING)
        warnings.filterwarnings("ignore")
    return accelerator


def resume_threads(saved: int | None, now: int, forced: bool) -> tuple[int, str | None]:
    """The CPU threads a process resuming a checkpoint written with `saved` threads a process (None: not
    recorded) takes, where it has `now`: the checkpoint's, since the order of a step's sums, and so the
    last bits of every result, depend on the thread count, unless the user set another (`forced`:
    OMP_NUM_THREADS); then a line that says so."""
    if not saved or saved == now:
        return now, None
    if forced:
        return now, (f"OMP_NUM_THREADS={now} gives each process {now} CPU thread(s), the checkpoint was written with "
                     f"{saved}: the resumed steps may differ from an unbroken run's in their last bits "
                     f"(OMP_NUM_THREADS={saved}, or unset, resumes exactly)")
    return saved, None


def take_threads(saved: int | None) -> str | None:
    """On a CPU, resume with the checkpoint's thread count (`resume_threads`); the line to say, if any."""
    global threads_why
    now = torch.get_num_threads()
    threads, note = resume_threads(saved, now, threads_why == "OMP_NUM_THREADS")
    if threads != now:
        torch.set_num_threads(threads)
        threads_why = f"the checkpoint's, for an exact resume; this machine's choice was {now}; OMP_NUM_THREADS=N sets it"
    return note


def set_bucket_mb(accelerator: Accelerator, mb: float | None) -> None:
    """DDP's gradient bucket size in MiB for the wrapper `accelerator.prepare` builds next (None:
    torch's default, 25 MiB after a first bucket of 1 MiB)."""
    handler = accelerator.ddp_handler
    if handler is not None:
        handler.bucket_cap_mb = mb if mb else 25


def one_machine() -> bool:
    """Whether every process of the group runs on this machine (torchrun's LOCAL_WORLD_SIZE)."""
    return os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")) == os.environ.get("WORLD_SIZE", "1")


def _reset_accelerate() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def teardown() -> None:
    """Leave the process group at the end of a command, as every process of a finished job must:
    NCCL warns at exit ("destroy_process_group() was not called") and may leak its resources
    otherwise. Then this process is as `setup` found it, for a later command in it (the Python
    API, tests): os.environ without the variables setup wrote (else `in_launched_process` would
    take it for a launched worker; a variable changed since by someone else is left as it is),
    and no accelerate state (each Accelerator shares the first one's, with its FSDP type and its
    precision: a later DDP setup would take FSDP's path). An Accelerator from before is unusable."""
    global _made_state
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if _made_state:
        _reset_accelerate()
        _made_state = False
    for name, (old, new) in _env_written.items():
        if os.environ.get(name) != new:
            continue
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old
    _env_written.clear()


def fsdp_plugin(bf16: bool) -> FullyShardedDataParallelPlugin:
    """FSDP2 as ddptune uses it.

    - One shard unit per decoder layer (the model's `_no_split_modules`), plus the root for the
      embeddings, final norm and head; each unit's weights are all-gathered just before its forward,
      freed after it (reshard_after_forward) and gathered again for its backward. Frozen base
      weights and LoRA adapters share a unit: FSDP2 shards each parameter on its own (a DTensor),
      so mixing requires_grad in one unit needs nothing like FSDP1's use_orig_params. A 4-bit base
      (QLoRA) shards the same way: its codes are stored in bf16 containers (model.QUANT_STORAGE),
      gathered bit for bit, and each layer keeps its quantization state whole (`prepare`).
    - bf16: weights are cast to bf16 for the all-gather and the compute, gradients are
      reduce-scattered in fp32 (as DDP all-reduces fp32 gradients) into fp32 master weights.
    - Gradients are averaged over the processes by the reduce-scatter, as DDP's all-reduce does, so
      the loss scaling in train.train_step holds for both.
    - Activation checkpointing stays with train.gradient_checkpointing (transformers' non-reentrant
      checkpointing, set on the model): accelerate's own wraps layers with preserve_rng_state=False,
      so the recomputed dropout masks (LoRA's) would differ from the forward's.
    - Checkpoints are written by ddptune (safetensors + JSON per process), not accelerate's
      save_state: its sharded format (torch.distributed.checkpoint) pickles its metadata.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                          reshard_after_forward=True, mixed_precision_policy=policy,
                                          activation_checkpointing=False, cpu_ram_efficient_loading=False)


class ShardingFailed(RuntimeError):
    """FSDP left part of the frozen base whole on every process: the run stops before its first step."""


def prepare(accelerator: Accelerator, model, optimizer):
    """`accelerator.prepare(model, optimizer)`: DDP's wrapper, or FSDP2's sharding. Before sharding, a
    4-bit base's layers keep their quantization state (model.keep_quant_state), which their gathered
    weights then carry; after it, each process must hold about its 1/N of the frozen base's bytes
    (`unsharded`), or every process stops with one line (ShardingFailed): a weight FSDP leaves whole
    costs its full size on every GPU, silently."""
    from ddptune import model as model_lib

    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if fsdp:
        model_lib.keep_quant_state(model)
    else:
        leave_frozen_weights(model, compare=accelerator.num_processes > 1)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    if fsdp and (layers := model_lib.four_bit_layers(prepared)):
        _state_on_gathered_weights(prepared, layers)
    if fsdp and accelerator.num_processes > 1:
        problems = [p for p in gather(unsharded(prepared, accelerator.num_processes)) if p]
        if problems:
            raise ShardingFailed(problems[0])
    return prepared, optimizer


class ReplicasDiffer(RuntimeError):
    """The processes loaded different frozen weights: their steps would train different models."""


def leave_frozen_weights(model, compare: bool) -> None:
    """DDP's wrapper broadcasts only what trains: every process loaded the same frozen base, so sending
    rank 0's copy again (557 MB for a 135M model in fp32, the whole base for an 8B) only delays the first
    step (by 1.5 s for the 135M model on one CPU process, where it goes nowhere). With `compare` (more
    than one process), each process's checksum of its frozen weights is compared instead (ReplicasDiffer:
    say, two machines holding different revisions of a hub model)."""
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [n for n, _ in frozen])
    if not compare:
        return
    sums = gather(sum(i * _checksum(p) for i, (_, p) in enumerate(frozen, 1)))
    if bad := [i for i, s in enumerate(sums) if s != sums[0]]:
        raise ReplicasDiffer(f"rank {bad[0]} loaded other frozen weights than rank 0 (checksum {sums[bad[0]]} against "
                             f"{sums[0]}): give every machine the same model.source and model.revision")


def _checksum(t: torch.Tensor) -> int:
    """The sum of a tensor's bit patterns as integers: exact, so the same in any summation order."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return int(t.detach().contiguous().view(ints).sum(dtype=torch.int64))


def _state_on_gathered_weights(model, layers: list) -> None:
    """Give each 4-bit layer's gathered weight its quantization state, once: FSDP2 gathers a weight
    into the same plain tensor before every forward, so bitsandbytes finds the state on it and never
    rebuilds the weight as its own parameter class inside the forward (which compiled layers cannot
    trace: each 4-bit matmul would break the layer's graph). One all-gather of each unit, here."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for unit in [m for m in model.modules() if isinstance(m, FSDPModule)]:
        unit.unshard()
        for layer in layers:
            if not isinstance(layer.weight, DTensor) and getattr(layer.weight, "quant_state", None) is None:
                layer.weight.quant_state = layer.quant_state
        unit.reshard()


def unsharded(model, world: int) -> str | None:
    """What is wrong when this process holds more of `model`'s frozen weights than its share under a
    full shard over `world` processes (each weight split along its first dimension), else None."""
    from torch.distributed.tensor import DTensor

    held = share = whole = 0
    left = []
    for name, p in model.named_parameters():
        if p.requires_grad or p.dim() == 0:
            continue
        row = p.element_size() * (p.numel() // p.shape[0])
        whole += row * p.shape[0]
        share += row * -(-p.shape[0] // world)
        held += p.to_local().numel() * p.element_size() if isinstance(p, DTensor) else row * p.shape[0]
        if not isinstance(p, DTensor):
            left.append(f"{name.rsplit('model.', 1)[-1]} ({str(p.dtype).removeprefix('torch.')})")
    if held <= share:
        return None
    size = lambda n: f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"  # noqa: E731
    return (f"train.strategy=fsdp: after sharding, this process holds {size(held)} of the frozen base's {size(whole)}, "
            f"more than its 1/{world} share ({size(share)}): {len(left)} weights were left whole on every process, e.g. "
            f"{left[0] if left else '?'} (FSDP2 shards floating-point tensors only); stopping before a run that needs "
            "the whole base on every GPU")


def sharded(model) -> bool:
    """True for a model that FSDP2 shards (its parameters are DTensors, each process holds a part)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: a DTensor gathered whole (a collective), anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def gathered_state_dict(model, trainable_only: bool) -> dict[str, torch.Tensor]:
    """`model`'s state dict with whole tensors on the main process, for a save that loads without
    ddptune. Sharded (FSDP2): each tensor is all-gathered to rank 0's CPU (a collective; the other
    processes get {}); `trainable_only` leaves out the frozen base. Otherwise the state as it is."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return model.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)


class Stalled(RuntimeError):
    """A collective failed: another process hung past the timeout or died. The run stops."""


def set_timeout(minutes: float) -> None:
    """How long any collective of the default process group may wait for the other processes
    before failing (no-op without a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.distributed_c10d._set_pg_timeout(timedelta(minutes=minutes))


def collective_failed(e: BaseException) -> bool:
    """True for the errors a collective raises when a peer hung past the timeout or went away
    (gloo raises plain RuntimeErrors; NCCL DistBackendError, when its watchdog lets it)."""
    if isinstance(e, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(e)
    return any(s in text for s in ("Timed out waiting", "Connection closed by peer", "Connection reset by peer",
                                   "Application timeout caused pair closure",  # gloo, a peer silent past the timeout
                                   "NCCL communicator was aborted", "Watchdog caught collective operation timeout"))


def first_line(e: BaseException) -> str:
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return line.split("] ", 1)[-1][:200]  # without gloo's source location


def collective_error(e: BaseException) -> str:
    """A failed collective's error in a few words: its first sentence ("Read error [127.0.0.1]:5050:
    Connection reset by peer"), without gloo's advice after it; the whole text goes to launch.raw_log."""
    return first_line(e).split(". ", 1)[0].rstrip(".")


stop_heard = 0  # the stop signal (SIGINT, SIGTERM) this process caught while stops are heard; 0: none yet


def _hear(signum, _frame) -> None:
    """The first stop is heard, and said at once by the process that talks to the user where no launcher
    of ddptune's says it for it; a second ends the process as a stop outside the loop does (launch.Stopped)."""
    global stop_heard
    if stop_heard:
        launch.stop_now(signum)
    stop_heard = signum
    if is_main_process() and not validated_by_parent():
        # below the progress bar's line; not print: this may interrupt a write to stderr
        os.write(2, ("\n" + launch.heard_line(signum) + "\n").encode())


def _heard_from_now(fresh: bool) -> dict:
    """`_hear` handles SIGINT and SIGTERM (in the main thread; elsewhere nothing changes); the handlers it replaced."""
    global stop_heard
    if fresh:
        stop_heard = 0
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, _hear) for s in (signal.SIGINT, signal.SIGTERM)}


@contextlib.contextmanager
def stops_heard():
    """A stop signal within this block (the end of a run: its final save and evaluation) is heard and the
    block goes on; a second, or one after a stop heard in the loop just before (ControlChannel), ends the process."""
    old = _heard_from_now(fresh=False)
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


class ControlChannel:
    """What every process must agree on between steps: whether SIGINT or SIGTERM reached any of
    them (from `ControlChannel()` to `close()` these signals are heard, not fatal: a second one
    is), whether a checkpoint is due, and each process's busy time in its newest recorded step
    (step less waiting for the others: it names a straggler). One small all-reduce on the host per step, over gloo (a
    gloo group beside NCCL on GPUs), so the device is never waited for; it travels while the next
    step runs and is read after it, so the processes' hosts are never held in step with each other
    (every process acts on the same answer after the same step, one step after it was asked)."""

    def __init__(self, timeout_minutes: float):
        self.old = _heard_from_now(fresh=True)
        self.group = None
        self.pending = None  # the previous step's question, on its way
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if self.world > 1 and torch.distributed.get_backend() != "gloo":
            self.group = torch.distributed.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes))

    def agree(self, due: bool, seconds: float = 0.0) -> tuple[int, bool, list[float]]:
        """(a signal number if any process caught one, else 0; whether any process finds a save due;
        every process's `seconds`, by rank), all from the previous call ((0, False, []) at the first)."""
        rank = torch.distributed.get_rank() if self.world > 1 else 0
        flags = torch.zeros(2 + self.world, dtype=torch.int64)
        flags[0], flags[1], flags[2 + rank] = stop_heard, int(due), round(seconds * 1e6)
        work = None
        if self.world > 1:
            work = torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self.group, async_op=True)
        previous, self.pending = self.pending, (flags, work)
        if previous is None:
            return 0, False, []
        answer, work = previous
        if work is not None:
            work.wait()
        return int(answer[0]), bool(answer[1]), [t / 1e6 for t in answer[2:].tolist()]

    def close(self) -> None:
        for s, handler in self.old.items():
            signal.signal(s, handler)


def on_main(accelerator: Accelerator, fn):
    """Run `fn()` on the main process only; every process returns its result or raises the same
    exception type with the same message (others wait at the broadcast meanwhile)."""
    result, error = attempt(fn) if accelerator.is_main_process else (None, None)
    if accelerator.num_processes > 1:
        box = [result, error]
        broadcast_object_list(box, from_process=0)
        result, error = box
    if error is not None:
        raise error
    return result


def on_node(accelerator: Accelerator, fn):
    """Run `fn()` on the first process of each machine only (the others of that machine wait); every
    process returns its machine's result, or every process raises the first exception any raised. For
    what each machine must make on its own disk (a cache that is not shared), once a machine."""
    result, error = attempt(fn) if accelerator.is_local_main_process else (None, None)
    answers = gather((result, error)) if accelerator.num_processes > 1 else [(result, error)]
    error = next((e for _, e in answers if e is not None), None)
    if error is not None:
        raise error
    return answers[accelerator.process_index - accelerator.local_process_index][0]  # this machine's first process


def attempt(fn) -> tuple:
    """(fn(), None), or (None, the exception it raised): for a result every process is then told."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - the caller re-raises it on every process
        return None, e


def gather(obj) -> list:
    """`obj` from every process, in rank order (a collective: every process must call it)."""
    return gather_object([obj])


def ddp_wrapper(model) -> torch.nn.parallel.DistributedDataParallel | None:
    return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


class StepClock:
    """This process's times for one optimizer step, on its device's clock (CUDA events on a GPU,
    so nothing waits; perf_counter on CPU, where everything is synchronous anyway).

    Marks: start (before the first forward), grads_ready (every gradient computed: DDP's last
    bucket is ready to all-reduce), synced (the backward call returned: the all-reduce is done),
    end (after the optimizer). From them:
      compute   = grads_ready - start    forwards and backwards, this process's own work
      wait      = synced - grads_ready   the gradient all-reduce, including waiting for slower processes
      optimizer = end - synced           clipping, the update, zeroing
      step      = end - previous end     (the first step, and the first after `pause()`: end - start)
      host      = the host's own time from start to end (perf_counter): issuing the step's work. Well
                  under `step`, the host kept ahead; near it, either the device waited for the host or
                  the host for room in a full launch queue (a profile tells which: that wait is spent
                  inside launch calls)
    `read()` is called a step later, when the events are long done. `buckets`: how many gradient
    buckets DDP handed over in the step begun last.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: dict = {}
        self.prev_end = None
        self.buckets = 0

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self) -> None:
        self.marks = {"start": self._now()}
        self.buckets = 0
        self.host_start = time.perf_counter()

    def mark(self, name: str) -> None:
        self.marks[name] = self._now()

    def pause(self) -> None:
        """Work between two steps that is not training (validation, a checkpoint save): the next
        step is timed from its own start, not from the end of the last."""
        self.prev_end = None

    def finish(self) -> dict:
        """Mark the end of the step and hand over its marks (to `read` later)."""
        self.mark("end")
        self.marks["host_s"] = time.perf_counter() - self.host_start
        if "grads_ready" not in self.marks:  # no DDP wrapper: the gradients were ready when backward returned
            self.marks["grads_ready"] = self.marks["synced"]
        marks, marks["prev_end"] = self.marks, self.prev_end
        self.prev_end = self.marks["end"]
        return marks

    def read(self, marks: dict) -> dict[str, float]:
        """Seconds of each part of the step whose marks these are (waits for the step to finish)."""
        if self.cuda:
            marks["end"].synchronize()
            span = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731
        else:
            span = lambda a, b: b - a  # noqa: E731
        return {"compute_s": span(marks["start"], marks["grads_ready"]),
                "wait_s": span(marks["grads_ready"], marks["synced"]),
                "optimizer_s": span(marks["synced"], marks["end"]),
                "step_s": span(marks["prev_end"] or marks["start"], marks["end"]), "host_s": marks["host_s"]}


def time_gradient_sync(model, clock: StepClock) -> None:
    """Mark `grads_ready` each time DDP hands a gradient bucket to the all-reduce (the last bucket
    is ready when this process's backward has computed everything), then all-reduce it as DDP
    does by default (sum / world size). With one process there is nothing to reduce: the bucket
    is returned as it is. A no-op for a model that DDP does not wrap. While a CUDA graph records the
    step there is no mark: the graph's replay is timed as a whole."""
    ddp = ddp_wrapper(model)
    if ddp is None:
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    single = torch.distributed.get_world_size() == 1

    def hook(_state, bucket):
        if not (clock.cuda and torch.cuda.is_current_stream_capturing()):  # a timing event cannot be recorded
            clock.mark("grads_ready")
        clock.buckets += 1
        if single:
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, hook)
