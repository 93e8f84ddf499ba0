"""A strict YAML loader (no key twice, no nested aliases, no base-60 numbers) and quoting that keeps a line short."""
from __future__ import annotations

import typing
from typing import Any

import yaml

QUOTE_CHARS = 200  # the most of a value a problem line quotes


def quoted(value: Any) -> str:
    """`value` as a problem line quotes it: its repr, cut to about QUOTE_CHARS characters (a config
    may hold a value of megabytes, and the line must stay one line a person reads)."""
    return shortened(repr(value))


def shortened(text: str) -> str:
    return text if len(text) <= QUOTE_CHARS else f"{text[:QUOTE_CHARS - 20]}... ({len(text):,} characters)"


class StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML keeps the last one silently:
    a second `train:` section would drop every key of the first), and an alias of a node that holds
    aliases itself: nested aliases grow a few hundred bytes into billions of values (nine levels of
    nine: 387 million), which no config needs. An alias of a plain node (`&lr 2e-4` ... `*lr`) stays."""

    def __init__(self, stream):
        super().__init__(stream)
        self._open: list = []  # the anchors of the nodes being composed, outermost first
        self._holding_aliases: set = set()  # anchors of nodes that hold an alias

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            alias = f"the alias *{shortened(str(event.anchor))} (line {event.start_mark.line + 1})"
            if event.anchor in self._open:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{alias} is inside the node it repeats: a value without end (write the values out)",
                    event.start_mark)
            if event.anchor in self._holding_aliases:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{alias} repeats a node that holds aliases itself: nested aliases multiply, and are "
                    "refused (write the values out)", event.start_mark)
            self._holding_aliases.update(a for a in self._open if a is not None)
            return super().compose_node(parent, index)
        self._open.append(getattr(self.peek_event(), "anchor", None))
        try:
            return super().compose_node(parent, index)
        finally:
            self._open.pop()

    def construct_yaml_int(self, node):
        """YAML 1.1 reads digits joined by colons as a base-60 number (an unquoted row slice 1:30 is 90,
        1:30:00 is 5400), which no config means: they stay the text written, as YAML 1.2 reads them;
        a key that wants a number then refuses the text, and a row slice is the slice written."""
        if ":" in node.value:
            return self.construct_scalar(node)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):  # 1:30.5, base 60 with a fraction: the text written, as above
        if ":" in node.value:
            return self.construct_scalar(node)
        return super().construct_yaml_float(node)

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{quoted(key)} appears twice (lines {seen[key]} and {key_node.start_mark.line + 1}; "
                    "merge them into one)", key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)
