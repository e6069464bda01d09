"""What an optax updater sees: the tree the store was initialised with, in place of the store's
flat ``{key: value}`` mapping.

Inside, a push hands an optimizer group's values around as ``{key: value}`` (keys named by
their paths, ``'params/dense/bias'``), and its optax state is kept in that form too: its
per-key subtrees (Adam's ``mu``) are ``{key: leaf}`` mappings, which the layouts, the
checkpoints and the sharding rules read. :func:`viewed` wraps a user's transformation so that
it is handed the user's own tree instead (a flax ``params`` dict stays one, with its paths),
whatever form the push took: masks and labels by path (``optax.masked``,
``optax.multi_transform``, flax's ``path_aware_map``) then see what they see on one device. The
wrapper turns the mapping into the tree on the way in and the tree into the mapping on the way
out, for the updates and for every subtree of the optax state that has the tree's structure.

Which tree: a group that is exactly a tree given to ``init`` gets that tree; a group within one
tree gets the tree with ``None`` in place of the leaves outside the group (optax treats ``None``
as an empty subtree); a group over several trees whose roots are dicts with distinct keys gets
one dict holding them all. A group over several trees of other kinds, and a store of plain keys,
keep the flat mapping.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterable
from typing import Any

import jax
import optax

from jaxkv._src.state.kvstate import KVState
from jaxkv._src.state.tree_shapes import TreeShape

__all__ = ["TreeView", "inner", "viewed", "viewed_trees"]

logger = logging.getLogger("jaxkv")


class _View:
    """A group's tree: its structure (``treedef``, with ``None`` nodes where the tree's leaves
    are outside the group) and the group's keys in its leaf order."""

    __slots__ = ("keys", "root", "treedef")
    treedef: Any  # (jaxlib ships no stub for PyTreeDef's methods)

    def __init__(self, template: Any, keys: list[str]):
        self.treedef = jax.tree_util.tree_structure(template)
        self.keys = tuple(keys)
        self.root = type(template)

    def tree(self, mapping: dict) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, [mapping[k] for k in self.keys])

    def mapping(self, tree: Any) -> dict:
        return dict(zip(self.keys, self.treedef.flatten_up_to(tree)))

    def matches(self, node: Any) -> bool:
        """Whether ``node`` has the tree's structure down to its leaves (which may be any
        subtree there: an optax ``MaskedNode``, say)."""
        if type(node) is not self.root:
            return False
        try:
            self.treedef.flatten_up_to(node)
        except (ValueError, TypeError):
            return False
        return True


def _template(shape: TreeShape, keys: frozenset) -> Any:
    """The tree of ``shape`` with each leaf its key, ``None`` for those outside ``keys``."""
    shape = shape.known()  # (a tree known by its paths only: nested dicts)
    return jax.tree_util.tree_unflatten(
        shape.treedef, [k if k in keys else None for k in shape.leaf_keys]
    )


def _view(trees: tuple[TreeShape, ...], keys: frozenset) -> _View | None:
    involved = [t for t in trees if not keys.isdisjoint(t)]
    if not involved or not keys <= {k for t in involved for k in t}:
        return None  # plain keys (or a tree's keys with others: no tree to hand)
    templates = [_template(t, keys) for t in involved]
    if len(templates) == 1:
        template = templates[0]
    elif all(isinstance(t, dict) for t in templates) and len(
        {k for t in templates for k in t}
    ) == sum(len(t) for t in templates):
        template = {k: v for t in templates for k, v in t.items()}
    else:
        logger.warning(
            "jaxkv: the optimizer group %s spans %d trees that do not merge into one dict; "
            "its optax updater is handed a flat mapping of their keys",
            sorted(keys),
            len(templates),
        )
        return None
    return _View(template, jax.tree_util.tree_leaves(template))


