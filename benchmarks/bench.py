"""jaxkv's benchmark: push from D devices then pull to D devices, beside its baselines.

Where it ran heads the log and results.md: JAX's default backend, its device kind and count,
the CPU devices used, the library versions. Every section but the GPU one runs on CPU devices
taken explicitly (``jax.devices("cpu")``; the sections run in processes of their own get
JAX_PLATFORMS=cpu), so it means the same on a machine with an accelerator.

Workloads (8 simulated CPU devices):
  resnet50  the 193 parameter tensors of ResNet-50 (25.6M float32)
  small     1000 keys of 16x16 float32
  in-jit    one data-parallel optax.adam step on the resnet50 tensors inside jit + shard_map
            (and pmap): hand-written lax.psum beside jaxkv.push with a replicated and with a
            sharded store, with and without GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (each in a
            fresh process; benchmarks/injit.py says what each row does)
  processes the in-jit data-parallel step of a 2048-wide MLP in 1, 2, 3 and 4 launched
            processes: GSPMD beside jaxkv with and without verified sums (benchmarks/processes.py)
  mesh      the 2-axis in-jit step of examples/flax_mesh.py (a flax MLP on a 2 x 4 mesh, data x
            model, tensor parallel along model inside the step): jaxkv.push with axis_name beside
            the same step with lax.pmean and optax by hand (benchmarks/mesh_step.py); and the
            training step of examples/gpt_mesh.py (a flax GPT on 8 devices): GSPMD + optax with
            FSDP shardings beside jaxkv's plain-jit and shard_map recipes, in one process (each
            row's peak RSS in a process of its own) and in 2 launched processes of 4 devices
            (benchmarks/gpt_step.py)

Columns: jaxkv imperative (jaxkv.mx KVStore with nd outs, as in the MXNet tutorial), jaxkv
functional (jaxkv.pushpull with per-device jax.Arrays), a naive per-key JAX loop, a
single-threaded NumPy reduce-and-copy, the memory-bandwidth floor, and MXNet 1.9.1 (run with
its own venv beside this one; "not run" where that venv is absent).

Every time is the median of at least 7 timed steps after warm-up, the best of three rounds
that time jaxkv, MXNet and the copy bandwidth back to back; ratios compare numbers from this run
only. Writes benchmarks/results.md and benchmarks/results.png.

  dist      ResNet-50 push + pull in 2 processes (1, then 2 devices each), jaxkv dist_sync
            beside MXNet 1.9.1 dist_sync with 2 servers (benchmarks/dist.py)

The resnet50 rows are also timed with JAXKV_NO_FAST_PATHS=1 (no private JAX names), in
processes of their own.

One device, SGD push + pull, beside a hand-written jitted update (benchmarks/eager.py):
  proxy     CPU device 0, always run: ResNet-50's 193 keys and 1000 keys with every dimension
            cut to at most 2, so the host's and the per-buffer cost alone are timed; hand-written
            JAX, jaxkv functional and imperative, with their goal (<= 1.2x each)
  gpu       the accelerator's first device, the full key sets; the rows above, PyTorch's foreach
            ops and the copy floor; skipped where JAX's default backend is cpu, unless
            JAXKV_BENCH_GPU_ON_CPU=1 runs it on CPU device 0 (to test it; 10 steps a round)
  Both check each row's values after a few steps against the hand-written row's.

One device, one in-jit training step (benchmarks/step.py): jax.grad of a loss that reads every
parameter, then optax.adam or optax.sgd, in one jax.jit with the state donated; hand-written
optax over the 193 tensors, optax.flatten, a flat buffer read through per-tensor views, jaxkv
per key and with the flat layout, PyTorch's Adam (fused, foreach) and SGD (foreach) step alone:
  step      ResNet-50's tensors cut to at most 2 per dimension and full size on CPU device 0,
            then full size on the accelerator's first device (skipped where JAX's default
            backend is cpu, unless JAXKV_BENCH_GPU_ON_CPU=1); each row's values checked

Sparse embeddings (benchmarks/rows.py): a 1M x 64 (and 10M x 64) float32 table, 1,000 random
rows per device per step pushed from 8 CPU devices with lazy SGD and pulled back to each, jaxkv
functional and imperative beside MXNet 1.9.1's row_sparse path and jaxkv's dense path:
  rows      run in a process of its own, MXNet's in its venv

The Gluon/Module loop (benchmarks/gluon.py): MXNet training code's own store calls, the
optimizer on the store (SGD with momentum and weight decay), ResNet-50's 193 tensors at full size
on 8 CPU devices, jaxkv (JAXKV_LAYOUT=auto and keys) beside MXNet 1.9.1 (benchmarks/mxnet_gluon.py):
  gluon     a `device` store: kv.init key by key, then per step and key kv.push(i, grads,
            priority=-i) and kv.pull(i, out=weights, priority=-i); the start-up (seconds, XLA
            compiles, peak RSS beside the data held) and the steady step; then dist_sync in 2
            processes; values checked against a NumPy model and between the sides. Each side in
            a process of its own, stopped (and reported so) past --gluon-timeout seconds of
            start-up or --gluon-mem-gb GB; --gluon-scale K divides every dimension by K and
            --gluon-keys N takes the first N keys, to try it quickly

New keys (benchmarks/new_keys.py): 100 keys made one at a time (init, push, pull, read), from a
fresh process, per updater (none, a Python updater, MXNet's SGD and Adam, optax.adam), jaxkv's
seconds and compiles beside MXNet 1.9.1's seconds:
  new-keys  each side and updater in a process of its own

Host time (benchmarks/host.py): the embedding loop on one device, 1000 keys x 8 devices pushed
and pulled as lists, the embedding loop in 2 processes, and the 100-key Python-updater start-up,
jaxkv beside MXNet 1.9.1 and hand-written JAX floors (benchmarks/embedding_floor.py,
benchmarks/keys_worker.py), in interleaved rounds, with per-round ratios, the issue's goals and
where jaxkv's host time goes (each call's share of the step):
  host      every run in a process of its own; --host-rounds R (default 3), --host-steps S
            (each embedding run's steps, default 60), --host-keys-steps S (each keys run's,
            default 23) to try it quickly

Usage: python benchmarks/bench.py [--steps 7] [--quick]
         [--only in-jit|mesh|processes|dist|proxy|gpu|step|rows|gluon|new-keys|host]
         [--eager-steps 200] [--step-steps 200]
         [--gluon-scale 1] [--gluon-keys N] [--gluon-timeout 900] [--gluon-mem-gb G]
         [--gluon-dist-devices 1 [2]] [--gluon-dist-processes 1 2 3 4]
         [--host-rounds 3] [--host-steps 60] [--host-keys-steps 23]
--only proxy / --only gpu / --only step exit 1 where a hand-written or jaxkv row fails or its
values differ (a missed goal is reported, not an error); the full run does so after writing its
report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import threading
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import dist  # noqa: E402  (benchmarks/dist.py)
import eager  # noqa: E402  (benchmarks/eager.py)
import gluon  # noqa: E402  (benchmarks/gluon.py)
import gpt_step  # noqa: E402  (benchmarks/gpt_step.py)
import host  # noqa: E402  (benchmarks/host.py)
import jax.numpy as jnp  # noqa: E402
import mesh_step  # noqa: E402  (benchmarks/mesh_step.py)
import new_keys  # noqa: E402  (benchmarks/new_keys.py)
import numpy as np  # noqa: E402
import processes  # noqa: E402  (benchmarks/processes.py)
import rows as sparse_rows  # noqa: E402  (benchmarks/rows.py)
import step  # noqa: E402  (benchmarks/step.py)

import jaxkv  # noqa: E402
import jaxkv.mx as mx  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = os.path.join(HERE, "data", "resnet50_shapes.json")  # ResNet-50 v1's 193 tensors
MXNET_VENV = os.environ.get("MXNET_VENV", os.path.join(HERE, "..", ".venv-mxnet"))
D = 8
ROUNDS = 3


def log(msg: str) -> None:
    print(msg, flush=True)


def cpu_devices() -> list[jax.Device]:
    """The D CPU devices the multi-device sections run on, asked for by platform."""
    devs = jax.devices("cpu")
    if len(devs) < D:
        raise RuntimeError(f"expected {D} CPU devices (jax_num_cpu_devices), found {len(devs)}")
    return devs[:D]


def where() -> str:
    """Where this run happens: JAX's default backend, its device kind and count, the CPU
    devices the CPU sections use, the machine and the library versions."""
    import jaxlib
    import optax

    devs = jax.devices()
    try:
        cpus = f"{len(cpu_devices())} simulated CPU devices (jax.devices('cpu'))"
    except RuntimeError as e:
        cpus = f"no CPU devices ({e})"
    return (
        f"default backend {jax.default_backend()} (device kind {devs[0].device_kind}, {len(devs)} "
        f"device{'s' if len(devs) > 1 else ''}); CPU sections on {cpus}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"JAX {jax.__version__}, jaxlib {jaxlib.__version__}, optax {optax.__version__}, "
        f"jaxkv {jaxkv.__version__}"
    )


@contextlib.contextmanager
def cpu_children():
    """Processes started inside run on JAX's CPU backend only (JAX_PLATFORMS=cpu): the
    sections that run in processes of their own take ``jax.devices()`` to be the CPU devices."""
    before = os.environ.get("JAX_PLATFORMS")
    os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        yield
    finally:
        if before is None:
            del os.environ["JAX_PLATFORMS"]
        else:
            os.environ["JAX_PLATFORMS"] = before


def workload(name: str) -> list[tuple[int, ...]]:
    if name == "resnet50":
        with open(SHAPES) as f:
            return [tuple(s) for s in json.load(f)]
    return [(16, 16)] * 1000


def median_ms(step, steps: int) -> float:
    step()
    step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


class CompileCounter:
    """Counts XLA compilations (jax.log_compiles) while active."""

    def __init__(self):
        import logging

        class _H(logging.Handler):
            def __init__(self, outer):
                super().__init__(logging.WARNING)
                self.outer = outer

            def emit(self, record):
                if "Compiling" in record.getMessage():
                    self.outer.count += 1

        self.count = 0
        self._handler = _H(self)
        self._logger = logging.getLogger("jax")
        self._ctx = None

    def __enter__(self):
        self._logger.addHandler(self._handler)
        self._propagate, self._logger.propagate = self._logger.propagate, False  # keep it quiet
        self._ctx = jax.log_compiles(True)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self._logger.removeHandler(self._handler)
        self._logger.propagate = self._propagate


# -- baselines ---------------------------------------------------------------------------------
def copy_bandwidth() -> float:
    """GB/s of a 2-thread copy of a 256 MB buffer, counting bytes read plus written."""
    src = np.ones(256 * 2**20 // 4, np.float32)
    dst = np.zeros_like(src)
    halves = np.array_split(np.arange(src.size), 2)
    bounds = [(h[0], h[-1] + 1) for h in halves]

    def copy():
        threads = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b])) for a, b in bounds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    ms = median_ms(copy, 7)
    return 2 * src.nbytes / (ms / 1e3) / 1e9


def numpy_reduce_copy(shapes, steps) -> float:
    grads = [[np.ones(s, np.float32) for _ in range(D)] for s in shapes]
    outs = [[np.zeros(s, np.float32) for _ in range(D)] for s in shapes]
    stored = [np.zeros(s, np.float32) for s in shapes]

    def step():
        for g, o, s in zip(grads, outs, stored):
            np.copyto(s, g[0])
            for x in g[1:]:
                np.add(s, x, out=s)
            for y in o:
                np.copyto(y, s)

    return median_ms(step, steps)


def naive_jax(shapes, steps) -> float:
    devs = cpu_devices()
    grads = [[jnp.ones(s, device=d) for d in devs] for s in shapes]
    stored = [jnp.zeros(s, device=devs[0]) for s in shapes]

    def step():
        outs = []
        for i, g in enumerate(grads):
            acc = g[0]
            for x in g[1:]:
                acc = acc + jax.device_put(x, devs[0])
            stored[i] = acc
            outs.append([jax.device_put(acc, d) for d in devs])
        jax.block_until_ready(outs)

    return median_ms(step, steps)


def memory() -> dict:
    """Steady-state peak RSS of the imperative ResNet-50 loop, in a process of its own."""
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "memory.py"), SHAPES],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def mxnet(work: str) -> float | None:
    python = os.path.join(MXNET_VENV, "bin", "python")
    if not os.path.exists(os.path.join(MXNET_VENV, ".ok")):
        return None
    script = os.path.join(HERE, "mxnet_baseline.py")
    out = subprocess.run(
        [python, script, f"{work}:{D}"], capture_output=True, text=True, check=True
    ).stdout
    for line in out.splitlines():
        if line.startswith("mxnet "):
            return float(line.split("median_ms=")[1])
    return None


# -- jaxkv -------------------------------------------------------------------------------------
def jaxkv_imperative(shapes, steps, counter_box) -> float:
    keys = list(range(len(shapes)))
    # mx.kv.create spans the default backend's devices: the store is given the CPU devices.
    kv = mx.kv.KVStore("local", devices=[mx.cpu(d) for d in range(D)])
    kv.init(keys, [mx.nd.zeros(s, mx.cpu(0)) for s in shapes])
    grads = [[mx.nd.ones(s, mx.cpu(d)) for d in range(D)] for s in shapes]
    outs = [[mx.nd.zeros(s, mx.cpu(d)) for d in range(D)] for s in shapes]

    def step():
        kv.push(keys, grads)
        kv.pull(keys, out=outs)
        mx.nd.waitall()

    step()
    with CompileCounter() as c:
        ms = median_ms(step, steps)
    counter_box.append(c.count)
    return ms


def jaxkv_functional(shapes, steps, counter_box) -> float:
    keys = list(range(len(shapes)))
    devs = cpu_devices()
    state = jaxkv.init(jaxkv.empty(devs), keys, [jnp.zeros(s, device=devs[0]) for s in shapes])
    grads = [[jnp.ones(s, device=d) for d in devs] for s in shapes]
    box = [state]

    def step():
        box[0], pulled = jaxkv.pushpull(box[0], keys, grads, devices=devs, donate=True)
        jax.block_until_ready(pulled)

    step()
    with CompileCounter() as c:
        ms = median_ms(step, steps)
    counter_box.append(c.count)
    return ms


def no_fast_paths(steps, rounds: int = 2) -> dict[str, float]:
    """The resnet50 imperative and functional ms/step with every private JAX name off
    (``JAXKV_NO_FAST_PATHS=1``, read when jaxkv is imported: so in processes of their own),
    the best of ``rounds``."""
    env = dict(os.environ, JAXKV_NO_FAST_PATHS="1", JAX_PLATFORMS="cpu")
    best: dict[str, float] = {}
    for _ in range(rounds):
        out = subprocess.run(
            [sys.executable, __file__, "--only", "no-fast-paths", "--steps", str(steps)],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        ).stdout
        line = next(x for x in out.splitlines() if x.startswith("NO_FAST_PATHS "))
        for path, ms in json.loads(line.split(" ", 1)[1]).items():
            best[path] = min(ms, best.get(path, ms))
    return best


def in_jit(steps) -> dict[str, dict]:
    """The in-jit section (benchmarks/injit.py), once with the default malloc and once with
    glibc's huge-page malloc, each in a process of its own."""
    import tempfile

    import injit

    lines = {}
    with tempfile.TemporaryDirectory(prefix="jaxkv-bench-cache-") as cache, cpu_children():
        for label, hugetlb in (("default malloc", False), ("hugetlb malloc", True)):
            log(f"[in-jit] {label}: ResNet-50 adam step, 4 rows, {injit.ROUNDS} rounds ...")
            lines[label] = injit.run_subprocess(steps, injit.ROUNDS, hugetlb, cache, log=log)
    return lines


