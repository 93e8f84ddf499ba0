"""Data at scale: generated chat rows prepared for training, and what training processes hold of them.

    python benchmarks/data_scale.py --tokenizer TOKENIZER_DIR --rows 100000,1000000 [--before TREE]
        [--before-rows 100000] [--nproc 1,2,8] [--samsum PATH] [--check] --out benchmarks/results/NAME.json

For each row count (and each of --kinds), one JSON-lines file of distinct rows made from SAMSum's
validation rows: conversations (a system turn, the user's instruction and dialogue ending in the row's
own number, the summary as the assistant's reply), or dialogue rows of the same dialogues and summaries. TOKENIZER_DIR is SmolLM2's tokenizer (the demo model's), saved with save_pretrained.
Each tree (this checkout, and --before's, an older commit's worktree, for row counts up to
--before-rows) runs with its own src/ on PYTHONPATH and its own empty DDPTUNE_CACHE:
- prepare: `ddptune data` on the file (every row checked and tokenized as its training does): the
  rows/s it reports (its time after the tokenizer's load), and its wall time; for this checkout the
  store's bytes a token, then the same command again (the store found made); with
  --before-no-threads, the older tree's command again into an empty cache with the tokenizer's own
  threads off (TOKENIZERS_PARALLELISM=false), as they are in this checkout's workers; with
  --json-list, the same rows written as one JSON list (`[row, row, ...]`) prepared into an empty cache,
  and with --gzip, the JSON-lines file gzipped (.jsonl.gz), likewise;
- hold: at each --nproc, that many processes joined over gloo do with the data what a training
  process does before its first step (this checkout: tokenized.load, the step stream and its first
  step; the older one: data.load), after one of them prepared it; each reports its anonymous (not
  file-backed) memory taken by that, from /proc, and its peak resident memory; this checkout's then
  make what CUDA graphs are prepared from for an epoch (graphs.Layout: every step surveyed, shared out
  over the processes where the tree does so, 2 lengths), and report its seconds and the anonymous
  memory held with it;
- train: `ddptune train --nproc N` at the largest --nproc on CPU processes, preset:smollm2-135m
  (random weights in SmolLM2's shape and vocabulary), one optimizer step of one sample a process, from
  an empty cache and then again: seconds from launch to the first step's line in metrics.jsonl, the
  step's own time (its step_time_s) and their difference, launch to the start of the loop, with the
  run's own split of that time (summary.json's start-up, with its parts, and loading); then the same launch on the
  file's first 4,000 rows, its store made (the second of two runs): what the launch costs whatever
  the data;
- cores (--cores K,...): the tokenizing work alone, in this process's checkout (tokenized.work on
  the first --cores-rows rows, in the chunks preparation hands its workers), done whole by each of K
  forked processes at once: rows/s over all K, what K cores give this work without a row read, sent
  or written; and first, in this process, µs a row of that work and of its parts (`parts`);
- check (--check): the store's content check that every run's preparation makes before it trusts a
  store (store.inspect: each file's crc32 against meta.json, then its bounds: ids inside the
  vocabulary, masks 0 or 1, examples in order inside ids.bin), timed in this process on the store
  `prepare` made: first from the disk (each file's pages dropped from the page cache), then from the
  page cache (least of 3), each file's crc32 and the bounds alone, and what each training process
  checks on opening it (sizes, the index's shape); with the machine's other load at the time;
- the anchor, in this process: Hugging Face datasets' `Dataset.from_json`, then `map(batched=True,
  num_proc=cores)` with the tokenizer's batched `apply_chat_template(tokenize=True)`: rows/s of each.
Each figure is printed, and written to --out, as soon as it is measured: a command stopped at a time
limit keeps what it had measured.
"""
from __future__ import annotations

import argparse
import gzip
import inspect
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddptune import provenance

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a careful assistant who summarizes conversations."
INSTRUCTION = "Summarize the following dialogue."
SMALL = 4000  # rows of the small launch beside each train run


def make_rows(samsum: Path, n: int, path: Path, kind: str = "chat") -> None:
    """n distinct rows from SAMSum's: conversations (a system turn, the instruction and dialogue, the
    summary as the reply) or dialogue rows (`dialogue`, `summary`), each dialogue ending in its number."""
    base = json.loads(samsum.read_text())
    with open(path, "w") as f:
        for i in range(n):
            r = base[i % len(base)]
            dialogue = f"{r['dialogue']}\n(conversation {i})"
            row = {"dialogue": dialogue, "summary": r["summary"]} if kind == "dialogue" else {"messages": [
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{INSTRUCTION}\n\n{dialogue}"},
                {"role": "assistant", "content": r["summary"]}]}
            f.write(json.dumps(row) + "\n")


