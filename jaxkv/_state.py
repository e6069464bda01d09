"""``KVState``: the immutable pytree at the heart of jaxkv.

The key set, the key kind and the store's devices are static (aux data), so ``jit`` specialises
on them; stored values and optimizer states are the leaves, so ``tree_map`` only touches arrays.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Hashable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._errors import KeyTypeError, KVStoreError, unknown_key

__all__ = ["AXIS", "KVState", "empty"]

Key = int | str
AXIS = "kv"  # The name of the store's one mesh axis.
# Values with at least this many elements are stored sharded over the devices. MXNet's
# MXNET_KVSTORE_BIGARRAY_BOUND plays the same role (default 1e6); measured on 8 CPU devices,
# sharding from 16K elements up made push + pull of ResNet-50's parameters fastest.
BIGARRAY_BOUND = 1 << 14
_KEEP = object()
# A state's aux data: keys, devices, big-array bound, compression, shapes, optimizer groups,
# and the user's mesh (None: the store's own).
_Aux = tuple[
    tuple[Key, ...],
    tuple[jax.Device, ...],
    int | None,
    tuple | None,
    tuple[tuple[int, ...], ...],
    tuple[tuple[Key, ...], ...],
    Mesh | None,
]


@functools.lru_cache(maxsize=4096)
def _is_sharded(shape: tuple[int, ...], n: int, bound: int | None) -> bool:
    # Asked for every value of every push and pull: cached, since shapes repeat.
    return (
        bound is not None
        and n > 1
        and len(shape) > 0
        and shape[0] % n == 0
        and math.prod(shape) >= bound
    )


@functools.lru_cache(maxsize=64)
def _mesh(devices: tuple[jax.Device, ...]) -> Mesh:
    return Mesh(np.array(devices, dtype=object), (AXIS,))


@functools.lru_cache(maxsize=128)
def _sharding(mesh: Mesh, sharded: bool) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]) if sharded else PartitionSpec())


@functools.lru_cache(maxsize=64)
def _local_positions(devices: tuple[jax.Device, ...]) -> dict[jax.Device, int]:
    me = jax.process_index()
    return {d: i for i, d in enumerate(d for d in devices if d.process_index == me)}


@functools.lru_cache(maxsize=64)
def _positions(devices: tuple[jax.Device, ...]) -> dict[jax.Device, int]:
    return {d: i for i, d in enumerate(devices)}


def normalize_key(key: Any) -> Key:
    """``key`` as a plain ``int`` or ``str``; anything else is refused."""
    if type(key) is int or type(key) is str:  # the common cases, before the ABC checks
        return key
    if isinstance(key, str):
        return key
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        return int(key)
    raise KeyTypeError(f"key {key!r}: expected an int or a str, given {type(key).__name__}")


def key_kind(key: Key) -> str:
    return "str" if isinstance(key, str) else "int"


@jax.tree_util.register_pytree_with_keys_class
class KVState:
    """An immutable key-value store of arrays over a set of devices.

    Leaves: one stored value per key (a ``jax.Array`` over the store's devices, shape and dtype
    fixed at ``init``), one optax optimizer state per *group* of keys (the keys one optimizer
    updates as one tree: made by :func:`jaxkv.init_optimizer`, or by the first optax push of a
    key set), and, under 2-bit gradient compression, one error-feedback residual per key (shape
    ``(D * n, ...)`` for a value of shape ``(n, ...)``: each device's residual in its own
    block). Aux data: the sorted key set, each key's (global) shape, the optimizer groups, the
    devices, the big-array bound and the compression. Inside ``shard_map`` with
    :func:`jaxkv.specs`, a sharded value's leaf is this device's block; the shapes in aux data
    still say the whole value's shape. A value with at least ``bigarray_bound`` elements whose
    first dimension divides by the number of devices is stored sharded along that dimension
    (each device holds 1/D of it, and of its optimizer state); smaller values are replicated
    on every device.

    Make one with :func:`jaxkv.empty` and :func:`jaxkv.init`; every operation returns a new state.

    Examples:
      >>> import jax.numpy as jnp, jaxkv
      >>> state = jaxkv.init(jaxkv.empty(), {"w": jnp.zeros(3)})
      >>> state.keys()
      ('w',)
      >>> state["w"].shape
      (3,)
    """

    __slots__ = (
        "_keys",
        "_devices",
        "_values",
        "_opt_states",
        "_bound",
        "_residuals",
        "_compression",
        "_lookup",
        "_shapes",
        "_groups",
        "_user_mesh",
    )
    # The slots' types (annotations only: a class-level value would clash with the slot).
    _keys: tuple[Key, ...]
    _devices: tuple[jax.Device, ...]
    _values: tuple[Any, ...]
    _opt_states: tuple[Any, ...]
    _bound: int | None
    _residuals: tuple[Any, ...]
    _compression: tuple | None
    _lookup: dict[Key, int] | None
    _shapes: tuple[tuple[int, ...], ...]
    _groups: tuple[tuple[Key, ...], ...]
    _user_mesh: Mesh | None

    def __init__(
        self,
        keys: tuple[Key, ...],
        devices: tuple[jax.Device, ...],
        values: Sequence[Any],
        opt_states: Sequence[Any],
        bound: int | None = BIGARRAY_BOUND,
        residuals: Sequence[Any] = (),
        compression: tuple | None = None,
        shapes: Sequence[tuple[int, ...]] | None = None,
        groups: Sequence[tuple[Key, ...]] = (),
        mesh: Mesh | None = None,
    ):
        # No validation here: pytree transformations rebuild states with arbitrary leaves.
        object.__setattr__(self, "_keys", keys)  # sorted, all int or all str
        object.__setattr__(self, "_devices", devices)
        object.__setattr__(self, "_values", tuple(values))  # aligned with _keys
        if shapes is None:  # a fresh state: its values are whole
            shapes = tuple(tuple(v.shape) for v in self._values)
        object.__setattr__(self, "_shapes", tuple(shapes))  # whole values' shapes, as _keys
        object.__setattr__(self, "_groups", tuple(groups))  # sorted tuples of keys, disjoint
        object.__setattr__(self, "_opt_states", tuple(opt_states))  # aligned with _groups
        object.__setattr__(self, "_bound", bound)  # sharded storage from this many elements
        residuals = tuple(residuals) or (None,) * len(keys)  # aligned with _keys
        object.__setattr__(self, "_residuals", residuals)
        object.__setattr__(self, "_compression", compression)  # e.g. ("2bit", 0.5), or None
        object.__setattr__(self, "_lookup", None)  # key -> position, built on first use
        object.__setattr__(self, "_user_mesh", mesh)  # the user's one-axis mesh, or None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("KVState is immutable: operations return a new state")

    def _placement(self) -> KVState:
        """A state with no keys and this one's devices, big-array bound and compression: the
        static facts a cached computation may keep without keeping any of the arrays alive."""
        return KVState(
            (), self._devices, (), (), self._bound, (), self._compression, (), (), self._user_mesh
        )

    # -- pytree protocol -------------------------------------------------------------------
    def tree_flatten_with_keys(
        self,
    ) -> tuple[tuple[tuple[jax.tree_util.GetAttrKey, tuple[Any, ...]], ...], _Aux]:
        children = (
            (jax.tree_util.GetAttrKey("values"), self._values),
            (jax.tree_util.GetAttrKey("opt_states"), self._opt_states),
            (jax.tree_util.GetAttrKey("residuals"), self._residuals),
        )
        return children, self._aux()

    def tree_flatten(self) -> tuple[tuple[tuple[Any, ...], ...], _Aux]:
        return (self._values, self._opt_states, self._residuals), self._aux()

    def _aux(self) -> _Aux:
        return (
            self._keys,
            self._devices,
            self._bound,
            self._compression,
            self._shapes,
            self._groups,
            self._user_mesh,
        )

    @classmethod
    def tree_unflatten(cls, aux: _Aux, children: Sequence[Sequence[Any]]) -> KVState:
        keys, devices, bound, compression, shapes, groups, mesh = aux
        values, opt_states, residuals = children
        return cls(
            keys, devices, values, opt_states, bound, residuals, compression, shapes, groups, mesh
        )

    # -- read-only views -------------------------------------------------------------------
    def keys(self) -> tuple[Key, ...]:
        """The keys, sorted."""
        return self._keys

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The devices the store's values live on."""
        return self._devices

    @property
    def mesh(self) -> Mesh:
        """The store's one-axis mesh over :attr:`devices`: the mesh given to :func:`empty`, or
        one of its own (axis name ``'kv'``, or the ``axis_name`` given to :func:`empty`)."""
        mesh = self._user_mesh
        return _mesh(self._devices) if mesh is None else mesh

    @property
    def axis(self) -> str:
        """The name of the mesh axis that sharded values are split along."""
        mesh = self._user_mesh
        return AXIS if mesh is None else mesh.axis_names[0]

    @property
    def positions(self) -> dict[jax.Device, int]:
        """Each device's position in :attr:`devices`."""
        return _positions(self._devices)

    @property
    def local_positions(self) -> dict[jax.Device, int]:
        """This process's devices, each with its position among them (in mesh order)."""
        return _local_positions(self._devices)

    @property
    def sharding(self) -> NamedSharding:
        """The replicated sharding over :attr:`devices`, where small values live."""
        return _sharding(self.mesh, False)

    @property
    def compression(self) -> tuple | None:
        """``('2bit', threshold)``, ``('fp16',)``, ``('bf16',)``, or ``None``."""
        return self._compression

    @property
    def residuals(self) -> Mapping[Key, Any]:
        """A read-only mapping from key to its error-feedback residual (``None`` without one)."""
        return MappingProxyType(dict(zip(self._keys, self._residuals)))

    @property
    def bigarray_bound(self) -> int | None:
        """Values with at least this many elements are stored sharded (see the class doc)."""
        return self._bound

    def is_sharded(self, shape: tuple[int, ...]) -> bool:
        """Whether a value (or optimizer-state leaf) of ``shape`` is stored sharded."""
        return _is_sharded(tuple(shape), len(self._devices), self._bound)

    def sharding_for(self, shape: tuple[int, ...]) -> NamedSharding:
        """Where a stored array of ``shape`` lives: sharded along axis 0, or replicated."""
        return _sharding(self.mesh, self.is_sharded(tuple(shape)))

    @property
    def values(self) -> Mapping[Key, Any]:
        """A read-only mapping from key to stored value."""
        return MappingProxyType(dict(zip(self._keys, self._values)))

    @property
    def shapes(self) -> Mapping[Key, tuple[int, ...]]:
        """A read-only mapping from key to the shape of its whole value (also inside
        ``shard_map``, where a sharded value's leaf is only this device's block)."""
        return MappingProxyType(dict(zip(self._keys, self._shapes)))

    @property
    def opt_states(self) -> Mapping[tuple[Key, ...], Any]:
        """A read-only mapping from each optimizer group (a sorted tuple of keys) to its optax
        state, the state of ``optimizer.init({key: value for key in group})``."""
        return MappingProxyType(dict(zip(self._groups, self._opt_states)))

    def opt_group(self, key: Any) -> tuple[Key, ...] | None:
        """The optimizer group ``key`` belongs to, or ``None`` if it has no optimizer state."""
        key = self._keys[self.index(key)]
        for group in self._groups:
            if key in group:
                return group
        return None

    @property
    def key_kind(self) -> str | None:
        """``'int'`` or ``'str'``, or ``None`` while the store is empty."""
        return key_kind(self._keys[0]) if self._keys else None

    def __contains__(self, key: Hashable) -> bool:
        try:
            return normalize_key(key) in self._index
        except KVStoreError:
            return False

    def __getitem__(self, key: Key) -> Any:
        return self._values[self.index(key)]

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        shown = ", ".join(repr(k) for k in self._keys[:6])
        more = ", ..." if len(self._keys) > 6 else ""
        return f"KVState(keys=[{shown}{more}], devices={len(self._devices)})"

    # -- helpers for the operations ----------------------------------------------------------
    @property
    def _index(self) -> dict[Key, int]:
        lookup = self._lookup
        if lookup is None:
            lookup = {k: i for i, k in enumerate(self._keys)}
            object.__setattr__(self, "_lookup", lookup)
        return lookup

    def index(self, key: Any) -> int:
        """Position of ``key`` in :meth:`keys`; refuses unknown keys and the wrong key kind."""
        key = normalize_key(key)
        self.check_kind(key)
        try:
            return self._index[key]
        except KeyError:
            raise unknown_key(key, self._keys) from None

    def check_kind(self, key: Key) -> None:
        kind = self.key_kind
        if kind is not None and key_kind(key) != kind:
            raise KeyTypeError(
                f"key {key!r}: this store holds {kind} keys, given a {key_kind(key)} key "
                "(one store holds one kind of key, as in MXNet)"
            )

    def replace(
        self,
        values: Mapping[Key, Any] | None = None,
        opt_states: Mapping[tuple[Key, ...], Any] | None = None,
        residuals: Mapping[Key, Any] | None = None,
        compression: Any = _KEEP,
    ) -> KVState:
        """A new state with some keys' leaves replaced or added (and maybe the compression).

        ``opt_states`` maps optimizer groups (tuples of keys) to their state; a group replaces
        every group that shares a key with it, and a state of ``None`` removes the group.
        Keys keep their recorded shapes; new keys take their value's shape.
        """
        old_v, old_r = dict(zip(self._keys, self._values)), dict(zip(self._keys, self._residuals))
        shapes = dict(zip(self._keys, self._shapes))
        for k, v in (values or {}).items():
            shapes.setdefault(k, tuple(v.shape))
        old_v.update(values or {})
        old_r.update(residuals or {})
        keys = tuple(sorted(old_v))
        groups = dict(zip(self._groups, self._opt_states))
        for group, opt in (opt_states or {}).items():
            group = tuple(sorted(group))
            for other in [g for g in groups if set(g) & set(group)]:
                del groups[other]
            if opt is not None:
                groups[group] = opt
        position = {k: i for i, k in enumerate(keys)}
        order = sorted(groups, key=lambda g: position[g[0]])
        return KVState(
            keys,
            self._devices,
            [old_v[k] for k in keys],
            [groups[g] for g in order],
            self._bound,
            [old_r.get(k) for k in keys],
            self._compression if compression is _KEEP else compression,
            [shapes[k] for k in keys],
            order,
            self._user_mesh,
        )


