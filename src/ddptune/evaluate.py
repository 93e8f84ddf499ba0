"""`ddptune eval` and `ddptune compare`: generated summaries, ROUGE, zero-shot against fine-tuned.

Generation is greedy, batched, with the KV cache and left padding. The evaluation rows are cut
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
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from ddptune import checks, config as config_lib, data, dist, model as model_lib, report
from ddptune.config import Config, ConfigError

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


def prompt_ids(rows: list[dict], tokenizer, d: config_lib.DataConfig) -> list[list[int]]:
    pieces = data.prompt_pieces(tokenizer, d.instruction)
    out = []
    for r in rows:
        ex = data.tokenize_example(tokenizer, pieces, r["dialogue"], r["summary"], d.max_length)
        out.append(ex["input_ids"][: ex["prompt_len"]])
    return out


def stop_ids(tokenizer, d: config_lib.DataConfig) -> list[int]:
    """End-of-sequence ids: the tokenizer's eos and the chat template's end-of-turn token."""
    ids = {tokenizer.eos_token_id}
    end = data.prompt_pieces(tokenizer, d.instruction)[2]
    end_ids = tokenizer(end.strip(), add_special_tokens=False)["input_ids"] if end.strip() else []
    if len(end_ids) == 1:
        ids.add(end_ids[0])
    return sorted(i for i in ids if i is not None)


def fixed_batches(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """Row indices in batches of similar prompt length; the same for any process count."""
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], batch: list[int], max_new_tokens: int, eos: list[int], device) -> list[str]:
    width = max(len(prompts[i]) for i in batch)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, i in enumerate(batch):  # left padding: every prompt ends where generation starts
        ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
        mask[row, width - len(prompts[i]):] = 1
    out = model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
        do_sample=False, num_beams=1, use_cache=True, eos_token_id=eos, pad_token_id=pad,
    )
    return [tokenizer.decode(seq[width:], skip_special_tokens=True).strip() for seq in out]


def generate_all(net, tokenizer, prompts: list[list[int]], cfg: Config, accelerator: Accelerator,
                 desc: str = "generate") -> tuple[list[str] | None, float]:
    """Greedy texts for every prompt, the work shared out over the processes (every process calls
    this): on rank 0 the texts in prompt order, None on the others; and the generation seconds.
    Rank 0 shows a bar over its generate calls (every process makes as many)."""
    was_training = net.training
    net.eval()
    batches = fixed_batches(prompts, cfg.eval.batch_size)
    world, rank = accelerator.num_processes, accelerator.process_index
    calls = math.ceil(len(batches) / world)  # the same on every process
    mine = [batches[min(j * world + rank, len(batches) - 1)] for j in range(calls)]
    eos = stop_ids(tokenizer, cfg.data)
    accelerator.wait_for_everyone()
    t0 = time.perf_counter()
    done = []
    # generation runs the layers eagerly: compiled training graphs (train.compile) do not fit a KV cache
    with accelerator.autocast(), torch.compiler.set_stance("force_eager"):
        for batch in tqdm(mine, desc=desc, unit="batch", disable=not accelerator.is_main_process, leave=False,
                          dynamic_ncols=True):
            texts = generate(net, tokenizer, prompts, batch, cfg.eval.max_new_tokens, eos, accelerator.device)
            done += list(zip(batch, texts))
    if accelerator.device.type == "cuda":
        torch.cuda.synchronize()
    gen_s = time.perf_counter() - t0
    everything = gather_object(done)
    net.train(was_training)
    if not accelerator.is_main_process:
        return None, gen_s
    preds = dict(everything)  # repeats of the last batch collapse onto the same row index
    return [preds[i] for i in range(len(prompts))], gen_s


def evaluate(model, tokenizer, rows: list[dict], cfg: Config, accelerator: Accelerator, out_dir: Path, label: str) -> dict:
    """Generate for `rows` on every process, score on rank 0, write predictions and metrics there."""
    net = accelerator.unwrap_model(model)
    world = accelerator.num_processes
    predictions, gen_s = generate_all(net, tokenizer, prompt_ids(rows, tokenizer, cfg.data), cfg, accelerator,
                                      f"generate ({label.split(' (')[0]})")
    if not accelerator.is_main_process:
        return {}
    scores = rouge(predictions, [r["summary"] for r in rows])
    result = {
        "label": label, **scores, "n": len(rows), "world_size": world,
        "generation_time_s": gen_s, "samples_per_s": len(rows) / gen_s if gen_s else None,
        "max_new_tokens": cfg.eval.max_new_tokens, "batch_size": cfg.eval.batch_size,
        "mean_prediction_words": sum(len(p.split()) for p in predictions) / max(len(predictions), 1),
        "model": cfg.model.source,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"id": r["id"], "dialogue": r["dialogue"], "reference": r["summary"], "prediction": p})
             for r, p in zip(rows, predictions)]
    report.write_text(out_dir / "predictions.jsonl", "\n".join(lines) + "\n")
    report.write_json(out_dir / "metrics.json", result)
    accelerator.print(
        f"ddptune: {label}: ROUGE-1 {scores['rouge1']:.2f}  ROUGE-2 {scores['rouge2']:.2f}  "
        f"ROUGE-L {scores['rougeL']:.2f}  ROUGE-Lsum {scores['rougeLsum']:.2f}  "
        f"({len(rows)} samples, {gen_s:.1f}s generation) -> {out_dir}"
    )
    return result


def eval_rows(cfg: Config) -> list[dict]:
    rows = data.load_split(cfg.data.val, cfg.data.val_rows, cfg.data)
    return rows[: cfg.eval.max_samples] if cfg.eval.max_samples else rows


# ---------------------------------------------------------------------------------------------
# The commands


def main(args) -> int:
    """`ddptune eval RUN_DIR|CONFIG [overrides] [--nproc N] [--base] [--out DIR]`."""
    target = Path(args.target)
    run_dir = target if target.is_dir() else None
    if run_dir is not None:
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError([f"eval: {run_dir} has no config.yaml (give a folder written by ddptune train, or a YAML config)"])
        cfg = config_lib.load(run_dir / "config.yaml", args.overrides)
    elif not target.is_file():
        raise ConfigError([f"eval: {target} not found (give a folder written by ddptune train, or a YAML config)"])
    else:
        cfg = config_lib.load(target, args.overrides)
    problems = config_lib.check_values(cfg)
    if cfg.data.val is None:
        problems.append("data.val: evaluation needs a validation set (e.g. data.val=demo data.val_rows=560:600)")
    if args.nproc is not None and args.nproc < 1:
        problems.append(f"--nproc: must be at least 1 (got {args.nproc})")
    trained = run_dir is not None and not args.base
    if trained and not model_lib.trained_weights_dir(run_dir, cfg.train.method).is_dir():
        problems.append(f"eval: {model_lib.trained_weights_dir(run_dir, cfg.train.method)} not found "
                        "(has the run finished? or pass --base for the zero-shot base model)")
    problems += checks.trained_weights_problems(run_dir, cfg.train.method, "eval") if trained else []
    out = Path(args.out) if args.out else (run_dir or Path(cfg.output_dir)) / ("eval" if trained else "eval-base")

    def checked_once(data_ok: bool = True) -> list[str]:
        """The model, the output folder and the data: read once per job, not by every process."""
        found = checks.model_problems(cfg) + checks.folder_problems("--out" if args.out else "eval", out)
        return found + (checks.jsonl_problems(cfg.data) or data.check(cfg.data)[0] if data_ok else [])

    if not dist.in_launched_process():  # here, before any process starts (--nproc's workers skip it: we did)
        problems += checked_once(data_ok=not any(p.startswith("data.") for p in problems))
    if problems:
        raise ConfigError(problems)
    if args.nproc is not None and not dist.in_launched_process():
        child = ["eval", str(target), *args.overrides, "--out", str(out)] + (["--base"] if args.base else [])
        return dist.torchrun(args.nproc, ["ddptune", *child])

    accelerator = dist.setup(cfg.train.precision)
    if not dist.validated_by_parent() and dist.in_launched_process():  # under torchrun or accelerate launch
        # rank 0 checks once; every process then fails with the same line (no traceback per rank)
        if problems := dist.on_main(accelerator, checked_once):
            raise ConfigError(problems)
    tokenizer = model_lib.load_tokenizer(cfg.model)
    t = cfg.train
    t0 = time.perf_counter()
    accelerator.print(f"ddptune: loading {cfg.model.source}" + (f" with {model_lib.trained_weights_dir(run_dir, t.method)}" if trained else "")
                      + " ...")
    with accelerator.main_process_first():
        if trained:
            net = model_lib.load_trained(run_dir, cfg.model, t.method, accelerator.device, t.precision, t.seed)
        else:
            net = model_lib.load_model(cfg.model, t.method, accelerator.device, t.precision, t.seed)
    accelerator.print(f"ddptune: loaded in {time.perf_counter() - t0:.1f}s")
    label = f"fine-tuned ({model_lib.trained_weights_dir(run_dir, t.method)})" if trained else "zero-shot"
    evaluate(net, tokenizer, eval_rows(cfg), cfg, accelerator, out, label)
    accelerator.wait_for_everyone()
    return 0


def find_metrics(path: Path) -> list[Path]:
    """metrics.json files of a run folder (eval, eval-base) or of an eval folder itself."""
    if (path / "metrics.json").is_file():
        return [path / "metrics.json"]
    return sorted(p / "metrics.json" for p in path.iterdir() if p.is_dir() and (p / "metrics.json").is_file()) if path.is_dir() else []


def _read_json(path: Path, keys: tuple[str, ...] = ()) -> dict:
    """A JSON object file written by ddptune; ConfigError naming the file when it is not one."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError([f"compare: {path} cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:120]}) "
                           "(re-run the command that wrote it, or leave that run out)"]) from None
    missing = [k for k in keys if not isinstance(obj, dict) or k not in obj]
    if missing:
        raise ConfigError([f"compare: {path} lacks {', '.join(missing)} (not written by ddptune eval? re-run it)"])
    return obj if isinstance(obj, dict) else {}


