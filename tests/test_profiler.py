"""jaxkv's work under named scopes: the sum (``jaxkv.sum``), the compression
(``jaxkv.compress``), the updater (``jaxkv.updater``) and the row routes (``jaxkv.rows.route``)
are in the HLO's op names of a push, and in what ``jax.profiler`` records of it.

On CPU a trace's events name the HLO instructions that ran (``hlo_op``, ``hlo_module``); their
scopes are in the HLO's op metadata, which JAX saves with the trace (``.xplane.pb``, what
TensorBoard's profile plugin and XProf read) and which the compiled text shows."""

import functools
import glob
import gzip
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _devices import SPLIT_BOUND, cpu_empty
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv
from jaxkv._src.core import compression

AXIS = "kv"
D = 8
SCOPES = ("jaxkv.sum", "jaxkv.compress", "jaxkv.updater", "jaxkv.rows.route")


def op_names(hlo_text):
    """Each instruction of compiled HLO text and the op name in its metadata."""
    pattern = r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{op_name="([^"]*)"'
    return dict(re.findall(pattern, hlo_text, re.MULTILINE))


def traced(tmp_path, fn):
    """Run ``fn`` under ``jax.profiler.trace``; the trace's events (its perfetto JSON) and its
    ``.xplane.pb`` as bytes."""
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        jax.block_until_ready(fn())
    (events,) = glob.glob(str(tmp_path / "plugins/profile/*/perfetto_trace.json.gz"))
    (xplane,) = glob.glob(str(tmp_path / "plugins/profile/*/*.xplane.pb"))
    with gzip.open(events, "rt") as f:
        trace = json.load(f)["traceEvents"]
    with open(xplane, "rb") as f:
        return trace, f.read()


def sharded(state, x):
    return jax.device_put(x, NamedSharding(state.mesh, P(AXIS)))


def data_parallel_step(opt):
    """A ``jit(shard_map(...))`` step pushing each device's gradients with ``opt``."""
    state = jaxkv.init_optimizer(
        jaxkv.init(
            cpu_empty(bigarray_bound=SPLIT_BOUND), {"w": jnp.zeros((64, 512)), "b": jnp.zeros(8)}
        ),
        opt,
    )
    specs = jaxkv.specs(state, AXIS)

    def step(state, grads):
        return jaxkv.push(state, grads, updater=opt, axis_name=AXIS)

    fn = jax.jit(jax.shard_map(step, mesh=state.mesh, in_specs=(specs, P(AXIS)), out_specs=specs))
    grads = {
        "w": sharded(state, np.ones((D * 64, 512), np.float32)),
        "b": sharded(state, np.ones(D * 8, np.float32)),
    }
    return fn, state, grads


@pytest.mark.standard_promotion  # Adam
def test_a_push_with_an_optax_updater_names_its_sum_and_its_updater_in_the_hlo():
    fn, state, grads = data_parallel_step(optax.adam(0.1))
    lowered = fn.lower(state, grads)
    text = lowered.as_text(debug_info=True)
    assert "jaxkv.sum" in text and "jaxkv.updater" in text
    names = op_names(lowered.compile().as_text()).values()
    assert any("jaxkv.sum/psum" in n or "jaxkv.sum/reduce_scatter" in n for n in names)
    assert any("/jaxkv.updater/" in n for n in names)


def test_compression_is_named_in_the_hlo_and_its_exchange_under_the_sum(devices):
    mesh = Mesh(np.array(devices), (AXIS,))
    blocks = jax.device_put(np.ones((D * 4, 3), np.float32), NamedSharding(mesh, P(AXIS)))
    for config in (("2bit", 0.5), ("fp16",)):
        mask = (True,) * D
        fn = functools.partial(compression.compress, config, [mask], axis=AXIS)
        run = jax.shard_map(
            lambda b, r, fn=fn: fn([b], [r]), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)
        )
        names = op_names(jax.jit(run).lower(blocks, blocks).compile().as_text()).values()
        assert any("jaxkv.compress/" in n for n in names), config
        exchange = functools.partial(compression.exchange, config, [False], axis=AXIS)
        run = jax.shard_map(
            lambda b, r, fn=exchange: fn([b], [r]),
            mesh=mesh,
            in_specs=P(AXIS),
            out_specs=P(AXIS),
            check_vma=False,
        )
        text = jax.jit(run).lower(blocks, blocks).as_text(debug_info=True)
        assert "jaxkv.compress/" in text and "jaxkv.sum/all_gather" in text, config


