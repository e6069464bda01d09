"""A plain NumPy model of one ``jaxkv.KVStore``, for the stateful test (tests/test_stateful.py).

Values are kept as float64 arrays holding exactly what the store should hold in the key's
dtype: the test keeps every value in the range where its dtype is exact (:func:`exact_limit`),
so any summation order gives the same bits. The one inexact part is an optax optimizer, which
the model runs by hand with ``jax.numpy`` on one device, on the summed gradients.

A push follows MXNet: every value given for a key in the call is summed (each first cast to the
stored dtype), then a plain updater runs once per key. With 2-bit compression each device first
adds its own values to its residual for the key, sends ``+t``, ``-t`` or 0 per element and keeps
the rest (``model_push`` of tests/test_compression.py); devices that push nothing keep their
residual.

An optax optimizer keeps one state per *group* of keys: the state of ``init({key: value for key
in group})``. A push updates its distinct keys as one tree, ``update({key: gradient}, state,
{key: value})``: they must be exactly one group, or all be without state (then they become a new
group, its state made first); any other key set is refused and changes nothing. ``init`` of new
keys makes no state; ``set_optimizer`` of another optimizer than the store's updater drops every
group; ``jaxkv.init_optimizer`` makes one group of its keys, replacing the groups inside them and
refusing a group that reaches beyond them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

NDEV = 8
F32, F16, BF16, I32 = (np.dtype(t) for t in (np.float32, np.float16, jnp.bfloat16, np.int32))
# Integers (and multiples of a power-of-two grid, scaled) up to this size are exact in the dtype.
_EXACT = {F32: 2.0**24, F16: 2.0**11, BF16: 2.0**8, I32: 2.0**31 - 1}
PLAIN_UPDATERS = ("assign", "add", "inplace")
# Module-level optax objects: the store caches its compiled pushes per updater object, so the
# same objects in every run keep compilation to one per push signature for the whole test.
OPTIMIZERS = {"sgd": optax.sgd(0.1, momentum=0.9), "adam": optax.adam(0.05)}


def exact_limit(dtype: Any, grid: float = 1.0) -> float:
    """Values on ``grid`` (1 or a power of two below it) are exact in ``dtype`` up to this size."""
    return _EXACT[np.dtype(dtype)] * (grid if np.dtype(dtype) != I32 else 1.0)


def is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(np.dtype(dtype), jnp.floating))


def in_dtype(x: Any, dtype: Any) -> np.ndarray:
    """``x`` cast to ``dtype`` (rounded, or truncated for integers) and back to float64."""
    return np.asarray(x, np.float64).astype(np.dtype(dtype)).astype(np.float64)


def two_bit(residual: np.ndarray, g: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
    """MXNet's 2-bit rule for one device: (what it sends, its new residual)."""
    acc = residual + g
    q = np.where(acc >= t, t, np.where(acc <= -t, -t, 0.0))
    return q, acc - q


@functools.cache
def optimizer_step(name: str):
    """One optax step of a group, jitted once per optimizer (and tree): (params, state) from
    the gradients, each a dict ``{key: array}``."""
    opt = OPTIMIZERS[name]

    def step(grad, state, params):
        updates, state = opt.update(grad, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step)


@dataclass
class KeyModel:
    value: np.ndarray  # float64, exactly the stored value (in ``dtype``)
    dtype: np.dtype
    residual: np.ndarray | None = None  # (NDEV, *shape) float64 with 2-bit compression

    def copy(self) -> KeyModel:
        residual = None if self.residual is None else self.residual.copy()
        return KeyModel(self.value.copy(), self.dtype, residual)