def in_jit_lines(jit_rows) -> list[str]:
    """The in-jit section's result lines: one per row and malloc, then the goals."""
    import injit

    out = []
    for label, res in jit_rows.items():
        out += injit.table(res, label)
    for label, res in jit_rows.items():
        out += [f"{label}: {g}" for g in injit.goals(res)]
    return out


# -- report --------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="skip the slow baselines")
    parser.add_argument(
        "--only",
        choices=[
            "in-jit",
            "mesh",
            "processes",
            "dist",
            "no-fast-paths",
            "proxy",
            "gpu",
            "step",
            "rows",
            "gluon",
            "new-keys",
            "host",
        ],
        help="run only this section; print it, write no report",
    )
    parser.add_argument(
        "--eager-steps",
        type=int,
        help=f"timed steps per round of the proxy and gpu sections (default {eager.STEPS}, "
        f"{eager.FORCED_STEPS} for the gpu section forced onto CPU)",
    )
    parser.add_argument(
        "--step-steps",
        type=int,
        help=f"timed steps per round of the step section's proxy and accelerator sets (default "
        f"{step.STEPS[step.PROXY]}; the full-size CPU set times {step.STEPS[step.FULL]})",
    )
    parser.add_argument(
        "--gluon-scale",
        type=int,
        default=1,
        help="the gluon section: divide every dimension of ResNet-50's tensors by K (at least 1)",
    )
    parser.add_argument("--gluon-keys", type=int, help="the gluon section: the first N keys only")
    parser.add_argument(
        "--gluon-timeout",
        type=float,
        default=gluon.TIMEOUT,
        help=f"the gluon section: seconds one side's start-up may take (default {gluon.TIMEOUT}, "
        f"or ${gluon.TIMEOUT_ENV})",
    )
    parser.add_argument(
        "--gluon-mem-gb",
        type=float,
        help="the gluon section: GB one side's processes may hold (default 80%% of the memory "
        "available)",
    )
    parser.add_argument(
        "--gluon-dist-devices",
        type=int,
        nargs="+",
        default=[1],
        help="the gluon section: devices per process of its dist_sync rows (default 1)",
    )
    parser.add_argument(
        "--gluon-dist-processes",
        type=int,
        nargs="+",
        default=[1, 2, 3, 4],
        help="the gluon section: process counts of its dist_sync rows (default 1 2 3 4; jaxkv's "
        "second layout at 2 only)",
    )
    parser.add_argument(
        "--host-rounds",
        type=int,
        default=host.ROUNDS,
        help=f"the host section: interleaved rounds (default {host.ROUNDS})",
    )
    parser.add_argument(
        "--host-steps",
        type=int,
        default=host.STEPS,
        help=f"the host section: each embedding run's steps, 10 of them warm-up (default "
        f"{host.STEPS})",
    )
    parser.add_argument(
        "--host-keys-steps",
        type=int,
        default=host.KEYS_STEPS,
        help=f"the host section: each keys run's steps, 3 of them warm-up (default "
        f"{host.KEYS_STEPS})",
    )
    args = parser.parse_args()
    steps = max(args.steps, 7)
    gpt_steps = max(args.steps, gpt_step.STEPS)  # the GPT section's timed steps per round

    def host_section() -> dict:
        return host.run(
            args.host_rounds, args.host_steps, args.host_keys_steps, mxnet_venv=MXNET_VENV, log=log
        )

    def gluon_section() -> dict:
        return gluon.run_section(
            args.gluon_scale,
            args.gluon_keys,
            steps,
            args.gluon_timeout,
            args.gluon_mem_gb,
            tuple(args.gluon_dist_devices),
            log=log,
            dist_processes=tuple(args.gluon_dist_processes),
        )

    log(f"jaxkv benchmark: {where()}")
    if args.only in ("proxy", "gpu"):
        res = eager.run(args.only, CompileCounter, args.eager_steps, log=log)
        log("\n".join(eager.lines(res)))
        return 1 if eager.failed(res) else 0
    if args.only == "step":
        res = step.run(CompileCounter, args.step_steps, log=log)
        log("\n".join(step.lines(res)))
        return 1 if step.failed(res) else 0
    if args.only == "in-jit":
        log("\n".join(in_jit_lines(in_jit(steps))))
        return
    if args.only == "processes":
        log("\n".join(processes.report(processes.collect(steps, log=log))))
        return 0
    if args.only == "mesh":
        log("\n".join(mesh_step.lines(mesh_step.run(CompileCounter, steps, log=log))))
        log("\n".join(gpt_step.lines(gpt_step.run(CompileCounter, gpt_steps, log=log))))
        return
    if args.only == "rows":
        log("\n".join(sparse_rows.report(sparse_rows.run_section(steps, MXNET_VENV, log=log))))
        return
    if args.only == "gluon":
        log("\n".join(gluon.report(gluon_section())))
        return
    if args.only == "new-keys":
        log("\n".join(new_keys.report(new_keys.run(log=log))))
        return
    if args.only == "host":
        log("\n".join(host.report(host_section())))
        return
    if args.only == "dist":
        with cpu_children():
            rows = dist.run(steps, log=log) + dist.run(steps, log=log, compression="2bit")
        log("\n".join(dist.lines(rows)))
        return
    if args.only == "no-fast-paths":  # run by no_fast_paths(), in a process of its own
        shapes, counts = workload("resnet50"), []
        times = {
            "imperative": jaxkv_imperative(shapes, steps, counts),
            "functional": jaxkv_functional(shapes, steps, counts),
        }
        print("NO_FAST_PATHS " + json.dumps(times), flush=True)
        return
    # Timings on this shared machine drift by tens of percent between minutes. Each workload is
    # measured in ROUNDS rounds, each timing jaxkv (both paths), MXNet and the copy bandwidth back
    # to back; every number reported is the best of its rounds (lowest time, highest bandwidth),
    # so each one measures the machine at its least disturbed, and all rounds are listed.
    bws: list[float] = []
    rows = []
    for work in ("resnet50", "small"):
        shapes = workload(work)
        nbytes = sum(int(np.prod(s)) for s in shapes) * 4
        row = {"workload": work, "MB": nbytes / 1e6}
        counts: list[int] = []
        best: dict[str, list[float]] = {"imperative": [], "functional": [], "mxnet": []}
        for r in range(ROUNDS):
            log(f"[{work}] round {r + 1}/{ROUNDS}: copy bandwidth ...")
            bws.append(copy_bandwidth())
            log(f"  {bws[-1]:.1f} GB/s")
            log(f"[{work}] round {r + 1}/{ROUNDS}: jaxkv imperative ...")
            best["imperative"].append(jaxkv_imperative(shapes, steps, counts))
            log(f"  {best['imperative'][-1]:.1f} ms")
            log(f"[{work}] round {r + 1}/{ROUNDS}: jaxkv functional ...")
            best["functional"].append(jaxkv_functional(shapes, steps, counts))
            log(f"  {best['functional'][-1]:.1f} ms")
            log(f"[{work}] round {r + 1}/{ROUNDS}: MXNet 1.9.1 ...")
            mx_ms = mxnet(work)
            if mx_ms is not None:
                best["mxnet"].append(mx_ms)
            log(f"  {_fmt(mx_ms, ' ms')}")
        for path, times in best.items():
            row[path] = min(times) if times else None
            row[f"{path} rounds"] = times
        row["compiles"] = sum(counts)
        if args.quick:
            row["numpy"] = row["naive"] = None
        else:
            log(f"[{work}] numpy reduce-and-copy ...")
            row["numpy"] = numpy_reduce_copy(shapes, steps)
            log(f"  {row['numpy']:.1f} ms")
            log(f"[{work}] naive JAX loop ...")
            row["naive"] = naive_jax(shapes, steps)
            log(f"  {row['naive']:.1f} ms")
        rows.append(row)
    bw = max(bws)
    for row in rows:
        row["floor"] = (2 * D + 1) * row["MB"] * 1e6 / (bw * 1e9) * 1e3
    eager_res = [
        eager.run(section, CompileCounter, args.eager_steps, log=log)
        for section in ("proxy", "gpu")
    ]
    step_res = step.run(CompileCounter, args.step_steps, log=log)
    log("[resnet50] jaxkv with JAXKV_NO_FAST_PATHS=1 (no private JAX names), best of 2 ...")
    slow = no_fast_paths(steps)
    log(f"  {slow}")
    jit_rows = in_jit(steps)
    mesh_res = mesh_step.run(CompileCounter, steps, log=log)
    gpt_res = gpt_step.run(CompileCounter, gpt_steps, log=log)
    procs_res = processes.collect(steps, log=log)
    with cpu_children():
        dist_rows = dist.run(steps, log=log) + dist.run(steps, log=log, compression="2bit")
    rows_res = sparse_rows.run_section(steps, MXNET_VENV, log=log)
    gluon_res = gluon_section()
    new_keys_res = new_keys.run(log=log)
    host_res = host_section()
    log("[memory] peak RSS of the imperative resnet50 loop ...")
    mem = memory()
    log(f"  {mem}")
    write_report(
        rows,
        jit_rows,
        bw,
        mem,
        slow,
        dist_rows,
        eager_res,
        step_res,
        rows_res,
        gluon_res,
        mesh_res,
        procs_res,
        gpt_res,
        new_keys_res,
        host_res,
    )
    return 1 if any(eager.failed(r) for r in eager_res) or step.failed(step_res) else 0


