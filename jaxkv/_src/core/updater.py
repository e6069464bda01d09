"""Running an updater: an optax transformation over one optimizer group as one tree, or an
MXNet-style ``updater(key, pushed, stored)`` key by key; the one piece of code the eager push
(``_push.py``) and the push inside the user's trace (``_trace.py``) share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import optax

from jaxkv._src.errors import KVStoreError, ShapeError
from jaxkv._src.state.kvstate import Key, KVState
from jaxkv._src.state.pairing import as_array

__all__ = [
    "Updater",
    "apply_updater",
    "apply_updates",
    "is_pure_updater",
    "optimizer_group",
    "pure_updater",
    "updater_name",
]

_PURE = "__jaxkv_pure_updater__"


def pure_updater(updater: Any) -> Any:
    """Mark ``updater(key, input, stored)`` as pure: it computes its result from its arguments
    only (no Python state, no side effects), so the imperative ``KVStore`` may trace it once
    and compile it, instead of calling it as Python on every push as MXNet does.

    Returns ``updater`` itself; usable as a decorator.

    Examples:
      >>> import jaxkv
      >>> @jaxkv.pure_updater
      ... def update(key, input, stored):
      ...     return stored + 2 * input
      >>> jaxkv.create("local").set_updater(update)
    """
    if not callable(updater):
        raise KVStoreError(
            f"pure_updater: expected a callable updater(key, input, stored), given {updater!r}"
        )
    try:
        setattr(updater, _PURE, True)
    except (AttributeError, TypeError):  # a builtin or a bound method: wrap it
        fn = updater

        def pure(key: Key, pushed: Any, stored: Any) -> Any:
            return fn(key, pushed, stored)

        pure.__qualname__ = getattr(fn, "__qualname__", repr(fn))
        setattr(pure, _PURE, True)
        return pure
    return updater


def is_pure_updater(updater: Any) -> bool:
    """Whether ``updater`` was marked with :func:`pure_updater`."""
    return bool(getattr(updater, _PURE, False))


def updater_name(updater: Any) -> str:
    """How a message names ``updater``: its qualified name, else its type's."""
    return getattr(updater, "__qualname__", None) or type(updater).__name__


class Updater(Protocol):
    """How a pushed value is merged into the stored one.

    Called once per distinct key of a push, inside ``jit``, with the key (a Python ``int`` or
    ``str``), the pushed value summed over devices (already cast to the stored dtype) and the
    stored value; returns the new stored value, of the stored shape. The default is assign.
    An ``optax.GradientTransformation`` may be given instead: the pushed value is then the
    gradient, and the optimizer state is kept in the ``KVState``.
    """

    def __call__(self, key: Key, pushed: jax.Array, stored: jax.Array) -> jax.Array: ...


def _group_names(keys: Sequence[Key]) -> str:
    return "[" + ", ".join(map(repr, keys)) + "]"


def optimizer_group(
    state: KVState, keys: Sequence[Key], unpack: bool = True
) -> tuple[tuple[Key, ...], Any]:
    """The optimizer group an optax push of ``keys`` updates, and its state (``None`` if the
    keys have none yet: they become a new group; with ``unpack=False``, ``True`` in place of
    a state that exists, which under a flat layout would take a computation to unpack).

    An optax push updates the pushed keys as one tree, as ``optax.update`` would. So the
    pushed keys must be exactly one group, or all be without optimizer state; anything else
    is refused, since part of a group's state (a shared step count, a global norm) would
    otherwise be updated for keys that were not pushed.
    """
    keys = tuple(sorted(keys))
    groups = {k: state.opt_group(k) for k in keys}
    if all(g is None for g in groups.values()):
        return keys, None
    group = next(g for g in groups.values() if g is not None)
    if group == keys:
        return group, state.opt_states[group] if unpack else True
    fresh = [k for k, g in groups.items() if g is None]
    others = sorted({g for g in groups.values() if g is not None and g != group})
    given = f"keys {_group_names(keys)}"
    if fresh:
        why = f"keys {_group_names(fresh)} have no optimizer state yet"
    elif others:
        why = f"they span the groups {', '.join(_group_names(g) for g in [group, *others])}"
    else:
        why = f"the group also holds {_group_names([k for k in group if k not in keys])}"
    raise KVStoreError(
        f"{given}: an optax push updates one optimizer group as one tree, expected exactly the "
        f"keys of group {_group_names(group)}, given {_group_names(keys)} ({why}). A group is "
        "the key set of the first optax push of its keys, or of jaxkv.init_optimizer. Push "
        "the same keys together every time (zeros for keys without a gradient), or make the "
        "groups you need with jaxkv.init_optimizer(state, optimizer, keys=...)"
    )


