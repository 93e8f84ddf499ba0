"""Generation and scoring: prompts, batched greedy (or sampled) generation over the processes, and ROUGE.

Generation is greedy (predict may sample: `Sampling`, through transformers' GenerationConfig), batched,
with the KV cache and left padding. The evaluation rows are cut
into fixed batches (sorted by prompt length) before they are shared out, so every batch holds
the same rows whatever the process count; each process runs the same number of generate calls
(the last ones repeat a batch when the count does not divide); rank 0 gathers the texts in
order, drops the repeats and scores once with `rouge-score`. 1 and N processes give the same
predictions and the same ROUGE.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm.auto import tqdm
from transformers import GenerationConfig

from ddptune import data, report
from ddptune.data import chat, formats
from ddptune.config import ConfigError, DataConfig, EvalConfig

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")


# ---------------------------------------------------------------------------------------------
# Scoring


def sentences(text: str) -> str:
    """One sentence per line, as ROUGE-Lsum expects (a rule-based split: no downloads)."""
    parts = re.split(r"(?<=[.!?])\s+", text.strip())
    return "\n".join(p for p in parts if p)


def rouge(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L/Lsum F1 × 100 over the pairs, Porter stemming on."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)
    totals = dict.fromkeys(ROUGE_KEYS, 0.0)
    for pred, ref in zip(predictions, references, strict=True):
        scores = scorer.score(sentences(ref), sentences(pred))
        for k in ROUGE_KEYS:
            totals[k] += scores[k].fmeasure
    n = max(len(predictions), 1)
    return {k: 100.0 * v / n for k, v in totals.items()}


# ---------------------------------------------------------------------------------------------
# Generation


def prompt_ids(rows: list[dict], tokenizer, d: DataConfig) -> list[list[int]]:
    """What each row's generation starts from: a dialogue's prompt as training built it, or a
    conversation's turns up to its last user turn (before its last assistant turn, when it has one)
    with the generation prompt, in the pieces training tokenized them in (chat.prompt_ids)."""
    pieces, out = None, []
    for r in rows:
        if "messages" in r:
            try:
                out.append(chat.prompt_ids(tokenizer, formats.context_and_answer(r["messages"])[0], d.loss_on, d.max_length))
            except chat.TemplateProblem as e:
                raise ConfigError([f"row {r['id']}: {e}"]) from None
            continue
        pieces = pieces or data.prompt_pieces(tokenizer, d.instruction, d.system_prompt)
        ex = data.tokenize_example(tokenizer, pieces, r["dialogue"], r["summary"], d.max_length)
        out.append(ex["input_ids"][: ex["prompt_len"]])
    return out


def reference(row: dict) -> str:
    """What a row's generation is scored against: its summary, or its last assistant turn."""
    return formats.context_and_answer(row["messages"])[1] if "messages" in row else row["summary"]


def stop_ids(tokenizer, d: DataConfig) -> list[int]:
    """End-of-sequence ids: the tokenizer's eos and the chat template's end-of-turn token."""
    ids = {tokenizer.eos_token_id}
    end = data.prompt_pieces(tokenizer, d.instruction, d.system_prompt)[2]
    end_ids = tokenizer(end.strip(), add_special_tokens=False)["input_ids"] if end.strip() else []
    if len(end_ids) == 1:
        ids.add(end_ids[0])
    return sorted(i for i in ids if i is not None)


def fixed_batches(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """Row indices in batches of similar prompt length; the same for any process count."""
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


@dataclass(frozen=True)
class Sampling:
    """`ddptune predict`'s sampling: at `temperature`, from the `top_p` / `top_k` likeliest tokens (None: the
    model's generation_config, else transformers' defaults); each batch seeded from `seed` and its place."""
    temperature: float
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0


def settings(max_new_tokens: int, eos: list[int], pad: int, sampling: Sampling | None = None) -> GenerationConfig:
    """transformers' GenerationConfig of a generate call: greedy (what eval scores), or `sampling`."""
    if sampling is None:
        return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, use_cache=True,
                                eos_token_id=eos, pad_token_id=pad)
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=sampling.temperature,
                            top_p=sampling.top_p, top_k=sampling.top_k, num_beams=1, use_cache=True,
                            eos_token_id=eos, pad_token_id=pad)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], batch: list[int], config: GenerationConfig, device) -> list[str]:
    width = max(len(prompts[i]) for i in batch)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, i in enumerate(batch):  # left padding: every prompt ends where generation starts
        ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
        mask[row, width - len(prompts[i]):] = 1
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
    return [tokenizer.decode(seq[width:], skip_special_tokens=True).strip() for seq in out]


