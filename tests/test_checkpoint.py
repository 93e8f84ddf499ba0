"""Checkpoints hold data only: a planted pickle never runs; a damaged newest checkpoint falls back;
a step that is not finite stops the run before anything non-finite is saved."""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import multiproc
from conftest import ROOT, metrics
from ddptune import checkpoint, config, data, model as model_lib, step, train
from ddptune.config import ConfigError

TINY = str(ROOT / "configs" / "tiny.yaml")


class Payload:
    """Unpickling this creates the file `path`: proof that a loader ran code from disk."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_planted_pickles_never_run(tmp_path):
    out = tmp_path / "run"
    train.run(config.load(TINY, [f"output_dir={out}", "train.max_steps=2", "train.save_every=2", "data.val=null"]))
    ckpt = out / "checkpoints" / "step-000002"
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == ["optimizer.json", "optimizer.safetensors", "rng.json", "rng.safetensors", "scheduler.json",
                     "state.json", "weights.safetensors"]
    marker = tmp_path / "pwned"
    m = model_lib.add_adapters(model_lib.build_preset("tiny", 0, torch.float32, torch.device("cpu"), "varlen"), "lora",
                               config.LoraConfig(r=8, alpha=16, dropout=0.0), False)
    opt, sched = step.build_optimizer(config.load(TINY).train, m, 2)
    for name in files:  # each file in turn replaced by a pickle that would create `marker`
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(ckpt, bad)
        (bad / name).write_bytes(pickle.dumps(Payload(marker)))
        with pytest.raises(ValueError, match="cannot be read"):
            checkpoint.load(bad, m, opt, sched, 0)
        assert not marker.exists(), name
    # the tokenized-data cache: a planted pickle is not read, the cache is made again
    (cache,) = (out / "cache").iterdir()
    assert cache.suffix == ".json"
    cache.write_bytes(pickle.dumps(Payload(marker)))
    cfg = config.load(TINY)
    rows = data.load_split(cfg.data.train, cfg.data.train_rows, cfg.data)
    tok = model_lib.load_tokenizer(cfg.model)
    again = data.tokenize_cached(rows, tok, cfg.data, out / "cache", data.fingerprint(tok))
    assert not marker.exists() and len(again) == len(rows) and json.loads(cache.read_text()) == again


def test_resume_falls_back_past_a_damaged_checkpoint(tmp_path):
    args = ["train.max_steps=4", "train.save_every=2", "train.keep_checkpoints=3", "lora.dropout=0.0", "data.val=null"]
    full = tmp_path / "full"
    train.run(config.load(TINY, [f"output_dir={full}", *args]))
    part = tmp_path / "part"
    shutil.copytree(full, part, ignore=shutil.ignore_patterns("adapter", "summary.json", "ranks.jsonl"))
    (part / "config.yaml").write_text((full / "config.yaml").read_text().replace(str(full), str(part)))
    shutil.rmtree(part / "checkpoints" / "step-000004")
    newest = part / "checkpoints" / "step-000003"  # a torn copy of step 2 posing as the newest
    shutil.copytree(part / "checkpoints" / "step-000002", newest)
    (newest / "optimizer.safetensors").write_bytes(b"\0" * 10)
    (newest / "state.json").write_text(json.dumps({"step": 3, "world_size": 1}))
    (part / "checkpoints" / ".step-000004.tmp-abc").mkdir()  # what a kill during a save leaves
    summary, _ = train.run(config.load(TINY, [f"output_dir={part}", *args]), resume=True)
    losses = lambda d: [r["loss"] for r in metrics(d) if "loss" in r]  # noqa: E731
    assert losses(part) == pytest.approx(losses(full), abs=1e-6)  # resumed after step 2, not 3
    assert not (part / "checkpoints" / ".step-000004.tmp-abc").exists()  # the next save cleared it
    a, b = load_file(full / "adapter" / "adapter_model.safetensors"), load_file(part / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    (part / "summary.json").unlink()  # as if it had died again, now with nothing readable to go back to
    for p in (part / "checkpoints").iterdir():
        shutil.rmtree(p)
    (part / "checkpoints" / "step-000002").mkdir()
    (part / "checkpoints" / "step-000002" / "state.json").write_text("{not json")
    with pytest.raises(ConfigError, match="no checkpoint in .* can be read back"):
        train.run(config.load(TINY, [f"output_dir={part}", *args]), resume=True)


def test_a_step_that_is_not_finite_stops_the_run_before_saving(tmp_path):
    out = tmp_path / "run"
    cfg = config.load(TINY, [f"output_dir={out}", "train.max_steps=8", "train.lr=1e30", "train.max_grad_norm=0",
                             "train.warmup_steps=0", "train.lr_schedule=constant", "data.val=null"])
    with pytest.raises(train.NonFinite, match=r"step \d+: loss .* stopping before anything non-finite is saved"):
        train.run(cfg)
    assert not (out / "adapter").exists() and not (out / "summary.json").exists()


def test_a_finished_run_is_not_resumed_over(tmp_path):
    from ddptune import checks

    out = tmp_path / "run"
    args = [f"output_dir={out}", "train.max_steps=2", "train.save_every=2", "data.val=null"]
    train.run(config.load(TINY, args))
    before = (out / "summary.json").read_text()
    with pytest.raises(ConfigError, match="is complete .* nothing to resume"):
        checks.validate(config.load(TINY, args), 1, resume=True)
    assert (out / "summary.json").read_text() == before


def _save_forever(folder: str) -> None:
    """Write checkpoints of a 128 MB weight, step after step, until killed."""
    w = torch.nn.Parameter(torch.randn(32 * 1024 * 1024))
    opt = torch.optim.SGD([w], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for step in range(1, 10_000):
        checkpoint.save(Path(folder), step, {"w": w.detach()}, opt, sched, [checkpoint.rng_state()], {"world_size": 1})


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_whole(tmp_path):
    import signal
    import time

    folder = tmp_path / "checkpoints"
    proc = multiproc.context().Process(target=_save_forever, args=(str(folder),))
    proc.start()
    deadline = time.time() + 120
    # wait until one checkpoint is complete and the next is being written, then kill -9
    while time.time() < deadline and not (checkpoint.list_checkpoints(folder) and list(folder.glob(".step-*.tmp-*"))):
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    complete = checkpoint.list_checkpoints(folder)
    assert complete and list(folder.glob(".step-*.tmp-*")), "the kill did not land during a save"
    w = torch.nn.Parameter(torch.zeros(32 * 1024 * 1024))
    opt = torch.optim.SGD([w], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model = torch.nn.Module()
    model.w = w
    state = checkpoint.load(complete[-1], model, opt, sched, 0)  # the newest complete one reads back whole
    assert state["step"] == int(complete[-1].name.split("-")[1]) and w.abs().sum() > 0
    (folder / f".{complete[-1].name}.old").mkdir()  # what a kill between commit's two renames leaves
    checkpoint.prune(folder, keep=1)
    assert not list(folder.glob(".step-*.tmp-*")) and checkpoint.list_checkpoints(folder) == complete[-1:]
    assert not list(folder.glob(".step-*.old"))


def test_learning_rates_kept_on_the_gpu_resume_in_either_kind_of_optimizer(tmp_path):
    """A step recorded as CUDA graphs keeps the learning rate as a tensor that its schedule fills in
    place (the recorded update reads it there). A checkpoint stores it as a number: a run with a
    tensor rate resumes one written with a number and the reverse, the tensor stays the object the
    optimizer had (a recording still points at it), and both go on as the unbroken run does."""
    import transformers

    def run_parts(tensor_lr: bool):
        w = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.AdamW([w], lr=torch.tensor(1e-3) if tensor_lr else 1e-3)
        return w, opt, transformers.get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=10)

    def step(w, opt, sched):
        w.grad = torch.arange(3.0)
        opt.step()
        sched.step()

    for saved_with_tensor in (True, False):
        w, opt, sched = run_parts(saved_with_tensor)
        for _ in range(3):
            step(w, opt, sched)
        path = checkpoint.save(tmp_path / str(saved_with_tensor), 3, {"w": w.detach()}, opt, sched, [checkpoint.rng_state()], {})
        step(w, opt, sched)  # the unbroken run's step 4
        for tensor_lr in (True, False):
            w2, opt2, sched2 = run_parts(tensor_lr)
            lr_object = opt2.param_groups[0]["lr"]
            checkpoint.load(path, torch.nn.ParameterDict({"w": w2}), opt2, sched2, 0)
            assert (opt2.param_groups[0]["lr"] is lr_object) == tensor_lr
            assert float(opt2.param_groups[0]["lr"]) == pytest.approx(8.75e-4)
            step(w2, opt2, sched2)
            assert torch.allclose(w2, w) and float(opt2.param_groups[0]["lr"]) == pytest.approx(float(opt.param_groups[0]["lr"]))
