"""GPU-only checks (skipped without CUDA; run on the device machine, see BENCHMARKS.md)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from ddptune import arch as arch_lib, attention, batches, loss as loss_lib, model as model_lib
from ddptune.data import tokens
from test_architectures import GPU_QLORA, GPU_RUNS

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_flash_varlen_matches_per_sample_sdpa():
    """The FlashAttention varlen kernel gives each packed sample the attention (and gradients)
    it would get alone, with grouped-query heads, in bf16."""
    assert attention._flash_varlen is not None, "torch has no torch.nn.attention.varlen"
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [37, 200, 5, 511, 64]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(lengths), 32, 128, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(sum(lengths), 8, 128, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True) for _ in range(2))
    out = attention._flash_varlen(q, k, v, cu, max(lengths), 128 ** -0.5)
    ref = torch.cat([
        torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1).float(), k[a:b].transpose(0, 1).float(), v[a:b].transpose(0, 1).float(),
            is_causal=True, enable_gqa=True).transpose(0, 1)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    assert (out.float() - ref).abs().max() < 2e-2
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        assert (a.float() - b.float()).abs().max() / b.float().abs().max() < 2e-2


@cuda
def test_the_card_is_measured_once_and_its_cached_figures_read_back(tmp_path, monkeypatch):
    """card.of measures the GPU's five figures (each within a factor of 20 of the reference card's: a
    datacenter card of this decade), writes them under $DDPTUNE_CACHE/cards, and the next call reads
    them back unmeasured; a damaged file is measured again and rewritten."""
    from ddptune import card

    monkeypatch.setenv("DDPTUNE_CACHE", str(tmp_path))
    reserved = torch.cuda.memory_reserved(0)
    first = card.of(torch.device("cuda", 0))
    assert torch.cuda.memory_reserved(0) - reserved < 64 * 2**20  # its ~400 MiB went back to the GPU (cuBLAS keeps a workspace)
    assert first.source == "measured" and first.name == torch.cuda.get_device_name(0)
    assert all(0.05 < f < 20 for f in first.factors().values()) and 50 < first.matrix_tflops < 5000
    (path,) = (tmp_path / "cards").iterdir()
    assert card.of(torch.device("cuda", 0)) == first  # read back: the same figures, to the last digit
    path.write_text('{"format": 1, "name": "truncated')
    again = card.of(torch.device("cuda", 0))
    assert again.source == "measured" and json.loads(path.read_text())["kernel_s"] == again.kernel_s


def packed_and_separate(weights_dtype: torch.dtype, context) -> tuple:
    """The tiny preset's loss on one packed row of three samples, and the sum of their losses alone
    (each through SDPA with transformers' mask), under `context`; and the model."""
    torch.manual_seed(0)
    net = loss_lib.CausalLMLoss(model_lib.build_preset("tiny", 0, weights_dtype, torch.device("cuda"), "varlen"))
    ex = []
    for n in (90, 140, 60):
        ids = torch.randint(0, 256, (n,)).tolist()
        ex.append({"input_ids": ids, "labels": [tokens.IGNORE] * 10 + ids[10:]})
    to = lambda b: {k: v.cuda() if torch.is_tensor(v) else v for k, v in b.items()}  # noqa: E731
    with context:
        separate = sum(net(**to(batches.collate([e], 0)), num_items=1).float() for e in ex)
        packed = net(**to(batches.collate_packed(ex)), num_items=1).float()
    return packed, separate, net


@cuda
def test_packed_loss_equals_separate_losses_on_gpu():
    """Through the whole model (varlen attention, bf16): packed row = sum of the samples alone."""
    packed, separate, _ = packed_and_separate(torch.bfloat16, torch.no_grad())
    assert torch.allclose(packed, separate, rtol=1e-2)


@cuda
def test_packed_full_fine_tune_fp32_weights_under_autocast():
    """Full fine-tuning keeps fp32 weights under bf16 autocast; rotary embeddings hand the flash
    kernel (bf16/fp16 only) fp32 queries and keys. The packed row still equals the samples alone,
    and gradients flow."""
    packed, separate, net = packed_and_separate(torch.float32, torch.autocast("cuda", dtype=torch.bfloat16))
    assert torch.allclose(packed, separate.detach(), rtol=1e-2)
    packed.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters() if p.requires_grad)


