"""Run by tests/test_push_parity_dist.py under ``python -m jaxkv.launch -n 2
--devices-per-process 2``: tests/test_push_parity.py's cases across processes.

    parity_job.py CASES [--drop FIELD]

``CASES``: ``all``, or ``OPTION:PATH:LAYOUT`` triples joined by commas (:data:`CASES` lists
them all). Each case makes a store with ``jaxkv.empty(layout=LAYOUT)``, which spans every
process's devices (4 here, 2 in each process; key "b" is split across all 4), and pushes both
values of one option of ``jaxkv.push`` (``OPTIONS``, imported with the NumPy model from
tests/test_push_parity.py), each twice from copies of one state (the second call reuses the
computation: a cache key without the option hands the second value the first one's), along
one path:

- ``plan``: a list of keys, one value each (the eager fast path in one process; across
  processes the general path runs, as the plans replay one process's calls only);
- ``general``: a mapping ``{key: value}``;
- ``devices``: a list of per-device values, this process's devices' only;
- ``jit``: inside the user's ``jax.jit``, the per-device values one array over every
  process's devices (``P("kv")``), summed by the user's code before the push;
- ``shard_map``: inside the user's ``shard_map`` over the store's mesh, each device pushing
  its own value with ``axis_name="kv"``.

Each process contributes its own devices' values: device ``d`` of the store (in every
process's order) gives ``_grad(key, d)``, so the model sums them over all 4 devices. A mean
divides by every process's contributions: 2 for one value per key per process (plan, general),
4 for one per device (devices, shard_map), 1 in ``jit`` (the user's sum is one value). Every
result is compared with the model, every process's shards with the whole value, and a digest of
each case's values is all-gathered: the processes must agree bit for bit.

No combination of an option, a path and a layout is refused across processes (a refusal would
fail its case, printed as an error). As in one process, the options a trace takes no part in
(``EAGER_ONLY``: ``donate``, ``extra_args``) run on the eager paths only: :data:`CASES`.

``--drop FIELD`` leaves ``FIELD`` out of the push computations' cache key first (the
``_Dropping`` cache of tests/test_push_parity.py): the case of the option it stands for then
gives a wrong value or deletes a state it must keep, and the job fails.

Each case prints ``rank R ok OPTION PATH LAYOUT``, then ``rank R done`` at the end; the first
case that fails prints ``rank R mismatch OPTION PATH LAYOUT: ...`` (a wrong value, a deleted
state, processes that disagree) or ``rank R error OPTION PATH LAYOUT: ...`` (an exception), and
the process exits with 1.
"""

import hashlib
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv  # joins the job

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import test_push_parity as parity  # noqa: E402 (tests/: the options and the model)

from jaxkv._src.core import eager  # noqa: E402

PATHS = parity.PATHS
TRACED_PATHS = ("jit", "shard_map")
LAYOUTS = parity.LAYOUTS
OPTIONS = parity.OPTIONS
CASES = [
    (option, path, layout)
    for option in OPTIONS
    for path in PATHS
    for layout in LAYOUTS
    if not (path in TRACED_PATHS and option in parity.EAGER_ONLY)
]
UPDATERS = {id(parity.SGD): "SGD", id(parity.SGD_SLOW): "SGD_SLOW", id(parity.SCALED): "SCALED"}


def ok(what):
    print(f"rank {jax.process_index()} ok {what}", flush=True)


def _shown(options):
    """``options`` with the updaters by name."""
    return ", ".join(f"{k}={UPDATERS.get(id(v), v)}" for k, v in options.items())


def _mine(state):
    """This process's devices of the store, with their positions in it."""
    me = jax.process_index()
    return [(d, dev) for d, dev in enumerate(state.devices) if dev.process_index == me]


def _stacked(state, key):
    """Every device's contribution to ``key`` as one array over the store's mesh, rows along
    ``"kv"``: each process gives its own devices' rows."""
    n = len(state.devices)
    shape = (n, *parity.SHAPES[key])
    split = NamedSharding(state.mesh, P("kv"))
    return jax.make_array_from_callback(
        shape, split, lambda idx: np.stack([parity._grad(key, d) for d in range(n)])[idx]
    )


