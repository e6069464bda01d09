"""The trees given to ``init``: each one's keys and its structure, which an optax updater is
handed in place of the store's flat ``{key: value}`` mapping (``core/tree_view.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["TreeShape", "entries_of", "from_entries"]


class TreeShape(tuple):
    """A tree given to ``init``: its keys, sorted (the tuple itself: it compares equal to a
    plain tuple of the same keys, as a store's ``trees`` were kept before), its structure
    (``treedef``, a ``jax.tree_util`` ``PyTreeDef``, or ``None`` where none is known) and its
    keys in the structure's leaf order (``leaf_keys``).

    Two ``TreeShape``s are equal where their keys and structures are: a ``jit`` that traced a
    push for one structure does not replay it for another of the same paths."""

    treedef: Any
    leaf_keys: tuple[str, ...]

    def __new__(cls, leaf_keys: Sequence[str], treedef: Any = None) -> TreeShape:  # noqa: PYI034 (a tuple subclass)
        self = super().__new__(cls, sorted(leaf_keys))
        self.treedef = treedef
        self.leaf_keys = tuple(leaf_keys)
        return self

    @classmethod
    def of(cls, tree: Sequence[str]) -> TreeShape:
        """``tree`` itself, or a plain tuple of keys (a checkpoint's) with no structure known."""
        return tree if isinstance(tree, TreeShape) else cls(tree)

    def known(self) -> TreeShape:
        """This shape with a structure: its own, or where none is known (a checkpoint written
        before structures were saved), nested dicts from its keys split at ``/``, the
        structure a flax ``params`` dict has."""
        if self.treedef is not None:
            return self
        return from_entries(self.leaf_keys, [[["key", p] for p in k.split("/")] for k in self])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TreeShape):
            mine, theirs = self.treedef, other.treedef
            same = mine is theirs or (mine is not None and theirs is not None and mine == theirs)
            return tuple.__eq__(self, other) and same
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:  # a plain tuple of the same keys hashes alike
        return tuple.__hash__(self)

    def __reduce__(self) -> Any:  # copies keep what the tuple alone would lose
        return (TreeShape, (self.leaf_keys, self.treedef))


def entries_of(treedef: Any) -> list[list[list[Any]]] | None:
    """Each leaf's path in ``treedef``, as JSON-ready entries (``["key", k]`` for a mapping's
    key, ``["idx", i]`` for a sequence's index, ``["attr", name]`` for an attribute), in leaf
    order; ``None`` for a structure with an entry of another kind."""
    leaves = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(leaves)[0]:
        entries: list[list[Any]] = []
        for e in path:
            if isinstance(e, jax.tree_util.DictKey) and isinstance(e.key, str | int):
                entries.append(["key", e.key])
            elif isinstance(e, jax.tree_util.SequenceKey):
                entries.append(["idx", e.idx])
            elif isinstance(e, jax.tree_util.GetAttrKey):
                entries.append(["attr", e.name])
            else:
                return None
        out.append(entries)
    return out


def from_entries(leaf_keys: Sequence[str], entries: Sequence[Sequence[Any]]) -> TreeShape:
    """The :class:`TreeShape` rebuilt from :func:`entries_of`'s paths (a checkpoint's): mappings
    as dicts, sequences as lists, and an attribute's node (a dataclass, a module) as a dict of
    its attributes, whose keys name the same paths."""
    root: dict[Any, Any] = {}
    for n, path in enumerate(entries):
        node: Any = root
        for i, (_, name) in enumerate(path):
            if i == len(path) - 1:
                node[name] = n
            else:
                node = node.setdefault(name, {})

    # A node whose entries are all sequence indices 0..n-1 is a list.
    kinds: dict[tuple, str] = {}
    for path in entries:
        for i, (kind, _) in enumerate(path):
            kinds[tuple(tuple(e) for e in path[:i])] = kind

    def build(node: Any, prefix: tuple) -> Any:
        if not isinstance(node, dict):
            return node
        built = {k: build(v, (*prefix, (kinds[prefix], k))) for k, v in node.items()}
        if kinds.get(prefix) == "idx" and sorted(built) == list(range(len(built))):
            return [built[i] for i in range(len(built))]
        return built

    tree = build(root, ())
    order, treedef = jax.tree_util.tree_flatten(tree)
    keys = [leaf_keys[n] for n in order]
    return TreeShape(keys, treedef)