@cuda
def test_an_in_process_gpu_run_gets_one_thread_as_nproc_1_would(monkeypatch):
    """Without a launcher (and OMP_NUM_THREADS unset) `dist.setup` gives a GPU process the one OpenMP
    thread `--nproc 1` gives it through torchrun."""
    from ddptune import dist

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        dist.setup()
        assert torch.get_num_threads() == 1
    finally:
        dist.teardown()
        torch.set_num_threads(before)


@cuda
def test_flash_varlen_takes_a_padded_row_with_empty_samples():
    """The fixed shapes of train.cuda_graphs: a pad sample, boundaries repeated (empty samples) and
    max_length above every sample's length leave the real samples' attention and gradients as they are."""
    g = torch.Generator(device="cuda").manual_seed(1)
    lengths = [37, 200, 5]
    real = sum(lengths)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    padded_cu = torch.tensor([0, 37, 237, 242, 256] + [256] * 59, device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(256, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True) for _ in range(3))
    out = attention._flash_varlen(q[:real], k[:real], v[:real], cu, max(lengths), 0.125)
    fixed = attention._flash_varlen(q, k, v, padded_cu, 512, 0.125)
    assert torch.equal(fixed[:real], out)
    w = torch.randn_like(out)
    a = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    b = torch.autograd.grad((fixed[:real].float() * w).sum(), (q, k, v))
    for x, y in zip(a, b):
        assert torch.allclose(x[:real].float(), y[:real].float(), atol=1e-3)


@cuda
def test_flash_varlen_computes_every_position_of_a_row_padded_for_graphs():
    """A row padded for CUDA graphs far past the longest sample: every position, pad samples
    included, gets the attention it would get alone, and every gradient is finite. (One pad sample
    longer than max_length_q left positions unwritten: finite loss, NaN gradients on H200.)"""
    g = torch.Generator(device="cuda").manual_seed(2)
    ex = [{"input_ids": [1] * n, "labels": [1] * n} for n in (37, 200, 5)]
    row = batches.collate_packed(ex, pad_to=1024, max_length=200)
    cu = row["cu_seq_lens_q"].cuda()
    q, k, v = (torch.randn(1024, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True) for _ in range(3))
    out = attention._flash_varlen(q, k, v, cu, row["max_length_q"], 0.125)
    bounds = sorted(set(cu.tolist()))
    ref = torch.cat([
        torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1).float(), k[a:b].transpose(0, 1).float(), v[a:b].transpose(0, 1).float(),
            is_causal=True, scale=0.125).transpose(0, 1)
        for a, b in zip(bounds[:-1], bounds[1:])])
    assert bounds[-1] == 1024 and (out.float() - ref).abs().max() < 2e-2
    out.float().square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def losses_of(folder) -> list[dict]:
    return [json.loads(l) for l in (folder / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]


@cuda
@pytest.mark.parametrize("checkpointing, lengths", [(False, 1), (True, 1), (False, 3)])
def test_layer_graphs_train_to_the_losses_of_compiled_layers(tmp_path, monkeypatch, checkpointing, lengths):
    """Each layer recorded as a CUDA graph (forced: the speed decider picks layer graphs for 8-bit
    optimizers) changes how kernels are launched, not the math: same losses as compiled layers
    without graphs (bf16, so within rounding), also with gradient checkpointing and with rows padded
    to several lengths. Every length is compiled before the first step: none in the middle of the run."""
    from conftest import ROOT
    import torch._dynamo.utils as dynamo_utils
    from ddptune import config, graphs, train

    compiled_after_warming = []
    warm = graphs.warm_layers

    def counted(*args):  # how many graphs dynamo has compiled once every length is warm
        warm(*args)
        compiled_after_warming.append(dynamo_utils.counters["stats"]["unique_graphs"])

    monkeypatch.setattr(graphs, "warm_layers", counted)
    runs = {}
    for scope in ("off", "layers"):
        monkeypatch.setenv("DDPTUNE_SPEED", f"graphs={scope},lengths={lengths}")
        cfg = config.load(ROOT / "configs" / "tiny.yaml", [
            f"output_dir={tmp_path / scope}", "train.max_steps=8", "data.val=null", "eval.enabled=false", "train.compile=true",
            "train.micro_batch_size=8", f"train.gradient_checkpointing={str(checkpointing).lower()}"])
        summary, _ = train.run(cfg)
        assert summary["cuda_graphs"] == scope
        runs[scope] = [r["loss"] for r in losses_of(tmp_path / scope)]
    assert runs["layers"] == pytest.approx(runs["off"], rel=2e-2)
    assert runs["layers"][-1] < runs["layers"][0]
    assert compiled_after_warming == [dynamo_utils.counters["stats"]["unique_graphs"]]


@cuda
@pytest.mark.parametrize("lengths, checkpointing, row, method", [
    (1, False, 8192, "lora"), (3, False, 8192, "lora"), (1, True, 768, "lora"), (1, False, 8192, "qlora"), (1, False, 8192, "full")])
def test_whole_step_graphs_train_to_the_losses_of_compiled_layers(tmp_path, monkeypatch, lengths, checkpointing, row, method):
    """The whole step recorded (the forwards, backwards, clipping and the fused AdamW update of
    step.py, replayed): the same losses, gradient norms and learning rates as the compiled layers
    launched one by one (bf16, so within rounding), at one length or several. A run resumed from its
    checkpoint at step 4 goes on with the unbroken run's losses. With gradient checkpointing too, and
    several packed rows a step, with a 4-bit base, and full fine-tuning."""
    from conftest import ROOT, checkpoints_kept
    from ddptune import config, train

    def run(name, scope):
        monkeypatch.setenv("DDPTUNE_SPEED", f"graphs={scope},lengths={lengths},dequantize=false")
        cfg = config.load(ROOT / "configs" / "tiny.yaml", [
            f"output_dir={tmp_path / name}", "train.max_steps=8", "data.val=null", "eval.enabled=false", "train.compile=true",
            "train.micro_batch_size=8", "train.save_every=4", f"train.gradient_checkpointing={str(checkpointing).lower()}",
            f"train.tokens_per_forward={row}", f"train.method={method}", *(["train.lr=1e-4"] if method == "full" else [])])
        with checkpoints_kept():  # the resumed run starts from the step-4 checkpoint of a finished one
            summary, _ = train.run(cfg, resume="resume" in name)
        return summary, losses_of(tmp_path / name)

    _, eager = run("eager", "off")
    summary, step = run("step", "step")
    assert summary["cuda_graphs"] == "step" and summary["compiled"]
    for key, rel in (("loss", 2e-2), ("grad_norm", 5e-2), ("lr", 1e-6)):
        assert [r[key] for r in step] == pytest.approx([r[key] for r in eager], rel=rel), key
    assert step[-1]["loss"] < step[0]["loss"]
    import shutil

    shutil.copytree(tmp_path / "step" / "checkpoints" / "step-000004", tmp_path / "step-resume" / "checkpoints" / "step-000004")
    shutil.copy(tmp_path / "step" / ".ddptune-run", tmp_path / "step-resume" / ".ddptune-run")
    _, resumed = run("step-resume", "step")
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in step[4:]], rel=2e-2)


