"""The benchmark's mesh section, its GPT: the training step of ``examples/gpt_mesh.py`` (a flax
GPT, bfloat16 compute over float32 parameters, 4 micro-batches accumulated in a ``lax.scan``,
clipping by the global norm and AdamW with a mask by path) on 8 devices, jaxkv's recipes beside
GSPMD with optax.

Rows, each one jitted training step with its state donated, the same model, batches and
optimizer, from the same initial parameters:
  gspmd-fsdp        plain ``jax.jit`` with NamedShardings on the 2 x 4 mesh ("data", "model"):
                    the parameters in Megatron's tensor-parallel layout with "data" added on
                    dimension 0 of every leaf whose piece has at least 1024 elements, and
                    optax's state placed as the parameters it follows, the step's outputs kept
                    there (FSDP / ZeRO's placement; the example's ``gspmd_state``,
                    ``gspmd_step`` and ``init_params(mesh, cfg, fsdp=True)``): XLA partitions
                    the step
  jaxkv-jit         the example's plain-``jit`` recipe: the tensor-parallel parameters given to
                    ``jaxkv.init`` on ``jaxkv.empty(mesh=mesh, axis_name="data",
                    bigarray_bound=1024)``, which adds "data" to the big ones (the same bound
                    as gspmd-fsdp's) and their optimizer state, then one ``jax.jit`` of
                    the gradient with respect to ``state.tree()`` and ``jaxkv.push``
  jaxkv-shard_map   the README's sharded step by hand: a store over the 8 devices on one axis,
                    ``jaxkv.empty(devices)`` (values of at least 16384 elements split along it
                    with their optimizer state, ZeRO; at 1024, as the other rows, its job of 2
                    processes hung in ``jaxkv.init``'s batched put, since made one at a time),
                    ``jax.shard_map`` over its mesh with ``in_specs=(jaxkv.specs(state, "kv"),
                    P("kv"))``; on each device the loss of
                    ``jaxkv.gather(state, local, "kv")`` (whole parameters) on its rows of the
                    batch, over the example's micro-batches, its gradient with respect to
                    ``state.tree()`` (``jax.vjp`` of the gather: one reduce-scatter of the
                    accumulated gradient), then ``jaxkv.push(state, grads, updater=tx,
                    axis_name="kv", reduce="mean")``

Each ms/step is the median of a round's timed steps after warm-up, the best of 3 rounds; within
a round the rows are interleaved step by step (the order alternating). Compiles are counted over
the timed rounds; state is the bytes of parameters and optimizer state on the mesh's first
device; diff is the largest |difference| of a jaxkv row's parameters from gspmd-fsdp's after the
same steps (bfloat16 compute: the partitionings round differently).

    python benchmarks/gpt_step.py [--steps 10] [--small] [--processes 1 2 4]

prints the section: the rows in this process (8 simulated CPU devices), each row's peak
resident set in a process of its own, then the rows in a job of P launched processes of 8 / P
devices each, the rows interleaved as in one process (``python -m jaxkv.launch -n P
--devices-per-process 8/P benchmarks/gpt_step.py --worker``; rank 0 prints a JSON line per row;
the peak RSS is the job's, the largest of its processes, all rows together).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import os
import platform
import resource
import subprocess
import sys
import time

import jax

if __name__ == "__main__" and "JAXKV_PROCESS_ID" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv._src.jax_internals import varying_axes  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "gpt_mesh.py")
ROWS = ("gspmd-fsdp", "jaxkv-jit", "jaxkv-shard_map")
ROUNDS = 3
STEPS = 10  # timed steps per round at least (a step takes a second or so on CPU)
PROCESSES = (2,)  # the launched jobs of the full run: 2 processes of 4 devices
JOB_TIMEOUT = 1200  # seconds a launched job may take


def load(name: str, path: str):
    """The example at ``path`` as a module named ``name``, loaded once (registered first:
    flax's dataclasses look their module up)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def example():
    """``examples/gpt_mesh.py`` as a module."""
    return load("gpt_mesh", EXAMPLE)


def config(small: bool = False):
    """The example's GPT: its default size, or ``SMALL`` (the tests')."""
    ex = example()
    return ex.SMALL if small else ex.Config()


def where(devices) -> str:
    """Where rows run, in words: the backend, device kind and count, processes, the machine."""
    procs = jax.process_count()
    return (
        f"{len(devices)} {devices[0].platform.upper()} devices (device kind "
        f"{devices[0].device_kind}) in {procs} process{'es' if procs > 1 else ''}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"JAX {jax.__version__}"
    )


class Compiles:
    """Counts XLA compilations (``jax.log_compiles``) while active (for processes that do not
    import bench.py; it passes its ``CompileCounter``)."""

    def __init__(self) -> None:
        self.count = 0
        self._handler = example()._Compiles()
        self._logger = logging.getLogger("jax")

    def __enter__(self) -> Compiles:
        self._handler.count = 0
        self._logger.addHandler(self._handler)
        self._propagate, self._logger.propagate = self._logger.propagate, False
        self._ctx = jax.log_compiles(True)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
        self._logger.removeHandler(self._handler)
        self._logger.propagate = self._propagate
        self.count = self._handler.count


def _sequences(cfg, step: int) -> np.ndarray:
    """Step ``step``'s batch of token sequences, as ``examples/gpt_mesh.py``'s ``tokens``."""
    rng = np.random.default_rng([7, step])
    start = rng.integers(0, cfg.vocab, (cfg.batch, 1))
    stride = rng.integers(1, 4, (cfg.batch, 1))
    return ((start + stride * np.arange(cfg.block + 1)) % cfg.vocab).astype(np.int32)


def _put(seq: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(seq.shape, sharding, lambda i: seq[i])


def _varying(x, axis: str):
    """``x`` typed as varying along the mapped axis ``axis`` (its value unchanged)."""
    return x if axis in varying_axes(x) else jax.lax.pcast(x, axis, to="varying")


def _loss_and_grads(ex, cfg, params, batch, axis: str):
    """The example's ``loss_and_grads`` inside ``shard_map``: the mean next-token loss of this
    device's rows and its gradient, over ``cfg.micro`` micro-batches in a ``lax.scan`` whose
    carry varies along ``axis`` (the rows do)."""
    model = ex.GPT(cfg)

    def loss(p, seq):
        logits = model.apply(p, seq[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, seq[:, 1:]).mean()

    def one(carry, seq):
        total, grads = carry
        value, g = jax.value_and_grad(loss)(params, seq)
        return (total + value, jax.tree.map(jnp.add, grads, g)), None

    micro = batch.reshape(cfg.micro, cfg.batch // cfg.micro, cfg.block + 1)
    zeros = jax.tree.map(lambda x: _varying(jnp.zeros_like(x), axis), (jnp.zeros(()), params))
    (total, grads), _ = jax.lax.scan(one, zeros, micro)
    return total / cfg.micro, jax.tree.map(lambda g: g / cfg.micro, grads)


def shard_map_step(ex, cfg, tx, state):
    """The README's sharded step over the store's one axis "kv": ``step(state, batch) ->
    (state, loss)``, one ``jax.jit`` of a ``jax.shard_map``, the state donated."""
    n = state.mesh.devices.size
    rows = cfg.batch // n  # this device's sequences
    mine = dataclasses.replace(cfg, batch=rows, micro=min(cfg.micro, rows))
    specs = jaxkv.specs(state, "kv")

    def whole(local):  # the whole parameters, typed as varying (each device's rows differ)
        return jax.tree.map(lambda x: _varying(x, "kv"), jaxkv.gather(state, local, "kv"))

    def step(state, batch):
        params, back = jax.vjp(whole, state.tree())
        loss, g = _loss_and_grads(ex, mine, params, batch, "kv")
        (grads,) = back(g)  # AD's sum over the devices, of each device's blocks
        state = jaxkv.push(state, grads, updater=tx, axis_name="kv", reduce="mean")
        return state, jax.lax.pmean(loss, "kv")

    sharded = jax.shard_map(
        step, mesh=state.mesh, in_specs=(specs, P("kv")), out_specs=(specs, P())
    )
    return jax.jit(sharded, donate_argnums=0)


class _Row:
    """One row: a jitted step, its carried state and its batches (step ``t`` takes batch ``t``)."""

    def __init__(self, step, carry, batches, params):
        self.step, self.carry, self.batches, self.params, self.t = step, carry, batches, params, 0

    def __call__(self) -> None:
        out = self.step(*self.carry, self.batches[self.t])
        self.carry, loss = out[:-1], out[-1]
        self.t += 1
        jax.block_until_ready((self.carry, loss))

    def tree(self):
        """The row's parameters (a flax tree)."""
        return self.params(self.carry)


def make_rows(ex, cfg, devices, names=ROWS, total: int = 64) -> dict[str, _Row]:
    """The rows ``names`` on ``devices`` (8 of them), each with ``total`` batches."""
    tx = ex.make_optimizer(cfg)
    mesh = ex.make_mesh(list(devices))
    seqs = [_sequences(cfg, t) for t in range(total)]
    rows = {}
    for name in names:
        if name == "gspmd-fsdp":
            params = ex.init_params(mesh, cfg, fsdp=True)
            batches = [_put(s, NamedSharding(mesh, P("data"))) for s in seqs]
            opt, shardings = ex.gspmd_state(params, tx)
            rows[name] = _Row(
                ex.gspmd_step(cfg, tx, shardings), (params, opt), batches, lambda c: c[0]
            )
        elif name == "jaxkv-jit":
            batches = [_put(s, NamedSharding(mesh, P("data"))) for s in seqs]
            state = ex.make_store(mesh, cfg, tx)
            rows[name] = _Row(ex.jaxkv_step(cfg, tx), (state,), batches, lambda c: c[0].tree())
        elif name == "jaxkv-shard_map":
            store = jaxkv.empty(list(devices), bigarray_bound=ex.BOUND)
            state = jaxkv.init_optimizer(jaxkv.init(store, ex.init_params(mesh, cfg)), tx)
            kv = NamedSharding(state.mesh, P("kv"))
            batches = [_put(s, kv) for s in seqs]
            step = shard_map_step(ex, cfg, tx, state)
            rows[name] = _Row(step, (state,), batches, lambda c: c[0].tree())
        else:
            raise ValueError(f"no row {name!r}; rows: {', '.join(ROWS)}")
        jax.block_until_ready(rows[name].carry)
        if jax.process_count() > 1:  # every process's set-up done before the next row's
            multihost_utils.sync_global_devices(f"gpt_step {name}")
    return rows


def device_bytes(tree, device) -> int:
    """The bytes of ``tree``'s leaves held on ``device``."""
    return sum(
        s.data.nbytes
        for leaf in jax.tree_util.tree_leaves(tree)
        for s in leaf.addressable_shards
        if s.device == device
    )


def _most(x: float) -> float:
    """The largest of every process's ``x``."""
    if jax.process_count() == 1:
        return x
    return float(np.max(multihost_utils.process_allgather(np.array([x], np.float64))))


def rss_peak_mb() -> float:
    """This process's peak resident set so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(rows, counter, steps: int, rounds: int, log, tag: str = "gpt") -> dict:
    """Warm-up, then ``rounds`` rounds of ``steps`` timed steps per row (one untimed first),
    interleaved step by step: each row's ms per round, and its compiles in the rounds."""
    t0 = time.perf_counter()
    for row in rows.values():  # warm-up: two steps (the second sees the first's outputs)
        row()
        row()
    log(f"  [{tag}] set-up and warm-up {time.perf_counter() - t0:.1f} s")
    times: dict[str, list[float]] = {n: [] for n in rows}
    compiles = dict.fromkeys(rows, 0)
    for r in range(rounds):
        samples: dict[str, list[float]] = {n: [] for n in rows}
        for i in range(steps + 1):
            order = list(rows)
            for name in order if (i + r) % 2 == 0 else order[::-1]:
                with counter() as c:
                    t = time.perf_counter()
                    rows[name]()
                    samples[name].append(time.perf_counter() - t)
                compiles[name] += c.count
        for name in rows:
            times[name].append(float(np.median(samples[name][1:]) * 1e3))
        log(
            f"  [{tag}] round {r + 1}/{rounds}: "
            + ", ".join(f"{n} {times[n][-1]:.1f} ms" for n in rows)
        )
    return {"times": times, "compiles": compiles}


def measure(rows, devices, counter, steps: int, rounds: int, log, tag: str = "gpt") -> dict:
    """Times ``rows`` (:func:`timed`) and reads each one's state bytes on the first device and
    its parameters' largest |difference| from gspmd-fsdp's: ``{name: {...}}``."""
    ex = example()
    res = timed(rows, counter, steps, rounds, log, tag)
    first = ex.make_mesh(list(devices)).devices.flat[0]
    ref = rows["gspmd-fsdp"].tree() if "gspmd-fsdp" in rows else None
    out = {}
    for name, row in rows.items():
        diff = None
        if ref is not None and name != "gspmd-fsdp":
            diff = ex.max_difference(row.tree(), ref)
        out[name] = {
            "ms": min(res["times"][name]),
            "rounds": res["times"][name],
            "compiles": int(_most(res["compiles"][name])),
            "state_bytes": device_bytes(row.carry, first) if first.process_index == 0 else 0,
            "diff": diff,
            "steps": row.t,
            "processes": jax.process_count(),
            "where": where(devices),
        }
    return out


def run(
    counter,
    steps: int = STEPS,
    rounds: int = ROUNDS,
    log=print,
    small: bool = False,
    processes=PROCESSES,
    rss: bool = True,
) -> dict:
    """The section: the rows in this process on 8 CPU devices (compiles counted with
    ``counter``, bench.CompileCounter), each row's peak RSS in a process of its own (``rss``),
    and the rows in jobs of each of ``processes`` launched processes. Returns
    ``{"config": ..., "steps": ..., "jobs": {processes: {row: {...}}}}``."""
    ex = example()
    cfg = config(small)
    devices = jax.devices("cpu")[:8]
    steps = max(steps, 1)
    out: dict = {"config": dataclasses.asdict(cfg), "steps": steps, "rounds": rounds, "jobs": {}}
    out["bound"] = ex.BOUND
    n = sum(
        x.size
        for x in jax.tree.leaves(
            jax.eval_shape(lambda: ex.init_params(ex.make_mesh(list(devices)), cfg))
        )
    )
    out["parameters"] = int(n)
    with jax.numpy_dtype_promotion("standard"):
        rows = make_rows(ex, cfg, devices, total=2 + rounds * (steps + 1))
        one = measure(rows, devices, counter, steps, rounds, log)
    del rows
    if rss:
        for name in ROWS:
            log(f"  [gpt] {name} alone in a process of its own (peak RSS) ...")
            (line,) = _launch(1, ["--rows", name, "--steps", "2", "--rounds", "1"], small)
            one[name]["rss_peak_mb"] = line["rss_peak_mb"]
    out["jobs"][1] = one
    # Across processes the rows take turns in one job, as in one process.
    for p in processes:
        log(f"  [gpt] every row: {p} processes of {8 // p} devices ...")
        args = ["--rows", *ROWS, "--steps", str(steps), "--rounds", str(rounds)]
        try:
            job = _launch(p, args, small)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:  # reported
            log(f"  [gpt] {p} processes: did not finish: {str(e)[-2000:]}")
            out.setdefault("failed", {})[p] = str(e).splitlines()[0][:200]
            continue
        out["jobs"][p] = {line.pop("row"): line for line in job}
    return out


def _launch(p: int, args: list[str], small: bool) -> list[dict]:
    """This script's ``--worker`` in a job of ``p`` processes (one alone: a plain process of 8
    CPU devices): the JSON lines rank 0 prints."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(
        x for x in (os.path.join(HERE, ".."), env.get("PYTHONPATH")) if x
    )
    script = [os.path.abspath(__file__), "--worker", *args] + (["--small"] if small else [])
    if p == 1:
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "jaxkv.launch", "-n", str(p)]
        command += ["--devices-per-process", str(8 // p), "--no-prefix", *script]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    if out.returncode:
        raise RuntimeError(f"{p} process(es), {' '.join(args)}:\n{out.stdout}{out.stderr}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def worker(args) -> None:
    """The rows in this process (a launched job's or one alone): rank 0 prints a JSON line
    per row, with the job's largest peak RSS."""
    ex = example()
    cfg = config(args.small)
    devices = jax.devices()
    log = (
        (lambda m: print(m, file=sys.stderr, flush=True))
        if jax.process_index() == 0
        else (lambda m: None)
    )
    total = 2 + args.rounds * (args.steps + 1)
    with jax.numpy_dtype_promotion("standard"):
        rows = make_rows(ex, cfg, devices, args.rows, total)
        res = measure(rows, devices, Compiles, args.steps, args.rounds, log, tag="gpt worker")
    peak = _most(rss_peak_mb())
    if jax.process_index() == 0:
        for name, r in res.items():
            print(json.dumps({"row": name, **r, "rss_peak_mb": peak}), flush=True)


def _finished(res: dict) -> list[tuple[int, str, dict, float]]:
    """``(processes, row, its results, gspmd-fsdp's ms/step)`` of each row whose job finished."""
    out = []
    for p, job in res["jobs"].items():
        base = job["gspmd-fsdp"]["ms"] if "gspmd-fsdp" in job else float("nan")
        out += [(p, name, job[name], base) for name in ROWS if name in job]
    return out


def lines(res: dict) -> list[str]:
    """The section as printed by ``bench.py --only mesh``: one line per job and row."""
    out = []
    for p, name, r, base in _finished(res):
        diff = "" if r["diff"] is None else f"  max |diff| {r['diff']:.1e}"
        rss = f"  peak RSS {r['rss_peak_mb']:.0f} MB" if "rss_peak_mb" in r else ""
        out.append(
            f"GPT step  {p} process{'es' if p > 1 else ''}  {name:<16} {r['ms']:8.1f} ms/step"
            f"  gspmd / this {base / r['ms']:.2f}x  compiles {r['compiles']}  "
            f"state {r['state_bytes'] / 1e6:.2f} MB/device{rss}{diff}  "
            f"rounds {', '.join(f'{t:.1f}' for t in r['rounds'])}  [{r['where']}]"
        )
    for p, why in res.get("failed", {}).items():
        out.append(f"GPT step  {p} processes  did not finish: {why}")
    return out


def report(res: dict) -> list[str]:
    """The section of results.md: what the rows are, then one table row per job and row."""
    c = res["config"]
    out = [
        f"GPT step: the training step of `examples/gpt_mesh.py` (a flax GPT of "
        f"{res['parameters'] / 1e6:.2f}M float32 parameters: d_model {c['d_model']}, "
        f"{c['n_layer']} layers, {c['n_head']} heads, vocabulary {c['vocab']}, {c['block']} "
        f"tokens; {c['batch']} sequences a step in {c['micro']} micro-batches, {c['compute']} "
        "compute; clipping and AdamW) on 8 CPU devices. gspmd-fsdp: plain `jax.jit` with "
        "NamedShardings on the 2 x 4 mesh ('data', 'model'), tensor parallel along 'model' "
        "and every leaf whose piece has at least the same bound's elements, and its optax state, "
        "also split along 'data' (FSDP / ZeRO); "
        "jaxkv-jit: the example's plain-`jit` recipe (`jaxkv.empty(mesh=mesh, "
        f"axis_name='data', bigarray_bound={res['bound']})`, the gradient with respect to "
        "`state.tree()`, `jaxkv.push`); "
        "jaxkv-shard_map: the README's sharded step, a store over the 8 devices on one axis "
        f"'kv' at the same bound (values of at least {res['bound']} elements and their "
        "optimizer state split along it), "
        "`jax.shard_map` with "
        "`jaxkv.specs`, the loss of `jaxkv.gather` on each device's rows, `jaxkv.push(..., "
        "axis_name='kv', reduce='mean')`. ms/step: median of "
        f"{res['steps']} steps after warm-up, best of {res['rounds']} rounds, the rows "
        "interleaved step by step; compiles: during the timed rounds; state: bytes of "
        "parameters and optimizer state on the mesh's first device; peak RSS: in one process, "
        "each row alone in a process of its own (2 steps after warm-up); across processes, the "
        "job's (every row in it), the largest of its processes; diff: the "
        "largest |difference| of the row's parameters from "
        "gspmd-fsdp's after the same steps.",
        "",
        "| GPT step | processes | ms/step | gspmd / this | compiles | state MB/device | "
        "peak RSS MB | diff | "
        + " | ".join(f"round {i + 1} ms" for i in range(res["rounds"]))
        + " | where |",
        "|---|---|---|---|---|---|---|---|" + "---|" * res["rounds"] + "---|",
    ]
    for p, name, r, base in _finished(res):
        diff = "—" if r["diff"] is None else f"{r['diff']:.1e}"
        rss = f"{r['rss_peak_mb']:.0f}" if "rss_peak_mb" in r else ""
        out.append(
            f"| {name} | {p} | {r['ms']:.1f} | {base / r['ms']:.2f}x | {r['compiles']} | "
            f"{r['state_bytes'] / 1e6:.2f} | {rss} | {diff} | "
            + " | ".join(f"{t:.1f}" for t in r["rounds"])
            + f" | {r['where']} |"
        )
    for p, why in res.get("failed", {}).items():
        out.append(f"| (every row) | {p} | did not finish: {why.replace('|', '/')} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--small", action="store_true", help="the example's SMALL GPT")
    parser.add_argument(
        "--processes",
        type=int,
        nargs="*",
        default=list(PROCESSES),
        help="the launched jobs' process counts (8 devices in all; default 2)",
    )
    parser.add_argument("--no-rss", action="store_true", help="no per-row process for its RSS")
    parser.add_argument("--worker", action="store_true", help="run the rows here, print JSON")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), help="the worker's rows")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    res = run(
        Compiles,
        args.steps,
        args.rounds,
        lambda m: print(m, flush=True),
        args.small,
        args.processes,
        not args.no_rss,
    )
    print("\n".join(lines(res)))
    print()
    print("\n".join(report(res)))


if __name__ == "__main__":
    main()
