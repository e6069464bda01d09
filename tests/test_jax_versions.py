"""The public JAX names that moved between the versions pyproject.toml accepts are feature
detected in jaxkv/_fast.py, by attribute or signature, never by version: each route gives the
same types and values on the JAX that runs the tests (`make test-oldest` and `make test-newest`
run them on the oldest and the newest)."""

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

from jaxkv import _fast


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


def _renamed(mp, mesh):
    """A JAX whose all_gather takes no ``to`` but which has all_gather_invariant (until 0.8.1);
    made from this JAX's ``to="invarying"`` where it has no all_gather_invariant of its own."""
    gather = jax.lax.all_gather
    if not hasattr(jax.lax, "all_gather_invariant"):
        try:
            jax.shard_map(
                lambda x: gather(x, "d", to="invarying"), mesh=mesh, in_specs=P("d"), out_specs=P()
            )(jnp.ones(8))
        except ValueError:
            pytest.skip("this JAX has neither all_gather_invariant nor all_gather(to='invarying')")

        def renamed(x, axis_name, *, tiled=False):
            return gather(x, axis_name, tiled=tiled, to="invarying")

        mp.setattr(jax.lax, "all_gather_invariant", renamed, raising=False)
    _without_to(mp)


ROUTES = {
    "this JAX": lambda mp, mesh: None,
    "all_gather_invariant": _renamed,
    "psum": lambda mp, mesh: (
        _without_to(mp),
        mp.delattr(jax.lax, "all_gather_invariant", False),
    ),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("tiled", [True, False])
def test_all_gather_invariant_gives_the_whole_value_typed_invariant(
    mesh, monkeypatch, route, tiled
):
    ROUTES[route](monkeypatch, mesh)
    seen = {}

    @partial(jax.shard_map, mesh=mesh, in_specs=P("d"), out_specs=P())  # checks replication
    def step(x):
        whole = _fast.all_gather_invariant(x, "d", tiled=tiled)
        seen["whole"] = _fast.varying_axes(whole)
        return whole

    x = jnp.arange(16.0).reshape(8, 2)
    np.testing.assert_array_equal(step(x), x if tiled else x.reshape(8, 1, 2))
    assert seen == {"whole": frozenset()}


def test_no_route_is_chosen_by_version():
    source = inspect.getsource(_fast)
    for word in ("__version__", "version_info", "jax.version", "jaxlib.version"):
        assert word not in source
