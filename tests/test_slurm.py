"""examples/slurm/train.sbatch on a real one-node SLURM cluster on this host: SIGTERM the running
job, and it saves, requeues itself, resumes with --resume auto and ends with exactly the adapter of
an unbroken run.

The cluster is this test's own (munged, slurmctld and slurmd on free ports, everything under a
temporary folder, stopped at the end). Skipped unless SLURM is installed (Debian: apt-get install
slurm-wlm) and the test runs as root (slurmd starts job steps as their user). Marked `slurm`:
`pytest -m slurm` runs it alone. On a 2-core machine the module takes 1.5-3 minutes (two starts'
imports and 60 tiny steps for the first test, a start and a cancel for the second), so CI does not
install SLURM for it.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, UNBROKEN_ARGS, metrics

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(not all(shutil.which(d) for d in DAEMONS) or os.geteuid() != 0,
                       reason="needs SLURM (apt-get install slurm-wlm) and root"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, ready, timeout: float = 120.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := ready():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node SLURM cluster on this host; yields the environment its commands need."""
    root = tmp_path_factory.mktemp("slurm")
    host, pids = socket.gethostname(), {}
    key = root / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    sock = root / "munge.sock"
    subprocess.run(["munged", "--force", f"--socket={sock}", f"--key-file={key}", f"--log-file={root / 'munged.log'}",
                    f"--pid-file={root / 'munged.pid'}", f"--seed-file={root / 'munged.seed'}"], check=True)
    for d in ("state", "spool"):
        (root / d).mkdir()
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=ddptune-test", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", f"AuthInfo=socket={sock}", "CredType=cred/munge",
        f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}", f"SlurmdLogFile={root / 'slurmd.log'}",
        "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill", "MpiDefault=none", "ReturnToService=2", "JobRequeue=1", "MinJobAge=600",
        f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
        "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
    env = dict(os.environ, SLURM_CONF=str(conf))
    try:
        subprocess.run(["slurmctld", "-c"], env=env, check=True)
        subprocess.run(["slurmd", "-c"], env=env, check=True)
        _wait("the node to be idle", lambda: subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                                            text=True).stdout.strip() == "idle", timeout=60)
        yield env
    finally:
        for name in ("slurmd", "slurmctld", "munged"):  # each by the pid it wrote: nothing else is touched
            pid_file = root / f"{name}.pid"
            if pid_file.exists() and (text := pid_file.read_text().strip()).isdigit():
                pids[name] = int(text)
                try:
                    os.kill(pids[name], signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for pid in pids.values():
            _wait(f"pid {pid} to end", lambda: not _alive(pid), timeout=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _job(env: dict, job: str) -> dict:
    text = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


def _submit(cluster: dict, tmp_path: Path) -> tuple[str, dict, Path, Path]:
    """The example script submitted for the tiny run the unbroken adapter came from (2 processes);
    returns once it has logged 5 steps: (job id, environment, output_dir, the job's log)."""
    out, log = tmp_path / "run", tmp_path / "job.log"
    env = dict(cluster, PYTHONPATH=str(ROOT / "src"), DDPTUNE=f"{sys.executable} -m ddptune", NPROC="2",
               LEAD_SECONDS="60", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    job = subprocess.run(["sbatch", "--parsable", f"--output={log}", f"--chdir={tmp_path}", "--time=15",
                          str(ROOT / "examples" / "slurm" / "train.sbatch"), str(ROOT / "configs" / "tiny.yaml"),
                          f"output_dir={out}", *UNBROKEN_ARGS], env=env, capture_output=True, text=True, check=True).stdout.strip()
    _wait("5 steps", lambda: (out / "metrics.jsonl").exists() and len(metrics(out)) >= 5, timeout=240, every=0.05)
    return job, env, out, log


def test_a_job_stopped_by_sigterm_requeues_itself_and_finishes_exactly(cluster, tmp_path, unbroken):
    started = time.monotonic()
    job, env, out, log = _submit(cluster, tmp_path)
    subprocess.run(["scancel", "--signal=TERM", job], env=env, check=True)  # what --signal=TERM@N sends
    # the script requeued the job; SLURM holds a requeued job back for two minutes, which a test need not wait
    _wait("the requeue", lambda: _job(env, job).get("Restarts") == "1" and _job(env, job)["JobState"] == "PENDING")
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True)
    state = _wait("the job's end", lambda: (s := _job(env, job)["JobState"]) in ("COMPLETED", "FAILED", "CANCELLED") and s,
                  timeout=300)
    text = log.read_text(errors="replace")
    assert state == "COMPLETED", text[-4000:]
    stopped = [l for l in text.splitlines() if l.startswith("ddptune: stopped by SIGTERM after step ")]
    assert len(stopped) == 1, text[-4000:]
    step = int(stopped[0].split("after step ")[1].split()[0])
    assert 5 <= step < 60
    for line in (f"ddptune job {job}: start 1 ", f"ddptune job {job}: stopped (exit 143): requeued",
                 f"ddptune job {job}: start 2 ", f"resuming after step {step}", f"ddptune job {job}: the run is complete"):
        assert line in text, (line, text[-4000:])
    assert [r["step"] for r in metrics(out) if "loss" in r] == list(range(1, 61))
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert adapter.keys() == unbroken.keys() and all(torch.equal(adapter[k], unbroken[k]) for k in adapter)
    print(f"slurm: submit, stop, requeue and finish took {time.monotonic() - started:.0f} s")


def test_a_cancelled_job_saves_and_stays_cancelled(cluster, tmp_path):
    """scancel JOBID signals the script too: the training saves and stops, and nothing requeues it."""
    job, env, out, log = _submit(cluster, tmp_path)
    subprocess.run(["scancel", job], env=env, check=True)
    _wait("the job's end", lambda: _job(env, job)["JobState"] == "CANCELLED" and "not requeued here" in log.read_text(errors="replace"),
          timeout=120)
    text = log.read_text(errors="replace")
    assert "ddptune: stopped by SIGTERM after step " in text and f"ddptune job {job}: cancelled or preempted (exit 143)" in text
    assert _job(env, job)["Restarts"] == "0" and any((out / "checkpoints").glob("step-*/state.json"))
