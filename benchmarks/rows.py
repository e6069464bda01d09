"""Sparse embeddings: a table of R x 64 float32 rows, per step each of 8 CPU devices pushes the
gradient of 1,000 random rows of its own with SGD (lazy: only those rows change) and pulls its
own 1,000 rows back, beside MXNet 1.9.1's row_sparse path on the same workload
(benchmarks/mxnet_rows.py) and today's dense path.

Rows:
  functional   jaxkv.push_rows(state, key, [ids per device], [rows per device],
               updater=optax.sgd(lr), donate=True), then jaxkv.pull_rows(state, key,
               [ids per device]): each device's rows on it
  fused        jaxkv.pushpull_rows(state, key, [ids per device], [rows per device],
               updater=optax.sgd(lr), donate=True): the same step in one computation
  imperative   jaxkv.mx: kv.push(key, [row_sparse gradients]) with
               kv.set_optimizer(mx.optimizer.SGD(learning_rate=lr, lazy_update=True)), then
               kv.row_sparse_pull(key, out=[row_sparse outs], row_ids=[ids per device])
  dense        the dense path as it was before rows existed: each device's gradient a dense
               R x 64 array pushed with kv.push, and kv.row_sparse_pull into dense outs (the
               values MXNet gives, every row of the table in every out)
  floor        the same step written by hand: one jitted shard_map over the table sharded by
               rows (an all-gather of the ids and rows, the owners' scatter-add, one
               psum_scatter of the asked rows back), donated: no store

Each step's values are checked against a NumPy model of lazy SGD for the first steps. Also
reports, per table size, the bytes each device holds (the table is sharded: its 1/D share) and
the push computation's temporary bytes (what XLA allocates beyond its inputs and outputs).

Usage: python benchmarks/rows.py [--rows 1000000 10000000] [--steps 7] [--dense-steps 2]
Prints one JSON line per row:  {"row": ..., "rows": R, "median_ms": x, ...}
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxkv  # noqa: E402
import jaxkv.mx as mx  # noqa: E402

WIDTH, N, LR = 64, 1000, 0.1
KEY = "w"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def batches(rows: int, devices: int, count: int = 4) -> list[tuple[list, list]]:
    """``count`` steps' (ids per device, gradient rows per device) as NumPy arrays."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        ids = [np.sort(rng.choice(rows, N, replace=False)).astype(np.int32) for _ in range(devices)]
        grads = [rng.normal(size=(N, WIDTH)).astype(np.float32) / 100 for _ in range(devices)]
        out.append((ids, grads))
    return out


def median_ms(step, steps: int) -> float:
    step(0)
    step(1)
    times = []
    for k in range(steps):
        t = time.perf_counter()
        step(k)
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def model(rows: int, steps: list) -> tuple[np.ndarray, list]:
    """The table (from ones) after ``steps`` of lazy SGD, and each step's pulled rows; only
    the touched rows are kept (a dict), so 10M rows cost nothing."""
    touched: dict[int, np.ndarray] = {}
    pulls = []
    for ids, grads in steps:
        summed: dict[int, np.ndarray] = {}
        for i, g in zip(np.concatenate(ids).tolist(), np.concatenate(grads)):
            summed[i] = summed.get(i, 0) + g.astype(np.float64)
        for i, g in summed.items():
            w = touched.get(i, np.ones(WIDTH, np.float32))
            touched[i] = (w - np.float32(LR) * g.astype(np.float32)).astype(np.float32)
        pulls.append(
            [np.stack([touched.get(i, np.ones(WIDTH, np.float32)) for i in x]) for x in ids]
        )
    return touched, pulls


def check(name: str, got: list, want: list) -> None:
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6, err_msg=name)


def per_device_bytes() -> int:
    """The most bytes any CPU device holds in live arrays."""
    held: dict = {}
    for x in jax.live_arrays():
        for s in x.addressable_shards:
            held[s.device] = held.get(s.device, 0) + s.data.nbytes
    return max(held.values()) if held else 0