def empty(
    devices: Iterable[Any] | None = None,
    *,
    bigarray_bound: int | None = BIGARRAY_BOUND,
    compression: Mapping[str, Any] | None = None,
    mesh: Mesh | None = None,
    axis_name: str | None = None,
) -> KVState:
    """An empty store over ``devices`` (JAX devices or contexts; default: all local devices).

    Values with at least ``bigarray_bound`` elements (whose first dimension divides by the
    number of devices) are stored sharded across the devices; smaller ones are replicated.
    ``bigarray_bound=None`` replicates everything, which ``pmap`` needs: it accepts a state
    passed with ``in_axes=None`` only if every leaf is replicated.

    ``compression`` takes MXNet's gradient-compression parameters: ``{'type': '2bit',
    'threshold': t}`` (t > 0; error feedback per device, as MXNet), or ``{'type': 'fp16'}`` /
    ``{'type': 'bf16'}`` (each device's value rounded to that type before the sum).

    ``mesh`` adopts the user's one-axis ``jax.sharding.Mesh``: the store lives on its devices,
    in its order, and its arrays carry shardings over that very mesh, so a ``shard_map`` step
    over it (``in_specs=jaxkv.specs(state, axis)``) takes the state in and out unchanged and
    compiles once. ``axis_name`` alone names the axis of the store's own mesh (default
    ``'kv'``); with ``mesh`` it must be that mesh's axis.

    Examples:
      >>> import jaxkv
      >>> len(jaxkv.empty().devices) >= 1
      True
    """
    from ._context import Context

    if mesh is not None and not isinstance(mesh, Mesh):
        raise KVStoreError(f"mesh: expected a jax.sharding.Mesh, given {type(mesh).__name__}")
    if mesh is not None and len(mesh.axis_names) != 1:
        raise KVStoreError(
            f"mesh: expected a mesh with one axis, given axes {tuple(mesh.axis_names)}; a store "
            "lives on a one-axis mesh (make one over the same devices for the store)"
        )
    if axis_name is not None and not isinstance(axis_name, str):
        raise KVStoreError(f"axis_name: expected a str, given {axis_name!r}")
    if mesh is not None and axis_name is not None and axis_name != mesh.axis_names[0]:
        raise KVStoreError(
            f"axis_name: expected the mesh's axis {mesh.axis_names[0]!r}, given {axis_name!r}"
        )
    if devices is None:
        devs = tuple(jax.local_devices()) if mesh is None else tuple(mesh.devices.flat)
    else:
        devs = tuple(d.device if isinstance(d, Context) else d for d in devices)
        if mesh is not None and devs != tuple(mesh.devices.flat):
            raise KVStoreError(
                f"devices: expected the mesh's devices in its order {list(mesh.devices.flat)}, "
                f"given {list(devs)}; pass the mesh alone"
            )
    if not devs or not all(isinstance(d, jax.Device) for d in devs):
        raise KVStoreError(f"devices: expected a non-empty list of JAX devices, given {devices!r}")
    if len(set(devs)) != len(devs):
        raise KVStoreError(f"devices: expected distinct devices, given {list(devs)}")
    if bigarray_bound is not None and (not isinstance(bigarray_bound, int) or bigarray_bound < 1):
        raise KVStoreError(
            f"bigarray_bound: expected a positive int or None, given {bigarray_bound!r}"
        )
    config = compression_config(compression)
    check_compression_devices(config, devs)
    if mesh is None and axis_name is not None and axis_name != AXIS:
        mesh = Mesh(np.array(devs, dtype=object), (axis_name,))
    return KVState((), devs, (), (), bigarray_bound, (), config, (), (), mesh)


