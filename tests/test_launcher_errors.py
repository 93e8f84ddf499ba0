"""Bad input found inside the workers of an outside launcher (torchrun here; `accelerate launch`
runs the same agent): one line from ddptune, exit 2 from each worker, no traceback of ddptune's.
The launcher's own report follows (its traceback, a table of failed ranks); it cannot be changed,
but its root cause repeats the line, so the reason is also at the end of the output."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from conftest import ROOT, adapter_folder, field, words


def test_bad_input_found_inside_torchrun_workers_is_one_line_also_at_the_end(tmp_path):
    # A run folder whose checkpoint was written by 1 process with 4 samples a step: resuming it
    # with 2 processes at tiny.yaml's batch is refused. Without --nproc only the workers see the
    # folder (rank 0 validates in train.setup), before any data or model is loaded.
    out = tmp_path / "run"
    (out / "checkpoints" / "step-000002").mkdir(parents=True)
    (out / "checkpoints" / "step-000002" / "state.json").write_text(json.dumps({"step": 2, "world_size": 1, "global_batch": 4}))
    (tmp_path / "tmp").mkdir()  # torchrun keeps its workers' error files in a folder it never removes
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path / "tmp"),
               PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "ddptune", "train", str(ROOT / "configs" / "tiny.yaml"), f"output_dir={out}", "--resume"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    ours = [l for l in re.split(r"[\r\n]", proc.stderr) if l.startswith("ddptune:")]
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert len(ours) == 1 and ours[0].startswith("ddptune: invalid config: ") and field(ours[0]) == "--resume", proc.stderr[-3000:]
    # the checkpoint; its 1 process and 4 samples a step, the 2 processes now; the key to set, or --nproc 1
    assert {str(out / "checkpoints" / "step-000002"), "train.effective_batch_size=4"} <= words(ours[0]), ours[0]
    assert [w for w in re.split(r"[\s,;()]+", ours[0]) if w.isdigit()] == ["1", "4", "2", "1"], ours[0]
    assert not re.search(r'File ".*[/\\]ddptune[/\\]', proc.stderr), proc.stderr  # torchrun's frames only
    assert "exitcode  : 2" in proc.stderr  # each worker's own exit code, in torchrun's table
    tail = proc.stderr.strip().splitlines()[-3:]  # the root cause closes torchrun's report
    assert any(l.strip() == f"traceback : {ours[0]}" for l in tail), proc.stderr[-3000:]


def test_ddptunes_launcher_prints_once_each_line_rank_0_did_not(tmp_path, monkeypatch):
    """--nproc: rank 0 prints its own line; ddptune's launcher prints, from the workers' error files,
    each other line once (one only a non-zero rank met, or all of them on a node without rank 0)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from ddptune import dist, launch

    def failure(rank: int, line: str | None, exitcode: int = 2) -> ProcessFailure:
        path = tmp_path / f"error-{len(list(tmp_path.iterdir()))}.json"  # a new file each time (none when no line)
        if line:
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
            launch.tell_launcher(line)
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))

    bad, own = "ddptune: invalid config: x: bad", "ddptune: invalid config: y: only rank 2 saw this"
    assert launch.untold({0: failure(0, bad), 1: failure(1, bad), 2: failure(2, own), 3: failure(3, own)}) == [own]
    assert launch.untold({0: failure(0, None, -15), 1: failure(1, bad)}) == [bad]  # rank 0 stopped before it spoke
    assert launch.untold({2: failure(2, bad), 3: failure(3, bad)}) == [bad]  # node 1
    assert launch.untold({0: failure(0, bad), 1: failure(1, None, -15)}) == []
    # a worker killed by a signal says nothing itself: the launcher names it (the first to fail only:
    # torchrun's own SIGTERMs to the others follow from it); what a training run saved: test_stops
    monkeypatch.delenv(launch.RUN, raising=False)
    assert launch.killed(1, failure(1, None, -9)) == [
        "ddptune: rank 1 was killed by SIGKILL and the job stopped (the kernel's out-of-memory killer sends SIGKILL: "
        "see dmesg)"]
    assert launch.killed(0, failure(0, bad)) == [] and launch.killed(0, failure(0, None, 130)) == []


