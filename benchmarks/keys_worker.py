"""1000 keys x 8 devices, list push and pull, written once against an ``mx`` module: jaxkv's
drop-in (``jaxkv.mx``) or Apache MXNet 1.9.1's own; and its floor, the same step written by
hand in JAX.

A ``device`` store over 8 CPU devices (jaxkv: JAX's 8 simulated CPU devices; MXNet:
``mx.cpu(0)`` to ``mx.cpu(7)``), ``kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))``,
1000 keys of 16 x 16 float32 initialised as one list, and per step ``kv.push(keys, grads)``
(per key a list of 8 per-device gradients) then ``kv.pull(keys, out=outs)`` (per key 8
per-device outs) and ``mx.nd.waitall()``. The same gradients every step, multiples of 1/1024
small enough that their sum over the devices is exact in any order, so both libraries' values
agree to the bit.

    python keys_worker.py jaxkv|mxnet|floor [--steps 23] [--pieces] [--store device|local]

``--store local`` makes a ``local`` store instead (MXNet's takes as long here: with an optimizer
on the store, both run MXNet's Python updater key by key).

Prints ``keys <name> first_ms=<x> median_ms=<x> compiles=<n> checksum=<x>``: the first step
(start-up: compiles), the median of the steps after the 3 warm-up steps, the compiles after
them (jaxkv and floor; -1 for MXNet), and the float64 sum of 4 keys' pulled values on every
device after the last step (the same in every library).

``--pieces`` (jaxkv and MXNet) times each call of the step on its own (``time.perf_counter``
around ``kv.push``, ``kv.pull`` and ``mx.nd.waitall``) and prints ``pieces <name> step_ms=<x>
push_ms=<x> pull_ms=<x> waitall_ms=<x>``: each piece's median over the timed steps and the
median step (the sum of its pieces). A round of its own: the timing perturbs the step.

The floor (``floor``): the fastest hand-written JAX found for the same step with the same
buffers in and out (8000 per-device gradient arrays in, 8000 per-device out arrays back, every
step), the weights kept as one (1000, 16, 16) buffer replicated on the 8 devices (a store may
keep them so), per step:
  1. per device, one jit stacks its 1000 gradients into one (1000, 16, 16) buffer (8 calls);
  2. one jit over the 8 devices (``shard_map``): one all-reduce (``psum``) of the stacked
     gradients, SGD on the replicated weights (donated, each product rounded as MXNet's
     kernel rounds it), and the 1000 new weights as 1000 outputs, each replicated;
  3. the per-device outs: each output's 8 single-device arrays (``jax.Array``'s private
     ``_arrays``, where it has it; ``addressable_shards`` otherwise).
What else was tried (this machine, 2 cores shared, medians of 10 steps): one jit taking each
key's 8 gradients as one global array, wrapped every step
(``jax.make_array_from_single_device_arrays`` per key: 94 ms a step for the wrapping alone;
JAX's private ``ArrayImpl(..., _skip_checks=True)``: 27 ms), then 1000 psums (170-200 ms) or
one psum of the keys stacked in the jit (53 ms; 142 ms a step in all); per-device jits
unstacking the new weights into 1000 outputs each (8 calls, 40-53 ms) instead of the mesh jit's
1000 replicated outputs (29 ms).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np
from compiles import Compiles  # benchmarks/compiles.py

KEYS, SHAPE, D = 1000, (16, 16), 8
LR = 0.1
WARM = 3
CHECKED = (0, 1, 499, 999)  # the keys whose pulled values are summed


def _count_compiles() -> Compiles:
    import jax

    counter = Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    logger.propagate = False  # counted, not printed
    jax.config.update("jax_log_compiles", True)
    return counter


def data() -> tuple[np.ndarray, np.ndarray]:
    """The initial weights (1000, 16, 16) and the gradients (1000, 8, 16, 16): multiples of
    1/64 and 1/1024, every sum of 8 gradients exact in float32."""
    rng = np.random.default_rng(0)
    init = rng.integers(-64, 65, size=(KEYS, *SHAPE)).astype(np.float32) / 64
    grads = rng.integers(-64, 65, size=(KEYS, D, *SHAPE)).astype(np.float32) / 1024
    return init, grads


def _line(name: str, times: list[float], compiles: int, checksum: float) -> str:
    return (
        f"keys {name} first_ms={times[0] * 1e3:.1f} median_ms={np.median(times[WARM:]) * 1e3:.3f} "
        f"compiles={compiles} checksum={checksum:.9g}"
    )


def run(mx, name: str, steps: int, pieces: bool, store: str = "device") -> None:
    counter = _count_compiles() if name == "jaxkv" else None
    init, grad_values = data()
    keys = list(range(KEYS))
    kv = mx.kv.create(store)
    kv.init(keys, [mx.nd.array(x) for x in init])
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=LR))
    ctxs = [mx.cpu(d) for d in range(D)]
    grads = [[mx.nd.array(grad_values[k, d], ctx=c) for d, c in enumerate(ctxs)] for k in keys]
    outs = [[mx.nd.zeros(SHAPE, ctx=c) for c in ctxs] for _ in keys]
    mx.nd.waitall()
    times, parts, compiled_before = [], [], 0
    for step in range(steps):
        if step == WARM and counter is not None:
            compiled_before = counter.count
        t0 = time.perf_counter()
        kv.push(keys, grads)
        t1 = time.perf_counter() if pieces else 0.0
        kv.pull(keys, out=outs)
        t2 = time.perf_counter() if pieces else 0.0
        mx.nd.waitall()
        t3 = time.perf_counter()
        times.append(t3 - t0)
        if pieces:
            parts.append((t1 - t0, t2 - t1, t3 - t2))
    # (counted over the timed steps: the checksum's read below may compile a view of the keys)
    compiles = -1 if counter is None else counter.count - compiled_before
    got = [o.asnumpy().astype(np.float64) for k in CHECKED for o in outs[k]]
    print(_line(name, times, compiles, float(sum(x.sum() for x in got))), flush=True)
    if pieces:
        p = np.median(np.array(parts[WARM:]), axis=0) * 1e3
        print(
            f"pieces {name} step_ms={np.median(times[WARM:]) * 1e3:.3f} push_ms={p[0]:.3f} "
            f"pull_ms={p[1]:.3f} waitall_ms={p[2]:.3f}",
            flush=True,
        )


def floor(steps: int) -> None:
    """The step written by hand in JAX (the module's docstring says how)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    counter = _count_compiles()
    init, grad_values = data()
    devices = jax.devices("cpu")[:D]
    mesh = Mesh(np.array(devices), ("d",))
    split, whole = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    weights = jax.device_put(init, whole)
    grads = [
        [jax.device_put(grad_values[k, d], dev) for d, dev in enumerate(devices)]
        for k in range(KEYS)
    ]
    per_device = [[grads[k][d] for k in range(KEYS)] for d in range(D)]
    outs = [
        [jax.device_put(np.zeros(SHAPE, np.float32), dev) for dev in devices] for _ in range(KEYS)
    ]
    z = np.int32(0)

    stack = jax.jit(lambda *gs: jnp.stack(gs))

    def body(w, g, z):
        s = jax.lax.psum(g, "d")  # one all-reduce of every key's gradients
        # MXNet's sgd_update: weight - lr * grad, the product rounded on its own (its bits or-ed
        # with an int32 zero XLA cannot see, so that it is not fused into an FMA)
        step = jax.lax.bitcast_convert_type(np.float32(LR) * s, jnp.int32) | z
        new = w - jax.lax.bitcast_convert_type(step, jnp.float32)
        return new, [new[k] for k in range(KEYS)]

    update = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d"), P()), out_specs=(P(), P())),
        donate_argnums=0,
    )

    def shards(x: jax.Array) -> list[jax.Array]:
        arrays = getattr(x, "_arrays", None)  # private: the per-device arrays, made already
        return list(arrays) if arrays is not None else [s.data for s in x.addressable_shards]

    times, compiled_before = [], 0
    for step in range(steps):
        if step == WARM:
            compiled_before = counter.count
        t = time.perf_counter()
        stacked = [stack(*g) for g in per_device]
        g = jax.make_array_from_single_device_arrays((D * KEYS, *SHAPE), split, stacked)
        weights, new = update(weights, g, z)
        outs = [shards(x) for x in new]
        jax.block_until_ready(outs)
        times.append(time.perf_counter() - t)
    got = [np.asarray(o).astype(np.float64) for k in CHECKED for o in outs[k]]
    assert all(o.devices() == {d} for o, d in zip(outs[0], devices)), "outs on the wrong devices"
    print(
        _line("floor", times, counter.count - compiled_before, float(sum(x.sum() for x in got))),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=["jaxkv", "mxnet", "floor"])
    parser.add_argument("--steps", type=int, default=23)
    parser.add_argument("--pieces", action="store_true", help="time each call of the step")
    parser.add_argument("--store", default="device", choices=["device", "local"])
    args = parser.parse_args()
    if args.name == "mxnet":
        import mxnet as mx

        run(mx, args.name, args.steps, args.pieces, args.store)
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", D)
    if args.name == "floor":
        floor(args.steps)
        return
    import jaxkv.mx as mx

    run(mx, args.name, args.steps, args.pieces, args.store)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