class StoreModel:
    """What a store holds (its ``KVState``: values, optimizer groups and their states,
    compression and residuals) and which updater it runs (not part of the state: ``load`` and
    ``state =`` keep it)."""

    def __init__(self):
        self.keys: dict[Any, KeyModel] = {}
        # Optimizer groups (sorted tuples of keys, disjoint) and their optax states (jax arrays
        # on one device, over the tree ``{key: value}``).
        self.groups: dict[tuple, Any] = {}
        self.threshold: float | None = None  # 2-bit compression, or None
        self.updater = "assign"  # one of PLAIN_UPDATERS or OPTIMIZERS

    @property
    def optimizer(self) -> str | None:
        return self.updater if self.updater in OPTIMIZERS else None

    def snapshot(self) -> StoreModel:
        """A copy of the state part (keys, groups, compression); the updater is left as it is."""
        s = StoreModel()
        s.restore(self)
        return s

    def restore(self, snap: StoreModel) -> None:
        """The state part of ``snap``, keeping this store's updater."""
        self.keys = {k: km.copy() for k, km in snap.keys.items()}
        self.groups = dict(snap.groups)  # optax states are immutable: shared
        self.threshold = snap.threshold

    def init(self, key: Any, x: np.ndarray, dtype: Any) -> None:
        """``init`` of a new key: its value, a zero residual under compression, no optimizer
        state (its group is made by its first optax push or by ``init_optimizer``)."""
        km = KeyModel(np.asarray(x, np.float64).copy(), np.dtype(dtype))
        if self.threshold is not None:
            km.residual = np.zeros((NDEV, *km.value.shape))
        self.keys[key] = km

    def set_optimizer(self, name: str) -> None:
        """``set_optimizer``: an optimizer other than the store's updater drops every group
        (its states were made by another updater); the same one again changes nothing."""
        if name != self.updater:
            self.groups = {}
        self.updater = name

    # -- optimizer groups ------------------------------------------------------------------
    def group_of(self, key: Any) -> tuple | None:
        return next((g for g in self.groups if key in g), None)

    def ungrouped(self) -> list:
        """The keys without optimizer state, sorted."""
        return [k for k in sorted(self.keys) if self.group_of(k) is None]

    def push_sets(self) -> list[tuple]:
        """Key sets an optax push takes: every group, and (if any) all the keys without state
        (any part of which is taken too)."""
        fresh = tuple(self.ungrouped())
        return sorted(self.groups) + ([fresh] if fresh else [])

    def optax_refusal(self, keys: Any) -> str | None:
        """Why an optax push of ``keys`` is refused (None: it is taken)."""
        keys = tuple(sorted(set(keys)))
        groups = {self.group_of(k) for k in keys}
        if groups == {None} or groups == {keys}:
            return None
        if None in groups:
            return "keys with and without optimizer state"
        if len(groups) > 1:
            return "keys of several groups"
        return "part of a group"

    def params(self, keys: Any) -> dict:
        """The tree ``{key: stored value}`` an optimizer sees, on one device."""
        return {k: jnp.asarray(self.keys[k].value, self.keys[k].dtype) for k in keys}

    def init_optimizer(self, name: str, keys: Any) -> str | None:
        """``jaxkv.init_optimizer`` of ``keys``: one group of fresh state, replacing the groups
        inside ``keys``; a group that reaches beyond them refuses it (the returned reason) and
        nothing changes."""
        keys = set(keys)
        if any(keys & set(g) and not set(g) <= keys for g in self.groups):
            return "a group reaching beyond the keys"
        self.groups = {g: s for g, s in self.groups.items() if not set(g) <= keys}
        group = tuple(sorted(keys))
        self.groups[group] = OPTIMIZERS[name].init(self.params(group))
        return None

    def set_compression(self, threshold: float | None) -> None:
        """``set_gradient_compression``: every residual starts again at zero."""
        self.threshold = threshold
        for km in self.keys.values():
            km.residual = None if threshold is None else np.zeros((NDEV, *km.value.shape))

    def summed(self, key: Any, parts: list[tuple[int | None, np.ndarray]]) -> np.ndarray:
        """The pushed value after the sum over ``parts`` ((device or None, value) pairs), and
        after compression; updates the residuals."""
        km = self.keys[key]
        if self.threshold is None:
            return sum(in_dtype(x, km.dtype) for _, x in parts)
        by_device: dict[int, np.ndarray] = {}
        for d, x in parts:  # several values from one device are summed there first
            by_device[d] = by_device.get(d, 0) + np.asarray(x, np.float64)
        total = np.zeros_like(km.value)
        for d, g in by_device.items():
            q, km.residual[d] = two_bit(km.residual[d], in_dtype(g, km.dtype), self.threshold)
            total = total + q
        return total

    def push(self, by_key: dict[Any, list[tuple[int | None, np.ndarray]]]) -> None:
        """One push call: ``by_key`` maps each distinct key to its parts. An optax push must be
        one the store takes (see :meth:`optax_refusal`)."""
        pushed = {k: self.summed(k, parts) for k, parts in by_key.items()}
        if self.optimizer is None:
            for k, x in pushed.items():
                km = self.keys[k]
                if self.updater == "assign":
                    km.value = x
                elif self.updater == "add":
                    km.value = km.value + x
                else:  # inplace
                    km.value = km.value + 2 * x
            return
        group = tuple(sorted(pushed))
        assert self.optax_refusal(group) is None, (group, self.groups.keys())
        params = self.params(group)
        state = self.groups.get(group)
        if state is None:  # keys without state: a new group, its state made first
            state = OPTIMIZERS[self.updater].init(params)
        grads = {k: jnp.asarray(pushed[k], self.keys[k].dtype) for k in group}
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam needs it
            new, self.groups[group] = optimizer_step(self.updater)(grads, state, params)
        for k in group:
            self.keys[k].value = in_dtype(np.asarray(new[k], np.float64), self.keys[k].dtype)

    def result_bound(self, key: Any, parts: list[tuple[int | None, np.ndarray]]) -> float:
        """How far from zero any intermediate of pushing ``parts`` to ``key`` goes, whatever
        the order of summation: the test keeps this within :func:`exact_limit`, so that every
        order gives the same bits."""
        km = self.keys[key]
        # assign, or an optimizer (float32 only): the stored value is not added to
        scale = {"add": 1.0, "inplace": 2.0}.get(self.updater, 0.0)
        if self.threshold is None:
            reach = sum(np.abs(x) for _, x in parts)  # bounds every partial sum
            pushed = sum(np.asarray(x, np.float64) for _, x in parts)
            sent = reach
        else:
            by_device: dict[int, np.ndarray] = {}
            reach_of: dict[int, np.ndarray] = {}
            for d, x in parts:
                by_device[d] = by_device.get(d, 0) + np.asarray(x, np.float64)
                reach_of[d] = reach_of.get(d, 0) + np.abs(x)
            reach, pushed = 0.0, 0.0
            for d, g in by_device.items():
                acc = km.residual[d] + g  # the new residual is no further from zero than acc
                reach = np.maximum(reach, np.maximum(reach_of[d], np.abs(acc)))
                pushed = pushed + two_bit(km.residual[d], g, self.threshold)[0]
            sent = len(by_device) * self.threshold  # bounds every partial sum of what is sent
        bounds = [reach, max(scale, 1.0) * sent, np.abs(km.value + scale * pushed) * (scale > 0)]
        return max(float(np.max(b)) for b in bounds)

    def sign_source(self, key: Any, device: int | None) -> np.ndarray:
        """What a part's signs should oppose to keep the result small: the stored value, or
        with compression the device's residual."""
        km = self.keys[key]
        if self.threshold is None or device is None:
            return km.value
        return km.residual[device]


def flipped(x: np.ndarray, against: np.ndarray) -> np.ndarray:
    """``x`` with each element's sign opposite to ``against`` (where that is not zero)."""
    return np.where(against > 0, -np.abs(x), np.where(against < 0, np.abs(x), x))
