"""Families side by side: tokens/s and MFU of small random models of several architectures, one shape.

Each family's model is built from its transformers config class with the same width, depth and heads (a
mixture's experts a token times each expert's width equal to the dense MLP's width, so a token meets the
same matrix work), random weights, SmolLM2's tokenizer, saved to a folder, and trained by `ddptune train
configs/demo.yaml` with only the data, the model, the steps and evaluation overridden (the command is in
the results): the speed decider chooses as it would for a user, and the banner's choices are recorded.
MFU is ddptune's (metrics.FlopModel: model FLOPs of the matrices a token meets, the head at the loss
targets, causal attention without windows) over the datasheet's dense bf16 rate.

    python benchmarks/families.py --tokenizer .tok/smollm2 --data .devdata/samsum_validation.json \
        --name h100_families_small --steps 60
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from ddptune import provenance  # noqa: E402

T = transformers
SHAPE = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             max_position_embeddings=4096, tie_word_embeddings=False)
DENSE = 2816
FAMILIES = {
    "llama": (T.LlamaConfig, {"intermediate_size": DENSE}),
    "gemma3": (T.Gemma3TextConfig, {"intermediate_size": DENSE, "sliding_window": 512, "query_pre_attn_scalar": 64}),
    "qwen3-moe": (T.Qwen3MoeConfig, {"intermediate_size": DENSE, "num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": DENSE // 2}),
    "gpt-oss": (T.GptOssConfig, {"intermediate_size": DENSE // 2, "num_local_experts": 8, "num_experts_per_tok": 2,
                                 "sliding_window": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
}


def build(name: str, tokenizer: str, folder: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer)
    cls, extra = FAMILIES[name]
    cfg = cls(**SHAPE, **extra, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--work", default="/tmp/families")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args()
    work, out = Path(a.work), {"command": sys.argv, "date": time.strftime("%Y-%m-%d"),
                               "commit": provenance.commit(), "device": torch.cuda.get_device_name(0), "runs": {}}
    for name in a.families.split(","):
        folder = work / f"{name}-model"
        if not (folder / "config.json").exists():
            build(name, a.tokenizer, folder)
        args = [sys.executable, "-m", "ddptune", "train", str(ROOT / "configs" / "demo.yaml"), f"model.source={folder}", f"data.train={a.data}",
                "data.train_rows=null", "data.val=null", "eval.enabled=false", f"train.max_steps={a.steps}",
                f"output_dir={work / name}", "--overwrite"]
        began = time.perf_counter()
        proc = subprocess.run(args, capture_output=True, text=True)
        wall = time.perf_counter() - began
        banner = [l for l in proc.stdout.splitlines() + proc.stderr.splitlines() if l.startswith("ddptune: ")]
        run = {"args": args[3:], "rc": proc.returncode, "wall_s": wall, "banner": banner}
        if proc.returncode == 0:
            summary = json.loads((work / name / "summary.json").read_text())
            run.update({k: summary.get(k) for k in ("tokens_per_s_per_gpu", "mfu", "median_step_time_s", "compiled",
                                                     "cuda_graphs", "final_loss", "peak_memory_gib", "mfu_denominator_tflops")})
        else:
            run["stderr_tail"] = proc.stderr[-2000:]
        out["runs"][name] = run
        print(name, {k: v for k, v in run.items() if k not in ("banner", "args", "stderr_tail")}, flush=True)
        Path(a.results).mkdir(parents=True, exist_ok=True)
        (Path(a.results) / f"{a.name}.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