def functional(rows: int, steps: int, fused: bool = False) -> dict:
    devices = jax.devices("cpu")
    work = batches(rows, len(devices))
    sgd = optax.sgd(LR)
    state = jaxkv.init(jaxkv.empty(devices), {KEY: jnp.ones((rows, WIDTH), jnp.float32)})
    placed = [
        (
            [jax.device_put(i, d) for i, d in zip(ids, devices)],
            [jax.device_put(g, d) for g, d in zip(grads, devices)],
        )
        for ids, grads in work
    ]
    box = {"state": state}
    pulled = []

    def step(k: int) -> None:
        ids, grads = placed[k % len(placed)]
        if fused:
            box["state"], out = jaxkv.pushpull_rows(
                box["state"], KEY, ids, grads, updater=sgd, donate=True
            )
        else:
            box["state"] = jaxkv.push_rows(box["state"], KEY, ids, grads, updater=sgd, donate=True)
            out = jaxkv.pull_rows(box["state"], KEY, ids)
        jax.block_until_ready(out)
        pulled.append(out)

    for k in range(len(work)):  # every batch once (each compiles its routes), checked
        step(k)
    check(
        "fused" if fused else "functional",
        [x for step_out in pulled for x in step_out],
        [x for p in model(rows, work)[1] for x in p],
    )
    pulled.clear()
    ms = median_ms(step, steps)
    pulled.clear()
    held = per_device_bytes()
    return {
        "row": "fused" if fused else "functional",
        "rows": rows,
        "median_ms": ms,
        "held_per_device": held,
        "table_share": rows * WIDTH * 4 // len(devices),
    }


def floor(rows: int, steps: int) -> dict:
    """The same step written by hand in JAX, the table sharded by rows over the 8 devices as a
    store keeps it: one jitted ``shard_map``, donated. Each device's ids and gradient rows are
    all-gathered; each device adds ``-lr * g`` into the rows it owns (the others dropped: lazy
    SGD, each id's gradients summed); each device then reads every asked row it owns (zero
    where it does not) and one ``psum_scatter`` gives each device its own rows. Two
    collectives, no host work but the call: what the step costs without a store."""
    from functools import partial  # noqa: PLC0415

    from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    devices = jax.devices("cpu")
    d = len(devices)
    if rows % d:
        raise ValueError(f"expected rows that divide by {d} devices, given {rows}")
    block = rows // d
    mesh = Mesh(np.array(devices), ("kv",))
    split = NamedSharding(mesh, P("kv"))
    work = batches(rows, d)

    @partial(
        jax.shard_map, mesh=mesh, in_specs=(P("kv"), P("kv"), P("kv")), out_specs=(P("kv"), P("kv"))
    )
    def body(table, ids, grads):
        me = jax.lax.axis_index("kv")
        every = jax.lax.all_gather(ids[0], "kv").reshape(-1)  # (d * N,)
        every_g = jax.lax.all_gather(grads[0], "kv").reshape(-1, WIDTH)
        local = every - me * block
        mine = (local >= 0) & (local < block)
        at = jnp.where(mine, local, block)  # (not owned: past the block, dropped; a negative
        # index would count from the block's end)
        table = table.at[at].add(-LR * every_g, mode="drop")
        asked = jnp.where(mine[:, None], table[jnp.where(mine, local, 0)], 0.0)
        back = jax.lax.psum_scatter(asked.reshape(d, N, WIDTH), "kv", scatter_dimension=0)
        return table, back

    step_fn = jax.jit(body, donate_argnums=0)
    box = {"table": jax.device_put(jnp.ones((rows, WIDTH), jnp.float32), split)}
    placed = [
        (jax.device_put(np.stack(ids), split), jax.device_put(np.stack(grads), split))
        for ids, grads in work
    ]
    pulled = []

    def step(k: int) -> None:
        ids, grads = placed[k % len(placed)]
        box["table"], out = step_fn(box["table"], ids, grads)
        jax.block_until_ready(out)
        pulled.append(out)

    for k in range(len(work)):  # every batch once, checked
        step(k)
    got = [np.asarray(x).reshape(d, N, WIDTH) for x in pulled]
    check("floor", [x for g in got for x in g], [x for p in model(rows, work)[1] for x in p])
    pulled.clear()
    ms = median_ms(step, steps)
    pulled.clear()
    return {"row": "floor", "rows": rows, "median_ms": ms}


