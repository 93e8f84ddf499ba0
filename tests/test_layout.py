"""The package's shape, read from the source (so a moved import or a grown function breaks this
test, not a run): commands import components, never each other; the ground floor imports nothing
of ddptune; the import graph has no circle; no module, function or class outgrows a screen's reason;
and each module's first docstring line says what it owns."""
from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

import ddptune

PACKAGE = Path(ddptune.__file__).parent
# modules that know nothing of the rest: YAML, starting processes, checkpoint files, figures, attention, architectures,
# how a run stops, the cache folder, tokens (IGNORE)
GROUND = {"yamlsafe", "launch", "checkpoint", "metrics", "report", "attention", "arch", "stops", "cache", "data.tokens"}
COMMANDS = {"cli", "train", "evaluate", "predict", "export", "scale", "plan", "env", "datacmd"}
MAX_MODULE, MAX_TRAIN, MAX_FUNCTION, MAX_CLASS = 600, 450, 60, 120
LONG_ALLOWED: set[tuple[str, str]] = set()  # (module, function) pairs allowed past MAX_FUNCTION: none
RUN_NAMES = {"r", "run"}  # what train.py calls its run object (train.Run)


def name_of(path: Path) -> str:
    """A module's dotted name inside the package: `train`, `data` (data/__init__.py), `data.rows`."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def ddptune_imports(path: Path, names: set[str] = frozenset()) -> set[str]:
    """The package's modules that `path` imports, function-level imports too: `from ddptune.data import
    rows` is `data.rows` where that module is among `names`, else `data`."""
    found = set()

    def add(module: str, imported: list[str]) -> None:
        found.update(f"{module}.{n}" if f"{module}.{n}" in names else module for n in imported)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 or node.module == "ddptune":
                found.update(node.module.split(".")[:1] if node.module and node.level == 1 else
                             (a.name for a in node.names))
            elif node.module and node.module.startswith("ddptune."):
                add(node.module.split(".", 1)[1], [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".", 1)[1] for a in node.names if a.name.startswith("ddptune."))
    return found - {name_of(path) if path.is_relative_to(PACKAGE) else path.stem}


def modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p != PACKAGE / "__init__.py"]


def graph() -> dict[str, set[str]]:
    names = {name_of(p) for p in modules()}
    return {name_of(p): ddptune_imports(p, names) for p in modules()}


def test_the_reader_sees_function_level_imports_too(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from . import config\nimport ddptune.data\ndef g():\n    from ddptune import model, plan\n"
                 "    from .checks import x\n    from ddptune.data import rows, Source\n")
    assert ddptune_imports(f, {"data", "data.rows"}) == {"config", "data", "data.rows", "model", "plan", "checks"}


def test_the_import_graph_has_no_circle():
    g = graph()
    assert set(g) >= COMMANDS | GROUND | {"dist", "model", "data", "batches", "speed", "graphs", "step"}
    for deps in g.values():
        assert deps <= set(g), f"imports a module that does not exist: {deps - set(g)}"
    order = list(graphlib.TopologicalSorter(g).static_order())  # raises CycleError on a circle
    assert order.index("config") < order.index("train") < order.index("cli")


def test_commands_import_components_never_each_other_and_the_ground_floor_imports_nothing():
    g = graph()
    assert {m: g[m] for m in GROUND if g[m]} == {}
    assert {m: g[m] & COMMANDS for m in g if m not in ("cli", "__main__") and g[m] & COMMANDS} == {}


def test_no_module_function_or_class_outgrows_its_bound():
    too_long = {}
    for path in modules():
        lines = len(path.read_text().splitlines())
        name = name_of(path)
        if lines > (MAX_TRAIN if name == "train" else MAX_MODULE):
            too_long[name] = lines
        for node in ast.walk(ast.parse(path.read_text())):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNCTION \
                    and (name, node.name) not in LONG_ALLOWED:
                too_long[f"{name}.{node.name}"] = size
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS and not any(
                    "dataclass" in ast.unparse(d) for d in node.decorator_list):
                too_long[f"{name}.{node.name}"] = size
    assert too_long == {}


def run_parameters(source: str) -> list[str]:
    """The functions (lambdas too) in `source` that take a run object: a parameter named as train.py
    names its run, or annotated with Run."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]:
                annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                if arg.arg in RUN_NAMES or re.search(r"\bRun\b", annotation):
                    found.append(f"{getattr(node, 'name', 'lambda')}({arg.arg})")
    return sorted(found)


def test_the_reader_finds_a_run_parameter_however_it_is_spelled():
    source = ("def a(r): pass\ndef b(x, *, run=None): pass\ndef c(state: 'train.Run'): pass\n"
              "async def d(x: Run | None): pass\nf = lambda r: r\ndef fine(rows, runs: list, running: Running): pass\n")
    assert run_parameters(source) == ["a(r)", "b(run)", "c(state)", "d(x)", "lambda(r)"]


def test_only_train_holds_the_run_object():
    """Every module but train.py takes the values it uses (or a small record of them) and returns new
    ones: a function that takes the run hides what it reads, and one that changes it hides what it writes."""
    found = {name_of(p): names for p in modules() if p.stem != "train" and (names := run_parameters(p.read_text()))}
    assert found == {}


def test_each_module_says_in_its_first_line_what_it_owns():
    unsaid = {}
    for path in modules():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = doc.splitlines()[0] if doc else ""
        if not first or len(first) > 120 or not first.rstrip().endswith((".", ":")):
            unsaid[name_of(path)] = first
    assert unsaid == {}


def test_train_reads_as_setup_fit_finish():
    tree = ast.parse((PACKAGE / "train.py").read_text())
    assert {"setup", "fit", "finish", "train_step"} <= {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_the_data_wing_reaches_nothing_that_knows_processes_or_models():
    """data/ (files → rows → examples → the tokenized store) is the same for 1 and N processes: neither
    it nor anything it imports knows the process group, the launch, the model or a step."""
    g = graph()
    wing = {m for m in g if m == "data" or m.startswith("data.")}
    reached, todo = set(), list(wing)
    while todo:
        for dep in g[todo.pop()] - reached:
            reached.add(dep)
            todo.append(dep)
    assert wing >= {"data", "data.rows", "data.tokenized", "data.store"}
    assert reached & (COMMANDS | {"dist", "launch", "start", "comm", "model", "step", "batches", "speed"}) == set()
    assert [name_of(p) for p in modules() if name_of(p) in wing and "torch.distributed" in p.read_text()] == []


def borrowed(tree: ast.Module) -> dict[str, str]:
    """The names a module imports from another of the package's modules (not the modules themselves),
    each with its home: `from ddptune.data.tokens import IGNORE` is {"IGNORE": "data.tokens"}."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddptune."):
            home = node.module.split(".", 1)[1]
            found.update({a.asname or a.name: home for a in node.names
                          if not (PACKAGE / home.replace(".", "/") / f"{a.name}.py").exists()})
    return found


def test_every_name_is_reached_at_its_home_never_passed_on():
    """A module that imports a name only for others to take from it hides who needs whom: no module
    imports a name it does not use, and no code (tests too) reaches a name through a module that borrowed it."""
    trees = {p: ast.parse(p.read_text()) for p in [*modules(), *sorted(Path(__file__).parent.glob("*.py"))]}
    nodes = {p: list(ast.walk(tree)) for p, tree in trees.items()}
    taken = {name_of(p): borrowed(trees[p]) for p in modules()}
    unused = {name: left for p in modules() if (left := sorted(set(taken[name := name_of(p)]) - {
        n.id for n in nodes[p] if isinstance(n, ast.Name)}))}
    passed_on = []
    for p, found in nodes.items():
        aliases = {a.asname or a.name: ".".join([*n.module.split(".")[1:], a.name]) for n in found
                   if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "ddptune" for a in n.names}
        passed_on += [f"{p.name}:{n.lineno}: {n.value.id}.{n.attr}" for n in found if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Name) and n.attr in taken.get(aliases.get(n.value.id), {})]
    assert (unused, passed_on) == ({}, [])


KEYWORD_ONLY = {"train": "Run", "batches": "Stream", "memory": "Job", "speed": "Speed"}  # records built in many places


def test_long_calls_name_their_arguments_and_the_records_take_keywords_only():
    """A call of 8 or more arguments to the package's own functions names each one (a swapped pair of
    numbers would pass unseen), and the records built field by field in several places take keywords only."""
    trees = {p: ast.parse(p.read_text()) for p in [*modules(), *sorted(Path(__file__).parent.glob("*.py"))]}
    own = {n.name for p in modules() for n in ast.walk(trees[p]) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    positional = [f"{p.name}:{n.lineno}: {ast.unparse(n.func)}" for p, tree in trees.items() for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and len(n.args) + len(n.keywords) >= 8 and n.args
                  and not any(isinstance(a, ast.Starred) for a in n.args)
                  and (n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)) in own]
    keywords_only = {name_of(p) for p in modules() if name_of(p) in KEYWORD_ONLY for n in trees[p].body
                     if isinstance(n, ast.ClassDef) and n.name == KEYWORD_ONLY[name_of(p)]
                     and any("kw_only=True" in ast.unparse(d) for d in n.decorator_list)}
    assert positional == [] and keywords_only == set(KEYWORD_ONLY)
