"""Every option of a push, through every path, against a NumPy model; generated from the options.

The options are what the computations' and plans' cache keys are built from: the keyword
parameters of ``jaxkv.push``, the fields of the store's ``Facts`` and of the computations' key
(``core/signature.PushKey``). Each has a case here that pushes once with one value of it and once
with another, each twice (the second call replays the plan or reuses the computation), and
compares every result with the model. A new option without a case fails
``test_every_option_has_a_case``; an option left out of a cache key gives the second value the
first one's computation, which ``test_an_option_left_out_of_the_key_is_caught`` shows the cases
catch. A covering subset of the paths runs in ``make test``, every combination in
``make test-deep``.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _variants import covering
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv
from jaxkv._src.core import eager, plans
from jaxkv._src.core.signature import PushKey, PushOptions
from jaxkv._src.state.kvstate import Facts

SHAPES = {"a": (8, 2), "b": (64, 256)}  # "b" at the default bound: stored split
SGD = optax.sgd(0.5)
SGD_SLOW = optax.sgd(0.125)  # the same structure as SGD: only its identity tells them apart


def _scaled():
    """An optax transformation taking its scale as an extra argument of ``update``."""

    def update(updates, state, params=None, *, scale=1.0):
        return jax.tree.map(lambda g: -scale * g, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


SCALED = _scaled()
LR = {id(SGD): 0.5, id(SGD_SLOW): 0.125}

# Paths: how the values reach the push. "plan": a list of keys, one value each (the eager
# fast path); "general": a mapping (the general path); "devices": a list of per-device values
# (stacked, summed across devices); "jit": inside the user's jax.jit; "shard_map": inside the
# user's shard_map over the store's mesh, axis_name="kv".
PATHS = ("plan", "general", "devices", "jit", "shard_map")
LAYOUTS = ("keys", "flat")

# Each option of jaxkv.push, with two values (and the updater they go with, where it matters).
OPTIONS = {
    "updater": [dict(updater=SGD), dict(updater=SGD_SLOW)],
    "reduce": [dict(reduce="sum"), dict(reduce="mean")],
    "donate": [dict(donate=True), dict(donate=False)],
    "extra_args": [
        dict(updater=SCALED, extra_args={"scale": jnp.float32(0.5)}),
        dict(updater=SCALED, extra_args={"scale": jnp.float32(2.0)}),
    ],
    # axis_name: None in the eager and jit paths, "kv" in shard_map's (the PATHS axis).
}
EAGER_ONLY = {"donate", "extra_args"}  # refused or meaningless inside a trace

# Each fact of a store (Facts), with the keywords of two stores that differ in it alone.
FACTS = {
    "devices": [dict(), dict(devices=4)],
    "bound": [dict(), dict(bigarray_bound=4)],
    "compression": [dict(), dict(compression={"type": "2bit", "threshold": 0.5})],
    "mesh": [dict(), dict(mesh=True)],
    "policy": [dict(layout="keys"), dict(layout="flat")],
    "reduce": [dict(reduce="sum"), dict(reduce="mean")],
    "mesh_axes": [dict(), dict(mesh2=True)],
}

# The fields of the computations' key, and the cases that vary each: a field derived from the
# others (by_rank: the updater and keys) or varied by a path has no case of its own.
PUSH_KEY = {
    "facts": "FACTS",
    "layout": "FACTS['policy']",
    "keys": "keys",
    "kinds": "kinds",
    "options": "OPTIONS_KEY",
    "divisors": "test_a_mean_divides_by_the_values_each_push_gives, OPTIONS['reduce']",
    "by_rank": "derived from the updater and the keys",
    "keyed": "tests/test_mesh_mixed_keys.py (tensor-parallel keys beside others)",
}
# The fields of a push's options (core/signature.PushOptions: the plans' and the computations'
# key hold it whole), and the option of jaxkv.push each comes from.
OPTIONS_KEY = {"updater_id": "updater", "donate": "donate", "reduce": "reduce"}


def test_every_option_has_a_case():
    """A new option of push, of a store or of the computations' key needs a case here."""
    pushed = {
        name
        for name, p in inspect.signature(jaxkv.push).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert pushed == set(OPTIONS) | {"axis_name"}
    assert {f.name for f in dataclasses.fields(Facts) if f.compare} == set(FACTS)
    assert {f.name for f in dataclasses.fields(PushKey)} == set(PUSH_KEY)
    assert {f.name for f in dataclasses.fields(PushOptions) if f.compare} == set(OPTIONS_KEY)
    assert set(OPTIONS_KEY.values()) <= set(OPTIONS)


# -- the model --------------------------------------------------------------------------------
def _grad(key, d=0):
    """Device ``d``'s contribution to ``key`` (every path pushes these)."""
    shape = SHAPES[key]
    base = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) % 7 + 1.0
    return base * (d + 1)


