"""The public JAX names that moved between the versions pyproject.toml accepts are feature detected
in jaxkv/_src/jax_internals.py, by attribute or signature, never by version: each route gives the
same types and values on the JAX that runs the tests (`make test-oldest` and `make test-newest` run
them on the oldest and the newest)."""

import inspect
import types
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxkv._src import jax_internals as _fast


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(devices, ("d",))


def test_varying_axes_under_shard_map(mesh):
    seen = {}

    @partial(jax.shard_map, mesh=mesh, in_specs=(P("d"), P()), out_specs=P())
    def step(x, y):
        seen["x"], seen["y"] = _fast.varying_axes(x), _fast.varying_axes(y)
        seen["me"] = _fast.varying_axes(jax.lax.axis_index("d"))
        return jax.lax.psum(x, "d") + y

    step(jnp.ones(8), jnp.ones(1))
    assert seen == {"x": {"d"}, "y": frozenset(), "me": {"d"}}


def test_varying_axes_without_tracking(mesh):
    seen = {}

    @partial(jax.shard_map, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False)
    def step(x):
        seen["x"] = _fast.varying_axes(x)
        return x

    step(jnp.ones(8))
    assert seen == {"x": frozenset()}
    assert _fast.varying_axes(jnp.ones(3)) == frozenset()


def test_varying_axes_reads_vma_where_there_is_no_manual_axis_type(monkeypatch):
    """JAX 0.8 and 0.9 call the set ``jax.typeof(x).vma``."""
    monkeypatch.setattr(jax, "typeof", lambda x: types.SimpleNamespace(vma=frozenset({"d"})))
    assert _fast.varying_axes(jnp.ones(3)) == {"d"}
    monkeypatch.setattr(jax, "typeof", lambda x: types.SimpleNamespace())  # no tracking at all
    assert _fast.varying_axes(jnp.ones(3)) == frozenset()


def _pvary_only(mp):
    """A JAX with jax.lax.pvary and no pcast (until 0.8.1)."""
    pcast = getattr(jax.lax, "pcast", None)
    if pcast is not None:
        mp.delattr(jax.lax, "pcast")
        with warnings.catch_warnings():  # reading the old pvary: deprecated where pcast exists
            warnings.simplefilter("ignore", DeprecationWarning)
            mp.setattr(jax.lax, "pvary", lambda x, a: pcast(x, a, to="varying"), raising=False)


@pytest.mark.parametrize("route", ["this JAX", "pvary"])
def test_to_varying_types_an_invariant_value_as_varying(mesh, monkeypatch, route):
    if route == "pvary":
        _pvary_only(monkeypatch)
    seen = {}

    @partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P("d"))
    def step(y):
        v = _fast.to_varying(y, ("d",))
        seen["v"] = _fast.varying_axes(v)
        return v

    assert _fast.CAN_MARK_VARYING
    out = step(jnp.arange(3.0))
    assert seen == {"v": {"d"}}
    np.testing.assert_array_equal(out, np.tile(np.arange(3.0), 8))


def _without_to(monkeypatch):
    """A JAX whose all_gather takes no ``to``."""
    gather = jax.lax.all_gather

    def older(x, axis_name, *, to=None, **kw):
        if to is not None:
            raise TypeError("all_gather() got an unexpected keyword argument 'to'")
        return gather(x, axis_name, **kw)

    monkeypatch.setattr(jax.lax, "all_gather", older)


def _invariant_gather(mesh):
    """This JAX's all-gather typed invariant, whatever it is called (None without one)."""
    gather = jax.lax.all_gather
    found = getattr(jax.lax, "all_gather_invariant", None) or _fast._private_gather
    if found is not None:
        return found
    try:
        jax.shard_map(
            lambda x: gather(x, "d", to="invarying"), mesh=mesh, in_specs=P("d"), out_specs=P()
        )(jnp.ones(8))
    except ValueError:
        return None
    return lambda x, axis_name, *, axis=0, tiled=False: gather(
        x, axis_name, axis=axis, tiled=tiled, to="invarying"
    )


def _skip_without(gather):
    if gather is None:
        pytest.skip("this JAX's only all-gather typed invariant is private (fast paths are off)")
    return gather


def _public(mp, mesh):
    """A JAX whose all_gather takes no ``to`` and with jax.lax.all_gather_invariant (<= 0.8.1)."""
    gather = _skip_without(_invariant_gather(mesh))
    mp.setattr(jax.lax, "all_gather_invariant", gather, raising=False)
    _without_to(mp)


def _private(mp, mesh):
    """A JAX with neither, but the private all_gather_invariant (0.8.2 to 0.9.2)."""
    mp.setattr(_fast, "_private_gather", _skip_without(_invariant_gather(mesh)))
    mp.delattr(jax.lax, "all_gather_invariant", False)
    _without_to(mp)


def _plain(mp, mesh):
    """Those JAX versions with JAXKV_NO_FAST_PATHS=1."""
    mp.setattr(_fast, "_private_gather", None)
    mp.delattr(jax.lax, "all_gather_invariant", False)
    _without_to(mp)


ROUTES = {"this JAX": None, "public": _public, "private": _private, "plain": _plain}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("tiled", [True, False])
def test_all_gather_invariant_gives_the_whole_value(mesh, monkeypatch, route, tiled):
    """Typed invariant (out_specs P() is checked), except by the plain route: typed varying."""
    if ROUTES[route] is not None:
        ROUTES[route](monkeypatch, mesh)
    invariant = route != "plain" and (route != "this JAX" or _invariant_gather(mesh) is not None)
    seen = {}

    @partial(jax.shard_map, mesh=mesh, in_specs=P("d"), out_specs=P(), check_vma=invariant)
    def step(x):
        whole = _fast.all_gather_invariant(x, "d", tiled=tiled)
        seen["whole"] = _fast.varying_axes(whole)
        return whole

    x = jnp.arange(16.0).reshape(8, 2)
    np.testing.assert_array_equal(step(x), x if tiled else x.reshape(8, 1, 2))
    assert seen == {"whole": frozenset()}


def test_the_plain_route_is_typed_varying(mesh, monkeypatch):
    _plain(monkeypatch, mesh)
    seen = {}

    @partial(jax.shard_map, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    def step(x):
        seen["whole"] = _fast.varying_axes(_fast.all_gather_invariant(x, "d", tiled=True))
        return x

    step(jnp.arange(8.0))
    assert seen == {"whole": {"d"}}


def test_no_route_is_chosen_by_version():
    source = inspect.getsource(_fast)
    for word in ("__version__", "version_info", "jax.version", "jaxlib.version"):
        assert word not in source
