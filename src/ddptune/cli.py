"""The `ddptune` command line: parse, then hand over to one command module (train: through start.py).

    ddptune train CONFIG.yaml [key=value ...] [--nproc N] [--resume]
    ddptune eval RUN_DIR|CONFIG.yaml [key=value ...] [--nproc N] [--base]
    ddptune data CONFIG.yaml [key=value ...] [--show N] [--nproc N]
    ddptune compare RUN_DIR ... [--json PATH]
    ddptune scale CONFIG.yaml --nproc 1,2,4 [--mode same-per-device|same-global|both]
    ddptune plan CONFIG.yaml [key=value ...] [--gpus N] [--gpu-memory GiB] [--json PATH]
    ddptune export RUN_DIR OUT [--merge] [--dtype auto|bf16|fp32] [--format gguf [--outtype T] [--quantize K] [--ollama NAME]]
    ddptune predict RUN_DIR [FILE.jsonl|-] [key=value ...] [--out FILE] [--nproc N] [--max-new-tokens N]
                    [--temperature T [--top-p P] [--top-k K] [--seed S]]
    ddptune env

With --nproc the command re-runs itself in N processes through torchrun (a free port on this
host); under `accelerate launch` or `torchrun` leave --nproc out: the launcher has set the group.
A bad config fails here, before any process starts, with one line naming each field and its fix;
torch and transformers are imported only once a command needs them, so a refusal is quick.
`train` starts through start.py on every launch path: its run is admitted once and holds a lock
on its output_dir until it ends (lock.py), so a second run or --resume into the same folder is
refused with one line.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

from ddptune import checks, config as config_lib, launch
from ddptune.config import ConfigError


class UsageError(Exception):
    """A command line argparse cannot parse (raised instead of argparse's usage dump and exit)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every other refusal, instead of the usage text
        command = self.prog.removeprefix("ddptune").strip()
        raise UsageError(f"{command + ': ' if command else ''}{message} (see {self.prog} --help)")


def _parser(with_reference: bool = False) -> argparse.ArgumentParser:
    p = _Parser(prog="ddptune", description="Data-parallel LoRA/QLoRA/full fine-tuning for dialogue summarization.")
    p.add_argument("-V", "--version", action="store_true", help="print ddptune's version and exit")  # (answered in _main)
    sub = p.add_subparsers(dest="command", required=True)
    _train_parser(sub, with_reference)
    _eval_parser(sub)
    _compare_parser(sub)
    _scale_parser(sub)
    _plan_parser(sub)
    _export_parser(sub)
    _predict_parser(sub)
    _data_parser(sub)
    sub.add_parser("env", help="devices, interconnect and versions for a bug report", add_help=False)
    return p


def _train_parser(sub, with_reference: bool) -> None:
    """The arguments of `ddptune train`; with_reference: its --help lists every config key."""
    epilog = None
    if with_reference:  # `train --help` lists every config key
        from ddptune import configref

        epilog = "config keys (override any with section.key=value):\n" + configref.reference_text()
    t = sub.add_parser("train", help="fine-tune as a YAML config says", formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=epilog)
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.lr=1e-4")
    t.add_argument("--nproc", type=int, default=None, help="start N processes (one per GPU; CPU processes without GPUs)")
    t.add_argument("--resume", default=None, choices=["yes", "auto"], metavar="[auto]",
                   help="continue the run in output_dir from its newest checkpoint; --resume auto: start it when "
                        "output_dir holds no run, continue it when it holds an unfinished one (for requeued jobs)")
    t.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                   help="refuse to start when `ddptune plan` says the run will not fit GPUs of this size (on CUDA the check "
                        "always runs, against the GPU's free memory)")
    t.add_argument("--overwrite", action="store_true", help="delete a ddptune run's files in output_dir and start again")
    t.add_argument("--nnodes", type=int, default=1, help="machines in the job (run the same command on each, with its --node-rank)")
    t.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..nnodes-1; node 0 writes output_dir")
    t.add_argument("--master", default=None, metavar="HOST:PORT", help="node 0's address and a free port, reachable from every node")
    t.add_argument("--max-restarts", type=int, default=0,
                   help="restart the workers up to K times after one fails; they resume from the newest checkpoint")


def _eval_parser(sub) -> None:
    """The arguments of `ddptune eval`."""
    e = sub.add_parser("eval", help="generate summaries and score ROUGE")
    e.add_argument("target", help="a run folder (from train) or a YAML config")
    e.add_argument("overrides", nargs="*")
    e.add_argument("--nproc", type=int, default=None)
    e.add_argument("--base", action="store_true", help="the base model without adapter (zero-shot)")
    e.add_argument("--out", default=None, help="folder for predictions.jsonl and metrics.json")


