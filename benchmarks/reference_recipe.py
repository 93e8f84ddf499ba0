#!/usr/bin/env python
"""Reference recipe benchmark: the tutorial QLoRA fine-tune users run today.

HF ``Trainer`` + Accelerate + PEFT (QLoRA via bitsandbytes), gradient checkpointing,
dynamic padding (``DataCollatorForSeq2Seq``), no packing.  Standalone (does not import
``ddptune``) so ddptune's speed benchmark can compare against it.

    accelerate launch --num_processes N benchmarks/reference_recipe.py \
        --model-dir DIR --data samsum.json --out ref.json
    python benchmarks/reference_recipe.py --method lora ...   # CPU smoke test (fp32)
"""
import argparse
import importlib.metadata
import json
import math
import os
import statistics
import tempfile
import time

import torch
from accelerate import PartialState
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq,
                          Trainer, TrainerCallback, TrainingArguments)

INSTRUCTION = "Summarize the following dialogue."


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    with open(path) as f:
        data = json.load(f)
    data = data[:rows] if rows else data
    if not data:
        raise SystemExit(f"no rows in {path}")
    encoded = [encode_example(tokenizer, r["dialogue"], r["summary"], max_length) for r in data]
    reps = max(1, math.ceil(samples_needed / len(encoded)))
    return encoded * reps  # a list of dicts is a valid map-style dataset


# ----------------------------------------------------------------------------- measurement
class StepMeter(TrainerCallback):
    """Per-optimizer-step wall time, tokens (real / padded) on this rank, loss, grad norm."""

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
    """Stock Trainer; only counts the tokens of every micro-batch (loss math untouched)."""

    def __init__(self, *a, meter, **kw):
        super().__init__(*a, **kw)
        self.meter = meter

    def training_step(self, model, inputs, *a, **kw):
        self.meter.count(inputs)
        return super().training_step(model, inputs, *a, **kw)


def reduce_list(values, op, device, dtype=torch.float64):
    """all_reduce ("SUM"/"MAX") a per-step list across ranks (no-op single-process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=dtype, device=device)
    torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op))
    return t.tolist()


def versions():
    out = {}
    for pkg in ("torch", "transformers", "peft", "accelerate", "bitsandbytes"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


# ----------------------------------------------------------------------------- main
def load_model(args, cuda, local_rank):
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


def main(argv=None):
    args = parse_args(argv)
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


if __name__ == "__main__":
    main()
