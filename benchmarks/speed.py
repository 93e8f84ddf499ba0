"""Speed benchmark: the tutorial's recipe against ddptune on the same GPU, model shape, data and optimization.

One run does, in order:
  1. the GPU's bf16 matrix rate (the MFU denominator), measured on random data;
  2. the reference recipe (HF Trainer + accelerate launch + PEFT + bitsandbytes QLoRA, gradient
     checkpointing, dynamic padding: `recipe` below), unless --skip-reference; with
     --reference-best also the recipe with its own best switches (no checkpointing, cuDNN attention off);
  3. the ddptune runs named by --runs (RUNS below) and --run: the same job (same samples per optimizer
     step, learning rate, LoRA, 4-bit base, optimizer) as configs/samsum_qlora_llama31_8b.yaml ships it,
     the speed decider choosing how it runs (src/ddptune/speed.py); the same with gradient checkpointing
     forced on; bf16 LoRA (no quantization) for MFU. An override such as `env:DDPTUNE_SPEED=graphs=off`
     forces the decider's choices.
It writes benchmarks/results/<name>.json (--results: another folder; raw figures of every run, every step's time
and tokens on both sides, and the commit, date, command line and device) and prints the headline figures.
An 8B run of all three plus the reference takes over 10 minutes: split it with --runs if that is too long.

    python benchmarks/speed.py --name h200_llama31_8b_qlora_v2 --preset llama-3.1-8b \
        --tokenizer .tok/smollm2 --data .devdata/samsum_validation.json --steps 25 --warmup 5 --runs ddptune,ddptune_gc

--epoch times the tutorial's whole job end to end instead: its 14,732 SAMSum training dialogues in one
epoch are 921 steps of 16 samples, so every ddptune run trains train.max_steps=921 on the --rows given
(the 818 rows of the SAMSum validation file: the sample stream runs on through 18 passes over them,
14,736 samples), and `epoch` records each command's wall time, Python's start, loading and compiling
included. The recipe still runs --steps steps: its epoch is extrapolated, its measured command's wall
time plus its median step for each of the remaining steps, and recorded as an extrapolation. The 8B
job takes about 8 minutes on an H200 with the recipe at --steps 30:

    python benchmarks/speed.py --epoch --name h200_llama31_8b_qlora_epoch --preset llama-3.1-8b \
        --tokenizer .tok/smollm2 --data .devdata/samsum_validation.json --steps 30 --warmup 5 --runs "" --run shipped=

Every ddptune run is the shipped config's program: the speed decider's choices do not depend on how
many steps a run takes, so --steps of a run time the program of the whole epoch. Several `env:` values for one variable
are joined with commas: `--run plain=env:DDPTUNE_SPEED=graphs=off,env:DDPTUNE_SPEED=combo=false`.

`families` trains small random models of several architectures at one shape (Llama, Gemma 3, Qwen3-MoE,
GPT-OSS; a mixture's experts a token times each expert's width equal the dense MLP's width, so a token meets the
same matrix work), each built from its transformers config class with SmolLM2's tokenizer and trained by
`ddptune train configs/demo.yaml` with only the data, the model, the steps and evaluation overridden: the speed
decider chooses as it would for a user, and the banner's choices are recorded. MFU is ddptune's over the
datasheet's dense bf16 rate:

    python benchmarks/speed.py families --tokenizer .tok/smollm2 --data .devdata/samsum_validation.json \
        --name h100_families_small --steps 60

`recipe` runs the tutorial's recipe alone, the way the comparison above runs it: HF Trainer + Accelerate +
PEFT (QLoRA through bitsandbytes), gradient checkpointing, dynamic padding (DataCollatorForSeq2Seq), no
packing; none of ddptune's training code runs (only ddptune.provenance, which names the commit). It
writes one JSON summary (rank 0) with every optimizer step's time and tokens:

    accelerate launch --num_processes N benchmarks/speed.py recipe --model-dir DIR --data samsum.json --out ref.json
    python benchmarks/speed.py recipe --method lora ...   # CPU smoke test (fp32)
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddptune import provenance

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "samsum_qlora_llama31_8b.yaml"
TUTORIAL_SAMPLES = 14_732  # SAMSum's training dialogues: the tutorial trains one epoch of them
INSTRUCTION = "Summarize the following dialogue."


def epoch_steps(samples: int = TUTORIAL_SAMPLES, per_step: int = 16) -> int:
    """Optimizer steps of one epoch of `samples` at `per_step` samples a step (4 a forward x 4 accumulated),
    the last one full: the tutorial's epoch is 921."""
    return math.ceil(samples / per_step)