def env_of(tree: Path, cache: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(tree / "src"), HF_HUB_OFFLINE="1", DDPTUNE_CACHE=str(cache),
                CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")


def prepare(tree: Path, args, data: Path, cache: Path, threads: bool = True) -> dict:
    """`ddptune data` on the file: wall seconds, the tokenizer's load, rows/s of the rest (`threads`
    false: the tokenizer's own threads off, TOKENIZERS_PARALLELISM=false)."""
    cmd = [sys.executable, "-m", "ddptune", "data", str(ROOT / "configs" / "demo.yaml"), *overrides(data, args)]
    started = time.perf_counter()
    env = env_of(tree, cache) if threads else dict(env_of(tree, cache), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(f"{tree}: ddptune data: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    rate = re.search(r"rows (?:checked and tokenized|found tokenized) in ([0-9.]+)s \((?:([0-9,]+) rows/s)?", proc.stderr)
    if rate is None:
        raise SystemExit(f"{tree}: ddptune data said no rate:\n{proc.stderr[-2000:]}")
    rows = sum(int(c) for c in re.findall(r"^\| train \| \S+ \| \S+ \| (\d+) \|", proc.stdout, re.M))
    return {"wall_s": round(wall, 2), "rows": rows, "seconds": float(rate.group(1)),
            "rows_per_s": int(rate.group(2).replace(",", "")) if rate.group(2) else None,
            "table": proc.stdout.splitlines()[2:5]}


def store_bytes(cache: Path) -> dict:
    metas = [json.loads(p.read_text()) for p in (cache / "tokens").glob("*/meta.json")]
    tokens, size = sum(m["tokens"] for m in metas), sum(sum(m["bytes"].values()) for m in metas)
    return {"store_tokens": tokens, "store_bytes": size, "bytes_per_token": round(size / max(tokens, 1), 3)}


def as_json_list(lines: Path, path: Path) -> None:
    """The rows of a JSON-lines file written as one JSON list, a row a line."""
    with open(lines) as f, open(path, "w") as g:
        g.write("[\n")
        for k, line in enumerate(f):
            g.write((",\n" if k else "") + line.rstrip("\n"))
        g.write("\n]\n")


def check(cache: Path) -> dict:
    """The content check of each store in `cache` (module docstring), in seconds."""
    from ddptune import launch
    from ddptune.data import store

    def timed(fn) -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    def least(fn, n: int = 3) -> float:
        return round(min(timed(fn) for _ in range(n)), 3)

    load = {"load_avg_1m": round(os.getloadavg()[0], 2), "busy_cores": round(launch.busy_cores(1.0), 2)}
    stores = []
    for folder in sorted(p.parent for p in (cache / "tokens").glob("*/meta.json")):
        meta = json.loads((folder / "meta.json").read_text())
        for name in store.FILES:  # from the disk: none of its pages cached (a store made or read long before)
            fd = os.open(folder / name, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        started = time.perf_counter()
        found = store.inspect(folder)
        cold = time.perf_counter() - started
        if not isinstance(found, store.Store):
            raise SystemExit(f"{folder}: {found}")
        opened = store.Store(folder, meta)
        size = sum(meta["bytes"].values())
        crc = {name: least(lambda: store.checksum(folder / name)) for name in store.FILES}
        stores.append({"examples": meta["examples"], "tokens": meta["tokens"], "bytes": size, "dtype": meta["dtype"],
                       "whole_from_disk_s": round(cold, 3), "whole_cached_s": least(lambda: store.inspect(folder)),
                       "crc32_s": crc, "crc32_cached_gb_per_s": round(size / sum(crc.values()) / 1e9, 2),
                       "bounds_s": least(lambda: store.damage(opened)),
                       "on_open_s": least(lambda: store.inspect(folder, whole=False))})
    return {"stores": stores, "other_load_before": load,
            "other_load_after": {"load_avg_1m": round(os.getloadavg()[0], 2), "busy_cores": round(launch.busy_cores(1.0), 2)}}


def overrides(data: Path, args) -> list[str]:
    return ["model.source=preset:smollm2-135m", f"model.tokenizer={args.tokenizer}", f"data.train={data}",
            "data.train_rows=null", "data.val=null", "data.max_length=512", "eval.enabled=false"]


def cores(args, data: Path, row: dict, save) -> None:
    """tokenized.work on the file's first --cores-rows rows, whole, in each of K forked processes at
    once (the tokenizer's own threads off, as in preparation's workers, and on again after); before
    that, in this process, the same rows' work timed in its parts (`parts`). Each figure goes into
    `row`, then `save()`."""
    from unittest import mock

    with mock.patch.dict(os.environ, TOKENIZERS_PARALLELISM="false"):
        _cores(args, data, row, save)


def _cores(args, data: Path, row: dict, save) -> None:
    import multiprocessing

    from transformers import AutoTokenizer

    from ddptune import config, data as data_lib
    from ddptune.data import rows as rows_lib, tokenized

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    d = config.load(ROOT / "configs" / "demo.yaml", overrides(data, args)).data
    job = tokenized.Job("data.train", str(data), data_lib.format_of(str(data), d), d)
    chunks = list(rows_lib.chunks(str(data), range(min(args.cores_rows, rows_lib.count(str(data))))))
    n = sum(map(len, chunks))
    tokenized.work(job, tok, chunks[0])
    timed = parts(job, tok, chunks)
    print(json.dumps({"parts_us_a_row": timed}), flush=True)
    context, out = multiprocessing.get_context("fork"), []
    row.update(processes=out, parts_us_a_row=timed)
    for k in (int(c) for c in args.cores.split(",")):
        go = context.Barrier(k + 1)
        procs = [context.Process(target=_all_chunks, args=(go, job, tok, chunks)) for _ in range(k)]
        for proc in procs:
            proc.start()
        go.wait()
        started = time.perf_counter()
        for proc in procs:
            proc.join()
        wall = time.perf_counter() - started
        out.append({"processes": k, "rows_each": n, "wall_s": round(wall, 2), "rows_per_s": round(k * n / wall)})
        print(json.dumps({"cores": out[-1]}), flush=True)
        save()


def parts(job, tok, chunks: list) -> dict:
    """µs a row (the least of three times), in this process, of the whole work and of its parts: reading,
    checking and normalising a row; rendering its pieces through the chat template; the tokenizer's batched
    encoding of them; the examples made from them (the encoding again, the cut rows' segments, the masks);
    the arrays of the store."""
    import gc

    from ddptune import data as data_lib
    from ddptune.data import chat, rows as rows_lib, tokenized, tokens

    n, d = sum(map(len, chunks)), job.d

    def us(fn, items) -> float:  # fn of each chunk's items, its result let go as a worker's is
        took = []
        for _ in range(3):
            started = time.perf_counter()
            for item in items:
                fn(item)
            took.append(time.perf_counter() - started)
        return round(min(took) / n * 1e6, 1)

    rows = [[data_lib.normalise(rows_lib.parse(item, k), k, job.fmt, d) for k, item in c] for c in chunks]
    pieces = [[chat.pieces(tok, r["messages"], d.loss_on) for r in c] for c in rows]
    examples = [chat.tokenize_many(tok, p, d.max_length, [r["messages"] for r in c]) for p, c in zip(pieces, rows)]
    gc.freeze()  # what is held for the parts, out of the collector's way: a worker holds one chunk's
    try:
        return {"work": us(lambda c: tokenized.work(job, tok, c), chunks),
                "rows": us(lambda c: [data_lib.row_problem(row := rows_lib.parse(item, k), job.fmt, d)
                                      or data_lib.normalise(row, k, job.fmt, d) for k, item in c], chunks),
                "render": us(lambda c: [chat.pieces(tok, r["messages"], d.loss_on) for r in c], rows),
                "encode": us(lambda p: tokens.many_ids(tok, [t for ps in p for t, _ in ps]), pieces),
                "examples": us(lambda pc: chat.tokenize_many(tok, pc[0], d.max_length, [r["messages"] for r in pc[1]]),
                               list(zip(pieces, rows))),
                "arrays": us(lambda e: tokenized.as_arrays(e, list(range(len(e)))), examples)}
    finally:
        gc.unfreeze()


def _all_chunks(go, job, tok, chunks) -> None:
    from ddptune.data import tokenized

    go.wait()
    for chunk in chunks:
        tokenized.work(job, tok, chunk)


def anchor(args, data: Path) -> dict:
    """datasets + the tokenizer's batched chat template, as TRL-style trainers prepare chat rows."""
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    with tempfile.TemporaryDirectory() as hf:
        t0 = time.perf_counter()
        ds = datasets.Dataset.from_json(str(data), cache_dir=hf)
        t1 = time.perf_counter()
        ds.map(lambda b: {"input_ids": tok.apply_chat_template(b["messages"], tokenize=True, return_dict=False)},
               batched=True, num_proc=len(os.sched_getaffinity(0)), remove_columns=["messages"])
        t2 = time.perf_counter()
    return {"from_json_s": round(t1 - t0, 2), "from_json_rows_per_s": round(len(ds) / (t1 - t0), 1),
            "map_s": round(t2 - t1, 2), "map_rows_per_s": round(len(ds) / (t2 - t1), 1), "num_proc": len(os.sched_getaffinity(0))}


def status(pid: int) -> dict:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, v in re.findall(r"^(VmHWM|RssAnon):\s+(.+)$", text, re.M)}


def descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def anon_bytes() -> int:
    return status(os.getpid()).get("RssAnon", 0)


def hold_worker(args) -> None:
    """One of --nproc processes (under torch.distributed.run): what a training process does with the
    data before its first step, and the anonymous memory that took (this process's)."""
    import gc

    from accelerate import Accelerator

    from ddptune import batches, config, memory, metrics, model as model_lib

    acc = Accelerator(cpu=True)
    tok = model_lib.load_tokenizer(config.ModelConfig(source="preset:smollm2-135m", tokenizer=args.tokenizer))
    flops = metrics.FlopModel.of_shape(memory.shape_of(model_lib.preset_config("smollm2-135m", "sdpa")), "lora", 16,
                                       ["q_proj", "k_proj", "v_proj", "o_proj"])
    d = config.DataConfig(train=args.hold, max_length=512)
    gc.collect()
    before = anon_bytes()
    try:
        from ddptune import dist, graphs
        from ddptune.data import tokenized
    except ImportError:  # an older tree: its main process tokenizes into a cache the others read
        from ddptune import data

        cache = Path(os.environ["DDPTUNE_CACHE"]) / "old-cache"
        with acc.main_process_first():
            if acc.is_main_process:
                data.prepare(d, tok, cache)
        train, _ = data.load(d, tok, cache)
        costs = [flops.sample(len(e["input_ids"]), batches.target_tokens([e])) for e in train]
        targets = [batches.target_tokens([e]) for e in train]
        graphs = None
    else:
        train, _ = tokenized.load(dist.on_node(acc, lambda: tokenized.prepare(d, tok)))
        costs, targets = flops.sample(train.lengths, train.targets), train.targets
    stream = batches.Stream(examples=train, costs=costs, targets=targets, global_batch=8 * acc.num_processes,
                            parts=acc.num_processes, seed=0, packing=True, micro_batch_size=8, tokens_per_forward=4096,
                            max_length=512)
    stream.share(0)
    gc.collect()
    held, row = anon_bytes() - before, {"rank": acc.process_index, "examples": len(train)}
    if graphs:  # this checkout: what CUDA graphs are prepared from, for an epoch (Layout, 2 lengths)
        t, epoch = time.perf_counter(), -(-len(train) // stream.global_batch)
        params = inspect.signature(graphs.Layout.of).parameters
        shared = {"gather": dist.gather} if "gather" in params else {}  # as training
        if "sizes" in params:  # the decider's padded lengths given: the layout surveys the run's steps alone
            layout = graphs.Layout.of(stream, 0, epoch, (), True, acc.process_index, **shared)
        else:
            layout = graphs.Layout.of(stream, 0, epoch, 2, True, acc.process_index, epoch, **shared)
        row.update(layout_s=round(time.perf_counter() - t, 2), layout_steps=epoch, layout_lengths=list(layout.stream.graph_lengths))
        gc.collect()
        row["with_layout_anon_gib"] = round((anon_bytes() - before) / 2**30, 4)
    Path(args.hold_out, f"rank{acc.process_index}.json").write_text(json.dumps(
        {**row, "data_anon_gib": round(held / 2**30, 4), "peak_rss_gib": round(status(os.getpid())["VmHWM"] / 2**30, 4)}))
    acc.wait_for_everyone()


def hold(tree: Path, args, data: Path, cache: Path, nproc: int, work: Path) -> dict:
    out = work / f"hold-{tree.name}-{nproc}-{time.monotonic_ns()}"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
           str(Path(__file__).resolve()), "--tokenizer", args.tokenizer, "--hold", str(data), "--hold-out", str(out), "--out", "-"]
    proc = subprocess.run(cmd, cwd=tree, env=dict(env_of(tree, cache), OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{tree}: hold at {nproc}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    ranks = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    return {"nproc": nproc, "examples": ranks[0]["examples"], "data_anon_gib": [r["data_anon_gib"] for r in ranks],
            "data_anon_total_gib": round(sum(r["data_anon_gib"] for r in ranks), 3),
            "peak_rss_gib": [r["peak_rss_gib"] for r in ranks],
            **{k: [r[k] for r in ranks] for k in ("layout_s", "with_layout_anon_gib") if k in ranks[0]}}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(tree: Path, args, data: Path, cache: Path, nproc: int, work: Path) -> dict:
    """One optimizer step at `nproc` CPU processes: launch to the first step, memory of each process."""
    out = work / f"run-{nproc}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "ddptune", "train", str(ROOT / "configs" / "demo.yaml"), *overrides(data, args),
           "train.max_steps=1", f"train.effective_batch_size={nproc}", "train.micro_batch_size=1", f"output_dir={out}",
           "--nproc", str(nproc)]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env_of(tree, cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak: dict[int, dict] = {}
    first_step, launcher = None, 0
    while proc.poll() is None:
        launcher = max(launcher, status(proc.pid).get("VmHWM", 0))
        for pid in descendants(proc.pid):
            now = status(pid)
            seen = peak.setdefault(pid, {"VmHWM": 0, "RssAnon": 0})
            for k, v in now.items():
                seen[k] = max(seen[k], v)
        if first_step is None and (out / "metrics.jsonl").is_file() and '"loss"' in (out / "metrics.jsonl").read_text():
            first_step = time.perf_counter() - started
        time.sleep(0.1)
    _, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{tree}: ddptune train --nproc {nproc}: exit {proc.returncode}\n{err[-3000:]}")
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["step_time_s"]
    summary = json.loads((out / "summary.json").read_text())
    split = summary["wall_split"]  # the run's own: start-up, then loading
    workers = sorted((v for v in peak.values() if v["VmHWM"]), key=lambda v: -v["VmHWM"])[:nproc]
    gib = lambda b: round(b / 2**30, 3)  # noqa: E731
    return {"nproc": nproc, "launch_to_first_step_s": round(first_step, 2) if first_step else None,
            "first_step_s": round(step, 2), "launch_to_loop_s": round(first_step - step, 2) if first_step else None,
            "wall_s": round(time.perf_counter() - started, 2),
            "run_startup_s": round(split["startup_s"], 2), "run_load_s": round(split["load_s"], 2),
            "run_startup_split": {k: round(v, 2) for k, v in (summary.get("startup_split") or {}).items()},
            "launcher_peak_rss_gib": gib(launcher),
            "worker_peak_rss_gib": [gib(v["VmHWM"]) for v in workers],
            "worker_peak_anon_gib": [gib(v["RssAnon"]) for v in workers],
            "workers_peak_anon_total_gib": gib(sum(v["RssAnon"] for v in workers))}


def one_tree(tree: Path, args, data: Path, rows: int, work: Path, results: list) -> None:
    """One tree's row, appended to `results` and written to --out after each part it measures (a command
    stopped at its limit keeps what it measured); each part printed as it comes."""
    cache = work / f"cache-{tree.name}-{data.stem}"
    row = {"tree": str(tree), "commit": provenance.commit(tree) if tree != ROOT else args.commit, "rows": rows,
           "kind": data.stem.split("-")[0]}
    results.append(row)

    def part(name: str, value) -> None:
        row[name] = value
        print(json.dumps({name: value}), flush=True)
        write(args, results)

    part("prepare", prepare(tree, args, data, cache))
    if tree != ROOT and args.before_no_threads:
        part("prepare_no_threads", prepare(tree, args, data, work / f"cache-{tree.name}-{data.stem}-no-threads", False))
    if args.json_list:
        part("prepare_json_list", prepare(tree, args, data.with_suffix(".json"), work / f"cache-{tree.name}-{data.stem}-json"))
    if args.gzip:
        part("prepare_gzip", prepare(tree, args, data.with_suffix(".jsonl.gz"), work / f"cache-{tree.name}-{data.stem}-gz"))
    if tree == ROOT:
        part("store", store_bytes(cache))
        if args.check:
            part("check", check(cache))
        part("prepare_again", prepare(tree, args, data, cache))
    if not args.prepare_only:
        part("hold", [hold(tree, args, data, cache, n, work) for n in args.nproc])
        cold, nproc = work / f"cache-{tree.name}-{data.stem}-train", args.train_nproc or max(args.nproc)
        part("train_cold", train(tree, args, data, cold, nproc, work))
        part("train_warm", train(tree, args, data, cold, nproc, work))
        small = work / f"{data.stem}-first{SMALL}.jsonl"  # the same launch on a few rows: what does not scale with them
        with open(data) as f, open(small, "w") as g:
            g.writelines(line for _, line in zip(range(SMALL), f))
        train(tree, args, small, cold, nproc, work)  # makes the few rows' store
        part("train_small_warm", train(tree, args, small, cold, nproc, work))


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--rows", default="100000,1000000")
    p.add_argument("--before", type=Path, help="an older checkout (a git worktree) to measure beside this one")
    p.add_argument("--before-rows", type=int, default=100000)
    p.add_argument("--before-no-threads", action="store_true",
                   help="prepare again in the --before tree with the tokenizer's own threads off")
    p.add_argument("--nproc", default="1,2,8")
    p.add_argument("--hold", help=argparse.SUPPRESS)  # a hold worker's data file (hold_worker)
    p.add_argument("--hold-out", help=argparse.SUPPRESS)
    p.add_argument("--samsum", type=Path, default=ROOT.parent / "shared" / "data" / "samsum_validation.json")
    p.add_argument("--skip-anchor", action="store_true")
    p.add_argument("--prepare-only", action="store_true", help="measure preparation alone (no hold, no train)")
    p.add_argument("--cores", help="process counts K for the tokenizing work alone, e.g. 1,2,4,8,16 (chat rows)")
    p.add_argument("--cores-rows", type=int, default=20000, help="rows each of the K processes tokenizes")
    p.add_argument("--json-list", action="store_true", help="prepare the same rows written as one JSON list too")
    p.add_argument("--gzip", action="store_true", help="prepare the same JSON-lines file gzipped (.jsonl.gz) too")
    p.add_argument("--kinds", default="chat", help="chat and/or dialogue rows, e.g. chat,dialogue")
    p.add_argument("--check", action="store_true", help="time the store's content check (crc32 and bounds) too")
    p.add_argument("--train-nproc", type=int, help="processes of the train runs (default: the largest --nproc)")
    p.add_argument("--commit", help="this checkout's commit, where its git history is not the one it was made from")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.argv = argv
    if args.hold:
        return hold_worker(args) or 0
    args.nproc = [int(n) for n in args.nproc.split(",")]
    args.tokenizer = str(Path(args.tokenizer).resolve())
    args.commit = args.commit or provenance.commit(ROOT)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for kind, rows in ((k, int(r)) for k in args.kinds.split(",") for r in args.rows.split(",")):
            data = work / f"{kind}-{rows}.jsonl"
            make_rows(args.samsum, rows, data, kind)
            if args.json_list:
                as_json_list(data, data.with_suffix(".json"))
            if args.gzip:
                with open(data, "rb") as f, gzip.open(data.with_suffix(".jsonl.gz"), "wb") as g:
                    shutil.copyfileobj(f, g)
            trees = [ROOT] + ([args.before.resolve()] if args.before and rows <= args.before_rows else [])
            for tree in trees:
                one_tree(tree, args, data, rows, work, results)
            if args.cores and kind == "chat":
                results.append({"rows": rows})
                cores(args, data, results[-1], lambda: write(args, results))
            if not args.skip_anchor and kind == "chat":
                results.append({"anchor": "datasets", "rows": rows, **anchor(args, data)})
                print(json.dumps(results[-1]), flush=True)
            data.unlink()
            data.with_suffix(".json").unlink(missing_ok=True)
            data.with_suffix(".jsonl.gz").unlink(missing_ok=True)
            write(args, results)  # after each row count: a command stopped at its limit keeps what it measured
    return 0


def write(args, results: list) -> None:
    out = {**provenance.record(args.commit, __file__, args.argv), "cpus": len(os.sched_getaffinity(0)),
           "python": platform.python_version(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