def _fmt(x, unit=""):
    return "not run" if x is None else f"{x:.1f}{unit}"


def _ratio(a, b):
    return "—" if a is None or b is None else f"{a / b:.2f}x"


def write_report(
    rows,
    jit_rows,
    bw,
    mem,
    slow,
    dist_rows,
    eager_res,
    step_res,
    rows_res,
    gluon_res,
    mesh_res,
    procs_res,
    gpt_res,
    new_keys_res,
    host_res,
) -> None:
    lines = [
        "# jaxkv benchmark results",
        "",
        f"Where: {where()}. Host copy bandwidth {bw:.1f} GB/s.",
        "",
        f"Push from {D} CPU devices then pull to {D}. Each time is the median "
        f"of at least 7 steps after warm-up, the best of {ROUNDS} rounds that each timed both "
        "jaxkv paths, MXNet and the copy bandwidth back to back (every round is listed below).",
        "",
        "| workload | path | ms/step | GB/s | vs floor | vs NumPy | naive JAX / this | "
        "MXNet / this | compiles |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        moved = (2 * D + 1) * r["MB"] / 1e3
        for path in ("imperative", "functional"):
            ms = r[path]
            lines.append(
                f"| {r['workload']} | jaxkv {path} | {ms:.1f} | {moved / (ms / 1e3):.1f} | "
                f"{_ratio(ms, r['floor'])} | {_ratio(ms, r['numpy'])} | "
                f"{_ratio(r['naive'], ms)} | {_ratio(r['mxnet'], ms)} | {r['compiles']} |"
            )
        lines.append(
            f"| {r['workload']} | bandwidth floor | {r['floor']:.1f} | {bw:.1f} | 1.00x | | | | |"
        )
        lines.append(f"| {r['workload']} | NumPy 1-thread | {_fmt(r['numpy'])} | | | | | | |")
        lines.append(f"| {r['workload']} | naive JAX | {_fmt(r['naive'])} | | | | | | |")
        lines.append(f"| {r['workload']} | MXNet 1.9.1 | {_fmt(r['mxnet'])} | | | | | | |")
    resnet = next(r for r in rows if r["workload"] == "resnet50")
    lines += [
        "",
        "With `JAXKV_NO_FAST_PATHS=1` (no private JAX name; what a JAX without them gives), "
        "resnet50, best of 2 runs in processes of their own:",
        "",
        "| path | ms/step, fast paths off | ms/step, on (above) | off / on |",
        "|---|---|---|---|",
    ]
    for path in ("imperative", "functional"):
        lines.append(
            f"| jaxkv {path} | {slow[path]:.1f} | {resnet[path]:.1f} | "
            f"{_ratio(slow[path], resnet[path])} |"
        )
    lines += ["", *dist_report(dist_rows)]
    lines += ["", *in_jit_report(jit_rows)]
    lines += ["", *mesh_step.report(mesh_res)]
    lines += ["", *gpt_step.report(gpt_res)]
    lines += ["", *processes.report(procs_res)]
    lines += ["", *gluon.processes_lines(gluon_res)]
    lines += ["", *new_keys.report(new_keys_res)]
    lines += [
        "",
        "| workload | path | " + " | ".join(f"round {i + 1} ms" for i in range(ROUNDS)) + " |",
        "|---|---|" + "---|" * ROUNDS,
    ]
    for r in rows:
        for path in ("imperative", "functional", "mxnet"):
            times = r[f"{path} rounds"]
            cells = [f"{t:.1f}" for t in times] + ["not run"] * (ROUNDS - len(times))
            lines.append(f"| {r['workload']} | {path} | " + " | ".join(cells) + " |")
    used, trimmed = mem["peak"] - mem["base"], mem["peak_trimmed"] - mem["base"]
    lines += [
        "",
        "| memory (imperative resnet50 loop) | MB | / data |",
        "|---|---|---|",
        f"| interpreter + JAX baseline | {mem['base'] / 1e6:.0f} | |",
        f"| data: stored values + one set of gradients + one set of outs | "
        f"{mem['data'] / 1e6:.0f} | 1.00x |",
        f"| steady-state peak RSS above the baseline | {used / 1e6:.0f} | "
        f"{used / mem['data']:.2f}x |",
        f"| the same after malloc_trim returned set-up's freed memory | "
        f"{trimmed / 1e6:.0f} | {trimmed / mem['data']:.2f}x |",
    ]
    for res in eager_res:  # one device: the CPU proxy, then the GPU section
        lines += ["", *eager.report(res)]
    lines += ["", *step.report(step_res)]
    lines += ["", *sparse_rows.report(rows_res)]
    lines += ["", *gluon.report(gluon_res)]
    lines += ["", *host.report(host_res)]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(HERE, "results.md"), "w") as f:
        f.write(text)
    log("\n" + text)
    plot(rows, jit_rows)


