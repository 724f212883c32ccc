"""Reading a matrix file's YAML safely: bounded, duplicate keys refused, every error one line.

Owns `read_yaml(path)`: the text (UTF-8), PyYAML's safe loader (no Python objects), and the
bounds a hostile or mistyped file could otherwise break:
- nesting: at most MAX_DEPTH levels, counted while scanning flow collections (`[[[[...`) and while
  composing block ones, so 20,000 levels fail at level MAX_DEPTH instead of in a RecursionError;
- aliases: the document's size with every alias expanded (counted on the node graph, shared nodes
  once each, never expanded) at most MAX_EXPANDED_NODES, and its expanded depth at most MAX_DEPTH,
  so an alias bomb (each level nine aliases of the one before) fails in milliseconds; an alias
  inside its own anchor (`&a [*a]`) is a recursive structure, refused;
- duplicate keys in one mapping (YAML 1.2 requires keys to be unique; PyYAML keeps the last one,
  which silently dropped an engine), named with both lines. Keys merged in by `<<: *base` may be
  overridden; that is what merge keys are for.
A matrix needs a few levels and a few hundred nodes; the bounds sit far above that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from benchsuite.config.problems import yaml_path
from benchsuite.errors import UserError

MAX_DEPTH = 64
MAX_EXPANDED_NODES = 200_000


class YamlError(UserError):
    """A matrix file that cannot be read as bounded YAML; one line naming the file and the place."""


class _Bounded(yaml.SafeLoader):
    def __init__(self, text: str, source: Path) -> None:
        super().__init__(text)
        self.source = source
        self.depth = 0

    def fetch_flow_collection_start(self, token_class: Any) -> None:
        if self.flow_level >= MAX_DEPTH:
            raise YamlError(f"{self.source}: {_where(self.get_mark())}: nested deeper than {MAX_DEPTH} levels")
        super().fetch_flow_collection_start(token_class)

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YamlError(f"{self.source}: {_where(mark)}: nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> Any:
        seen: dict[Any, Node] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                first = seen[key].start_mark.line + 1
                raise YamlError(
                    f"{self.source}: {_where(key_node.start_mark)}: duplicate key {key!r} (first at line {first}); "
                    "each key may appear once in a mapping"
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def read_yaml(source: Path) -> Any:
    """The parsed document of `source`; YamlError (one line) for unreadable or unbounded YAML."""
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise YamlError(f"{source}: no such matrix file") from None
    except UnicodeDecodeError as exc:
        raise YamlError(f"{source}: not UTF-8 text (byte {exc.start}); a matrix is a YAML text file") from None
    except OSError as exc:
        raise YamlError(f"{source}: cannot read ({exc.strerror})") from None
    loader: _Bounded | None = None
    try:
        loader = _Bounded(text, source)  # the reader refuses control characters here
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expanded(source, node)
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = _where(mark) if mark else "unknown place"
        raise YamlError(f"{source}: YAML syntax error at {where}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise YamlError(f"{source}: YAML syntax error: {' '.join(str(exc).split())}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _where(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _children(node: Node, path: tuple[str | int, ...]) -> list[tuple[Node, tuple[str | int, ...]]]:
    """Each child with its YAML path (a mapping's key nodes sit at the mapping's own path)."""
    if isinstance(node, MappingNode):
        out = []
        for key, value in node.value:
            out.append((key, path))
            out.append((value, path + (key.value if isinstance(key, ScalarNode) else "?",)))
        return out
    if isinstance(node, SequenceNode):
        return [(kid, path + (i,)) for i, kid in enumerate(node.value)]
    return []


def _check_expanded(source: Path, root: Node) -> None:
    """Size and depth of the document with aliases expanded, without expanding them (memo per node).
    Errors name the YAML path (the first way to reach the node) and its line; "aliases expand" only
    when an alias is involved, else "too many values"."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    refs: dict[int, int] = {}  # times a node is reached as a child: more than once means an alias
    aliased: dict[int, bool] = {}  # an alias somewhere in the node's subtree
    on_path: set[int] = set()
    stack: list[tuple[Node, tuple[str | int, ...], bool]] = [(root, (), False)]
    while stack:
        node, path, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            kids = [kid for kid, _ in _children(node, path)]
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            aliased[key] = any(refs[id(k)] > 1 or aliased[id(k)] for k in kids)
            where = f"{source}: {yaml_path(path)}: {_where(node.start_mark)}"
            if size[key] > MAX_EXPANDED_NODES:
                raise YamlError(
                    f"{where}: aliases expand to more than {MAX_EXPANDED_NODES} values (an alias bomb?)"
                    if aliased[key]
                    else f"{where}: too many values (more than {MAX_EXPANDED_NODES}); a matrix needs a few hundred"
                )
            if depth[key] > MAX_DEPTH:
                raise YamlError(f"{where}: aliases nest deeper than {MAX_DEPTH} levels")
            continue
        if key in size:
            continue
        if key in on_path:
            where = f"{source}: {yaml_path(path)}: {_where(node.start_mark)}"
            raise YamlError(f"{where}: a recursive alias (an anchor used inside itself)")
        on_path.add(key)
        stack.append((node, path, True))
        for kid, kid_path in reversed(_children(node, path)):  # popped in document order: a node's
            refs[id(kid)] = refs.get(id(kid), 0) + 1  # path is then where its anchor is written
            if id(kid) not in size:
                stack.append((kid, kid_path, False))
