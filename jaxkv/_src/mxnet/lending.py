"""The imperative store's lend/donate policy: what a push may donate, given what it lent out.

A ``KVStore`` hands its arrays out in two ways: to the outs of a pull, which it lends its stored
values to with no copy where it keeps them (:meth:`Lending.keeps_values`), and through
``kv.state``. A push may reuse (donate) the buffers of neither while they are still held, or
a caller's array would be deleted under it. The bookkeeping costs O(1) a lend, however many
arrays stay lent."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import jax

from jaxkv._src.core.signature import KEEP_VALUES, Donate
from jaxkv._src.mxnet.ndarray import NDArray
from jaxkv._src.state import buckets, pairing
from jaxkv._src.state.kvstate import Key, KVState

__all__ = ["Lending", "holds"]

# An entry of what a stored array was lent to: (the array, {id(out): (out, what it got)}),
# all weakly held.
Entry = tuple[Any, dict[int, tuple[Any, Any]]]


class Lending:
    """One store's lent and handed-out arrays, and the donation each push may make."""

    def __init__(self) -> None:
        # Arrays handed out through `state`: never donated while the store still holds them.
        self.shared: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # Whether the store keeps its values at each push (donating only the optimizer state
        # and residuals) and lends them to the outs of a pull, with no copy; decided once, at
        # the first push or pull (see keeps_values), so every push has one donation mode.
        self.keep_values: bool | None = None
        # Stored arrays lent to outs, by id. A push of rows donates a table unless an out
        # still holds what it was lent (see lent).
        self.lent_to: dict[int, Entry] = {}
        self._limit = 64  # lend sweeps lent_to when it grows past this

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

    def lend(self, given: Iterable[tuple[jax.Array, NDArray]], leaves: int) -> None:
        """Note that each out of ``given`` was given what it holds now, a part of the stored
        array beside it (of a state of ``leaves`` leaves): one call for a whole pull."""
        ref = weakref.ref
        table = self.lent_to
        for stored, out in given:
            entry = table.get(id(stored))
            if entry is None or entry[0]() is not stored:
                if len(table) > self._limit:  # forget the dead
                    table = self.lent_to = {
                        i: e for i, e in table.items() if e[0]() is not None and holds(e)
                    }
                    # The next sweep after as many new entries again as survive this one: the
                    # sweeps cost O(1) a lend, however many arrays stay lent (MXNet's loop
                    # keeps one lent array per key and out).
                    self._limit = 2 * len(table) + 4 * leaves + 64
                entry = (ref(stored), {})
                table[id(stored)] = entry
            outs = entry[1]
            if len(outs) >= 8:  # lent to out after out: keep the outs that still hold it
                for i in [i for i, pair in outs.items() if not holds((entry[0], {i: pair}))]:
                    del outs[i]
            outs[id(out)] = (ref(out), ref(out.holding()))

    def lent(self, leaves: list[Any]) -> bool:
        """Whether an out still holds a part of one of the stored arrays ``leaves`` (then a
        push must not donate it)."""
        for leaf in leaves:
            entry = self.lent_to.get(id(leaf))
            if entry is not None and entry[0]() is leaf and holds(entry):
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
        if not self.keeps_values(state):
            return True
        if state.flat_layout is not None:  # a lent view may alias a bucket the push takes
            return not any(e[0]() is not None and holds(e) for e in self.lent_to.values())
        return not self.lent([state[k] for k in keys])

    def donation(self, state: KVState, key: Any, values: Any) -> Donate:
        """What a push of ``values`` to ``key`` into the store's ``state`` may donate: its
        values and the rest, or all but the values (:meth:`keeps_values`), or nothing while
        something handed out through ``state`` is held."""
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


def holds(entry: Entry) -> bool:
    """Whether an out of a lent array's entry (see :meth:`Lending.lend`) still holds what it
    was given."""
    for out_ref, handed_ref in entry[1].values():
        out, handed = out_ref(), handed_ref()
        if out is not None and handed is not None and out.holding() is handed:
            return True
    return False
