"""jaxkv/_src/jax_internals.py: each private-name fast path gives what its public fallback gives,
and JAXKV_NO_FAST_PATHS turns every one of them off."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv._src import jax_internals as ji

N = 4  # devices of the mesh the sharded arrays live on


@pytest.fixture
def mesh(devices):
    return Mesh(np.array(devices[:N]), ("i",))


@pytest.fixture
def public(monkeypatch):
    """Within a test: every fast path off, as JAXKV_NO_FAST_PATHS=1 (or another JAX) leaves it."""

    def off():
        monkeypatch.setattr(ji, "ENABLED", False)
        monkeypatch.setattr(ji, "ArrayImpl", None)
        monkeypatch.setattr(ji, "ShapedArray", None)
        monkeypatch.setattr(ji, "SingleDevice", None)
        monkeypatch.setattr(ji, "_private_gather", None)

    return off


def _arrays(mesh, devices):
    """A small pool of arrays: on one device, split over the mesh, replicated over it, and
    placed by a one-device NamedSharding (not one device's own sharding)."""
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    return {
        "one": jax.device_put(x, devices[3]),
        "split": jax.device_put(x, NamedSharding(mesh, P("i"))),
        "columns": jax.device_put(x.reshape(3, 8), NamedSharding(mesh, P(None, "i"))),
        "replicated": jax.device_put(x, NamedSharding(mesh, P())),
        "named_one": jax.device_put(x, NamedSharding(Mesh(np.array(devices[5:6]), ("j",)), P())),
    }


def test_one_devices_sharding_is_made_and_told_apart_without_a_deprecated_name(mesh, devices):
    """JAX 0.12 deprecates ``jax.sharding.SingleDeviceSharding`` (a warning, an error in the
    suite): the helpers take the public route each JAX offers."""
    s = ji.single_device_sharding(devices[2])
    assert s.device_set == {devices[2]}
    x = jax.device_put(np.arange(3.0), s)
    assert x.sharding == s and ji.single_device(x) == devices[2]
    assert ji.is_single_device_sharding(s)
    assert ji.is_single_device_sharding(jax.device_put(np.arange(3.0), devices[4]).sharding)
    for name, a in _arrays(mesh, devices).items():
        assert ji.is_single_device_sharding(a.sharding) == (name == "one"), name


def _both(public, fn, *args):
    """``fn(*args)`` on the fast path, then on the public fallback."""
    fast = fn(*args)
    public()
    return fast, fn(*args)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda a: [a["one"], a["split"], a["replicated"]], True),
        (lambda a: [], True),
        (lambda a: [a["one"], np.zeros(3, np.float32)], False),  # a NumPy array is no jax.Array
        (lambda a: [a["split"], 1.0], False),
    ],
)
def test_all_eager_on_the_fast_path_is_the_public_isinstance_check(
    mesh, devices, public, make, expected
):
    xs = make(_arrays(mesh, devices))
    assert _both(public, ji.all_eager, xs) == (expected, expected)


def test_a_tracer_is_not_eager_on_either_path(public):
    seen = []
    jax.make_jaxpr(lambda x: seen.append(ji.all_eager([x])) or x)(jnp.zeros(2))
    public()
    jax.make_jaxpr(lambda x: seen.append(ji.all_eager([x])) or x)(jnp.zeros(2))
    assert seen == [False, False]


@pytest.mark.parametrize(
    ("name", "index"),
    [("one", 3), ("named_one", 5), ("split", None), ("replicated", None), ("columns", None)],
)
def test_single_device_reads_the_device_as_the_public_device_set_does(
    mesh, devices, public, name, index
):
    x = _arrays(mesh, devices)[name]
    expected = None if index is None else devices[index]
    assert _both(public, ji.single_device, x) == (expected, expected)


@pytest.mark.parametrize(
    "names",
    [
        ["one", "one", "one"],  # the C-level passes
        ["one", "named_one", "split"],  # one sharding of another kind: asked one by one
        [],
    ],
)
def test_single_devices_reads_each_device_as_single_device_does(mesh, devices, public, names):
    arrays = _arrays(mesh, devices)
    xs = [arrays[n] for n in names]
    expected = tuple(ji.single_device(x) for x in xs)
    assert _both(public, ji.single_devices, xs) == (expected, expected)


def test_assemble_without_checks_builds_the_array_the_public_function_builds(mesh, devices, public):
    blocks = [np.full((2, 3), d, np.float32) + np.arange(6).reshape(2, 3) for d in range(N)]
    shards = [jax.device_put(b, d) for b, d in zip(blocks, devices[:N])]
    sharding = NamedSharding(mesh, P("i"))
    fast = ji.assemble((2 * N, 3), sharding, shards)
    public()
    slow = ji.assemble((2 * N, 3), sharding, shards)
    for x in (fast, slow):
        assert x.shape == (2 * N, 3) and x.dtype == np.float32
        assert x.sharding == sharding
        np.testing.assert_array_equal(np.asarray(x), np.concatenate(blocks))
        # each device holds its own block: block d at rows 2d, 2d + 1
        for s in x.addressable_shards:
            d = devices.index(s.device)
            np.testing.assert_array_equal(np.asarray(s.data), blocks[d])
    assert type(fast) is type(slow)


def test_assemble_falls_back_where_the_private_constructor_takes_other_arguments(
    mesh, devices, monkeypatch
):
    def other_signature(*args, **kwargs):
        raise TypeError("unexpected keyword argument '_skip_checks'")

    monkeypatch.setattr(ji, "ArrayImpl", other_signature)
    shards = [jax.device_put(np.full((1,), i, np.float32), d) for i, d in enumerate(devices[:N])]
    x = ji.assemble((N,), NamedSharding(mesh, P("i")), shards)
    np.testing.assert_array_equal(np.asarray(x), np.arange(N, dtype=np.float32))


