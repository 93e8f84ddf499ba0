"""`ddptune predict RUN [INPUT|-] [key=value ...] [--input FILE.jsonl|-] [--out FILE] [--nproc N]`:
summaries of new dialogues with a finished run's model. No references, no ROUGE: just outputs.

Each input line is a JSON object holding the dialogue in the run's `data.dialogue_column`
(`dialogue` unless the run set another), or a row of another format (formats.py: the run's
data.format, or the one the rows' keys name), whose turns up to the last user turn are the prompt;
`-` reads the lines from stdin. Prompts are built as in training (the run's config.yaml:
data.instruction, data.max_length — a longer dialogue is cut at its end, a conversation loses its
earliest turns — through data.prompt_pieces or chat.prompt_ids); generation is `ddptune eval`'s (generation.generate_all: greedy,
batched by eval.batch_size, at most eval.max_new_tokens, shared out over the processes), or sampled with --temperature
(--top-p, --top-k, --seed: the same texts for any process count). Rank 0
writes one JSON line per input row, in input order: the row's own fields plus `prediction`, to
--out or to stdout. Messages go to stderr, so stdout holds only the JSON lines.
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

from ddptune import config as config_lib, launch, report, rundir, sources as source_lib, trained
from ddptune.data import formats
from ddptune.config import ConfigError


def checked(args) -> tuple:
    """(the run's config, the input, --out, the overrides), once every problem with them is refused."""
    run_dir = Path(args.run)
    sources = [a for a in args.overrides if "=" not in a]
    overrides = [a for a in args.overrides if "=" in a]
    overrides += [f"eval.max_new_tokens={args.max_new_tokens}"] if (args.max_new_tokens or 0) >= 1 else []
    if args.input is not None:
        sources.insert(0, args.input)
    problems = sampling_problems(args)
    if len(sources) > 1:
        problems.append(f"predict: {len(sources)} inputs given ({', '.join(sources)}); give one file, or - for stdin")
    source = sources[0] if sources else None
    if source is None:
        if sys.stdin is None or sys.stdin.isatty():
            problems.append("--input: no input (give a .jsonl file of {\"dialogue\": ...} rows, or - to read them from stdin)")
        else:
            source = "-"
    if args.nproc is not None and args.nproc < 1:
        problems.append(f"--nproc: must be at least 1 (got {args.nproc})")
    out = Path(args.out) if args.out else None
    if out is not None:
        if out.is_dir():
            problems.append(f"--out: {out} is a folder (give a file path, e.g. {out / 'predictions.jsonl'})")
        elif out.exists():
            problems.append(f"--out: {out} already exists (choose a new file; nothing was overwritten)")
        else:
            problems += rundir.folder_problems("--out", out.parent)
    if source == "-" and launch.in_launched_process() and not launch.validated_by_parent():
        problems.append("--input: - (stdin) cannot be shared by processes a launcher started (give a .jsonl file, or use --nproc)")
    try:
        cfg = trained.trained_run(run_dir, "predict", overrides)
    except ConfigError as e:
        raise ConfigError(problems + e.problems) from None
    if not launch.in_launched_process():  # here, before any process starts (--nproc's workers skip it: we did)
        if problems:
            problems += source_lib.source_problems(cfg.model)
        else:  # the model's code (torch, transformers) is imported only when all else holds
            from ddptune import model as model_lib

            problems += model_lib.model_problems(cfg.model, cfg.lora, cfg.train.method)
    if problems:
        raise ConfigError(problems)
    return cfg, source, out, overrides


def sampling_problems(args) -> list[str]:
    """--temperature, --top-p, --top-k and --seed: numbers in range, and the last three only with a temperature."""
    t, p, k = args.temperature, args.top_p, args.top_k
    problems = [line for bad, line in (
        (not (math.isfinite(t) and t >= 0), f"--temperature: {t} is not 0 (greedy) or a positive number, e.g. 0.7"),
        (p is not None and not 0 < p <= 1, f"--top-p: {p} is outside (0, 1], e.g. 0.9"),
        (k is not None and k < 1, f"--top-k: {k} must be at least 1, e.g. 50"),
        (not 0 <= args.seed < 2**32, f"--seed: {args.seed} is outside 0..{2**32 - 1}"),
        (args.max_new_tokens is not None and args.max_new_tokens < 1, "--max-new-tokens: must be at least 1")) if bad]
    unused = [flag for flag, given in (("--top-p", p is not None), ("--top-k", k is not None), ("--seed", args.seed != 0)) if given]
    if unused and not t:
        problems.append(f"{unused[0]}: only with sampling (add --temperature, e.g. --temperature 0.7; greedy is the default)")
    return problems


def sampling_of(args):
    """The sampling the flags ask for (generation.Sampling), or None: greedy."""
    from ddptune import generation

    return generation.Sampling(args.temperature, args.top_p, args.top_k, args.seed) if args.temperature else None


def sampling_flags(args) -> list[str]:
    """The sampling flags again, for the processes --nproc starts."""
    return [f for flag, v in (("--temperature", args.temperature), ("--top-p", args.top_p), ("--top-k", args.top_k),
                              ("--seed", args.seed)) if v for f in (flag, str(v))]


def main(args) -> int:
    run_dir = Path(args.run)
    cfg, source, out, overrides = checked(args)
    rows, asked = read_rows(source, cfg.data, rundir.taken_formats(run_dir))

    if args.nproc is not None and not launch.in_launched_process():
        path = source
        if source == "-":  # the processes cannot all read stdin: hand them its rows in a file
            fd, path = tempfile.mkstemp(prefix="ddptune-predict-", suffix=".jsonl")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        try:
            child = ["predict", str(run_dir), "--input", path, *overrides, *sampling_flags(args)] + (["--out", str(out)] if out else [])
            return launch.torchrun(args.nproc, ["ddptune", *child])
        finally:
            if source == "-":
                os.unlink(path)

    return predict(cfg, run_dir, rows, asked, out, sampling_of(args))


def predict(cfg, run_dir: Path, rows: list[dict], asked: list[dict], out: Path | None, sampling=None) -> int:
    """Every process: load the run's model, generate its share of the summaries; rank 0 writes them."""
    from ddptune import dist, generation, model as model_lib

    t = cfg.train
    accelerator = dist.setup(t.precision)
    if not launch.validated_by_parent() and launch.in_launched_process():  # under torchrun or accelerate launch
        # rank 0 checks the model once; every process then fails with the same line (no traceback per rank)
        if problems := dist.on_main(accelerator, lambda: model_lib.model_problems(cfg.model, cfg.lora, cfg.train.method)):
            raise ConfigError(problems)
    tokenizer = model_lib.load_tokenizer(cfg.model, cfg.data)
    with accelerator.main_process_first():
        net = model_lib.load_trained(run_dir, cfg.model, t.method, accelerator.device, t.precision, t.seed)
    # no reference: a dialogue is cut (if too long) as for an empty summary, a conversation's earliest turns
    try:
        prompts = generation.prompt_ids(asked, tokenizer, cfg.data)
    except ConfigError as e:
        raise ConfigError([f"--input: {e.problems[0]}"]) from None
    texts, gen_s = generation.generate_all(net, tokenizer, prompts, cfg.eval, cfg.data, accelerator, sampling=sampling)
    if accelerator.is_main_process:
        lines = "".join(json.dumps({**r, "prediction": p}, ensure_ascii=False) + "\n" for r, p in zip(rows, texts))
        if out is None:
            sys.stdout.write(lines)
            sys.stdout.flush()
        else:
            report.write_text(out, lines)
        print(f"ddptune: predict: {len(rows)} summaries in {gen_s:.1f}s over {accelerator.num_processes} process(es)"
              f" -> {out or 'stdout'}", file=sys.stderr)
    accelerator.wait_for_everyone()
    return 0


def read_rows(source: str, d, taken: tuple[str, ...] | None = None) -> tuple[list[dict], list[dict]]:
    """The JSON-object rows of a .jsonl file or of stdin (`-`), and each as generation takes it: a
    dialogue (d.dialogue_column) or, in a chat format (formats.py), the turns up to the last user turn.
    `taken`: the formats the run trained on (rundir.taken_formats); a row of another shape is refused.
    None (a run saved before it recorded them): d.format, or the format the rows' keys name. ConfigError
    naming the first bad line."""
    where, column = "--input", d.dialogue_column
    example = formats.sample(taken[0], d) if taken else f'{{"{column}": ...}}'
    if source == "-":
        text, name = sys.stdin.read(), "stdin"
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError([f"{where}: {source} {config_lib.not_a_file(path)} (give a .jsonl file of "
                               f"{example} rows, or - for stdin)"])
        try:
            text, name = path.read_text(encoding="utf-8"), source
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError([f"{where}: cannot read {source} ({type(e).__name__}) (give a UTF-8 JSON-lines file)"]) from None
    rows, numbers = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as e:
            raise ConfigError([f"{where}: line {number} of {name} is not JSON ({getattr(e, 'msg', e)}) "
                               "(one JSON object per line)"]) from None
        numbers.append(number)
    if not rows:
        raise ConfigError([f"{where}: {name} holds no rows (give one JSON object per line, e.g. {example})"])
    found = [formats.detect(rows, d)] * len(rows) if taken is None else \
        [formats.asked_format(row, d, taken) or taken[0] for row in rows]
    for number, row, fmt in zip(numbers, rows, found):
        if taken is not None and isinstance(row, dict) and formats.asked_format(row, d, taken) is None:
            raise ConfigError([f"{where}: line {number} of {name} {formats.shape_problem(row, d, taken)}"])
        if fmt != "dialogue" and (problem := formats.problem(row, fmt, d, answer=False)):
            raise ConfigError([f"{where}: line {number} of {name} ({fmt}): {problem}"])
        if fmt == "dialogue" and (problem := dialogue_problem(row, column)):
            raise ConfigError([f"{where}: line {number} of {name} {problem}"])
    return rows, [asked_row(r, i, fmt, d) for i, (r, fmt) in enumerate(zip(rows, found))]


def asked_row(row: dict, i: int, fmt: str, d) -> dict:
    """A checked input row as generation prompts it: a dialogue, or a conversation whose last assistant turn
    is the reply to write (generation prompts with the turns before it): an empty one after a final user turn."""
    if fmt == "dialogue":
        return {"id": str(i), "dialogue": row[d.dialogue_column], "summary": ""}
    found = formats.normalise(row, i, fmt, d)
    if found["messages"][-1]["role"] == "user":  # not the reply to an earlier user turn: one to this one
        found["messages"].append({"role": "assistant", "content": ""})
    return found


def dialogue_problem(row, column: str) -> str | None:
    """What keeps a row of the dialogue format from being prompted, as the rest of a line naming the
    row; None when its `column` holds text."""
    sample = f'{{"{column}": "A: hi\\nB: hello"}}'
    if not isinstance(row, dict):
        return f"is {formats.kind(row)}, not an object of fields (one JSON object per line, e.g. {sample})"
    if column not in row:
        keys = ", ".join(sorted(row))
        return (f"has no text field {column!r} (it has: {keys or 'nothing'}; give each row a {column!r} string, set "
                "data.dialogue_column=NAME, or data.format to the rows' format)")
    if not isinstance(row[column], str):
        return f"holds {formats.kind(row[column])} in {column!r}, not text (write the dialogue as a JSON string, e.g. {sample})"
    if wrong := formats.text_problem(row[column]):
        return f"in {column!r} {wrong}"
    return None
