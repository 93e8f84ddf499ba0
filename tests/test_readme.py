"""The README's "Using it" and "`scale` and `plan`" sections work as written. Every command in its code blocks is either run
here, in order and in-process through `ddptune.cli.main` as the shell would call it, or named in SKIP
with the reason (a skipped run that later lines read has a stand-in, STAND_IN); a line with placeholders (CONFIG, RUN, [--optional]) is a synopsis, not run. Every flag a
line names must be one its command's --help lists, a `$` example must print what the README shows
(`...` stands for anything), and the Python example runs. A command added to the section without a
decision here, or a SKIP entry the section no longer holds, fails the test."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
import sys

import pytest
import torch

from conftest import ROOT
from ddptune import cli

# command as written -> why it is not run here
SKIP = {
    "ddptune train configs/tiny.yaml": "30 steps of training, slow beside other work (tests/test_train.py trains tiny end to end)",
    "ddptune train configs/tiny.yaml --nproc 2 output_dir=runs/tiny-2": "a 2-process training run (tests/test_console.py runs one)",
    "ddptune train configs/demo.yaml train.lr=5e-4 output_dir=runs/x": "minutes of training (make demo); the Python example's tiny run stands in",
    "accelerate launch --config_file configs/accelerate/2gpu.yaml -m ddptune train configs/samsum_qlora_llama31_8b.yaml":
        "2 GPUs, and SAMSum from the hub",
    "ddptune env": "its bandwidth figure starts 2 processes for 10-20 s here (tests/test_env.py); run with --no-bandwidth",
}
RUN_INSTEAD = {"ddptune env": ["env", "--no-bandwidth"]}
# a skipped command -> (the folder the Python example trains, copied to the folder it would write), so
# that the commands after it read a finished run of the same format (the demo dialogues) at no cost
STAND_IN = {"ddptune train configs/demo.yaml train.lr=5e-4 output_dir=runs/x": ("runs/api", "runs/x")}
SYNOPSIS = re.compile(r"\[|\b[A-Z]{2,}\b")  # [--optional] or a placeholder such as CONFIG, RUN, OUT


def using_it() -> str:
    """The README's "Using it" section, and its "`scale` and `plan`" section's examples."""
    text = (ROOT / "README.md").read_text()
    sections = []
    for title in ("\n## Using it\n", "\n## `scale` and `plan`\n"):
        start = text.index(title)
        sections.append(text[start:text.index("\n## ", start + 1)])
    return "\n".join(sections)


def examples(section: str) -> tuple[list[tuple[str, list[str] | None]], list[str]]:
    """(command, its shown output or None) for each command line; the Python blocks' code."""
    commands, python = [], []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", section, re.S):
        if lang == "python":
            python.append(body)
        elif lang == "bash":
            lines = [re.split(r"\s+#\s", l)[0].strip() for l in body.splitlines()]
            commands += [(l, None) for l in lines if l and not l.startswith("#")]
        else:  # `$ command` and what it prints, up to the next `$`
            for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
                command, *shown = chunk.strip().splitlines()
                commands.append((command.strip(), shown))
    return commands, python


def ddptune_argv(command: str) -> list[str] | None:
    """The arguments ddptune gets from this shell line (after `| ddptune`, `-m ddptune` or `ddptune`)."""
    words = shlex.split(command.split(" | ")[-1])
    for i, w in enumerate(words):
        if w == "ddptune" and (i == 0 or words[i - 1] == "-m"):
            return words[i + 1:]
    return None


def piped(command: str) -> str | None:
    """What `echo '...' | ddptune ...` hands ddptune on stdin; None for a command without a pipe."""
    if " | " not in command:
        return None
    words = shlex.split(command.split(" | ")[0])
    assert words[0] == "echo", command
    return " ".join(words[1:]) + "\n"