def compare_rows(paths: list[str]) -> list[dict]:
    rows = []
    for p in map(Path, paths):
        if not p.exists():
            raise ConfigError([f"compare: {p} not found (give run folders or eval folders)"])
        found = find_metrics(p)
        if not found:
            raise ConfigError([f"compare: {p} holds no evaluation (run ddptune eval {p} first)"])
        for m in found:
            run = m.parent.parent if m.parent.name.startswith("eval") else m.parent
            summary = _read_json(run / "summary.json") if (run / "summary.json").is_file() else {}
            e = _read_json(m, ("label", *ROUGE_KEYS, "n", "generation_time_s"))
            base = e["label"] == "zero-shot"
            # the base model was not trained: the run's training columns do not describe it
            trained = {} if base else summary
            rows.append({
                "run": str(run), "eval": m.parent.name, "model": "zero-shot (base)" if base else "fine-tuned",
                "processes": trained.get("world_size"), "global_batch": trained.get("global_batch"),
                "steps": trained.get("steps"), "train_time_s": trained.get("train_time_s"),
                "val_loss": trained.get("val_loss"),
                **{k: e[k] for k in ROUGE_KEYS}, "n": e["n"], "generation_time_s": e["generation_time_s"],
            })
    return rows


def config_differences(rows: list[dict]) -> list[str]:
    """The config keys (section.key) whose values differ between the compared runs, and each
    row's values of them under those keys (runs without a readable config.yaml are left out)."""
    configs = {}
    for run in dict.fromkeys(r["run"] for r in rows):
        try:
            configs[run] = config_lib.flatten(config_lib.read_yaml(Path(run) / "config.yaml", "compare"))
        except ConfigError:
            continue
    keys = sorted({k for c in configs.values() for k in c} - {"output_dir"})
    differing = [k for k in keys if len({repr(c.get(k)) for c in configs.values()}) > 1]
    for r in rows:
        for k in differing:
            r[k] = configs.get(r["run"], {}).get(k)
    return differing