def _push(path, state, keys, options):
    """``jaxkv.push`` of this process's contributions to ``keys`` along ``path``: the new state,
    and how many values each key's mean divides by (every process's together)."""
    n, processes = len(state.devices), jax.process_count()
    mine = _mine(state)
    traced = {k: v for k, v in options.items() if k in ("updater", "reduce")}
    if path in ("plan", "general"):  # one value per key: this process's devices' sum
        values = {k: jnp.asarray(sum(parity._grad(k, d) for d, _ in mine)) for k in keys}
        if path == "plan":
            return jaxkv.push(state, list(keys), [values[k] for k in keys], **options), processes
        return jaxkv.push(state, values, **options), processes
    if path == "devices":
        values = [[jax.device_put(parity._grad(k, d), dev) for d, dev in mine] for k in keys]
        return jaxkv.push(state, list(keys), values, **options), n
    grads = {k: _stacked(state, k) for k in keys}
    if path == "jit":  # the user's sum over the devices, then one value per key

        def summed(s, g):
            return jaxkv.push(s, {k: v.sum(0) for k, v in g.items()}, **traced)

        return jax.jit(summed)(state, grads), 1

    # shard_map: each device pushes its own contribution, summed over "kv"
    if isinstance(options.get("updater"), optax.GradientTransformation):
        state = jaxkv.init_optimizer(state, options["updater"])

    def step(s, g):
        return jaxkv.push(s, {k: v[0] for k, v in g.items()}, axis_name="kv", **traced)

    specs = jaxkv.specs(state, "kv")
    body = jax.shard_map(step, mesh=state.mesh, in_specs=(specs, P("kv")), out_specs=specs)
    return jax.jit(body)(state, grads), n


def _check(new, keys, count, options, what):
    """Each key's value against the model (whole, and this process's shards of it), where
    the store keeps it; returns a digest of the values, to compare across processes."""
    digest = hashlib.sha256()
    n = len(new.devices)
    for k in keys:
        value = jaxkv.pull(new, k)
        whole = np.asarray(multihost_utils.process_allgather(value, tiled=True))
        want = parity._model(k, n, count, options)
        np.testing.assert_allclose(whole, want, rtol=1e-6, err_msg=f"{what}: key {k!r}")
        for shard in value.addressable_shards:
            got = np.asarray(shard.data)
            assert np.array_equal(got, whole[shard.index]), f"{what}: key {k!r}'s shard"
        if new.flat_layout is None:
            stored = new.values[k]
            assert stored.sharding.is_equivalent_to(new.sharding_of(k), stored.ndim), (what, k)
        digest.update(whole.tobytes())
    return digest.digest()


def _agree(digest, what):
    """Every process computed the same values, bit for bit (128 bits of their digests, as
    int32 words: JAX's default integers)."""
    mine = np.frombuffer(digest[:16], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.size)
    assert (every == every[0]).all(), f"{what}: the processes' values differ ({every})"


def run_case(option, path, layout):
    """Both values of ``option`` through ``path``, each pushed twice from copies of one state."""
    base = jaxkv.empty(layout=layout)
    assert base.devices == tuple(jax.devices()), base.devices
    base = jaxkv.init(base, {k: parity._stored(k) for k in parity.SHAPES})
    assert base.is_sharded(parity.SHAPES["b"]), "key 'b' is split across the processes"
    pair = OPTIONS[option]
    state = parity._with_optimizer(base, pair[0].get("updater", parity.SGD))
    for options in pair:
        options = {"updater": parity.SGD, **options}
        for _ in range(2):  # the second reuses the computation
            what = f"{path} {layout} {_shown(options)}"
            given = parity._copy(state)
            new, count = _push(path, given, list(parity.SHAPES), options)
            _agree(_check(new, parity.SHAPES, count, options, what), what)
            if not options.get("donate"):  # the state pushed from is still whole
                assert not any(x.is_deleted() for x in jax.tree.leaves(given)), what


def main():
    args = sys.argv[1:]
    if "--drop" in args:  # (across processes no plan is made: the computations' key alone)
        at = args.index("--drop")
        eager._COMPUTATIONS = parity._Dropping(args[at + 1])
        del args[at : at + 2]
    (names,) = args
    assert jax.process_count() == 2 and len(jax.local_devices()) == 2, "2 processes x 2 devices"
    # As the suite's tests run (conftest.py): an implicit cast in jaxkv is an error.
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    if names == "all":
        cases = CASES
    else:
        cases = [tuple(c.split(":")) for c in names.split(",")]
        assert all(c in CASES for c in cases), [c for c in cases if c not in CASES]
    rank = jax.process_index()
    for case in cases:
        what = " ".join(case)
        try:
            run_case(*case)
        except AssertionError as e:
            print(f"rank {rank} mismatch {what}: {str(e).strip()}", flush=True)
            sys.exit(1)
        except Exception as e:
            traceback.print_exc()
            print(f"rank {rank} error {what}: {type(e).__name__}: {e}", flush=True)
            sys.exit(1)
        ok(what)
    if "--drop" not in sys.argv:
        refuse_global()
        ok("refused: a value over every process")
    print(f"rank {rank} done", flush=True)


def refuse_global():
    """An eager push of one array over every process's devices (not this process's own part)
    is refused with the key named, whatever the devices per process, and changes nothing."""
    state = jaxkv.init(jaxkv.empty(), {"a": np.zeros((8, 2), np.float32)})
    whole = jax.device_put(np.ones((8, 2), np.float32), NamedSharding(state.mesh, P()))
    try:
        jaxkv.push(state, "a", whole)
    except jaxkv.KVStoreError as e:
        assert "key 'a': a multi-process push expects this process's own values" in str(e), e
    else:
        raise AssertionError("a push of an array over every process was not refused")
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))


if __name__ == "__main__":
    main()
