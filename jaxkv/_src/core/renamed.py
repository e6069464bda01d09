"""Computations shared by keys of the same shapes: a push or an optimizer's init run on the keys
renamed by their rank, where the numbers cannot depend on the keys' names.

A push's computation is compiled per signature, and the keys' names are part of it: they name
the tree an updater sees and the optimizer state's structure. Keys made one at a time (MXNet's
tutorial: init a key, push it, read it, next key) then compile one computation per key, though
every key of a shape computes the same. Renamed by rank (the i-th of the pushed keys in sorted
order is called ``i``), keys of the same shapes and dtypes share one computation; the trees'
orders agree (a dict's leaves are in sorted key order), so each leaf pairs with the same leaf as
under the keys' own names. The optimizer state goes in and out as its leaves, and its structure
for the renamed keys is traced (``jax.eval_shape`` of the optimizer's ``init``), not compiled.

Renamed only where the names cannot matter:
  - no updater (an assignment);
  - a transformation marked ``updater.positional`` (MXNet's optimizers: their per-key numbers
    are arguments);
  - an optax transformation pushed to one key of a store of plain keys, where its ``init`` and
    ``update`` traced for the key's own name and for its rank give the same program (the same
    jaxpr and constants; checked once per key, traced, not compiled). A mask or a label by
    name then differs in the program, and the key's own name is used.
A store holding trees is never renamed for optax (its optimizer sees the trees' paths), nor are
keys with shardings of their own.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkv._src.core.updater import is_positional
from jaxkv._src.errors import KVStoreError
from jaxkv._src.state.kvstate import Key, KVState

__all__ = ["call", "init", "ranks", "renamable", "restructured"]

_CHECKED_MAX = 1024  # verdicts of the programs' comparison kept, least recent dropped first


def renamable(state: KVState, updater: Any, keys: tuple[Key, ...]) -> bool:
    """Whether a push of ``updater`` to ``keys`` may run on the keys renamed by rank (for an
    optax transformation not marked positional, the push checks its programs first)."""
    if state.tp_specs:
        return False
    if updater is None or (is_positional(updater) and len(keys) == 1):
        return True
    return isinstance(updater, optax.GradientTransformation) and len(keys) == 1 and not state.trees


def ranks(keys: tuple[Key, ...]) -> tuple[int, ...]:
    """Each key's rank among ``keys`` (their names once renamed)."""
    order = sorted(keys)
    return tuple(order.index(k) for k in keys)


def call(
    fn: Callable,
    named_fn: Callable[[], Callable],
    updater: Any,
    named: tuple[Key, ...],
    stored: list[jax.Array],
    opt_state: Any,
    residuals: list[Any],
    pushed: list[jax.Array],
    extra_args: Any = None,
) -> tuple[Any, Any, list[Any]]:
    """The push computation on the keys ``named`` renamed by rank (``fn``, which takes the
    optimizer state as its leaves and the renamed state's structure as a last argument): the
    state's leaves in, the new ones out in the keys' own structure. Where the renamed
    structure cannot be told, the programs differ, an extra argument is given, or tracing
    raises (the message then names the keys), the computation of the keys' own names
    (``named_fn()``) runs instead."""
    leaves, own = jax.tree_util.tree_flatten(opt_state)
    avals = _avals_of(stored)
    renamed = _structure(updater, own, ranks(named), avals)
    checked = is_positional(updater) or (
        extra_args is None
        and renamed is not None
        and _same_update(updater, named, avals, own, renamed, _avals_of(leaves))
    )
    if renamed is None or not checked:
        return named_fn()(stored, opt_state, residuals, pushed, extra_args)
    try:
        values, new_leaves, new_residuals = fn(
            stored, leaves, residuals, pushed, extra_args, renamed
        )
    except KVStoreError:  # raised while tracing: nothing ran; the message names the keys
        return named_fn()(stored, opt_state, residuals, pushed, extra_args)
    return values, jax.tree_util.tree_unflatten(own, new_leaves), new_residuals


