"""The training command end to end: real processes through torchrun and accelerate, gloo on CPU."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import ROOT, check, ddptune, metrics
from ddptune import config, model as model_lib, train

TINY = str(ROOT / "configs" / "tiny.yaml")


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in metrics(run_dir) if "loss" in r]


def test_cli_two_processes_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = check(ddptune("train", TINY, f"output_dir={out}", "--nproc", "2"))

    for name in ("config.yaml", "metrics.jsonl", "summary.json", "adapter/adapter_model.safetensors",
                 "adapter/adapter_config.json", "adapter/tokenizer.json", "adapter/ddptune.yaml"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 8
    assert len(set(summary["replica_fingerprints"])) == 1  # both replicas hold the same weights
    # only rank 0 prints: one start banner, one final line
    assert proc.stdout.count("ddptune: done") == 1 and proc.stdout.count("2 process(es)") == 1
    assert "4 per device x 2 processes x 1 accumulation = 8" in proc.stdout

    rows = metrics(out)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for key in ("lr", "tokens", "step_time_s", "tokens_per_s_per_gpu", "grad_norm"):
        assert all(r[key] >= 0 for r in steps), key
    first, last = sum(losses(out)[:3]) / 3, sum(losses(out)[-3:]) / 3
    assert last < first - 0.3, (first, last)
    assert any("val_loss" in r for r in rows)

    # the adapter loads back with peft onto the same base and changes its output
    from peft import PeftModel

    base = model_lib.build_preset("tiny", 0, torch.float32, torch.device("cpu"))
    ids = torch.tensor([[256, 72, 105, 33, 10, 65]])
    before = base(ids).logits
    tuned = PeftModel.from_pretrained(base, out / "adapter")
    saved = load_file(out / "adapter" / "adapter_model.safetensors")
    loaded = {n: p for n, p in tuned.named_parameters() if "lora_" in n}
    assert len(loaded) == len(saved) > 0
    for name, tensor in saved.items():
        match = [p for n, p in loaded.items() if n.replace(".default", "") == name]
        assert len(match) == 1 and torch.equal(match[0], tensor), name
    assert not torch.allclose(tuned(ids).logits, before)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_two_processes_take_the_same_steps_as_one_with_accumulation(tmp_path, packing):
    common = ["train.max_steps=4", "train.micro_batch_size=2", "train.lr=1e-2", "lora.dropout=0.0", "train.val_every=2",
              f"train.packing={str(packing).lower()}"]
    one, two = tmp_path / "one", tmp_path / "two"
    check(ddptune("train", TINY, f"output_dir={one}", "train.grad_accum=2", *common))
    check(ddptune("train", TINY, f"output_dir={two}", "train.grad_accum=1", *common, "--nproc", "2"))

    rows = [r for r in metrics(one) if "loss" in r]
    # samples of unequal lengths: padded batches compute padding, packed rows none
    assert all((r["padded_tokens"] == r["tokens"]) if packing else (r["padded_tokens"] > r["tokens"]) for r in rows)
    assert len(losses(one)) == 4
    for a, b in zip(losses(one), losses(two), strict=True):
        assert abs(a - b) < 1e-5, (losses(one), losses(two))
    wa = load_file(one / "adapter" / "adapter_model.safetensors")
    wb = load_file(two / "adapter" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-5, rtol=0), k
    assert any(wa[k].abs().sum() > 0 for k in wa if "lora_B" in k)
    # validation loss: token-weighted sums reduced over processes, then divided
    val = lambda run: [r["val_loss"] for r in metrics(run) if "val_loss" in r]
    assert len(val(one)) == 2 and val(one) == pytest.approx(val(two), abs=1e-5)
    fps = json.loads((two / "summary.json").read_text())["replica_fingerprints"]
    assert len(fps) == 2 and fps[0] == fps[1]


def test_resume_ends_with_the_weights_of_an_unbroken_run(tmp_path):
    # dropout on: the resumed run must also restore every process's RNG to match
    args = ["train.max_steps=6", "train.save_every=3", "train.keep_checkpoints=5", "lora.dropout=0.1", "data.val=null"]
    full = tmp_path / "full"
    check(ddptune("train", TINY, f"output_dir={full}", *args, "--nproc", "2"))
    assert [p.name for p in sorted((full / "checkpoints").iterdir())] == ["step-000003", "step-000006"]

    # the folder of a run that died during step 6, after its step-3 checkpoint and 5 metric lines
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step-000003", part / "checkpoints" / "step-000003")
    saved = yaml.safe_load((full / "config.yaml").read_text()) | {"output_dir": str(part)}
    (part / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    (part / "metrics.jsonl").write_text("".join(l + "\n" for l in (full / "metrics.jsonl").read_text().splitlines()[:5]))
    # a half-written checkpoint left by the crash is ignored
    (part / "checkpoints" / ".step-000006.tmp-x").mkdir()

    proc = check(ddptune("train", TINY, f"output_dir={part}", *args, "--resume", "--nproc", "2"))
    assert "resuming after step 3" in proc.stdout
    assert [r["step"] for r in metrics(part) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert losses(part) == pytest.approx(losses(full), abs=1e-6)
    wa = load_file(full / "adapter" / "adapter_model.safetensors")
    wb = load_file(part / "adapter" / "adapter_model.safetensors")
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_resume_refuses_a_changed_config(tmp_path):
    out = tmp_path / "run"
    check(ddptune("train", TINY, f"output_dir={out}", "train.max_steps=2", "train.save_every=2", "data.val=null"))
    proc = ddptune("train", TINY, f"output_dir={out}", "train.max_steps=2", "train.save_every=2", "data.val=null",
                   "train.lr=0.5", "--resume")
    assert proc.returncode == 2
    assert "train.lr: is 0.5 but the run being resumed used 0.01" in proc.stderr


def test_lora_weights_change_and_base_weights_stay(tmp_path):
    cfg = config.load(TINY, [f"output_dir={tmp_path / 'run'}", "train.max_steps=5", "data.val=null"])
    _, tuned = train.run(cfg)
    base = model_lib.build_preset("tiny", cfg.train.seed, torch.float32, torch.device("cpu")).state_dict()
    n_lora = n_base = 0
    for name, p in tuned.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: non-zero means it trained
            assert p.requires_grad and p.abs().sum() > 0, name
            n_lora += 1
        elif "lora_" not in name:
            key = name.removeprefix("base_model.model.").replace(".base_layer", "")
            assert not p.requires_grad and torch.equal(p.detach(), base[key]), name
            n_base += 1
    assert n_lora == 2 * 7 and n_base == len(base)  # 7 linear projections per layer, 2 layers


def test_accelerate_launch_with_the_shipped_config(tmp_path):
    """`accelerate launch --config_file configs/accelerate/2gpu.yaml -m ddptune train ...` (CPU: gloo)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs/accelerate/2gpu.yaml"),
           "-m", "ddptune", "train", TINY, f"output_dir={out}", "train.max_steps=3", "data.val=null"]
    check(subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(set(summary["replica_fingerprints"])) == 1


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_gradient_checkpointing_works_under_ddp(method, tmp_path):
    """Non-reentrant checkpointing under DDP (reentrant fails with "marked ready twice"); the
    recomputation replays dropout exactly, so the losses equal a run without it. QLoRA runs on
    bitsandbytes' CPU 4-bit kernels here."""
    args = [f"train.method={method}", "train.max_steps=3", "lora.dropout=0.1", "data.val=null", "--nproc", "2"]
    on, off = tmp_path / "on", tmp_path / "off"
    check(ddptune("train", TINY, f"output_dir={on}", "train.gradient_checkpointing=true", *args))
    check(ddptune("train", TINY, f"output_dir={off}", "train.gradient_checkpointing=false", *args))
    summary = json.loads((on / "summary.json").read_text())
    assert summary["gradient_checkpointing"] is True and summary["method"] == method
    assert len(set(summary["replica_fingerprints"])) == 1
    assert losses(on) == pytest.approx(losses(off), abs=1e-5)


def test_packing_gives_the_padded_losses_without_padding(tmp_path):
    args = ["train.max_steps=4", "train.micro_batch_size=2", "train.grad_accum=2", "lora.dropout=0.0", "data.val=null", "--nproc", "2"]
    padded, packed = tmp_path / "padded", tmp_path / "packed"
    check(ddptune("train", TINY, f"output_dir={padded}", "train.packing=false", *args))
    check(ddptune("train", TINY, f"output_dir={packed}", "train.packing=true", *args))
    assert losses(packed) == pytest.approx(losses(padded), abs=1e-5)
    a = [r for r in metrics(padded) if "loss" in r]
    b = [r for r in metrics(packed) if "loss" in r]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]  # the same samples
    assert all(rb["forwards"] == 1 and ra["forwards"] == 2 for ra, rb in zip(a, b))
    # each process's 4 samples fit one 8192-token row: nothing but real tokens is computed
    assert all(r["padded_tokens"] == r["tokens"] for r in b)
    assert all(r["padded_tokens"] > r["tokens"] for r in a)


def test_compiled_layers_give_the_eager_losses_and_still_evaluate(tmp_path):
    """train.compile (regional torch.compile, dynamic lengths, varlen attention inside the graph)
    changes speed, not math; validation and generation afterwards run the layers eagerly."""
    args = ["train.max_steps=3", "train.packing=true", "eval.enabled=true", "eval.zero_shot=false",
            "eval.max_samples=4", "eval.max_new_tokens=8", "--nproc", "1"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    check(ddptune("train", TINY, f"output_dir={eager}", "train.compile=false", *args))
    check(ddptune("train", TINY, f"output_dir={compiled}", "train.compile=true", *args))
    assert json.loads((compiled / "summary.json").read_text())["compiled"] is True
    assert losses(compiled) == pytest.approx(losses(eager), abs=1e-5)
    val = [[r["val_loss"] for r in metrics(d) if "val_loss" in r] for d in (eager, compiled)]
    assert val[1] == pytest.approx(val[0], abs=1e-5) and len(val[0]) == 1
    assert (compiled / "eval" / "predictions.jsonl").is_file()
