"""train.strategy=fsdp with train.method=qlora: FSDP2 over a 4-bit NF4 base on real gloo processes, on CPU.

The packed 4-bit codes live in bf16 containers, so fully_shard shards them like any frozen weight
and each layer keeps its quantization state. FSDP-QLoRA over 2 processes takes the steps DDP-QLoRA
over 2 and one process take; its checkpoints hold each process's part of the adapters and resume
exactly; and the failures other tools met silently stop the run here: a base left whole on every
process, a step whose loss is exactly 0, a gradient norm that is not finite.

Tolerance, fp32: NF4 dequantization is a table lookup times a scale, computed identically on every
process from the same codes (gathered bit for bit: tested below for every bf16 bit pattern, NaNs
included), so the 4-bit path adds no difference of its own between the strategies; what differs is
the order of fp32 sums (a reduce-scatter against an all-reduce, packed rows split otherwise over the
processes), as for LoRA-FSDP (tests/test_fsdp.py): 1e-5. bf16: the policy casts the adapters to bf16
before the all-gather where DDP's autocast casts them in each matmul, the same rounding of the same
values, while bf16 sums run in other orders; losses and gradient norms differed by up to 3e-5
relative, so 5e-4 (an eighth of bf16's 2^-8 step): a gradient summed instead of averaged (2x) or a
code gathered wrong stands out. AdamW moves each weight by about lr whatever its gradient's size, so
an element whose gradient is near 0 turns such differences into larger ones: the adapters differed
by up to 0.7 % of their norm, and 1 % is allowed.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import multiproc
from conftest import ROOT, checkpoints_kept, field, metrics, words
from ddptune import config, dist, memory, model as model_lib, step as step_lib, stops, train

TINY = str(ROOT / "configs" / "tiny.yaml")
COMMON = ["train.method=qlora", "train.max_steps=4", "train.effective_batch_size=8", "train.grad_accum=null",
          "train.tokens_per_forward=512", "lora.dropout=0.0", "data.val_rows=560:565", "train.val_every=2",
          "train.save_every=2", "train.keep_checkpoints=2"]
FSDP = [*COMMON, "train.strategy=fsdp", "train.gradient_checkpointing=true"]
ADAPTER = "adapter/adapter_model.safetensors"


def run(out, overrides: list[str], resume: bool = False) -> dict:
    """A run that keeps its checkpoints when it finishes (the tests read them and cut interrupted runs from them)."""
    with checkpoints_kept():
        return train.run(config.load(TINY, [f"output_dir={out}", *overrides]), resume=resume)[0]


def stopped(out, overrides: list[str]) -> str:
    """What stopped the run: its error's type and line."""
    try:
        run(out, overrides)
    except (stops.NonFinite, dist.ShardingFailed) as e:
        return f"{type(e).__name__}: {e}"
    return "finished"


