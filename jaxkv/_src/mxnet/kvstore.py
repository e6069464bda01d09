"""``KVStore``: MXNet's imperative KVStore API over the functional core.

The store holds one :class:`KVState` and rebinds it on every call; all logic lives in the pure
operations. Calls are serialised by a lock, so pushes from many threads lose nothing. The store
owns its buffers: a store with values split across devices donates them to each update; one
without lends them to the outs of a pull instead of copying them (and keeps them at each
update). Anything it hands out (pulled values, outs, ``state``) is never invalidated by a later
update.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax

import jaxkv._src.rows.ops  # noqa: F401 - rows.ops below
from jaxkv._src import jax_internals, rows
from jaxkv._src.checkpoint import npz
from jaxkv._src.core import compression, ops, plans, trees
from jaxkv._src.core.eager import check_laid_out
from jaxkv._src.core.updater import (
    as_transformation,
    as_updater,
    is_pure_updater,
    optimizer_group,
    positional,
    updater_name,
)
from jaxkv._src.errors import DtypeError, KVStoreError, ShapeError, shown
from jaxkv._src.mxnet import casts, held, kvstore_rows, lending, per_key, states_file
from jaxkv._src.mxnet.ndarray import NDArray, unwrap
from jaxkv._src.mxnet.optimizers import catalog  # noqa: F401 - fills the registry
from jaxkv._src.mxnet.optimizers.optimizer import Optimizer as MXNetOptimizer
from jaxkv._src.mxnet.updater import Updater as MXNetUpdater
from jaxkv._src.processes import host, join, order
from jaxkv._src.rows.sizes import Padded
from jaxkv._src.state import buckets, dtypes, pairing, placement
from jaxkv._src.state.kvstate import Key, KVState, empty, spans_processes
from jaxkv._src.state.policy import bound_from

__all__ = ["KVStore", "create"]

logger = logging.getLogger("jaxkv")

_LOCAL_TYPES = (
    "local",
    "device",
    "nccl",
    "local_allreduce_cpu",
    "local_allreduce_device",
    "local_update_cpu",
)
_DIST_TYPES = ("dist_sync", "dist_device_sync")
TYPES = _LOCAL_TYPES + _DIST_TYPES
_NOT_YET = {
    "dist_async": "asynchronous updates (dist_async) are not supported; use dist_sync, whose "
    "results are also reproducible",
    "dist_device_async": "asynchronous updates (dist_device_async) are not supported; use "
    "dist_device_sync",
}


def create(name: str = "local", *, reduce: str = "sum") -> KVStore:
    """A new :class:`KVStore` of type ``name`` (MXNet's ``mx.kv.create``).

    Args:
      name: one of ``local``, ``device`` (aliases ``nccl``, ``local_allreduce_cpu``,
        ``local_allreduce_device``, ``local_update_cpu``), ``dist_sync``, ``dist_device_sync``.
      reduce: how a push combines a key's values: ``'sum'`` (MXNet's) or ``'mean'`` (the sum
        divided by how many values were pushed, across processes too, as ``jax.lax.pmean``).

    Raises:
      KVStoreError: the name is unknown (the message lists the valid ones) or not supported.

    Examples:
      >>> import jaxkv
      >>> jaxkv.create("device").type
      'device'
    """
    return KVStore(_checked_type(name), reduce=reduce)


def create_drop_in(name: str = "local") -> DropInKVStore:
    """:func:`create` for ``jaxkv.mx.kv.create``: the store refuses what MXNet refuses where
    jaxkv's own store accepts more (see :class:`DropInKVStore`)."""
    return DropInKVStore(_checked_type(name))


def _checked_type(name: Any) -> str:
    if not isinstance(name, str):
        raise KVStoreError(f"KVStore type: expected a str such as 'local', given {name!r}")
    if name in _NOT_YET:
        raise KVStoreError(f"KVStore type {name!r}: {_NOT_YET[name]}")
    if name not in TYPES:
        raise KVStoreError(f"unknown KVStore type {name!r}: expected one of {list(TYPES)}")
    return name


def _from_mxnet_updater(updater: Any) -> Any:
    """An updater as the pure core wants it, from a pure one or an MXNet in-place one.

    MXNet updaters receive ``NDArray``s and mutate ``stored`` (``stored += input * 2``); here
    they receive ``NDArray`` handles over traced arrays, and the handle's final value is the
    new stored value. An updater that returns a value (array or ``NDArray``) is used as is.
    """
    if updater is None or isinstance(updater, optax.GradientTransformation):
        return updater
    if not callable(updater):
        raise KVStoreError(
            f"updater: expected a callable updater(key, input, stored), given {updater!r}"
        )

    @functools.wraps(updater)
    def pure(key: Key, pushed: jax.Array, stored: jax.Array) -> jax.Array:
        handle = NDArray(stored)
        out = updater(key, NDArray(pushed), handle)
        return handle.asjax() if out is None else unwrap(out)

    return pure


def _opened_tree(given: Any, call: str) -> trees.Tree | None:
    """What ``call`` (``init``, ``push``) got with no value: a tree (as a ``Tree``), or a flat
    mapping of keys to values (``None``); a key alone is refused."""
    split = trees.split(given)
    if split is None and not isinstance(given, Mapping):
        raise KVStoreError(
            f"{call}({given!r}): expected a value for the key, or a tree of parameters (or a "
            "mapping of keys to values), given a key and no value"
        )
    return split


def _unwrap_leaf(x: Any) -> Any:
    return x.asjax() if isinstance(x, NDArray) else x


def _unwrap_values(values: Any) -> Any:
    if type(values) is NDArray:
        return values.asjax()
    if isinstance(values, list | tuple):  # leaves unwrapped in place: pushes hold thousands
        return [v.asjax() if type(v) is NDArray else _unwrap_values(v) for v in values]
    return unwrap(values)


# MXNet's default for MXNET_KVSTORE_BIGARRAY_BOUND: the elements from which its servers split
# an array (a dist store's bound across processes).
MXNET_BIGARRAY_BOUND = 1_000_000