EPOCH_STEPS = epoch_steps()


def sh(cmd: list[str], log: Path, env: dict | None = None) -> float:
    """Run a command, tee its output to `log`; return wall seconds. Raises on failure."""
    print("$", " ".join(cmd), *(f"({k}={v})" for k, v in (env or {}).items()), flush=True)
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ, **(env or {})))
    if proc.returncode:
        print(log.read_text()[-6000:])
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}")
    return time.perf_counter() - t


def matmul_tflops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def recipe_args(argv=None):
    """The recipe's command line (`speed.py recipe --help`)."""
    p = argparse.ArgumentParser(prog="speed.py recipe", description="the tutorial's recipe alone (module docstring)")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--tokenizer-dir", default=None, help="default: --model-dir")
    p.add_argument("--data", required=True, help="JSON list of {dialogue, summary} rows (SAMSum)")
    p.add_argument("--out", required=True, help="summary JSON (written by rank 0)")
    p.add_argument("--method", choices=["qlora", "lora"], default="qlora")
    p.add_argument("--rows", type=int, default=None, help="use only the first N rows")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--per-device-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--warmup-steps", type=float, default=0.03,
                   help="LR warmup; a value < 1 is a ratio of max steps (tutorial: 0.03)")
    p.add_argument("--warmup-steps-excluded", type=int, default=5,
                   help="first N optimizer steps excluded from the timing statistics")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--no-cudnn-attention", action="store_true",
                   help="turn torch's cuDNN attention off (it builds a plan for every new sequence length)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data
def encode_example(tokenizer, dialogue, summary, max_length):
    """Token ids + labels (-100 on the prompt, loss on the summary only), truncated."""
    if getattr(tokenizer, "chat_template", None):
        user = {"role": "user", "content": f"{INSTRUCTION}\n\n{dialogue}"}
        prompt = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template([user, {"role": "assistant", "content": summary}], tokenize=False)
        special = False  # the template already carries BOS etc.
    else:
        prompt = f"{INSTRUCTION}\n\n### Dialogue:\n{dialogue}\n\n### Summary:\n"
        full = f"{prompt}{summary}{tokenizer.eos_token}"
        special = True
    ids = tokenizer(full, add_special_tokens=special)["input_ids"][:max_length]
    n_prompt = min(len(tokenizer(prompt, add_special_tokens=special)["input_ids"]), len(ids))
    labels = [-100] * n_prompt + ids[n_prompt:]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def build_dataset(tokenizer, path, rows, max_length, samples_needed):
    """The recipe's examples from a JSON list of SAMSum rows (the first `rows`), repeated to `samples_needed`."""
    with open(path) as f:
        data = json.load(f)
    data = data[:rows] if rows else data
    if not data:
        raise SystemExit(f"no rows in {path}")
    encoded = [encode_example(tokenizer, r["dialogue"], r["summary"], max_length) for r in data]
    reps = max(1, math.ceil(samples_needed / len(encoded)))
    return encoded * reps  # a list of dicts is a valid map-style dataset


