"""The config reference: each field's docstring, for CONFIG.md's table and `ddptune train --help`."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from typing import Any

import yaml

from ddptune.config import Config


def field_docs(cls: type) -> dict[str, str]:
    """{field name: docstring} of a config dataclass, read from its source (a string right after
    the field, as litgpt and jsonargparse read them)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def reference() -> list[dict]:
    """Every leaf key: {"key", "default", "doc"}, in the order of the dataclasses."""
    rows = []
    for section in dataclasses.fields(Config):
        cls = section.type if isinstance(section.type, type) else typing.get_type_hints(Config)[section.name]
        if not dataclasses.is_dataclass(cls):
            rows.append({"key": section.name, "default": section.default, "doc": field_docs(Config).get(section.name, "")})
            continue
        docs, defaults = field_docs(cls), cls()
        for f in dataclasses.fields(cls):
            rows.append({"key": f"{section.name}.{f.name}", "default": getattr(defaults, f.name), "doc": docs.get(f.name, "")})
    return rows


def _yaml_value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("\n...").removesuffix("...").strip()


def reference_markdown() -> str:
    """CONFIG.md's config table, generated from the docstrings (a test keeps CONFIG.md in step)."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for r in reference():
        lines.append(f"| `{r['key']}` | `{_yaml_value(r['default'])}` | {r['doc'].replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


def reference_text() -> str:
    """The same reference as plain text, for `ddptune train --help`."""
    return "\n".join(f"  {r['key']}={_yaml_value(r['default'])}\n      {r['doc']}" for r in reference())


if __name__ == "__main__":  # python -m ddptune.configref: CONFIG.md's config table
    print(reference_markdown(), end="")
