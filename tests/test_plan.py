"""`ddptune plan`: its predictions against the peaks measured on an H200, its recommendations, and
`ddptune train` refusing a run the plan says will not fit (before loading anything)."""
from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import ROOT, SHARED_DATA
from ddptune import checks, cli, config, data, memory, plan

CONFIG_8B = str(ROOT / "configs" / "samsum_qlora_llama31_8b.yaml")  # the tutorial's job


def _plan_check():
    spec = importlib.util.spec_from_file_location("plan_check", ROOT / "benchmarks" / "plan_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data is not beside this checkout")
def test_prediction_inside_the_stated_band_of_every_measured_peak():
    """Each peak measured on an H200 (benchmarks/results), read from its raw file with the settings
    its run used; the largest forward recomputed from the same data and tokenizer. Every prediction
    lies inside the band memory.py (and the README) state: from PLAN_UNDER under to PLAN_OVER over.
    Not covered: the 1B QLoRA scale run the plan missed by 38 % (its raw peak lacks the run's
    largest forward; the run is in git tag lab-notes-2026-12-01)."""
    check = _plan_check()
    runs = check.measured_runs()
    assert {r["file"] for r in runs} >= {"h200_llama31_8b_qlora_v2.json", "h200_llama31_8b_lora_bf16.json"}
    assert any(r["checkpointing"] for r in runs) and any(not r["checkpointing"] for r in runs)
    assert any(r["dequantized"] for r in runs if "dequantized" in r)  # a QLoRA base kept dequantized
    misses = []
    for r in runs:
        predicted = check.predict(r)
        if not -memory.PLAN_UNDER <= predicted / r["measured_gib"] - 1 <= memory.PLAN_OVER:
            misses.append(f"{r['name']}: predicted {predicted:.2f} GiB, measured {r['measured_gib']:.2f} GiB")
    assert not misses, misses


def test_8b_full_fine_tuning_just_fits_one_h200_and_an_80_gib_gpu_is_sent_to_fsdp():
    """AdamW's 16 bytes a weight (fp32 weights, gradients, two states) are 119.6 GiB at 8B: one H200
    held the run at 119.8 GiB (benchmarks/results/h200x2_llama31_8b_full_1gpu_metrics.jsonl), and
    plan says it fits, inside its own error of the GPU's size. An 80 GiB GPU cannot: FSDP over 2."""
    cfg = config.load(CONFIG_8B, ["train.method=full", "train.optimizer=adamw", "train.gradient_checkpointing=true"])
    shape = memory.model_shape(cfg)
    p = memory.plan(cfg, shape, gpus=1, gpu_gib=memory.DEFAULT_GPU_GIB)
    assert p["verdict"] == "ddp" and p["options"][0]["fits"]
    assert sum(p["options"][0][k] for k in ("weights", "gradients", "optimizer")) * memory.GIB > 16 * shape.params
    assert -memory.PLAN_UNDER < p["margin"] < 0  # fits, but closer to the GPU's size than plan's measured error
    p = memory.plan(cfg, shape, gpus=1, gpu_gib=80)
    n = p["fsdp_gpus_needed"]
    assert p["verdict"] == "does_not_fit" and n == 2 and p["options"][-1]["fits"] and p["options"][-1]["shards"] == n
    assert p["recommendation"].startswith("does not fit on 1 GPU") and f"FSDP (full shard) over {n} GPUs" in p["recommendation"]
    # with those GPUs given, FSDP over them is the recommendation itself
    assert memory.plan(cfg, shape, gpus=n, gpu_gib=80)["verdict"] == "fsdp"


