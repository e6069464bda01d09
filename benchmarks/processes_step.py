"""The in-jit data-parallel step across processes, measured: a 256 -> 2048 x 3 -> 16 MLP
(8.95M float32 parameters, AdamW), each process one CPU device, run under the launcher:

    python -m jaxkv.launch -n P --devices-per-process 1 --no-prefix \\
        benchmarks/processes_step.py [STEPS] [ROW ...]

Rows (default: all four), in turns within each of 3 rounds; each row's time is the mean of
STEPS steady steps, the best of the rounds (the first 3 steps, which compile, not timed):
  gspmd             plain jit over the global mesh, every leaf of at least the store's default
                    bound (16384 elements) whose rows divide by the devices split by rows
                    (NamedSharding), the rest replicated, the batch split: XLA places the
                    collectives and the optimizer state
  jaxkv             the README's step: jaxkv.gather and jaxkv.push inside shard_map over a store
                    spanning every process's devices (``jaxkv.empty()``'s default bound),
                    verified sums as by default across processes (a twentieth of each sum
                    checked at every step, another twentieth each step)
  jaxkv-every-sum   the same with JAXKV_VERIFY_SUMS=1 (every step checked)
  jaxkv-unverified  the same with JAXKV_VERIFY_SUMS=0
  jaxkv-verify-N    the same with JAXKV_VERIFY_SUMS=N (an N-th of each sum checked at each run;
                    a large N: what the check's machinery costs, its dots next to nothing)
  jaxkv-jit         docs/functional.md's plain-jit recipe: the gradient with respect to the
                    store's values (a dict of its keys) and jaxkv.push in one jax.jit (no
                    shard_map), the same store
  jaxkv-jit-every-sum, jaxkv-jit-unverified
                    the same with JAXKV_VERIFY_SUMS=1 and =0
  shard_map-by-hand the same step written by hand in shard_map, no jaxkv: parameters and
                    optimizer state replicated, the gradients summed by lax.psum
  jaxkv-jit-bound-2048
                    the same with a bigarray_bound of 2048: the biases split too, as XLA
                    splits GSPMD's

Each process prints one line per row, as JSON (``benchmarks/processes.py`` reads them): its
rank, the row, ms/step, the bytes of parameters and optimizer state on its devices and of the
whole state, its bytes written (sockets included: gloo's messages) per step, the collectives in
the compiled step, and its resident set: at the start of the row and its peak (a row run alone
in a fresh job has its own peak; rows run together share one).
"""

import json
import os
import resource
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
ROWS = sys.argv[2:] or ["gspmd", "jaxkv", "jaxkv-every-sum", "jaxkv-unverified"]
WIDTHS = [256, 2048, 2048, 2048, 16]
BATCH = 64  # per device
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


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


def rss_mb(peak=False):
    """This process's resident set now, or its peak so far, in MB."""
    if peak:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def written():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def held(tree):
    leaves = jax.tree_util.tree_leaves(tree)
    mine = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    return mine, sum(x.nbytes for x in leaves)


def collectives(step, *args):
    text = step.lower(*args).compile().as_text()
    return sum(text.count(f" {op}(") + text.count(f" {op}-start(") for op in COLLECTIVES)


def timed(rows, batch, rounds=3):
    """Each row's mean step time (ms, the best of ``rounds``) and bytes written per step."""
    best = {name: float("inf") for name in rows}
    sent = {}
    carries = {name: carry for name, (_, carry) in rows.items()}
    for r in range(rounds):
        for name, (step, _) in rows.items():
            times = []
            for i in range((3 if r == 0 else 0) + STEPS):
                start, before = time.perf_counter(), written()
                carries[name] = step(carries[name], *batch)
                jax.block_until_ready(carries[name])
                if r or i >= 3:
                    times.append(time.perf_counter() - start)
                    sent.setdefault(name, []).append(written() - before)
            best[name] = min(best[name], 1e3 * statistics.fmean(times))
    return best, {name: statistics.fmean(v) for name, v in sent.items()}, carries