class KVStore:
    """MXNet's KVStore: ``init``, ``push``, ``pull`` and friends, over a :class:`KVState`.

    Make one with :func:`jaxkv.create`. Values are :class:`jaxkv.nd.NDArray` handles or
    ``jax.Array`` objects; ``pull(key)`` returns ``jax.Array`` objects, and
    ``pull(key, out=...)`` fills ``NDArray`` handles. ``KVStore(name, devices, layout=...)``
    makes one over given devices and in a given layout (see :func:`jaxkv.empty`; default: the
    environment variable ``JAXKV_LAYOUT``, else ``'auto'``).

    Examples:
      >>> import jaxkv, jaxkv.nd as nd
      >>> kv = jaxkv.create("local")
      >>> kv.init(3, nd.ones((2, 3)) * 2)
      >>> a = nd.zeros((2, 3))
      >>> kv.pull(3, out=a)
      >>> a.asnumpy().tolist()
      [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    """

    def __init__(
        self,
        name: str = "local",
        devices: Any = None,
        *,
        layout: str | None = None,
        reduce: str = "sum",
    ) -> None:
        if devices is None and name in _DIST_TYPES:
            try:  # under SLURM or Open MPI with no launcher: JAX's own cluster detection
                join.join_cluster()
            except RuntimeError as e:
                raise KVStoreError(
                    f"create({name!r}): expected to join the cluster job found in the "
                    "environment before JAX started, given a process where JAX has already "
                    f"computed ({e}); create the store (or call jax.distributed.initialize()) "
                    "before the first JAX computation"
                ) from None
            devices = join.process_devices()
        elif devices is None:  # MXNet's local and device stores: this process's devices
            devices = jax.local_devices()
        self._type = name
        self._lock = threading.RLock()
        # MXNet's knob for which arrays are big enough to be split across devices. Across
        # processes a dist store splits from MXNet's own default, as MXNet's servers do: each
        # process then keeps 1/P of every big value and of its optimizer state. Else jaxkv's
        # default ("default": JAXKV_BIGARRAY_BOUND, else policy.BIGARRAY_BOUND).
        bound: int | None | str = "default"
        if "MXNET_KVSTORE_BIGARRAY_BOUND" in os.environ:
            bound = bound_from("MXNET_KVSTORE_BIGARRAY_BOUND")
        elif name in _DIST_TYPES and jax.process_count() > 1:
            bound = MXNET_BIGARRAY_BOUND
        # What it holds until something reads (held.py): per-key inits, pushes and pulls into
        # outs (its queue), and a row-sparse push under MXNet's optimizer, checked and held
        # until the next call (its rows: a row_sparse_pull of its key then runs both in one
        # computation, pushpull_rows; any other use of the state runs it first, see _state).
        self._calls = held.Calls()
        self._stored: KVState = empty(devices, bigarray_bound=bound, layout=layout, reduce=reduce)
        self._updater: Any = None
        # An updater that runs as Python on every push (set_updater of a function not marked
        # pure), or None.
        self._python_updater: Any = None
        self._mxnet_optimizer: MXNetOptimizer | None = None  # where set_optimizer got one
        self._wrappers: dict[int, tuple[Any, Any]] = {}  # id(updater) -> (updater, wrapper)
        # What the store lent to outs and handed out, and what a push may donate (lending.py).
        self._lending = lending.Lending()

    # -- properties ------------------------------------------------------------------------
    @property
    def _state(self) -> KVState:
        """The store's state, with a held row-sparse push and the held calls applied first."""
        calls = self._calls
        if calls.rows is not None or calls.queue is not None:
            self.run_held()
        return self._stored

    @_state.setter
    def _state(self, state: KVState) -> None:
        calls = self._calls  # what it holds came first: it runs, then is replaced
        if calls.rows is not None or calls.queue is not None:
            self.run_held()
        self._stored = state

    def _runs(self) -> held.Runs:
        """This store's own calls, as its held calls run them (``held.Runs``)."""
        return held.Runs(
            owner=self,
            stored=self._get_stored,
            rebind=self._set_stored,
            init=self._init_now,
            push=self._push_held,
            pull=self._pull_now,
            restore=self._restore,
            spare_for_rows=self._lending.spare_for_rows,
            push_rows=kvstore_rows.run_held,
            group_updater=self._group_updater,
        )

    def _group_updater(self) -> Any:
        """The updater held pushes of several keys run with as one optimizer group, each key
        updated alone as MXNet's optimizer updates it (``_update``), where the store has an
        MXNet optimizer and no Python updater; else ``None``."""
        if self._mxnet_optimizer is None or self._python_updater is not None:
            return None
        if not isinstance(self._updater, optax.GradientTransformation):
            return None
        return per_key.per_key(self._updater)

    def _get_stored(self) -> KVState:
        return self._stored

    def _set_stored(self, state: KVState) -> None:
        self._stored = state

    def _restore(self, counted: Any) -> None:
        """Put back the MXNet optimizer's bookkeeping ``counted`` (``None``: nothing): the
        pushes counted since were refused, or dropped, as a push refused at once."""
        if counted is not None and self._mxnet_optimizer is not None:
            self._mxnet_optimizer.restore_bookkeeping(counted)

    @property
    def type(self) -> str:
        """The type name, as given to :func:`create`."""
        return self._type

    @property
    def rank(self) -> int:
        """This worker's index (the JAX process index)."""
        return jax.process_index()

    @property
    def num_workers(self) -> int:
        """How many workers (JAX processes) share the store."""
        return jax.process_count()

    @property
    def state(self) -> KVState:
        """The current :class:`KVState`, for use in a functional loop.

        Later updates of this store never invalidate it. Keys inited one at a time are laid
        out (their buckets) in the state handed out; the store keeps that layout, except in a
        store over several processes, where one process alone may take the state and the
        store's layout must stay alike in every process.
        """
        with self._lock:
            # Keys inited one at a time laid out (kept so: the same state until a change),
            # and each key pushed alone a group of its own. Across processes the store keeps
            # its own layout: one process alone may take the state, and a store laid out anew
            # would make that process's next push another program than the other processes'
            # (which hang there). Laying out is each process's own (no collective).
            settled = self._state.settled()
            if not spans_processes(settled.devices):
                self._stored = settled
            state = per_key.alone(settled)
            self._lending.share(state)
            return state

    @state.setter
    def state(self, state: KVState) -> None:
        if not isinstance(state, KVState):
            raise KVStoreError(f"state: expected a jaxkv.KVState, given {type(state).__name__}")
        with self._lock:
            self._lending.share(state)
            self._state = state

    def keys(self) -> list:
        """The keys in the store, sorted."""
        return list(self._state.keys())

    def __repr__(self) -> str:
        return (
            f"KVStore(type={self._type!r}, keys={len(self._state)}, "
            f"devices={len(self._state.devices)})"
        )

    # -- init / push / pull ----------------------------------------------------------------
    def init(self, key: Any, value: Any = pairing.MISSING) -> None:
        """Add ``key`` (or a list of keys) with an initial value each; or, with no value, a
        tree of parameters (a flax ``params`` dict, any pytree), each leaf a key named by its
        path as in :func:`jaxkv.init` (``kv.pull(tree)`` then gives the tree back).

        Checked at once; held until something reads, with the store's other held calls. A
        store holds trees or plain keys, not both: mixing them is refused."""
        with self._lock:
            if value is pairing.MISSING:
                self._init_tree(key)
                return
            keys = list(key) if isinstance(key, list | tuple) else [key]
            trees.check_init(self._stored, None, keys)  # plain keys into a store of trees
            values = _unwrap_values(value)
            if not self._may_hold(values):
                self._init_now(key, values)
                return
            queue = self._calls.queue if self._calls.queue is not None else held.Held()
            queue.inits.update(ops.checked_inits(self._stored, key, values, queue.inits))
            self._calls.hold(queue, self)

    def _init_tree(self, tree: Any) -> None:
        if _opened_tree(tree, "init") is None:  # a flat mapping of keys to values
            self.init(list(tree), list(tree.values()))
            return
        tree = jax.tree_util.tree_map(_unwrap_leaf, tree)
        agreed = self._type in _DIST_TYPES and jax.process_count() > 1
        if agreed:  # rank 0's values, as MXNet's servers keep the first init
            tree = host.from_rank_zero(jax.tree_util.tree_map(np.asarray, tree))
        self._state = ops.init_keys(self._state, tree, defer=True, agreed=agreed)

    def _tree_pairs(self, tree: Any) -> tuple[list, list]:
        """A tree pushed with no value: its keys (the leaves' paths) and leaves, checked
        against the trees given to ``init``; a flat mapping: its keys and values."""
        split = _opened_tree(tree, "push")
        if split is None:
            return list(tree), list(tree.values())
        self._check_tree(split)
        return split.keys, [_unwrap_leaf(x) for x in split.leaves]

    def _check_tree(self, tree: trees.Tree, nested: bool = True) -> None:
        """Refuse a tree of other paths than a tree given to ``init``, and a tree given to a
        store of plain keys (``nested``: not a flat mapping of keys, which such a store
        takes)."""
        state = self._held_state()
        if nested or state.trees:
            trees.check_push(state, tree)

    def _held_state(self) -> KVState:
        """The store's state with its held inits in it (its trees, for the checks)."""
        if self._calls.queue is not None and self._calls.queue.inits:
            return self._state
        return self._stored

    def _init_now(self, key: Any, values: Any) -> None:
        agreed = self._type in _DIST_TYPES and jax.process_count() > 1
        if agreed:  # rank 0's values, as MXNet's servers keep the first init
            values = host.from_rank_zero(jax.tree_util.tree_map(np.asarray, values))
        self._state = ops.init_keys(self._state, key, values, defer=True, agreed=agreed)

    def push(self, key: Any, value: Any = pairing.MISSING, priority: int = 0) -> None:
        """Push values: each key's values (one per device) are summed, then the updater runs.
        With no value, a tree of the structure given to :meth:`init` (gradients of the
        parameters): its leaves pushed to the keys named by their paths, as one push.

        Checked at once; held until something reads (docs/design.md, "MXNet code as it is
        written"), except under
        an updater that runs as Python on every push (``set_updater`` of a function not
        marked with :func:`jaxkv.pure_updater`)."""
        with self._lock:
            if value is pairing.MISSING:
                key, value = self._tree_pairs(key)
            if _holds_row_sparse(value):
                self._push_row_sparse(key, value)
                return
            values = _unwrap_values(value)
            if (
                not self._may_hold(values)
                or self._python_updater is not None
                or (isinstance(key, list | tuple) and self._plain_optax())
            ):
                self._update(key, values)
                return
            inits = self._calls.queue.inits if self._calls.queue is not None else None
            if inits:
                grouped = pairing.group(self._stored, key, values, inits)
            else:  # (a call like an earlier one: grouped again without its per-value checks)
                grouped = plans.checked_group(self._stored, key, values)
            check_laid_out(self._stored, grouped)
            if self._plain_optax():
                for k in grouped:  # refused now, as the push would refuse it when run
                    if k in self._stored:  # (a held init's key has no state yet)
                        _alone(self._stored, k)
            queue = self._calls.queue
            if (
                queue is not None
                and len(queue.pushes) >= _HELD_PUSHES
                and not spans_processes(self._stored.devices)
            ):  # a bound on what one process holds (across processes: held to the next read)
                self.run_held()
                queue = None
            queue = queue if queue is not None else held.Held()
            opt = self._mxnet_optimizer
            if opt is None:
                for k, arrays in grouped.items():
                    queue.hold_push(k, arrays)
            else:  # MXNet's bookkeeping now, in its order (a list's keys sorted)
                if queue.counted is None:
                    queue.counted = opt.bookkeeping()
                keys = sorted(grouped)
                for k, row in zip(keys, opt.next_update(keys)):
                    queue.hold_push(k, grouped[k], row)
            self._calls.hold(queue, self)

    def pull(
        self, key: Any, out: Any = None, priority: int = 0, ignore_sparse: bool = True
    ) -> jax.Array | list[jax.Array] | None:
        """Pull values into ``out`` (``NDArray`` handles, each filled on its own device).

        With ``out=None``, returns the value(s) as ``jax.Array`` objects instead. A pull into
        outs is checked at once and held until something reads (an out, ``nd.waitall``, any
        other call of the store but a push, init or pull); the outs then get exactly what
        MXNet's ordering gives them. A pull of a list with no call held before it runs at
        once."""
        with self._lock:
            if out is None:
                tree = trees.structure(key)
                if tree is not None:  # a tree (or a mapping) of keys: its values, as a tree
                    self._check_tree(tree, trees.is_tree(key))
                    return trees.fill(tree, list(self._values(tree.keys)))
                return self._values(key)
            if (
                self._calls.queue is None
                and isinstance(key, list | tuple)
                and not spans_processes(self._stored.devices)
            ):  # A list pull with nothing held before it runs now, by its fill plan: the list
                # is the batch already. (Across processes it is held: its gathers are agreed.)
                self._pull_now(key, out, ignore_sparse)
                return None
            pairs = pairing.pairs(key, out, "outs")
            if all(type(o) is NDArray for _, outs in pairs for o in outs):
                owed = [o for _, outs in pairs for o in outs if o.owed_by is self]
                if owed and self._calls.queue is not None:  # that pull lands first
                    self._calls.run_through(owed, self._runs())
                queue = self._calls.queue if self._calls.queue is not None else held.Held()
                self._check_outs(pairs, self._held_shape)
                for k, outs in pairs:
                    queue.hold_pull(k, outs, self)
                self._calls.hold(queue, self)
                return None
            self._pull_now(key, out, ignore_sparse)
            return None

    def _pull_now(self, key: Any, out: Any, ignore_sparse: bool = True) -> None:
        fill = plans.prepare_fill(self._state, key, out, NDArray)
        if fill is not None and fill(
            self._state, self._keeps_values(), self._lend_whole, self._lending.later
        ):
            return
        pairs = pairing.pairs(key, out, "outs")
        self._check_outs(pairs)
        self._fill(_sparse_outs(pairs, ignore_sparse))

    # -- held calls ------------------------------------------------------------------------
    def _may_hold(self, values: Any) -> bool:
        """Whether calls with these values may be held: eager arrays only (a traced value
        cannot outlive its trace)."""
        if isinstance(values, list | tuple):  # (the first test is the cheap one)
            return all(type(v) is jax_internals.ArrayImpl or self._may_hold(v) for v in values)
        return not pairing.is_traced(values)

    def _held_shape(self, key: Key) -> tuple[int, ...]:
        """``key``'s shape, from a held init or the store (whose held calls need not run)."""
        return self._calls.shape(self._stored, key)

    def run_held(self) -> None:
        """Run every held call (see ``held.py``): the inits, the pulls before their key's push,
        every push at once, the pulls after it. Package-internal: ``nd.waitall`` and a read of
        an out run it."""
        with self._lock:
            self._calls.run(self._runs())

    def _push_held(self, keys: list[Key], values: list[list], scalars: dict[Key, Any]) -> None:
        """The held pushes, as one push: each key updated alone, as MXNet updates it (under an
        MXNet optimizer, with the numbers worked out when each push was called)."""
        grouped = dict(zip(keys, values))  # (checked when held: not paired again)
        self._update(keys, values, self._plain_optax(), scalars or None, grouped)

    def _plain_optax(self) -> bool:
        """Whether the updater is an optax transformation given to set_optimizer (whose list
        pushes update the list as one tree)."""
        return self._mxnet_optimizer is None and isinstance(
            self._updater, optax.GradientTransformation
        )

    def pushpull(
        self, key: Any, value: Any = pairing.MISSING, out: Any = None, priority: int = 0
    ) -> Any:
        """Push ``value`` then pull into ``out`` (or into ``value`` itself when ``out=None``).
        With no value, a tree (as :meth:`push` takes it): pushed, then its new values returned
        as a tree."""
        with self._lock:
            if value is pairing.MISSING:  # a tree, or a mapping: its new values, as it
                self.push(key)
                tree = trees.structure(key)
                assert tree is not None  # push took it: a tree or a mapping
                return trees.fill(tree, list(self._values(tree.keys)))
            if _holds_row_sparse(value):  # MXNet: push, then pull ignoring row-sparse outs
                targets = out if out is not None else value
                to_fill = pairing.pairs(key, targets, "outs")
                self._check_outs(to_fill)
                self._push_row_sparse(key, value)
                self._fill(_sparse_outs(to_fill, True))
                return None
            pairs = fill = None
            if out is not None or _holds_ndarrays(value):
                targets = out if out is not None else value
                fill = plans.prepare_fill(self._state, key, targets, NDArray)
                if fill is None:  # checked before the push: a refused call changes nothing
                    pairs = pairing.pairs(key, targets, "outs")
                    self._check_outs(pairs)
            self._update(key, _unwrap_values(value))
            if fill is not None:
                if fill(self._state, self._keeps_values(), self._lend_whole):
                    return None
                pairs = pairing.pairs(key, out if out is not None else value, "outs")
            if pairs is None:
                return self._values(key)
            self._fill(_sparse_outs(pairs, True))
            return None

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Initialise ``key`` with ``value``, then pull it into ``out``."""
        with self._lock:
            pairs = pairing.pairs(key, out, "outs")
            before = self._state
            self.init(key, value)
            try:
                self._check_outs(pairs)
            except KVStoreError:
                self._state = before
                raise
            self._fill(_sparse_outs(pairs, True))

    def row_sparse_pull(
        self, key: Any, out: Any = None, priority: int = 0, row_ids: Any = None
    ) -> jax.Array | list[jax.Array] | None:
        """Pull only the rows ``row_ids`` (others zero) into ``out``, or return them."""
        if row_ids is None:
            raise KVStoreError(f"key {shown(key)}: row_sparse_pull expects row_ids, given None")
        with self._lock:
            deferred = self._calls.rows if out is not None else None
            if deferred is not None:
                pairs = pairing.pairs(key, out, "outs")
                outs = pairs[0][1] if len(pairs) == 1 else []
                if (
                    outs
                    and pairs[0][0] == deferred.key
                    and all(map(kvstore_rows.is_row_sparse, outs))
                ):
                    self._calls.rows = None  # taken: the pull below runs it
                    across = spans_processes(self._stored.devices)
                    try:
                        # Across processes the refusal is told to the others in the
                        # all-gather they meet first in the pull (its agreement): every
                        # process refuses the pull and holds the push still, as this one.
                        with rows.ops.checking(self._stored, deferred.key, rows.ops.REFUSED_PULL):
                            # (shapes as held: a call held since the push runs after it)
                            self._check_outs(pairs, self._held_shape)
                            ids = kvstore_rows.wanted(
                                self._stored,
                                deferred.key,
                                _row_ids_per_out(key, pairs, row_ids)[0],
                            )
                    except KVStoreError:
                        self._calls.rows = deferred  # refused: the push still runs
                        if not across:  # (in one process, now: alone)
                            self._calls.settle(self._runs())
                        raise
                    before, failed, later = self._calls.kept(deferred, self._runs())
                    # In one process the calls it kept run after it, while its computation
                    # runs (held.Calls.run_after); across processes, before it, once agreed
                    # on the host, or after it where its computation agreed them (later).
                    after = None if across or before is None else before.run
                    try:
                        state, got = kvstore_rows.pushpull_into(
                            self._stored, deferred, outs, ids, None if after else before
                        )
                    except rows.ops.PullRefusedElsewhere:  # (before anything ran anywhere)
                        self._calls.rows = deferred  # held still, with the calls it keeps
                        raise
                    except BaseException:
                        failed()
                        raise
                    self._stored = state
                    for o, x, where in got:
                        o.set_rows_lazily(*_padded(x), where)
                    if after is not None:
                        after()
                    later()
                    return None
            state = self._state
            if out is None:
                keys = key if isinstance(key, list | tuple) else [key]
                ids = row_ids if isinstance(key, list | tuple) else [row_ids]
                if len(ids) != len(keys):
                    raise ShapeError(
                        f"keys {keys!r}: expected {len(keys)} row_ids, given {len(ids)}"
                    )
                pulled = [rows.ops.row_sparse_pull(state, k, unwrap(r)) for k, r in zip(keys, ids)]
                # As pull returns them: whole on the store's devices (split values gathered).
                pulled = [
                    r
                    if r.is_fully_replicated and r.sharding.device_set == set(state.devices)
                    else placement.replicate([r], state.devices)[0]
                    for r in pulled
                ]
                return pulled if isinstance(key, list | tuple) else pulled[0]
            pairs = pairing.pairs(key, out, "outs")
            self._check_outs(pairs)
            ids_of = _row_ids_per_out(key, pairs, row_ids)
            filled: list = []
            for (k, outs), ids in zip(pairs, ids_of):
                sparse = [(o, x) for o, x in zip(outs, ids) if kvstore_rows.is_row_sparse(o)]
                if sparse:
                    got = kvstore_rows.pull_into(state, k, *map(list, zip(*sparse)))
                    filled.extend(("rows", *r) for r in got)
                for o, x in zip(outs, ids):
                    if not kvstore_rows.is_row_sparse(o):  # beyond MXNet, which refuses dense outs
                        device = o.jax_device()
                        kept = rows.ops.row_sparse_pull(state, k, unwrap(x), devices=[device])
                        filled.append(("dense", o, kept, device))
            for how, o, x, where in filled:  # every out filled once all are computed
                if how == "rows":
                    o.set_rows_lazily(*_padded(x), where)
                else:
                    _set(o, x, where)
            return None

    # -- updaters and optimizers ---------------------------------------------------------------
    def set_updater(self, updater: Any) -> None:
        """Use ``updater(key, input, stored)`` on every push, for every key, as MXNet does.

        The function runs as Python at each push, once per distinct key in key order, on
        ``NDArray`` handles: ``input`` holds the devices' sum, ``stored`` the stored value;
        the new value is what it returns, or else ``stored``'s final value (MXNet's in-place
        style, ``stored += input * 2``). Its side effects and Python state behave as in
        MXNet. A function marked with :func:`jaxkv.pure_updater` (it computes only from its
        arguments) is traced instead: compiled once, with the pushes held and run together
        like those of an optimizer. An exception raised in either is a ``KVStoreError``
        naming the key and the updater, the original as its ``__cause__``, and the push
        changes nothing. An optax transformation, or a wrapper with a
        ``gradient_transformation()`` method (``optax.MultiSteps``), is taken as
        :meth:`set_optimizer` takes it; anything else that is not callable is refused.
        """
        if isinstance(updater, MXNetUpdater):  # mx.optimizer.get_updater(opt): MXNet's way
            self.set_optimizer(updater.optimizer)  # of setting opt on a local store
            return
        updater = as_updater(updater, "set_updater")  # optax.MultiSteps: its transformation
        with self._lock:
            if self._calls.queue is not None:
                self.run_held()
            if (
                updater is not None
                and not isinstance(updater, optax.GradientTransformation)
                and callable(updater)
                and not is_pure_updater(updater)
            ):
                self._updater = None
                self._python_updater = updater
                self._mxnet_optimizer = None
                return
            self._updater = self._traced(updater)
            self._python_updater = None
            self._mxnet_optimizer = None

    def _traced(self, updater: Any) -> Any:
        """``updater`` as the pure core runs it (the same updater set again reuses its
        wrapper, and so its compiled pushes)."""
        known = self._wrappers.get(id(updater))
        if known is None or known[0] is not updater:
            known = self._wrappers[id(updater)] = (updater, _from_mxnet_updater(updater))
        return known[1]

    _set_updater = set_updater

    def set_optimizer(self, optimizer: optax.GradientTransformation) -> None:
        """Update values with an optax optimizer: each push is a gradient for its keys.

        As in the functional core, the keys of one push are updated as one tree (one optimizer
        group, made by the first push of those keys): code that pushes key by key gets one
        state per key, which is MXNet's semantics; code that pushes a list of keys gets
        ``optax.update`` on that list. A push of part of a group is refused. An optax wrapper
        that is not a transformation itself but has a ``gradient_transformation()`` method
        (``optax.MultiSteps``) is taken as the transformation it gives. An exception the
        optimizer raises is a ``KVStoreError`` naming the keys and the optimizer, the original
        as its ``__cause__``, and the push changes nothing.
        """
        mxnet = None
        if isinstance(optimizer, MXNetOptimizer):  # mx.optimizer.SGD / Adam, on optax
            mxnet = optimizer
            # Its per-key numbers are arguments (next_update): the same computation for any
            # keys of the same shapes.
            optimizer = positional(mxnet.transformation())
        optimizer = as_transformation(  # optax.MultiSteps: its transformation
            optimizer, "set_optimizer", "optax.sgd(0.1)", "mx.optimizer.SGD / Adam, "
        )
        with self._lock:
            if self._calls.queue is not None:
                self.run_held()
            self._python_updater = None
            if optimizer is not self._updater:  # states made for another optimizer go
                self._state = self._state.replace(
                    opt_states={g: None for g in self._state.opt_states}
                )
            self._updater = optimizer
            self._mxnet_optimizer = mxnet

    def set_gradient_compression(self, compression_params: dict) -> None:
        """Compress each device's pushed values before they are summed, as MXNet does.

        ``{'type': '2bit', 'threshold': t}`` (t > 0, default 0.5): each device keeps an
        error-feedback residual per key and sends only ``+t``, ``-t`` or 0 per element. A value
        from a device outside the store (CPU data pushed into a store on a GPU) is compressed
        on the store device at its position in the pushed list (the i-th on the (i mod D)-th),
        with that device's residual, as MXNet indexes residuals by position.
        ``{'type': 'fp16'}`` / ``{'type': 'bf16'}`` (beyond MXNet): values are rounded to that
        type. As in MXNet, only ``device`` and ``dist`` store types compress.
        """
        if "device" not in self._type and "dist" not in self._type:
            raise KVStoreError(
                f"gradient compression {compression_params!r}: expected a 'device' or 'dist' "
                f"store type (as MXNet), given {self._type!r}"
            )
        with self._lock:
            self._state = compression.set_compression(self._state, compression_params)

    def is_capable(self, capability: str) -> bool:
        """Whether the store supports ``capability`` (MXNet knows ``'optimizer'``)."""
        if str(capability).lower() == "optimizer":
            return True
        raise KVStoreError(f"unknown capability: expected 'optimizer', given {capability!r}")

    # -- saving ----------------------------------------------------------------------------
    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Save the optimizer state of every key to ``fname`` (atomic write, no pickle).

        ``dump_optimizer=True`` (an MXNet optimizer, ``mx.optimizer``) also saves what MXNet's
        pickled optimizer carries: its update counts, ``num_update``, the schedule's state and
        its numbers (learning rate, weight decay, multipliers), as JSON, so that a store that
        loads the file resumes the run as MXNet does. Without it, as in MXNet, the counts are
        not saved: a store that loads the file counts from ``begin_num_update``."""
        with self._lock:
            self._require_optimizer("save_optimizer_states")
            record = None
            if dump_optimizer:
                if self._mxnet_optimizer is None:
                    raise KVStoreError(
                        "dump_optimizer=True: expected a store whose optimizer is an MXNet one "
                        "(mx.optimizer), given an optax transformation, which is code, and "
                        "jaxkv does not pickle code; save with dump_optimizer=False and call "
                        "set_optimizer again after loading"
                    )
                record = self._mxnet_optimizer.record()
            npz.save(fname, per_key.alone(self._state), values=False, record=record)

    def load_optimizer_states(self, fname: str) -> None:
        """Load optimizer states saved by :meth:`save_optimizer_states` (integrity checked).

        A file saved with ``dump_optimizer=True`` also restores the MXNet optimizer's update
        counts, ``num_update``, schedule and numbers (MXNet replaces its optimizer with the
        file's; jaxkv refuses a file whose optimizer is of another class, arguments or
        schedule than the store's, before anything changes). A file MXNet 1.9.1 saved (a
        pickle) is read too, under an MXNet optimizer, by a reader that runs none of its code
        and refuses anything but MXNet's states and optimizer (see the migration guide)."""
        with self._lock:
            self._require_optimizer("load_optimizer_states")
            if states_file.is_pickle_file(fname):
                self._load_mxnet_states(fname)
            else:
                self._load(fname, values=False, optimizer=self._updater)

    def _load_mxnet_states(self, fname: str) -> None:
        """MXNet's optimizer states (and its dumped optimizer) into this store's, every check
        made before anything changes."""
        opt = self._mxnet_optimizer
        if opt is None:
            raise KVStoreError(
                f"{fname}: MXNet's optimizer states: expected a store with an MXNet optimizer "
                "(kv.set_optimizer(mx.optimizer.<the saved run's>(...))), given an optax "
                "transformation, whose state MXNet's does not describe"
            )
        states, saved = states_file.read(fname)
        state = self._state
        unknown = sorted(repr(k) for k in states if k not in state)
        if unknown:
            raise KVStoreError(
                f"{fname}: MXNet's optimizer states of keys {unknown}, expected keys of this "
                f"store ({sorted(map(repr, state.keys()))[:8]}...); init them first"
            )
        put_back = None
        counts = dict(opt._index_update_count)  # noqa: SLF001 - without a dump: the store's
        if saved is not None:
            record = states_file.as_record(saved, opt)
            put_back = opt.restore_record(record, fname)
            counts = dict(saved.fields.get("_index_update_count", {}))
        for k in sorted(states, key=repr):
            group = state.opt_group(k)
            if group is not None and len(group) > 1:  # pushed with others before: alone now
                state = per_key.regroup(state, [k], self._updater) or state
            if state.opt_group(k) is None:
                from jaxkv._src.core.eager import init_opt_states

                state = init_opt_states(state, self._updater, (k,))
            template = state.opt_states[(k,)]
            half = buckets.stored_type(state, state.index(k)).dtype == np.float16
            slots = states_file.slots_of(
                states[k], type(opt).__name__, half and opt.multi_precision
            )
            leaves, treedef = jax.tree_util.tree_flatten(template)
            count = np.int32(counts.get(k, opt.begin_num_update))
            filled = states_file.filled(fname, k, leaves, count, slots)
            placed = [order.put(x, t.sharding) for x, t in zip(filled, leaves)]
            state = state.replace(opt_states={(k,): jax.tree_util.tree_unflatten(treedef, placed)})
        self._state = state
        if put_back is not None:
            put_back()

    def save(self, fname: str) -> None:
        """Save the whole store (values, optimizer states, residuals) to ``fname``.

        A single-process job writes one file, atomically. A ``dist_sync`` store of a
        multi-process job writes a directory: every process calls ``save`` with the same path,
        and each writes only its own shards (with orbax-checkpoint, ``pip install
        'jaxkv[dist]'``); the save commits atomically. A path that already is such a directory
        is written in that format by one process too. Under an MXNet optimizer, its update
        counts, schedule and numbers are saved too (as ``dump_optimizer=True`` saves them), so
        that :meth:`load` resumes the run exactly.
        """
        with self._lock:
            opt = self._mxnet_optimizer
            record = None if opt is None else opt.record()
            npz.save(fname, per_key.alone(self._state), values=True, record=record)

    def load(self, fname: str) -> None:
        """Replace the store's contents with those saved by :meth:`save`.

        Either format loads onto this store's devices, whatever the processes and devices that
        saved it; in a multi-process job every process calls ``load``. Every saved byte is
        checked (SHA-256) first: a damaged checkpoint is a :class:`KVStoreError`, and the store
        is unchanged. An MXNet optimizer's counts and schedule saved with it are restored.
        """
        with self._lock:
            optimizer = self._updater
            if not isinstance(optimizer, optax.GradientTransformation):
                optimizer = None
            self._load(fname, values=True, optimizer=optimizer)

    def _load(self, fname: str, values: bool, optimizer: Any) -> None:
        """Load ``fname`` (see :meth:`load`), and the MXNet optimizer's record saved with it,
        each checked before anything changes."""

        def checked(record: Any) -> Any:
            if record is None:
                return None
            opt = self._mxnet_optimizer
            if opt is None:
                raise KVStoreError(
                    f"{fname}: holds an MXNet optimizer's record ({record.get('class')!r}), "
                    "expected a store with an MXNet optimizer to restore it into, given "
                    f"{'none' if self._updater is None else 'an optax transformation'}; call "
                    "kv.set_optimizer(mx.optimizer...) as the saved run did, then load"
                )
            return opt.restore_record(record, fname)

        state, put_back = npz.load_with_record(
            fname, self._state, values=values, optimizer=optimizer, check_record=checked
        )
        self._state = state
        if put_back is not None:
            put_back()

    def _require_optimizer(self, what: str) -> None:
        if not isinstance(self._updater, optax.GradientTransformation):
            raise KVStoreError(
                f"{what}: expected a store with an optimizer, given none; call "
                "set_optimizer(optax_transformation) first"
            )

    # -- barrier ---------------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait until every worker reaches this point (and local work has finished)."""
        jax.block_until_ready(jax.tree_util.tree_leaves(self._state))
        host.barrier("jaxkv.KVStore.barrier")

    _barrier = barrier

    # -- internals -------------------------------------------------------------------------
    def _keeps_values(self) -> bool:
        """Whether this store keeps its values at each push and lends them to outs
        (``Lending.keeps_values``, decided at its first push or pull)."""
        if self._lending.keep_values is None:
            return self._lending.keeps_values(self._state)
        return self._lending.keep_values

    def _lend_whole(self, given: list[jax.Array]) -> None:
        """``Lending.lend`` of the stored arrays a pull gave outs (or parts of)."""
        self._lending.lend(given)

    def _update(
        self,
        key: Any,
        values: Any,
        each_alone: bool = False,
        scalars: dict | None = None,
        grouped: dict[Key, list] | None = None,
    ) -> None:
        """Push ``values`` to ``key`` with the store's updater; ``each_alone``: an optax
        optimizer updates each key alone (keys pushed one at a time). Under an MXNet
        optimizer, ``scalars`` are each key's kernel numbers (``Optimizer.next_update``),
        worked out now where not given. ``grouped``: each key's values, paired and checked
        already (held pushes)."""
        # (across processes: one donation; the store keeps the copies whatever the push does,
        # since what it handed out is forgotten now)
        state = self._stored = self._lending.detached(self._state)
        if self._python_updater is not None:
            self._state = self._push_python(state, key, values)
            return
        updater = self._updater
        if self._plain_optax() and not each_alone and per_key.any_per_key(state):
            keys = sorted(grouped or _grouped(state, key, values))  # (checked: one kind of key)
            if per_key.holds_per_key(state, keys):  # keys pushed one at a time before
                if len(keys) > 1:
                    raise KVStoreError(
                        f"keys {keys}: an optax push updates one optimizer group as one tree, "
                        f"expected the keys of one group, given keys that were pushed one at a "
                        "time, each a group of its own (kv.state shows the groups); push them "
                        "one at a time"
                    )
                each_alone = True
        if isinstance(updater, optax.GradientTransformation) and (
            each_alone or self._mxnet_optimizer is not None  # MXNet's optimizers: each key alone
        ):
            if grouped is None:
                grouped = _grouped(state, key, values)
            keys = sorted(grouped)
            extra = None
            opt, saved = self._mxnet_optimizer, None
            if opt is not None:
                if scalars is None:
                    saved = opt.bookkeeping()
                    table = opt.next_update(keys)
                    if spans_processes(state.devices):  # not held: agreed here
                        try:
                            held.agree_numbers(keys, table)
                        except BaseException:
                            opt.restore_bookkeeping(saved)  # refused: not counted either
                            raise
                else:
                    table = np.stack([scalars[k] for k in keys])
                extra = {"scalars": table}  # a row per key, in key order (per_key's)
            try:
                parts = _by_placement(state, keys)
                if len(parts) > 1:
                    in_parts = self._push_in_parts(state, parts, grouped, updater, extra)
                    if in_parts is not None:
                        self._state = in_parts
                        return
                regrouped = per_key.regroup(state, keys, updater)
                if regrouped is None:  # a key shares one tree of state with others
                    self._state = self._push_key_by_key(state, grouped, updater, extra)
                    return
                state, key, values = regrouped, keys, [grouped[k] for k in keys]
                # KEEP_VALUES is jaxkv's own third answer, beside the public True and False.
                self._state = ops.push(
                    state,
                    key,
                    values,
                    updater=per_key.per_key(updater),
                    donate=self._lending.donation(state, key, values),  # type: ignore[arg-type]
                    extra_args=extra,
                )
            except BaseException:
                if opt is not None and saved is not None:  # refused: not counted either
                    opt.restore_bookkeeping(saved)
                raise
            return
        self._state = ops.push(
            state,
            key,
            values,
            updater=updater,
            donate=self._lending.donation(state, key, values),  # type: ignore[arg-type]
        )

    def _push_in_parts(
        self,
        state: KVState,
        parts: list[list[Key]],
        grouped: dict[Key, list],
        updater: Any,
        extra: dict[str, np.ndarray] | None = None,
    ) -> KVState | None:
        """A push of keys each updated alone (``grouped``: key -> its values; ``extra``: a row
        per key in key order) run as one push per part of ``parts``, each part made one
        optimizer group (the same numbers: each key's update stands alone). ``None`` where a
        key shares one tree of state with others (the caller pushes key by key). Every part
        but the last donates nothing: the store's state changes only once every part has
        succeeded."""
        row = {k: i for i, k in enumerate(sorted(grouped))}
        # Every part's optimizer group and state made before the first part runs, as its own
        # push would make them: a part whose computation takes the whole state (keys in
        # buckets) then sees, at the first push, the state's structure of every later push,
        # and is compiled once (made by the next part's push, the new group changed the
        # structure the first part's computation was traced for: the Gluon loop on ResNet-50
        # compiled its bucketed keys' push again at its second step).
        state = state.settled()
        for part in parts:
            regrouped = per_key.regroup(state, part, updater)
            if regrouped is None:
                return None
            state = regrouped
            state = ops.with_opt_state(state, part, per_key.per_key(updater))
        for n, part in enumerate(parts):  # (each part is one group already, made above)
            values = [grouped[k] for k in part]
            args = None
            if extra is not None:
                args = {name: v[[row[k] for k in part]] for name, v in extra.items()}
            last = n == len(parts) - 1
            state = ops.push(
                state,
                part,
                values,
                updater=per_key.per_key(updater),
                donate=self._lending.donation(state, part, values) if last else False,  # type: ignore[arg-type]
                extra_args=args,
            )
        return state

    def _push_key_by_key(
        self,
        state: KVState,
        grouped: dict[Key, list],
        updater: Any,
        extra: dict[str, np.ndarray] | None = None,
    ) -> KVState:
        """A push (``grouped``: key -> its values) updated key by key in key order, each key
        its own optimizer group, as MXNet's optimizers update (the same numbers as one push of
        the keys: each key's update stands alone; a later push of any of them alone is then
        accepted, as in MXNet); ``extra``: the update's extra arguments, a row per key in key
        order. The store's state changes only once every key's push has succeeded."""
        for i, k in enumerate(sorted(grouped)):
            args = None if extra is None else {n: v[i] for n, v in extra.items()}
            state = ops.push(state, k, grouped[k], updater=updater, donate=False, extra_args=args)
        return state

    def _push_python(self, state: KVState, key: Any, values: Any) -> KVState:
        """A push under a Python updater, as MXNet runs one: the devices' values summed (and
        compressed, across processes too) as an assigning push sums them, then
        ``updater(key, recv, stored)`` called here, once per distinct key in key order, on
        ``NDArray`` handles; the new value is what it returns, or else the ``stored`` handle's
        final value. An exception raised in it is a ``KVStoreError`` naming the key, and the
        store is unchanged."""
        summed = ops.push(state, key, values, updater=None, donate=False)
        keys = sorted({k for k, _ in pairing.pairs(key, values, "values")})
        updater = self._python_updater
        new = {}
        for k in keys:
            handle = NDArray(state[k])
            try:
                out = updater(k, NDArray(summed[k]), handle)
            except Exception as e:
                raise KVStoreError(
                    f"key {shown(k)}: the updater {updater_name(updater)} raised "
                    f"{type(e).__name__}: {e}"
                ) from e
            value = pairing.as_array(handle.asjax() if out is None else unwrap(out))
            if tuple(value.shape) != tuple(state.shapes[k]):
                raise ShapeError(
                    f"key {shown(k)}: the updater {updater_name(updater)} gave shape "
                    f"{tuple(value.shape)}, expected the stored shape {tuple(state.shapes[k])}"
                )
            stored = state[k]
            value = value.astype(stored.dtype)
            if value.sharding != stored.sharding:
                value = order.put(value, stored.sharding)
            new[k] = value
        # (A state deferring keys made one at a time goes on deferring them: replace's default.)
        return summed.replace(values=new)

    def _push_row_sparse(self, key: Any, value: Any) -> None:
        """A push where some values are row-sparse: each key with one is pushed by rows
        (``kvstore_rows.push``), the others as one dense push; the store changes only once every
        part has succeeded (and an MXNet optimizer's counts only then)."""
        opt = self._mxnet_optimizer
        saved = None if opt is None else opt.bookkeeping()
        try:
            self._push_rows_now(key, value, saved)
        except BaseException:
            if opt is not None and saved is not None:
                opt.restore_bookkeeping(saved)
            raise

    def _push_rows_now(self, key: Any, value: Any, counted: Any = None) -> None:
        grouped = self._keeps_held(key, value)  # the calls held before it, to run with it
        keep = grouped is not None
        if grouped is None:
            grouped = _grouped(self._state, key, value)
        sparse = [k for k, vs in grouped.items() if any(map(kvstore_rows.is_row_sparse, vs))]
        dense = [k for k in grouped if k not in sparse]
        updater, lazy = self._updater, True
        if self._python_updater is not None:  # it sees the rows summed into a dense value
            updater = self._traced(self._python_updater)
        opt, extra = self._mxnet_optimizer, None
        updater_of: dict[Key, Any] = dict.fromkeys(sparse, updater)
        extra_of: dict[Key, Any] = dict.fromkeys(sparse)
        if opt is not None:  # MXNet's bookkeeping, in key order; the rows' kernels then
            keys = sorted(grouped)  # compile in what the key's update reads (its inputs)
            table = opt.next_update(keys)
            if dense and spans_processes(self._state.devices):  # not held: agreed here
                # (a push of rows alone agrees its numbers with its sizes: see rows.ops)
                held.agree_numbers(keys, table)
            lazy = opt.lazy_update
            # The kernel's numbers (learning rate, bias correction...) are arguments of the
            # computation, as for dense keys: a schedule compiles nothing new.
            state = self._stored  # (the held calls ran above, or are kept)
            for k in sparse:
                opt.check_row_sparse(opt.inputs(k))
            half = {
                k: buckets.stored_type(state, state.index(k)).dtype == np.float16 for k in sparse
            }
            updater_of = {
                k: opt.transformation(row_sparse=True, master=half[k], check=False) for k in sparse
            }
            extra_of = {k: {"scalars": table[keys.index(k)]} for k in sparse}
            if dense:
                extra = {"scalars": np.stack([table[keys.index(k)] for k in sorted(dense)])}
        state = self._stored
        if isinstance(updater, optax.GradientTransformation):
            inner = self._updater
            for k in sparse:  # a key pushed with others one at a time before: its state alone
                if (g := state.opt_group(k)) is not None and len(g) > 1:
                    state = per_key.regroup(state, [k], inner) or state
            self._stored = state  # (no value changes)
        steps = len(sparse) + bool(dense)
        donate = steps == 1 and self._lending.row_push_donates(state, sparse)
        queue = self._calls.queue
        if keep and queue is not None and any(queue.pulls):  # (a kept pull may lend the
            # table's array)
            donate = False
        if dense and opt is not None:
            state = self._push_key_by_key(
                state, {k: _unwrap_values(grouped[k]) for k in dense}, self._updater, extra
            )
        elif dense:
            state = ops.push(
                state,
                dense,
                [_unwrap_values(grouped[k]) for k in dense],
                updater=self._updater,
                donate=donate,
            )
        opt_set = self._mxnet_optimizer is not None
        if sparse == list(grouped) and len(sparse) == 1 and lazy and opt_set:
            # Held until the next call (checked now): a row_sparse_pull of the key then runs
            # with it in one computation, as a training loop's push and pull of rows do.
            k = sparse[0]
            deferred = kvstore_rows.held(state, k, grouped[k], updater_of[k], donate, extra_of[k])
            calls = self._calls
            before, calls.queue = (calls.queue, None) if keep else (None, calls.queue)
            calls.rows = deferred._replace(counted=counted, before=before)
            held.holding(self)  # nd.waitall runs it
            return
        for k in sparse:
            state = kvstore_rows.push(
                state, k, grouped[k], updater_of[k], lazy, donate, extra_of[k]
            )
        self._state = state

    def _keeps_held(self, key: Any, value: Any) -> dict[Key, list] | None:
        """The pushed values by key (``_grouped``) where a push of rows keeps the calls held
        before it, to run with it (else ``None``, nothing grouped or run): where it is one
        lazy push of one key's rows under an MXNet optimizer (held for its
        ``row_sparse_pull``), after held pushes of other keys and no held init. Across
        processes its ``row_sparse_pull`` then agrees both in one host all-gather
        (``rows.ops.Before``) where each would make one; in one process, where no pull is
        held among them, the kept pushes run once the rows' computation is dispatched, while
        it runs (their values and numbers do not depend on it: other keys, numbers worked out
        when each push was called). Decided from what every process agrees on (the held
        pushes and inits, the push), so that every process decides alike."""
        opt, queue = self._mxnet_optimizer, self._calls.queue
        lazy_mxnet = opt is not None and opt.lazy_update and self._python_updater is None
        if not self._calls.keeps(lazy_mxnet):
            return None
        assert queue is not None  # (keeps: pushes are held)
        if not spans_processes(self._stored.devices) and any(queue.pulls):
            return None  # (a held pull must read what it reads before the push of rows)
        grouped = _grouped(self._stored, key, value)  # (no held init: the store's keys)
        (k, values), *others = grouped.items()
        rows = any(map(kvstore_rows.is_row_sparse, values))
        return grouped if not others and k not in queue.count and rows else None

    def _values(self, key: Any) -> jax.Array | list[jax.Array]:
        single = not isinstance(key, list | tuple)
        values = placement.replicated_copies(self._state, [key] if single else list(key))
        return values[0] if single else values

    def _check_outs(self, pairs: list[tuple[Key, list]], shape_of: Any = None) -> None:
        """Refuse outs that are not ``NDArray``s of their key's shape (``shape_of(key)``,
        default the stored value's). Each out's held value is asked for first, which lands any
        pull another store holds for it, so that this one lands after it (reading nothing)."""
        for k, outs in pairs:
            shape = tuple(self._state[k].shape) if shape_of is None else shape_of(k)
            for o in outs:
                if type(o) is NDArray and o.held_value().shape == shape:
                    continue  # the common case, checked cheaply
                if not isinstance(o, NDArray):
                    raise KVStoreError(
                        f"key {shown(k)}: out expected a jaxkv.nd.NDArray, given "
                        f"{type(o).__name__}; a jax.Array cannot be filled in place, so use "
                        f"the return value instead: value = kv.pull({shown(k)})"
                    )
                if o.shape != shape:
                    raise ShapeError(
                        f"key {shown(k)}: out has shape {o.shape}, expected the stored "
                        f"shape {shape}"
                    )

    def _fill(self, pairs: list[tuple[Key, list]]) -> None:
        """Give each (checked) out the value of its key, on the out's own device.

        Replicated values are handed out as they are where the store lends them (and a key
        read through a view of its bucket always: a fresh array), else copied in one
        computation. Sharded values are all-gathered a few at a time and handed out at once,
        so the outs' previous arrays are released as the new ones arrive, and a pull never
        holds two full sets of outs.
        """
        state = self._state
        outs_of: dict[Any, list[NDArray]] = {}
        for k, outs in pairs:
            outs_of.setdefault(k, []).extend(outs)
        small = [k for k in outs_of if not buckets.is_split(state, state.index(k))]
        big = [k for k in outs_of if buckets.is_split(state, state.index(k))]
        position: dict[Any, int] = {}

        def hand_out(keys: list[Key], values: list[jax.Array], lent: bool = False) -> None:
            elsewhere: list[tuple[NDArray, jax.Array, Any]] = []  # outs off the store's devices
            given: list[jax.Array] = []  # the stored arrays lent
            for key, value in zip(keys, values):
                arrays = jax_internals.per_device(value)
                if not position:
                    position.update(
                        {jax_internals.single_device(x): i for i, x in enumerate(arrays)}
                    )
                for o in outs_of[key]:
                    device = o.jax_device()
                    i = position.get(device)
                    if i is None:
                        elsewhere.append((o, arrays[0], device))
                    else:
                        _set(o, arrays[i], device)
                        if lent and not kvstore_rows.is_row_sparse(o):
                            given.append(value)
            if given:
                self._lend_whole(given)
            if elsewhere:  # copied there in one call (a dist_sync store: one device per process)
                moved = jax.device_put([x for _, x, _ in elsewhere], [d for _, _, d in elsewhere])
                for (o, _, device), x in zip(elsewhere, moved):
                    _set(o, x, device)

        # One copy computation for all replicated values, then the sharded ones in chunks:
        # chunking everything together measured ~30% slower on ResNet-50.
        if small:
            index = [state.index(k) for k in small]
            keep = self._keeps_values()
            hand_out(small, placement.for_outs(state, index, keep), lent=keep)
        chunk, size = [], 0
        for i, key in enumerate(big):
            chunk.append(key)
            size += state[key].nbytes * len(state.devices)
            if size >= _GATHER_CHUNK_BYTES or i == len(big) - 1:
                hand_out(chunk, placement.replicated_copies(state, chunk))
                chunk, size = [], 0