def _stored(key):
    return np.full(SHAPES[key], 3.0, np.float32)


def _model(key, n, count, options, compression=None):
    """The key's new value: the ``n`` devices' contributions summed (each compressed first
    where the store compresses ``count`` values), divided by ``count`` for a mean, then the
    updater's step."""
    grads = [_grad(key, d) for d in range(n)]
    if compression is not None:  # 2-bit: a value at least the threshold gives the threshold
        t = compression["threshold"]
        quantized = [g if count == 1 else np.where(g >= t, t, 0.0) for g in grads]
        g = np.sum(quantized, axis=0, dtype=np.float32)
        g = g if count > 1 else np.where(g >= t, t, 0.0)
    else:
        g = np.sum(grads, axis=0, dtype=np.float32)
    if options.get("reduce", "sum") == "mean":
        g = g / count
    updater = options.get("updater")
    if updater is None:
        return g
    if updater is SCALED:
        return _stored(key) - float((options.get("extra_args") or {}).get("scale", 1.0)) * g
    return _stored(key) - LR[id(updater)] * g


# -- the stores and paths ---------------------------------------------------------------------
def _store(devices, layout="keys", *, devices_n=8, mesh=False, mesh2=False, **kwargs):
    devs = list(devices[:devices_n])
    if mesh2:  # a data x model mesh: values summed and split along "data"
        m = Mesh(np.array(devs).reshape(4, 2), ("data", "model"))
        state = jaxkv.empty(mesh=m, axis_name="data", layout=layout, **kwargs)
    elif mesh:
        state = jaxkv.empty(mesh=Mesh(np.array(devs), ("kv",)), layout=layout, **kwargs)
    else:
        state = jaxkv.empty(devs, layout=layout, **kwargs)
    return jaxkv.init(state, {k: jnp.asarray(_stored(k)) for k in SHAPES})


def _with_optimizer(state, updater):
    """``state`` with ``updater``'s state made (a plan replays pushes into such states)."""
    if isinstance(updater, optax.GradientTransformation):
        return jaxkv.init_optimizer(state, updater)
    return state


def _copy(state):
    """The same state (its key set and layout the very objects) in buffers of its own."""
    return jax.tree.map(jnp.copy, state)


def _push(path, state, keys, options):
    """``jaxkv.push`` of every device's contributions to ``keys`` along ``path``: the new
    state, and the number of values each key's mean divides by."""
    devs = list(state.devices)
    n = len(devs)
    traced = {k: v for k, v in options.items() if k in ("updater", "reduce")}
    if path in ("plan", "general", "jit"):  # one value per key: the devices' sum
        values = {k: jnp.asarray(sum(_grad(k, d) for d in range(n))) for k in keys}
        if path == "jit":
            return jax.jit(lambda s, v: jaxkv.push(s, v, **traced))(state, values), 1
        if path == "plan":
            return jaxkv.push(state, list(keys), [values[k] for k in keys], **options), 1
        return jaxkv.push(state, values, **options), 1
    if path == "devices":
        values = [[jax.device_put(_grad(k, d), dev) for d, dev in enumerate(devs)] for k in keys]
        return jaxkv.push(state, list(keys), values, **options), n

    # shard_map: each device pushes its own contribution, summed over "kv"
    if isinstance(options.get("updater"), optax.GradientTransformation):
        state = jaxkv.init_optimizer(state, options["updater"])

    def step(s, grads):
        return jaxkv.push(s, {k: g[0] for k, g in grads.items()}, axis_name="kv", **traced)

    split = NamedSharding(state.mesh, P("kv"))
    grads = {k: jax.device_put(np.stack([_grad(k, d) for d in range(n)]), split) for k in keys}
    specs = jaxkv.specs(state, "kv")
    body = jax.shard_map(step, mesh=state.mesh, in_specs=(specs, P("kv")), out_specs=specs)
    return jax.jit(body)(state, grads), n