def apply_updates(params: Any, updates: Any) -> Any:
    """``optax.apply_updates``, with an update of a wider float type than its parameter (a
    float32 update of a float16 weight, from a float32 master copy) added in the wider type and
    cast back, whatever JAX's dtype promotion mode (optax's adds them as promotion allows)."""

    def add(p: Any, u: Any) -> Any:
        if p is None:
            return None
        p = jax.numpy.asarray(p)
        u = jax.numpy.asarray(u)
        if (
            u.dtype != p.dtype
            and jax.numpy.issubdtype(p.dtype, jax.numpy.floating)
            and jax.numpy.issubdtype(u.dtype, jax.numpy.floating)
            and u.dtype.itemsize > p.dtype.itemsize
        ):
            return (p.astype(u.dtype) + u).astype(p.dtype)
        return jax.numpy.asarray(p + u).astype(p.dtype)

    return jax.tree.map(add, params, updates, is_leaf=lambda x: x is None)


def apply_updater(
    updater: Any,
    keys: Sequence[Key],
    pushed: Sequence[jax.Array],
    stored: Sequence[jax.Array],
    opt_state: Any,
    extra_args: dict[str, Any] | None = None,
) -> tuple[list[jax.Array], Any]:
    """Run ``updater`` for ``keys``; returns ``(new_values, new_opt_state)``.

    An optax transformation updates the keys as one tree ``{key: value}`` (their group), as
    ``optax.update`` + ``optax.apply_updates`` would, ``extra_args`` passed to its ``update``
    as keyword arguments (optax's ``GradientTransformationExtraArgs``); any other updater runs
    key by key.
    """
    if updater is None:
        new = list(pushed)
    elif isinstance(updater, optax.GradientTransformation):
        params = dict(zip(keys, stored))
        try:
            if opt_state is None:
                opt_state = updater.init(params)
            updates, opt_state = updater.update(
                dict(zip(keys, pushed)), opt_state, params, **(extra_args or {})
            )
        except KVStoreError:
            raise
        except Exception as e:
            raise KVStoreError(
                f"keys {_group_names(keys)}: the optimizer raised {type(e).__name__}: {e}"
            ) from e
        result = apply_updates(params, updates)
        new = [result[k] for k in keys]
    else:
        new = []
        for key, p, s in zip(keys, pushed, stored):
            try:
                value = updater(key, p, s)
            except KVStoreError:
                raise
            except Exception as e:
                name = updater_name(updater)
                raise KVStoreError(
                    f"key {key!r}: the updater {name} raised {type(e).__name__}: {e}"
                ) from e
            if value is None:
                raise KVStoreError(
                    f"key {key!r}: the updater returned None, expected the new stored value. "
                    "MXNet-style in-place updaters (stored += ...) work through jaxkv.KVStore; "
                    "a functional updater must return the new value"
                )
            new.append(value)
    out = []
    for key, value, s in zip(keys, new, stored):
        value = as_array(value)
        if tuple(value.shape) != tuple(s.shape):
            raise ShapeError(
                f"key {key!r}: the updater returned shape {tuple(value.shape)}, expected the "
                f"stored shape {tuple(s.shape)}"
            )
        out.append(value.astype(s.dtype))
    return out, opt_state
