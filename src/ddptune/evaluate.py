"""`ddptune eval` and `ddptune compare`: generated summaries, ROUGE, zero-shot against fine-tuned.

`eval` generates for the validation rows with a finished run's model (or the base, zero-shot) and
scores them (generation.py: the same rows and ROUGE at any process count); `compare` puts runs'
scores and losses side by side, with the config keys that differ.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ddptune import checks, config as config_lib, data, launch, report, rundir, sources, trained as trained_lib
from ddptune.config import ConfigError

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")  # generation.ROUGE_KEYS (which needs torch to import)
WORKER_MODULES = ("ddptune.cli", "ddptune.dist", "ddptune.generation", "ddptune.model")  # launch.TRAIN_MODULES, for eval


def main(args) -> int:
    """`ddptune eval RUN_DIR|CONFIG [overrides] [--nproc N] [--base] [--out DIR]`."""
    target = Path(args.target)
    run_dir = target if target.is_dir() else None
    if run_dir is not None:
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError([f"eval: {run_dir} has no config.yaml (give a folder written by ddptune train, or a YAML config)"])
        cfg = config_lib.load(run_dir / "config.yaml", args.overrides)
    elif not target.is_file():
        raise ConfigError([f"eval: {target} {config_lib.not_a_file(target)} (give a folder written by ddptune train, "
                           "or a YAML config)"])
    else:
        cfg = config_lib.load(target, args.overrides)
    problems = checks.check_values(cfg)
    if cfg.data.val is None:
        problems.append("data.val: evaluation needs a validation set (e.g. data.val=demo data.val_rows=560:600)")
    if args.nproc is not None and args.nproc < 1:
        problems.append(f"--nproc: must be at least 1 (got {args.nproc})")
    trained = run_dir is not None and not args.base
    if trained and not rundir.trained_weights_dir(run_dir, cfg.train.method).is_dir():
        problems.append(f"eval: {rundir.trained_weights_dir(run_dir, cfg.train.method)} not found "
                        "(has the run finished? or pass --base for the zero-shot base model)")
    problems += trained_lib.trained_weights_problems(run_dir, cfg.train.method, "eval") if trained else []
    out = Path(args.out) if args.out else (run_dir or Path(cfg.output_dir)) / ("eval" if trained else "eval-base")
    if not args.out:  # a folder of other settings is kept: this one goes beside it
        out, note = free_folder(out, scored_with(cfg))
        if note and launch.is_main_process():
            print(f"ddptune: note: eval: {note}", file=sys.stderr)

    def checked_once(data_ok: bool = True, found: tuple = ()) -> list[str]:
        """The output folder, the data and the model (its code is imported only when all else holds):
        read once per job, not by every process."""
        found = [*found, *rundir.folder_problems("--out" if args.out else "eval", out)]
        found += data.check(cfg.data)[0] if data_ok else []
        if data_ok and not found and run_dir is not None and (taken := rundir.taken_formats(run_dir)):
            found += data.untaken(cfg.data, taken)  # the rows the run trained on, not another shape
        if found:
            return found + sources.source_problems(cfg.model)
        from ddptune import model as model_lib

        return model_lib.model_problems(cfg.model, cfg.lora, cfg.train.method)

    launches = args.nproc is not None and not launch.in_launched_process()
    # torch's launcher imports torch while the job is checked (none for a job already refused)
    with launch.standby(launches and not problems, preload=WORKER_MODULES) as standby:
        if not launch.in_launched_process():  # here, before any process starts (--nproc's workers skip it: we did)
            problems = checked_once(not any(p.startswith("data.") for p in problems), tuple(problems))
        if problems:
            raise ConfigError(problems)
        if launches:
            child = ["eval", str(target), *args.overrides, "--out", str(out)] + (["--base"] if args.base else [])
            return launch.torchrun(args.nproc, ["ddptune", *child], standby=standby)
    return evaluate(cfg, run_dir, trained, out, checked_once)


def evaluate(cfg, run_dir: Path | None, trained: bool, out: Path, checked_once) -> int:
    """Every process: load the model (with the run's trained weights unless zero-shot), generate and score."""
    from ddptune import dist, generation, model as model_lib

    accelerator = dist.setup(cfg.train.precision)
    if not launch.validated_by_parent() and launch.in_launched_process():  # under torchrun or accelerate launch
        # rank 0 checks once; every process then fails with the same line (no traceback per rank)
        if problems := dist.on_main(accelerator, checked_once):
            raise ConfigError(problems)
    tokenizer = model_lib.load_tokenizer(cfg.model, cfg.data)
    t = cfg.train
    t0 = time.perf_counter()
    accelerator.print(f"ddptune: loading {cfg.model.source}" + (f" with {rundir.trained_weights_dir(run_dir, t.method)}" if trained else "")
                      + " ...")
    with accelerator.main_process_first():
        if trained:
            net = model_lib.load_trained(run_dir, cfg.model, t.method, accelerator.device, t.precision, t.seed)
        else:
            net = model_lib.load_model(cfg.model, t.method, accelerator.device, t.precision, t.seed)
    accelerator.print(f"ddptune: loaded in {time.perf_counter() - t0:.1f}s")
    label = f"fine-tuned ({rundir.trained_weights_dir(run_dir, t.method)})" if trained else "zero-shot"
    generation.evaluate(model=net, tokenizer=tokenizer, rows=generation.eval_rows(cfg.data, cfg.eval.max_samples), e=cfg.eval,
                        d=cfg.data, source=cfg.model.source, accelerator=accelerator, out_dir=out, label=label)
    if accelerator.is_main_process:
        report.write_json(out / SETTINGS, scored_with(cfg))
    accelerator.wait_for_everyone()
    return 0


SETTINGS = "settings.json"  # in an eval folder: the config keys its scores depend on (scored_with)
NO_SCORE = {"data.train", "data.train_rows", "eval.enabled", "eval.zero_shot"}  # keys that change no evaluation


def scored_with(cfg) -> dict:
    """The config keys an evaluation's scores depend on: the model, data and eval sections but for the training
    rows and evaluation's switches, as JSON reads them back."""
    flat = config_lib.flatten(config_lib.to_dict(cfg))
    kept = {k: v for k, v in flat.items() if k.split(".")[0] in ("model", "data", "eval") and k not in NO_SCORE}
    return json.loads(json.dumps(kept))


def folder_settings(folder: Path) -> dict | None:
    """What the evaluation in `folder` was scored with: its SETTINGS, or, for one a training run wrote (eval/,
    eval-base/), that run's config.yaml; None where neither can be read."""
    try:
        if (folder / SETTINGS).is_file():
            return json.loads((folder / SETTINGS).read_text(encoding="utf-8"))
        return scored_with(config_lib.load(folder.parent / "config.yaml"))
    except (OSError, ValueError, ConfigError):
        return None


def free_folder(out: Path, settings: dict) -> tuple[Path, str | None]:
    """`out`, unless it holds an evaluation scored with other settings: then the first of out-2, out-3, ... that
    holds none (or one of these settings), and a line naming the keys that differ. Nothing is overwritten."""
    first, n = out, 1
    found = folder_settings(out) if (out / "metrics.json").is_file() else settings
    if found == settings:
        return out, None
    while (out / "metrics.json").is_file() and folder_settings(out) != settings:
        n += 1
        out = first.with_name(f"{first.name}-{n}")
    differ = [k for k in settings if (found or {}).get(k) != settings[k]]
    keys = ", ".join(f"{k}={settings[k]!r}" for k in differ[:4]) or "its settings cannot be read"
    return out, f"{first} holds an evaluation with other settings (here {keys}): it stays; this one goes to {out}"


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
    """A row per evaluation of each path; a finished run whose trained model has none (eval off, or only
    `eval --base`) has a row of its training figures alone, its ROUGE columns None."""
    rows = []
    for p in map(Path, paths):
        if not p.exists():
            raise ConfigError([f"compare: {p} not found (give run folders or eval folders)"])
        found = find_metrics(p)
        if not found and not (p / "summary.json").is_file():
            raise ConfigError([f"compare: {p} holds no finished run (summary.json) and no evaluation "
                               "(give a folder written by ddptune train or ddptune eval)"])
        these = []
        for m in found:
            run = m.parent.parent if m.parent.name.startswith("eval") else m.parent
            summary = _read_json(run / "summary.json") if (run / "summary.json").is_file() else {}
            these.append(_compare_row(run, summary, m))
        if (p / "summary.json").is_file() and all(r["model"] != "fine-tuned" for r in these):
            these.insert(0, _compare_row(p, _read_json(p / "summary.json"), None))
        rows += these
    return rows


def _compare_row(folder: Path, summary: dict, metrics_path: Path | None) -> dict:
    """One compare row: the training figures of the run in `folder` and, with `metrics_path`, that evaluation's scores."""
    e = _read_json(metrics_path, ("label", *ROUGE_KEYS, "n", "generation_time_s")) if metrics_path else {}
    base = e.get("label") == "zero-shot"
    trained = {} if base else summary  # the base model was not trained: the run's training columns do not describe it
    return {
        "run": str(folder), "eval": metrics_path.parent.name if metrics_path else None,
        "scored_on": scored_on(folder_settings(metrics_path.parent), e["n"]) if metrics_path else None,
        "model": "zero-shot (base)" if base else "fine-tuned",
        "processes": trained.get("world_size"),
        **{k: trained.get(k) for k in ("global_batch", "steps", "final_loss", "val_loss", "train_time_s", "wall_time_s")},
        **{k: e.get(k) for k in (*ROUGE_KEYS, "n", "generation_time_s")},
    }


def scored_on(settings: dict | None, n: int) -> str:
    """The samples an evaluation scored, in words: "8 of demo rows 560:600" (the settings unknown: "8 of ?")."""
    if settings is None:
        return f"{n} of ?"
    val = settings.get("data.val")
    sources = [f"{s['source']}{' rows ' + s['rows'] if s.get('rows') else ''}" for s in val] if isinstance(val, list) else \
        [f"{val}{' rows ' + settings['data.val_rows'] if settings.get('data.val_rows') else ''}"]
    return f"{n} of {' + '.join(sources)}"


def mark_samples(rows: list[dict]) -> bool:
    """Whether every evaluated row scored the same samples; each row's `same_samples` says so (None: not evaluated)."""
    same = len({r["scored_on"] for r in rows if r["scored_on"] is not None}) <= 1
    for r in rows:
        r["same_samples"] = same if r["scored_on"] is not None else None
    return same


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
                   ("steps", "steps"), ("final_loss", "final loss"), ("val_loss", "val loss"), ("train_time_s", "train s"),
                   ("wall_time_s", "wall s"), ("rouge1", "ROUGE-1"),
                   ("rouge2", "ROUGE-2"), ("rougeL", "ROUGE-L"), ("rougeLsum", "ROUGE-Lsum"), ("n", "n"),
                   ("generation_time_s", "gen s")]


