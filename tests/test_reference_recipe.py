"""CPU smoke test of the tutorial's recipe (`benchmarks/speed.py recipe`) on a tiny random Llama (no network)."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "speed.py"

NAMES = ["Anna", "Ben", "Carl", "Dora", "Eve", "Finn"]
VERBS = ["meet", "call", "cook", "read", "walk", "shop"]
PLACES = ["park", "office", "cafe", "gym", "station", "library"]

KEYS = ["tool", "method", "world_size", "per_device_batch", "grad_accum", "samples_per_step", "steps",
        "warmup_steps_excluded", "median_step_time_s", "real_tokens_per_step", "padded_tokens_per_step",
        "padding_fraction", "real_tok_s", "real_tok_s_per_gpu", "peak_mem_gib", "peak_reserved_gib",
        "step_times_s", "real_tokens", "padded_tokens", "losses", "grad_norms", "final_loss", "load_time_s",
        "train_time_s", "device", "versions"]


def make_rows(n=20):
    rows = []
    for i in range(n):
        a, b = NAMES[i % 6], NAMES[(i + 1) % 6]
        v, p = VERBS[i % 6], PLACES[(i * 5) % 6]
        turns = [f"{a}: Shall we {v} at the {p} today ?", f"{b}: Yes , let us {v} at the {p} ."]
        turns += [f"{a}: Great , see you at the {p} ."] * (i % 4)  # varying lengths -> padding
        rows.append({"id": str(i), "dialogue": "\n".join(turns),
                     "summary": f"{a} and {b} will {v} at the {p} today ."})
    return rows


def make_tokenizer(rows):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = [r["dialogue"] + " " + r["summary"] for r in rows]
    texts.append("Summarize the following dialogue. ### Dialogue: Summary: user assistant")
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    assert len(fast) < 512
    return fast


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("ref_recipe")
    rows = make_rows()
    data = tmp / "samsum.json"
    data.write_text(json.dumps(rows))
    model_dir = tmp / "tiny-llama"
    tokenizer = make_tokenizer(rows)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return tmp, model_dir, data, tokenizer


def load_script_module():
    spec = importlib.util.spec_from_file_location("speed_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_encode_masks_prompt(tiny_setup):
    _, _, _, tok = tiny_setup
    rr = load_script_module()
    ex = rr.encode_example(tok, "Anna: Shall we meet ?", "Anna will meet .", 512)
    assert len(ex["input_ids"]) == len(ex["labels"]) == len(ex["attention_mask"])
    supervised = [t for t in ex["labels"] if t != -100]
    assert tok.decode(supervised) == "Anna will meet . </s>"
    assert ex["input_ids"][0] == tok.bos_token_id and ex["labels"][0] == -100
    # truncation keeps lengths consistent
    short = rr.encode_example(tok, "Anna: Shall we meet ?", "Anna will meet .", 8)
    assert len(short["input_ids"]) == len(short["labels"]) == 8 and set(short["labels"]) == {-100}

    # chat-template path: loss only on the assistant turn
    tok.chat_template = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
                         "{% if add_generation_prompt %}<s> assistant : {% endif %}")
    try:
        ex = rr.encode_example(tok, "Anna: Shall we meet ?", "Anna will meet .", 512)
    finally:
        tok.chat_template = None
    assert tok.decode([t for t in ex["labels"] if t != -100]) == "Anna will meet . </s>"


def test_reference_recipe_cpu_lora(tiny_setup):
    tmp, model_dir, data, _ = tiny_setup
    out = tmp / "ref.json"
    cmd = [sys.executable, str(SCRIPT), "recipe", "--model-dir", str(model_dir), "--data", str(data),
           "--out", str(out), "--method", "lora", "--max-steps", "3", "--per-device-batch", "2",
           "--grad-accum", "2", "--warmup-steps-excluded", "1"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    s = json.loads(out.read_text())
    assert set(KEYS) <= set(s), set(KEYS) - set(s)
    assert s["tool"] == "reference_recipe" and s["method"] == "lora" and s["device"] == "cpu"
    assert s["world_size"] == 1 and s["samples_per_step"] == 4 and s["steps"] == 3
    assert s["warmup_steps_excluded"] == 1
    assert len(s["losses"]) == 3 and all(math.isfinite(x) for x in s["losses"])
    assert len(s["grad_norms"]) == 3 and all(math.isfinite(g) for g in s["grad_norms"])
    assert len(s["step_times_s"]) == len(s["real_tokens"]) == len(s["padded_tokens"]) == 3  # every step's, for ratios over any window
    assert 0 <= s["padding_fraction"] < 1
    assert s["real_tok_s"] > 0 and s["median_step_time_s"] > 0
    assert 0 < s["real_tokens_per_step"] <= s["padded_tokens_per_step"]
    assert s["final_loss"] == s["losses"][-1]
    assert set(s["versions"]) == {"torch", "transformers", "peft", "accelerate", "bitsandbytes"}