@pytest.mark.parametrize("name", ["one", "split", "columns", "replicated"])
def test_per_device_gives_the_addressable_shards_in_their_order(mesh, devices, public, name):
    x = _arrays(mesh, devices)[name]
    fast, slow = _both(public, ji.per_device, x)
    shards = x.addressable_shards
    assert len(fast) == len(slow) == len(shards)
    for f, s, shard in zip(fast, slow, shards):
        assert ji.is_single_device_sharding(f.sharding)
        assert f.sharding.device_set == s.sharding.device_set == {shard.device}
        np.testing.assert_array_equal(np.asarray(f), np.asarray(shard.data))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(x)[shard.index])


def _in_map(mesh, fn, x):
    """``fn`` traced (nothing compiled) on each device's block of ``x``."""
    return jax.make_jaxpr(jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P("i")))(x)


def test_varying_axes_follow_what_jax_tracks(mesh):
    seen = {}

    def body(x):
        seen["block"] = ji.varying_axes(x)
        seen["summed"] = ji.varying_axes(jax.lax.psum(x, "i"))
        seen["made"] = ji.varying_axes(jnp.ones(2))
        seen["marked"] = ji.varying_axes(ji.to_varying(jnp.ones(2), ("i",)))
        return jax.lax.psum(x, "i")

    _in_map(mesh, body, jnp.arange(8.0))
    assert seen == {
        "block": frozenset({"i"}),
        "summed": frozenset(),
        "made": frozenset(),
        "marked": frozenset({"i"}),
    }
    assert ji.varying_axes(jnp.ones(2)) == frozenset()  # outside any map


@pytest.mark.parametrize("tiled", [True, False])
def test_all_gather_invariant_gives_the_plain_gather_s_values_on_every_route(mesh, tiled):
    """The public ``to="invarying"``, the private function of JAX 0.8.2 to 0.9.2 and the plain
    gather (the last fallback) give one value; the first two type it invariant."""
    x = jnp.arange(8.0 * 2).reshape(8, 2)
    routes = {
        "invariant": lambda b: ji.all_gather_invariant(b, "i", tiled=tiled),
        "plain": lambda b: jax.lax.all_gather(b, "i", tiled=tiled),
    }
    if ji._private_gather is not None:
        routes["private"] = lambda b: ji._private_gather(b, "i", tiled=tiled)
    types = {}

    def body(b):
        outs = {name: route(b) for name, route in routes.items()}
        types.update((name, ji.varying_axes(v)) for name, v in outs.items())
        return {name: v[None] for name, v in outs.items()}  # each device's copy, side by side

    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))(x)
    whole = np.asarray(x) if tiled else np.asarray(x).reshape(N, 2, 2)
    for value in got.values():
        np.testing.assert_array_equal(np.asarray(value), np.broadcast_to(whole, (N, *whole.shape)))
    assert types.pop("plain") == frozenset({"i"})
    assert set(types.values()) == {frozenset()}


def test_all_gather_invariant_without_the_keyword_takes_the_next_route(mesh, monkeypatch):
    real = jax.lax.all_gather

    def old_gather(x, axis_name, *, axis=0, tiled=False, **kwargs):
        if kwargs:
            raise TypeError("all_gather() got an unexpected keyword argument 'to'")
        return real(x, axis_name, axis=axis, tiled=tiled)

    monkeypatch.setattr(jax.lax, "all_gather", old_gather)
    shapes = {}

    def body(b):
        g = ji.all_gather_invariant(b, "i", tiled=True)
        shapes["g"] = (g.shape, ji.varying_axes(g))
        return g

    _in_map(mesh, body, jnp.arange(8.0))
    # the private function where this JAX has it, else the plain gather: the whole value
    expected = frozenset() if ji._private_gather is not None else frozenset({"i"})
    assert shapes["g"] == ((8,), expected)


FAST = pytest.mark.skipif(not ji.ENABLED, reason="JAXKV_NO_FAST_PATHS is set: no fast path")


@FAST
def test_the_hooks_into_jax_distributed_are_off_without_fast_paths(public):
    fast = (ji.distributed_state(), ji.cluster_environments())
    assert fast[0] is not None  # this JAX exposes both
    assert fast[1] and not any(getattr(e, "opt_in_only_method", False) for e in fast[1])
    public()
    assert ji.gloo_cpu_backend({"hostname": "localhost"}) is None
    assert ji.distributed_state() is None
    assert ji.cluster_environments() is None


@FAST
def test_cluster_environments_are_jax_s_in_its_order_less_those_it_tries_only_by_name():
    from jax._src.clusters import ClusterEnv

    kinds = list(ClusterEnv._cluster_types)
    got = ji.cluster_environments()
    names = [e.__name__ for e in got]
    assert "SlurmCluster" in names and "OmpiCluster" in names
    assert names == sorted(names, key=[k.__name__ for k in kinds].index)  # JAX's order
    left_out = [k for k in kinds if k not in got]
    assert all(k.opt_in_only_method for k in left_out)


@pytest.mark.parametrize(("value", "enabled"), [("", True), ("0", True), ("1", False)])
def test_jaxkv_no_fast_paths_is_read_at_import(monkeypatch, value, enabled):
    was = ji.ENABLED
    monkeypatch.setenv("JAXKV_NO_FAST_PATHS", value)
    try:
        importlib.reload(ji)
        assert ji.ENABLED is enabled
        assert (ji.ArrayImpl is not None) is enabled
        if not enabled:
            assert ji._private_gather is None
    finally:
        monkeypatch.undo()  # the environment as this run has it, and the module read again
        importlib.reload(ji)
    assert ji.ENABLED is was
