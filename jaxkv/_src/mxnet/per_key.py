"""An optax transformation run on each key alone, so one push updates many keys with MXNet's
per-key optimizer state (one state, one update count, per key).

MXNet's KVStore updates every key with its own optimizer state, whether the keys were pushed
one at a time or as a list. :func:`per_key` gives that inside one jaxkv optimizer group: its
state for a group of several keys is a :class:`PerKeyState` mapping each key to what
``inner.init({key: value})`` makes, and its update runs ``inner`` on each key alone. For a group
of one key it is ``inner`` itself, state and all, so a store's one-key groups mean the same
under both. Since each key's state stands alone, groups can be cut and joined without changing
a number (:func:`regroup`): the imperative store joins the keys it pushes together into one
group, so that they run as one computation. Such groups never leave the store: what it hands
out (``kv.state``) and saves has each of their keys as a group of its own (:func:`alone`), the
groups an optax push of one key at a time makes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import optax

from jaxkv._src.core import alike, renamed
from jaxkv._src.core.updater import init_state, is_positional, positional
from jaxkv._src.state.kvstate import Key, KVState

__all__ = ["PerKeyState", "alone", "holds_per_key", "per_key", "regroup"]


@jax.tree_util.register_pytree_with_keys_class
class PerKeyState:
    """The optimizer state of a group of several keys under :func:`per_key`: each key's own
    state, by key (in key order)."""

    __slots__ = ("states",)

    def __init__(self, states: dict[Key, Any]) -> None:
        self.states = {k: states[k] for k in sorted(states)}

    def tree_flatten_with_keys(self) -> tuple[list, tuple]:
        keys = tuple(self.states)
        return [(jax.tree_util.DictKey(k), self.states[k]) for k in keys], keys

    def tree_flatten(self) -> tuple[list, tuple]:
        keys = tuple(self.states)
        return [self.states[k] for k in keys], keys

    @classmethod
    def tree_unflatten(cls, keys: tuple, children: Sequence[Any]) -> PerKeyState:
        new = object.__new__(cls)
        new.states = dict(zip(keys, children))
        return new

    def __repr__(self) -> str:
        return f"PerKeyState({self.states!r})"


@functools.lru_cache(maxsize=256)
def per_key(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` run on each key of a tree alone, one state per key (the same object for the
    same ``inner`` while it is among the last 256, so its compiled pushes are reused). Its
    update's extra arguments (optax's ``GradientTransformationExtraArgs``) are arrays with a
    row per key, in the order of the keys of the gradients' tree (sorted): each key's update
    gets its row."""

    def init(params: dict) -> Any:
        return _joined({k: inner.init({k: v}) for k, v in params.items()})

    def update(grads: dict, state: Any, params: Any = None, **extra_args: Any) -> tuple[dict, Any]:
        # extra_args: each an array with a row per key, in the keys' order (per_key_args).
        if len(grads) == 1:
            return inner.update(grads, state, params, **_row(extra_args, 0))
        updates, states = {}, {}
        for i, k in enumerate(grads):
            u, states[k] = inner.update(
                {k: grads[k]},
                state.states[k],
                None if params is None else {k: params[k]},
                **_row(extra_args, i),
            )
            updates[k] = u[k]
        return updates, PerKeyState(states)

    # Messages name it by inner's functions: per_key(chain.<locals>.update_fn).
    for fn, of in ((init, inner.init), (update, inner.update)):
        fn.__qualname__ = f"per_key({getattr(of, '__qualname__', None) or type(of).__name__})"
    made = optax.GradientTransformationExtraArgs(init, update)
    # A flat store's push updates keys alike as one batch (core/alike.py).
    alike.register(made, alike.PerKey(inner, _own_states, _joined))
    return positional(made) if is_positional(inner) else made


def _own_states(state: Any) -> dict[Key, Any] | None:
    return dict(state.states) if isinstance(state, PerKeyState) else None


def _row(extra_args: dict[str, Any], i: int) -> dict[str, Any]:
    return {name: value[i] for name, value in extra_args.items()}


def _states_of(group: tuple[Key, ...], state: Any) -> dict[Key, Any] | None:
    """Each key's own state in a ``per_key`` group's ``state``, or ``None`` where the group's
    state is one tree over several keys (a list pushed under a plain optax transformation)."""
    if len(group) == 1:
        return {group[0]: state}
    if isinstance(state, PerKeyState) and tuple(state.states) == group:
        return dict(state.states)
    return None


