"""dist.setup / dist.teardown in this process (gloo on CPU): a finished command leaves the process
as it found it, so a later command in it (the Python API, tests) starts afresh."""
from __future__ import annotations

import os
import warnings

import torch
from accelerate.utils import DistributedType

import multiproc
from conftest import measured_busy_cores
from ddptune import dist, launch


def test_teardown_undoes_what_a_one_process_fsdp_setup_wrote():
    """FSDP without a launcher forms a group of one as a launcher would (RANK, WORLD_SIZE, ...) and
    accelerate adds ACCELERATE_USE_FSDP: after teardown none of it is left, and a DDP setup that
    follows takes DDP's path, not FSDP's (accelerate's shared state was made anew)."""
    before = dict(os.environ)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist.setup("no", "fsdp")
        assert not [w for w in caught if "OMP_NUM_THREADS" in str(w.message)]  # accelerate's, when it sets them itself
        assert launch.in_launched_process()
        dist.teardown()
        assert dict(os.environ) == before and not launch.in_launched_process()
        accelerator = dist.setup("no", "ddp")
        assert accelerator.distributed_type == DistributedType.NO
        assert type(accelerator.prepare(torch.nn.Linear(2, 2))) is torch.nn.Linear  # FSDP2 would refuse a model alone
    finally:
        dist.teardown()
    assert dict(os.environ) == before


def test_teardown_keeps_a_launchers_own_variables(monkeypatch):
    launcher = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(multiproc.free_port()))
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    try:
        dist.setup("no", "fsdp")
        assert os.environ.get("ACCELERATE_USE_FSDP") == "true" and torch.distributed.get_world_size() == 1
    finally:
        dist.teardown()
    assert dict(os.environ) == before and launch.in_launched_process()


def test_threads_per_process_are_one_on_gpus_and_a_share_of_the_free_cores_on_cpus(monkeypatch):
    """A GPU process gets 1 OpenMP thread (spinning workers slowed 2-process GPU steps), a CPU one its
    share of the cores other work leaves free; OMP_NUM_THREADS, when set, wins either way."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(launch, "busy_cores", lambda: 0.0)
    assert launch.default_threads(2, cuda=True) == 1
    assert launch.default_threads(2, cuda=False) == max(1, cores // 2)
    assert launch.default_threads(4 * cores, cuda=False) == 1
    assert launch.default_threads(1, cuda=False) == cores
    monkeypatch.setattr(launch, "busy_cores", lambda: 0.9)  # another program on one core
    assert launch.default_threads(1, cuda=False) == max(1, cores - 1)
    monkeypatch.setattr(launch, "busy_cores", lambda: 2.0 * cores)  # more than this host's cores
    assert launch.default_threads(1, cuda=False) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch.default_threads(2, cuda=True) == launch.default_threads(2, cuda=False) == 3


def test_a_program_spinning_on_one_of_the_cores_is_seen_busy():
    """busy_cores reads the kernel's per-core counters: a real process spinning on one of this
    process's cores counts as at least most of a core (other work on the machine only adds)."""
    import subprocess
    import sys

    core = min(os.sched_getaffinity(0))
    spin = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        import time

        time.sleep(0.5)  # started and spinning
        assert measured_busy_cores(0.5) >= 0.7
    finally:
        spin.kill()
        spin.wait()


def test_an_in_process_cpu_run_takes_the_threads_the_free_cores_allow(monkeypatch):
    """dist.setup on CPU without OMP_NUM_THREADS sets torch's threads from default_threads (torch's
    own default would be every core, even those other work holds) and says why."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(launch, "busy_cores", lambda: 0.9)
    before = torch.get_num_threads()
    try:
        dist.setup("no")
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) - 1)
        assert f"{len(os.sched_getaffinity(0))} cores, 0.9 busy" in dist.threads_why
    finally:
        dist.teardown()
        torch.set_num_threads(before)


def _prepare_with_rank_1_changed(change: str):
    """Two processes build the same frozen layer and trained layer; rank 1 changes one of them before
    DDP's wrapper is built. Returns (trained weight after the wrapper, or the refusal's class name)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].requires_grad_(False)
    acc = dist.setup()
    if acc.process_index == 1:
        with torch.no_grad():
            model[0 if change == "frozen" else 1].weight.add_(1.0)
    try:
        prepared, _ = dist.prepare(acc, model, torch.optim.SGD(model[1].parameters(), lr=0.1))
    except dist.ReplicasDiffer as e:
        return type(e).__name__
    return prepared.module[1].weight.tolist(), prepared.module[0].weight.tolist()


def _wrapped_parameters():
    """One process: the names of the parameters DDP's wrapper holds, and of those it leaves alone."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].requires_grad_(False)
    prepared, _ = dist.prepare(dist.setup(), model, torch.optim.SGD(model[1].parameters(), lr=0.1))
    return sorted(n for n, _ in prepared.named_parameters() if n.removeprefix("module.") not in prepared.parameters_to_ignore), \
        sorted(prepared.parameters_to_ignore)


def test_one_process_ddp_leaves_the_frozen_weights_alone_as_several_do():
    held, left = multiproc.run(_wrapped_parameters, 1)[0]
    assert left == ["0.bias", "0.weight"]
    assert held == ["module.1.bias", "module.1.weight"]


def test_ddp_sends_what_trains_and_refuses_replicas_whose_frozen_weights_differ():
    # the trained weight is rank 0's on every process after the wrapper
    (w0, f0), (w1, f1) = multiproc.run(_prepare_with_rank_1_changed, 2, "trained")
    assert w0 == w1 and f0 == f1
    # a frozen weight that differs is not silently overwritten by rank 0's: every process stops
    assert multiproc.run(_prepare_with_rank_1_changed, 2, "frozen") == ["ReplicasDiffer", "ReplicasDiffer"]


def test_each_setup_in_a_process_takes_its_own_strategy_without_a_teardown_between(monkeypatch):
    """The Python API may run one command after another in a process without teardown: each setup gets its own
    FSDP plugin (the previous one keeps the layer classes of the previous model) and a DDP setup after an FSDP
    one takes DDP's path."""
    launcher = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(multiproc.free_port()))
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    try:
        first = dist.setup("no", "fsdp").state.fsdp_plugin
        second = dist.setup("no", "fsdp").state.fsdp_plugin
        assert first is not None and second is not None and second is not first
        assert dist.setup("no", "ddp").distributed_type != DistributedType.FSDP
    finally:
        dist.teardown()
