"""``make bench``'s "new keys" rows: keys made one at a time, as MXNet's KVStore tutorial makes
them, timed from a fresh process (start-up and compiles included), jaxkv beside MXNet 1.9.1.

    python benchmarks/new_keys.py [--keys 100] [--json FILE]

Each updater runs in a process of its own, for jaxkv (``jaxkv.mx``) and for MXNet (its venv,
``conformance/setup_mxnet.sh``; "not run" where it is absent): per key ``kv.init(k, ones)``,
``kv.push(k, grad)``, ``kv.pull(k, out=out)`` and ``out.asnumpy()``, on one CPU device, keys of
shape (2, 3). The updaters: none (assign), a Python updater (``kv._set_updater``, in-place
``weight[:] = weight - 0.1 * grad``), MXNet's SGD and Adam (``kv.set_optimizer``), and for
jaxkv alone ``optax.adam`` (MXNet has no optax). Printed: seconds for all keys, XLA compiles
(jaxkv), MXNet's seconds and the ratio; every value checked against the updater's rule.

    python benchmarks/new_keys.py --side jaxkv|mxnet --updater U --keys N

is one side's process (prints one JSON line).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
UPDATERS = ("none", "python", "mxnet-sgd", "mxnet-adam", "optax-adam")
SHAPE = (2, 3)


def _side(side: str, updater: str, keys: int) -> dict:
    """One side's loop in this process: seconds, compiles (jaxkv), first and last key's ms."""
    compiles = []
    if side == "mxnet":
        import mxnet as mx
    else:
        import jax

        import jaxkv.mx as mx

        class Counter(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.getMessage().startswith("Compiling"):
                    compiles.append(1)

        jax.config.update("jax_log_compiles", True)
        logging.getLogger("jax").addHandler(Counter())
        logging.getLogger("jax").setLevel(logging.WARNING)
        logging.getLogger("jax").propagate = False
    import numpy as np

    start = time.perf_counter()
    kv = mx.kv.create("local")
    if updater == "python":

        def update(key, grad, weight):
            weight[:] = weight - 0.1 * grad

        kv._set_updater(update)
    elif updater == "mxnet-sgd":
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    elif updater == "mxnet-adam":
        kv.set_optimizer(mx.optimizer.Adam(learning_rate=0.1))
    elif updater == "optax-adam":
        import optax

        kv.set_optimizer(optax.adam(0.1))
    want = {"none": 2.0, "python": 0.8, "mxnet-sgd": 0.8, "mxnet-adam": 0.9, "optax-adam": 0.9}
    times = []
    for k in range(keys):
        t = time.perf_counter()
        kv.init(k, mx.nd.ones(SHAPE))
        kv.push(k, mx.nd.ones(SHAPE) * 2)
        out = mx.nd.zeros(SHAPE)
        kv.pull(k, out=out)
        value = out.asnumpy()
        times.append(time.perf_counter() - t)
        if not np.allclose(value, want[updater], rtol=1e-4):
            raise SystemExit(
                f"{side} {updater}: key {k} is {value.ravel()[:3]}, not {want[updater]}"
            )
    return {
        "side": side,
        "updater": updater,
        "keys": keys,
        "s": time.perf_counter() - start,
        "compiles": len(compiles) if side == "jaxkv" else None,
        "first_ms": 1e3 * times[0],
        "last_ms": 1e3 * times[-1],
    }


def _mxnet_python() -> str | None:
    venv = os.environ.get("MXNET_VENV", os.path.join(ROOT, ".venv-mxnet"))
    return (
        os.path.join(venv, "bin", "python") if os.path.exists(os.path.join(venv, ".ok")) else None
    )


def one(side: str, updater: str, keys: int) -> dict | None:
    """One side's loop in a fresh process (``None``: MXNet's venv is absent)."""
    python = sys.executable if side == "jaxkv" else _mxnet_python()
    if python is None:
        return None
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (ROOT, env.get("PYTHONPATH")) if x)
    command = [python, os.path.abspath(__file__), "--side", side, "--updater", updater]
    out = subprocess.run(
        [*command, "--keys", str(keys)], env=env, capture_output=True, text=True, timeout=1800
    )
    if out.returncode:
        raise RuntimeError(f"{side} {updater}:\n{out.stdout[-2000:]}{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(keys: int = 100, log=print) -> list[dict]:
    """Every updater's row: jaxkv's and MXNet's side, each in a process of its own."""
    rows = []
    for updater in UPDATERS:
        log(f"  [new keys] {updater}: {keys} keys ...")
        mine = one("jaxkv", updater, keys)
        theirs = None if updater == "optax-adam" else one("mxnet", updater, keys)
        rows.append({"updater": updater, "jaxkv": mine, "mxnet": theirs})
    return rows


def report(rows: list[dict]) -> list[str]:
    """The rows as a markdown table."""
    keys = rows[0]["jaxkv"]["keys"]
    out = [
        f"New keys: {keys} keys of shape (2, 3) made one at a time (init, push, pull into an "
        "out, read), from a fresh process, one CPU device (`benchmarks/new_keys.py`).",
        "",
        "| updater | jaxkv s | jaxkv compiles | jaxkv last key ms | MXNet s | MXNet / jaxkv |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        j, m = r["jaxkv"], r["mxnet"]
        theirs = f"{m['s']:.2f} | {m['s'] / j['s']:.2f}x" if m else "— | —"
        out.append(
            f"| {r['updater']} | {j['s']:.2f} | {j['compiles']} | {j['last_ms']:.1f} | {theirs} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--side", choices=("jaxkv", "mxnet"))
    parser.add_argument("--updater", choices=UPDATERS)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    if args.side:
        print(json.dumps(_side(args.side, args.updater, args.keys)), flush=True)
        return
    rows = run(args.keys, log=lambda m: print(m, file=sys.stderr, flush=True))
    print("\n".join(report(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