def _check(new, keys, n, count, options, what, compression=None):
    """Each key's value against the model, and (one array per key) where the store keeps it."""
    for k in keys:
        np.testing.assert_allclose(
            np.asarray(jaxkv.pull(new, k)),
            _model(k, n, count, options, compression=compression),
            rtol=1e-6,
            err_msg=f"{what}: key {k!r}",
        )
        if new.flat_layout is None:
            value = new.values[k]
            assert value.sharding.is_equivalent_to(new.sharding_of(k), value.ndim), (what, k)


def _case(devices, path, layout, pair, store=None):
    """Both values of an option (``pair``) through ``path``, each pushed twice from copies of
    one state, every result checked against the model."""
    base = store or _store(devices, layout)
    n = len(base.devices)
    # One state for both values (the optimizer state of the first: the updaters of a pair
    # have one structure), so that each may find what the other left in a cache.
    state = _with_optimizer(base, pair[0].get("updater", SGD))
    for options in pair:
        options = {"updater": SGD, **options}
        for _ in range(2):  # the second replays the plan or reuses the computation
            given = _copy(state)
            new, count = _push(path, given, list(SHAPES), options)
            _check(new, SHAPES, n, count, options, f"{path} {layout} {options}")
            if not options.get("donate"):  # the state pushed from is still whole
                assert not any(x.is_deleted() for x in jax.tree.leaves(given))


EAGER = [p for p in PATHS if p not in ("jit", "shard_map")]
TRACED = [o for o in OPTIONS if o not in EAGER_ONLY]


@pytest.mark.parametrize(
    ("path", "layout", "option"),
    covering(EAGER, LAYOUTS, list(OPTIONS)) + covering(["jit", "shard_map"], LAYOUTS, TRACED),
)
def test_each_option_of_push_on_each_path(devices, path, layout, option):
    _case(devices, path, layout, OPTIONS[option])


@pytest.mark.parametrize(("path", "fact"), covering(["plan", "general", "devices"], list(FACTS)))
def test_each_fact_of_a_store_on_each_path(devices, path, fact):
    """Two stores that differ in one fact, the same updater object pushed into each."""
    for store_kwargs in FACTS[fact]:
        kwargs = dict(store_kwargs)
        if kwargs.pop("devices", None):
            kwargs["devices_n"] = 4
        if kwargs.get("mesh2") and path == "devices":
            continue  # a store on several axes sums along its axis inside shard_map only
        state = _with_optimizer(_store(devices, **kwargs), SGD)
        n = len(state.devices)
        options = {"updater": SGD, "reduce": kwargs.get("reduce", "sum")}
        for _ in range(2):
            new, count = _push(path, _copy(state), list(SHAPES), {"updater": SGD})
            what = f"{path} {fact} {store_kwargs}"
            _check(new, SHAPES, n, count, options, what, kwargs.get("compression"))


def test_the_keys_pushed_and_how_they_arrive(devices):
    """PushKey.keys and .kinds: one key then two, one value then per-device values, on one
    store, each against the model."""
    state = _store(devices)
    for keys in (["a"], ["a", "b"], ["b"]):
        for path in ("plan", "devices", "plan"):
            new, count = _push(path, _copy(state), keys, {"updater": None})
            _check(new, keys, 8, count, {"updater": None}, f"{path} {keys}")