# ----------------------------------------------------------------------------- measurement
def recipe_trainer():
    """(StepMeter, MeteredTrainer): a callback timing every optimizer step (wall time, tokens real and
    padded on this rank, loss, grad norm) and the stock Trainer counting each micro-batch's tokens for it
    (the loss math untouched). Made on call: transformers is imported only where the recipe runs."""
    import torch
    from transformers import Trainer, TrainerCallback

    class StepMeter(TrainerCallback):
        def __init__(self):
            self.cuda = torch.cuda.is_available()
            self.times, self.real, self.padded, self.losses, self.grad_norms = [], [], [], [], []
            self._real = 0  # running (device tensor) count for the current optimizer step
            self._padded = 0
            self._t = None

        def count(self, inputs):  # called for every micro-batch by MeteredTrainer
            mask = inputs["attention_mask"]
            self._real = self._real + mask.sum()
            self._padded += mask.numel()

        def _now(self):
            if self.cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kw):
            self._t = self._now()

        def on_step_end(self, args, state, control, **kw):
            # step_end -> step_end: includes data loading and the previous step's logging
            t = self._now()
            self.times.append(t - self._t)
            self._t = t
            self.real.append(int(self._real))
            self.padded.append(self._padded)
            self._real, self._padded = 0, 0

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
                if "grad_norm" in logs:
                    self.grad_norms.append(float(logs["grad_norm"]))

    class MeteredTrainer(Trainer):
        def __init__(self, *a, meter, **kw):
            super().__init__(*a, **kw)
            self.meter = meter

        def training_step(self, model, inputs, *a, **kw):
            self.meter.count(inputs)
            return super().training_step(model, inputs, *a, **kw)

    return StepMeter, MeteredTrainer


def reduce_list(values, op, device, dtype=None):
    """all_reduce ("SUM"/"MAX") a per-step list across ranks (no-op single-process)."""
    import torch

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=dtype or torch.float64, device=device)
    torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op))
    return t.tolist()