def test_a_row_push_in_the_users_step_names_its_route_its_sum_and_its_update():
    state = jaxkv.init(cpu_empty(bigarray_bound=SPLIT_BOUND), {"e": jnp.zeros((4096, 8))})
    assert state.is_sharded((4096, 8))
    specs = jaxkv.specs(state, AXIS)

    def step(state, ids, rows):
        return jaxkv.push_rows(state, "e", ids, rows, axis_name=AXIS)

    fn = jax.jit(
        jax.shard_map(step, mesh=state.mesh, in_specs=(specs, P(AXIS), P(AXIS)), out_specs=specs)
    )
    ids = sharded(state, np.arange(D * 2, dtype=np.int32) * 7)
    rows = sharded(state, np.ones((D * 2, 8), np.float32))
    names = op_names(fn.lower(state, ids, rows).compile().as_text()).values()
    for scope in ("jaxkv.rows.route", "jaxkv.sum", "jaxkv.updater"):
        assert any(f"/{scope}/" in n for n in names), scope


def test_a_trace_of_eager_pushes_carries_every_scope_in_its_hlo(tmp_path, devices):
    """The eager push's own computations (sum, 2-bit compression, an optax update over a
    bucket) and a routed row push: their HLO, saved in the trace, names each scope."""
    squeeze = jaxkv.init(
        cpu_empty(compression={"type": "2bit", "threshold": 0.5}), {"w": jnp.zeros((8, 4))}
    )
    opt = optax.adam(0.1)
    flat = jaxkv.init_optimizer(jaxkv.init(cpu_empty(layout="flat"), {"a": jnp.zeros(4)}), opt)
    # One array of its own, sharded (in a bucket its rows are updated where they lie, unrouted).
    table = jaxkv.init(cpu_empty(layout="keys"), {"e": jnp.zeros((4096, 8))})
    values = [jax.device_put(jnp.ones((8, 4)), d) for d in devices]
    ids = [jax.device_put(np.arange(4, dtype=np.int32) * 100 + i, d) for i, d in enumerate(devices)]
    rows = [jax.device_put(np.ones((4, 8), np.float32), d) for d in devices]

    def pushes():
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam
            return (
                jaxkv.push(squeeze, "w", values),
                jaxkv.push(
                    flat, "a", [jax.device_put(jnp.ones(4), d) for d in devices], updater=opt
                ),
                jaxkv.push_rows(table, "e", ids, rows),
            )

    _, xplane = traced(tmp_path, pushes)
    for scope in SCOPES:
        assert scope.encode() in xplane, scope


@pytest.mark.standard_promotion  # Adam
def test_the_trace_events_of_a_step_are_the_hlo_ops_under_jaxkvs_scopes(tmp_path):
    """What a Perfetto or TensorBoard trace shows of a step: on CPU each op's event names its
    module and instruction, whose op name holds the scope."""
    fn, state, grads = data_parallel_step(optax.adam(0.1))
    text = fn.lower(state, grads).compile().as_text()
    scope_of = op_names(text)
    module = re.search(r"^HloModule ([\w.\-]+)", text, re.MULTILINE).group(1)
    fn(state, grads)  # compiled before the trace

    events, _ = traced(tmp_path, lambda: fn(state, grads))
    ran = [
        e["args"]["hlo_op"]
        for e in events
        if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == module
    ]
    assert ran
    scopes = {s for op in ran for s in SCOPES if s in scope_of.get(op, "")}
    assert {"jaxkv.sum", "jaxkv.updater"} <= scopes


@pytest.mark.standard_promotion  # Adam
def test_a_push_and_a_pull_in_the_users_step_are_named_whole():
    """The whole push under ``jaxkv.push`` (its sum and updater inside it), the gathers of a
    pull under ``jaxkv.pull``."""
    fn, state, grads = data_parallel_step(optax.adam(0.1))
    text = fn.lower(state, grads).as_text(debug_info=True)
    assert "jaxkv.push/jaxkv.sum" in text and "jaxkv.push/jaxkv.updater" in text

    def step(state):
        return jaxkv.pull(state, "w", axis_name=AXIS)

    pull = jax.jit(
        jax.shard_map(
            step,
            mesh=state.mesh,
            in_specs=(jaxkv.specs(state, AXIS),),
            out_specs=P(),
            check_vma=False,
        )
    )
    assert "jaxkv.pull" in pull.lower(state).as_text(debug_info=True)


@pytest.mark.parametrize("layout", ["keys", "flat"])
def test_eager_calls_are_on_the_host_timeline_and_their_computation_named(
    tmp_path, devices, layout
):
    state = jaxkv.init(cpu_empty(layout=layout), {"w": jnp.zeros((8, 4))})
    values = [jax.device_put(jnp.ones((8, 4)), d) for d in devices]
    opt = optax.sgd(0.1)
    state = jaxkv.push(state, "w", values, updater=opt)  # compiled here, outside the trace

    def calls():
        new, got = jaxkv.pushpull(state, "w", values, updater=opt)
        return jaxkv.pull(new, "w"), got

    events, xplane = traced(tmp_path, calls)
    names = {e.get("name") for e in events}
    assert {"jaxkv.push", "jaxkv.pull", "jaxkv.pushpull"} <= names
    assert b"jaxkv.push/" in xplane  # the push computation's op names