def compare_command(args) -> int:
    """`ddptune compare RUN ... [--json PATH] [--plot PNG]`."""
    return compare_main(args.runs, args.json, args.plot)


def compare_main(paths: list[str], json_path: str | None, plot_path: str | None = None) -> int:
    """Print the runs' table (ROUGE, loss, and a column for each config key whose value differs);
    optionally write it as JSON, and the runs' loss curves as a PNG."""
    for flag, value, example in (("--json", json_path, "compare.json"), ("--plot", plot_path, "losses.png")):
        if problems := rundir.report_file_problems(flag, value, example):
            raise ConfigError(problems)
    rows = compare_rows(paths)
    differing = config_differences(rows)
    same = mark_samples(rows)
    columns = COMPARE_COLUMNS[:2] + [(k, k) for k in differing] + COMPARE_COLUMNS[2:]
    columns += [] if same else [("scored_on", "scored on")]
    # a column no run has (ROUGE where evaluation was off, training figures of a base model) is left out
    print(report.markdown_table(rows, [c for c in columns if any(r.get(c[0]) is not None for r in rows)]))
    if not same:
        print("ddptune compare: note: the ROUGE rows were scored on different samples (the `scored on` column): "
              "compare them only with rows of the same samples", file=sys.stderr)
    if json_path:
        report.write_json(Path(json_path), rows)
    if plot_path:
        report.plot_losses(Path(plot_path), loss_curves(rows))
    for path in (p for p in (json_path, plot_path) if p):
        print(f"ddptune compare: wrote {path}", file=sys.stderr)
    return 0