def _set(out: NDArray, x: jax.Array, device: Any) -> None:
    """Rebind ``out`` to ``x`` (on ``device``), in ``out``'s dtype, cast as MXNet copies a
    value into an array of another dtype (:func:`casts.mxnet_cast`: a float beyond an 8-bit
    out's range keeps its low bits, as C's cast does, where XLA's would clamp it); a
    row-sparse out keeps the rows of ``x`` that are not zero."""
    if kvstore_rows.is_row_sparse(out):
        out.set_value(x, device)
        return
    dtype = out.held_value().dtype  # (nothing read)
    out.set_value(casts.mxnet_cast(x, dtype), device)


def _alone(state: KVState, key: Key) -> None:
    """Refuse an optax push of ``key`` alone where its optimizer group is a tree over several
    keys (a list pushed together): part of a group (keys pushed one at a time keep a state
    each, and may be pushed alone)."""
    group = state.opt_group(key)
    if group is not None and len(group) > 1 and not per_key.holds_per_key(state, [key]):
        optimizer_group(state, (key,), unpack=False)  # raises, naming the group


def _padded(rows: Any) -> tuple[jax.Array, int]:
    """Pulled rows as ``(rows, count)``: a padded result and its count, or rows as they are."""
    if isinstance(rows, Padded):
        return rows.rows, rows.n
    return rows, rows.shape[0]


