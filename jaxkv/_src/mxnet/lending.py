"""The imperative store's lend/donate policy: what a push may donate, given what it lent out.

A ``KVStore`` hands its arrays out in two ways: to the outs of a pull, which it lends its stored
values to with no copy where it keeps them (:meth:`Lending.keeps_values`), and through
``kv.state``. A push may reuse (donate) the buffers of neither while they are still held, or
a caller's array would be deleted under it. The bookkeeping costs O(1) a stored array lent
(not an out), however many arrays stay lent."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import jax

from jaxkv._src.core.signature import KEEP_VALUES, Donate
from jaxkv._src.state import buckets, pairing, placement
from jaxkv._src.state.kvstate import Key, KVState, spans_processes

__all__ = ["Lending"]

# A note of a lent array: a weak reference to it (a note never keeps an array alive).
_note = weakref.ref


class Lending:
    """One store's lent and handed-out arrays, and the donation each push may make."""

    def __init__(self) -> None:
        # Arrays handed out through `state`: never donated while the store still holds them.
        self.shared: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # Whether the store keeps its values at each push (donating only the optimizer state
        # and residuals) and lends them to the outs of a pull, with no copy; decided once, at
        # the first push or pull (see keeps_values), so every push has one donation mode.
        self.keep_values: bool | None = None
        # Stored arrays lent to outs, by id. A push of rows donates a table unless it was
        # lent (see lent).
        self.lent_to: dict[int, weakref.ref] = {}
        self._limit = 64  # lend sweeps lent_to when it grows past this
        # The values of pulls not made yet (placement.Later: made when an out is first read),
        # each holding the stored arrays it reads: spared (given copies) before a push that
        # may donate them.
        self.laters: weakref.WeakSet = weakref.WeakSet()

    def keeps_values(self, state: KVState) -> bool:
        """Whether the store keeps its values at each push and lends them to outs, decided at
        its first push or pull (``state``: the store's then): yes where no value is split
        across devices, in one process or several (a pull into outs can then hand out the
        stored arrays as they are, MXNet's usual push-then-pull loop copies nothing, and a
        push holds the old and new values as a donating push followed by a copying pull
        would); no otherwise (split values are gathered into fresh copies at each pull
        anyway, and donating them saves their memory)."""
        if self.keep_values is None:
            self.keep_values = not any(
                buckets.is_split(state, i) for i in range(len(state.key_shapes))
            )
        return self.keep_values

    def lend(self, arrays: Iterable[jax.Array]) -> None:
        """Note that a pull gave outs the stored ``arrays`` (or parts of them): one note per
        array, however many outs got it, and none for an array noted already."""
        table = self.lent_to
        for x in arrays:
            note = table.get(id(x))
            if note is None or note() is not x:
                if len(table) > self._limit:  # forget the arrays no one holds any more
                    table = self.lent_to = {i: n for i, n in table.items() if n() is not None}
                    # The next sweep after as many new notes again as survive this one: O(1)
                    # a note, however many arrays stay lent.
                    self._limit = 2 * len(table) + 64
                table[id(x)] = _note(x)

    def later(self, made: Any) -> None:
        """Note the values of a pull to be made when an out is first read (``placement.Later``)."""
        self.laters.add(made)

    def spare(self) -> None:
        """Before a push that may donate stored arrays: every pull's values not made yet hold
        copies of the arrays they read instead (one computation each), so that no out loses its
        value. Once spared, they read nothing of the store's."""
        if self.laters:
            for made in list(self.laters):
                made.spare()
            self.laters.clear()

    def spare_for_rows(self, state: KVState, keys: list[Key]) -> None:
        """:meth:`spare`, before a donating push of rows to ``keys``, where it may donate what a
        pull not made yet reads: a bucket (the keys lie in one, or the push takes the whole
        state). A push into tables kept as arrays of their own donates none (a pull not made
        yet holds the buckets alone), so the pulled values stay unmade and uncopied: a model's
        small keys pulled at every step beside a table cost no copy of their buckets."""
        if self.laters and _own_rows(state, keys) is None:
            self.spare()

    def lent(self, leaves: list[Any]) -> bool:
        """Whether one of the stored arrays ``leaves`` was lent to an out (then a push must not
        donate it: an out may still hold it, or a part of it). Once the store holds a new
        array for a key (the next push), that key is free to donate again."""
        for leaf in leaves:
            note = self.lent_to.get(id(leaf))
            if note is not None and note() is leaf:
                return True
        return False

    def share(self, state: KVState) -> None:
        """Note the arrays of ``state``, handed out through ``kv.state``."""
        for leaf in jax.tree_util.tree_leaves(state):
            self.shared[id(leaf)] = leaf

    def row_push_donates(self, state: KVState, keys: list[Key]) -> bool:
        """Whether a push of rows to ``keys`` may donate the buffers it updates (the table,
        in place, and its optimizer state): nothing handed out through ``state`` is held, and
        no out holds a table it was lent. A store that keeps its values lends them only to
        the outs of a dense pull, which an embedding table's loop never makes: its table is
        then updated in place, at a cost that grows with the rows alone."""
        if len(self.shared):
            return False
        self.spare_for_rows(state, keys)
        if not self.keeps_values(state):
            return True
        if state.flat_layout is None:
            return not self.lent([state[k] for k in keys])
        own = _own_rows(state, keys)
        if own is None:  # it takes a bucket (or the whole state): a lent view may alias a bucket
            return not any(note() is not None for note in self.lent_to.values())
        # the keys' own arrays: all the push takes of the stored values (O(keys))
        return not self.lent([state.leaves[j] for j in own])

    def detached(self, state: KVState) -> KVState:
        """``state``, where it spans processes and arrays of it handed out through ``kv.state``
        are still held, with fresh copies of those (each process copying its own shards: no
        collective), which it no longer shares: a push then donates as every other process's
        does, whatever this process holds. JAX 0.12 pairs the collectives of one compiled
        program alone, and a program that donates is another: a push donating on one process
        and not on another hangs. One copy of what was handed out, once; the arrays handed
        out stay valid."""
        if not len(self.shared) or not spans_processes(state.devices):
            return state
        leaves, tree = jax.tree_util.tree_flatten(state)
        held = [j for j, x in enumerate(leaves) if self.shared.get(id(x)) is x]
        self.shared = weakref.WeakValueDictionary()
        if not held:
            return state
        for j, x in zip(held, placement.copies([leaves[j] for j in held])):
            leaves[j] = x
        return jax.tree_util.tree_unflatten(tree, leaves)

    def donation(self, state: KVState, key: Any, values: Any) -> Donate:
        """What a push of ``values`` to ``key`` into the store's ``state`` may donate: its
        values and the rest, or all but the values (:meth:`keeps_values`), or nothing while
        something handed out through ``state`` is held."""
        self.spare()  # (a push that donates nothing need not: it comes to the same)
        donate: Donate = KEEP_VALUES if self.keeps_values(state) else True
        if len(self.shared):
            # Forget what the store no longer holds: those arrays it can never donate.
            live = {id(leaf) for leaf in jax.tree_util.tree_leaves(state)}
            for gone in [i for i in list(self.shared.keys()) if i not in live]:
                self.shared.pop(gone, None)
        if len(self.shared):  # something handed out through `state` is held: keep it valid
            if state.flat_layout is None and not state.deferred:
                # One array per key, and none to settle into buckets first: a push donates
                # only its keys' leaves and their group's state.
                pushed = {k for k, _ in pairing.pairs(key, values, "values") if k in state}
                groups = {g for k in pushed if (g := state.opt_group(k)) is not None}
                leaves = jax.tree_util.tree_leaves(
                    [[state[k] for k in pushed], [state.opt_states[g] for g in groups]]
                )
                if any(id(leaf) in self.shared for leaf in leaves):
                    donate = False
            else:
                # A push may write into buckets other keys share, or settle keys held apart
                # into buckets first (then donating every leaf): any leaf handed out counts,
                # and every one left in `shared` is a leaf of `state` (forgotten above if not).
                donate = False
        return donate


def _own_rows(state: KVState, keys: list[Key]) -> list[int] | None:
    """The leaf positions of ``keys``' arrays of their own in a flat state (all a push of rows
    to them takes of its stored values: ``KVState.own_leaves``), else ``None``."""
    if state.flat_layout is None:
        return None
    return state.own_leaves([state.index(k) for k in keys])
