"""A stateful property test of the imperative ``KVStore`` against a plain NumPy model.

Each run draws a configuration once (so that the number of distinct compiled pushes stays
small): the store type (``local`` or ``device``), the big-array bound (16, so that keys of
shape (8, 4) and (16, 8) are stored sharded and their pushes go through the fused
reduce-scatter; the default 16K; or 1M, so that a (1024, 16) key is replicated but still
reduce-scattered), the dtypes its keys use (float32, float16, bfloat16, int32), whether it uses
an optax optimizer (``optax.sgd(0.1, momentum=0.9)`` or ``optax.adam(0.05)``: float32 keys
only) and, on ``device`` stores, a 2-bit compression threshold. Then Hypothesis drives the store
with ``init``, ``push``, ``pull``, ``pushpull``, ``broadcast``, ``row_sparse_pull``,
``set_updater`` (assign, a pure ``stored + pushed`` and an MXNet in-place ``stored += inp * 2``),
``set_optimizer``, ``jaxkv.init_optimizer`` (on ``kv.state``, the result set back),
``set_gradient_compression``, ``save`` / ``load`` (into the same store or a fresh one of the same
configuration), ``save_optimizer_states`` / ``load_optimizer_states``, reading ``kv.state`` and
setting it back later, and with calls that must be refused.

The model (tests/_model.py) follows MXNet: a push sums every value given for a key in the call
(duplicate keys and per-device lists alike, each value cast to the stored dtype), compressing
each device's share first when 2-bit compression is on, then a plain updater runs once per key.
An optax optimizer keeps one state per group of keys and updates the distinct keys of a push as
one tree: they must be exactly one group or all be without state (a new group); optimizer pushes
mostly draw such key sets, and sometimes part of a group, keys of several groups or keys with
and without state, which must be refused. The data are small integers and every value is kept
where its dtype is exact (a push whose result could leave that range has the signs of its values
turned against the stored value, or is left out), so every pulled value is compared exactly, in
the dtype it must have; only values an optimizer has touched are compared with a tolerance (rtol
1e-5), against optax run by hand on each group's tree.

Every refusal must raise ``jaxkv.KVStoreError`` and leave the store and every ``out`` it was
given exactly as before. Arrays handed to or received from the store (init and push values,
pulled arrays, outs, handed-out ``KVState``s) are watched for a while afterwards: a later update
must never change or invalidate them.

Each run draws the store's layout too (``auto``, ``flat`` or ``keys``; ``JAXKV_LAYOUT``, where
set, fixes it): every layout must give the same numbers.

Profiles (see the end of this file): the default one is derandomized (the same runs every
time, about a minute); ``HYPOTHESIS_PROFILE=deep`` (``make test-deep``) runs 2000 random runs
of up to 50 steps. ``HYPOTHESIS_MAX_EXAMPLES=n`` overrides either profile's number of runs.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _devices import cpu_store
from _model import (
    BF16,
    F16,
    F32,
    I32,
    NDEV,
    OPTIMIZERS,
    PLAIN_UPDATERS,
    StoreModel,
    exact_limit,
    flipped,
    in_dtype,
    is_float,
)
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import jaxkv
import jaxkv.nd as nd

# A small fixed pool, so that compiled pushes are shared between runs. Sharded shapes repeat
# so that several sharded keys often meet in one push.
SHAPES = [(2, 3), (4,), (), (8, 4), (16, 8), (8, 4), (16, 8), (1024, 16)]
SHARDED_SHAPES = [(8, 4), (16, 8), (8, 4), (16, 8), (1024, 16)]  # with bound 16
WRONG_SHAPES = [(3, 2), (4,), (2, 3), (6,), (1,), (8, 2), (16, 8)]
KEYS = {"int": [0, 1, 2, 3], "str": ["a", "b", "c", "d"]}
NEVER = {"int": 9, "str": "z"}  # a key of the run's kind that is never initialised
BOUND_ENV = "MXNET_KVSTORE_BIGARRAY_BOUND"
DEFAULT_BOUND = 1 << 14
BOUNDS = [16, 16, 16, None, 1 << 20]  # None: the store's default
# Store types, each with the 2-bit threshold its runs may set (only device stores compress).
STORES = [("local", None), ("local", None), ("device", None), ("device", 0.5), ("device", 2.0)]
# The dtypes a run's keys use (optimizer runs: float32 only), each in three pools of eight.
DTYPE_POOLS = [[F32], [F16], [BF16], [I32], [F32, F16], [BF16, I32], [F16, BF16], [I32, F32]]
WATCH = 10  # how many handed-over arrays stay watched
MESH = jax.sharding.Mesh(jax.devices("cpu")[:2], ("d",))  # for values that span two devices


def _widens(given, stored) -> bool:
    """Whether a value of dtype ``given`` is a safe widening into a key of ``stored``."""
    return np.dtype(given) != np.dtype(stored) and bool(np.can_cast(given, stored, "safe"))


def add_updater(key, pushed, stored):
    """A pure updater: returns the new stored value."""
    return stored + pushed


def inplace_updater(key, inp, stored):
    """MXNet's in-place style: mutates ``stored`` and returns None."""
    stored += inp * 2


UPDATERS = {"assign": None, "add": add_updater, "inplace": inplace_updater}


def _np(x) -> np.ndarray:
    return x.asnumpy() if isinstance(x, nd.NDArray) else np.asarray(x)


def _same(actual, expected: np.ndarray, dtype, what: str, tolerant: bool = False) -> None:
    """``actual`` has ``dtype`` and holds ``expected`` (float64) cast to it."""
    got = _np(actual)
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    got, want = got.astype(np.float64), in_dtype(expected, dtype)
    if tolerant:
        scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def _small_ints(data, shape) -> np.ndarray:
    """Integers in [-3, 3]; drawn one by one for tiny shapes, else from a drawn seed (Hypothesis
    gives a run a few thousand choices: element by element, pushes would use them up)."""
    size = math.prod(shape)
    if size <= 4:
        xs = data.draw(st.lists(st.integers(-3, 3), min_size=size, max_size=size))
        return np.array(xs, np.float64).reshape(shape)
    seed = data.draw(st.integers(0, 2**32 - 1))
    return np.random.default_rng(seed).integers(-3, 4, size=shape).astype(np.float64)


def _device_lists(max_size: int = NDEV):
    """1..max_size device ids: all distinct (MXNet's one value per device) or with repeats."""
    distinct = st.permutations(range(NDEV)).flatmap(
        lambda p: st.integers(1, max_size).map(lambda n: list(p[:n]))
    )
    repeats = st.lists(st.integers(0, NDEV - 1), min_size=1, max_size=max_size)
    return st.one_of(distinct, distinct, repeats)


@dataclass
class Part:
    """One array of a push: where it lives (None: on several devices), its dtype and values."""

    kind: str  # array, jax, ones, full, or pulled (an array the store handed out)
    dev: int | None
    dtype: np.dtype
    x: np.ndarray  # float64, exact in dtype
    handle: Any = None

    def make(self) -> None:
        if self.kind == "pulled":
            return
        ctx, shape = jaxkv.cpu(self.dev), self.x.shape
        if self.kind == "ones":
            self.handle = nd.ones(shape, ctx, dtype=self.dtype)
        elif self.kind == "full":
            self.handle = nd.full(shape, float(self.x.reshape(-1)[0]), ctx, dtype=self.dtype)
        elif self.kind == "jax":
            self.handle = jax.device_put(self.x.astype(self.dtype), ctx.device)
        else:
            self.handle = nd.array(self.x.astype(self.dtype), ctx=ctx, dtype=self.dtype)