def gathered_codes() -> dict:
    """A 4-bit layer whose packed codes are every bf16 bit pattern (NaNs among them), beside an fp32
    layer as LoRA's are, sharded over the group; after an all-gather (with bf16 mixed precision, and
    without), whether each process holds the very bits it had before sharding, and whether the
    sharded layer computes what it did."""
    import bitsandbytes as bnb
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    out = {}
    for policy in ("bf16", "none"):
        torch.manual_seed(0)
        four = bnb.nn.Linear4bit(256, 512, bias=False, compute_dtype=torch.float32, quant_type="nf4",
                                 quant_storage=model_lib.QUANT_STORAGE).to("cpu")  # quantized here
        codes = four.weight.data
        codes.copy_(torch.arange(codes.numel(), dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(codes.shape))
        before = codes.view(torch.int16).clone()
        x = torch.randn(3, 256)
        expected = four(x)
        layer = torch.nn.Sequential(four, torch.nn.Linear(512, 8))
        model_lib.keep_quant_state(layer)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if policy == "bf16" else MixedPrecisionPolicy()
        fully_shard(layer, mp_policy=mp)
        held = four.weight.to_local().numel() / before.numel()
        layer.unshard()
        after = four.weight.data.view(torch.int16).reshape(-1)
        out[policy] = {"same_bits": torch.equal(after, before.reshape(-1)), "nan_patterns": int(torch.isnan(codes).sum()),
                       "held": held, "same_output": torch.equal(four(x), expected)}
        layer.reshard()
    return out


def died_during_step_4(full: Path, part: Path) -> None:
    """`part`: the folder of run `full` had it died during step 4, after its step-2 checkpoint and 3 metric lines."""
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step-000002", part / "checkpoints" / "step-000002")
    saved = yaml.safe_load((full / "config.yaml").read_text()) | {"output_dir": str(part)}
    (part / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    shutil.copy(full / ".ddptune-run", part / ".ddptune-run")
    (part / "metrics.jsonl").write_text("".join(line + "\n" for line in (full / "metrics.jsonl").read_text().splitlines()[:3]))


def afresh(port: int) -> None:
    """Leave the process group and accelerate's state (as a finished command does), so that the next
    run may take another strategy or precision; it forms its group anew on `port`."""
    dist.teardown()
    os.environ["MASTER_PORT"] = str(port)


def two_processes(root: str, ports: list[int]) -> dict:
    """One process's part of every 2-process run, in turn, in one set of processes: DDP-QLoRA in fp32
    and bf16, FSDP-QLoRA in bf16, then in fp32 with its resume and the runs that provoke its guards."""
    root, out = Path(root), {}
    out["ddp"] = run(root / "ddp2", COMMON)
    afresh(ports[0])
    run(root / "ddp2-bf16", [*COMMON, "train.precision=bf16"])
    afresh(ports[1])
    run(root / "fsdp2-bf16", [*FSDP, "train.precision=bf16"])
    afresh(ports[2])
    with checkpoints_kept():
        out["fsdp"], model = train.run(config.load(TINY, [f"output_dir={root / 'fsdp2'}", *FSDP]))
    layer = model.get_base_model().model.layers[1]  # a unit's gathered weights carry their quantization state
    layer.unshard()
    q = layer.self_attn.q_proj.base_layer
    out["gathered"] = type(q.weight).__name__, q.weight.dtype, q.weight.quant_state is q.quant_state
    layer.reshard()
    out["codes"] = gathered_codes()
    if torch.distributed.get_rank() == 0:
        died_during_step_4(root / "fsdp2", root / "part")
    torch.distributed.barrier()
    run(root / "part", FSDP, resume=True)
    # a step that scores nothing: from the third step on, the steps' summed loss comes back as 0
    steps = []
    clip_and_update = step_lib.clip_and_update

    def nothing_scored(parts, loss_sum):
        steps.append(1)
        if len(steps) >= 3:
            loss_sum.zero_()
        return clip_and_update(parts, loss_sum)

    step_lib.clip_and_update = nothing_scored
    try:
        out["zero"] = stopped(root / "zero", FSDP)
    finally:
        step_lib.clip_and_update = clip_and_update
    out["nan"] = stopped(root / "nan", [*FSDP, "train.lr=1e30", "train.max_grad_norm=0", "train.warmup_steps=0",
                                         "train.lr_schedule=constant", "train.save_every=0"])
    model_lib.QUANT_STORAGE = torch.uint8  # what FSDP2 cannot shard: accelerate leaves such weights whole
    out["uint8"] = stopped(root / "uint8", FSDP)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp-qlora")
    results = multiproc.run(two_processes, 2, str(root), [multiproc.free_port() for _ in range(3)])
    multiproc.run(run, 1, root / "one", COMMON)
    return root, results


def rows(run_dir) -> list[dict]:
    return [r for r in metrics(run_dir) if "loss" in r]


def val(run_dir) -> list[float]:
    return [r["val_loss"] for r in metrics(run_dir) if "val_loss" in r]


def test_fsdp_qlora_takes_the_steps_of_ddp_qlora_and_of_one_process(runs):
    root, results = runs
    summary = results[0]["fsdp"]
    assert summary["strategy"] == "fsdp" and summary["world_size"] == 2 and summary["method"] == "qlora"
    assert summary["base_4bit"] is True and summary["gradient_checkpointing"] is True
    one = json.loads((root / "one" / "summary.json").read_text())
    assert (summary["total_params"], summary["trainable_params"]) == (one["total_params"], one["trainable_params"])
    s = memory.shape_of(model_lib.preset_config("tiny", "sdpa"))
    assert one["total_params"] == s.params + s.lora_params(8, ["all-linear"])  # 4-bit weights at their unpacked count
    fsdp, ddp, single = rows(root / "fsdp2"), rows(root / "ddp2"), rows(root / "one")
    assert len(fsdp) == len(ddp) == len(single) == 4 and all(r["forwards"] > 1 for r in fsdp)
    for key in ("loss", "grad_norm"):
        for other in (ddp, single):
            assert [r[key] for r in fsdp] == pytest.approx([r[key] for r in other], abs=1e-5, rel=1e-5), key
    assert len(val(root / "fsdp2")) == 2
    for other in ("ddp2", "one"):
        assert val(root / "fsdp2") == pytest.approx(val(root / other), abs=1e-5)
    w = {d: load_file(root / d / ADAPTER) for d in ("fsdp2", "ddp2", "one")}
    assert w["fsdp2"].keys() == w["ddp2"].keys() == w["one"].keys() and any("lora_B" in k for k in w["one"])
    for k in w["one"]:
        assert w["fsdp2"][k].shape == w["one"][k].shape, k
        assert torch.allclose(w["fsdp2"][k], w["ddp2"][k], atol=1e-5, rtol=0), k
        assert torch.allclose(w["fsdp2"][k], w["one"][k], atol=1e-5, rtol=0), k
    assert any(w["one"][k].abs().max() > 0 for k in w["one"] if "lora_B" in k)  # the adapters trained


def test_bf16_mixed_precision_takes_ddps_steps(runs):
    root, _ = runs
    fsdp, ddp = rows(root / "fsdp2-bf16"), rows(root / "ddp2-bf16")
    assert len(fsdp) == len(ddp) == 4
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in fsdp] == pytest.approx([r[key] for r in ddp], rel=5e-4), key
    assert val(root / "fsdp2-bf16") == pytest.approx(val(root / "ddp2-bf16"), rel=5e-4)
    a, b = load_file(root / "fsdp2-bf16" / ADAPTER), load_file(root / "ddp2-bf16" / ADAPTER)
    for k in a:  # fp32 master weights, moved by AdamW, which scales each gradient element to about lr
        assert a[k].dtype == torch.float32 and (a[k] - b[k]).norm() <= 1e-2 * b[k].norm(), k


def test_the_4bit_codes_are_sharded_and_gathered_bit_for_bit(runs):
    """FSDP2 reshapes nothing and canonicalizes no NaN: every code comes back as it was."""
    _, results = runs
    for rank in results:
        for policy, r in rank["codes"].items():
            assert r["nan_patterns"] > 0 and r["held"] == 0.5, policy
            assert r["same_bits"] and r["same_output"], policy


def test_a_gathered_4bit_weight_carries_its_layers_quantization_state(runs):
    """A plain gathered tensor, never rebuilt as bitsandbytes' parameter class inside the forward
    (which compiled layers cannot trace)."""
    _, results = runs
    assert all(r["gathered"] == ("Parameter", torch.bfloat16, True) for r in results)


def test_the_adapter_loads_on_the_4bit_base_without_ddptune(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    root, _ = runs
    ids = torch.tensor([[256, 72, 105, 33, 10, 65]])
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)  # its stock uint8 containers: the same codes
    base = lambda: AutoModelForCausalLM.from_pretrained(model_lib.preset_folder("tiny", 0), quantization_config=quant,  # noqa: E731
                                                        dtype=torch.float32, attn_implementation="sdpa")
    logits = {d: PeftModel.from_pretrained(base(), root / d / "adapter")(ids).logits for d in ("fsdp2", "one")}
    assert torch.allclose(logits["fsdp2"], logits["one"], atol=1e-4)
    assert not torch.allclose(logits["fsdp2"], base()(ids).logits, atol=1e-4)


def test_sharded_qlora_checkpoints_hold_adapter_parts_and_resume_exactly(runs):
    root, _ = runs
    ckpt = root / "fsdp2" / "checkpoints" / "step-000002"
    assert json.loads((ckpt / "state.json").read_text())["shards"] == 2
    halves = [load_file(ckpt / f"weights.shard-0000{i}.safetensors") for i in range(2)]
    whole = load_file(root / "one" / "checkpoints" / "step-000002" / "weights.safetensors")
    assert halves[0].keys() == halves[1].keys() == whole.keys() and all("lora_" in k for k in whole)  # no base weight
    assert all(halves[0][k].shape[0] + halves[1][k].shape[0] == whole[k].shape[0] for k in whole)
    assert [r["step"] for r in rows(root / "part")] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows(root / "part")] == pytest.approx([r["loss"] for r in rows(root / "fsdp2")], abs=1e-6)
    a, b = load_file(root / "fsdp2" / ADAPTER), load_file(root / "part" / ADAPTER)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def figures(line: str) -> tuple[float, float]:
    """The loss and the gradient norm a NonFinite line reports for its step."""
    loss, norm = re.match(r"NonFinite: step \d+: loss (\S+), gradient norm ([^:]+): ", line).groups()
    return float(loss), float(norm)