def versions():
    """The recipe's packages and their versions."""
    out = {}
    for pkg in ("torch", "transformers", "peft", "accelerate", "bitsandbytes"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


# ----------------------------------------------------------------------------- main
def load_model(args, cuda, local_rank):
    """The recipe's model: the base (4-bit NF4 with double quantization for qlora) with LoRA on every linear layer."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    gc = not args.no_gradient_checkpointing
    gc_kwargs = {"use_reentrant": False}
    kw = {"attn_implementation": "sdpa"}
    if cuda:
        kw.update(dtype=torch.bfloat16, device_map={"": local_rank})
    else:
        kw.update(dtype=torch.float32)
    if args.method == "qlora":
        if not cuda:
            raise SystemExit("--method qlora needs CUDA (bitsandbytes 4-bit); use --method lora on CPU")
        from transformers import BitsAndBytesConfig
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, **kw)
    model.config.use_cache = False
    if args.method == "qlora":
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gc, gradient_checkpointing_kwargs=gc_kwargs)
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def recipe(argv=None):
    """The recipe's run (`speed.py recipe`): trains, then writes its summary JSON from rank 0 and returns it."""
    import torch
    from accelerate import PartialState
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, TrainingArguments

    args = recipe_args(argv)
    state = PartialState()
    cuda = torch.cuda.is_available()
    if cuda and args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    world, rank = state.num_processes, state.process_index
    is_main = state.is_main_process

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir or args.model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"

    samples_per_step = args.per_device_batch * args.grad_accum * world
    dataset = build_dataset(tokenizer, args.data, args.rows, args.max_length, samples_per_step * args.max_steps)

    t0 = time.perf_counter()
    model = load_model(args, cuda, state.local_process_index)
    load_time = time.perf_counter() - t0
    if is_main:
        model.print_trainable_parameters()

    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="reference_recipe_"),
        per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        bf16=cuda,
        use_cpu=not cuda,
        optim="paged_adamw_8bit" if cuda else "adamw_torch",
        gradient_checkpointing=not args.no_gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        max_steps=args.max_steps,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps,  # transformers 5: float < 1 == ratio (old warmup_ratio)
        max_grad_norm=args.max_grad_norm,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        ddp_find_unused_parameters=False,
        seed=args.seed,
        data_seed=args.seed,
        remove_unused_columns=False,
        label_names=["labels"],
    )
    StepMeter, MeteredTrainer = recipe_trainer()
    meter = StepMeter()
    trainer = MeteredTrainer(
        model=model, args=targs, train_dataset=dataset, processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
        callbacks=[meter], meter=meter)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    if cuda:
        torch.cuda.synchronize()
    train_time = time.perf_counter() - t0

    # ---- aggregate across ranks: tokens summed, times/memory max
    dev = targs.device
    times = reduce_list(meter.times, "MAX", dev)
    real = reduce_list(meter.real, "SUM", dev)
    padded = reduce_list(meter.padded, "SUM", dev)
    peak = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()] if cuda else [0, 0]
    peak = reduce_list(peak, "MAX", dev)

    skip = args.warmup_steps_excluded if len(times) > args.warmup_steps_excluded else 0
    m_times, m_real, m_padded = times[skip:], real[skip:], padded[skip:]
    n = max(len(m_times), 1)
    summary = {
        "tool": "reference_recipe",
        "method": args.method,
        "world_size": world,
        "per_device_batch": args.per_device_batch,
        "grad_accum": args.grad_accum,
        "samples_per_step": samples_per_step,
        "steps": len(times),
        "warmup_steps_excluded": skip,
        "median_step_time_s": statistics.median(m_times) if m_times else None,
        "real_tokens_per_step": sum(m_real) / n,
        "padded_tokens_per_step": sum(m_padded) / n,
        "padding_fraction": 1.0 - sum(m_real) / sum(m_padded) if sum(m_padded) else None,
        "real_tok_s": sum(m_real) / sum(m_times) if sum(m_times) else None,
        "real_tok_s_per_gpu": sum(m_real) / sum(m_times) / world if sum(m_times) else None,
        "peak_mem_gib": peak[0] / 2**30,
        "peak_reserved_gib": peak[1] / 2**30,
        "step_times_s": times,  # every optimizer step's, the excluded ones first
        "real_tokens": [int(x) for x in real],
        "padded_tokens": [int(x) for x in padded],
        "losses": meter.losses,
        "grad_norms": meter.grad_norms,
        "final_loss": meter.losses[-1] if meter.losses else None,
        "load_time_s": load_time,
        "train_time_s": train_time,
        "device": torch.cuda.get_device_name(state.local_process_index) if cuda else "cpu",
        "versions": versions(),
    }
    if is_main:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
        s = summary
        print(f"[reference_recipe] {s['method']} x{world} on {s['device']}: {s['steps']} steps, "
              f"median step {s['median_step_time_s']:.3f}s, {s['real_tok_s']:.0f} real tok/s "
              f"({s['real_tok_s_per_gpu']:.0f}/gpu), padding {s['padding_fraction']:.1%}, "
              f"peak {s['peak_mem_gib']:.2f} GiB, final loss {s['final_loss']} -> {args.out}")
    state.wait_for_everyone()
    return summary


# ddptune's runs: the recipe's job as the config ships it (packing; the speed decider keeps gradient
# checkpointing off where the run fits without it), the same with gradient checkpointing forced on
# (the recipe's memory class), and bf16 LoRA without quantization (the MFU target), 64 samples per step.
RUNS = {
    "ddptune": ["train.gradient_checkpointing=auto", "train.packing=true"],
    "ddptune_gc": ["train.gradient_checkpointing=true", "train.packing=true"],
    "ddptune_lora_bf16": ["train.gradient_checkpointing=auto", "train.packing=true", "train.method=lora",
                          "train.grad_accum=16"],
}


def steps_of(args) -> int:
    """Steps of each ddptune run: the epoch's (--epoch-steps), --ddptune-steps, or the recipe's --steps."""
    return getattr(args, "epoch_steps", EPOCH_STEPS) if args.epoch else args.ddptune_steps or args.steps


