"""Reading a job file's YAML, at a bounded cost, before any of it is validated.

A job file is written by hand; what it may cost to read is bounded (issue 40): its size, and how
many values its aliases expand to (an alias is a reference, but each value it names is validated
at every place it appears: the "billion laughs"). Every walk here visits each node once.
"""

from __future__ import annotations

from typing import Any

import yaml


class JobFileRefused(ValueError):
    """A job file refused before validation (too large, an alias bomb, a key given twice): one line."""


# A job file is written by hand: 60k detect objects take 1.1 MB. Bigger is a mistake (a data file
# passed as the job) and would cost gigabytes to parse before its error.
MAX_JOB_BYTES = 4 << 20
# Values a job file may stand for once its YAML aliases are expanded: an alias is a reference,
# but each value it names is validated (and hashed) at every place it appears ("billion laughs").
MAX_EXPANDED_NODES = 1_000_000
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 10x faster on a long list


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _check_expansion(root: yaml.Node, source: str) -> None:
    """Refuse a document whose aliases expand past MAX_EXPANDED_NODES, or refer to themselves.
    Each node is sized once (an alias is the same node object), so this is linear in the file."""
    size: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    open_ids: set[int] = set()
    while stack:
        node, done = stack.pop()
        if done:
            open_ids.discard(id(node))
            size[id(node)] = min(MAX_EXPANDED_NODES + 1, 1 + sum(size[id(c)] for c in _children(node)))
            continue
        if id(node) in size:
            continue
        if id(node) in open_ids:
            raise JobFileRefused(f"{source}: line {node.start_mark.line + 1}: a YAML alias refers to a value that holds it")
        open_ids.add(id(node))
        stack.append((node, True))
        for c in _children(node):
            if isinstance(c, yaml.ScalarNode):
                size[id(c)] = 1
            elif id(c) not in size:
                stack.append((c, False))
    if size[id(root)] > MAX_EXPANDED_NODES:
        raise JobFileRefused(f"{source}: its YAML aliases expand to more than {MAX_EXPANDED_NODES:,} values; a job "
                       "file needs no such structure")


def _duplicate_key(node: yaml.Node, path: str = "", seen_nodes: set[int] | None = None) -> str | None:
    """`field.path: key given twice (lines a and b)` for the first key a mapping repeats. A node
    reached again through an alias was checked the first time."""
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:
        return None
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            here = f"{path}.{name}" if path else str(name)
            if name is not None and name in seen:
                return f"{here}: key given twice (lines {seen[name] + 1} and {key.start_mark.line + 1})"
            seen[name] = key.start_mark.line
            if found := _duplicate_key(value, here, seen_nodes):
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            if found := _duplicate_key(item, f"{path}.{i}", seen_nodes):
                return found
    return None


def read_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    loader = _LOADER(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        _check_expansion(node, source)
        if duplicate := _duplicate_key(node):
            raise JobFileRefused(f"{source}: {duplicate}")
        return loader.construct_document(node), node
    finally:
        loader.dispose()