def imperative(rows: int, steps: int) -> dict:
    devices = jax.devices("cpu")
    ctxs = [mx.cpu(d) for d in range(len(devices))]
    work = batches(rows, len(devices))
    kv = jaxkv.KVStore("local", devices=devices)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=LR, lazy_update=True))
    kv.init(KEY, mx.nd.ones((rows, WIDTH)).tostype("row_sparse"))
    outs = [mx.nd.sparse.zeros("row_sparse", (rows, WIDTH), ctx=c) for c in ctxs]
    placed = [
        (
            [
                mx.nd.sparse.row_sparse_array((g, i), shape=(rows, WIDTH), ctx=c)
                for i, g, c in zip(ids, grads, ctxs)
            ],
            [mx.nd.array(i, ctx=c, dtype="int64") for i, c in zip(ids, ctxs)],
        )
        for ids, grads in work
    ]
    pulled = []
    checking = False

    def step(k: int) -> None:
        grads, ids = placed[k % len(placed)]
        kv.push(KEY, grads)
        kv.row_sparse_pull(KEY, out=outs, row_ids=ids)
        mx.nd.waitall()
        if checking:
            pulled.append([o.data.asnumpy() for o in outs])

    checking = True
    for k in range(len(work)):
        step(k)
    checking = False
    check(
        "imperative",
        [x for step_out in pulled for x in step_out],
        [x for p in model(rows, work)[1] for x in p],
    )
    pulled.clear()
    ms = median_ms(step, steps)
    pulled.clear()
    held = per_device_bytes()
    share = rows * WIDTH * 4 // len(devices)
    return {
        "row": "imperative",
        "rows": rows,
        "median_ms": ms,
        "held_per_device": held,
        "table_share": share,
    }