def main():
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("kv",))
    split = NamedSharding(mesh, P("kv"))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n * BATCH, WIDTHS[0])).astype(np.float32)
    y = rng.standard_normal((n * BATCH, WIDTHS[-1])).astype(np.float32)
    batch = [jax.make_array_from_callback(a.shape, split, lambda i, a=a: a[i]) for a in (x, y)]
    opt = optax.adamw(1e-3)
    bound = jaxkv.empty(devices).bigarray_bound  # the store's default, GSPMD's rule too
    steps, info = {}, {}

    for name in ROWS:
        start = rss_mb()
        if name == "gspmd":

            def where(a):
                return (
                    split if a.size >= bound and a.shape[0] % n == 0 else NamedSharding(mesh, P())
                )

            p = {k: jax.device_put(v, where(v)) for k, v in params0().items()}
            carry = (p, jax.jit(opt.init)(p))

            @partial(jax.jit, donate_argnums=0)
            def step(carry, x, y):
                p, s = carry
                g = jax.grad(loss_fn)(p, x, y)
                u, s = opt.update(g, s, p)
                return optax.apply_updates(p, u), s

        elif name == "shard_map-by-hand":  # no jaxkv: the same step written in shard_map
            p = {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in params0().items()}
            carry = (p, jax.jit(opt.init)(p))

            @partial(jax.jit, donate_argnums=0)
            @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("kv"), P("kv")), out_specs=P())
            def step(carry, x, y):
                p, s = carry
                g = jax.lax.psum(jax.grad(loss_fn)(p, x, y), "kv")
                g = jax.tree.map(lambda a: a / n, g)
                u, s = opt.update(g, s, p)
                return optax.apply_updates(p, u), s

        elif name.startswith("jaxkv-jit"):  # docs/functional.md's plain-jit recipe
            setting = {"jaxkv-jit-unverified": "0", "jaxkv-jit-every-sum": "1"}.get(name)
            if setting is None:
                os.environ.pop(verified.ENV_VERIFY_SUMS, None)
            else:
                os.environ[verified.ENV_VERIFY_SUMS] = setting
            small = 2048 if name == "jaxkv-jit-bound-2048" else None
            store = jaxkv.empty(devices, bigarray_bound=small) if small else jaxkv.empty(devices)
            state = jaxkv.init(store, params0())
            carry = jaxkv.init_optimizer(state, opt)

            @partial(jax.jit, donate_argnums=0)
            def step(state, x, y):
                grads = jax.grad(loss_fn)(dict(state.values), x, y)
                return jaxkv.push(state, grads, updater=opt)

        else:
            setting = {"jaxkv-unverified": "0", "jaxkv-every-sum": "1"}.get(name)
            if name.startswith("jaxkv-verify-"):  # JAXKV_VERIFY_SUMS=N: an N-th at each run
                setting = name.removeprefix("jaxkv-verify-")
            if setting is None:  # jaxkv's default across processes: a twentieth of each sum
                os.environ.pop(verified.ENV_VERIFY_SUMS, None)
            else:
                os.environ[verified.ENV_VERIFY_SUMS] = setting
            state = jaxkv.init(jaxkv.empty(devices), params0())
            carry = jaxkv.init_optimizer(state, opt)
            specs = jaxkv.specs(carry, "kv")

            @partial(jax.jit, donate_argnums=0)
            @partial(
                jax.shard_map,
                mesh=carry.mesh,
                in_specs=(specs, P("kv"), P("kv")),
                out_specs=specs,
            )
            def step(state, x, y):
                def loss(local):
                    return loss_fn(jaxkv.gather(state, local, "kv"), x, y) / n

                grads = jax.grad(loss)(dict(state.values))
                return jaxkv.push(state, grads, updater=opt, axis_name="kv")

        info[name] = {"collectives": collectives(step, carry, *batch), "rss_start_mb": start}
        steps[name] = (step, carry)
    ms, sent, carries = timed(steps, batch)
    for name in ROWS:
        mine, whole = held(carries[name])
        line = {
            "rank": jax.process_index(),
            "processes": jax.process_count(),
            "row": name,
            "ms": ms[name],
            "state_bytes": mine,
            "whole_state_bytes": whole,
            "sent_bytes_per_step": sent[name],
            "rss_peak_mb": rss_mb(peak=True),
            **info[name],
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