@dataclass
class Push:
    keys: Any  # as given to the store: a key or a list of keys
    entries: list  # [(key, single value?, [Part, ...])] in call order
    refused: str | None = None  # why the store must refuse it
    skipped: bool = False

    @property
    def values(self) -> Any:
        vals = [ps[0].handle if one else [p.handle for p in ps] for _, one, ps in self.entries]
        return vals if isinstance(self.keys, list) else vals[0]

    @property
    def parts(self) -> list[Part]:
        return [p for _, _, ps in self.entries for p in ps]

    def by_key(self) -> dict:
        out: dict = {}
        for k, _, ps in self.entries:
            out.setdefault(k, []).extend(ps)
        return out


class KVStoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv: Any = None
        self.m = StoreModel()
        self.kind = "int"
        self.tolerant = False  # True once an optimizer has run: values are no longer integers
        self.watched: list = []  # (handle, expected, dtype, context or None)
        self.pulled: list = []  # (array, expected, dtype): arrays the store handed out
        self.states: list = []  # (KVState from kv.state, model snapshot, its values then)
        self.saved: tuple | None = None  # (path, model snapshot)
        self.saved_opt: tuple | None = None  # (path, optimizer groups, key shapes)
        self.saves = 0
        self.steps = 0
        self.tmp = tempfile.mkdtemp(prefix="jaxkv-stateful-")

    def teardown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)
        event(f"run: {self.steps // 10 * 10}+ steps")

    # -- configuration -----------------------------------------------------------------------
    def new_store(self) -> jaxkv.KVStore:
        """A store of this run's type over the 8 CPU devices, made with this run's big-array
        bound."""
        old = os.environ.get(BOUND_ENV)
        try:
            if self.bound is None:
                os.environ.pop(BOUND_ENV, None)
            else:
                os.environ[BOUND_ENV] = str(self.bound)
            kv = cpu_store(self.store_type, layout=self.layout)
        finally:
            if old is None:
                os.environ.pop(BOUND_ENV, None)
            else:
                os.environ[BOUND_ENV] = old
        return kv

    def sharded(self, shape) -> bool:
        bound = self.bound or DEFAULT_BOUND
        return len(shape) > 0 and shape[0] % NDEV == 0 and math.prod(shape) >= bound

    @property
    def known(self) -> list:
        return sorted(self.m.keys)

    def dtype_of(self, key) -> np.dtype:
        return self.m.keys[key].dtype

    def shape_of(self, key) -> tuple:
        return self.m.keys[key].value.shape

    # -- checks ----------------------------------------------------------------------------
    def same(self, actual, expected, dtype, what) -> None:
        _same(actual, expected, dtype, what, self.tolerant)

    def watch(self, handle) -> None:
        """Watch ``handle`` (already checked against the model): it must keep its value (bit
        for bit), dtype and device."""
        ctx = handle.context if isinstance(handle, nd.NDArray) else None
        value = _np(handle)
        self.watched.append((handle, value.astype(np.float64), value.dtype, ctx))
        del self.watched[:-WATCH]

    def keep_pulled(self, array) -> None:
        """Keep an array the store handed out (already checked), to push it back later."""
        value = np.asarray(array)
        self.pulled.append((array, value.astype(np.float64), value.dtype))
        del self.pulled[:-4]

    def check_store(self) -> None:
        """The store holds exactly the model: same keys, same values, same dtypes."""
        assert self.kv.keys() == self.known
        if not self.m.keys:
            return
        values = self.kv.pull(self.known)
        assert isinstance(values, list) and len(values) == len(self.m.keys)
        for k, v in zip(self.known, values):
            assert isinstance(v, jax.Array)
            self.same(v, self.m.keys[k].value, self.dtype_of(k), f"stored value of key {k!r}")

    def check_outs(self, entries, outs_info, rows=None) -> None:
        """Each out holds its key's value (or the kept rows of it), on its own device."""
        for i, (k, handles) in enumerate(zip(entries, outs_info)):
            for j, (h, d, _, dtype) in enumerate(handles):
                want = self.m.keys[k].value
                if rows is not None:
                    want = _keep_rows(want, rows[i][j])
                self.same(h, want, dtype, f"out of key {k!r} on cpu({d})")
                assert h.context == jaxkv.cpu(d), f"out of key {k!r}: {h.context} != cpu({d})"
                self.watch(h)

    def check_returned(self, keys, entries, result, rows=None) -> None:
        if isinstance(keys, list):
            assert isinstance(result, list) and len(result) == len(entries)
        else:
            result = [result]
        for i, (k, r) in enumerate(zip(entries, result)):
            assert isinstance(r, jax.Array), type(r)
            want = self.m.keys[k].value
            if rows is not None:
                want = _keep_rows(want, rows[i])
            self.same(r, want, self.dtype_of(k), f"returned value of key {k!r}")
            self.watch(r)
            self.keep_pulled(r)

    def refused(self, call, outs_info=()) -> None:
        """``call`` raises KVStoreError and changes nothing: not the store, not any out."""
        try:
            call()
        except jaxkv.KVStoreError:
            pass
        else:
            raise AssertionError("expected jaxkv.KVStoreError, the call was accepted")
        self.check_store()
        for handles in outs_info:
            for h, d, initial, dtype in handles:
                _same(h, initial, dtype, f"out on cpu({d}) after a refused call")
                assert h.context == jaxkv.cpu(d)

    # -- drawing -----------------------------------------------------------------------------
    def draw_part(self, data, shape, dtype, dev=None, allow_pulled=True) -> Part:
        """One array of ``shape``: made here, or one the store handed out earlier."""
        how = data.draw(st.sampled_from(["array", "array", "ones", "full", "jax", "pulled"]))
        if how == "pulled":
            same = [  # of a dtype the key holds (another is refused: ``refusal``'s "lossy")
                (a, x, dt)
                for a, x, dt in self.pulled
                if a.shape == shape and np.can_cast(dt, dtype, "safe")
            ]
            if same and allow_pulled:
                a, x, dt = data.draw(st.sampled_from(same))
                return Part("pulled", None, dt, x, a)
            how = "array"
        if dev is None:
            dev = data.draw(st.integers(0, NDEV - 1))
        if how == "ones":
            x = np.ones(shape)
        elif how == "full":
            x = np.full(shape, float(data.draw(st.integers(-3, 3))))
        else:
            x = _small_ints(data, shape)
        return Part(how, dev, np.dtype(dtype), x)

    def draw_value(self, data, key, allow_pulled=True) -> tuple[bool, list[Part]]:
        """A push value for one key: one array, or a list of per-device arrays."""
        shape, dtype = self.shape_of(key), self.draw_push_dtype(data, key)
        if data.draw(st.booleans()):
            return True, [self.draw_part(data, shape, dtype, allow_pulled=allow_pulled)]
        devs = data.draw(_device_lists())
        return False, [
            self.draw_part(data, shape, dtype, dev=d, allow_pulled=allow_pulled) for d in devs
        ]

    def draw_push_dtype(self, data, key) -> np.dtype:
        """Mostly the stored dtype; sometimes another that the stored one holds without loss
        (a safe widening, which the store casts; the others are refused: ``refusal``)."""
        stored = self.dtype_of(key)
        if self.family != "plain":
            return stored
        wider = [d for d in (F32, I32, F16, BF16, np.dtype(np.int8)) if _widens(d, stored)]
        return np.dtype(data.draw(st.sampled_from([stored, stored, *wider])))

    def draw_outs(self, data, shape, dtype):
        """``out`` for one key: one NDArray or a list of them, on various devices, of the stored
        dtype or float32. Returns (out, [(handle, device id, initial value, dtype), ...])."""
        single = data.draw(st.booleans())
        devs = [data.draw(st.integers(0, NDEV - 1))] if single else data.draw(_device_lists(4))
        handles = []
        for d in devs:
            fill = data.draw(st.sampled_from([0, -7]))
            dt = np.dtype(data.draw(st.sampled_from([dtype, F32])))
            h = nd.full(shape, fill, jaxkv.cpu(d), dtype=dt)
            handles.append((h, d, np.full(shape, fill), dt))
        out = handles[0][0] if single else [h for h, _, _, _ in handles]
        return out, handles

    def draw_keys(self, data, pool):
        """A single key, or a list of 1..4 keys (repeats allowed): (keys, [key, ...])."""
        if data.draw(st.booleans()):
            k = data.draw(st.sampled_from(pool))
            return k, [k]
        ks = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4))
        return ks, ks

    def draw_optax_keys(self, data, taken: bool = False) -> list | None:
        """With an optimizer, the distinct keys of a push: mostly (with ``taken``, always) a set
        it takes (one group exactly, or keys without state), sometimes one it refuses (part of
        a group, keys of several groups, keys with and without state). None: any keys (no
        optimizer, or now and then with one, as a plain push draws them)."""
        if self.m.optimizer is None:
            return None
        how = "taken" if taken else data.draw(st.sampled_from(["taken"] * 3 + ["refused", "any"]))
        if how == "any":
            return None
        if how == "refused":
            wrong = [sets for sets in self.refused_optax_sets() if sets]
            if wrong:
                return list(data.draw(st.sampled_from(data.draw(st.sampled_from(wrong)))))
        ks = list(data.draw(st.sampled_from(self.m.push_sets())))
        if self.m.group_of(ks[0]) is None and len(ks) > 1 and data.draw(st.booleans()):
            ks = data.draw(st.lists(st.sampled_from(ks), min_size=1, max_size=len(ks), unique=True))
        return ks

    def refused_optax_sets(self) -> list[list[tuple]]:
        """Key sets an optax push must refuse, by kind: each group without one of its keys;
        two groups together; a group with a key without state, or a group's key with one."""
        groups, fresh = sorted(self.m.groups), self.m.ungrouped()
        part = [tuple(k for k in g if k != drop) for g in groups if len(g) > 1 for drop in g]
        several = [a + b for i, a in enumerate(groups) for b in groups[i + 1 :]]
        mixed = [g + (k,) for g in groups for k in fresh]
        mixed += [(g[0], k) for g in groups if len(g) > 1 for k in fresh]
        return [part, several, mixed]

    def draw_covering(self, data, ks: list):
        """Keys for a push of exactly the distinct keys ``ks``, in any order, maybe with a
        repeat or (one key) alone: (keys, [key, ...])."""
        if len(ks) == 1 and data.draw(st.booleans()):
            return ks[0], ks
        ks = list(data.draw(st.permutations(ks)))
        if len(ks) < 4 and not data.draw(st.integers(0, 3)):
            ks.insert(data.draw(st.integers(0, len(ks))), data.draw(st.sampled_from(ks)))
        return ks, ks

    def draw_push(self, data, taken: bool = False) -> Push:
        """Keys and values for a push, kept where the model is exact (see the module doc)."""
        optax_keys = self.draw_optax_keys(data, taken)
        if optax_keys is None:
            keys, entries = self.draw_keys(data, self.known)
        else:
            keys, entries = self.draw_covering(data, optax_keys)
        compressed = self.m.threshold is not None
        # A compressed push refuses values that span several devices: seldom draw those.
        allow_pulled = not compressed or data.draw(st.integers(0, 3)) == 0
        return self.checked_push(
            Push(keys, [(k, *self.draw_value(data, k, allow_pulled)) for k in entries])
        )

    def draw_device_push(self, data, taken: bool = False) -> Push:
        """The data-parallel pattern: several distinct keys, each with one value per device
        from the same devices (all of them, or some), so that sharded keys of one dtype are
        reduce-scattered together."""
        ks = self.draw_optax_keys(data, taken)
        if ks is not None:
            ks = list(data.draw(st.permutations(ks)))
        else:
            ks = list(self.known)  # mostly every key, as a training step pushes every gradient
            if not data.draw(st.integers(0, 2)):
                ks = data.draw(st.lists(st.sampled_from(ks), min_size=1, max_size=4, unique=True))
        if data.draw(st.booleans()):
            ks.sort(key=lambda k: not self.sharded(self.shape_of(k)))  # sharded keys first
        if data.draw(st.integers(0, 2)):
            devs = list(range(NDEV))
        else:
            devs = data.draw(_device_lists()) if len(ks) else []
            devs = list(dict.fromkeys(devs))  # one value per device
        entries = []
        for k in ks:
            shape, dtype = self.shape_of(k), self.draw_push_dtype(data, k)
            kind = data.draw(st.sampled_from(["array", "jax"]))
            rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
            xs = rng.integers(-3, 4, size=(len(devs), *shape)).astype(np.float64)
            entries.append((k, False, [Part(kind, d, dtype, x) for d, x in zip(devs, xs)]))
        return self.checked_push(Push(ks, entries))

    def checked_push(self, push: Push) -> Push:
        """``push`` marked refused (a compressed push of values on several devices, an optax
        push of keys that are not one group) or left out (its result would not be exact), its
        arrays made."""
        if self.m.threshold is not None and any(p.dev is None for p in push.parts):
            push.refused = "compressed push of a value on several devices"
        elif self.m.optimizer is not None:
            why = self.m.optax_refusal(push.by_key())
            push.refused = why and f"optax push of {why}"
        if not push.refused and self.m.optimizer is None:
            for k, parts in push.by_key().items():
                if not self.keep_exact(k, parts):
                    push.skipped = True
        if not push.refused and self.m.optimizer is not None:
            self.exact_gradients(push)
        for p in push.parts:
            p.make()
        return push

    def exact_gradients(self, push: Push) -> None:
        """Keep each key's summed gradient exact: a handed-out array that holds fractions (an
        optimizer's result) is pushed only as a key's one value; beside others, its rounded
        values are pushed instead. Float32 sums of fractions depend on the order, and the model
        sums in float64: Adam's first step moves by ``lr * g / (|g| + eps)``, so a gradient
        that cancels to 0 in one order and to 1e-9 in another moves by 0 or by ``lr / 10``."""
        for k, parts in push.by_key().items():
            if len(parts) < 2:
                continue
            for p in parts:
                if p.kind == "pulled" and not np.array_equal(p.x, np.round(p.x)):
                    p.kind, p.dev, p.x, p.handle = "array", 0, np.round(p.x), None
                    p.dtype = self.dtype_of(k)
                    event("push: a handed-out gradient rounded, its sum exact")

    def keep_exact(self, key, parts: list[Part]) -> bool:
        """Make pushing ``parts`` to ``key`` exact in the key's dtype, turning the signs of the
        values against the stored value (or residual) if needed; False if that is not enough."""
        limit = exact_limit(self.dtype_of(key), self.grid)
        if self.m.result_bound(key, [(p.dev, p.x) for p in parts]) <= limit:
            return True
        turned = []
        for p in parts:
            dev = p.dev if p.dev is not None else 0
            turned.append((dev, flipped(p.x, self.m.sign_source(key, dev))))
        if self.m.result_bound(key, turned) > limit:
            return False
        for p, (dev, x) in zip(parts, turned):
            p.kind, p.dev, p.x = "array", dev, x
            if p.handle is not None:  # was an array handed out by the store
                p.dtype, p.handle = self.dtype_of(key), None
        event("push: signs turned to stay exact")
        return True

    def note_push(self, push: Push) -> None:
        """Events for the paths a push takes: how many sharded keys were reduce-scattered
        together (fused), per dtype."""
        stacked: dict = {}
        for k, parts in push.by_key().items():
            devs = [p.dev for p in parts]
            one_each = len(parts) > 1 and None not in devs and len(set(devs)) == len(devs)
            if self.sharded(self.shape_of(k)) and (self.m.threshold is not None or one_each):
                stacked.setdefault(self.dtype_of(k), []).append(k)
        most = max((len(ks) for ks in stacked.values()), default=0)
        if most >= 2:
            event("push: 2+ sharded keys reduce-scattered together")
        elif most == 1:
            event("push: 1 sharded key reduce-scattered")

    def updating(self):
        """Where pushes run: optax's Adam mixes a float with an int32 step count, which strict
        dtype promotion (if the suite turns it on) refuses; every other updater runs strict."""
        if self.m.updater == "adam":
            return jax.numpy_dtype_promotion("standard")
        return contextlib.nullcontext()

    def apply_push(self, push: Push) -> None:
        by_key = push.by_key()
        if self.m.optimizer is not None:
            self.tolerant = True
            new = self.m.group_of(next(iter(by_key))) is None
            event(f"push: an {self.m.optimizer} step ({'new' if new else 'existing'} group)")
            if len(by_key) > 1:
                event("push: an optimizer step of 2+ keys")
        self.m.push({k: [(p.dev, p.x) for p in parts] for k, parts in by_key.items()})
        if self.m.threshold is not None:
            event("push: 2-bit compressed")
        for dt in {self.dtype_of(k) for k in push.by_key()}:
            event(f"push: a {dt.name} key")

    def check_parts(self, push: Push, what: str) -> None:
        for p in push.parts:
            _same(p.handle, p.x, p.dtype, f"a pushed value after {what}")
            self.watch(p.handle)

    # -- rules -----------------------------------------------------------------------------
    @initialize(data=st.data())
    def start(self, data):
        """One configuration per run (see the module doc), then a first init."""
        self.store_type, self.threshold = data.draw(st.sampled_from(STORES), label="store")
        self.bound = data.draw(st.sampled_from(BOUNDS), label="bound")
        self.layout = os.environ.get("JAXKV_LAYOUT") or data.draw(
            st.sampled_from(["auto", "flat", "keys"]), label="layout"
        )
        self.family = data.draw(st.sampled_from(["plain", "plain", "sgd", "adam"]), label="opt")
        if self.family == "plain":
            self.dtypes = data.draw(st.sampled_from(DTYPE_POOLS), label="dtypes")
        else:
            self.dtypes = [F32]
        self.grid = 0.5 if self.threshold == 0.5 else 1.0  # values are multiples of this
        self.kind = data.draw(st.sampled_from(["int", "str"]), label="key kind")
        event(f"config: {self.store_type} store")
        event(f"config: bound {self.bound or DEFAULT_BOUND}")
        event(f"config: {self.family}")
        event(f"config: 2-bit threshold {self.threshold}")
        for dt in self.dtypes:
            event(f"config: {dt.name} keys")
        self.kv = self.new_store()
        if self.family != "plain" and data.draw(st.integers(0, 3)):
            self.set_optimizer()
        # With the low bound, half the runs start with sharded keys only, of one dtype.
        sharded = self.bound == 16 and data.draw(st.booleans())
        self.init_keys(data, least=2, most=4, sharded=sharded)
        if self.threshold is not None and data.draw(st.integers(0, 3)):
            self.set_compression(data)  # refused if an int32 key was made

    @precondition(lambda self: len(self.m.keys) < 4)
    @rule(data=st.data())
    def init(self, data):
        self.init_keys(data, least=1, most=2)

    def init_keys(self, data, least: int, most: int, sharded: bool = False) -> None:
        """``init`` of ``least`` to ``most`` new keys: one alone, or a list; with ``sharded``,
        of shapes stored sharded (with the low bound) and the run's first dtype."""
        fresh = [k for k in KEYS[self.kind] if k not in self.m.keys]
        as_list = least > 1 or data.draw(st.booleans())
        ks = data.draw(
            st.lists(
                st.sampled_from(fresh),
                min_size=least,
                max_size=most if as_list else 1,
                unique=True,
            )
        )
        parts = []
        for _ in ks:
            if sharded:
                shape, dtype = data.draw(st.sampled_from(SHARDED_SHAPES)), self.dtypes[0]
            else:
                shape, dtype = (
                    data.draw(st.sampled_from(SHAPES)),
                    data.draw(st.sampled_from(self.dtypes)),
                )
            part = self.draw_part(data, shape, dtype)
            part.make()
            parts.append(part)
        handles = [p.handle for p in parts]
        if as_list:
            call = lambda: self.kv.init(ks, handles)
        else:
            call = lambda: self.kv.init(ks[0], handles[0])
        if self.m.threshold is not None and not all(is_float(p.dtype) for p in parts):
            event("refused: init of an int32 key into a compressed store")
            self.refused(call)
            return
        call()
        for k, p in zip(ks, parts):
            self.m.init(k, p.x, p.dtype)
            self.watch(p.handle)
            if self.sharded(p.x.shape):
                event("init: a sharded key")

    def draw_any_push(self, data, taken: bool = False) -> Push:
        """Half the time the data-parallel pattern, else anything MXNet accepts (with
        ``taken``, and an optimizer: of keys it takes)."""
        if data.draw(st.booleans()):
            return self.draw_device_push(data, taken)
        return self.draw_push(data, taken)

    @precondition(lambda self: self.m.keys)
    @rule(data=st.data())
    def push(self, data):
        self.run_push(self.draw_any_push(data))

    @precondition(lambda self: self.m.optimizer is not None and self.m.keys)
    @rule(data=st.data())
    def optimizer_step(self, data):
        """A push with the optimizer of keys it takes (one group, or keys without state), as a
        training loop pushes: so that optimizer steps stay frequent beside the other rules
        that optimizer runs have."""
        self.run_push(self.draw_any_push(data, taken=True))

    @precondition(lambda self: self.m.keys)
    @rule()
    def push_every_key(self):
        """A training step: every key pushed from every device, with a fixed pattern of values
        that differs per element, device and key. Hypothesis puts the rules without arguments
        first, and runs the first one most often: this is the one to run most. With an
        optimizer whose groups are not the whole key set, one group (or the keys without
        state) in turn, so that the push is taken."""
        ks = self.known
        if self.m.optimizer is not None and self.m.optax_refusal(ks):
            sets = self.m.push_sets()
            ks = list(sets[self.steps % len(sets)])
        entries = []
        for j, k in enumerate(ks):
            shape, dtype = self.shape_of(k), self.dtype_of(k)
            base = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
            parts = [Part("array", d, dtype, (base + d + 3 * j) % 5 - 2) for d in range(NDEV)]
            entries.append((k, False, parts))
        self.run_push(self.checked_push(Push(ks, entries)))

    def run_push(self, push: Push) -> None:
        if push.skipped:
            event("push: left out (its result would not be exact)")
            return
        if push.refused:
            event(f"refused: {push.refused}")
            self.refused(lambda: self.kv.push(push.keys, push.values))
            return
        self.note_push(push)
        with self.updating():
            self.kv.push(push.keys, push.values)
            if self.m.updater == "adam":  # a held push runs at the next read: for Adam, here,
                nd.waitall()  # where its implicit cast may run (see updating)
        self.apply_push(push)
        self.check_parts(push, "the push")

    @precondition(lambda self: self.m.keys)
    @rule(data=st.data())
    def pull(self, data):
        keys, entries = self.draw_keys(data, self.known)
        if data.draw(st.booleans()):
            self.check_returned(keys, entries, self.kv.pull(keys))
            return
        drawn = [self.draw_outs(data, self.shape_of(k), self.dtype_of(k)) for k in entries]
        outs = [o for o, _ in drawn]
        assert self.kv.pull(keys, out=outs if isinstance(keys, list) else outs[0]) is None
        if sum(self.sharded(self.shape_of(k)) for k in set(entries)) >= 2:
            event("pull: 2+ sharded keys into outs")
        self.check_outs(entries, [hs for _, hs in drawn])

    @precondition(lambda self: self.m.keys)
    @rule(data=st.data())
    def pushpull(self, data):
        self.run_pushpull(data, self.draw_any_push(data))

    def run_pushpull(self, data, push: Push) -> None:
        if push.skipped:
            return
        keys, values = push.keys, push.values
        entries = keys if isinstance(keys, list) else [keys]
        with_out = data.draw(st.booleans())
        if with_out:
            drawn = [self.draw_outs(data, self.shape_of(k), self.dtype_of(k)) for k in entries]
            outs = [o for o, _ in drawn]
            out = outs if isinstance(keys, list) else outs[0]
            if push.refused:
                event(f"refused: {push.refused}")
                self.refused(lambda: self.kv.pushpull(keys, values, out=out), [h for _, h in drawn])
                return
            self.note_push(push)
            with self.updating():
                assert self.kv.pushpull(keys, values, out=out) is None
            self.apply_push(push)
            self.check_outs(entries, [hs for _, hs in drawn])
            self.check_parts(push, "pushpull with out")
            return
        in_place = all(isinstance(p.handle, nd.NDArray) for p in push.parts)
        if push.refused:
            event(f"refused: {push.refused}")
            outs = [(p.handle, p.dev, p.x, p.dtype) for p in push.parts] if in_place else []
            self.refused(lambda: self.kv.pushpull(keys, values), [outs])
            return
        self.note_push(push)
        with self.updating():
            result = self.kv.pushpull(keys, values)
        self.apply_push(push)
        if in_place:
            # The pulled value is written into the value handles themselves, in their dtype.
            assert result is None
            for k, _, parts in push.entries:
                for p in parts:
                    before = jaxkv.cpu(p.dev)
                    want = self.m.keys[k].value
                    self.same(p.handle, want, p.dtype, f"value handle of key {k!r} after pushpull")
                    assert p.handle.context == before
                    self.watch(p.handle)
        else:
            self.check_returned(keys, entries, result)
            self.check_parts(push, "pushpull")

    @rule(name=st.sampled_from(PLAIN_UPDATERS))
    def set_updater(self, name):
        self.kv.set_updater(UPDATERS[name])
        self.m.updater = name

    @precondition(lambda self: self.family != "plain")
    @rule()
    def set_optimizer(self):
        """``set_optimizer``: after another updater every group goes; again, nothing changes."""
        again = self.m.optimizer is not None
        self.kv.set_optimizer(OPTIMIZERS[self.family])
        self.m.set_optimizer(self.family)
        event(f"set_optimizer: {self.family}{' again' if again else ''}")

    def promotion(self):
        """Where optax runs outside a push: standard dtype promotion for Adam (see
        :meth:`updating`)."""
        if self.family == "adam":
            return jax.numpy_dtype_promotion("standard")
        return contextlib.nullcontext()

    @precondition(lambda self: self.family != "plain" and self.m.keys)
    @rule(data=st.data())
    def init_optimizer(self, data):
        """``jaxkv.init_optimizer`` on ``kv.state`` (every key, or some), the result set back:
        the keys become one group of fresh state; a group reaching beyond them is refused."""
        how = data.draw(st.sampled_from(["all", "all", "groups", "any"]))
        if how == "all":
            keys = data.draw(st.sampled_from([None, self.known]))
            ks = self.known
        elif how == "groups":  # whole groups and keys without state: taken
            units = [list(g) for g in self.m.groups] + [[k] for k in self.m.ungrouped()]
            picked = data.draw(st.lists(st.sampled_from(units), min_size=1, unique_by=tuple))
            keys = ks = [k for u in picked for k in u]
        else:
            keys = ks = data.draw(
                st.lists(st.sampled_from(self.known), min_size=1, max_size=4, unique=True)
            )
        if len(ks) == 1 and data.draw(st.booleans()):
            keys = ks[0]
        state, tx = self.kv.state, OPTIMIZERS[self.family]
        groups = list(state.opt_states)
        with self.promotion():
            why = self.m.init_optimizer(self.family, ks)
            if why is not None:
                event(f"refused: init_optimizer of {why}")
                try:
                    jaxkv.init_optimizer(state, tx, keys)
                except jaxkv.KVStoreError:
                    pass
                else:
                    raise AssertionError("expected jaxkv.KVStoreError, init_optimizer accepted")
                assert list(state.opt_states) == groups
                return
            new = jaxkv.init_optimizer(state, tx, keys)
        assert list(state.opt_states) == groups  # the given state is unchanged
        self.check_opt_states(new)
        for k in self.known:
            self.same(new[k], self.m.keys[k].value, self.dtype_of(k), f"key {k!r} after it")
        self.kv.state = new
        event(f"init_optimizer: {'every key' if ks == self.known else 'some keys'}")

    @precondition(lambda self: self.threshold is not None)
    @rule(data=st.data())
    def set_compression(self, data):
        """2-bit compression with the run's threshold (residuals start at zero), or none."""
        off = data.draw(st.integers(0, 4)) == 0
        params = {"type": "none"} if off else {"type": "2bit", "threshold": self.threshold}
        if not off and not all(is_float(km.dtype) for km in self.m.keys.values()):
            event("refused: compression of a store holding int32 keys")
            self.refused(lambda: self.kv.set_gradient_compression(params))
            return
        self.kv.set_gradient_compression(params)
        self.m.set_compression(None if off else self.threshold)
        event(f"set_gradient_compression: {params['type']}")

    @rule(data=st.data())
    def broadcast(self, data):
        """``broadcast``: init of new keys, then a pull of them into ``out``."""
        fresh = [k for k in KEYS[self.kind] if k not in self.m.keys]
        how = data.draw(st.sampled_from(["ok", "ok", "duplicate", "wrong out"]))
        if how == "duplicate" and not self.m.keys:
            how = "ok"
        if not fresh:  # every key is taken: only a refused broadcast is left
            how = "duplicate"
        ks = []
        if fresh:
            ks = data.draw(st.lists(st.sampled_from(fresh), min_size=1, max_size=2, unique=True))
        if how == "duplicate":
            ks.insert(data.draw(st.integers(0, len(ks))), data.draw(st.sampled_from(self.known)))
        parts, drawn = [], []
        for k in ks:
            if k in self.m.keys:
                shape = self.shape_of(k)
                dtype = self.dtype_of(k)
            else:
                shape = data.draw(st.sampled_from(SHAPES))
                dtype = data.draw(st.sampled_from(self.dtypes))
            part = self.draw_part(data, shape, dtype)
            part.make()
            parts.append(part)
            drawn.append(self.draw_outs(data, shape, part.dtype))
        if how == "wrong out":
            i = data.draw(st.integers(0, len(ks) - 1))
            shape = data.draw(st.sampled_from([s for s in WRONG_SHAPES if s != parts[i].x.shape]))
            drawn[i] = self.draw_outs(data, shape, F32)
        single = len(ks) == 1 and data.draw(st.booleans())
        keys = ks[0] if single else ks
        values = parts[0].handle if single else [p.handle for p in parts]
        outs = drawn[0][0] if single else [o for o, _ in drawn]
        call = lambda: self.kv.broadcast(keys, values, out=outs)
        ints = self.m.threshold is not None and not all(is_float(p.dtype) for p in parts)
        if how != "ok" or ints:
            event(f"refused: broadcast ({'int32 into compression' if ints else how})")
            self.refused(call, [hs for _, hs in drawn])
            return
        call()
        for k, p in zip(ks, parts):
            self.m.init(k, p.x, p.dtype)
        self.check_outs(ks, [hs for _, hs in drawn])
        event("broadcast")

    @precondition(lambda self: self.m.keys)
    @rule(data=st.data())
    def row_sparse_pull(self, data):
        """``row_sparse_pull`` with and without ``out``; row ids out of range are refused."""
        keys, entries = self.draw_keys(data, self.known)
        entries = entries[:2]
        keys = entries if isinstance(keys, list) else entries[0]
        bad = False

        def draw_ids(rows):
            nonlocal bad
            ids = data.draw(st.lists(st.integers(0, max(rows - 1, 0)), max_size=4))
            form = data.draw(st.sampled_from(["nd", "nd int32", "numpy", "jax"]))
            wrong = data.draw(st.sampled_from([None] * 6 + ["negative", "too big", "fraction"]))
            if wrong is not None or rows == 0:
                bad = True
                if wrong == "fraction" and form in ("nd", "numpy"):
                    bad_id = 0.5
                elif wrong == "too big":
                    bad_id = rows + data.draw(st.integers(0, 3))
                else:
                    bad_id = -data.draw(st.integers(1, max(rows, 1)))
                ids.insert(data.draw(st.integers(0, len(ids))), bad_id)
                event(f"refused: row_sparse_pull with a {wrong or 'negative'} row id")
            if form == "nd":
                arr = nd.array(ids)
            elif form == "nd int32":
                arr = nd.array(ids, dtype=I32)
            elif form == "numpy":
                arr = np.array(ids)
            else:
                arr = jnp.asarray(ids)
            return arr, sorted({int(i) for i in ids if not bad})

        def rows_of(k):
            shape = self.shape_of(k)
            if not shape:
                nonlocal bad
                bad = True
                event("refused: row_sparse_pull of a scalar")
            return shape[0] if shape else 0

        if data.draw(st.booleans()):  # without out
            ids = [draw_ids(rows_of(k)) for k in entries]
            row_ids = [a for a, _ in ids] if isinstance(keys, list) else ids[0][0]
            call = lambda: self.kv.row_sparse_pull(keys, row_ids=row_ids)
            if bad:
                self.refused(call)
                return
            self.check_returned(keys, entries, call(), rows=[r for _, r in ids])
            event("row_sparse_pull")
            return
        drawn = [self.draw_outs(data, self.shape_of(k), self.dtype_of(k)) for k in entries]
        outs = [o for o, _ in drawn]
        out = outs if isinstance(keys, list) else outs[0]
        n = sum(len(hs) for _, hs in drawn)
        if data.draw(st.booleans()):  # one row_ids for every out
            arr, rows = draw_ids(min(rows_of(k) for k in entries))
            row_ids, per_out = arr, [[rows] * len(hs) for _, hs in drawn]
        else:
            per_key = [[draw_ids(rows_of(k)) for _ in hs] for k, (_, hs) in zip(entries, drawn)]
            row_ids = [a for ids in per_key for a, _ in ids]
            per_out = [[r for _, r in ids] for ids in per_key]
        assert n == sum(len(r) for r in per_out)
        call = lambda: self.kv.row_sparse_pull(keys, out=out, row_ids=row_ids)
        if bad:
            self.refused(call, [hs for _, hs in drawn])
            return
        assert call() is None
        self.check_outs(entries, [hs for _, hs in drawn], rows=per_out)
        event("row_sparse_pull into outs")

    @precondition(lambda self: self.m.keys)
    @rule(keep=st.booleans())
    def hand_off(self, keep):
        """``kv.state``: the store's whole state, as the model has it (values, where they
        live, optimizer states, compression and residuals); kept and watched afterwards, or
        dropped at once (the store may then donate its arrays again)."""
        state = self.kv.state
        assert isinstance(state, jaxkv.KVState)
        assert list(state.keys()) == self.known
        t = self.m.threshold
        assert state.compression == (None if t is None else ("2bit", t))
        for k, km in self.m.keys.items():
            shape, value = km.value.shape, state[k]
            assert value.dtype == km.dtype
            assert state.is_sharded(shape) == self.sharded(shape), (k, shape, self.bound)
            if self.sharded(shape):
                event("hand-off: a sharded key")
                block = value.addressable_shards[0].data.shape
                assert block == (shape[0] // NDEV, *shape[1:]), (k, block)
            if t is None:
                assert state.residuals[k] is None
            else:
                r = np.asarray(state.residuals[k]).reshape(NDEV, *shape)
                _same(r, km.residual, km.dtype, f"residuals of key {k!r}")
            if keep:
                self.keep_pulled(jaxkv.pull(state, k))
        self.check_opt_states(state)
        if not keep:
            return
        held = {k: np.asarray(v) for k, v in zip(self.known, jaxkv.pull(state, self.known))}
        self.states.append((state, self.m.snapshot(), held))
        del self.states[:-2]

    def check_opt_states(self, state: jaxkv.KVState) -> None:
        """``state`` holds the model's optimizer groups (sorted tuples of keys) and, for each,
        the state of optax run by hand on the group's tree."""
        groups = state.opt_states
        assert sorted(groups) == sorted(self.m.groups), (list(groups), list(self.m.groups))
        for k in self.known:
            assert state.opt_group(k) == self.m.group_of(k), (k, state.opt_group(k))
        for g, want in self.m.groups.items():
            assert list(g) == sorted(g), g
            got = groups[g]
            assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want), g
            for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
                _same(a, np.asarray(b, np.float64), b.dtype, f"opt state of group {g}", True)
            if len(g) > 1:
                event("opt states: a group of 2+ keys")
        if len(groups) > 1:
            event("opt states: 2+ groups")

    @precondition(lambda self: self.states)
    @rule(data=st.data())
    def set_state(self, data):
        """``kv.state = earlier_state``: the store continues from it, with its own updater."""
        state, snap, _ = data.draw(st.sampled_from(self.states))
        self.kv.state = state
        self.m.restore(snap)
        event("state: set back to an earlier kv.state")

    @precondition(lambda self: self.m.keys)
    @rule()
    def save(self):
        path = os.path.join(self.tmp, f"store{self.saves}.npz")
        self.saves += 1
        self.kv.save(path)
        self.saved = (path, self.m.snapshot())

    @precondition(lambda self: self.saved is not None)
    @rule(fresh=st.booleans())
    def load(self, fresh):
        """``load`` into this store or a fresh one of the same configuration and updater."""
        path, snap = self.saved
        target = self.kv
        if fresh:
            target = self.new_store()
            if self.m.optimizer is not None:
                target.set_optimizer(OPTIMIZERS[self.m.optimizer])
            else:
                target.set_updater(UPDATERS[self.m.updater])
        if self.m.optimizer is None and snap.groups:
            # The file holds optimizer states; a store without an optimizer cannot take them.
            event("refused: load of optimizer states into a store without an optimizer")
            self.refused(lambda: target.load(path))
            assert target.keys() == ([] if fresh else self.known)
            return
        target.load(path)
        self.kv = target
        self.m.restore(snap)
        event(f"load: into a {'fresh' if fresh else 'the same'} store")

    @precondition(lambda self: self.family != "plain" and self.m.keys)
    @rule(data=st.data())
    def optimizer_states_file(self, data):
        """``save_optimizer_states``, or ``load_optimizer_states`` of the last such file: both
        need an optimizer, and the load the file's keys (those of its groups of the shapes
        saved); the file's groups replace the store's, values and residuals stay."""
        shapes = {k: km.value.shape for k, km in self.m.keys.items()}
        if self.saved_opt is None or data.draw(st.booleans()):
            path = os.path.join(self.tmp, f"opt{self.saves}.npz")
            self.saves += 1
            if self.m.optimizer is None:
                event("refused: save_optimizer_states without an optimizer")
                self.refused(lambda: self.kv.save_optimizer_states(path))
                return
            self.kv.save_optimizer_states(path)
            self.saved_opt = (path, dict(self.m.groups), shapes)
            event("save_optimizer_states")
            return
        path, groups, saved = self.saved_opt
        why = None
        if self.m.optimizer is None:
            why = "into a store without an optimizer"
        elif set(saved) != set(shapes):
            why = "of other keys"
        elif any(saved[k] != shapes[k] for g in groups for k in g):
            why = "of keys of other shapes"
        if why is not None:
            event(f"refused: load_optimizer_states {why}")
            self.refused(lambda: self.kv.load_optimizer_states(path))
            return
        self.kv.load_optimizer_states(path)
        self.m.groups = dict(groups)
        event("load_optimizer_states")

    # -- refusals --------------------------------------------------------------------------
    @precondition(lambda self: self.m.keys)
    @rule(data=st.data())
    def refuse(self, data):
        """A call the store must refuse: it raises KVStoreError and changes nothing."""
        what = data.draw(
            st.sampled_from(
                [
                    self.refuse_unknown_key,
                    self.refuse_duplicate_init,
                    self.refuse_wrong_shape_push,
                    self.refuse_wrong_shape_out,
                    self.refuse_wrong_shape_pushpull_out,
                    self.refuse_mixed_kinds,
                ]
            )
        )
        what(data)

    def refuse_unknown_key(self, data):
        unknown = [k for k in KEYS[self.kind] if k not in self.m.keys] + [NEVER[self.kind]]
        bad = data.draw(st.sampled_from(unknown))
        op = data.draw(st.sampled_from(["push", "pull", "pull_out", "pushpull"]))
        shape = data.draw(st.sampled_from(SHAPES))
        # Alone, or in a list among known keys (which must not be touched either).
        push = self.draw_push(data)
        keys, values = push.keys, push.values
        if not isinstance(keys, list):
            keys, values = [keys], [values]
        at = data.draw(st.integers(0, len(keys)))
        extra = self.draw_part(data, shape, F32)
        extra.make()
        keys = keys[:at] + [bad] + keys[at:]
        values = values[:at] + [extra.handle] + values[at:]
        if len(keys) == 1 and data.draw(st.booleans()):
            keys, values = keys[0], values[0]
        if op == "push":
            self.refused(lambda: self.kv.push(keys, values))
        elif op == "pushpull":
            self.refused(lambda: self.kv.pushpull(keys, values))
        elif op == "pull":
            self.refused(lambda: self.kv.pull(keys))
        else:
            entries = keys if isinstance(keys, list) else [keys]
            drawn = [
                self.draw_outs(data, self.shape_of(k) if k in self.m.keys else shape, F32)
                for k in entries
            ]
            outs = [o for o, _ in drawn]
            out = outs if isinstance(keys, list) else outs[0]
            self.refused(lambda: self.kv.pull(keys, out=out), [hs for _, hs in drawn])

    def refuse_duplicate_init(self, data):
        old = data.draw(st.sampled_from(self.known))
        fresh = [k for k in KEYS[self.kind] if k not in self.m.keys]
        ks = [old]
        if fresh and data.draw(st.booleans()):  # a new key in the same call must not be added
            ks.insert(data.draw(st.integers(0, 1)), data.draw(st.sampled_from(fresh)))
        elif data.draw(st.booleans()):  # the same key twice in one call
            ks = [old, old]
        vals = []
        for k in ks:
            shape = self.shape_of(k) if k in self.m.keys else SHAPES[0]
            part = self.draw_part(data, shape, F32)
            part.make()
            vals.append(part.handle)
        if len(ks) == 1 and data.draw(st.booleans()):
            self.refused(lambda: self.kv.init(old, vals[0]))
        else:
            self.refused(lambda: self.kv.init(ks, vals))

    def with_wrong_shape(self, data, push: Push) -> tuple[Any, Any]:
        """The push's keys and values with one array (or one device's array) misshapen."""
        keys, values = push.keys, push.values
        if not isinstance(keys, list):
            keys, values = [keys], [values]
        i = data.draw(st.integers(0, len(keys) - 1))
        shape = data.draw(st.sampled_from([s for s in WRONG_SHAPES if s != self.shape_of(keys[i])]))
        bad = self.draw_part(data, shape, F32, allow_pulled=False)
        bad.make()
        if isinstance(values[i], list):  # one device's value is wrong, the others are fine
            values[i] = list(values[i])
            values[i][data.draw(st.integers(0, len(values[i]) - 1))] = bad.handle
        else:
            values[i] = bad.handle
        if len(keys) == 1 and data.draw(st.booleans()):
            return keys[0], values[0]
        return keys, values

    def refuse_wrong_shape_push(self, data):
        keys, values = self.with_wrong_shape(data, self.draw_push(data))
        if data.draw(st.booleans()):
            self.refused(lambda: self.kv.push(keys, values))
        else:
            self.refused(lambda: self.kv.pushpull(keys, values))

    def refuse_wrong_shape_out(self, data):
        keys, entries = self.draw_keys(data, self.known)
        drawn = [self.draw_outs(data, self.shape_of(k), self.dtype_of(k)) for k in entries]
        i = data.draw(st.integers(0, len(entries) - 1))
        shape = data.draw(
            st.sampled_from([s for s in WRONG_SHAPES if s != self.shape_of(entries[i])])
        )
        drawn[i] = self.draw_outs(data, shape, F32)
        outs = [o for o, _ in drawn]
        out = outs if isinstance(keys, list) else outs[0]
        self.refused(lambda: self.kv.pull(keys, out=out), [hs for _, hs in drawn])

    def refuse_wrong_shape_pushpull_out(self, data):
        """pushpull into a wrong-shaped out is refused, and (as every KVStoreError promises)
        changes nothing: the push must not happen either."""
        push = self.draw_push(data)
        keys, values = push.keys, push.values
        entries = keys if isinstance(keys, list) else [keys]
        drawn = [self.draw_outs(data, self.shape_of(k), self.dtype_of(k)) for k in entries]
        i = data.draw(st.integers(0, len(entries) - 1))
        shape = data.draw(
            st.sampled_from([s for s in WRONG_SHAPES if s != self.shape_of(entries[i])])
        )
        drawn[i] = self.draw_outs(data, shape, F32)
        outs = [o for o, _ in drawn]
        out = outs if isinstance(keys, list) else outs[0]
        self.refused(lambda: self.kv.pushpull(keys, values, out=out), [hs for _, hs in drawn])

    def refuse_mixed_kinds(self, data):
        other = "str" if self.kind == "int" else "int"
        foreign = data.draw(st.sampled_from(KEYS[other]))
        op = data.draw(st.sampled_from(["init", "push", "pull", "pull_out", "pushpull"]))
        own = data.draw(st.sampled_from(self.known))
        shape = self.shape_of(own)
        alone = data.draw(st.booleans())
        keys = [foreign] if alone else data.draw(st.permutations([own, foreign]))
        if op == "init":
            fresh = [k for k in KEYS[self.kind] if k not in self.m.keys]
            if not alone and fresh:  # both keys new, of different kinds
                keys = [fresh[0] if k == own else k for k in keys]
            vals = [nd.ones(shape, jaxkv.cpu(0)) for _ in keys]
            self.refused(lambda: self.kv.init(keys, vals))
        elif op in ("push", "pushpull"):
            vals = []
            for _ in keys:
                part = self.draw_part(data, shape, self.dtype_of(own), allow_pulled=False)
                part.make()
                vals.append(part.handle)
            fn = self.kv.push if op == "push" else self.kv.pushpull
            if alone:
                self.refused(lambda: fn(foreign, vals[0]))
            else:
                self.refused(lambda: fn(keys, vals))
        elif op == "pull":
            self.refused(lambda: self.kv.pull(foreign if alone else keys))
        else:
            drawn = [self.draw_outs(data, shape, self.dtype_of(own)) for _ in keys]
            outs = [o for o, _ in drawn]
            out = outs[0] if alone else outs
            self.refused(
                lambda: self.kv.pull(foreign if alone else keys, out=out), [hs for _, hs in drawn]
            )

    @rule(data=st.data())
    def refuse_settings(self, data):
        """Compression a store cannot take (any on ``local``, as MXNet; of int32 values), a
        compressed push of a value that spans several devices, a non-optax optimizer, a state
        that is not a KVState: refused, and nothing changes."""
        what = data.draw(
            st.sampled_from(
                ["compression", "int32", "int32", "spread", "optimizer", "state", "lossy"]
            )
        )
        fresh = [k for k in KEYS[self.kind] if k not in self.m.keys] + [NEVER[self.kind]]
        ints = [k for k, km in self.m.keys.items() if not is_float(km.dtype)]
        if what == "int32" and self.m.threshold is not None:
            # Only floating-point values are compressed (as MXNet): an int32 key is refused,
            # and so is a list holding one (its float key is not added either).
            ks = data.draw(st.permutations(fresh))[:2]
            vals = [nd.ones((4,), jaxkv.cpu(0), dtype=I32)] + [nd.ones((4,))] * (len(ks) - 1)
            event("refused: init of an int32 key into a compressed store")
            self.refused(lambda: self.kv.init(ks, vals))
        elif what == "spread" and self.m.threshold is not None and self.m.keys:
            # Residuals belong to devices: a value on several devices has no one residual.
            k = data.draw(st.sampled_from(self.known))
            x = np.ones(self.shape_of(k), self.dtype_of(k))
            spread = jax.device_put(
                x, jax.sharding.NamedSharding(MESH, jax.sharding.PartitionSpec())
            )
            value = data.draw(st.sampled_from([spread, [nd.ones(x.shape, jaxkv.cpu(1)), spread]]))
            event("refused: compressed push of a value on several devices")
            self.refused(lambda: self.kv.push(k, value))
        elif what in ("int32", "spread") and self.store_type == "device":
            event("refused: compression of a store holding int32 keys")
            params = {"type": "2bit", "threshold": self.threshold or 0.5}
            if ints:
                self.refused(lambda: self.kv.set_gradient_compression(params))
            else:  # on a store of this configuration that holds one
                other = self.new_store()
                other.init([0, 1], [nd.ones((4,)), nd.full((2, 3), 3, dtype=I32)])
                try:
                    other.set_gradient_compression(params)
                except jaxkv.KVStoreError:
                    pass
                else:
                    raise AssertionError("compression of int32 values was accepted")
                assert other.state.compression is None
                _same(other.pull(1), np.full((2, 3), 3), I32, "an int32 value")
        elif what == "lossy" and self.m.keys:
            # A value whose dtype the key's cannot hold without loss (a float into an int32
            # key, float32 into float16) is refused, not cast.
            k = data.draw(st.sampled_from(self.known))
            stored = self.dtype_of(k)
            lossy = [d for d in (F32, I32, F16, BF16) if d != stored and not _widens(d, stored)]
            dt = data.draw(st.sampled_from(lossy))
            event("refused: a push of a dtype the key cannot hold")
            self.refused(lambda: self.kv.push(k, nd.ones(self.shape_of(k), dtype=dt)))
        elif what == "optimizer":
            self.refused(lambda: self.kv.set_optimizer("sgd"))
        elif what == "state":
            self.refused(lambda: setattr(self.kv, "state", {"w": jnp.zeros(2)}))
        elif self.store_type == "local":
            params = data.draw(
                st.sampled_from([{"type": "2bit", "threshold": 0.5}, {"type": "2bit"}])
            )
            self.refused(lambda: self.kv.set_gradient_compression(params))
        else:
            params = data.draw(
                st.sampled_from(
                    [
                        {"type": "2bit", "threshold": 0},
                        {"type": "2bit", "threshold": -0.5},
                        {"type": "1bit", "threshold": 0.5},
                        {"type": "none", "threshold": 0.5},
                        {"type": "2bit", "threshold": 0.5, "ratio": 2},
                    ]
                )
            )
            self.refused(lambda: self.kv.set_gradient_compression(params))

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def store_matches_model(self):
        self.steps += 1
        if self.kv is not None:
            self.check_store()

    @invariant()
    def handed_arrays_untouched(self):
        """No update changes or invalidates an array the user gave or received."""
        for h, expected, dtype, ctx in self.watched:
            _same(h, expected, dtype, "an array handed to or from the store, after later calls")
            if ctx is not None:
                assert h.context == ctx

    @invariant()
    def handed_states_untouched(self):
        """A ``KVState`` read from ``kv.state`` keeps its values (and its optimizer states stay
        valid), whatever the store did since."""
        for state, _, held in self.states:
            keys = sorted(held)
            assert list(state.keys()) == keys
            for k, v in zip(keys, jaxkv.pull(state, keys)):
                _same(v, held[k], held[k].dtype, f"key {k!r} of a handed-out state")
            for leaf in jax.tree_util.tree_leaves(dict(state.opt_states)):
                assert not leaf.is_deleted(), "an optimizer state of a handed-out state"