def call(argv: list[str], stdin: str | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.MonkeyPatch.context() as mp:
        if stdin is not None:
            mp.setattr(sys, "stdin", io.StringIO(stdin))
        try:
            code = cli.main(argv)
        except SystemExit as e:  # --help
            code = e.code
    return code, out.getvalue(), err.getvalue()


def shown_matches(shown: list[str], printed: list[str]) -> bool:
    patterns = [".*".join(map(re.escape, line.split("..."))) for line in shown]
    return len(patterns) == len(printed) and all(re.fullmatch(p, l) for p, l in zip(patterns, printed))


def test_every_command_of_using_it_runs_as_written(monkeypatch, tmp_path):
    # in order, from a folder of their own that holds the repository's configs/, as from a fresh clone's root
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    commands, python = examples(using_it())
    assert len(commands) > 15 and python, "the section's code blocks were not found"
    assert not set(SKIP) - {c for c, _ in commands}, "SKIP names commands the README no longer shows"
    for code in python:  # the Python example first: its run (runs/api) is the stand-in's
        exec(compile(code, "README.md (From Python)", "exec"), {})
    assert (tmp_path / "runs" / "api" / "adapter").is_dir()
    helps = {"": call(["--help"])[1]}
    ran = []
    for command, shown in commands:
        argv = ddptune_argv(command)
        assert argv is not None or command in SKIP, f"not a ddptune command, and not in SKIP: {command}"
        if argv is None:
            continue
        name = argv[0] if argv and not argv[0].startswith("-") else ""
        if name not in helps:
            code, out, _ = call([name, "--help"])
            assert code == 0 and out.startswith(f"usage: ddptune {name}"), (command, out)
            helps[name] = out
        for flag in {w.strip("[]").split("=")[0] for w in argv if w.strip("[").startswith("--")}:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}\b", helps[name]), f"{command}: `ddptune {name} --help` has no {flag}"
        if SYNOPSIS.search(command):
            continue
        if command in STAND_IN:
            shutil.copytree(*STAND_IN[command])
        if command in SKIP and command not in RUN_INSTEAD:
            continue
        code, out, err = call(RUN_INSTEAD.get(command, argv), piped(command))
        printed = (out + err).strip().splitlines()
        if shown is None:
            assert code == 0, f"{command}: exit {code}\n{err[-2000:]}"
        elif not torch.cuda.is_available():  # ddptune plan sizes for this machine's GPU when there is one
            error = shown[0].startswith("ddptune: invalid config:")
            assert code == (2 if error else 0) and shown_matches(shown, printed), \
                f"{command}: exit {code}, printed\n" + "\n".join(printed) + "\nREADME shows\n" + "\n".join(shown)
        ran.append(command)
    assert "ddptune --version" in ran and any(c.startswith("ddptune plan") for c in ran), ran
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()  # the export of runs/x
    for name in set(re.search(r"\{([\w,]+)\}", helps[""]).group(1).split(",")) - set(helps):  # every other --help
        assert call([name, "--help"])[0] == 0, name


def test_every_run_folder_an_example_reads_is_one_an_earlier_example_writes():
    """On a fresh clone the examples run in order: a runs/NAME that a command reads was written by an
    example above it (output_dir=runs/NAME), not by make demo, whose folder is named by the time."""
    commands, python = examples(using_it())
    written, unread = set(), []
    code = [re.split(r"\s+#\s", line)[0] for body in python for line in body.splitlines()]  # its comments show output
    for command in [c for c, _ in commands] + code:
        named = re.findall(r"(output_dir=)?(runs/[\w.-]+)", command)
        unread += [path for out, path in named if not out and path not in written]
        written |= {path for out, path in named if out}
    assert written and unread == [], unread


def test_each_training_example_writes_a_folder_no_earlier_example_trained_into():
    """A run into a folder that holds a finished run is refused unless --resume or --overwrite says
    what to do with it, so on a fresh clone each training example writes a folder of its own (its
    output_dir= override, else its config's)."""
    from ddptune import config

    folders = []
    for command, shown in examples(using_it())[0]:  # shown: a `$` example's output (a refusal), not a run
        argv = ddptune_argv(command)
        if argv and argv[0] == "train" and shown is None and not SYNOPSIS.search(command) and not {
                "--resume", "--overwrite"} & set(argv):
            overrides = [a for a in argv[2:] if "=" in a and not a.startswith("-")]
            folders.append(config.load(ROOT / argv[1], overrides).output_dir)
    assert len(folders) >= 3 and len(set(folders)) == len(folders), folders


def test_what_the_commands_write_is_ignored_by_git():
    import subprocess

    for path in ("runs/x/adapter/adapter_model.safetensors", "out/merged/model.safetensors"):
        assert subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", path]).returncode == 0, path