def ddptune_run(args, name: str, overrides: list[str], work: Path) -> dict:
    """One `ddptune train` of the shipped config on the benchmark's data; an override `env:NAME=VALUE`
    sets an environment variable for the run instead (DDPTUNE_SPEED forces speed choices); the values
    of several for one NAME are joined with commas (`env:DDPTUNE_SPEED=graphs=off,env:DDPTUNE_SPEED=combo=false`)."""
    out = work / name
    env: dict[str, str] = {}
    for o in overrides:
        if o.startswith("env:"):
            key, value = o[4:].split("=", 1)
            env[key] = f"{env[key]},{value}" if key in env else value
    overrides = [o for o in overrides if not o.startswith("env:")]
    cmd = [sys.executable, "-m", "ddptune", "train", str(CONFIG), f"output_dir={out}",
           f"model.source=preset:{args.preset}", f"model.tokenizer={args.tokenizer}", f"data.train={args.data}",
           f"data.train_rows={args.rows}", "data.val=null", f"train.max_steps={steps_of(args)}",
           f"train.warmup_steps={args.lr_warmup}", f"train.method={args.method}", *args.override, *overrides, "--nproc", "1"]
    wall = sh(cmd, work / f"{name}.log", env)
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    measured = rows[args.warmup:]
    real = sum(r["tokens"] for r in measured)
    padded = sum(r["padded_tokens"] for r in measured)
    return {
        "tool": "ddptune", "overrides": overrides, "wall_s": wall,
        "median_step_time_s": statistics.median(r["step_time_s"] for r in measured),
        "median_host_s": statistics.median(r["host_s"] for r in measured),
        "real_tok_s_per_gpu": real / sum(r["step_time_s"] for r in measured),
        "padding_fraction": 1 - real / padded,
        "peak_mem_gib": summary["peak_mem_gib"], "mfu": summary["mfu"],
        "mfu_denominator_tflops": summary.get("mfu_denominator_tflops"), "speed": summary.get("speed"),
        "padded_lengths": summary.get("padded_lengths"), "wall_time_s": summary.get("wall_time_s"),
        "train_time_s": summary.get("train_time_s"), "steps": len(rows),
        "gradient_checkpointing": summary["gradient_checkpointing"], "compiled": summary.get("compiled"),
        "losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows],
        "step_times_s": [r["step_time_s"] for r in rows], "tokens": [r["tokens"] for r in rows],  # every step's
        "padded_tokens": [r["padded_tokens"] for r in rows], "host_s": [r["host_s"] for r in rows],
        "final_loss": rows[-1]["loss"], "load_time_s": summary["load_time_s"],
        "samples_per_step": summary["global_batch"],
    }


def epoch(result: dict, runs: list[str], references: list[str], steps: int = EPOCH_STEPS) -> dict:
    """The tutorial's epoch of `steps` steps end to end: each ddptune run's measured wall time (it trained
    every step), and each recipe run's extrapolated from its shorter run: its wall time plus its median
    step for each step it did not run."""
    out = {"steps": steps, "tutorial_samples": TUTORIAL_SAMPLES, "runs": {}}
    for name in runs:
        r = result[name]
        out["runs"][name] = {"wall_s": r["wall_s"], "extrapolated": False, "samples": steps * r["samples_per_step"],
                             "load_time_s": r["load_time_s"], "train_time_s": r["train_time_s"],
                             "median_step_time_s": r["median_step_time_s"]}
    for key in references:
        r = result[key]
        missing = steps - r["steps"]
        out["runs"][key] = {"wall_s": r["wall_s"] + missing * r["median_step_time_s"], "extrapolated": True,
                            "how": f"measured wall time of {r['steps']} steps + {missing} x the median step",
                            "measured_steps": r["steps"], "measured_wall_s": r["wall_s"],
                            "median_step_time_s": r["median_step_time_s"], "samples": steps * r["samples_per_step"]}
    if "reference" in out["runs"]:
        for name in runs:
            out["runs"][name]["against_reference"] = out["runs"]["reference"]["wall_s"] / out["runs"][name]["wall_s"]
    return out


# ---------------------------------------------------------------------------------------------
# `families`: small random models of several architectures, one shape, side by side

