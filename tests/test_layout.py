"""The package's shape: its import graph (every `from . import x` or `from ddptune import x`, at the top of a
module or inside a function) has no circle, the ground floor imports nothing of ddptune, and no module
imports a command's module from below. Read from the source, so a moved import breaks this test, not a run."""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import ddptune

PACKAGE = Path(ddptune.__file__).parent
# modules that know nothing of the rest: the config, the process layer, files and figures
GROUND = {"config", "dist", "launcher", "checkpoint", "metrics", "report"}
# the commands' floor: only the CLI (and __main__) may import it
COMMANDS = {"cli"}


def ddptune_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 or node.module == "ddptune":
                found.update(node.module.split(".")[:1] if node.module and node.level == 1 else
                             (a.name for a in node.names))
            elif node.module and node.module.startswith("ddptune."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("ddptune."))
    return found - {path.stem}


def graph() -> dict[str, set[str]]:
    return {p.stem: ddptune_imports(p) for p in sorted(PACKAGE.glob("*.py")) if p.stem != "__init__"}


def test_the_reader_sees_function_level_imports_too(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from . import config\nimport ddptune.data\ndef g():\n    from ddptune import model, plan\n"
                 "    from .checks import x\n")
    assert ddptune_imports(f) == {"config", "data", "model", "plan", "checks"}


def test_the_import_graph_has_no_circle():
    g = graph()
    assert set(g) >= {"config", "dist", "train", "evaluate", "scale", "cli", "model", "data"}
    for deps in g.values():
        assert deps <= set(g), f"imports a module that does not exist: {deps - set(g)}"
    order = list(graphlib.TopologicalSorter(g).static_order())  # raises CycleError on a circle
    assert order.index("config") < order.index("train") < order.index("cli")


def test_ground_floor_imports_nothing_of_ddptune_and_nothing_imports_the_cli():
    g = graph()
    assert {m: g[m] for m in GROUND if g[m]} == {}
    assert [m for m, deps in g.items() if deps & COMMANDS and m != "__main__"] == []


def test_train_reads_as_setup_fit_finish_in_short_functions():
    tree = ast.parse((PACKAGE / "train.py").read_text())
    functions = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert {"setup", "fit", "finish", "train_step"} <= set(functions)
    assert {name: n for name, n in functions.items() if n >= 60} == {}