def test_tiny_runs_ddp_as_is_and_checkpointing_is_recommended_when_activations_do_not_fit():
    tiny = config.load(ROOT / "configs" / "tiny.yaml")
    assert memory.plan(tiny, memory.model_shape(tiny))["verdict"] == "ddp"
    cfg = config.load(CONFIG_8B, ["train.gradient_checkpointing=false"])
    p = memory.plan(cfg, memory.model_shape(cfg), gpus=1, gpu_gib=40)
    assert p["verdict"] == "ddp_checkpointing"
    off, on = p["options"]
    assert off["activations"] > 5 * on["activations"] and off["weights"] == on["weights"]
    # forced on, the recorded CUDA graphs' pool is counted: a share of the activations
    graphs = config.load(CONFIG_8B, ["train.cuda_graphs=true", "train.gradient_checkpointing=false"])
    with_graphs = memory.plan(graphs, memory.model_shape(graphs), gpus=1, gpu_gib=400)["options"][0]
    assert with_graphs["graphs"] == pytest.approx(memory.GRAPH_POOL * with_graphs["activations"])
    assert off["graphs"] == 0


def test_plan_command_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli.main(["plan", CONFIG_8B, "--gpu-memory", "80",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "weights" in text and "activations" in text and "recommendation: DDP as is" in text
    saved = json.loads(out.read_text())
    assert saved["verdict"] == "ddp" and saved["gpu_memory_gib"] == 80 and saved["tokens_per_forward"] == 8192


def test_plan_json_makes_its_folder_and_replaces_an_older_plan_whole(tmp_path, capsys):
    """--json as compare's: a missing folder is made; an existing file is replaced by a whole new
    one (a temporary file renamed over it), never left half-written."""
    out = tmp_path / "new" / "plan.json"
    tiny = str(ROOT / "configs" / "tiny.yaml")
    assert cli.main(["plan", tiny, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["gpus"] == 1
    assert cli.main(["plan", tiny, "--gpus", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["gpus"] == 2 and [p.name for p in out.parent.iterdir()] == ["plan.json"]


def test_train_refuses_a_run_that_will_not_fit_in_one_line_before_loading(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["train", CONFIG_8B, "train.method=full",
                     "data.train=demo", "data.train_rows=null", "data.val=null", "data.val_rows=null",
                     f"output_dir={out}", "--gpu-memory", "80"])  # an 80 GiB GPU: the 8B full fine-tune needs FSDP
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "memory:" in err and "FSDP (full shard) over 2 GPUs" in err
    assert "train.memory_check=false tries anyway" in err
    assert not out.exists() or not any(out.iterdir())
    # the plan is an estimate: a user who knows better can still try
    cfg = config.load(CONFIG_8B, ["train.method=full"])
    assert checks.memory_problems(cfg, 1, 80)
    assert checks.memory_problems(config.load(CONFIG_8B,
                                              ["train.method=full", "train.memory_check=false"]), 1, 80) == []


def test_qlora_is_never_told_to_shard_and_fsdp_auto_checkpointing_is_not_refused():
    # QLoRA's 4-bit weights stay whole on every GPU (train.strategy=fsdp refuses qlora): no FSDP row, no FSDP advice
    shape = memory.model_shape(config.load(CONFIG_8B, []))
    p = memory.plan(config.load(CONFIG_8B, []), shape, gpus=2, gpu_gib=4)
    assert p["verdict"] == "does_not_fit" and all(o["shards"] == 1 for o in p["options"])
    assert "FSDP (full shard)" not in p["recommendation"] and "train.method=lora" in p["recommendation"]
    # FSDP with checkpointing `auto`: turning it on is the way out the run takes itself, not a refusal
    auto = config.load(CONFIG_8B, ["train.method=full", "train.strategy=fsdp", "train.gradient_checkpointing=auto"])
    assert memory.plan(auto, shape, gpus=2, gpu_gib=100)["options"][0]["fits"] is False
    assert checks.memory_problems(auto, 2, 100) == []
    assert checks.memory_problems(auto, 2, 60)  # with checkpointing on it still needs 80 GiB


def test_qlora_with_room_is_told_its_base_fits_dequantized_and_that_costs_lora_s_weights():
    cfg = config.load(CONFIG_8B, [])
    shape = memory.model_shape(cfg)
    roomy, tight = memory.plan(cfg, shape, gpus=2, gpu_gib=139.8), memory.plan(cfg, shape, gpus=2, gpu_gib=20)
    lora = memory.plan(config.load(CONFIG_8B, ["train.method=lora"]), shape, gpus=2, gpu_gib=139.8)["options"][0]
    # LoRA's bf16 weights, with the 4-bit ones still allocated beside them
    extra = shape.matrix_params * memory.NF4_BYTES / memory.GIB * (1 + memory.ALLOCATOR_SLACK)
    assert roomy["dequantized_base_gib"] == pytest.approx(lora["total"] + extra, rel=1e-6)
    assert roomy["dequantized_base_gib"] > roomy["options"][0]["total"] + 9 and "faster: the base fits dequantized" in plan.table(roomy)
    assert tight["dequantized_base_gib"] is None and "faster" not in plan.table(tight)


def test_fsdp_is_refused_when_the_whole_model_cannot_load_onto_one_gpu():
    """FSDP shards after loading: each process first holds the whole model (fp32 for full)."""
    cfg = config.load(CONFIG_8B, ["train.method=full", "train.strategy=fsdp"])
    load = memory.load_gib(memory.model_shape(cfg), "full")
    assert 30 < load < 31  # 8.03 B fp32 weights and the CUDA context
    (problem,) = checks.memory_problems(cfg, 8, 24)
    assert problem.startswith("memory: train.strategy=fsdp: each process loads the whole model") and "30." in problem
    assert checks.memory_problems(cfg, 2, memory.DEFAULT_GPU_GIB) == []


def test_a_verdict_inside_the_plans_error_is_called_close():
    cfg = config.load(CONFIG_8B, ["train.method=full", "train.gradient_checkpointing=true"])
    shape = memory.model_shape(cfg)
    tight = memory.plan(cfg, shape, 1, memory.DEFAULT_GPU_GIB)  # 137.7 GiB on 139.8 (a run held it at 119.8 allocated)
    assert tight["margin"] == pytest.approx(137.71 / memory.DEFAULT_GPU_GIB - 1, abs=1e-3)
    assert plan.table(tight).splitlines()[-1].startswith("close: as configured it leaves 1% of the GPU free")
    assert plan.table(memory.plan(cfg, shape, 1, 130)).splitlines()[-1].startswith("close: as configured it needs 6% more than the GPU holds")
    far = memory.plan(config.load(CONFIG_8B, ["train.gradient_checkpointing=true"]), shape, 1, memory.DEFAULT_GPU_GIB)
    assert not plan.table(far).splitlines()[-1].startswith("close:")


@pytest.mark.parametrize("gib", [0.1, memory.CUDA_CONTEXT_GIB])
def test_a_gpu_smaller_than_the_cuda_context_is_blamed_on_the_context(gib, capsys):
    """Below the CUDA context every GPU count is too small, whatever the activations: the line says so."""
    tiny = config.load(ROOT / "configs" / "tiny.yaml")
    p = memory.plan(tiny, memory.model_shape(tiny), gpus=1, gpu_gib=gib)
    assert p["verdict"] == "does_not_fit" and p["options"][0]["activations"] < 0.05
    assert p["recommendation"] == (f"does not fit on 1 GPU of {gib:g} GiB: the CUDA context alone takes "
                                   f"{memory.CUDA_CONTEXT_GIB} GiB of each GPU (use GPUs with more memory)")
    assert "activations" not in p["recommendation"]
    just_above = memory.plan(tiny, memory.model_shape(tiny), gpus=1, gpu_gib=2 * memory.CUDA_CONTEXT_GIB)
    assert just_above["verdict"] == "ddp"
    assert cli.main(["plan", str(ROOT / "configs" / "tiny.yaml"), "--gpu-memory", str(gib)]) == 0
    assert "the CUDA context alone takes" in capsys.readouterr().out