def loss_curves(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Each compared run's training loss per step, from its metrics.jsonl."""
    curves = {}
    for run in dict.fromkeys(r["run"] for r in rows):
        path = Path(run) / "metrics.jsonl"
        if path.is_file():
            lines = (json.loads(l) for l in path.read_text().splitlines() if l.strip())
            curves[run] = [(r["step"], r["loss"]) for r in lines if "loss" in r]
    return curves


COMPARE_COLUMNS = [("run", "run"), ("model", "model"), ("processes", "GPUs/procs"), ("global_batch", "global batch"),
                   ("steps", "steps"), ("train_time_s", "train s"), ("val_loss", "val loss"), ("rouge1", "ROUGE-1"),
                   ("rouge2", "ROUGE-2"), ("rougeL", "ROUGE-L"), ("rougeLsum", "ROUGE-Lsum"), ("n", "n"),
                   ("generation_time_s", "gen s")]


def report_file_problems(flag: str, value: str | None, example: str) -> list[str]:
    """A report file's path (`compare --json/--plot`, `plan --json`) can be written: not a folder,
    its folder is or can be made (report.write_* make it). An existing file is replaced whole."""
    if not value:
        return []
    target = Path(value)
    if target.is_dir():
        return [f"{flag}: {target} is a folder (give a file path, e.g. {target / example})"]
    return checks.folder_problems(flag, target.parent)


def compare_main(paths: list[str], json_path: str | None, plot_path: str | None = None) -> int:
    """Print the runs' table (ROUGE, loss, and a column for each config key whose value differs);
    optionally write it as JSON, and the runs' loss curves as a PNG."""
    for flag, value, example in (("--json", json_path, "compare.json"), ("--plot", plot_path, "losses.png")):
        if problems := report_file_problems(flag, value, example):
            raise ConfigError(problems)
    rows = compare_rows(paths)
    differing = config_differences(rows)
    print(report.markdown_table(rows, COMPARE_COLUMNS[:2] + [(k, k) for k in differing] + COMPARE_COLUMNS[2:]))
    if json_path:
        report.write_json(Path(json_path), rows)
    if plot_path:
        report.plot_losses(Path(plot_path), loss_curves(rows))
    return 0