def _compare_parser(sub) -> None:
    """The arguments of `ddptune compare`."""
    c = sub.add_parser("compare", help="ROUGE and loss of several runs side by side")
    c.add_argument("runs", nargs="+")
    c.add_argument("--json", default=None, help="also write the table's rows to this JSON file (replaced if it exists)")
    c.add_argument("--plot", default=None, metavar="PNG", help="draw the runs' training loss curves to this PNG (replaced if it exists)")


def _scale_parser(sub) -> None:
    """The arguments of `ddptune scale`."""
    s = sub.add_parser("scale", help="the same training at several process counts, and where the time goes")
    s.add_argument("config")
    s.add_argument("overrides", nargs="*")
    s.add_argument("--nproc", required=True, help="comma-separated process counts, e.g. 1,2,4")
    s.add_argument("--mode", choices=["same-per-device", "same-global", "both"], default="same-per-device",
                   help="same-per-device: the global batch grows with n; same-global: it stays; both: each (n = 1 shared)")
    s.add_argument("--out", default=None, help="output folder (default: <output_dir>-scale, or output_dir where its name ends in scale)")
    s.add_argument("--steps", type=int, default=None, help="measured steps of the largest batch (default 30)")
    s.add_argument("--warmup", type=int, default=None, help="steps of the largest batch before the measured window (default 3)")
    s.add_argument("--bandwidth-sizes", default="1MB,4MB,16MB,64MB,256MB,1GB", help="all-reduce sizes to time, or none (no predictions)")


def _plan_parser(sub) -> None:
    """The arguments of `ddptune plan`."""
    m = sub.add_parser("plan", help="predict peak memory per GPU before loading anything, and how to run it")
    m.add_argument("config")
    m.add_argument("overrides", nargs="*")
    m.add_argument("--gpus", type=int, default=1, help="GPUs to run on (default 1)")
    m.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                   help="memory of one GPU (default: this machine's GPU; without one, an H200's 139.8 GiB)")
    m.add_argument("--json", default=None, help="also write the plan as JSON to this file (replaced if it exists)")


def _export_parser(sub) -> None:
    """The arguments of `ddptune export`."""
    x = sub.add_parser("export", help="a run's adapter as a portable folder, or merged into its base (--merge)")
    x.add_argument("run", help="a finished run folder (from train)")
    x.add_argument("out", help="the folder to write (new or empty)")
    x.add_argument("--merge", action="store_true",
                   help="merge the adapter into the base: safetensors that AutoModelForCausalLM.from_pretrained loads alone")
    x.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="merged weights' dtype (with --merge, or for a full fine-tune); auto: the run's compute dtype here "
                        "(bf16 on GPU, fp32 on CPU)")
    x.add_argument("--format", choices=["safetensors", "gguf"], default="safetensors",
                   help="gguf: base + adapter merged into one GGUF file that llama.cpp and Ollama run as a chat model")
    x.add_argument("--outtype", choices=["bf16", "f16", "q8_0"], default=None, help="the GGUF file's weights (default bf16)")
    x.add_argument("--quantize", choices=["q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k"],
                   default=None, metavar="KQUANT", help="a K-quant (e.g. q4_k_m) of the GGUF file, made by llama.cpp's "
                   "llama-quantize or `ollama create -q`, whichever is on PATH")
    x.add_argument("--ollama", default=None, metavar="NAME",
                   help="also write an Ollama Modelfile (chat template, stop tokens, greedy) and print `ollama create NAME`")


def _predict_parser(sub) -> None:
    """The arguments of `ddptune predict`."""
    r = sub.add_parser("predict", help="summaries of new dialogues, or replies to conversations (JSON lines), with a "
                       "finished run's model")
    r.add_argument("run", help="a finished run folder (from train)")
    r.add_argument("overrides", nargs="*", metavar="INPUT|key=value",
                   help="a .jsonl file or - for stdin, of rows in the run's format: {\"dialogue\": ...} for a run trained on "
                   "dialogues, {\"messages\": [{\"role\": \"user\", \"content\": ...}]} (or its other chat formats) for one "
                   "trained on conversations (the reply to the last user turn); overrides such as eval.max_new_tokens=32")
    r.add_argument("--input", default=None, help="the .jsonl file, or - for stdin (default: stdin when it is piped)")
    r.add_argument("--out", default=None, help="write the JSON lines to this new file (default: stdout)")
    r.add_argument("--nproc", type=int, default=None, help="share the dialogues out over N processes")
    r.add_argument("--max-new-tokens", type=int, default=None, metavar="N", help="tokens generated per row at most "
                   "(default: the run's eval.max_new_tokens)")
    r.add_argument("--temperature", type=float, default=0.0, help="0: greedy, as eval (the default); above 0: sample "
                   "at this temperature")
    r.add_argument("--top-p", type=float, default=None, metavar="P", help="with --temperature: sample from the likeliest "
                   "tokens whose probabilities add up to P (default: the model's generation config)")
    r.add_argument("--top-k", type=int, default=None, metavar="K", help="with --temperature: sample from the K likeliest "
                   "tokens (default: the model's generation config, else 50)")
    r.add_argument("--seed", type=int, default=0, help="with --temperature: the seed of the sampling (the same texts "
                   "for any --nproc)")