class _Views:
    """The views of one store's trees, one per key set, made once."""

    def __init__(self, trees: tuple[TreeShape, ...]):
        self.trees = trees
        self.made: dict[frozenset, _View | None] = {}
        self.lock = threading.Lock()

    def of(self, keys: Iterable[Any]) -> _View | None:
        keys = frozenset(keys)
        with self.lock:
            if keys not in self.made:
                self.made[keys] = _view(self.trees, keys)
            return self.made[keys]


def _walk(node: Any, fn: Any) -> Any:
    """``node`` with ``fn(x)`` in place of each subtree for which it is not ``None``, looked
    for from the root down."""
    got = fn(node)
    if got is not None:
        return got
    if node is None or jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(node)):
        return node
    children, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
    return jax.tree_util.tree_unflatten(treedef, [_walk(c, fn) for c in children])


def _state_tree(view: _View, opt_state: Any) -> Any:
    """The optax state as the wrapped transformation keeps it: each ``{key: leaf}`` mapping of
    the group's keys as the tree."""
    keys = set(view.keys)

    def one(node: Any) -> Any:
        if type(node) is dict and set(node) == keys:
            return view.tree(node)
        return None

    return _walk(opt_state, one)


def _state_mapping(view: _View, opt_state: Any) -> Any:
    """The optax state as the store keeps it: each subtree of the tree's structure as a
    ``{key: leaf}`` mapping."""
    return _walk(opt_state, lambda node: view.mapping(node) if view.matches(node) else None)


class TreeView(optax.GradientTransformationExtraArgs):
    """An optax transformation over a store's ``{key: value}`` mappings that runs the user's
    transformation (``inner``) on their tree (:func:`viewed`)."""

    inner: Any  # (set once made: a NamedTuple subclass keeps attributes in its __dict__)


# The wrappers made, by the transformation's id and the trees: the same object for the same
# pair, so that its pushes find their compiled computations. The wrapper holds the
# transformation, so its id is not reused while it is here.
_MADE: collections.OrderedDict[tuple, TreeView] = collections.OrderedDict()
_MADE_MAX = 64
_LOCK = threading.Lock()


def _wrap(tx: Any, views: _Views) -> TreeView:
    def init_fn(params: Any) -> Any:
        view = views.of(params) if isinstance(params, dict) else None
        if view is None:
            return tx.init(params)
        return _state_mapping(view, tx.init(view.tree(params)))

    def update_fn(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        view = views.of(updates) if isinstance(updates, dict) else None
        if view is None:
            return tx.update(updates, state, params, **extra)
        tree_params = None if params is None else view.tree(params)
        new, state = tx.update(view.tree(updates), _state_tree(view, state), tree_params, **extra)
        return view.mapping(new), _state_mapping(view, state)

    wrapper = TreeView(init_fn, update_fn)
    wrapper.inner = tx
    return wrapper


def viewed(state: KVState, updater: Any) -> Any:
    """``updater`` as a push of ``state`` runs it: an optax transformation wrapped to see the
    trees given to ``init`` (the same wrapper for the same transformation and trees, so that a
    push finds its compiled computation again); anything else, or a store of plain keys, as it
    is."""
    return viewed_trees(tuple(state.trees), updater)


def viewed_trees(trees: tuple[TreeShape, ...], updater: Any) -> Any:
    """:func:`viewed` for a store holding ``trees``."""
    if not trees or not isinstance(updater, optax.GradientTransformation):
        return updater
    if isinstance(updater, TreeView):
        return updater
    key = (id(updater), trees)
    with _LOCK:
        known = _MADE.get(key)
        if known is not None and known.inner is updater:
            _MADE.move_to_end(key)
            return known
        wrapper = _MADE[key] = _wrap(updater, _Views(trees))
        while len(_MADE) > _MADE_MAX:
            _MADE.popitem(last=False)
    return wrapper


def inner(updater: Any) -> Any:
    """The user's transformation of a :class:`TreeView` (else ``updater`` itself)."""
    return updater.inner if isinstance(updater, TreeView) else updater