def _by_placement(state: KVState, keys: list[Key]) -> list[list[Key]]:
    """``keys`` (sorted) cut by where their values lie, or will once laid out
    (``KVState.in_buckets``): those in buckets, then those kept as arrays of their own, each
    part non-empty (one part where all lie alike). Each part becomes an optimizer group of
    its own: a group of bucketed keys keeps its optimizer state packed beside its bucket
    (one fused update, a compile of a few operations), which a group that also holds an
    array of its own cannot (an update per key: a compile that grows with the keys; 200
    small keys beside one big key: 11 s)."""
    if len(keys) < 2:
        return [keys]
    inside = state.in_buckets([state.index(k) for k in keys])
    if all(inside) or not any(inside):
        return [keys]
    return [[k for k, b in zip(keys, inside) if b], [k for k, b in zip(keys, inside) if not b]]


def _grouped(state: KVState, key: Any, values: Any) -> dict[Key, list]:
    """Each pushed key's values, MXNet's pairing, in call order; unknown keys are refused
    before anything runs."""
    grouped: dict[Key, list] = {}
    for k, vs in pairing.pairs(key, values, "values"):
        state.index(k)
        grouped.setdefault(k, []).extend(vs)
    return grouped


def _holds_row_sparse(x: Any) -> bool:
    if isinstance(x, list | tuple):  # (a dense NDArray, the usual value, tested first)
        return any(type(v) is not NDArray and _holds_row_sparse(v) for v in x)
    return kvstore_rows.is_row_sparse(x)


