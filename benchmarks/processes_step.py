"""The in-jit data-parallel step across processes, timed: a 256 -> 2048 x 3 -> 16 MLP
(8.95M float32 parameters, AdamW), each process one CPU device, run under the launcher:

    python -m jaxkv.launch -n 2 --devices-per-process 1 --no-prefix \\
        benchmarks/processes_step.py [STEPS]

Rows, each the median of STEPS steady steps (after 3 warm-up steps, which compile), the best
of 3 rounds in which the rows take turns:
  gspmd          plain jit over the global mesh, parameters and AdamW state sharded along rows
                 (NamedSharding), the batch split: XLA places the collectives
  jaxkv          the README's step: jaxkv.gather and jaxkv.push inside shard_map over a store
                 spanning every process's devices, verified sums on (the default across
                 processes)
  jaxkv-unverified  the same with JAXKV_VERIFY_SUMS=0

Process 0 prints one line per row: ``ROW ms/step MEDIAN``, and the verified sums' cost.
"""

import os
import statistics
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv
from jaxkv._src.core import verified

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
WIDTHS = [256, 2048, 2048, 2048, 16]
BATCH = 64  # per device


def params0():
    rng = np.random.default_rng(0)
    out = {}
    for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        out[f"k{i}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        out[f"b{i}"] = np.zeros(b, np.float32)
    return out


def forward(p, x):
    for i in range(len(WIDTHS) - 1):
        x = x @ p[f"k{i}"] + p[f"b{i}"]
        if i < len(WIDTHS) - 2:
            x = jnp.tanh(x)
    return x


def loss_fn(p, x, y):
    return jnp.mean((forward(p, x) - y) ** 2)


def timed(rows, batch, rounds=3):
    """Each row's median step time, in ms: the best of ``rounds`` rounds, the rows taking
    turns within a round (the machine's load changes over seconds). Each row is ``(step,
    carry)``; the first round's first 3 steps (which compile) are not timed."""
    best = {name: float("inf") for name in rows}
    carries = {name: carry for name, (_, carry) in rows.items()}
    for r in range(rounds):
        for name, (step, _) in rows.items():
            times = []
            for i in range((3 if r == 0 else 0) + STEPS):
                start = time.perf_counter()
                carries[name] = step(carries[name], *batch)
                jax.block_until_ready(carries[name])
                if r or i >= 3:
                    times.append(time.perf_counter() - start)
            best[name] = min(best[name], 1e3 * statistics.median(times))
    return best


def main():
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("kv",))
    rows = NamedSharding(mesh, P("kv"))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n * BATCH, WIDTHS[0])).astype(np.float32)
    y = rng.standard_normal((n * BATCH, WIDTHS[-1])).astype(np.float32)
    batch = [jax.make_array_from_callback(a.shape, rows, lambda i, a=a: a[i]) for a in (x, y)]
    opt = optax.adamw(1e-3)
    steps = {}

    # GSPMD: every leaf of at least 1M elements split along rows, as the store splits them.
    def spec(a):
        return rows if a.size >= 1 << 20 and a.shape[0] % n == 0 else NamedSharding(mesh, P())

    p = {k: jax.device_put(v, spec(v)) for k, v in params0().items()}
    s = jax.jit(opt.init)(p)

    @partial(jax.jit, donate_argnums=0)
    def gspmd(carry, x, y):
        p, s = carry
        g = jax.grad(loss_fn)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    steps["gspmd"] = (gspmd, (p, s))

    for name, verify in (("jaxkv", "1"), ("jaxkv-unverified", "0")):
        os.environ[verified.ENV_VERIFY_SUMS] = verify
        state = jaxkv.init(jaxkv.empty(devices, bigarray_bound=1 << 20), params0())
        state = jaxkv.init_optimizer(state, opt)
        specs = jaxkv.specs(state, "kv")

        @jax.jit
        @partial(
            jax.shard_map, mesh=state.mesh, in_specs=(specs, P("kv"), P("kv")), out_specs=specs
        )
        def step(state, x, y):
            def loss(local):
                return loss_fn(jaxkv.gather(state, local, "kv"), x, y) / n

            grads = jax.grad(loss)(dict(state.values))
            return jaxkv.push(state, grads, updater=opt, axis_name="kv")

        jax.block_until_ready(step(state, *batch))  # traced now, with this JAXKV_VERIFY_SUMS
        steps[name] = (step, state)
    results = timed(steps, batch)
    if jax.process_index() == 0:
        for name, ms in results.items():
            print(f"{name} ms/step {ms:.1f}", flush=True)
        cost = results["jaxkv"] / results["jaxkv-unverified"] - 1
        print(
            f"verified sums cost {100 * cost:+.1f}% of a step; jaxkv/gspmd speed "
            f"{results['gspmd'] / results['jaxkv']:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