def _keep_rows(value: np.ndarray, rows) -> np.ndarray:
    out = np.zeros_like(value)
    out[list(rows)] = value[list(rows)]
    return out


# Profiles, with every health check on. The explain phase is left out: on a failure it replays
# the machine over a thousand times (minutes) for little extra insight.
#
# The default profile (``make test``) is derandomized: the same 150 runs of up to 30 steps every
# time, about a minute on two busy cores; a failure takes seconds to show and up to a minute or
# two to shrink. Its runs are derived from the source of KVStoreMachine, so any edit of the
# class changes them: after one, check with ``--hypothesis-show-statistics`` that every
# ``config:``, ``push:``, ``refused:`` and rule event in the class still shows up.
#
# ``deep`` (``make test-deep``): 2000 random runs of up to 50 steps, about 45 s per 100 runs on
# two busy cores (some 15 minutes); failures are kept in Hypothesis's example database and
# replayed first next time.
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
settings.register_profile(
    "jaxkv-stateful",
    max_examples=100,
    stateful_step_count=30,
    derandomize=True,
    database=None,
    deadline=None,
    phases=_PHASES,
)
settings.register_profile(
    "deep",
    max_examples=2000,
    stateful_step_count=50,
    deadline=None,
    phases=_PHASES,
)
_profile = settings.get_profile(
    "deep" if os.environ.get("HYPOTHESIS_PROFILE") == "deep" else "jaxkv-stateful"
)
if os.environ.get("HYPOTHESIS_MAX_EXAMPLES"):
    _profile = settings(_profile, max_examples=int(os.environ["HYPOTHESIS_MAX_EXAMPLES"]))
KVStoreMachine.TestCase.settings = _profile
TestKVStore = KVStoreMachine.TestCase
