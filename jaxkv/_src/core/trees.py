"""Parameter trees as keys: a pytree's leaves keyed by their paths, and trees filled back from
the store.

A tree (a flax ``params`` dict, an nnx ``State``, an equinox module, any pytree that is not a
list or tuple of keys) is taken wherever a ``{key: value}`` mapping is: each leaf becomes the
key named by its path, the path's entries joined by ``/`` (``{"params": {"Dense_0": {"kernel":
w}}}`` gives the key ``'params/Dense_0/kernel'``; a sequence index is its number, an
attribute its name), the naming of ``flax.traverse_util.flatten_dict(sep="/")`` and of orbax's
checkpoint directories. A flat mapping of arrays (or of lists of per-device arrays) keeps its
own keys, which are the same names.

A store remembers the paths of each tree given to ``init``: a tree pushed must have exactly
the paths of one of them, and plain keys are not added to a store of trees, nor trees to a
store of plain keys. Each leaf stays a key of its own: ``pull(state, "params/Dense_0/kernel")``
works too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxkv._src.errors import KeyTypeError, KVStoreError, shown
from jaxkv._src.state.kvstate import Key, KVState
from jaxkv._src.state.tree_shapes import TreeShape

__all__ = [
    "SEP",
    "Tree",
    "check_init",
    "check_push",
    "fill",
    "is_tree",
    "path_key",
    "split",
    "structure",
]

SEP = "/"


def _entry(entry: Any) -> str:
    for name in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
        if hasattr(entry, name):
            return str(getattr(entry, name))
    return str(entry)


def path_key(path: tuple[Any, ...]) -> str:
    """The key naming the leaf at ``path`` (a ``jax.tree_util`` key path)."""
    return SEP.join(_entry(e) for e in path)


def _is_leaf_like(x: Any) -> bool:
    """Whether ``x`` is what a flat mapping holds per key: an array or a number (a leaf), or
    a list of them (per-device values)."""
    if isinstance(x, list | tuple) and not hasattr(x, "_fields"):  # a namedtuple is a node
        return all(_is_leaf_like(v) and not isinstance(v, list | tuple) for v in x)
    if isinstance(x, jax.Array | np.ndarray | np.generic | int | float | complex):
        return True
    leaves = jax.tree_util.tree_leaves(x)
    return len(leaves) == 1 and leaves[0] is x


def is_tree(keys: Any) -> bool:
    """Whether ``keys`` (the argument of ``init``/``push``/``pull`` that takes keys) is a tree:
    a nested mapping, or a pytree container other than a list or tuple of keys (a namedtuple
    is a tree), and not a key or a flat mapping of values."""
    if hasattr(keys, "_fields"):  # a namedtuple
        return True
    if isinstance(keys, str | int | list | tuple) or keys is None:
        return False
    if isinstance(keys, Mapping):
        return not all(_is_leaf_like(v) for v in keys.values())
    if _is_leaf_like(keys):
        return False
    return not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(keys))


class Tree:
    """A tree's keys (its leaves' paths, in leaf order), its leaves and its structure."""

    __slots__ = ("keys", "leaves", "treedef")

    def __init__(self, tree: Any):
        with_paths, self.treedef = jax.tree_util.tree_flatten_with_path(tree)
        self.keys = [path_key(p) for p, _ in with_paths]
        self.leaves = [x for _, x in with_paths]
        seen: dict[str, int] = {}
        for n, key in enumerate(self.keys):
            if key in seen:
                paths = [jax.tree_util.keystr(with_paths[i][0]) for i in (seen[key], n)]
                raise KVStoreError(
                    f"tree key {shown(key)}: expected each leaf's path to name one key, given two "
                    f"leaves named so ({paths[0]} and {paths[1]}); rename one"
                )
            seen[key] = n

    @property
    def mapping(self) -> dict[Key, Any]:
        return dict(zip(self.keys, self.leaves))

    def paths(self) -> tuple[str, ...]:
        return tuple(sorted(self.keys))

    def shape(self) -> TreeShape:
        """The tree's keys and structure, as a store keeps them (``KVState.trees``)."""
        return TreeShape(self.keys, self.treedef)


def split(keys: Any) -> Tree | None:
    """``keys`` as a :class:`Tree`, or ``None`` where it is a key, a list of keys or a flat
    mapping."""
    return Tree(keys) if is_tree(keys) else None


def structure(keys: Any) -> Tree | None:
    """``keys`` as a :class:`Tree` where it is a tree or any mapping (whose leaves are not
    read: ``pull``'s argument), else ``None``."""
    return Tree(keys) if isinstance(keys, Mapping) or is_tree(keys) else None


def fill(tree: Tree, values: list[Any]) -> Any:
    """``tree``'s structure with ``values`` (in its leaf order) as its leaves."""
    return jax.tree_util.tree_unflatten(tree.treedef, values)


def _first_difference(given: tuple[str, ...], stored: tuple[str, ...]) -> str:
    extra = sorted(set(given) - set(stored))
    missing = sorted(set(stored) - set(given))
    if extra and (not missing or extra[0] < missing[0]):
        return f"path {extra[0]!r}, which the stored tree does not have"
    return f"no leaf at path {missing[0]!r}, which the stored tree has"


def check_init(state: KVState, tree: Tree | None, keys: list[Any]) -> None:
    """Refuse an ``init`` that mixes plain keys with trees: a tree into a store of plain keys,
    plain keys into a store of trees."""
    if not len(state):
        return
    in_trees = {k for t in state.trees for k in t}
    if tree is not None and len(in_trees) < len(state):
        plain = next(k for k in state.keys() if k not in in_trees)
        raise KeyTypeError(
            f"tree key {tree.keys[0]!r}: expected a store of trees, given a store holding the "
            f"plain key {plain!r}; keep a tree in a store of its own, or init the tree's "
            "leaves as plain keys (a flat mapping)"
        )
    if tree is None and state.trees and keys:
        raise KeyTypeError(
            f"key {keys[0]!r}: expected a tree (this store holds the trees given to init), "
            "given a plain key; keep plain keys in a store of their own"
        )


def check_push(state: KVState, tree: Tree) -> None:
    """Refuse a tree whose paths are not exactly those of a tree given to ``init``, naming the
    first path that differs."""
    paths = tree.paths()
    if paths in state.trees:
        return
    if not state.trees:
        raise KVStoreError(
            f"tree key {tree.keys[0]!r}: expected a store of trees (jaxkv.init with a tree), "
            "given a tree to a store of plain keys; push a flat mapping of its keys"
        )
    # The stored tree it shares the most with: the one it was meant to be.
    stored = max(state.trees, key=lambda t: len(set(t) & set(paths)))
    raise KVStoreError(
        f"expected a tree of the structure given to init ({len(stored)} leaves), given a "
        f"tree of {len(paths)} leaves with {_first_difference(paths, stored)}"
    )
