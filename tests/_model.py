"""A plain NumPy model of one ``jaxkv.KVStore``, for the stateful test (tests/test_stateful.py).

Values are kept as float64 arrays holding exactly what the store should hold in the key's
dtype: the test keeps every value in the range where its dtype is exact (:func:`exact_limit`),
so any summation order gives the same bits. The one inexact part is an optax optimizer, which
the model runs by hand with ``jax.numpy`` on one device, per key, on the summed gradient.

A push follows MXNet: every value given for a key in the call is summed (each first cast to the
stored dtype), then the updater runs once per key. With 2-bit compression each device first adds
its own values to its residual for the key, sends ``+t``, ``-t`` or 0 per element and keeps the
rest (``model_push`` of tests/test_compression.py); devices that push nothing keep their residual.
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
    """One optax step for one key, jitted once per optimizer: (params, state) from a gradient."""
    opt = OPTIMIZERS[name]

    def step(grad, state, params):
        updates, state = opt.update(grad, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step)


@dataclass
class KeyModel:
    value: np.ndarray  # float64, exactly the stored value (in ``dtype``)
    dtype: np.dtype
    opt: Any = None  # the optax state (jax arrays on one device), None until made
    residual: np.ndarray | None = None  # (NDEV, *shape) float64 with 2-bit compression

    def copy(self) -> KeyModel:
        residual = None if self.residual is None else self.residual.copy()
        return KeyModel(self.value.copy(), self.dtype, self.opt, residual)


class StoreModel:
    """What a store holds (its ``KVState``: values, optimizer states, compression and residuals)
    and which updater it runs (not part of the state: ``load`` and ``state =`` keep it)."""

    def __init__(self):
        self.keys: dict[Any, KeyModel] = {}
        self.threshold: float | None = None  # 2-bit compression, or None
        self.updater = "assign"  # one of PLAIN_UPDATERS or OPTIMIZERS

    @property
    def optimizer(self) -> str | None:
        return self.updater if self.updater in OPTIMIZERS else None

    def snapshot(self) -> StoreModel:
        """A copy of the state part (keys, compression); the updater is left as it is."""
        s = StoreModel()
        s.keys = {k: km.copy() for k, km in self.keys.items()}
        s.threshold = self.threshold
        return s

    def restore(self, snap: StoreModel) -> None:
        """The state part of ``snap``, keeping this store's updater."""
        self.keys = {k: km.copy() for k, km in snap.keys.items()}
        self.threshold = snap.threshold

    def init(self, key: Any, x: np.ndarray, dtype: Any) -> None:
        km = KeyModel(np.asarray(x, np.float64).copy(), np.dtype(dtype))
        if self.threshold is not None:
            km.residual = np.zeros((NDEV, *km.value.shape))
        if self.optimizer:
            km.opt = OPTIMIZERS[self.optimizer].init(jnp.asarray(km.value, km.dtype))
        self.keys[key] = km

    def set_optimizer(self, name: str) -> None:
        """``set_optimizer`` (re)makes every key's optimizer state."""
        self.updater = name
        for km in self.keys.values():
            km.opt = OPTIMIZERS[name].init(jnp.asarray(km.value, km.dtype))

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

    def push(self, key: Any, parts: list[tuple[int | None, np.ndarray]]) -> None:
        km = self.keys[key]
        pushed = self.summed(key, parts)
        if self.updater == "assign":
            km.value = pushed
        elif self.updater == "add":
            km.value = km.value + pushed
        elif self.updater == "inplace":
            km.value = km.value + 2 * pushed
        else:
            opt = OPTIMIZERS[self.updater]
            params = jnp.asarray(km.value, km.dtype)
            if km.opt is None:
                km.opt = opt.init(params)
            grad = jnp.asarray(pushed, km.dtype)
            with jax.numpy_dtype_promotion("standard"):  # optax's Adam needs it
                new, km.opt = optimizer_step(self.updater)(grad, km.opt, params)
            km.value = np.asarray(new, np.float64)

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