def _sparse_outs(pairs: list[tuple[Key, list]], ignore_sparse: bool) -> list[tuple[Key, list]]:
    """``pairs`` without their row-sparse outs where MXNet ignores them (a pull with
    ``ignore_sparse=True``, pushpull and broadcast): those are left as they are."""
    if not ignore_sparse:
        return pairs
    kept = [(k, [o for o in outs if not kvstore_rows.is_row_sparse(o)]) for k, outs in pairs]
    if any(len(o) != len(outs) for (_, o), (_, outs) in zip(kept, pairs)):
        logger.info(
            "pull: row-sparse outs left unchanged (ignore_sparse=True, as MXNet); use "
            "row_sparse_pull, or pull with ignore_sparse=False"
        )
    return [(k, outs) for k, outs in kept if outs]


def _row_ids_per_out(key: Any, pairs: list[tuple[Key, list]], row_ids: Any) -> list[list]:
    """``row_ids`` paired with the outs as MXNet pairs them: one per out (nested per key for a
    list of keys), or one for every out."""
    n = sum(len(outs) for _, outs in pairs)
    if not isinstance(row_ids, list | tuple):
        return [[row_ids] * len(outs) for _, outs in pairs]
    if isinstance(key, list | tuple) and len(row_ids) == len(pairs) and n != len(pairs):
        out = []
        for (k, outs), ids in zip(pairs, row_ids):
            ids = list(ids) if isinstance(ids, list | tuple) else [ids] * len(outs)
            if len(ids) != len(outs):
                raise ShapeError(
                    f"key {shown(k)}: expected {len(outs)} row_ids (one per out), given {len(ids)}"
                )
            out.append(ids)
        return out
    if len(row_ids) == 1 and n > 1:
        row_ids = list(row_ids) * n
    if len(row_ids) != n:
        raise ShapeError(
            f"key {shown(key)}: expected {n} row_ids (one per out), given {len(row_ids)}"
        )
    it = iter(row_ids)
    return [[next(it) for _ in outs] for _, outs in pairs]


