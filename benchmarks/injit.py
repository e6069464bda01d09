"""The benchmark's in-jit section: one data-parallel optax.adam step on ResNet-50's 193 tensors,
8 CPU devices, hand-written beside jaxkv.push with a replicated and with a sharded store.

Every row runs the same model: the loss on device d is ``sum_k vdot(param_k, g_k[d])``, where
``g_k[d]`` is that device's gradient data for tensor k, so AD's gradient of parameter k on device
d is ``g_k[d]``; each step computes the loss (the forward reads the full parameters), sums the
gradients over the 8 devices and applies optax.adam.

Rows:
  hand-written psum   params and adam state replicated; the per-device gradient (AD w.r.t. a
                      varying copy of the params) is summed with lax.psum inside jax.shard_map
                      under jax.jit, then optax.adam updates the full params (donated)
  jaxkv replicated    jaxkv.empty(bigarray_bound=None) in the same shard_map step:
                      jaxkv.push(state, grads, updater=opt, axis_name='d'), where grads is AD's
                      gradient w.r.t. the stored values (already summed by shard_map's AD)
  jaxkv sharded       the default store (big tensors sharded 1/D per device) entering and leaving
                      shard_map with jaxkv.specs(state, 'd'); the forward all-gathers the params
                      with jaxkv.gather, so AD hands push shard-shaped, reduce-scattered grads
  jaxkv flat sharded  the same step with jaxkv.empty(layout="flat"): the 193 tensors and each
                      adam moment in one bucket split 1/D per device; the gather is one
                      all-gather and its gradient one reduce-scatter, adam one loop per device
  jaxkv pmap          the replicated store unmapped (in_axes=None) under jax.pmap, per-device
                      grads pushed with axis_name

Each ms/step is the median of at least 7 steps after warm-up, the best of 3 rounds; within a
round the rows are interleaved step by step (the order alternating), so a shared machine's
drifting load falls on every row alike. Compiles are counted over the timed rounds; state bytes
are those of the addressable shards on device 0.

Run as a script, it prints one JSON line (bench.py runs it so, with and without
GLIBC_TUNABLES=glibc.malloc.hugetlb=1).
"""

from __future__ import annotations

import functools
import json
import os
import resource
import sys
import time

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxkv  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = os.path.join(HERE, "data", "resnet50_shapes.json")
ROUNDS = 3
ROWS = (
    "hand-written psum",
    "jaxkv replicated",
    "jaxkv sharded",
    "jaxkv flat sharded",
    "jaxkv pmap",
)
HUGETLB = "glibc.malloc.hugetlb=1"


def device0_bytes(tree) -> int:
    """Bytes of the addressable shards of ``tree``'s leaves that live on the first device."""
    d0 = jax.devices()[0]
    return sum(
        s.data.nbytes
        for leaf in jax.tree_util.tree_leaves(tree)
        for s in leaf.addressable_shards
        if s.device == d0
    )


def layout_bytes(tree) -> tuple[int, int]:
    """(bytes of the leaves split across devices, bytes of the replicated leaves), full sizes."""
    sharded = replicated = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if leaf.sharding.is_fully_replicated:
            replicated += leaf.nbytes
        else:
            sharded += leaf.nbytes
    return sharded, replicated


class _Row:
    """One row: a jitted step, its carried state (params and optimizer state) and its data."""

    def __init__(self, step, carry, data):
        self.step, self.carry, self.data = step, carry, data

    def __call__(self):
        self.carry, loss = self.step(self.carry, self.data)
        jax.block_until_ready((self.carry, loss))


def _leaves(carry) -> list[np.ndarray]:
    """The carried arrays in tree order: params, then adam's count, mu and nu (the same order
    for the hand-written (params, opt_state) and for a KVState with one optimizer group)."""
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(carry)]


def _max_rel_diff(leaves: list[np.ndarray], ref: list[np.ndarray]) -> float | None:
    """max over leaves of max|a - b| / max|b|; None where the trees do not line up."""
    if len(leaves) != len(ref) or any(a.shape != b.shape for a, b in zip(leaves, ref)):
        return None
    return max(
        float(np.max(np.abs(a.astype(np.float64) - b)) / max(float(np.max(np.abs(b))), 1e-30))
        for a, b in zip(leaves, ref)
        if b.size
    )