def regroup(
    state: KVState, keys: Sequence[Key], inner: optax.GradientTransformation
) -> KVState | None:
    """``state`` with ``keys`` made one optimizer group of :func:`per_key` ``inner`` (each key
    keeping its own state; keys without one get ``inner``'s fresh state), and the other keys
    of the groups they leave kept as groups of their own. ``None`` where a group touched holds
    one state over several keys (not per key): it cannot be cut. ``state`` itself where
    ``keys`` already are one group, or none of them has state yet."""
    keys = tuple(sorted(keys))
    if keys in state.groups:  # one group already (MXNet's list push, step after step)
        return state
    touched = sorted({g for k in keys if (g := state.opt_group(k)) is not None})
    if not touched or touched == [keys]:
        return state
    # The old groups go first: replace() drops every group sharing a key with a given one.
    opt_states: dict[tuple[Key, ...], Any] = dict.fromkeys(touched)
    own: dict[Key, Any] = {}
    for g in touched:
        states = _states_of(g, state.opt_states[g])
        if states is None:
            return None
        own.update({k: s for k, s in states.items() if k in keys})
        rest = tuple(k for k in g if k not in keys)
        if rest:
            opt_states[rest] = _joined({k: states[k] for k in rest})
    fresh = [k for k in keys if k not in own]
    if fresh:
        own.update(_fresh_states(inner, {k: state[k] for k in fresh}))
    opt_states[keys] = _joined(own)
    return state.replace(opt_states=opt_states)


def _joined(states: dict[Key, Any]) -> Any:
    """The state of a group of ``states``' keys: a key's own state alone (``inner``'s), a
    :class:`PerKeyState` for several."""
    return next(iter(states.values())) if len(states) == 1 else PerKeyState(states)


def _fresh_states(inner: optax.GradientTransformation, values: dict[Key, Any]) -> dict[Key, Any]:
    """``inner``'s fresh state for each key of ``values`` alone, by one computation: where
    ``inner`` is positional (MXNet's optimizers), one for every key of the same shape and
    dtype (each key's state made for a key named 0, then given its own structure)."""
    keys = tuple(values)
    if is_positional(inner):
        made = _fresh_positional(inner)([values[k] for k in keys])
        out = {k: renamed.restructured(inner, {k: values[k]}, m) for k, m in zip(keys, made)}
        if all(m is not None for m in out.values()):
            return out
    return _fresh(inner, keys)(values)


@functools.lru_cache(maxsize=64)
def _fresh(inner: optax.GradientTransformation, keys: tuple[Key, ...]) -> Any:
    """One computation making ``inner``'s fresh state for each of ``keys`` alone."""
    return jax.jit(lambda values: {k: init_state(inner, {k: values[k]}) for k in keys})


@functools.lru_cache(maxsize=64)
def _fresh_positional(inner: optax.GradientTransformation) -> Any:
    """One computation making a positional ``inner``'s fresh state for each value of a list
    alone, as for a key named 0 (compiled per list of shapes and dtypes)."""
    return jax.jit(lambda values: [init_state(inner, {0: v}) for v in values])


def kept_per_key(state: KVState) -> list[tuple[Key, ...]]:
    """The groups of several keys that keep a state per key (made by pushes of one key at a
    time): one pass over the groups, no look-up per key (asked at every push)."""
    return [g for n, g in enumerate(state.groups) if len(g) > 1 and _is_per_key(state, n)]


def any_per_key(state: KVState) -> bool:
    """Whether ``state`` has a group of several keys that keeps a state per key."""
    return bool(kept_per_key(state))


def holds_per_key(state: KVState, keys: Sequence[Key]) -> bool:
    """Whether a key of ``keys`` is in a group of several keys that keeps a state per key."""
    kept = kept_per_key(state)
    return bool(kept) and any(state.opt_group(k) in kept for k in keys)


def alone(state: KVState) -> KVState:
    """``state`` with every key of a group kept per key made a group of its own, holding its
    own state: the groups pushes of one key at a time make, as optax and the functional core
    know them (``state`` itself where there is no such group)."""
    per = {g: st.states for g, st in _per_key_groups(state)}
    if not per:
        return state
    opt_states: dict[tuple[Key, ...], Any] = dict.fromkeys(per)
    for states in per.values():
        opt_states.update({(k,): s for k, s in states.items()})
    return state.replace(opt_states=opt_states)


def _per_key_groups(state: KVState) -> list[tuple[tuple[Key, ...], PerKeyState]]:
    """The groups of several keys whose state is kept per key, with that state."""
    return [(g, state.opt_states[g]) for g in kept_per_key(state)]


def _is_per_key(state: KVState, n: int) -> bool:
    packing = state.packings[n]
    if packing is not None:  # packed: the kind of tree tells, without unpacking it
        treedef = packing.treedef
        return isinstance(
            jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves), PerKeyState
        )
    return isinstance(state.group_states[n], PerKeyState)
