"""Every family trains as transformers' own code defines it: tiny random models built from each family's own
config class (no downloads), ddptune's loss against transformers' eager forward in fp32.

The features a family defines beyond Llama are made large enough to matter at this size (windows shorter than
the samples, soft-caps near the logits' scale), so a path that drops one differs by far more than the tolerance.
"""
from __future__ import annotations

import math

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import multiproc
from conftest import metrics
from ddptune import arch as arch_lib, batches, card, config, loss as loss_lib, model as model_lib, train
from ddptune.attention import register_attention
from ddptune.config import LoraConfig

VOCAB = 320  # the byte tokenizer's 259 ids and room
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=256, eos_token_id=257, pad_token_id=258,
             initializer_range=0.2)  # weights large enough that scores and logits reach the caps
WINDOW = 8
MOE = dict(num_experts_per_tok=2)
T = transformers
# family: (config class, what it defines beyond the shape above)
FAMILIES = {
    "llama": (T.LlamaConfig, {}),
    "mistral": (T.MistralConfig, {"sliding_window": None}),
    "mistral-window": (T.MistralConfig, {"sliding_window": WINDOW}),
    "mixtral": (T.MixtralConfig, {"num_local_experts": 4, **MOE, "sliding_window": None}),
    "qwen2": (T.Qwen2Config, {}),
    "qwen3": (T.Qwen3Config, {"head_dim": 32}),
    # the chosen experts' weights renormalized, as every released Qwen3-MoE routes (the config class's default does not)
    "qwen3-moe": (T.Qwen3MoeConfig, {"num_experts": 4, **MOE, "moe_intermediate_size": 32, "head_dim": 16,
                                     "norm_topk_prob": True}),
    "qwen3-moe-routed": (T.Qwen3MoeConfig, {"num_experts": 4, **MOE, "moe_intermediate_size": 32, "head_dim": 16,
                                            "norm_topk_prob": True, "output_router_logits": True,
                                            "router_aux_loss_coef": 0.5}),
    "gemma2": (T.Gemma2Config, {"sliding_window": WINDOW, "head_dim": 16, "attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 1,
                                "final_logit_softcapping": 1.5}),
    "gemma3": (T.Gemma3TextConfig, {"sliding_window": WINDOW, "head_dim": 16, "query_pre_attn_scalar": 8}),
    "phi3": (T.Phi3Config, {}),
    "olmo2": (T.Olmo2Config, {}),
    "gpt-oss": (T.GptOssConfig, {"num_local_experts": 4, **MOE, "sliding_window": WINDOW, "head_dim": 16,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "granite": (T.GraniteConfig, {"logits_scaling": 4.0, "attention_multiplier": 0.1, "embedding_multiplier": 2.0,
                                  "residual_multiplier": 0.5}),
}
RUN_FAMILIES = ["gemma3", "qwen3-moe", "qwen3-moe-routed"]  # whole runs: eager's step-1 loss, N=2 as N=1 (CPU)
# what `all-linear` adapts in each layer, by the name's end ("experts.*": the experts' 3-D weights)
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
DENSE = ATTENTION | {"gate_proj", "up_proj", "down_proj"}
EXPERTS = ATTENTION | {"experts"}
TARGETS = {"phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}, "olmo2": DENSE, "granite": DENSE,
           "mixtral": EXPERTS, "qwen3-moe": EXPERTS, "qwen3-moe-routed": EXPERTS, "gpt-oss": EXPERTS}


def family_config(name: str, attn: str = "eager"):
    cls, extra = FAMILIES[name]
    cfg = cls(**(SHAPE | extra))
    cfg._attn_implementation = attn
    return cfg


def family_model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(family_config(name), dtype=torch.float32).eval()


def rows(n: int = 4, seed: int = 0) -> list[dict]:
    """Samples longer than the window (20 to 29 tokens), the loss on their second halves."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, 256, (20 + 3 * i,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * (len(ids) // 2) + ids[len(ids) // 2:]})
    return out


def eager_loss(model, examples: list[dict]) -> float:
    """Summed token loss of transformers' own forward (eager attention), sample by sample: its loss with labels
    (the mean over a sample's targets, plus the router's balance loss where the config asks for it) times the
    sample's target count."""
    total = 0.0
    with torch.no_grad():
        for e in examples:
            out = model(input_ids=torch.tensor([e["input_ids"]], device=model.device),
                        labels=torch.tensor([e["labels"]], device=model.device))
            total += out.loss.item() * batches.target_tokens([e])
    return total


def adapted_logits(net) -> tuple:
    """An adapted model's adapters made non-zero (lora_B drawn at random), in eval mode: a sample's ids and the
    logits the adapted model gives them."""
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
        net.eval()
        ids = torch.tensor([rows(1)[0]["input_ids"]])
        return ids, net(input_ids=ids).logits


def with_attention(model, attn: str):
    register_attention()
    for m in model.modules():
        if isinstance(getattr(m, "config", None), transformers.PretrainedConfig):
            m.config._attn_implementation = attn
    return model


@pytest.mark.parametrize("name", FAMILIES)
def test_the_loss_is_transformers_own_packed_and_padded(name):
    """ddptune's loss (CausalLMLoss through varlen attention) equals transformers' eager forward on the same
    rows within 1e-5 relative, for a packed row and for a padded batch: windows per layer, soft-caps, sinks,
    the head's scaling and experts included."""
    model = family_model(name)
    examples = rows()
    want = eager_loss(model, examples)
    loss = loss_lib.CausalLMLoss(with_attention(model, "varlen"))
    with torch.no_grad():
        packed = loss(**batches.collate_packed(examples), num_items=1).item()
        padded = loss(**batches.collate(examples, pad_id=0), num_items=1).item()
    assert packed == pytest.approx(want, rel=1e-5)
    assert padded == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("name", ["qwen3-moe-routed", "mixtral", "gpt-oss"])
def test_the_router_loss_is_transformers_own_per_sample_and_the_same_however_samples_are_grouped(name):
    """Where the config asks for the router's load-balancing loss, a sample alone gets transformers' own loss
    (cross-entropy + coef x balance loss, labels given); several samples packed, padded or one by one get the sum of
    their losses weighted by their targets, whichever way they are grouped (what keeps 2 processes = 1)."""
    cls, extra = FAMILIES[name]
    cfg = cls(**(SHAPE | extra | {"output_router_logits": True, "router_aux_loss_coef": 0.5}))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    examples = rows()
    with torch.no_grad():
        own = [model(input_ids=torch.tensor([e["input_ids"]]), labels=torch.tensor([e["labels"]])) for e in examples]
    assert all(o.aux_loss > 0 for o in own)
    loss = loss_lib.CausalLMLoss(with_attention(model, "varlen"))
    assert loss.arch.router_aux_coef == 0.5
    counts = [batches.target_tokens([e]) for e in examples]
    with torch.no_grad():
        alone = [loss(**batches.collate_packed([e]), num_items=n).item() for e, n in zip(examples, counts)]
        packed = loss(**batches.collate_packed(examples), num_items=1).item()
        padded = loss(**batches.collate(examples, pad_id=0), num_items=1).item()
    assert alone == pytest.approx([o.loss.item() for o in own], rel=1e-5)
    want = sum(o.loss.item() * n for o, n in zip(own, counts))
    assert packed == pytest.approx(want, rel=1e-5) and padded == pytest.approx(want, rel=1e-5)


PLAIN = {"sliding_window": 4096, "attn_logit_softcapping": None, "final_logit_softcapping": None, "logits_scaling": 1.0}


@pytest.mark.parametrize("name,feature", [("mistral-window", "sliding_window"), ("gemma2", "sliding_window"),
                                          ("gemma2", "attn_logit_softcapping"), ("gemma2", "final_logit_softcapping"),
                                          ("gpt-oss", "sliding_window"), ("gpt-oss", "sinks"), ("granite", "logits_scaling")])
def test_each_feature_matters_at_this_size(name, feature):
    """The features are large enough here that leaving one out (the same weights, the feature plain) moves
    transformers' own loss far past the tolerance above: the test above would catch a path that drops it."""
    examples = rows()
    want = eager_loss(family_model(name), examples)
    cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(cls(**(SHAPE | extra | ({feature: PLAIN[feature]} if feature in PLAIN else {}))),
                                             dtype=torch.float32, attn_implementation="eager").eval()
    if feature == "sinks":
        for layer in plain.model.layers:
            layer.self_attn.sinks.data.fill_(-1e4)  # sinks that take no share of any softmax
    assert abs(eager_loss(plain, examples) - want) / want > 1e-3


def test_what_each_family_defines_is_read_from_its_config():
    """arch.of: windows per layer as the config's layer types say, soft-caps, the head's scale, sinks, experts."""
    gemma2 = arch_lib.of(family_config("gemma2"))
    assert gemma2.windows == (WINDOW, None, WINDOW, None) and gemma2.attn_softcap == 2.0 and gemma2.final_softcap == 1.5
    assert gemma2.slow_attention() == ["attention soft-capping"] and gemma2.tied_head
    assert arch_lib.of(family_config("mistral-window")).windows == (WINDOW,) * 4
    assert arch_lib.of(family_config("mistral")).windows == (None,) * 4
    assert arch_lib.of(family_config("qwen3")).windows == (None,) * 4  # use_sliding_window false
    oss = arch_lib.of(family_config("gpt-oss"))
    assert oss.sinks and oss.experts == 4 and oss.experts_per_token == 2 and oss.router_aux_coef is None
    assert oss.slow_attention() == ["attention sinks"]
    assert arch_lib.of(family_config("granite")).logit_scale == 0.25
    llama = arch_lib.of(family_config("llama"))
    assert llama.features() == [] and llama.slow_attention() == [] and not llama.moe
    routed = family_config("mixtral")
    routed.output_router_logits = True
    assert arch_lib.of(routed).router_aux_coef == routed.router_aux_loss_coef > 0
    chunked = family_config("llama")
    chunked.attention_chunk_size = 16
    assert arch_lib.of(chunked).packing_problem() is not None


@pytest.mark.parametrize("name", ["phi3", "olmo2", "granite", "mixtral", "qwen3-moe", "gpt-oss"])
def test_all_linear_adapts_what_a_user_expects(name):
    """all-linear: every projection of attention and the MLP (fused ones as they are), a mixture's experts
    through their 3-D weights (dropout 0, as peft's expert adapters need), never a router or the head;
    merged into the base, the adapted model gives the same logits."""
    model = family_model(name)
    lo = LoraConfig(r=4)
    net = model_lib.add_adapters(model, "lora", lo, False)
    adapted = {n.split(".lora_")[0].replace(".base_layer", "").rsplit(".", 1)[-1]
               for n, p in net.named_parameters() if "lora_" in n}
    assert adapted == TARGETS[name]
    dropout = net.peft_config["default"].lora_dropout
    assert dropout == (0.0 if arch_lib.of(model.config).moe else config.LORA_DROPOUT)
    ids, want = adapted_logits(net)
    with torch.no_grad():
        with net.disable_adapter():
            assert not torch.allclose(net(input_ids=ids).logits, want, atol=1e-3)  # the adapters change the output
        merged = net.merge_and_unload()
        assert (merged(input_ids=ids).logits - want).abs().max() < 1e-4 * want.abs().max()


def test_a_set_dropout_with_adapted_experts_is_refused_before_launch():
    lo = LoraConfig(dropout=0.1)
    moe, dense = (arch_lib.of(family_config(n)) for n in ("qwen3-moe", "llama"))
    assert [p.split(":")[0] for p in model_lib.arch_problems(moe, lo, "lora", True)] == ["lora.dropout"]
    assert model_lib.arch_problems(moe, LoraConfig(), "lora", True) == []
    assert model_lib.arch_problems(dense, lo, "lora", True) == []
    assert model_lib.arch_problems(moe, LoraConfig(dropout=0.1, target_modules=["q_proj"]), "lora", True) == []


# ---------------------------------------------------------------------------------------------
# whole runs: a saved family model as model.source


def saved_family(name: str, folder) -> str:
    family_model(name).save_pretrained(folder)
    model_lib.byte_tokenizer().save_pretrained(folder)
    return str(folder)


def family_run(args: list[str]) -> dict:
    """One process's part of a run of the tiny config on a saved family model."""
    cfg = config.load(str(config_path()), args)
    summary, _ = train.run(cfg)
    return summary


def config_path():
    from conftest import ROOT

    return ROOT / "configs" / "tiny.yaml"


RUN = ["train.max_steps=2", "data.train_rows=0:8", "data.val=null", "eval.enabled=false", "data.max_length=96", "train.warmup_steps=0",
       "train.tokens_per_forward=192", "lora.dropout=0", "train.effective_batch_size=8", "train.micro_batch_size=4",
       "train.grad_accum=null"]


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory):
    """Two steps of all 8 training rows (the demo's first 8) on a saved windowed dense family (Gemma 3) and
    a mixture (Qwen3-MoE, its experts adapted), at 1 and 2 gloo processes."""
    root = tmp_path_factory.mktemp("families")
    sources = {name: saved_family(name, root / f"{name}-model") for name in RUN_FAMILIES}
    for n in (1, 2):
        multiproc.run(_in_turn, n, [[f"model.source={s}", f"output_dir={root / f'{name}-{n}'}", *RUN]
                                    for name, s in sources.items()]
                      + [[f"model.source={s}", f"output_dir={root / f'{name}-fsdp'}", "train.strategy=fsdp", *RUN]
                         for name, s in sources.items() if n == 2])
    return root, sources


def _in_turn(runs: list[list[str]]) -> list[dict]:
    return [family_run(r) for r in runs]


@pytest.mark.parametrize("name", RUN_FAMILIES)
def test_a_run_steps_as_transformers_computes_and_two_processes_as_one(family_runs, name):
    """The first step's loss (the adapters start as the identity) is transformers' eager loss over the same 8
    tokenized rows; at 2 processes, with DDP or FSDP, the losses and gradient norms are those of one, and FSDP's
    saved adapter is one process's."""
    from ddptune.data import tokenized

    root, sources = family_runs
    cfg = config.load(str(config_path()), [f"model.source={sources[name]}", *RUN])
    train_set, _ = tokenized.load(tokenized.prepare(cfg.data, model_lib.load_tokenizer(cfg.model, cfg.data)))
    examples = [train_set[i] for i in range(len(train_set))]
    assert len(examples) == 8
    want = eager_loss(family_model(name), examples) / batches.target_tokens(examples)
    one, two, fsdp = (metrics(root / f"{name}-{n}") for n in (1, 2, "fsdp"))
    loss = lambda rows: [r["loss"] for r in rows if "loss" in r]  # noqa: E731
    norm = lambda rows: [r["grad_norm"] for r in rows if "grad_norm" in r]  # noqa: E731
    assert loss(one)[0] == pytest.approx(want, rel=1e-5)
    assert len(loss(one)) == 2 and loss(one)[1] != loss(one)[0]
    for other in (two, fsdp):
        assert loss(other) == pytest.approx(loss(one), rel=1e-5)
        assert norm(other) == pytest.approx(norm(one), rel=1e-4)
    saved = [load_file(root / f"{name}-{run}" / "adapter" / "adapter_model.safetensors") for run in ("fsdp", 1)]
    assert saved[0].keys() == saved[1].keys() and len(saved[0]) > 0
    for k in saved[1]:  # the whole adapter, every shard gathered, experts' adapters included (to 1 % of an
        # AdamW step at lr 1e-2: a gradient element near zero turns a sum's last bits into a step's; DDP's too)
        assert torch.allclose(saved[0][k], saved[1][k], atol=1e-4), k


# ---------------------------------------------------------------------------------------------
# what the speed choices and the plan make of an architecture


@pytest.mark.parametrize("name,dynamic", [("llama", False), ("gemma3", False), ("gemma2", True), ("gpt-oss", True),
                                          ("qwen3-moe", True)])
def test_layers_whose_work_changes_with_the_data_are_neither_compiled_nor_recorded(name, dynamic):
    """On a GPU the decider compiles and may record a dense model's layers (a sliding window included: the
    kernel takes it); a mixture's routing and per-sample own attention change shapes with the data, so it
    leaves those layers eager and unrecorded, and says why."""
    from test_speed import CONFIG_8B, samsum_like

    from ddptune import memory, speed

    shape = memory.shape_of(family_config(name))
    assert bool(shape.dynamic) == dynamic and shape.experts == (4 if "moe" in name or name == "gpt-oss" else 0)
    # the MLP width a token meets, what FLOPs and MFU count: a mixture's 2 experts a token, each of its width
    assert shape.intermediate == {"qwen3-moe": 2 * 32, "gpt-oss": 2 * 128}.get(name, 128)
    cfg = config.load(CONFIG_8B, ["train.method=lora"])
    chosen = speed.decide(cfg=cfg, cuda=True, shape=shape, world=1, free_gib=80.0, work=samsum_like(), card=card.REFERENCE,
                          link="")
    assert chosen.compiled == (not dynamic)
    if dynamic:
        assert chosen.graphs == "off" and all(o["graphs"] == "off" for o in chosen.estimate["options"])
        why = {"why": shape.dynamic}  # the reasons' codes, each with the cause memory.dynamic_reason names
        assert [chosen.reasons[k].as_dict() for k in ("compiled layers", "CUDA graphs")] == [
            {"code": "dynamic_layers", **why}, {"code": "unrecordable", **why}]
    forced = speed.decide(cfg=config.load(CONFIG_8B, ["train.method=lora", "train.compile=true"]), cuda=True, shape=shape,
                          world=1, free_gib=80.0, work=samsum_like(), card=card.REFERENCE, link="")
    assert forced.compiled  # the user's word stands


def test_plan_says_it_has_no_estimate_for_a_mixture_and_gives_one_otherwise(tmp_path, capsys):
    """`ddptune plan` of a saved mixture: no made-up number, exit 0, the JSON's estimate null; a dense family
    with head_dim apart from hidden/heads and an untied head gets its table."""
    import json
    import types

    from ddptune import plan

    for name in ("qwen3-moe", "qwen3"):
        source = saved_family(name, tmp_path / name)
        args = types.SimpleNamespace(config=str(config_path()), overrides=[f"model.source={source}"], gpus=1,
                                     gpu_memory=80.0, json=str(tmp_path / f"{name}.json"))
        assert plan.main(args) == 0
        written = json.loads((tmp_path / f"{name}.json").read_text())
        if name == "qwen3-moe":
            assert written["estimate"] is None and written["experts"] == 4
        else:
            assert written["options"][0]["total"] > 0 and written["params"] > 0


def test_the_banner_says_what_the_model_defines_and_how_it_trains():
    from ddptune import runlog

    assert runlog.architecture_lines(family_model("llama")) == []
    (gemma2,) = runlog.architecture_lines(family_model("gemma2"))
    assert "sliding window 8 on 2 of 4 layers" in gemma2 and "own attention" in gemma2 and "soft-cap" in gemma2
    (gemma3,) = runlog.architecture_lines(family_model("gemma3"))
    assert "own attention" not in gemma3 and "4 of 4 layers" in gemma3


# ---------------------------------------------------------------------------------------------
# the support table in CONFIG.md: what the tests here and in test_gpu.py prove, family by family

GPU_FAMILIES = ["llama", "mistral-window", "gemma2", "gemma3", "phi3", "qwen3-moe", "gpt-oss", "granite"]  # test_gpu.py
GPU_RUNS = list(FAMILIES)  # test_gpu.py: whole LoRA runs under the decider's choices
GPU_QLORA = list(FAMILIES)  # and QLoRA runs
PRESET_TESTED = {"llama"}  # the presets are Llama: FSDP, QLoRA, compiled layers and graphs are tested on them throughout


def support_rows() -> list[list[str]]:
    """Each family's row: Y where a test proves it, `eager` where the decider leaves the layers uncompiled and
    unrecorded (and says why), `refused` where the command refuses it in one line, `not tested` otherwise."""
    from ddptune import gguf_export, memory

    def y(proved: bool) -> str:
        return "Y" if proved else "not tested"

    out = []
    for name in FAMILIES:
        cfg = family_config(name)
        dynamic = bool(memory.shape_of(cfg).dynamic)
        speed = "eager" if dynamic else y(name in PRESET_TESTED or name in GPU_RUNS)  # test_gpu: compiled, whole step recorded
        gguf_ok = gguf_export.model_problem(cfg) is None
        two = name in RUN_FAMILIES or name in PRESET_TESTED  # here: DDP and FSDP at 2 gloo processes as one
        out.append([name, "Y", y(name in GPU_FAMILIES or name in GPU_RUNS), y(two), y(two),
                    y(name in PRESET_TESTED or name in GPU_QLORA), speed, speed,
                    y(name in GGUF_TESTED) if gguf_ok else "refused"])
    return out


GGUF_TESTED = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3-moe", "qwen3-moe-routed"}  # test_gguf_export: each reads back
# as llama.cpp reads it, with its logits
SUPPORT_HEAD = ["family", "trains exactly (fp32, CPU)", "bf16 on a GPU", "2 processes = 1", "FSDP", "QLoRA",
                "compiled layers", "CUDA graphs", "GGUF export"]


def support_markdown() -> str:
    rows = [SUPPORT_HEAD, ["---"] * len(SUPPORT_HEAD), *support_rows()]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n"


def test_the_support_table_in_config_md_is_what_the_tests_prove():
    """CONFIG.md's table between its markers is support_markdown() verbatim (regenerate: python -c "import sys;
    sys.path.insert(0, 'tests'); import test_architectures as t; print(t.support_markdown(), end='')")."""
    from conftest import ROOT

    text = (ROOT / "CONFIG.md").read_text()
    start, end = "<!-- support-table:start -->\n", "<!-- support-table:end -->"
    assert text[text.index(start) + len(start):text.index(end)] == support_markdown()


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in GGUF_TESTED])
def test_gguf_export_refuses_what_it_does_not_write_in_one_line(name):
    """A family the GGUF writer has no mapping for (its line lists those it has), or that a GGUF file would make
    llama.cpp compute otherwise (a window on llama, experts' weights not renormalized), is refused before anything
    is written (the table's `refused`)."""
    from conftest import words
    from ddptune import gguf_export

    cfg = family_config(name)
    problem = gguf_export.model_problem(cfg)
    assert problem is not None and problem.startswith("model: ") and "\n" not in problem
    if cfg.model_type not in gguf_export.ARCHES:
        assert {cfg.model_type, *gguf_export.ARCHES} <= words(problem), problem


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss", "phi3"])
def test_a_saved_adapter_loads_again_and_its_merged_export_reloads_to_the_same_logits(name, tmp_path):
    """What predict and `export --merge` do with a run's adapter, experts' adapters included: saved, loaded onto the
    saved base again (model_lib.load_trained), merged, saved as a plain model and read back by transformers."""
    from ddptune.config import ModelConfig

    family_model(name).save_pretrained(tmp_path / "base")
    model_lib.byte_tokenizer().save_pretrained(tmp_path / "base")
    net = model_lib.add_adapters(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32), "lora",
                                 LoraConfig(r=4), False)
    ids, want = adapted_logits(net)
    (tmp_path / "run").mkdir()
    model_lib.save_trained(net, tmp_path / "run" / "adapter")
    again = model_lib.load_trained(tmp_path / "run", ModelConfig(source=str(tmp_path / "base")),
                                   "lora", torch.device("cpu"), "fp32", 0).eval()
    with torch.no_grad():
        assert (again(input_ids=ids).logits - want).abs().max() < 1e-5 * want.abs().max()
        again.merge_and_unload().save_pretrained(tmp_path / "merged")
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        assert (merged(input_ids=ids).logits - want).abs().max() < 1e-4 * want.abs().max()