def test_a_step_that_scores_nothing_stops_every_process_at_that_step(runs):
    root, results = runs
    lines = {r["zero"] for r in results}
    assert len(lines) == 1  # both processes, the same step
    (line,) = lines
    loss, norm = figures(line)  # step 3's loss is 0 and its gradient norm a number: the loss of 0 stopped it
    assert line.startswith("NonFinite: step 3: ") and loss == 0.0 and math.isfinite(norm), line
    assert str(root / "zero" / "checkpoints" / "step-000002") in words(line) and line.endswith(")") and "\n" not in line
    assert [r["step"] for r in rows(root / "zero")] == [1, 2]  # step 3 is not logged
    assert not (root / "zero" / "adapter").exists() and not (root / "zero" / "summary.json").exists()


def test_a_gradient_norm_that_is_not_finite_stops_fsdp_qlora(runs):
    root, results = runs
    (line,) = {r["nan"] for r in results}
    assert line.startswith("NonFinite: step ") and not all(map(math.isfinite, figures(line))), line  # what stopped it
    step = int(line.split()[2].rstrip(":"))
    assert step >= 2 and [r["step"] for r in rows(root / "nan")] == list(range(1, step))
    assert not (root / "nan" / "adapter").exists()


def test_a_base_that_fsdp_leaves_whole_stops_the_run_before_its_first_step(runs):
    """uint8 containers (bitsandbytes' default): accelerate keeps them out of fully_shard, so each
    process would hold the whole 4-bit base; every process stops with the same one line."""
    root, results = runs
    (line,) = {r["uint8"] for r in results}
    assert line.startswith("ShardingFailed: ") and field(line.removeprefix("ShardingFailed: ")) == "train.strategy=fsdp", line
    assert {"1/2", "uint8"} <= words(line) and "\n" not in line, line  # its share of 2 processes, the dtype left whole
    assert not (root / "uint8" / "metrics.jsonl").exists() or rows(root / "uint8") == []