@cuda
def test_forced_graphs_record_the_whole_step_and_still_validate_and_evaluate(tmp_path):
    """train.cuda_graphs=true with the default AdamW records the whole step; validation (every few
    steps and at the end) and ROUGE's generation afterwards run the layers eagerly, outside the
    recordings, and the steps after a validation replay the same graphs: the same losses and
    validation losses as compiled layers without graphs."""
    from conftest import ROOT
    from ddptune import config, train

    def run(name, graphs):
        cfg = config.load(ROOT / "configs" / "tiny.yaml", [
            f"output_dir={tmp_path / name}", "train.max_steps=6", "train.val_every=3", "train.compile=true",
            "train.micro_batch_size=8", "eval.enabled=true", "eval.zero_shot=false", "eval.max_samples=8",
            "eval.max_new_tokens=8", f"train.cuda_graphs={graphs}"])
        summary, _ = train.run(cfg)
        rows = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return summary, [r["loss"] for r in rows if "loss" in r], [r["val_loss"] for r in rows if "val_loss" in r]

    summary, losses, val = run("step", "true")
    assert summary["cuda_graphs"] == "step" and "rouge" in summary and summary["speed"]["graphs"] == "step"
    off, eager_losses, eager_val = run("eager", "false")
    assert off["cuda_graphs"] == "off"
    assert losses == pytest.approx(eager_losses, rel=2e-2) and len(val) == len(eager_val) >= 2
    assert val == pytest.approx(eager_val, rel=2e-2)


