"""What a cached push is built from: its options and its computation's key, frozen objects
whose hashes are the cache keys.

A push's options (:class:`PushOptions`) are built once by ``jaxkv.push`` and held whole by the
plans' key (``plans.py``) and by :class:`PushKey`, an eager push's computation's key
(``eager.push_fn``, ``eager.flat_push_fn``). The computation is built from its key alone: the
store's static facts come from ``key.facts`` (``Facts.emptied()``), never from the state the
first call had, so that nothing a computation depends on can be left out of its key. A new
option of a push is a new field of :class:`PushOptions`, and with it part of every key."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxkv._src.state.kvstate import Facts, Key, KVState
from jaxkv._src.state.placement import Keyed

__all__ = ["Donate", "KEEP_VALUES", "Kind", "PushKey", "PushOptions"]

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
class PushOptions:
    """A push's options, built once by ``jaxkv.push`` from its arguments: the plans' cache
    (``plans.py``) and the computations' (:class:`PushKey`) key on this object whole, so that
    an option added here is part of every key with nothing else to change. The updater is
    compared by identity (``updater_id``; two ``optax.sgd(0.1)`` are two updaters: each has
    its own state), and a key holding the object holds the updater alive, so its id is not
    reused while the key lives."""

    updater: Any = dataclasses.field(compare=False, repr=False)
    donate: Donate = False
    reduce: str = "sum"  # 'mean' divides by the values per key (PushKey.divisors per key)
    updater_id: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "updater_id", id(self.updater))


@dataclasses.dataclass(frozen=True, slots=True)
class PushKey:
    """A push computation's key: the store's facts, its layout, the keys pushed (renamed by
    rank where ``by_rank``) and how each value arrives, the push's options (its updater by
    identity, what is donated), a mean's divisors per key, and the keys with their own
    sharding (tensor parallelism)."""

    facts: Facts
    layout: str  # "keys": one array per key; "flat": the state's buckets go in and out
    keys: tuple[Key, ...]
    kinds: tuple[Kind, ...]
    options: PushOptions
    divisors: tuple[int, ...] | None
    by_rank: bool = False
    keyed: Keyed = ()

    def placement(self) -> KVState:
        """A state with no keys and the key's facts: all a computation reads of the store."""
        return self.facts.emptied()