def _reason(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def _rows(shapes, opt) -> tuple[dict, dict]:
    """Builds every row; returns ({name: _Row}, {name: reason not run})."""
    D = len(jax.devices())
    mesh = Mesh(jax.devices(), ("d",))
    keys = list(range(len(shapes)))
    # Parameters and, per tensor, one gradient block per device: g[k] has shape (D, *shape_k),
    # split along its first axis, device d holding g[k][d].
    params = {
        k: jax.device_put(jnp.full(s, 0.1, jnp.float32), NamedSharding(mesh, P()))
        for k, s in zip(keys, shapes)
    }
    scale = jnp.arange(1, D + 1, dtype=jnp.float32) * 1e-3

    @functools.partial(jax.jit, out_shardings=NamedSharding(mesh, P("d")))
    def make_grads():
        return {
            k: scale.reshape((D,) + (1,) * len(s)) * (k % 7 + 1) * jnp.ones((D,) + s, jnp.float32)
            for k, s in zip(keys, shapes)
        }

    grads = make_grads()

    def local(g):
        return {k: v[0] for k, v in g.items()}

    def loss(full, g_local):
        return sum(jnp.vdot(full[k], g_local[k]) for k in keys)

    rows, skipped = {}, {}

    # (a) hand-written: per-device gradient, lax.psum, optax.adam on the full replicated params.
    @functools.partial(jax.jit, donate_argnums=0)
    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=((P(), P()), P("d")), out_specs=((P(), P()), P("d"))
    )
    def hand(carry, g):
        p, s = carry
        g_local = local(g)
        # AD w.r.t. a varying copy gives this device's own gradient; psum sums it.
        value, grad = jax.value_and_grad(loss)(jax.lax.pcast(p, "d", to="varying"), g_local)
        grad = jax.lax.psum(grad, "d")
        updates, s = opt.update(grad, s, p)
        return (optax.apply_updates(p, updates), s), value[None]

    rows["hand-written psum"] = _Row(hand, (params, opt.init(params)), grads)

    init_optimizer = getattr(jaxkv, "init_optimizer", None)

    # (b) jaxkv.push with a replicated store inside the same shard_map step.
    @functools.partial(jax.jit, donate_argnums=0)
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P(), P("d")))
    def kv_replicated(state, g):
        value, grad = jax.value_and_grad(loss)(dict(state.values), local(g))
        return jaxkv.push(state, grad, updater=opt, axis_name="d"), value[None]

    # pmap: the replicated store unmapped; pmap tracks nothing, so push psums the gradients.
    @functools.partial(
        jax.pmap, axis_name="i", in_axes=(None, 0), out_axes=(None, 0), donate_argnums=0
    )
    def kv_pmap(state, g):
        value, grad = jax.value_and_grad(loss)(dict(state.values), g)
        return jaxkv.push(state, grad, updater=opt, axis_name="i"), value

    for name, step in [("jaxkv replicated", kv_replicated), ("jaxkv pmap", kv_pmap)]:
        if init_optimizer is None:
            skipped[name] = "jaxkv.init_optimizer is not in this jaxkv"
            continue
        try:
            state = jaxkv.init(jaxkv.empty(bigarray_bound=None), params)
            rows[name] = _Row(step, init_optimizer(state, opt), grads)
        except Exception as e:
            skipped[name] = _reason(e)

    # (c) jaxkv.push with a sharded store: the forward all-gathers the local shards
    # (jaxkv.gather), so AD's gradient w.r.t. them is already reduce-scattered, shard-shaped.
    missing = [n for n in ("specs", "gather", "init_optimizer") if not hasattr(jaxkv, n)]
    if missing:
        skipped["jaxkv sharded"] = f"jaxkv.{', jaxkv.'.join(missing)} not in this jaxkv"
        return rows, skipped

    def sharded_step(spec):
        @functools.partial(jax.jit, donate_argnums=0)
        @functools.partial(
            jax.shard_map, mesh=mesh, in_specs=(spec, P("d")), out_specs=(spec, P("d"))
        )
        def kv_sharded(state, g):
            g_local = local(g)

            def sharded_loss(mine):
                return loss(jaxkv.gather(state, mine, "d"), g_local)

            value, grad = jax.value_and_grad(sharded_loss)(dict(state.values))
            return jaxkv.push(state, grad, updater=opt, axis_name="d"), value[None]

        return kv_sharded

    # The default store (on CPU "auto": big tensors sharded one by one, small ones in a
    # bucket) and, where this jaxkv has it, the flat layout: one bucket split 1/D per device.
    for name, layout in (("jaxkv sharded", None), ("jaxkv flat sharded", "flat")):
        try:
            empty = jaxkv.empty() if layout is None else jaxkv.empty(layout=layout)
            state = jaxkv.init_optimizer(jaxkv.init(empty, params), opt)
            if layout == "flat" and not getattr(state.flat_layout, "split", False):
                skipped[name] = "this jaxkv splits no bucket"
                continue
            rows[name] = _Row(sharded_step(jaxkv.specs(state, "d")), state, grads)
        except Exception as e:
            skipped[name] = _reason(e)
    return rows, skipped