def test_a_mean_divides_by_the_values_each_push_gives(devices):
    """PushKey.divisors: a mean of every device's values, then of half of them (each key's
    values stacked either way: the same kinds, the same options), each twice, on one store,
    against the model."""
    state = _store(devices)
    for n in (8, 4, 8):
        for _ in range(2):
            values = [[jax.device_put(_grad(k, d), devices[d]) for d in range(n)] for k in SHAPES]
            new = jaxkv.push(_copy(state), list(SHAPES), values, reduce="mean")
            _check(new, SHAPES, n, n, {"reduce": "mean"}, f"a mean of {n} values")


# -- the cases catch an option left out of a key ----------------------------------------------
def _without(options, option):
    """A push's options with one of them left out of its key (``None`` in its place)."""
    field = {v: k for k, v in OPTIONS_KEY.items()}[option]
    options = dataclasses.replace(options)  # (a copy)
    object.__setattr__(options, field, None)
    return options


class _Dropping(eager._Computations):  # noqa: SLF001
    """The computations' cache with fields of the key left out (``None`` in their place;
    ``fields`` joined by commas): a push option (``updater``, ``donate``, ``reduce``), a field
    of the key, or a fact."""

    def __init__(self, fields):
        super().__init__()
        self.fields = fields.split(",")

    def get(self, sig, build):
        key = sig
        for field in self.fields:
            if field in OPTIONS_KEY.values():
                key = dataclasses.replace(key, options=_without(key.options, field))
            elif field in {f.name for f in dataclasses.fields(PushKey)}:
                key = dataclasses.replace(key, **{field: None})
            else:  # a fact of the store
                key = dataclasses.replace(
                    key, facts=dataclasses.replace(key.facts, **{field: None})
                )
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = build(sig)
        return fn


class _DroppingPlans(plans._Plans):  # noqa: SLF001
    """The plans' cache with one of the push's options left out of its key."""

    def __init__(self, option):
        super().__init__()
        self.option = option

    def _key(self, sig):
        return tuple(_without(x, self.option) if isinstance(x, PushOptions) else x for x in sig)

    def get(self, sig):
        return super().get(self._key(sig))

    def put(self, sig, plan):
        super().put(self._key(sig), plan)


# (what is left out, the path and case that must then fail). The other fields cannot give a
# wrong result when left out: the layout and the compression come with their own kinds, the
# policy and the mesh with the state's tree structure (jit traces again), by_rank follows from
# the updater and the keys, keyed is tests/test_mesh_mixed_keys.py's, and the options' reduce
# is carried by the divisors too (a mean's divisors are None only where nothing is divided).
DROPPED = [
    ("updater", "plan", "updater"),
    ("divisors", None, "counts"),
    ("donate", "plan", "donate"),
    ("kinds", None, None),
    ("devices", "general", "devices"),
    ("bound", "general", "bound"),
]
# The plans' key: (ids of the key set, shapes, groups; facts, call keys, values per key, the
# push's options). A plan replays only values of its own shapes and devices (checked at each
# call), and only for its own key set: the parts whose loss a case must catch are the options.
DROPPED_FROM_PLANS = ["updater", "donate", "reduce"]


@pytest.mark.parametrize(("field", "path", "case"), DROPPED)
def test_an_option_left_out_of_the_key_is_caught(devices, monkeypatch, field, path, case):
    monkeypatch.setattr(eager, "_COMPUTATIONS", _Dropping(field))
    monkeypatch.setattr(plans, "_PUSHES", plans._Plans())  # noqa: SLF001
    with pytest.raises((AssertionError, ValueError, TypeError, jaxkv.KVStoreError)):
        if case is None:
            test_the_keys_pushed_and_how_they_arrive(devices)
        elif case == "counts":
            test_a_mean_divides_by_the_values_each_push_gives(devices)
        elif case in OPTIONS:
            _case(devices, path, "keys", OPTIONS[case])
        else:
            test_each_fact_of_a_store_on_each_path(devices, path, case)


@pytest.mark.parametrize("case", DROPPED_FROM_PLANS)
def test_an_option_left_out_of_the_plans_key_is_caught(devices, monkeypatch, case):
    monkeypatch.setattr(plans, "_PUSHES", _DroppingPlans(case))
    with pytest.raises((AssertionError, ValueError, TypeError, jaxkv.KVStoreError)):
        _case(devices, "devices", "keys", OPTIONS[case])