@pytest.mark.parametrize("name", ["gemma2", "gpt-oss", "mistral-window"])
def test_generation_through_varlen_attention_is_transformers_own(name):
    """Evaluation and predict generate through the same attention (a padded batch, then one token at a time
    against the cache): two prompts of unequal length, greedy, the tokens eager attention gives."""
    model = family_model(name)
    model.generation_config.pad_token_id = SHAPE["pad_token_id"]
    prompts = [e["input_ids"] for e in rows(2)]
    width = max(map(len, prompts))
    ids = torch.tensor([[SHAPE["pad_token_id"]] * (width - len(p)) + p for p in prompts])  # left-padded, as generation pads
    mask = (ids != SHAPE["pad_token_id"]).long()
    greedy = dict(max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, **greedy)
        got = with_attention(model, "varlen").generate(input_ids=ids, attention_mask=mask, **greedy)
    assert torch.equal(got, want)


def _run_as_if_unread(args: list[str]) -> str:
    """A run whose model config could not be read before launch (a hub model's): what stops it, by field."""
    from ddptune.config import ConfigError

    model_lib.model_config = lambda *a, **k: None
    try:
        family_run(args)
    except ConfigError as e:
        return ";".join(p.split(":")[0] for p in e.problems)
    return ""


def test_a_model_known_only_once_loaded_is_still_refused_before_any_step(tmp_path):
    """A hub model's or an unconverted GGUF file's architecture is read when the model loads: a set dropout
    with a mixture's experts adapted stops the run there, with the field, before any adapter or step."""
    source = saved_family("qwen3-moe", tmp_path / "moe")
    args = [f"model.source={source}", f"output_dir={tmp_path / 'run'}", *RUN, "lora.dropout=0.1"]
    assert multiproc.run(_run_as_if_unread, 1, args) == ["lora.dropout"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