@cuda
def test_the_decider_records_one_length_for_a_small_model_and_explains_each_choice(tmp_path):
    """A 6-step run of the tiny preset on a GPU: its step is bound by kernel latency, so padding costs
    nothing and one recorded length (less set-up than compiling for changing shapes) wins, at the
    decider's padded length; checkpointing is not needed; every choice has its line in summary.json."""
    from conftest import ROOT
    from ddptune import config, train

    cfg = config.load(ROOT / "configs" / "tiny.yaml", [f"output_dir={tmp_path / 'run'}", "train.max_steps=6", "data.val=null"])
    summary, _ = train.run(cfg)
    speed = summary["speed"]
    assert (speed["graphs"], speed["lengths"], speed["checkpointing"], speed["compiled"]) == ("step", 1, False, True)
    assert speed["estimate"]["setup_s"] < min(o["setup_s"] for o in speed["estimate"]["options"] if o["graphs"] == "off")
    assert summary["cuda_graphs"] == "step" and math.isfinite(summary["final_loss"])
    assert summary["padded_lengths"][0] == speed["sizes"][0] and len(speed["sizes"]) == 1  # (and a longer row's, where met)
    assert set(speed["reasons"]) >= {"compiled layers", "gradient checkpointing", "CUDA graphs", "DDP gradient buckets"}
    assert speed["estimate"]["free_gib"] > 1 and speed["estimate"]["memory_gib"] < speed["estimate"]["free_gib"]
    assert speed["estimate"]["card"]["source"] == "measured"  # timed with this card's own figures (card.of)
    assert speed["reasons"]["CUDA graphs"]["code"] in ("graphs_faster", "graphs_only_option")


def fail_every_step_recording(monkeypatch):
    """Every whole-step recording fails for real from now on: StepGraphs.record records the step's
    work followed by a synchronization, which a CUDA graph cannot hold. Returns the real record."""
    from ddptune import graphs

    record = graphs.StepGraphs.record

    def failing(self, work):
        def broken():
            work()
            torch.cuda.synchronize()
        return record(self, broken)

    monkeypatch.setattr(graphs.StepGraphs, "record", failing)
    return record


@cuda
def test_a_step_that_fails_to_record_falls_back_to_its_compiled_layers(tmp_path, monkeypatch):
    """A real capture failure (synchronizing inside the recording, which a CUDA graph cannot hold):
    the run goes on with its compiled layers launched one by one at the padded length, summary.json
    says no graphs ran, and the losses are those of compiled layers without graphs."""
    from conftest import ROOT
    from ddptune import config, train

    def run(name, scope):
        monkeypatch.setenv("DDPTUNE_SPEED", f"graphs={scope},lengths=1,dequantize=false")
        cfg = config.load(ROOT / "configs" / "tiny.yaml", [
            f"output_dir={tmp_path / name}", "train.max_steps=6", "data.val=null", "eval.enabled=false", "train.compile=true",
            "train.micro_batch_size=8"])
        summary, _ = train.run(cfg)
        return summary, losses_of(tmp_path / name)

    _, plain = run("plain", "off")
    fail_every_step_recording(monkeypatch)
    summary, fell = run("fell", "step")
    assert summary["cuda_graphs"] == "off" and summary["compiled"] and len(summary["padded_lengths"]) == 1
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in fell)
    assert [r["loss"] for r in fell] == pytest.approx([r["loss"] for r in plain], rel=2e-2)


@cuda
def test_a_failed_recording_leaves_the_stream_and_the_random_generator_as_they_were():
    """A recording that an operation invalidates (a synchronization inside it, which a CUDA graph
    cannot hold), after a random draw inside it: Unrecordable, and nothing of the capture stays. The
    current stream is the one before, no capture is under way, a random draw outside any recording
    works and draws what its seed draws, and a recording into a new memory pool records and replays
    (the failed one's pool stays the allocator's: torch 2.11 keeps allocating to it for the invalidated
    capture, and a fallback never records into it again; a later run makes a pool of its own)."""
    from ddptune import graphs

    side, pool, before = torch.cuda.Stream(), torch.cuda.graph_pool_handle(), torch.cuda.current_stream()
    x = torch.ones(1 << 16, device="cuda")

    def broken():
        torch.nn.functional.dropout(x, 0.5)  # the default generator takes part in the recording
        torch.cuda.synchronize()

    with pytest.raises(graphs.Unrecordable):
        graphs.record(broken, pool, side)
    assert torch.cuda.current_stream() == before and not torch.cuda.is_current_stream_capturing()
    torch.manual_seed(3)
    drawn = torch.randn(1024, device="cuda")
    torch.manual_seed(3)
    assert torch.equal(drawn, torch.randn(1024, device="cuda"))
    graph = graphs.record(lambda: x.mul_(3), torch.cuda.graph_pool_handle(), side)
    graph.replay()
    torch.cuda.synchronize()
    assert x[0].item() == 3