def dist_report(dist_rows) -> list[str]:
    """The multi-process section of results.md (benchmarks/dist.py)."""
    lines = [
        f"Multi-process: ResNet-50's 193 tensors, push from D devices then pull to D, in "
        f"{dist.PROCESSES} processes on this machine: MXNet 1.9.1 `dist_sync` with "
        f"{dist.SERVERS} servers beside jaxkv `dist_sync` (gloo, started by "
        "`python -m jaxkv.launch`). Median of at least 7 steps after warm-up, best of "
        f"{len(next(iter(dist_rows))['rounds']['jaxkv'])} rounds, each side's first step's "
        "values checked.",
        "",
        "The 2-bit rows compress on both sides (`set_gradient_compression({'type': '2bit', "
        "'threshold': 0.5})`); their last column compares them with jaxkv uncompressed at the "
        "same D, from the same run.",
        "",
        "| devices per process | compression | jaxkv ms/step | MXNet ms/step | MXNet / jaxkv | "
        "values | jaxkv rounds | MXNet rounds | jaxkv uncompressed / compressed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    plain = {r["D"]: r["jaxkv"] for r in dist_rows if not r.get("compression")}
    for r in dist_rows:
        rounds = {k: ", ".join(f"{t:.1f}" for t in v) or "not run" for k, v in r["rounds"].items()}
        versus = _ratio(plain.get(r["D"]), r["jaxkv"]) if r.get("compression") else ""
        lines.append(
            f"| {r['D']} | {r.get('compression') or 'none'} | {r['jaxkv']:.1f} | "
            f"{_fmt(r['mxnet'])} | {_ratio(r['mxnet'], r['jaxkv'])} | "
            f"{'ok' if r['ok'] else 'WRONG'} | {rounds['jaxkv']} | {rounds['mxnet']} | {versus} |"
        )
    return lines


def in_jit_report(jit_rows) -> list[str]:
    """The in-jit section of results.md: a table (one row per step and malloc), then the goals
    and what the rows compare."""
    import injit

    lines = [
        "In-jit: one data-parallel optax.adam step on the resnet50 tensors, 8 CPU devices. Every "
        "row does the same work: the same loss (on device d, the sum over tensors of "
        "vdot(full param, device d's gradient data)), whose forward reads the full params, so AD "
        "gives every row the same per-device gradients; the sum of those over the devices; and "
        "adam. Rows differ only in where params and adam state live and in how the sum is done. "
        "The hand-written step keeps both replicated and all-reduces the gradients (lax.psum). "
        "jaxkv sharded keeps big tensors 1/D per device, all-gathers them for the forward "
        "(jaxkv.gather), and AD's transpose of that gather reduce-scatters the gradients; push "
        "updates each device's shard. jaxkv flat sharded does the same with "
        "jaxkv.empty(layout='flat'): the 193 tensors and each adam moment in one bucket split "
        "1/D per device, gathered by one all-gather, summed by one reduce-scatter, adam one loop "
        "over each device's chunk. "
        "ms/step: median of at least 7 steps after warm-up, best of "
        f"{injit.ROUNDS} rounds, the rows interleaved step by step, in one process per malloc; "
        "compiles: during the "
        "timed rounds; state: bytes of the state's shards on device 0; faults: the process's "
        "minor page faults per step (median; XLA's temp buffers are fresh memory each step); "
        "diff: the largest "
        "relative difference of the row's final params and adam moments from the hand-written "
        "step's (every row takes the same steps on the same data).",
        "",
        "| in-jit step | malloc | ms/step | hand-written / this | compiles | state MB/device | "
        "faults/step | diff | "
        + " | ".join(f"round {i + 1} ms" for i in range(injit.ROUNDS))
        + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * injit.ROUNDS,
    ]
    for label, res in jit_rows.items():
        base = res["rows"].get("hand-written psum")
        for name in injit.ROWS:
            r = res["rows"].get(name)
            if r is None:
                reason = res["skipped"].get(name, "not built").replace("|", "/")
                cells = [name, label, f"not run: {reason}"] + [""] * (5 + injit.ROUNDS)
                lines.append("| " + " | ".join(cells) + " |")
                continue
            rounds = [f"{t:.1f}" for t in r["rounds"]]
            lines.append(
                f"| {name} | {label} | {r['ms']:.1f} | {_ratio(base and base['ms'], r['ms'])} | "
                f"{r['compiles']} | {r['state_bytes'] / 1e6:.1f} | "
                f"{r.get('faults', 0) / 1e3:.0f}K | {injit._diff(r)} | " + " | ".join(rounds) + " |"
            )
    lines.append("")
    for label, res in jit_rows.items():
        lines += [f"- {label}: {g}" for g in injit.goals(res)]
    return lines


def plot(rows, jit_rows=None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(rows) + (1 if jit_rows else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4))
    series = [
        ("jaxkv\nimper.", "imperative", "C0"),
        ("jaxkv\nfunct.", "functional", "C9"),
        ("floor", "floor", "C2"),
        ("NumPy", "numpy", "C7"),
        ("naive\nJAX", "naive", "C1"),
        ("MXNet\n1.9.1", "mxnet", "C3"),
    ]
    for ax, r in zip(axes, rows):
        shown = [(name, r[field], color) for name, field, color in series if r[field] is not None]
        ax.bar([s[0] for s in shown], [s[1] for s in shown], color=[s[2] for s in shown])
        ax.set_yscale("log")
        ax.set_title(f"{r['workload']} ({r['MB']:.0f} MB): push from {D} devices, pull to {D}")
        ax.set_ylabel("ms per step (log scale, lower is better)")
    if jit_rows:
        plot_in_jit(axes[-1], jit_rows)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "results.png"), dpi=100)


def plot_in_jit(ax, jit_rows) -> None:
    """Grouped bars: one group per in-jit step, one bar per malloc; rows not run are absent."""
    import injit

    names = list(injit.ROWS)
    width = 0.8 / max(len(jit_rows), 1)
    for i, (label, res) in enumerate(jit_rows.items()):
        xs = [j + i * width for j, n in enumerate(names) if n in res["rows"]]
        ys = [res["rows"][n]["ms"] for n in names if n in res["rows"]]
        ax.bar(xs, ys, width, label=label, color=f"C{i}")
    ax.set_xticks([j + width * (len(jit_rows) - 1) / 2 for j in range(len(names))])
    ax.set_xticklabels([n.replace(" ", "\n", 1) for n in names])
    ax.set_title(f"in-jit adam step, resnet50 tensors, {D} devices")
    ax.set_ylabel("ms per step (lower is better)")
    ax.legend()


if __name__ == "__main__":
    sys.exit(main())
