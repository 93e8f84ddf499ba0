"""Shared helpers: run the real CLI in subprocesses (real launcher, real gloo processes)."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# where the workers of launch.torchrun find ddptune and this folder's worker modules (envworker, cudaworker, ...)
WORKER_PATH = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
SHARED_DATA = ROOT.parent / "shared" / "data"


def ddptune(*args: str, timeout: float = 600, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run `python -m ddptune ARGS` and return the finished process (output captured)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if "--nproc" not in args:  # one process takes every core, as in-process runs here do (the launcher shares them out)
        env.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "ddptune", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def answer_ids(tok, text: str) -> list[int]:
    """What an answer trains (a dialogue's summary, an assistant turn): its text's ids, then the end
    its template writes after it, each spelled out here: the tokenizer's end-of-sequence token without
    a template, '<|end|>' and a newline for the tests' own templates, SmolLM2's '<|im_end|>' and a newline."""
    ids = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    if not getattr(tok, "chat_template", None):
        end = [tok.convert_tokens_to_ids("<|eos|>")]
    elif "<|end|>" in tok.chat_template:
        end = ids("<|end|>\n")
    else:
        end = [tok.convert_tokens_to_ids("<|im_end|>")] + ids("\n")
    assert len(end) >= 1 and None not in end and tok.unk_token_id not in end
    return ids(text) + end


def field(line: str) -> str:
    """The field a line of ddptune's names first, the code a refusal or a warning is known by: its text
    before the first ': ', after 'ddptune: ', 'warning: ' and 'invalid config: ' (the rest is the fix, in words)."""
    text = line.strip()
    for prefix in ("ddptune: ", "warning: ", "invalid config: "):
        text = text.removeprefix(prefix)
    return text.split(": ", 1)[0]


def words(line: str) -> set[str]:
    """The values a line names (paths, numbers, names, flags), split at spaces and the punctuation around them."""
    return set(re.split(r"[\s,;()]+|:(?=\s)", line)) - {""}


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def peak_allocated(fn):
    """fn()'s value and the most Python memory it held at once, in bytes (tracemalloc): what a test of
    work that must stay small bounds, since a busy machine changes its seconds but not this."""
    import tracemalloc

    tracemalloc.start()
    try:
        value = fn()
        return value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@contextlib.contextmanager
def umask(mask: int):
    """This process's umask set to `mask` meanwhile (what files and folders it creates then get)."""
    saved = os.umask(mask)
    try:
        yield
    finally:
        os.umask(saved)


def unreadable(folder: Path) -> list[str]:
    """What in `folder` (itself included) others cannot read: files without read for group and
    other, folders without read and search for them; each as 'MODE PATH'. Symlinks are not followed."""
    found = []
    for p in [folder, *folder.rglob("*")]:
        need = 0o055 if p.is_dir() else 0o044
        if not p.is_symlink() and p.stat().st_mode & need != need:
            found.append(f"{p.stat().st_mode & 0o777:o} {p}")
    return found


def adapter_folder(folder: Path) -> None:
    """What a finished LoRA run leaves in `folder` as far as the commands check before loading: an adapter config,
    its tensors (one adapted q_proj of rank 8) and the tokenizer beside them."""
    import torch
    from safetensors.torch import save_file

    from ddptune import model as model_lib

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                            "target_modules": ["q_proj"]}))
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{q}.lora_A.weight": torch.zeros(8, 4), f"{q}.lora_B.weight": torch.zeros(4, 8)},
              str(folder / "adapter_model.safetensors"))
    model_lib.byte_tokenizer().save_pretrained(folder)


@contextlib.contextmanager
def checkpoints_kept():
    """Runs that finish meanwhile, in this process, keep their checkpoints, as a run killed right
    after saving its final weights does: what tests cut the folder of a run that died midway from."""
    from ddptune import saving

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(saving, "remove_checkpoints", lambda out: None)
        yield


from ddptune import launch  # noqa: E402

measured_busy_cores = launch.busy_cores  # the real measurement, for the tests of it


@pytest.fixture(scope="session", autouse=True)
def _threads_as_torch_sets_them():
    """In-process runs take a fixed share of the cores, whatever else this machine runs meanwhile:
    tests compare runs bit for bit, and a thread count that followed the load between two runs
    would change the order of their sums. The share is the cores over the test workers
    (multiproc.xdist_workers): with more threads than cores, spinning OpenMP threads wait on each
    other (a 3-step tiny run trained in 4.4 s with 2 threads beside another worker on 2 cores, 1.2 s with 1)."""
    import multiproc

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "busy_cores", lambda seconds=0.2: float(cores - max(1, cores // multiproc.xdist_workers())))
        yield


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Preset checkpoints go to a temporary cache shared by the whole test run, never the user's."""
    monkeypatch.setenv("DDPTUNE_CACHE", str(tmp_path_factory.getbasetemp() / "ddptune-cache"))


@contextlib.contextmanager
def gguf_parsed_once(name_map: bool = False):
    """gguf's reader parses each GGUF file's header once: transformers parses SmolLM2's whole header
    (its 49k-token vocabulary, 6 s of a 2-core CPU) for every config, tokenizer and weights it reads
    from the file. The file is mapped read-only, and every read still maps and dequantizes its own
    tensors from it. `name_map`: gguf's tensor-name map of an architecture is built once too
    (transformers' loader builds it again for each of a model's modules). Yields the readers made."""
    import gguf

    real, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:  # a patch of its own: test_gguf_cache undoes its monkeypatch midway
        mp.setattr(gguf, "GGUFReader", reader)
        if name_map:
            mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        yield readers


@pytest.fixture
def parsed_once():
    """gguf_parsed_once for one test."""
    with gguf_parsed_once() as readers:
        yield readers


# One tiny run that faults and restarts are measured against (test_faults, test_launch): 2 processes,
# dropout 0, a checkpoint every 2 steps (checkpoints change no result).
UNBROKEN_ARGS = ["train.max_steps=60", "data.val=null", "lora.dropout=0.0", "train.save_every=2"]


def _train_tiny_to_the_end(overrides: list[str]) -> None:
    from ddptune import config, train

    train.run(config.load(ROOT / "configs" / "tiny.yaml", overrides))


@pytest.fixture(scope="session")
def unbroken(tmp_path_factory) -> dict:
    """The adapter of that run, never interrupted (in-process gloo ranks)."""
    import multiproc
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("unbroken") / "run"
    multiproc.run(_train_tiny_to_the_end, 2, [*UNBROKEN_ARGS, f"output_dir={out}"])
    return load_file(out / "adapter" / "adapter_model.safetensors")
