"""Does glibc's huge-page malloc (GLIBC_TUNABLES=glibc.malloc.hugetlb=1) speed up jaxkv on CPU?

XLA on CPU allocates a fresh temp buffer for every run of a computation; each new page costs a
minor page fault, and on a big step those faults can outweigh the arithmetic. With
``glibc.malloc.hugetlb=1`` glibc's malloc asks the kernel for transparent huge pages
(``madvise(MADV_HUGEPAGE)``), so a 2 MiB page takes one fault instead of 512. The tunable is read
when the process starts, so each measurement runs in a subprocess with and without it.

Workloads (8 simulated CPU devices, ResNet-50's 193 tensors, 25.6M float32):
  functional  jaxkv.pushpull eagerly: push one value per tensor from each of the 8 devices,
              pull the sum back to all 8 (the functional row of benchmarks/bench.py)
  psum-adam   the hand-written in-jit step: jax.jit + jax.shard_map (check_vma=False),
              per-device gradients summed with lax.psum, then optax.adam on replicated params
  jaxkv-jit   the same step through jaxkv.pull / jaxkv.push(updater=optax.adam, axis_name=...)
              with a replicated store (the README's shard_map idiom)
  ad-adam     (only with --only) psum-adam with shard_map's varying-axis tracking on, so that
              AD sums the gradients instead of an explicit lax.psum
  dist        (only with --only) python -m jaxkv.launch -n 2 --devices-per-process 2: a
              dist_sync KVStore, push from each process's 2 devices and pull to them; "on" is
              the launcher's default, "off" sets GLIBC_TUNABLES to an empty value; rank 0's
              numbers

For each: ms per step (median of the timed steps in one subprocess), minor page faults per step
(``ru_minflt`` deltas of the whole process) and system CPU per step. Rounds alternate which
setting goes first; the table gives the best and the median over rounds, and the ratios.

Usage: python benchmarks/hugetlb.py [--rounds 3] [--steps 3] [--only WORKLOAD]...
The default run starts 18 subprocesses: about 3.6 minutes of CPU time on this project's 2-core
machine, which took 5 to 6 minutes of wall time there while other work loaded it.

``child_env`` is the hook for other benchmarks: run a subprocess with ``env=child_env(True)``
and with ``env=child_env(False)`` to time the same code with and without the tunable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = os.path.join(HERE, "data", "resnet50_shapes.json")
TUNABLE = "glibc.malloc.hugetlb=1"
WORKLOADS = ("functional", "psum-adam", "jaxkv-jit")  # the default run
EXTRA = ("ad-adam", "dist")
D = 8


def child_env(tunable: bool, env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default: this process's) with GLIBC_TUNABLES set to the huge-page
    tunable (``tunable=True``) or removed (``False``)."""
    env = dict(os.environ if env is None else env)
    if tunable:
        env["GLIBC_TUNABLES"] = TUNABLE
    else:
        env.pop("GLIBC_TUNABLES", None)
    return env


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown (no /sys/kernel/mm/transparent_hugepage)"


# -- child: one workload, one setting ------------------------------------------------------------
def _child(work: str, steps: int) -> dict:
    import resource

    import jax

    if work == "dist":
        import jaxkv  # noqa: F401  (joins the launched job, with its device count, first)
    else:
        jax.config.update("jax_num_cpu_devices", D)
    import jax.numpy as jnp
    import numpy as np

    with open(SHAPES) as f:
        shapes = [tuple(s) for s in json.load(f)]
    devs = jax.devices()
    if work == "functional":
        step = _functional(jax, jnp, devs, shapes)
    elif work == "jaxkv-jit":
        step = _jaxkv_jit(jax, jnp, devs, shapes)
    elif work == "dist":
        step = _dist(jax, shapes)
    else:
        step = _hand_adam(jax, jnp, devs, shapes, explicit_psum=work == "psum-adam")
    step()
    step()  # warm: compiled, and the first outputs' layouts seen
    times, faults, sys_s = [], [], []
    for _ in range(steps):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        step()
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        times.append((t1 - t0) * 1e3)
        faults.append(r1.ru_minflt - r0.ru_minflt)
        sys_s.append((r1.ru_stime - r0.ru_stime) * 1e3)
    return {
        "ms": float(np.median(times)),
        "minflt": float(np.median(faults)),
        "sys_ms": float(np.median(sys_s)),
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "anon_huge_mb": _anon_huge_mb(),
    }


def _anon_huge_mb() -> float | None:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _functional(jax, jnp, devs, shapes):
    import jaxkv

    keys = list(range(len(shapes)))
    state = jaxkv.init(jaxkv.empty(), keys, [jnp.zeros(s) for s in shapes])
    grads = [[jax.device_put(jnp.ones(s), d) for d in devs] for s in shapes]
    box = [state]

    def step():
        box[0], pulled = jaxkv.pushpull(box[0], keys, grads, devices=devs, donate=True)
        jax.block_until_ready(pulled)

    return step


