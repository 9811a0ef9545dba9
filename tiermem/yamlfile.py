"""The one YAML loader of every config tiermem reads (a training YAML, its overrides, a tiermem or service
config): PyYAML's safe loader, bounded, with one-line errors.

Bounded, so that no text makes it hang or run out of memory: a file over ``MAX_BYTES`` is refused unread, a
document whose nodes, each alias counted as the whole of what it repeats, exceed ``MAX_NODES`` is refused as
it is composed ("billion laughs": nine aliases of nine repeat a list a billion times, and everything that
later walks the config, writes it or prints it, would walk every repetition), and so are collections nested
deeper than ``MAX_DEPTH`` (the composer recurses) and an alias inside what it names (a recursive
structure). A key given twice in one mapping is refused with both lines (PyYAML keeps the last silently); a
key that overrides one merged in with ``<<`` is not a duplicate.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from tiermem.errors import ConfigError
from tiermem.files import read_text

MAX_BYTES = 1 << 20  # a training YAML is a few KiB
MAX_NODES = 100_000  # values, aliases expanded; a config holds hundreds
MAX_DEPTH = 64  # ours nest 5 deep


class _Loader(yaml.SafeLoader):
    """The safe loader, counting what it composes (aliases expanded) and refusing duplicated keys."""

    def __init__(self, stream, where: str):
        super().__init__(stream)
        self.where = where
        self.expanded: dict[int, int] = {}  # id(node) -> nodes it stands for, aliases expanded
        self.total = 0
        self.depth = 0
        self.open: set[str] = set()  # anchors of the collections being composed

    def _count(self, n: int, event) -> None:
        self.total += n
        if self.total > MAX_NODES:
            raise ConfigError(f"{self.where}: more than {MAX_NODES:,} values with its aliases expanded (at line "
                              f"{event.start_mark.line + 1}); a config is not that large")

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self.open:
                raise ConfigError(f"{self.where}: alias *{event.anchor} at line {event.start_mark.line + 1} is inside "
                                  f"what &{event.anchor} names (a recursive structure)")
            node = super().compose_node(parent, index)
            self._count(self.expanded.get(id(node), 1), event)
            return node
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ConfigError(f"{self.where}: nested more than {MAX_DEPTH} levels deep at line "
                              f"{event.start_mark.line + 1}")
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self.open.add(anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
            self.open.discard(anchor)
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
            self._no_duplicates(node)
        else:
            children = []
        self.expanded[id(node)] = 1 + sum(self.expanded.get(id(c), 1) for c in children)
        self._count(1, event)
        return node

    def _no_duplicates(self, node: yaml.MappingNode) -> None:
        seen: dict[tuple, int] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            line = key.start_mark.line + 1
            first = seen.get((key.tag, key.value))
            if first is not None:
                lines = f"lines {first} and {line}" if first != line else f"twice on line {line}"
                raise ConfigError(f"{self.where}: key '{key.value}' is given twice ({lines}); keep one")
            seen[(key.tag, key.value)] = line


def load_yaml(text: str, where: str):
    """The value of one YAML document ``text`` (None when empty); ``where`` names it in errors."""
    loader = _Loader(text, where)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{where}: not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:  # (the constructor of a value nested within the depth bound, on a small stack)
        raise ConfigError(f"{where}: nested too deep") from None
    finally:
        loader.dispose()


def read_yaml(path, what: str = "config file") -> dict:
    """A YAML file's top-level mapping (an empty file is an empty mapping), or a one-line ConfigError. The file
    must be a regular file (a FIFO or a device is refused before it is opened) of at most ``MAX_BYTES``."""
    p = Path(path)
    data = load_yaml(read_text(p, what, MAX_BYTES), str(p))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of keys to values at the top level")
    return data