# How many pushes of one key a single-process store holds before it runs what it holds.
_HELD_PUSHES = 4

# How many bytes of sharded values a pull all-gathers before handing them out.
_GATHER_CHUNK_BYTES = 64 << 20


def _holds_ndarrays(x: Any) -> bool:
    if isinstance(x, list | tuple):
        return bool(x) and all(_holds_ndarrays(v) for v in x)
    return isinstance(x, NDArray)


# MXNet's store types whose values meet in CommCPU, which fails on several values of another
# dtype than the key's ("data type do not match"); the others (CommDevice) cast each value.
_CPU_COMM = ("local", "local_update_cpu", "local_allreduce_cpu", "dist_sync")


class DropInKVStore(KVStore):
    """The store of the MXNet drop-in (``jaxkv.mx.kv.create``): :class:`KVStore` with MXNet
    1.9.1's refusals where jaxkv's own store accepts more, so that code written against
    ``jaxkv.mx`` also runs on MXNet: ``row_sparse_pull`` into a dense out is refused, as
    MXNet's check does ("Expected row_sparse storage type for row_sparse_pull values").

    And MXNet's casts: a dense value of a dtype the key's cannot hold without loss, which
    jaxkv's own store refuses, is cast as MXNet 1.9.1 casts it (:func:`casts.mxnet_cast`: 300.0
    into a uint8 key is 44), then summed in the key's dtype; where MXNet fails instead (several
    such values of one key in a ``local`` or ``dist_sync`` store), the push is refused."""

    def push(self, key: Any, value: Any = pairing.MISSING, priority: int = 0) -> None:
        try:
            super().push(key, value, priority)
        except DtypeError:  # refused before anything changed: cast as MXNet does, and again
            if value is pairing.MISSING:
                raise
            super().push(key, self._mxnet_cast(key, value), priority)

    def pushpull(
        self, key: Any, value: Any = pairing.MISSING, out: Any = None, priority: int = 0
    ) -> jax.Array | list[jax.Array] | None:
        try:
            return super().pushpull(key, value, out, priority)
        except DtypeError:
            if value is pairing.MISSING:
                raise
            cast = self._mxnet_cast(key, value)
            return super().pushpull(key, cast, value if out is None else out, priority)

    def _mxnet_cast(self, key: Any, value: Any) -> Any:
        """``value`` (as a push of ``key`` takes it) with each array cast to its key's dtype as
        MXNet casts it; refuses what MXNet fails on."""
        value = _unwrap_values(value)
        given = value if isinstance(key, list | tuple) else [value]
        out = []
        for (k, vs), v in zip(pairing.pairs(key, value, "values"), given):
            dtype = self._dtype_of(k)
            arrays = [pairing.as_value(k, x, "the pushed value") for x in vs]
            lossy = [x.dtype for x in arrays if not dtypes.holds(dtype, x.dtype)]
            if lossy and (
                not casts.castable(dtype) or (len(arrays) > 1 and self._type in _CPU_COMM)
            ):
                raise DtypeError(
                    f"key {shown(k)}: {len(arrays)} pushed values of dtype {lossy[0]} into a "
                    f"key of dtype {dtype}: MXNet 1.9.1's {self._type!r} store fails on them "
                    "('data type do not match'); push value.astype(...) of the key's dtype"
                )
            cast = [casts.mxnet_cast(x, dtype) for x in arrays]
            out.append(cast if isinstance(v, list | tuple) else cast[0])
        return out if isinstance(key, list | tuple) else out[0]

    def _dtype_of(self, key: Key) -> Any:
        queue = self._calls.queue
        inits = queue.inits if queue is not None else {}
        if key in inits:
            return inits[key].dtype
        state = self._stored
        return buckets.stored_type(state, state.index(key)).dtype

    def row_sparse_pull(
        self, key: Any, out: Any = None, priority: int = 0, row_ids: Any = None
    ) -> jax.Array | list[jax.Array] | None:
        if out is not None:
            dense = [
                k
                for k, outs in pairing.pairs(key, out, "outs")
                for o in outs
                if not kvstore_rows.is_row_sparse(o)
            ]
            if dense:
                raise KVStoreError(
                    f"key {dense[0]!r}: row_sparse_pull expects row_sparse outs, given a dense "
                    "out (MXNet: 'Expected row_sparse storage type for row_sparse_pull "
                    "values'); pull into a dense out, or use jaxkv.KVStore, whose "
                    "row_sparse_pull fills dense outs too"
                )
        return super().row_sparse_pull(key, out, priority, row_ids)