def init(optimizer: Any, run: Callable[[dict], Any], tree: dict[Key, Any]) -> Any | None:
    """``optimizer``'s state for ``tree`` made by ``run`` (a compiled ``init``) on the keys
    renamed by rank, then given the keys' own structure; ``None`` where it may not be (see
    the module doc: the caller then runs it on the keys' own names)."""
    keys = tuple(tree)
    if not is_positional(optimizer) and not _same_init(optimizer, keys, _avals_of(tree.values())):
        return None
    return restructured(optimizer, tree, run(dict(zip(ranks(keys), tree.values()))))


def restructured(optimizer: Any, tree: dict[Key, Any], made: Any) -> Any | None:
    """``made`` (``optimizer``'s state made for ``tree``'s keys renamed by rank) in the
    structure ``optimizer.init(tree)`` has (traced, not compiled); ``None`` where the two do
    not hold as many leaves."""
    own: Any = jax.tree_util.tree_structure(
        jax.eval_shape(optimizer.init, _specs(tuple(tree), _avals_of(tree.values())))
    )
    leaves = jax.tree_util.tree_leaves(made)
    if own.num_leaves != len(leaves):
        return None
    return jax.tree_util.tree_unflatten(own, leaves)


# -- what is traced, not compiled ----------------------------------------------------------
def _specs(keys: tuple, avals: tuple) -> dict:
    return {k: jax.ShapeDtypeStruct(shape, dtype) for k, (shape, dtype) in zip(keys, avals)}


def _avals_of(leaves: Iterable[Any]) -> tuple:
    return tuple((tuple(x.shape), _dtype_name(x.dtype)) for x in leaves)


def _dtype_name(dtype: Any) -> str:
    # (at every push: NumPy's own dtypes named directly, JAX's extended ones through jnp)
    return dtype.name if isinstance(dtype, np.dtype) else jnp.dtype(dtype).name


@functools.lru_cache(maxsize=256)
def _structure(updater: Any, own: Any, ranked: tuple[int, ...], avals: tuple) -> Any:
    """The structure of ``updater``'s state for keys named ``ranked`` (values of ``avals``),
    where it holds as many leaves as a state of structure ``own`` (else ``None``)."""
    try:
        made = jax.eval_shape(updater.init, _specs(ranked, avals))
    except Exception:  # noqa: BLE001 - then the keys' own names are used
        return None
    renamed: Any = jax.tree_util.tree_structure(made)
    return renamed if renamed.num_leaves == own.num_leaves else None


def _same_program(a: Any, b: Any) -> bool:
    """Whether two closed jaxprs are one program: the same equations and constants."""
    if str(a.jaxpr) != str(b.jaxpr) or len(a.consts) != len(b.consts):
        return False
    return all(
        np.shape(x) == np.shape(y)
        and np.asarray(x).dtype == np.asarray(y).dtype
        and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(a.consts, b.consts)
    )


_CHECKED: collections.OrderedDict = collections.OrderedDict()


def _checked(key: tuple, check: Callable[[], bool]) -> bool:
    """``check()``'s verdict, kept by ``key`` (its updater kept alive with it)."""
    verdict = _CHECKED.get(key)
    if verdict is None:
        try:
            verdict = bool(check())
        except Exception:  # noqa: BLE001 - then the keys' own names are used
            verdict = False
        _CHECKED[key] = verdict
        while len(_CHECKED) > _CHECKED_MAX:
            _CHECKED.popitem(last=False)
    return verdict


def _same_init(optimizer: Any, keys: tuple, avals: tuple) -> bool:
    def check() -> bool:
        a = jax.make_jaxpr(optimizer.init)(_specs(keys, avals))
        b = jax.make_jaxpr(optimizer.init)(_specs(ranks(keys), avals))
        return _same_program(a, b)

    return _checked(("init", optimizer, keys, avals), check)


def _same_update(
    updater: Any, keys: tuple, avals: tuple, own: Any, renamed: Any, state_avals: tuple
) -> bool:
    def check() -> bool:
        states = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in state_avals]

        def program(names: tuple, structure: Any) -> Any:
            tree = _specs(names, avals)
            state = jax.tree_util.tree_unflatten(structure, states)
            return jax.make_jaxpr(lambda g, s, p: updater.update(g, s, p))(tree, state, tree)

        return _same_program(program(keys, own), program(ranks(keys), renamed))

    return _checked(("update", updater, keys, avals, own, state_avals), check)