@cuda
def test_after_a_failed_recording_the_same_process_draws_random_numbers_and_records_a_second_run(tmp_path, monkeypatch):
    """The whole step fails to record (a synchronization inside it) and the run falls back to its
    compiled layers, whose LoRA dropout draws random numbers every step; then, in the same process, a
    random draw and a second run whose whole step records. A failed recording once left the CUDA
    generator capturing: the next random operation anywhere in the process raised."""
    from conftest import ROOT
    from ddptune import config, graphs, train

    def run(name):
        monkeypatch.setenv("DDPTUNE_SPEED", "graphs=step,lengths=1,dequantize=false")
        cfg = config.load(ROOT / "configs" / "tiny.yaml", [
            f"output_dir={tmp_path / name}", "train.max_steps=6", "data.val=null", "eval.enabled=false", "train.compile=true",
            "train.micro_batch_size=8", "lora.dropout=0.1"])
        summary, _ = train.run(cfg)
        return summary, losses_of(tmp_path / name)

    record = fail_every_step_recording(monkeypatch)
    fell_summary, fell = run("fell")
    assert fell_summary["cuda_graphs"] == "off" and len(fell) == 6
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in fell)
    assert torch.randn(1024, device="cuda").isfinite().all()
    monkeypatch.setattr(graphs.StepGraphs, "record", record)
    summary, recorded = run("recorded")
    assert summary["cuda_graphs"] == "step" and len(recorded) == 6
    assert all(math.isfinite(r["loss"]) for r in recorded) and recorded[-1]["loss"] < recorded[0]["loss"]


@cuda
def test_combined_kernels_train_to_the_losses_of_compiled_layers_without_them(tmp_path, monkeypatch):
    """Combined kernels change how kernels are launched, not the math: compiled layers without graphs
    (where the decider turns them on) give the losses and gradient norms they give without them, within
    bf16's rounding, and summary.json says which ran."""
    from conftest import ROOT
    from ddptune import config, train

    def run(name, combo):
        torch._dynamo.reset()  # each run compiles its own layers, not the other's cached ones
        monkeypatch.setenv("DDPTUNE_SPEED", f"graphs=off,combo={combo},dequantize=false")
        cfg = config.load(ROOT / "configs" / "tiny.yaml", [
            f"output_dir={tmp_path / name}", "train.max_steps=6", "data.val=null", "eval.enabled=false", "train.compile=true",
            "train.micro_batch_size=8"])
        summary, _ = train.run(cfg)
        return summary, losses_of(tmp_path / name)

    plain_summary, plain = run("plain", "false")
    summary, combined = run("combined", "true")
    assert (plain_summary["speed"]["combo"], summary["speed"]["combo"], summary["compiled"]) == (False, True, True)
    for key, rel in (("loss", 2e-2), ("grad_norm", 5e-2)):
        assert [r[key] for r in combined] == pytest.approx([r[key] for r in plain], rel=rel), key