def run(counter, steps: int = 7, rounds: int = ROUNDS, log=print) -> dict:
    """Times every row, counting compiles with ``counter`` (bench.CompileCounter); returns
    {"rows": {name: {...}}, "skipped": {name: reason}, "devices": D, "glibc_tunables": ...}."""

    with open(SHAPES) as f:
        shapes = [tuple(s) for s in json.load(f)]
    opt = optax.adam(1e-3)
    t0 = time.perf_counter()
    rows, skipped = _rows(shapes, opt)
    log(f"  [in-jit] set-up {time.perf_counter() - t0:.1f} s")
    out: dict = {"skipped": skipped, "rows": {}}

    def fail(name, e):  # a row that fails is reported, never timed
        skipped[name] = _reason(e)
        del rows[name]

    for name in list(rows):
        try:  # warm-up: the first two steps compile (the second sees the first's outputs)
            t0 = time.perf_counter()
            rows[name]()
            rows[name]()
            log(f"  [in-jit] {name}: warm-up (compiles) {time.perf_counter() - t0:.1f} s")
        except Exception as e:
            fail(name, e)
    # Rows are interleaved step by step: in each round every row takes one untimed step, then
    # `steps` passes each time one step of every row (the order alternating between passes), so
    # the load of a shared machine, which drifts over seconds, falls on all rows alike.
    times: dict[str, list[float]] = {n: [] for n in rows}
    compiles = dict.fromkeys(rows, 0)
    faults: dict[str, list[int]] = {n: [] for n in rows}  # minor page faults per timed step
    for r in range(rounds):
        samples: dict[str, list[float]] = {n: [] for n in rows}
        for i in range(steps + 1):
            order = list(rows)
            for name in order if i % 2 == 0 else order[::-1]:
                if name not in rows:
                    continue
                try:
                    with counter() as c:
                        f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                        t = time.perf_counter()
                        rows[name]()
                        samples[name].append(time.perf_counter() - t)
                        if i:
                            faults[name].append(
                                resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f
                            )
                except Exception as e:
                    fail(name, e)
                    continue
                compiles[name] += c.count
        for name in rows:
            times[name].append(float(np.median(samples[name][1:]) * 1e3))
        log(
            f"  [in-jit] round {r + 1}/{rounds}: "
            + ", ".join(f"{n} {times[n][-1]:.1f} ms" for n in rows)
        )
    # Every row took the same steps from the same params with the same gradients, so all end
    # with the same params and adam moments (up to the order of the float sums).
    ref = _leaves(next(iter(rows.values())).carry) if rows else []
    out["reference"] = next(iter(rows), None)
    for name in rows:
        state = rows[name].carry
        sharded, replicated = layout_bytes(state)
        out["rows"][name] = {
            "ms": min(times[name]),
            "rounds": times[name],
            "compiles": compiles[name],
            "faults": float(np.median(faults[name])),
            "state_bytes": device0_bytes(state),
            "sharded_bytes": sharded,
            "replicated_bytes": replicated,
            "max_rel_diff": _max_rel_diff(_leaves(state), ref),
        }
    out["devices"] = len(jax.devices())
    out["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")
    return out