FAMILY_SHAPE = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                    max_position_embeddings=4096, tie_word_embeddings=False)
DENSE = 2816
FAMILIES = {  # transformers' config class, and the family's own keys beside FAMILY_SHAPE
    "llama": ("LlamaConfig", {"intermediate_size": DENSE}),
    "gemma3": ("Gemma3TextConfig", {"intermediate_size": DENSE, "sliding_window": 512, "query_pre_attn_scalar": 64}),
    "qwen3-moe": ("Qwen3MoeConfig", {"intermediate_size": DENSE, "num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": DENSE // 2}),
    "gpt-oss": ("GptOssConfig", {"intermediate_size": DENSE // 2, "num_local_experts": 8, "num_experts_per_tok": 2,
                                 "sliding_window": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
}


def build_family(name: str, tokenizer: str, folder: Path) -> None:
    """Family `name`'s model at FAMILY_SHAPE, random bf16 weights, saved to `folder` with the tokenizer."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    cls, extra = FAMILIES[name]
    cfg = getattr(transformers, cls)(**FAMILY_SHAPE, **extra, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)


def families(argv: list[str]) -> int:
    """`families ...` (the module docstring): each family's model trained by `ddptune train configs/demo.yaml`
    with only the data, the model, the steps and evaluation overridden; the banner's choices recorded."""
    import torch

    p = argparse.ArgumentParser(prog="speed.py families")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--work", default="/tmp/families")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args(argv)
    work, out = Path(a.work), {"command": sys.argv, "date": time.strftime("%Y-%m-%d"),
                               "commit": provenance.commit(), "device": torch.cuda.get_device_name(0), "runs": {}}
    for name in a.families.split(","):
        folder = work / f"{name}-model"
        if not (folder / "config.json").exists():
            build_family(name, a.tokenizer, folder)
        args = [sys.executable, "-m", "ddptune", "train", str(ROOT / "configs" / "demo.yaml"), f"model.source={folder}",
                f"data.train={a.data}", "data.train_rows=null", "data.val=null", "eval.enabled=false",
                f"train.max_steps={a.steps}", f"output_dir={work / name}", "--overwrite"]
        began = time.perf_counter()
        proc = subprocess.run(args, capture_output=True, text=True)
        run = {"args": args[3:], "rc": proc.returncode, "wall_s": time.perf_counter() - began,
               "banner": [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if line.startswith("ddptune: ")]}
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


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring): `recipe ...` runs the recipe alone, `families ...` the families side
    by side, anything else the comparison."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["recipe"]:
        recipe(argv[1:])
        return 0
    if argv[:1] == ["families"]:
        return families(argv[1:])
    p = argparse.ArgumentParser()
    p.add_argument("--name", required=True)
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--rows", default="0:818")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ddptune-steps", type=int, help="steps of each ddptune run, when not --steps: its median over more "
                   "steps than the recipe's (ddptune's are about 15x shorter)")
    p.add_argument("--warmup", type=int, default=5, help="optimizer steps left out of speed figures")
    p.add_argument("--lr-warmup", type=int, default=1)
    p.add_argument("--method", choices=["qlora", "lora"], default="qlora", help="lora: for a CPU smoke test")
    p.add_argument("--override", action="append", default=[], help="extra key=value for every ddptune run")
    p.add_argument("--skip-reference", action="store_true")
    p.add_argument("--reference-best", action="store_true", help="also the recipe without checkpointing, cuDNN attention off")
    p.add_argument("--runs", default="ddptune,ddptune_gc,ddptune_lora_bf16",
                   help=f"comma-separated ddptune runs, of: {', '.join(RUNS)}")
    p.add_argument("--run", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                   help="a run of its own: NAME=section.key=value,section.key=value (repeatable; after --runs)")
    p.add_argument("--epoch", action="store_true",
                   help=f"ddptune runs train the tutorial's epoch, {EPOCH_STEPS} steps, timed end to end; the recipe's is extrapolated")
    p.add_argument("--epoch-steps", type=int, default=EPOCH_STEPS, help="the epoch's steps (a shorter one for a smoke test)")
    p.add_argument("--commit", help="this checkout's commit, where the machine's copy does not carry its history")
    p.add_argument("--work", default="/tmp/ddptune-bench", help="the compiler and preset cache, and a new folder of this call's runs")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="the folder <name>.json goes to")
    args = p.parse_args(argv)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DDPTUNE_CACHE", str(Path(args.work) / "cache"))
    # this call's runs and logs in a folder of their own: a run's output_dir from an earlier call on the same
    # machine would be refused (it holds a run), and nothing here deletes one
    work = Path(tempfile.mkdtemp(prefix=f"{args.name}-", dir=args.work))

    from ddptune import model as model_lib

    result = {"name": args.name, **provenance.record(args.commit, __file__, argv), "preset": args.preset, "steps": args.steps, "warmup_steps_excluded": args.warmup,
              "ddptune_steps": steps_of(args), "runs_folder": str(work)}
    result["matmul_tflops_bf16"] = matmul_tflops()  # the second MFU column's denominator (ddptune's is the datasheet's)
    t = time.perf_counter()
    folder = model_lib.preset_folder(args.preset, 0)
    result["preset_save_s"] = time.perf_counter() - t

    variants = {"reference": []} if not args.skip_reference else {}
    if args.reference_best:  # the recipe with its own best switches: no checkpointing, cuDNN attention off
        variants["reference_best"] = ["--no-gradient-checkpointing", "--no-cudnn-attention"]
    for key, extra in variants.items():
        ref_json = work / f"{key}.json"
        wall = sh(["accelerate", "launch", "--num_processes", "1", "--mixed_precision", "bf16",
            str(Path(__file__).resolve()), "recipe", "--model-dir", str(folder), "--tokenizer-dir", args.tokenizer,
            "--data", args.data, "--method", args.method, "--max-steps", str(args.steps), "--warmup-steps-excluded", str(args.warmup),
            "--out", str(ref_json), *extra], work / f"{key}.log")
        result[key] = dict(json.loads(ref_json.read_text()), wall_s=wall)
        if os.environ.get("OUT"):  # what is measured so far, should a later run not finish in time
            Path(os.environ["OUT"], f"{args.name}.json").write_text(json.dumps(result, indent=2))

    out = Path(args.results) / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    named = [(n, RUNS[n]) for n in args.runs.split(",") if n]
    named += [(spec.split("=", 1)[0], [o for o in spec.split("=", 1)[1].split(",") if o]) for spec in args.run]
    for name, overrides in named:
        result[name] = ddptune_run(args, name, overrides, work)
        if os.environ.get("OUT"):  # what is measured so far, should a later run not finish in time
            Path(os.environ["OUT"], out.name).write_text(json.dumps(result, indent=2))

    if args.epoch:
        result["epoch"] = epoch(result, [n for n, _ in named], list(variants), args.epoch_steps)
    d = result.get("ddptune")
    if d:
        result.update({"ddptune_tok_s": d["real_tok_s_per_gpu"], "mfu": d["mfu"], "peak_mem_gib": d["peak_mem_gib"]})
    if "ddptune_lora_bf16" in result:
        result["mfu_lora_bf16"] = result["ddptune_lora_bf16"]["mfu"]
    if "reference" in result:
        r = result["reference"]
        result.update({"reference_tok_s": r["real_tok_s_per_gpu"], "reference_peak_mem_gib": r["peak_mem_gib"]})
        # each QLoRA run that was made, against the recipe (bf16 LoRA is a different job)
        for run, key in (("ddptune", "speedup"), ("ddptune_gc", "speedup_gc")):
            if run in result:
                result[key] = result[run]["real_tok_s_per_gpu"] / r["real_tok_s_per_gpu"]
    # every ddptune run's real tok/s against every recipe run of this call (bf16 LoRA is a different job)
    result["tok_s_against"] = {ref: {n: result[n]["real_tok_s_per_gpu"] / result[ref]["real_tok_s_per_gpu"] for n, _ in named}
                               for ref in variants}
    out.write_text(json.dumps(result, indent=2))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out.name).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=2))
    for name, run in result.get("epoch", {}).get("runs", {}).items():
        print(f"epoch of {args.epoch_steps} steps, {name}: {run['wall_s']:.1f} s{' (extrapolated)' if run['extrapolated'] else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