def _hand_adam(jax, jnp, devs, shapes, explicit_psum: bool):
    from functools import partial

    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(devs, ("d",))
    opt = optax.adam(1e-3)
    rep = NamedSharding(mesh, P())
    params = [jax.device_put(jnp.full(s, 0.5), rep) for s in shapes]
    opt_state = jax.device_put(opt.init(params), rep)
    x = _data(jax, jnp, mesh)

    # check_vma=False: gradients are per-device and summed by hand, the classic form. With it
    # on, the gradient of a replicated parameter comes back already summed by AD.
    @partial(jax.jit, donate_argnums=(0, 1))
    @partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), P(), P("d")),
        out_specs=(P(), P()),
        check_vma=not explicit_psum,
    )
    def train(p, s, x):
        g = jax.grad(_loss)(p, x)
        if explicit_psum:
            g = jax.lax.psum(g, "d")
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    box = [(params, opt_state)]

    def step():
        box[0] = train(*box[0], x)
        jax.block_until_ready(box[0])

    return step


def _jaxkv_jit(jax, jnp, devs, shapes):
    from functools import partial

    import optax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxkv

    mesh = Mesh(devs, ("d",))
    opt = optax.adam(1e-3)
    keys = list(range(len(shapes)))
    state = jaxkv.init(jaxkv.empty(bigarray_bound=None), keys, [jnp.full(s, 0.5) for s in shapes])
    x = _data(jax, jnp, mesh)

    @partial(jax.jit, donate_argnums=0)
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
    def train(state, x):
        g = jax.grad(_loss)(jaxkv.pull(state, keys), x)  # already summed: shard_map tracks it
        return jaxkv.push(state, keys, g, updater=opt, axis_name="d")

    box = [state]

    def step():
        box[0] = train(box[0], x)
        jax.block_until_ready(box[0])

    return step


def _dist(jax, shapes):
    import jaxkv.mx as mx

    keys = list(range(len(shapes)))
    local = range(len(jax.local_devices()))
    kv = mx.kv.create("dist_sync")
    kv.init(keys, [mx.nd.zeros(s) for s in shapes])
    grads = [[mx.nd.ones(s, mx.cpu(d)) for d in local] for s in shapes]
    outs = [[mx.nd.zeros(s, mx.cpu(d)) for d in local] for s in shapes]

    def step():
        kv.push(keys, grads)
        kv.pull(keys, out=outs)
        mx.nd.waitall()

    return step


def _data(jax, jnp, mesh):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.device_put(jnp.arange(D * 4, dtype=jnp.float32) / D, NamedSharding(mesh, P("d")))


def _loss(p, x):
    """Each device's data weighs every parameter: a full-shape gradient per device."""
    import jax.numpy as jnp

    return sum(jnp.sum(w * w) for w in p) * jnp.mean(x)


# -- parent: interleaved rounds ------------------------------------------------------------------
def _run(work: str, tunable: bool, steps: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", work, "--steps", str(steps)]
    env = child_env(tunable)
    if work == "dist":
        cmd[1:1] = ["-m", "jaxkv.launch", "-n", "2", "--no-prefix", "--devices-per-process", "2"]
        if not tunable:
            env["GLIBC_TUNABLES"] = ""  # a value of the user's own: the launcher keeps it
        else:
            env.pop("GLIBC_TUNABLES")  # the launcher's default
    out = subprocess.run(
        cmd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise SystemExit(f"{work} (hugetlb={int(tunable)}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", choices=WORKLOADS + EXTRA, action="append")
    parser.add_argument("--child", choices=WORKLOADS + EXTRA, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = _child(args.child, args.steps)
        if os.environ.get("JAXKV_PROCESS_ID", "0") == "0":
            print(json.dumps(result), flush=True)
        return

    print(f"THP: {thp_mode()}; {os.cpu_count()} cores; {D} simulated CPU devices", flush=True)
    works = args.only or list(WORKLOADS)
    res: dict[tuple[str, bool], list[dict]] = {(w, t): [] for w in works for t in (False, True)}
    start = time.perf_counter()
    for r in range(args.rounds):
        for w in works:
            for tunable in (False, True)[:: 1 if r % 2 == 0 else -1]:
                m = _run(w, tunable, args.steps)
                res[w, tunable].append(m)
                print(
                    f"round {r + 1}/{args.rounds} {w:<10} hugetlb={int(tunable)}: "
                    f"{m['ms']:7.1f} ms/step {m['minflt']:9.0f} faults/step "
                    f"{m['sys_ms']:6.1f} ms sys/step  peak RSS {m['maxrss_mb']:.0f} MB, "
                    f"{m['anon_huge_mb'] or 0:.0f} MB in huge pages  "
                    f"[{time.perf_counter() - start:.0f} s]",
                    flush=True,
                )
    print()
    print(
        "| workload | hugetlb | ms/step best | ms/step median | faults/step | sys ms/step "
        "| peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for w in works:
        for tunable in (False, True):
            ms = [m["ms"] for m in res[w, tunable]]
            flt = statistics.median(m["minflt"] for m in res[w, tunable])
            sy = statistics.median(m["sys_ms"] for m in res[w, tunable])
            rss = max(m["maxrss_mb"] for m in res[w, tunable])
            summary[w, tunable] = (min(ms), statistics.median(ms), flt)
            print(
                f"| {w} | {'on' if tunable else 'off'} | {min(ms):.1f} | "
                f"{statistics.median(ms):.1f} | {flt:,.0f} | {sy:.1f} | {rss:.0f} |"
            )
    print()
    for w in works:
        (b0, m0, f0), (b1, m1, f1) = summary[w, False], summary[w, True]
        print(
            f"{w}: off/on time {b0 / b1:.2f}x (best), {m0 / m1:.2f}x (median); "
            f"faults/step off/on {f0 / max(f1, 1):.1f}x"
        )


if __name__ == "__main__":
    main()
