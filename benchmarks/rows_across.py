"""The functional embedding step across processes: each process pushes a batch's rows of a table
split over every process's devices and pulls them back updated (``jaxkv.pushpull_rows``,
optax's Adam, lazy, the table donated), with the push kept between host agreements (it starts
with its computation, the processes' agreement riding in it: ``jaxkv/_src/rows/inband.py``)
and agreed on the host at every step, in interleaved rounds.

    python -m jaxkv.launch -n 2 --devices-per-process 1 --no-prefix \\
        benchmarks/rows_across.py [--rows R] [--steps S] [--rounds K]

Prints per round and process ``rows_across round=<k> kept=<0|1> rank=<r> median_ms=<x>
host_syncs=<y>`` (the median step after 10 warm-up steps; the host collectives a step), then
``rows_across rank=<r> kept/agreed=<ratio per round>`` and a checksum of the table that both
ways must agree on (they run the same pushes).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxkv
from jaxkv._src.processes import host
from jaxkv._src.rows import inband

WIDTH, LOW, HIGH, WARM = 64, 1200, 1300, 10


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rank = jax.process_index()
    start = np.random.default_rng(1234).normal(size=(args.rows, WIDTH)).astype(np.float32)
    states = {}
    for kept in (True, False):  # (one table each: the same pushes, compared at the end)
        states[kept] = jaxkv.init(jaxkv.empty(), {"emb": start})
    del start
    adam = optax.adam(0.01)
    rngs = {kept: np.random.default_rng(rank) for kept in (True, False)}
    calls: list[int] = []
    mine = host._mine
    host._mine = lambda x: calls.append(1) or mine(x)
    ratios = []
    for k in range(args.rounds):
        medians = {}
        for kept in (True, False) if k % 2 == 0 else (False, True):
            inband.ENABLED = kept
            state, rng, times, synced = states[kept], rngs[kept], [], 0
            for step in range(args.steps):
                n = int(rng.integers(LOW, HIGH + 1))
                ids = np.sort(rng.choice(args.rows, n, replace=False)).astype(np.int32)
                grad = jnp.asarray(rng.normal(size=(n, WIDTH)).astype(np.float32) / 100)
                if step == WARM:
                    synced = len(calls)
                t = time.perf_counter()
                state, got = jaxkv.pushpull_rows(state, "emb", ids, grad, updater=adam, donate=True)
                got.block_until_ready()
                times.append(time.perf_counter() - t)
            states[kept] = state
            medians[kept] = float(np.median(times[WARM:])) * 1e3
            per_step = (len(calls) - synced) / (args.steps - WARM)
            print(
                f"rows_across round={k} kept={int(kept)} rank={rank} "
                f"median_ms={medians[kept]:.3f} host_syncs={per_step:g}",
                flush=True,
            )
        ratios.append(medians[True] / medians[False])
    host._mine = mine
    inband.ENABLED = True
    sums = {
        kept: float(
            np.asarray(jaxkv.pull(s, "emb", devices=jax.local_devices()[0]), np.float64).sum()
        )
        for kept, s in states.items()
    }
    print(
        f"rows_across rank={rank} kept/agreed={' '.join(f'{r:.2f}' for r in ratios)} "
        f"checksum_kept={sums[True]:.9g} checksum_agreed={sums[False]:.9g}",
        flush=True,
    )


if __name__ == "__main__":
    main()