def generate_all(net, tokenizer, prompts: list[list[int]], e: EvalConfig, d: DataConfig, accelerator: Accelerator,
                 desc: str = "generate", sampling: Sampling | None = None) -> tuple[list[str] | None, float]:
    """Greedy (or `sampling`) texts for every prompt, the work shared out over the processes (every process
    calls this): on rank 0 the texts in prompt order, None on the others; and the generation seconds.
    Rank 0 shows a bar over its generate calls (every process makes as many). A sampled batch is seeded
    from its place among the batches: the same texts from any process count."""
    was_training = net.training
    net.eval()
    batches = fixed_batches(prompts, e.batch_size)
    world, rank = accelerator.num_processes, accelerator.process_index
    calls = math.ceil(len(batches) / world)  # the same on every process
    places = [min(j * world + rank, len(batches) - 1) for j in range(calls)]
    config = settings(e.max_new_tokens, stop_ids(tokenizer, d), tokenizer.pad_token_id, sampling)
    accelerator.wait_for_everyone()
    t0 = time.perf_counter()
    done = []
    # generation runs the layers eagerly: compiled training graphs (train.compile) do not fit a KV cache
    with accelerator.autocast(), torch.compiler.set_stance("force_eager"):
        for place in tqdm(places, desc=desc, unit="batch", disable=not accelerator.is_main_process, leave=False,
                          dynamic_ncols=True):
            if sampling is not None:
                torch.manual_seed(sampling.seed * len(batches) + place)
            texts = generate(net, tokenizer, prompts, batches[place], config, accelerator.device)
            done += list(zip(batches[place], texts))
    if accelerator.device.type == "cuda":
        torch.cuda.synchronize()
    gen_s = time.perf_counter() - t0
    everything = gather_object(done)
    net.train(was_training)
    if not accelerator.is_main_process:
        return None, gen_s
    preds = dict(everything)  # repeats of the last batch collapse onto the same row index
    return [preds[i] for i in range(len(prompts))], gen_s


def evaluate(model, tokenizer, rows: list[dict], e: EvalConfig, d: DataConfig, source: str, accelerator: Accelerator,
             out_dir: Path, label: str) -> dict:
    """Generate for `rows` on every process, score on rank 0, write predictions and metrics there (`source`:
    the model's, as its metrics name it)."""
    net = accelerator.unwrap_model(model)
    world = accelerator.num_processes
    predictions, gen_s = generate_all(net, tokenizer, prompt_ids(rows, tokenizer, d), e, d, accelerator,
                                      f"generate ({label.split(' (')[0]})")
    if not accelerator.is_main_process:
        return {}
    scores = rouge(predictions, [reference(r) for r in rows])
    names = list(dict.fromkeys(r.get("source") for r in rows))
    per_source = {name: {**rouge(*zip(*[(p, reference(r)) for r, p in zip(rows, predictions) if r.get("source") == name])),
                         "n": sum(r.get("source") == name for r in rows)} for name in names} if len(names) > 1 else {}
    result = {
        "label": label, **scores, "n": len(rows), "world_size": world, **({"sources": per_source} if per_source else {}),
        "generation_time_s": gen_s, "samples_per_s": len(rows) / gen_s if gen_s else None,
        "max_new_tokens": e.max_new_tokens, "batch_size": e.batch_size,
        "mean_prediction_words": sum(len(p.split()) for p in predictions) / max(len(predictions), 1),
        "model": source,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    asked = lambda row: {"messages": formats.context_and_answer(row["messages"])[0]} if "messages" in row else {"dialogue": row["dialogue"]}  # noqa: E731
    lines = [json.dumps({"id": r["id"], **({"source": r["source"]} if "source" in r else {}), **asked(r),
                         "reference": reference(r), "prediction": p})
             for r, p in zip(rows, predictions)]
    report.write_text(out_dir / "predictions.jsonl", "\n".join(lines) + "\n")
    report.write_json(out_dir / "metrics.json", result)
    accelerator.print(
        f"ddptune: {label}: ROUGE-1 {scores['rouge1']:.2f}  ROUGE-2 {scores['rouge2']:.2f}  "
        f"ROUGE-L {scores['rougeL']:.2f}  ROUGE-Lsum {scores['rougeLsum']:.2f}  "
        f"({len(rows)} samples, {gen_s:.1f}s generation) -> {out_dir}"
        + "".join(f"\nddptune: {label}, {name}: ROUGE-1 {v['rouge1']:.2f}  ROUGE-L {v['rougeL']:.2f} ({v['n']} samples)"
                  for name, v in per_source.items())
    )
    return result


def eval_rows(d: DataConfig, max_samples: int | None) -> list[dict]:
    """The validation rows of every data.val source, in order (the first eval.max_samples)."""
    rows = [dict(r, source=s.name) for s in data.sources(d, "val") for r in data.load_split(s.source, s.rows, d, s.field)]
    return rows[:max_samples] if max_samples else rows
