"""A stateful property test of the imperative ``KVStore`` against a plain NumPy model.

Hypothesis drives one ``jaxkv.create('local')`` store with random sequences of ``init``,
``push``, ``pull``, ``pushpull`` and ``set_updater`` (assign, a pure ``stored + pushed``
updater, and an MXNet in-place ``stored += inp * 2`` updater), and with calls that must be
refused. The model follows MXNet: a push sums every value given for a key in the call
(duplicate keys and per-device lists alike), then the updater runs once per distinct key
(assign by default); a pull fills every ``out`` with the stored value on the out's own device;
``pushpull(k, v)`` without ``out`` writes the pulled value into the value handles themselves.

Every pulled value is compared exactly (the data are small integers in float32, so every sum
is exact in any order). Every refusal must raise ``jaxkv.KVStoreError`` and leave the store,
and every ``out`` it was given, exactly as before. Arrays handed to or received from the store
(init and push values, pulled arrays) are watched for a while afterwards: a later update must
never change or invalidate them.

One kind of key (int or str) per run; mixing the kinds is refused. To keep compilation cheap,
keys come from four per kind, shapes from two, the dtype is float32, and the updaters are the
same module-level functions in every run.
"""

from __future__ import annotations

import jax
import numpy as np
from hypothesis import HealthCheck, Phase, settings
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

SHAPES = [(2, 3), (4,)]
WRONG_SHAPES = [(3, 2), (4,), (2, 3), (6,)]
KEYS = {"int": [0, 1, 2, 3], "str": ["a", "b", "c", "d"]}
NEVER = {"int": 9, "str": "z"}  # a key of the run's kind that is never initialised
NDEV = 8
WATCH = 10  # how many handed-over arrays stay watched


def add_updater(key, pushed, stored):
    """A pure updater: returns the new stored value."""
    return stored + pushed


def inplace_updater(key, inp, stored):
    """MXNet's in-place style: mutates ``stored`` and returns None."""
    stored += inp * 2


UPDATERS = {"assign": None, "add": add_updater, "inplace": inplace_updater}


def _apply(name: str, pushed: np.ndarray, stored: np.ndarray) -> np.ndarray:
    if name == "assign":
        return pushed.copy()
    if name == "add":
        return stored + pushed
    return stored + pushed * 2


def _np(x) -> np.ndarray:
    return x.asnumpy() if isinstance(x, nd.NDArray) else np.asarray(x)


def _eq(actual, expected: np.ndarray, what: str) -> None:
    got = _np(actual)
    assert got.dtype == np.float32, f"{what}: dtype {got.dtype}"
    np.testing.assert_array_equal(got, expected, err_msg=what)


def _small_ints(shape):
    size = int(np.prod(shape))
    return st.lists(st.integers(-3, 3), min_size=size, max_size=size).map(
        lambda xs: np.array(xs, dtype=np.float32).reshape(shape)
    )


def _device_lists(max_size: int = NDEV):
    """1..max_size device ids: all distinct (MXNet's one value per device) or with repeats."""
    distinct = st.permutations(range(NDEV)).flatmap(
        lambda p: st.integers(1, max_size).map(lambda n: list(p[:n]))
    )
    repeats = st.lists(st.integers(0, NDEV - 1), min_size=1, max_size=max_size)
    return st.one_of(distinct, repeats)


class KVStoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = jaxkv.create("local")
        self.model: dict = {}
        self.updater = "assign"
        self.kind = "int"
        self.watched: list = []  # (handle, expected, context or None)
        self.pulled: list = []  # jax.Arrays from pull(out=None), reusable as push values

    # -- helpers ---------------------------------------------------------------------------
    @property
    def known(self) -> list:
        return sorted(self.model)

    def watch(self, handle, expected: np.ndarray) -> None:
        ctx = handle.context if isinstance(handle, nd.NDArray) else None
        self.watched.append((handle, expected.copy(), ctx))
        del self.watched[:-WATCH]

    def check_store(self) -> None:
        """The store holds exactly the model: same keys, same values."""
        assert self.kv.keys() == self.known
        if not self.model:
            return
        values = self.kv.pull(self.known)
        assert isinstance(values, list) and len(values) == len(self.model)
        for k, v in zip(self.known, values):
            assert isinstance(v, jax.Array)
            _eq(v, self.model[k], f"stored value of key {k!r}")

    def draw_array(self, data, shape, dev: int):
        """One value of ``shape`` on device ``dev``: (handle, numpy value)."""
        how = data.draw(st.sampled_from(["array", "array", "ones", "full", "jax", "pulled"]))
        if how == "pulled":
            same = [(a, e) for a, e in self.pulled if a.shape == shape]
            if same:
                return data.draw(st.sampled_from(same))
            how = "array"
        ctx = jaxkv.cpu(dev)
        if how == "ones":
            return nd.ones(shape, ctx), np.ones(shape, np.float32)
        if how == "full":
            c = data.draw(st.integers(-3, 3))
            return nd.full(shape, c, ctx), np.full(shape, c, np.float32)
        x = data.draw(_small_ints(shape))
        if how == "jax":
            return jax.device_put(x, ctx.device), x
        return nd.array(x, ctx=ctx), x

    def draw_value(self, data, shape):
        """A push value for one key: one array or a list of per-device arrays.

        Returns (value, sum of its arrays, [(handle, numpy value), ...]).
        """
        if data.draw(st.booleans()):
            h, x = self.draw_array(data, shape, data.draw(st.integers(0, NDEV - 1)))
            return h, x.copy(), [(h, x)]
        parts = [self.draw_array(data, shape, d) for d in data.draw(_device_lists())]
        total = np.zeros(shape, np.float32)
        for _, x in parts:
            total = total + x
        return [h for h, _ in parts], total, parts

    def draw_outs(self, data, shape):
        """``out`` for one key: one NDArray or a list of them, on various devices.

        Returns (out, [(handle, device id, initial numpy value), ...]).
        """
        single = data.draw(st.booleans())
        devs = [data.draw(st.integers(0, NDEV - 1))] if single else data.draw(_device_lists(4))
        handles = []
        for d in devs:
            fill = data.draw(st.sampled_from([0, -7]))
            handles.append(
                (nd.full(shape, fill, jaxkv.cpu(d)), d, np.full(shape, fill, np.float32))
            )
        out = handles[0][0] if single else [h for h, _, _ in handles]
        return out, handles

    def draw_keys(self, data, pool):
        """A single key, or a list of 1..4 keys (repeats allowed): (keys, [key, ...])."""
        if data.draw(st.booleans()):
            k = data.draw(st.sampled_from(pool))
            return k, [k]
        ks = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4))
        return ks, ks

    def draw_push(self, data):
        """Keys and values for a push: (keys, values, {key: summed}, all value parts)."""
        keys, entries = self.draw_keys(data, self.known)
        values, parts = [], []
        summed: dict = {}
        for k in entries:
            v, total, ps = self.draw_value(data, self.model[k].shape)
            values.append(v)
            parts.extend(ps)
            summed[k] = summed.get(k, 0) + total
        return keys, (values if isinstance(keys, list) else values[0]), summed, parts

    def apply_push(self, summed: dict) -> None:
        for k, total in summed.items():
            new = _apply(self.updater, np.asarray(total, np.float32), self.model[k])
            self.model[k] = new.astype(np.float32)

    def check_outs(self, entries, outs_info) -> None:
        for k, handles in zip(entries, outs_info):
            for h, d, _ in handles:
                _eq(h, self.model[k], f"out of key {k!r} on cpu({d})")
                assert h.context == jaxkv.cpu(d), f"out of key {k!r}: {h.context} != cpu({d})"
                self.watch(h, self.model[k])

    def check_returned(self, keys, entries, result) -> None:
        if isinstance(keys, list):
            assert isinstance(result, list) and len(result) == len(entries)
        else:
            result = [result]
        for k, r in zip(entries, result):
            assert isinstance(r, jax.Array), type(r)
            _eq(r, self.model[k], f"returned value of key {k!r}")
            self.watch(r, self.model[k])
            self.pulled.append((r, self.model[k].copy()))
            del self.pulled[:-4]

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
            for h, d, initial in handles:
                _eq(h, initial, f"out on cpu({d}) after a refused call")
                assert h.context == jaxkv.cpu(d)

    # -- rules -----------------------------------------------------------------------------
    @initialize(kind=st.sampled_from(["int", "str"]), data=st.data())
    def start(self, kind, data):
        """One kind of key per run, and a first init (so every other rule has keys to use)."""
        self.kind = kind
        self.init(data)

    @precondition(lambda self: len(self.model) < 4)
    @rule(data=st.data())
    def init(self, data):
        fresh = [k for k in KEYS[self.kind] if k not in self.model]
        as_list = data.draw(st.booleans())
        ks = data.draw(st.lists(st.sampled_from(fresh), min_size=1, max_size=2, unique=True))
        if not as_list:
            ks = ks[:1]
        handles = []
        for k in ks:
            shape = data.draw(st.sampled_from(SHAPES))
            h, x = self.draw_array(data, shape, data.draw(st.integers(0, NDEV - 1)))
            handles.append((k, h, x))
        if as_list:
            self.kv.init(ks, [h for _, h, _ in handles])
        else:
            self.kv.init(ks[0], handles[0][1])
        for k, h, x in handles:
            self.model[k] = x.copy()
            self.watch(h, x)

    @rule(data=st.data())
    def push(self, data):
        keys, values, summed, parts = self.draw_push(data)
        self.kv.push(keys, values)
        self.apply_push(summed)
        for h, x in parts:
            _eq(h, x, "a pushed value after the push")
            self.watch(h, x)

    @rule(data=st.data())
    def pull(self, data):
        keys, entries = self.draw_keys(data, self.known)
        if data.draw(st.booleans()):
            self.check_returned(keys, entries, self.kv.pull(keys))
            return
        drawn = [self.draw_outs(data, self.model[k].shape) for k in entries]
        outs = [o for o, _ in drawn]
        assert self.kv.pull(keys, out=outs if isinstance(keys, list) else outs[0]) is None
        self.check_outs(entries, [hs for _, hs in drawn])

    @rule(data=st.data())
    def pushpull(self, data):
        keys, values, summed, parts = self.draw_push(data)
        entries = keys if isinstance(keys, list) else [keys]
        with_out = data.draw(st.booleans())
        if with_out:
            drawn = [self.draw_outs(data, self.model[k].shape) for k in entries]
            outs = [o for o, _ in drawn]
            result = self.kv.pushpull(keys, values, out=outs if isinstance(keys, list) else outs[0])
            self.apply_push(summed)
            assert result is None
            self.check_outs(entries, [hs for _, hs in drawn])
            for h, x in parts:
                _eq(h, x, "a pushed value after pushpull with out")
            return
        result = self.kv.pushpull(keys, values)
        self.apply_push(summed)
        if all(isinstance(h, nd.NDArray) for h, _ in parts):
            # The pulled value is written into the value handles themselves.
            assert result is None
            vals = values if isinstance(keys, list) else [values]
            for k, v in zip(entries, vals):
                for h in v if isinstance(v, list) else [v]:
                    before = h.context
                    _eq(h, self.model[k], f"value handle of key {k!r} after pushpull")
                    assert h.context == before
                    self.watch(h, self.model[k])
        else:
            self.check_returned(keys, entries, result)
            for h, x in parts:
                _eq(h, x, "a pushed value after pushpull")

    @rule(name=st.sampled_from(sorted(UPDATERS)))
    def set_updater(self, name):
        self.kv.set_updater(UPDATERS[name])
        self.updater = name

    # -- refusals --------------------------------------------------------------------------
    @rule(data=st.data())
    def refuse_unknown_key(self, data):
        unknown = [k for k in KEYS[self.kind] if k not in self.model] + [NEVER[self.kind]]
        bad = data.draw(st.sampled_from(unknown))
        op = data.draw(st.sampled_from(["push", "pull", "pull_out", "pushpull"]))
        shape = data.draw(st.sampled_from(SHAPES))
        # Alone, or in a list among known keys (which must not be touched either).
        keys, values, _, _ = self.draw_push(data)
        if not isinstance(keys, list):
            keys, values = [keys], [values]
        at = data.draw(st.integers(0, len(keys)))
        keys = keys[:at] + [bad] + keys[at:]
        values = values[:at] + [self.draw_value(data, shape)[0]] + values[at:]
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
                self.draw_outs(data, self.model[k].shape if k in self.model else shape)
                for k in entries
            ]
            outs = [o for o, _ in drawn]
            out = outs if isinstance(keys, list) else outs[0]
            self.refused(lambda: self.kv.pull(keys, out=out), [hs for _, hs in drawn])

    @rule(data=st.data())
    def refuse_duplicate_init(self, data):
        old = data.draw(st.sampled_from(self.known))
        fresh = [k for k in KEYS[self.kind] if k not in self.model]
        ks = [old]
        if fresh and data.draw(st.booleans()):  # a new key in the same call must not be added
            ks.insert(data.draw(st.integers(0, 1)), data.draw(st.sampled_from(fresh)))
        elif data.draw(st.booleans()):  # the same key twice in one call
            ks = [old, old]
        vals = [
            self.draw_array(
                data,
                self.model[k].shape if k in self.model else SHAPES[0],
                data.draw(st.integers(0, NDEV - 1)),
            )[0]
            for k in ks
        ]
        if len(ks) == 1 and data.draw(st.booleans()):
            self.refused(lambda: self.kv.init(old, vals[0]))
        else:
            self.refused(lambda: self.kv.init(ks, vals))

    @rule(data=st.data())
    def refuse_wrong_shape_push(self, data):
        keys, values, _, _ = self.draw_push(data)
        if not isinstance(keys, list):
            keys, values = [keys], [values]
        i = data.draw(st.integers(0, len(keys) - 1))
        shape = data.draw(
            st.sampled_from([s for s in WRONG_SHAPES if s != self.model[keys[i]].shape])
        )
        bad = self.draw_array(data, shape, data.draw(st.integers(0, NDEV - 1)))[0]
        if isinstance(values[i], list):  # one device's value is wrong, the others are fine
            values[i] = list(values[i])
            values[i][data.draw(st.integers(0, len(values[i]) - 1))] = bad
        else:
            values[i] = bad
        if len(keys) == 1 and data.draw(st.booleans()):
            keys, values = keys[0], values[0]
        if data.draw(st.booleans()):
            self.refused(lambda: self.kv.push(keys, values))
        else:
            self.refused(lambda: self.kv.pushpull(keys, values))

    @rule(data=st.data())
    def refuse_wrong_shape_out(self, data):
        keys, entries = self.draw_keys(data, self.known)
        drawn = [self.draw_outs(data, self.model[k].shape) for k in entries]
        i = data.draw(st.integers(0, len(entries) - 1))
        shape = data.draw(
            st.sampled_from([s for s in WRONG_SHAPES if s != self.model[entries[i]].shape])
        )
        bad_out, bad_handles = self.draw_outs(data, shape)
        drawn[i] = (bad_out, bad_handles)
        outs = [o for o, _ in drawn]
        out = outs if isinstance(keys, list) else outs[0]
        self.refused(lambda: self.kv.pull(keys, out=out), [hs for _, hs in drawn])

    @rule(data=st.data())
    def refuse_wrong_shape_pushpull_out(self, data):
        """pushpull into a wrong-shaped out is refused, and (as every KVStoreError promises)
        changes nothing: the push must not happen either."""
        keys, values, _, _ = self.draw_push(data)
        entries = keys if isinstance(keys, list) else [keys]
        drawn = [self.draw_outs(data, self.model[k].shape) for k in entries]
        i = data.draw(st.integers(0, len(entries) - 1))
        shape = data.draw(
            st.sampled_from([s for s in WRONG_SHAPES if s != self.model[entries[i]].shape])
        )
        drawn[i] = self.draw_outs(data, shape)
        outs = [o for o, _ in drawn]
        out = outs if isinstance(keys, list) else outs[0]
        self.refused(lambda: self.kv.pushpull(keys, values, out=out), [hs for _, hs in drawn])

    @rule(data=st.data())
    def refuse_mixed_kinds(self, data):
        other = "str" if self.kind == "int" else "int"
        foreign = data.draw(st.sampled_from(KEYS[other]))
        op = data.draw(st.sampled_from(["init", "push", "pull", "pull_out", "pushpull"]))
        own = data.draw(st.sampled_from(self.known))
        shape = self.model[own].shape
        alone = data.draw(st.booleans())
        keys = [foreign] if alone else data.draw(st.permutations([own, foreign]))
        if op == "init":
            fresh = [k for k in KEYS[self.kind] if k not in self.model]
            if not alone and fresh:  # both keys new, of different kinds
                keys = [fresh[0] if k == own else k for k in keys]
            vals = [nd.ones(shape, jaxkv.cpu(0)) for _ in keys]
            self.refused(lambda: self.kv.init(keys, vals))
        elif op in ("push", "pushpull"):
            vals = [self.draw_value(data, shape)[0] for _ in keys]
            fn = self.kv.push if op == "push" else self.kv.pushpull
            if alone:
                self.refused(lambda: fn(foreign, vals[0]))
            else:
                self.refused(lambda: fn(keys, vals))
        elif op == "pull":
            self.refused(lambda: self.kv.pull(foreign if alone else keys))
        else:
            drawn = [self.draw_outs(data, shape) for _ in keys]
            outs = [o for o, _ in drawn]
            out = outs[0] if alone else outs
            self.refused(
                lambda: self.kv.pull(foreign if alone else keys, out=out), [hs for _, hs in drawn]
            )

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def store_matches_model(self):
        self.check_store()

    @invariant()
    def handed_arrays_untouched(self):
        """No update changes or invalidates an array the user gave or received."""
        for h, expected, ctx in self.watched:
            _eq(h, expected, "an array handed to or from the store, after later calls")
            if ctx is not None:
                assert h.context == ctx


# 25 runs of up to 20 steps explore in ~10 s on two busy cores. The explain phase is left out:
# on a failure it replays the machine over a thousand times (minutes) for little extra insight.
KVStoreMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=20,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestKVStore = KVStoreMachine.TestCase
