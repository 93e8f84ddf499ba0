"""`ddptune data CONFIG [key=value ...] [--show N]`: the data checked and tokenized as a run would, without training.

Every check a run makes of its data before it starts (the sources, their files and rows, and for
conversations every loss mask through the chat template), then every row tokenized as training
tokenizes it (nothing cached, nothing written): each source's rows, formats, tokens before the
trained ones and trained ones, rows cut and dropped to fit data.max_length and the longest example;
the shares a mixture draws; and --show N examples of each source as text, the trained tokens
between [[ and ]], so the mask can be read before any GPU is rented.
"""
from __future__ import annotations

import sys
import time

from ddptune import checks, config as config_lib, data, formats, report
from ddptune.config import ConfigError
from ddptune.tokens import IGNORE

COLUMNS = [("split", "split"), ("name", "source"), ("format", "format"), ("rows", "rows"), ("kept", "kept"),
           ("cut", "cut"), ("dropped", "dropped"), ("prompt_tokens", "tokens before targets"),
           ("target_tokens", "trained tokens"), ("mean_tokens", "mean tokens"), ("longest", "longest (row)")]


def main(args) -> int:
    cfg = config_lib.load(args.config, args.overrides)
    problems = config_lib.check_values(cfg)
    if args.show < 0:
        problems.append(f"--show: must be 0 or more (got {args.show})")
    if problems := checks.input_problems(cfg, problems)[0]:
        raise ConfigError(problems)
    from ddptune import model as model_lib  # (torch and transformers: only once the checks above hold)

    started = time.perf_counter()
    tokenizer = model_lib.load_tokenizer(cfg.model)
    loaded = time.perf_counter()
    if problems := data.template_problems(cfg.data, tokenizer):  # every conversation's mask, as a run checks them
        raise ConfigError(problems)
    table, shown, rows_done, mix_rows = [], [], 0, []
    for split in ("train", "val"):
        for s in data.sources(cfg.data, split):
            rows = data.load_split(s.source, s.rows, cfg.data, s.field)
            examples = data.tokenize(rows, tokenizer, cfg.data, sys.stderr.isatty(), s.field)
            rows_done += len(rows)
            table.append({"split": split, **figures(s, rows, examples, tokenizer, cfg.data)})
            if split == "train":
                mix_rows.append((s, table[-1]["kept"]))
            shown += [(split, s.name, r, e) for r, e in zip(rows, examples) if e is not None][:args.show]
    seconds = time.perf_counter() - loaded
    print(f"ddptune data: {args.config}: {cfg.model.tokenizer or cfg.model.source}, data.max_length {cfg.data.max_length}"
          f", conversations trained on {'every assistant turn' if cfg.data.loss_on == 'assistant' else 'the last assistant turn'}")
    print(report.markdown_table(table, COLUMNS), end="")
    if len(mix_rows) > 1:
        mix = data.draws([s for s, _ in mix_rows], [n for _, n in mix_rows])
        period = sum(n for _, n in mix)
        print("mixture: each epoch of " + f"{period} samples draws " + ", ".join(
            f"{n} from {s.name} ({n / period:.1%}, weight {s.weight:g}, {n / rows:.2f} passes over its {rows} rows)"
            for (s, _), (rows, n) in zip(mix_rows, mix)))
    for k, (split, name, row, example) in enumerate(shown):
        print(f"\n--- {split} {name}, row {row['id']} ({len(example['input_ids'])} tokens"
              f"{', cut' if example.get('cut') else ''}; trained tokens between [[ and ]]) ---")
        print(marked(tokenizer, example))
    print(f"ddptune data: {rows_done} rows checked and tokenized in {seconds:.2f}s ({rows_done / max(seconds, 1e-9):,.0f} "
          f"rows/s; the tokenizer loaded in {loaded - started:.1f}s)", file=sys.stderr)
    return 0


def figures(s: data.Source, rows: list[dict], examples: list, tokenizer, d) -> dict:
    """One source's row of the table."""
    kept = [(r, e) for r, e in zip(rows, examples) if e is not None]
    targets = sum(sum(1 for t in e["labels"] if t != IGNORE) for _, e in kept)
    tokens = sum(len(e["input_ids"]) for _, e in kept)
    longest = max(kept, key=lambda p: len(p[1]["input_ids"]), default=None)
    fmt = formats.detect(data.read_rows(s.source), d)
    cut = sum(1 for r, e in kept if e.get("cut") or "messages" not in r and dialogue_cut(tokenizer, r, e, d))
    return {"name": s.name, "format": fmt, "rows": len(rows), "kept": len(kept), "cut": cut, "dropped": len(rows) - len(kept),
            "prompt_tokens": tokens - targets, "target_tokens": targets, "mean_tokens": tokens / max(len(kept), 1),
            "longest": f"{len(longest[1]['input_ids'])} ({longest[0]['id']})" if longest else ""}


def dialogue_cut(tokenizer, row: dict, example: dict, d) -> bool:
    """Whether a dialogue row lost tokens to data.max_length (its dialogue's end, or its summary's
    beyond half of max_length): only a row that reaches max_length can have, and then twice the room gives it more."""
    if len(example["input_ids"]) < d.max_length:
        return False
    pieces = data.prompt_pieces(tokenizer, d.instruction)
    return len(data.tokenize_example(tokenizer, pieces, row["dialogue"], row["summary"], 2 * d.max_length)["input_ids"]) \
        > d.max_length


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