def dense(rows: int, steps: int) -> dict:
    """Today's dense path: one dense gradient per device, and a pull into dense outs."""
    devices = jax.devices("cpu")
    ctxs = [mx.cpu(d) for d in range(len(devices))]
    work = batches(rows, len(devices), count=1)
    kv = jaxkv.KVStore("local", devices=devices)
    kv.set_optimizer(optax.sgd(LR))
    kv.init(KEY, mx.nd.ones((rows, WIDTH)))
    ids, grads = work[0]
    dense_grads = []
    for i, g, c in zip(ids, grads, ctxs):
        x = np.zeros((rows, WIDTH), np.float32)
        x[i] = g
        dense_grads.append(mx.nd.array(x, ctx=c))
    outs = [mx.nd.zeros((rows, WIDTH), ctx=c) for c in ctxs]
    ids_nd = [mx.nd.array(i, ctx=c, dtype="int64") for i, c in zip(ids, ctxs)]
    times = {}

    def push(_: int) -> None:
        kv.push(KEY, dense_grads)
        mx.nd.waitall()

    def pull(_: int) -> None:
        kv.row_sparse_pull(KEY, out=outs, row_ids=ids_nd)
        mx.nd.waitall()

    times["push_ms"] = median_ms(push, steps)
    times["pull_ms"] = median_ms(pull, steps)
    return {"row": "dense", "rows": rows, "median_ms": times["push_ms"] + times["pull_ms"], **times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--dense-steps", type=int, default=2)
    parser.add_argument("--only", nargs="+", default=["functional", "fused", "imperative", "dense"])
    args = parser.parse_args()
    runs = {
        "functional": functional,
        "fused": lambda rows, steps: functional(rows, steps, fused=True),
        "imperative": imperative,
        "dense": dense,
        "floor": floor,
    }
    for rows in args.rows:
        for name in args.only:
            if name == "dense" and rows > 1_000_000:
                continue  # 8 dense gradients of 10M x 64 would take 20 GB
            log(f"rows: {name} R={rows}")
            steps = args.dense_steps if name == "dense" else args.steps
            try:
                result = runs[name](rows, steps)
            except Exception as e:  # a row that fails is reported, and the others still run
                result = {"row": name, "rows": rows, "error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps(result), flush=True)


# -- the section of `make bench` (benchmarks/bench.py runs it) ---------------------------------
SIZES = (1_000_000, 10_000_000)
STEPS = 31
ROUNDS = 3  # jaxkv and MXNet in turn


def run_section(steps: int, mxnet_venv: str, log=log) -> dict:
    """Every row for each table size, in ROUNDS interleaved rounds: jaxkv's in a process of its
    own (on JAX's CPU backend), then MXNet's with its venv's python ("not run" where that venv
    is absent), then jaxkv's again, ... (the dense row in the first round only). A noisy
    machine slows a stretch of minutes, not one row: paired rounds keep the ratios honest."""
    import os
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # A step is milliseconds: at least 31 of them, or their median moves by 10-20% between runs.
    steps = max(steps, STEPS)
    python = os.path.join(mxnet_venv, "bin", "python")
    has_mxnet = os.path.exists(os.path.join(mxnet_venv, ".ok"))
    rounds: list[list[dict]] = []
    for k in range(ROUNDS):
        results: list[dict] = []
        only = ["functional", "fused", "imperative", "floor"] + (["dense"] if k == 0 else [])
        log(
            f"[rows] round {k + 1}/{ROUNDS}: jaxkv ({', '.join(only)}), tables of "
            f"{', '.join(f'{r:,}' for r in SIZES)} x {WIDTH} ..."
        )
        cmd = [sys.executable, os.path.join(here, "rows.py"), "--steps", str(steps), "--rows"]
        cmd += [str(r) for r in SIZES] + ["--only", *only]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        for line in out.stdout.splitlines():
            if line.startswith("{"):
                results.append(json.loads(line))
                log(f"  {line}")
        if out.returncode:
            log(f"  rows.py failed: {out.stderr[-2000:]}")
        if has_mxnet:
            log(f"[rows] round {k + 1}/{ROUNDS}: MXNet 1.9.1 row_sparse ...")
            mx_out = subprocess.run(
                [python, os.path.join(here, "mxnet_rows.py"), *map(str, SIZES)],
                capture_output=True,
                text=True,
                check=False,
            ).stdout
            for line in mx_out.splitlines():
                if line.startswith("mxnet-rows "):
                    fields = dict(f.split("=") for f in line.split()[1:])
                    results.append(
                        {
                            "row": "mxnet",
                            "rows": int(fields["R"]),
                            "median_ms": float(fields["median_ms"]),
                        }
                    )
                    log(f"  {line}")
        results += _loop_round(k, python if has_mxnet else None, env, log)
        rounds.append(results)
    return {"results": _merged(rounds), "rounds": rounds}


# -- the embedding loop as MXNet code runs it (benchmarks/embedding_worker.py) ------------------
LOOP_ROWS = 1_000_000
LOOP_STEPS = 60  # 10 of warm-up, then the median of 50


def _loop_line(out: str) -> list[dict]:
    """The ``embedding ...`` lines of a run, as dicts."""
    found = []
    for line in out.splitlines():
        if line.startswith("embedding "):
            _, name, *fields = line.split()
            f = dict(x.split("=") for x in fields)
            found.append(
                {
                    "name": name,
                    "kind": f["kind"],
                    "rank": int(f["rank"]),
                    "first_ms": float(f["first_ms"]),
                    "median_ms": float(f["median_ms"]),
                    "compiles": int(f["compiles"]),
                    "rows_sum": float(f["rows_sum"]),
                }
            )
    return found


def _loop_result(row: str, found: list[dict], err: str = "") -> dict:
    """One result of the loop: the slowest process's median and first step (a step of
    dist_sync waits for every process), the most compiles, each rank's checksum."""
    if not found:
        return {"row": row, "rows": LOOP_ROWS, "error": err[-300:] or "no result"}
    return {
        "row": row,
        "rows": LOOP_ROWS,
        "median_ms": max(r["median_ms"] for r in found),
        "first_ms": max(r["first_ms"] for r in found),
        "compiles": max(r["compiles"] for r in found),
        "sums": {str(r["rank"]): r["rows_sum"] for r in found},
    }


def _loop_round(k: int, mxnet_python: str | None, env: dict, log=log) -> list[dict]:
    """The embedding loop, one device in one process and 2 processes of one device each,
    jaxkv's (``jaxkv.mx``) and MXNet's (``local``; ``dist_sync`` with 2 servers)."""
    import os
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    worker = os.path.join(here, "embedding_worker.py")
    args = ["--rows", str(LOOP_ROWS), "--steps", str(LOOP_STEPS)]
    results = []
    log(f"[rows] round {k + 1}/{ROUNDS}: the embedding loop, 1 device, jaxkv ...")
    run = subprocess.run(
        [sys.executable, worker, "jaxkv", "device", *args], capture_output=True, text=True, env=env
    )
    results.append(_loop_result("loop-jaxkv-1", _loop_line(run.stdout), run.stderr))
    log(f"  {results[-1]}")
    log(f"[rows] round {k + 1}/{ROUNDS}: the embedding loop, 2 processes, jaxkv ...")
    cmd = [sys.executable, "-m", "jaxkv.launch", "-n", "2", "--devices-per-process", "1"]
    run = subprocess.run(
        [*cmd, "--no-prefix", worker, "jaxkv", "dist_sync", *args],
        capture_output=True,
        text=True,
        env=env,
    )
    results.append(_loop_result("loop-jaxkv-2", _loop_line(run.stdout), run.stderr))
    log(f"  {results[-1]}")
    if mxnet_python is None:
        return results
    log(f"[rows] round {k + 1}/{ROUNDS}: the embedding loop, 1 device, MXNet ...")
    run = subprocess.run(
        [mxnet_python, worker, "mxnet", "device", *args], capture_output=True, text=True
    )
    results.append(_loop_result("loop-mxnet-1", _loop_line(run.stdout), run.stderr))
    log(f"  {results[-1]}")
    log(f"[rows] round {k + 1}/{ROUNDS}: the embedding loop, 2 workers and 2 servers, MXNet ...")
    out, err = mxnet_loop(worker, args, mxnet_python)
    results.append(_loop_result("loop-mxnet-2", _loop_line(out), err))
    log(f"  {results[-1]}")
    return results


def mxnet_loop(worker: str, args: list[str], mxnet_python: str) -> tuple[str, str]:
    """MXNet's embedding loop (``worker``: embedding_worker.py) on ``dist_sync`` with 2
    workers and 2 servers: the workers' output and the failed roles' errors."""
    import dist  # benchmarks/dist.py

    for attempt in range(2):  # ps-lite's "bind failed" now and then: once more
        roles = dist.mxnet_job(
            [worker, "mxnet", "dist_sync", *args],
            servers=2,
            workers=2,
            env={"OMP_NUM_THREADS": "1"},
            python=mxnet_python,
        )
        out = "".join(o for role, _, o, _ in roles if role == "worker")
        if len(_loop_line(out)) == 2 or attempt:
            break
    return out, "".join(e for _, rc, _, e in roles if rc)


def _merged(rounds: list[list[dict]]) -> list[dict]:
    """One result per (row, R): the first round's fields, its ``median_ms`` the median over
    the rounds, with each round's in ``per_round`` (the rounds in order)."""
    merged: dict[tuple, dict] = {}
    for results in rounds:
        for r in results:
            slot = merged.setdefault((r["row"], r["rows"]), dict(r, per_round=[]))
            if "median_ms" in r:
                slot["per_round"].append(r["median_ms"])
    for r in merged.values():
        if r["per_round"]:
            r["median_ms"] = float(np.median(r["per_round"]))
    return list(merged.values())


def _paired_ratio(
    res: dict, row: str, rows: int, baseline: str = "mxnet"
) -> tuple[float, float, float] | None:
    """MXNet's time (``baseline``'s row) over ``row``'s, round by round: (median, lowest,
    highest), or None."""
    ratios = []
    for results in res.get("rounds", [res["results"]]):
        mine = [r for r in results if r["row"] == row and r["rows"] == rows and "median_ms" in r]
        theirs = [
            r for r in results if r["row"] == baseline and r["rows"] == rows and "median_ms" in r
        ]
        if mine and theirs:
            ratios.append(theirs[0]["median_ms"] / mine[0]["median_ms"])
    if not ratios:
        return None
    return float(np.median(ratios)), min(ratios), max(ratios)


def _get(res: dict, row: str, rows: int, field: str = "median_ms"):
    for r in res["results"]:
        if r["row"] == row and r["rows"] == rows:
            return r.get(field)
    return None


def report(res: dict) -> list[str]:
    """The sparse-embeddings section of results.md, with the issue's goals."""
    lines = [
        "## Sparse embeddings: rows of a table",
        "",
        f"A table of R x {WIDTH} float32; per step each of 8 CPU devices pushes the gradient of "
        f"{N:,} random rows of its own with SGD (lazy: only those rows change) and pulls its own "
        f"{N:,} rows back (benchmarks/rows.py; MXNet 1.9.1: benchmarks/mxnet_rows.py, "
        "`kv.init` of a row_sparse table of ones, `SGD(lazy_update=True)`, `row_sparse_pull` to "
        f"each device). Median of {STEPS} steps (or `--steps`, if more) after warm-up, in "
        f"{ROUNDS} rounds that take turns with MXNet's: ms/step is the median over the rounds, "
        "MXNet / this the median of the rounds' ratios (lowest-highest). Values checked against "
        "a NumPy model.",
        "",
        "| R | path | ms/step | MXNet / this | dense / this |",
        "|---|---|---|---|---|",
    ]
    for rows in SIZES:
        dense = _get(res, "dense", rows)
        for row in ("functional", "fused", "imperative", "dense", "floor", "mxnet"):
            ms = _get(res, row, rows)
            error = _get(res, row, rows, "error")
            if ms is None and error is None:
                continue
            name = {
                "mxnet": "MXNet 1.9.1 row_sparse",
                "dense": "jaxkv dense (before rows)",
                "fused": "jaxkv functional, pushpull_rows",
                "floor": "floor: the step by hand (one jitted shard_map)",
            }.get(row, f"jaxkv {row}")
            if error:
                lines.append(f"| {rows:,} | {name} | failed: {error} | | |")
                continue
            extra = ""
            if row == "dense":
                extra = (
                    f" (push {_get(res, row, rows, 'push_ms'):.0f}, "
                    f"pull {_get(res, row, rows, 'pull_ms'):.0f})"
                )
            paired = None if row == "mxnet" else _paired_ratio(res, row, rows)
            ratio_mx = "—"
            if paired is not None:
                mid, lo, hi = paired
                ratio_mx = f"{mid:.2f}x ({lo:.2f}-{hi:.2f})" if hi > lo else f"{mid:.2f}x"
            ratio_dense = "—" if dense is None or row == "dense" else f"{dense / ms:.0f}x"
            lines.append(f"| {rows:,} | {name} | {ms:.2f}{extra} | {ratio_mx} | {ratio_dense} |")
    lines += ["", *_loop_report(res), "", "| goal | measured | met |", "|---|---|---|"]
    lines += _loop_goals(res)
    small, big = SIZES
    for row in ("functional", "fused", "imperative"):
        at_floor = _paired_ratio(res, row, small, baseline="floor")
        if at_floor is not None:  # (no goal: where the 2x above stands against the hand's)
            mid, lo, hi = at_floor
            lines.append(
                f"| {row}: the hand-written floor's step over this one (R={small:,}; above 1: "
                f"faster than the floor) | {mid:.2f}x (rounds {lo:.2f}-{hi:.2f}) | — |"
            )
        ms, paired = _get(res, row, small), _paired_ratio(res, row, small)
        if paired is not None:
            mid, lo, hi = paired
            lines.append(
                f"| {row}: >= 2x faster than MXNet's row_sparse path (R={small:,}) | "
                f"{mid:.2f}x (rounds {lo:.2f}-{hi:.2f}) | {'yes' if mid >= 2 else 'no'} |"
            )
        dense = _get(res, "dense", small)
        if row == "imperative" and ms is not None and dense is not None:
            lines.append(
                f"| imperative: >= 100x faster than the dense imperative path (R={small:,}) | "
                f"{dense / ms:.0f}x | {'yes' if dense / ms >= 100 else 'no'} |"
            )
        ms_big = _get(res, row, big)
        if ms is not None and ms_big is not None:
            change = ms_big / ms - 1
            lines.append(
                f"| {row}: 10x the table changes a step by < 20% | {change:+.0%} | "
                f"{'yes' if abs(change) < 0.2 else 'no'} |"
            )
        held, share = _get(res, row, big, "held_per_device"), _get(res, row, big, "table_share")
        if held is not None and share:
            lines.append(
                f"| {row}: bytes held per device near the table's 1/D share (R={big:,}) | "
                f"{held / 1e6:.0f} MB for a {share / 1e6:.0f} MB share ({held / share:.2f}x) | "
                f"{'yes' if held / share < 1.25 else 'no'} |"
            )
    return lines


def _loop_rows(res: dict, row: str) -> list[dict]:
    """``row``'s result in each round."""
    rounds = res.get("rounds", [res["results"]])
    return [r for results in rounds for r in results if r["row"] == row]


def _loop_report(res: dict) -> list[str]:
    lines = [
        "### The embedding loop as MXNet code runs it",
        "",
        f"benchmarks/embedding_worker.py, the same code under `jaxkv.mx` and MXNet 1.9.1: a "
        f"row_sparse table of {LOOP_ROWS:,} x {WIDTH} float32 and a dense 256 x 64 key, "
        "`Adam(lazy_update=True)` under a warm-up `CosineScheduler` (a new learning rate every "
        "step), and per step a batch of 1,200-1,300 distinct rows (a new count each step): the "
        "dense key pushed with a priority, the table's row-sparse gradient pushed, its rows "
        "pulled back with `row_sparse_pull`, the dense key pulled. One device in one process "
        "(MXNet: a `local` store), and `dist_sync` over 2 processes of one device each (MXNet: "
        f"2 workers and 2 servers). Median of the {LOOP_STEPS - 10} steps after 10 of warm-up "
        "(across processes the slower one's), median over the rounds; first step: start-up "
        "(jaxkv compiles there); compiles: after the 10th step, the most of any round; "
        "checksums: the last step's pulled rows summed, per process, jaxkv against MXNet.",
        "",
        "| store | jaxkv ms/step | MXNet ms/step | MXNet / jaxkv | first step jaxkv, MXNet "
        "(ms) | compiles after step 10 | same checksums |",
        "|---|---|---|---|---|---|---|",
    ]
    for p, name in ((1, "one device"), (2, "2 processes (dist_sync)")):
        mine, theirs = f"loop-jaxkv-{p}", f"loop-mxnet-{p}"
        ms, mx_ms = _get(res, mine, LOOP_ROWS), _get(res, theirs, LOOP_ROWS)
        err = _get(res, mine, LOOP_ROWS, "error")
        if ms is None:
            lines.append(f"| {name} | failed: {err} | | | | | |")
            continue
        paired = _paired_ratio(res, mine, LOOP_ROWS, theirs)
        ratio = "—"
        if paired is not None:
            mid, lo, hi = paired
            ratio = f"{mid:.2f}x ({lo:.2f}-{hi:.2f})" if hi > lo else f"{mid:.2f}x"
        firsts = f"{_get(res, mine, LOOP_ROWS, 'first_ms'):.0f}"
        if mx_ms is not None:
            firsts += f", {_get(res, theirs, LOOP_ROWS, 'first_ms'):.0f}"
        compiles = max(r.get("compiles", -1) for r in _loop_rows(res, mine))
        same = _loop_checksums(res, p)
        mx_text = "not run" if mx_ms is None else f"{mx_ms:.2f}"
        lines.append(
            f"| {name} | {ms:.2f} | {mx_text} | {ratio} | {firsts} | {compiles} | {same} |"
        )
    return lines


def _loop_checksums(res: dict, p: int) -> str:
    """Whether every round's checksums agree with MXNet's (relative 1e-6): 'yes', 'no (...)'
    or '—' where MXNet did not run."""
    theirs = [r.get("sums") for r in _loop_rows(res, f"loop-mxnet-{p}") if r.get("sums")]
    mine = [r.get("sums") for r in _loop_rows(res, f"loop-jaxkv-{p}") if r.get("sums")]
    if not theirs or not mine:
        return "—"
    worst = 0.0
    for a in mine:
        for rank, x in a.items():
            y = theirs[0].get(rank)
            if y is None:
                return "no (a process missing)"
            worst = max(worst, abs(x - y) / max(abs(y), 1e-12))
    return "yes" if worst <= 1e-6 else f"no (relative {worst:.1e})"


def _loop_goals(res: dict) -> list[str]:
    lines = []
    for p, name in ((1, "one device"), (2, "2 processes")):
        paired = _paired_ratio(res, f"loop-jaxkv-{p}", LOOP_ROWS, f"loop-mxnet-{p}")
        if paired is None:
            continue
        mid, lo, hi = paired
        extra, ok = "", mid >= 1.5
        if p == 1:
            compiles = max(r.get("compiles", -1) for r in _loop_rows(res, "loop-jaxkv-1"))
            extra, ok = f", {compiles} compiles after step 10", ok and 0 <= compiles <= 2
        lines.append(
            f"| the embedding loop, {name}: >= 1.5x MXNet's step"
            f"{' with <= 2 compiles after step 10' if p == 1 else ''} | {mid:.2f}x (rounds "
            f"{lo:.2f}-{hi:.2f}){extra} | {'yes' if ok else 'no'} |"
        )
        same = _loop_checksums(res, p)
        lines.append(
            f"| the embedding loop, {name}: MXNet's values (checksums) | {same} | "
            f"{'yes' if same == 'yes' else 'no'} |"
        )
    return lines


if __name__ == "__main__":
    main()
