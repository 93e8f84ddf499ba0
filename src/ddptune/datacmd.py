"""`ddptune data CONFIG [key=value ...] [--show N]`: the data checked and tokenized as a run would, without training.

Every check a run makes of its data before it starts (the sources, their files and rows, and for
conversations every loss mask through the chat template), then every row tokenized as training
tokenizes it, into the store a run reads (tokenized.py: a later run on the same data finds it made):
each source's rows, formats, tokens before the trained ones and trained ones, rows cut and dropped
to fit data.max_length and where they were cut, and the longest example; the samples each training
source gives an epoch and the whole run (its weight's share of them, at --nproc processes);
and --show N examples of each source as text, the trained tokens between [[ and ]], so the mask can
be read before any GPU is rented; last, where the store is and its size. Nothing is written outside the store.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from ddptune import admission, batchplan, checks, config as config_lib, data, report
from ddptune.data import store as store_lib, tokenized
from ddptune.config import ConfigError, TrainConfig
from ddptune.data.tokens import IGNORE

DRAWS = [("name", "source"), ("examples", "examples"), ("weight", "weight"), ("share", "share"), ("epoch", "samples an epoch"),
         ("epoch_passes", "passes an epoch"), ("run", "samples in the run"), ("run_passes", "passes in the run")]
COLUMNS = [("split", "split"), ("name", "source"), ("format", "format"), ("rows", "rows"), ("kept", "kept"),
           ("cut", "cut"), ("dropped", "dropped"), ("prompt_tokens", "tokens before targets"),
           ("target_tokens", "trained tokens"), ("mean_tokens", "mean tokens"), ("longest", "longest (row)")]


def main(args) -> int:
    cfg = config_lib.load(args.config, args.overrides)
    problems = checks.check_values(cfg)
    if args.show < 0:
        problems.append(f"--show: must be 0 or more (got {args.show})")
    plan = None
    try:
        plan = batchplan.batch_plan(cfg.train, args.nproc) if args.nproc >= 1 else None
    except ConfigError as e:  # the batch does not divide over --nproc
        problems += e.problems
    if args.nproc < 1:
        problems.append(f"--nproc: must be at least 1 (got {args.nproc})")
    if problems := admission.input_problems(cfg, problems)[0]:
        raise ConfigError(problems)
    from ddptune import model as model_lib  # (torch and transformers: only once the checks above hold)

    started = time.perf_counter()
    tokenizer = model_lib.load_tokenizer(cfg.model, cfg.data)
    loaded = time.perf_counter()
    if problems := data.template_problems(cfg.data, tokenizer):
        raise ConfigError(problems)
    prepared = tokenized.prepare(cfg.data, tokenizer, sys.stderr.isatty())
    seconds = time.perf_counter() - loaded
    table, shown, mix_rows, stores = [], [], [], {}
    for split, found in (("train", prepared.train), ("val", prepared.val)):
        for s, (_, folder) in zip(data.sources(cfg.data, split), found):
            stores[folder] = store_lib.open_store(Path(folder), whole=False)  # prepare read it whole just now
            examples = store_lib.Examples([stores[folder]])
            table.append({"split": split, **figures(s, examples)})
            mix_rows += [(s, len(examples))] if split == "train" else []
            shown += [(split, s.name, examples, i) for i in range(min(args.show, len(examples)))]
    print(f"ddptune data: {args.config}: {cfg.model.tokenizer or cfg.model.source}, data.max_length {cfg.data.max_length}"
          f", conversations trained on {'every assistant turn' if cfg.data.loss_on == 'assistant' else 'the last assistant turn'}")
    if note := config_lib.kept_validation(cfg, args.overrides):
        print(f"ddptune: note: {note}", file=sys.stderr)
    print(f"data: {data.selection(cfg.data)}")
    print(report.markdown_table(table, COLUMNS), end="")
    print("".join(f"{line}\n" for line in prepared.notes), end="")
    print(draws_line(cfg.train, plan), report.markdown_table(draws_table(cfg.train, plan, mix_rows), DRAWS), sep="\n", end="")
    for split, name, examples, i in shown:
        example = examples[i]
        print(f"\n--- {split} {name}, row {examples.rows[i]} ({len(example['input_ids'])} tokens"
              f"{', cut' if example.get('cut') else ''}; trained tokens between [[ and ]]) ---")
        print(marked(tokenizer, example))
    rows = sum(row["rows"] for row in table)
    how = f"checked and tokenized in {seconds:.2f}s ({rows / max(seconds, 1e-9):,.0f} rows/s; " if prepared.made else \
        f"found tokenized in {seconds:.2f}s ("
    size = sum(sum(st.meta["bytes"].values()) for st in stores.values())
    tokens = sum(st.meta["tokens"] for st in stores.values())
    shown_size = f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.1f} kB"
    print(f"ddptune data: {rows} rows {how}the tokenizer loaded in {loaded - started:.1f}s); stored in {store_lib.root()}: "
          f"{shown_size}, {size / max(tokens, 1):.2f} bytes a token", file=sys.stderr)
    return 0


def draws_table(t: TrainConfig, plan: batchplan.BatchPlan, found: list[tuple[data.Source, int]]) -> list[dict]:
    """Each training source's draws: its examples, weight and share, and the samples it gives an epoch of the
    mixture (data.mixture: its examples, with one source) and the whole run (batches.Stream's stream)."""
    from ddptune import batches  # (torch: only once the checks have passed)

    sizes = [n for _, n in found]
    if not sum(sizes):  # every row dropped: the table above says so
        return []
    mix = data.draws([s for s, _ in found], sizes) if len(found) > 1 else ((sizes[0], sizes[0]),)
    samples = batchplan.total_steps(t, sum(sizes), plan.global_batch) * plan.global_batch
    run = batches.mixture_draws(mix, samples, t.seed) if len(found) > 1 else [samples]
    period = sum(n for _, n in mix)
    return [{"name": s.name, "examples": rows, "weight": s.weight, "share": f"{n / period:.1%}", "epoch": n,
             "epoch_passes": round(n / rows, 2), "run": k, "run_passes": round(k / rows, 2)}
            for (s, _), (rows, n), k in zip(found, mix, run)]


def draws_line(t: TrainConfig, plan: batchplan.BatchPlan) -> str:
    """What the draws table counts: the run's steps and samples, and the epoch of its sources."""
    length = f"train.max_steps={t.max_steps}" if t.max_steps else f"train.epochs={t.epochs:g}"
    return (f"samples drawn ({length}, {plan.global_batch} a step over {plan.world_size} process(es); an epoch draws as "
            "many samples as the sources hold examples, each source's share set by its weight):")


def figures(s: data.Source, examples: store_lib.Examples) -> dict:
    """One source's row of the table, from its store."""
    (store,) = examples.stores
    meta, tokens = store.meta, int(examples.lengths.sum())
    trained = int(np.count_nonzero(store.trained)) if tokens else 0  # read in place, not copied as int64
    longest = int(np.argmax(examples.lengths)) if len(examples) else None
    return {"name": s.name, "format": meta["format"], "rows": meta["rows"], "kept": len(examples), "cut": meta["cut"],
            "dropped": meta["dropped"], "prompt_tokens": tokens - trained, "target_tokens": trained,
            "mean_tokens": tokens / max(len(examples), 1),
            "longest": f"{examples.lengths[longest]} ({examples.rows[longest]})" if longest is not None else ""}


def marked(tokenizer, example: dict) -> str:
    """The example's text with every run of trained tokens between [[ and ]]."""
    out, run, trained = [], [], None
    for token, label in zip(example["input_ids"], example["labels"]):
        if (label != IGNORE) != trained and run:
            out.append(f"[[{tokenizer.decode(run)}]]" if trained else tokenizer.decode(run))
            run = []
        trained = label != IGNORE
        run.append(token)
    out.append(f"[[{tokenizer.decode(run)}]]" if trained else tokenizer.decode(run))
    return "".join(out)