_COMPRESSION_TYPES = ("2bit", "fp16", "bf16", "none")


def compression_config(params: Mapping[str, Any] | None) -> tuple | None:
    """MXNet's compression parameters as the static tuple a state keeps."""
    if params is None:
        return None
    if not isinstance(params, Mapping) or params.get("type") not in _COMPRESSION_TYPES:
        raise KVStoreError(
            f"gradient compression: expected {{'type': one of {list(_COMPRESSION_TYPES)}, ...}}, "
            f"given {params!r}"
        )
    kind = params["type"]
    extra = sorted(set(params) - {"type", "threshold"})
    if extra or (kind != "2bit" and "threshold" in params):
        raise KVStoreError(
            f"gradient compression {kind!r}: unexpected parameters {extra or ['threshold']}"
        )
    if kind == "none":
        return None
    if kind != "2bit":
        return (kind,)
    threshold = params.get("threshold", 0.5)  # MXNet's default
    if not isinstance(threshold, int | float) or isinstance(threshold, bool) or threshold <= 0:
        raise KVStoreError(
            f"gradient compression '2bit': threshold expected a number greater than 0 (as in "
            f"MXNet), given {threshold!r}"
        )
    return ("2bit", float(threshold))


def check_compression_devices(config: tuple | None, devices: tuple[jax.Device, ...]) -> None:
    """Refuse compression for a store over several processes with other than one device in
    each: across processes, each process compresses the sum of its own devices' values once
    (MXNet's ``dist_sync``), which needs the ``dist_sync`` layout."""
    if config is None or jax.process_count() == 1:
        return
    me = jax.process_index()
    mine = [d for d in devices if d.process_index == me]
    if len(mine) != len(devices) and len(mine) != 1:
        raise KVStoreError(
            f"gradient compression {config[0]!r}: across processes expected a store with one "
            f"device per process (a dist_sync KVStore), given {len(mine)} devices of this "
            f"process among {len(devices)}; use jaxkv.create('dist_sync'), or "
            "jaxkv.empty(one device of each process, compression=...)"
        )


def check_compressible(config: tuple | None, key: Key, dtype: Any) -> None:
    """Refuse a value that ``config``'s compression cannot carry: only floating-point values are
    compressed (as in MXNet). A 2-bit threshold cast to an integer dtype would be 0 or round the
    value, and fp16/bf16 rounding of large integers changes them: both silently."""
    if config is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise KVStoreError(
            f"key {key!r}: gradient compression {config[0]!r} expects a floating-point value "
            f"(as in MXNet), given dtype {np.dtype(dtype)}; store this key in a store without "
            "compression"
        )