def goals(res: dict) -> list[str]:
    """The two goals of the in-jit section, with the measured ratios."""
    rows, D = res["rows"], res["devices"]
    lines = []
    a, c = rows.get("hand-written psum"), rows.get("jaxkv sharded")
    if a and c:
        ratio = a["ms"] / c["ms"]
        verdict = "met" if ratio >= 1.5 else "NOT met"
        per_round = ", ".join(f"{x / y:.2f}x" for x, y in zip(a["rounds"], c["rounds"]))
        lines.append(
            f"goal: sharded step >= 1.5x faster than hand-written psum: "
            f"{a['ms']:.1f} / {c['ms']:.1f} ms = {ratio:.3f}x ({verdict}; round by round "
            f"{per_round})"
        )
    else:
        lines.append("goal: sharded step >= 1.5x faster than hand-written psum: not run")
    if c:
        ideal = c["sharded_bytes"] / D + c["replicated_bytes"]
        ratio = c["state_bytes"] / ideal
        verdict = "met" if ratio <= 1.2 else "NOT met"
        lines.append(
            f"goal: sharded per-device state <= 1.2 x (sharded/{D} + replicated): "
            f"{c['state_bytes'] / 1e6:.1f} MB / {ideal / 1e6:.1f} MB = {ratio:.3f}x ({verdict})"
        )
    else:
        lines.append("goal: sharded per-device state <= 1.2 x (sharded/D + replicated): not run")
    return lines


def table(res: dict, label: str) -> list[str]:
    """One line per row: ms/step, vs hand-written, compiles, per-device state MB, and the
    largest relative difference of its final params and adam moments from the first row's."""
    rows = res["rows"]
    base = rows.get("hand-written psum")
    lines = []
    for name in ROWS:
        if name in rows:
            r = rows[name]
            speed = f"{base['ms'] / r['ms']:.2f}x" if base else "—"
            lines.append(
                f"{label:<14} {name:<18} {r['ms']:8.1f} ms/step  {speed:>6} vs hand-written  "
                f"compiles {r['compiles']}  state {r['state_bytes'] / 1e6:6.1f} MB/device  "
                f"faults/step {r.get('faults', 0) / 1e3:.0f}K  max rel. diff {_diff(r)}"
            )
        else:
            reason = res["skipped"].get(name, "not built")
            lines.append(f"{label:<14} {name:<18} not run: {reason}")
    return lines


def _diff(row: dict) -> str:
    d = row.get("max_rel_diff")
    return "—" if d is None else f"{d:.1e}"


def run_subprocess(
    steps: int, rounds: int, hugetlb: bool, cache_dir: str | None = None, log=print
) -> dict:
    """The section in a fresh process, with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 or without
    GLIBC_TUNABLES; its progress lines pass through, its JSON result is returned. Processes
    given the same ``cache_dir`` share JAX's persistent compilation cache (the steps compile
    once; a cache hit still counts as a compile)."""
    import subprocess  # noqa: PLC0415

    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    if hugetlb:
        env["GLIBC_TUNABLES"] = HUGETLB
    if cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--steps", str(steps), "--rounds", str(rounds)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    result = None
    for line in proc.stdout:
        if line.startswith("{"):
            result = json.loads(line)
        else:
            log(line.rstrip())
    if proc.wait() != 0 or result is None:
        reason = f"the subprocess exited with {proc.returncode}"
        return {"rows": {}, "skipped": dict.fromkeys(ROWS, reason), "devices": 8}
    return result


def main() -> None:
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    from bench import CompileCounter  # noqa: PLC0415

    res = run(CompileCounter, max(args.steps, 7), args.rounds, log=lambda m: print(m, flush=True))
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
