"""What a cached push computation is built from: one frozen object, whose hash is its cache key.

An eager push compiles one computation per :class:`PushKey` and updater (``eager.push_fn``,
``eager.flat_push_fn``). The computation is built from the key alone: the store's static facts
come from ``key.facts`` (``Facts.emptied()``), never from the state the first call had, so that
nothing a computation depends on can be left out of its key. A new option of a push is a new
field here, and with it part of every key."""

from __future__ import annotations

import dataclasses

from jaxkv._src.state.kvstate import Facts, Key, KVState
from jaxkv._src.state.placement import Keyed

__all__ = ["Donate", "KEEP_VALUES", "Kind", "PushKey"]

# How a key's contributions reach the push computation: ``'one'`` (one value, on the store's
# devices), ``'stacked'`` (one block per device, to be summed), ``('compressed', mask)``
# (one block per device, compressed first; ``mask`` says which devices pushed), or
# ``'exchanged'`` (one block per process, its devices' sum, compressed and exchanged across
# the processes: a compressed store with one device per process).
Kind = str | tuple[str, tuple[bool, ...]]

# What a push may reuse the buffers of: ``True`` (the stored values, optimizer state and
# residuals), ``False`` (nothing), or ``KEEP_VALUES`` (all but the stored values: a ``KVStore``
# that keeps its values to lend them to the outs of its pulls).
KEEP_VALUES = "all but the values"
Donate = bool | str


@dataclasses.dataclass(frozen=True, slots=True)
class PushKey:
    """A push computation's key: the store's facts, its layout, the keys pushed (renamed by
    rank where ``by_rank``) and how each value arrives, what is donated, a mean's divisors, and
    the keys with their own sharding (tensor parallelism). The updater is held beside it, by
    identity (``eager._Computations``)."""

    facts: Facts
    layout: str  # "keys": one array per key; "flat": the state's buckets go in and out
    keys: tuple[Key, ...]
    kinds: tuple[Kind, ...]
    donate: Donate
    divisors: tuple[int, ...] | None
    by_rank: bool = False
    keyed: Keyed = ()

    def placement(self) -> KVState:
        """A state with no keys and the key's facts: all a computation reads of the store."""
        return self.facts.emptied()