def test_ddptunes_launcher_names_a_worker_that_died_and_logs_the_collectives_that_failed_after_it(tmp_path, monkeypatch):
    """--nproc: a worker that dies (killed, or exiting without a word) makes the others' collectives fail
    within the same seconds; the console gets one line, naming it, and their lines go to the run's log.
    Where no worker died first (one hung: torchrun kills it 30 s after the others failed), the lines of
    the failed collectives are the console's, one per process that saw one."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from ddptune import launch

    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv(launch.RUN, str(run))

    def failure(rank: int, exitcode: int, at: int, stalled: bool = False) -> ProcessFailure:
        path = tmp_path / f"error-{rank}-{exitcode}-{at}.json"
        if stalled:  # as a worker whose collective failed leaves it under ddptune's launcher
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
            monkeypatch.setenv(launch.VALIDATED, "1")
            launch.say_stalled(f"ddptune: rank {rank}: step 4: Connection closed by peer: another process hung or died")
        f = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))
        f.timestamp = at  # whole seconds, from the error file or when torch's launcher noticed the exit
        return f

    def ranks(lines: list[str]) -> list[list[int]]:
        return [[int(n) for n in re.findall(r"\brank (\d+)", line)] for line in lines]

    t = 1_000_000
    for noticed in (t - 1, t, t + 1):  # the killed worker noticed before, with or after the collective failed
        failures = {0: failure(0, 1, t, stalled=True), 1: failure(1, -9, noticed), 2: failure(2, -15, noticed)}
        rank, first = launch.cause(failures)
        assert (rank, first.exitcode) == (1, -9)
        assert ranks(launch.report(failures, rank, first)) == [[1]]
    logged = (run / launch.RAW_LOG).read_text().splitlines()
    assert len(logged) == 3 and all(re.search(r"\brank 0\b", l) for l in logged)
    # exited with an error of its own (its traceback is above), no line left: named too
    failures = {0: failure(0, 1, t, stalled=True), 1: failure(1, 3, t)}
    rank, first = launch.cause(failures)
    lines = launch.report(failures, rank, first)
    assert rank == 1 and ranks(lines) == [[1]] and "3" in words(lines[0])
    # a hang: the failed collectives are said; the hung worker, killed 30 s later, is not the cause
    failures = {0: failure(0, 1, t, stalled=True), 1: failure(1, -9, t + 30), 2: failure(2, 1, t, stalled=True)}
    rank, first = launch.cause(failures)
    assert (rank, first.exitcode) == (0, 1) and ranks(launch.report(failures, rank, first)) == [[0], [2]]
    # every worker stopped together and rank 0 said why (a stop, a non-finite loss): nothing more
    failures = {0: failure(0, 130, t), 1: failure(1, 130, t)}
    assert launch.report(failures, *launch.cause(failures)) == []


def _commands_with_stderr(commands: list[tuple[list[str], int]]) -> list[tuple[int, str]]:
    """In one launched process: each command's exit code and what it wrote to stderr, each command
    on its own rendezvous port (the same in every process)."""
    import contextlib
    import io

    from ddptune import cli

    results = []
    for argv, port in commands:
        os.environ["MASTER_PORT"] = str(port)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            results.append((cli.main(argv), err.getvalue()))
    return results


def test_a_missing_model_is_one_line_under_a_launcher_for_predict_and_eval(tmp_path):
    """Under torchrun or accelerate launch (no --nproc parent validated), rank 0 checks the model
    once and every process fails with its line (exit 2), before any of them loads anything; only
    rank 0 prints it. In-process gloo ranks with a launcher's environment stand in for torchrun."""
    import multiproc
    from ddptune import config

    run = tmp_path / "run"  # a finished run as far as predict and eval look before loading
    adapter_folder(run / "adapter")
    (run / "config.yaml").write_text(config.dump(config.load(ROOT / "configs" / "tiny.yaml", [f"output_dir={run}"])))
    (tmp_path / "in.jsonl").write_text(json.dumps({"dialogue": "A: hi\nB: hello"}) + "\n")
    missing = f"model.source={tmp_path / 'gone'}"
    commands = [(["predict", str(run), "--input", str(tmp_path / "in.jsonl"), missing], multiproc.free_port()),
                (["eval", str(run), missing], multiproc.free_port())]
    rank0, rank1 = multiproc.run(_commands_with_stderr, 2, commands, timeout=120)
    for (code0, err0), (code1, err1) in zip(rank0, rank1):
        assert code0 == code1 == 2 and err1 == "", (err0, err1)
        assert err0.startswith("ddptune: invalid config: model.source: ") and "gone" in err0 and err0.count("\n") == 1, err0
    assert not (run / "eval").exists()