@cuda
def test_a_qlora_run_at_nproc_1_trains_on_the_gpu_in_a_forked_worker(tmp_path):
    """--nproc runs its workers forked from a server that imported torch, transformers and ddptune
    without starting CUDA: the forked worker quantizes (bitsandbytes) and trains on the GPU."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "ddptune", "train", str(ROOT / "configs" / "tiny.yaml"), "--nproc", "1",
                           f"output_dir={out}", "train.method=qlora", "train.max_steps=3", "data.val=null", "eval.enabled=false"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["method"] == "qlora" and summary["mixed_precision"] == "bf16"
    assert summary["peak_mem_gib"] > 0  # GPU memory: on the CPU there is none to count
    assert len(losses_of(out)) == 3 and all(math.isfinite(r["loss"]) for r in losses_of(out))


@cuda
@pytest.mark.parametrize("preload, hidden, forked, device", [((), False, True, "cuda"), (("cudastart",), False, False, "cuda"),
                                                             ((), True, True, "cpu")])
def test_workers_are_forked_ready_imported_unless_the_fork_server_started_cuda(tmp_path, monkeypatch, preload, hidden,
                                                                               forked, device):
    """torch's CUDA build loads CUDA's driver library when imported without starting it: a worker forked
    from a server that imported torch and ddptune uses the GPU. A server whose module started CUDA leaves
    forks that could not: each worker then runs in a new interpreter, and uses the GPU there. A CPU job
    on a GPU host (CUDA_VISIBLE_DEVICES empty) keeps its forked workers."""
    import os

    from conftest import WORKER_PATH
    from ddptune import launch

    monkeypatch.setenv("PYTHONPATH", WORKER_PATH)
    if hidden:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    standby = launch.Standby(preload=("ddptune.cli", "ddptune.train", *preload))
    code = launch.torchrun(1, ["cudaworker"], env=dict(os.environ, CUDAWORKER_DIR=str(tmp_path)), standby=standby)
    assert code == 0
    assert json.loads((tmp_path / "rank-0.json").read_text()) == {"cli_preloaded": forked, "device": device, "sum": 2.0}


@cuda
@pytest.mark.parametrize("name", ["llama", "mistral-window", "gemma2", "gemma3", "phi3", "qwen3-moe", "gpt-oss", "granite"])
def test_each_family_on_the_gpu_is_transformers_own_within_bf16(name):
    """On CUDA in bf16 (autocast over fp32 weights, as full fine-tuning runs; varlen's flash kernel with each layer's
    window, or the model's own attention per sample), the packed loss and its gradients are the eager fp32
    reference's within bf16's tolerance. A mixture's gradients are only checked to be finite: bf16 moves near-tied
    router scores across the top-k line, and a token sent to another expert changes gradients by design."""
    from test_architectures import eager_loss, family_model, rows, with_attention

    examples = rows(6)
    reference = family_model(name)
    want = eager_loss(reference, examples)
    loss = loss_lib.CausalLMLoss(with_attention(family_model(name).cuda(), "varlen"))
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batches.collate_packed(examples).items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = loss(**batch, num_items=1).float()
    assert got.item() == pytest.approx(want, rel=2e-2)
    got.backward()
    ref = loss_lib.CausalLMLoss(with_attention(reference, "varlen"))
    ref(**batches.collate_packed(examples), num_items=1).backward()
    moe = arch_lib.of(reference.config).moe
    for (n, p), q in zip(loss.named_parameters(), ref.parameters()):
        assert p.grad is None or torch.isfinite(p.grad).all(), n
        if not moe and p.grad is not None and q.grad.abs().max() > 0:
            assert (p.grad.float().cpu() - q.grad).norm() <= 0.1 * q.grad.norm(), n


def _four_bit_eager_loss(source: str, examples: list[dict]) -> float:
    """transformers' own loss (eager attention) of the saved model loaded as ddptune's QLoRA loads it: NF4 with
    double quantization, bf16 elsewhere."""
    from test_architectures import eager_loss
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=quant, dtype=torch.bfloat16,
                                                 attn_implementation="eager", device_map={"": 0}).eval()
    return eager_loss(model, examples)


@cuda
@pytest.mark.parametrize("name, method", [(n, "lora") for n in GPU_RUNS] + [(n, "qlora") for n in GPU_QLORA])
def test_each_family_trains_under_the_shipped_choices(tmp_path, name, method):
    """A saved model of each family trains two steps on the GPU with what the decider chooses: compiled layers
    for a dense model (sliding windows included), eager layers where the work changes with the data (a
    mixture's routing, a model's own attention). The first loss (the adapters start as the identity) is
    transformers' eager loss of the same 8 rows within bf16's tolerance: fp32 weights for LoRA, the same NF4
    base for QLoRA."""
    from test_architectures import RUN, config_path, eager_loss, family_config, family_model, family_run, saved_family

    from ddptune import config, memory
    from ddptune.data import tokenized

    source = saved_family(name, tmp_path / name)
    args = [f"model.source={source}", f"output_dir={tmp_path / 'run'}", f"train.method={method}", *RUN]
    summary = family_run(args)  # in this process, as the other GPU runs here (a fork cannot start CUDA again)
    cfg = config.load(str(config_path()), args)
    train_set, _ = tokenized.load(tokenized.prepare(cfg.data, model_lib.load_tokenizer(cfg.model, cfg.data)))
    examples = [train_set[i] for i in range(len(train_set))]
    summed = eager_loss(family_model(name), examples) if method == "lora" else _four_bit_eager_loss(source, examples)
    rows_ = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows_ if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(summed / batches.target_tokens(examples), rel=2e-2)
    dynamic = bool(memory.shape_of(family_config(name)).dynamic)
    assert summary["compiled"] == (not dynamic), summary["speed"]
    assert summary["cuda_graphs"] == ("off" if dynamic else "step"), summary["speed"]