def _data_parser(sub) -> None:
    """The arguments of `ddptune data`."""
    dt = sub.add_parser("data", help="check and tokenize the data as a run would, and show what is trained")
    dt.add_argument("config")
    dt.add_argument("overrides", nargs="*")
    dt.add_argument("--show", type=int, default=2, metavar="N", help="examples of each source to print, trained tokens marked")
    dt.add_argument("--nproc", type=int, default=1, metavar="N", help="the process count the run will have (its global "
                    "batch, and so the samples it draws from each source; default 1); starts nothing")

def main(argv: list[str] | None = None) -> int:
    """The command line (sys.argv without argv: the program itself, whose start its timings count from)."""
    started = launch.command_started(program=argv is None)
    try:
        code = _main(argv, started)
    except BrokenPipeError:  # `ddptune env | head`: the reader has gone, so there is no one left to tell
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit, when Python flushes
        code = 1
    if "ddptune.dist" in sys.modules:  # a finished command leaves its process group (NCCL warns at exit otherwise)
        sys.modules["ddptune.dist"].teardown()
    if argv is None:  # the program ends now: its exit skips a last sweep of every object torch and transformers
        gc.freeze()   # made, which took a training worker 6 s after its closing lines on a 2-core CPU
    return code


COMMANDS = {"eval": ("evaluate", "main"), "compare": ("evaluate", "compare_command"), "scale": ("scale", "main"),
            "export": ("export", "main"), "predict": ("predict", "main"), "plan": ("plan", "main"), "data": ("datacmd", "main")}


def _main(argv: list[str] | None, started: float) -> int:
    argv = _resume_flag(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        import importlib.metadata

        print(f"ddptune {importlib.metadata.version('ddptune')}")
        return 0
    if argv[:1] == ["env"]:
        from ddptune import env

        return env.main(argv[1:])
    parser = _parser(with_reference=argv[:1] == ["train"] and ("-h" in argv or "--help" in argv))
    try:
        args, extra = parser.parse_known_args(argv)
        # key=value overrides may also follow the flags (argparse stops collecting them at a flag);
        # so may predict's input (a file, or - for stdin)
        stray = [a for a in extra if (a.startswith("-") or "=" not in a or not hasattr(args, "overrides"))
                 and not (args.command == "predict" and (a == "-" or not a.startswith("-")))]
        if stray:
            parser.error(f"unrecognized arguments: {' '.join(stray)}")
    except UsageError as e:
        return _refuse(e)
    if extra:
        args.overrides += extra
    try:
        if args.command == "train":  # started on every launch path by start.py; each process trains through _train_run
            from ddptune import start

            return start.train(args, started, _train_run)
        if args.command == "scale":  # what needs only the arguments and the config: answered before torch
            from ddptune import scaling

            scaling.parse_counts(args.nproc)
            if problems := checks.check_values(config_lib.load(args.config, list(args.overrides))):
                raise ConfigError(problems)
        import importlib

        module, function = COMMANDS[args.command]
        return getattr(importlib.import_module(f"ddptune.{module}"), function)(args)
    except ConfigError as e:
        return _refuse(e)


def _resume_flag(argv: list[str]) -> list[str]:
    """`--resume` alone means `--resume=yes`; `--resume auto` is `--resume=auto` (what follows a bare
    --resume is an override or the next flag, never its value)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--resume":
            auto = argv[i + 1:i + 2] == ["auto"]
            out.append("--resume=auto" if auto else "--resume=yes")
            i += 2 if auto else 1
            continue
        out.append(argv[i])
        i += 1
    return out


def _refuse(e: Exception) -> int:
    """Bad input: one line on stderr, exit 2, whichever launcher started this process (none,
    --nproc, torchrun, accelerate launch). Every process meets the same bad input (each reads the
    same command line and config; what rank 0 alone checks reaches the others through
    dist.on_main), so rank 0 alone says it, once. Each process that meets it also leaves it for the
    launcher's closing report. Under torchrun or accelerate launch that report follows: the
    launcher's own traceback and a table of failed ranks whose root cause shows this line; the
    launcher exits 1. With --nproc, ddptune's launcher prints only a line that rank 0 did not (one a
    single other process met, or any line on another node) and exits 2."""
    line = f"ddptune: {e}"
    if launch.is_main_process():
        print(line, file=sys.stderr)
    launch.tell_launcher(line)
    return 2


def _train_run(cfg, **kwargs):
    """train.run for start.py, which imports no command: train (torch, transformers) is imported once a
    process trains, after its run was admitted, so that a refusal stays quick."""
    from ddptune import train

    return train.run(cfg, **kwargs)
