"""Records Apache MXNet 1.9.1's 2-bit gradient compression in ``dist_sync`` with 2 workers.

Run with MXNet's own venv (it starts every role with the same python):

    "$(bash conformance/setup_mxnet.sh)" conformance/record_dist_compression.py

It writes conformance/data/mxnet_dist_2bit.json. Each run is one MXNet parameter-server job on
loopback (a scheduler, 1 or 2 servers, 2 workers; ``benchmarks/dist.py``'s ``mxnet_job``), with
one compression threshold. In every run both workers push the same six keys, each step a fresh
array per device (``inputs``: 1 or 2 cpu contexts per worker, the worker's rank picks its
values), then pull each key into fresh arrays on the same contexts. Every pull is recorded,
and checked against :func:`model`, a NumPy model of the semantics (the script fails on any
disagreement). A last job records what MXNet refuses and its default threshold.

Numbers in the JSON are float32 values written as the shortest decimal that reads back to the
same float32 (read them with ``np.float32``).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
import dist  # noqa: E402  (benchmarks/dist.py: mxnet_job starts the roles)

OUT = os.path.join(HERE, "data", "mxnet_dist_2bit.json")
WORKERS = 2
STEPS = 6
SEED = 0
INIT = 7.0  # every key's initial value (a pull after a push shows whether it is kept)
G = [0.3, 0.3, -0.7, 1.2, 0.05, -2.0]
BOUND = 10  # MXNET_KVSTORE_BIGARRAY_BOUND: the (4, 5) keys (20 elements) are split over servers
# key: (shape, devices per worker, values); "hand": G rolled by the step, times (w + 1)(d + 1);
# "random": uniform(-1.2, 1.2) rounded to 2 decimals (np.random.default_rng(SEED), keys in order)
KEYS = {
    3: ((2, 3), 1, "hand"),
    4: ((2, 3), 2, "hand"),
    5: ((2, 3), 1, "random"),
    6: ((2, 3), 2, "random"),
    7: ((4, 5), 1, "random"),
    8: ((4, 5), 2, "random"),
}
# One job each. bound None: MXNet's default (10**6, no key is split).
RUNS = [
    {"threshold": 0.5, "servers": 1, "bound": BOUND},
    {"threshold": 0.5, "servers": 2, "bound": BOUND},
    {"threshold": 0.25, "servers": 1, "bound": BOUND},
    {"threshold": 0.25, "servers": 2, "bound": BOUND},
    {"threshold": 0.5, "servers": 2, "bound": None},
    {"threshold": 0.5, "servers": 2, "bound": BOUND, "optimizer": {"sgd": 0.5}},
    {"threshold": 0.5, "servers": 2, "bound": BOUND, "store": "dist_sync_device"},
    # the servers get the threshold as C++ std::to_string(float), i.e. "%f": 6 decimals
    {"threshold": 0.1234567, "servers": 2, "bound": BOUND},
    {"threshold": 3e-7, "servers": 1, "bound": BOUND},
]
REFUSED = [
    {"type": "fp16"},
    {"type": "bf16"},
    {"type": "1bit", "threshold": 0.5},
    {"type": "2bit", "threshold": 0},
    {"type": "2bit", "threshold": -0.5},
]
TIMEOUT = 120  # seconds for one job


def inputs() -> dict[int, np.ndarray]:
    """Every pushed value: key -> float32 array ``[worker, step, device, *shape]``."""
    rng = np.random.default_rng(SEED)
    xs = {}
    for key, (shape, devices, kind) in KEYS.items():
        if kind == "hand":
            x = np.empty((WORKERS, STEPS, devices, *shape))
            for w in range(WORKERS):
                for s in range(STEPS):
                    for d in range(devices):
                        x[w, s, d] = np.roll(G, s).reshape(shape) * (w + 1) * (d + 1)
        else:
            x = rng.uniform(-1.2, 1.2, (WORKERS, STEPS, devices, *shape)).round(2)
        xs[key] = x.astype(np.float32)
    return xs


def server_threshold(threshold: float) -> np.float32:
    """The threshold the servers decode with: the workers send it as ``std::to_string(float)``
    (``"%f"``) and the servers read it back with ``std::stof``."""
    return np.float32(f"{float(np.float32(threshold)):f}")


def model(x: np.ndarray, threshold: float, sgd: float | None = None) -> np.ndarray:
    """MXNet dist_sync 2-bit, as read in its source and checked here: each worker sums its
    devices' values at full precision (float32), adds the sum to its own residual for the key,
    and sends ``+t`` where ``residual >= t`` (then ``residual -= t``), ``-t`` where
    ``residual <= -t`` (then ``residual += t``), else 0. The servers decode (with
    :func:`server_threshold`), sum the workers' values, and assign the sum to the stored value
    (or, with an SGD optimizer, ``stored -= lr * sum``). Returns the pulls ``[step, *shape]``."""
    t = np.float32(threshold)
    ts = server_threshold(threshold)
    residual = np.zeros((x.shape[0], *x.shape[3:]), np.float32)
    stored = np.full(x.shape[3:], INIT, np.float32)
    pulls = []
    for s in range(x.shape[1]):
        merged = np.zeros(x.shape[3:], np.float32)
        for w in range(x.shape[0]):
            total = x[w, s, 0].copy()
            for d in range(1, x.shape[2]):
                total += x[w, s, d]
            residual[w] += total
            sent = np.where(residual[w] >= t, 1, np.where(residual[w] <= -t, -1, 0))
            residual[w] -= (sent * t).astype(np.float32)
            merged += (sent * ts).astype(np.float32)
        stored = merged if sgd is None else stored - np.float32(sgd) * merged
        pulls.append(stored)
    return np.array(pulls)


def model_per_device(x: np.ndarray, threshold: float) -> np.ndarray:
    """The alternative the recording rules out: each device compresses its own value with its
    own residual (as MXNet's single-process ``device`` store does), then the values are summed."""
    t = np.float32(threshold)
    residual = np.zeros((x.shape[0], x.shape[2], *x.shape[3:]), np.float32)
    pulls = []
    for s in range(x.shape[1]):
        merged = np.zeros(x.shape[3:], np.float32)
        for w in range(x.shape[0]):
            for d in range(x.shape[2]):
                residual[w, d] += x[w, s, d]
                sent = np.where(residual[w, d] >= t, 1, np.where(residual[w, d] <= -t, -1, 0))
                residual[w, d] -= (sent * t).astype(np.float32)
                merged += (sent * t).astype(np.float32)
        pulls.append(merged)
    return np.array(pulls)


def _f32(a) -> object:
    """A float32 array as nested lists of the shortest decimals that read back to it."""
    a = np.asarray(a, np.float32)
    if a.ndim == 0:
        return float(str(np.float32(a)))
    return [_f32(v) for v in a]


def _error(e: Exception) -> str:
    """An MXNetError's message without its stack trace: the line that names the failed check."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    named = [line for line in lines if "Check failed" in line or "rror" in line.split(":")[0]]
    return (named or lines or [""])[-1]


# -- the worker's side (runs in each MXNet worker) --------------------------------------------


def worker_run(config: dict) -> dict:
    import mxnet as mx

    kv = mx.kv.create(config.get("store", "dist_sync"))
    kv.set_gradient_compression({"type": "2bit", "threshold": config["threshold"]})
    if config.get("optimizer"):
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=config["optimizer"]["sgd"]))
    xs = inputs()
    for key, (shape, _, _) in KEYS.items():
        kv.init(key, mx.nd.full(shape, INIT))
    first = {}
    for key, (shape, _, _) in KEYS.items():
        out = mx.nd.zeros(shape)
        kv.pull(key, out=out)
        first[key] = out.asnumpy()
    pulls: dict[int, list] = {key: [] for key in KEYS}
    for s in range(STEPS):
        # fresh arrays for every push and every pull: with one array per key MXNet's dist pull
        # writes into the pushed buffer
        for key, (_, devices, _) in KEYS.items():
            kv.push(key, [mx.nd.array(xs[key][kv.rank, s, d], mx.cpu(d)) for d in range(devices)])
        outs = {}
        for key, (shape, devices, _) in KEYS.items():
            outs[key] = [mx.nd.zeros(shape, mx.cpu(d)) for d in range(devices)]
            kv.pull(key, out=outs[key])
        mx.nd.waitall()
        for key, out in outs.items():
            values = [o.asnumpy() for o in out]
            assert all((v == values[0]).all() for v in values), (key, s, values)
            pulls[key].append(values[0])
    return {
        "rank": kv.rank,
        "first": {k: _f32(v) for k, v in first.items()},
        "pulls": {k: _f32(v) for k, v in pulls.items()},
    }


def worker_edges() -> dict:
    import mxnet as mx

    kv = mx.kv.create("dist_sync")
    refusals = {}
    for params in REFUSED:
        try:
            kv.set_gradient_compression(params)
            refusals[repr(params)] = None
        except Exception as e:  # MXNetError
            refusals[repr(params)] = _error(e)
    kv.set_gradient_compression({"type": "2bit"})  # the default threshold
    kv.init(3, mx.nd.zeros((2, 3)))
    default = []
    for _ in range(3):
        kv.push(3, [mx.nd.full((2, 3), 0.3)])
        out = mx.nd.zeros((2, 3))
        kv.pull(3, out=out)
        default.append(float(out.asnumpy()[0, 0]))
    try:
        out = mx.nd.zeros((2, 3))
        kv.pushpull(3, mx.nd.ones((2, 3)), out=out)
        mx.nd.waitall()
        refusals["pushpull"] = None
    except Exception as e:
        refusals["pushpull"] = _error(e)
    # A float16 key: rank 0's init pushes it (and fails before init's barrier), so rank 0
    # meets the other workers at a barrier of its own.
    try:
        kv.init(9, mx.nd.zeros((2, 3), dtype="float16"))
        refusals["init float16"] = None
    except Exception as e:
        refusals["init float16"] = _error(e)
        kv._barrier()
    try:
        kv.push(9, [mx.nd.ones((2, 3), dtype="float16")])
        mx.nd.waitall()
        refusals["push float16"] = None
    except Exception as e:
        refusals["push float16"] = _error(e)
    return {"rank": kv.rank, "refusals": refusals, "default_threshold_pulls": default}


# -- the recorder's side ----------------------------------------------------------------------


def job(config: dict, servers: int, bound: int | None) -> list[dict]:
    """One MXNet job; returns the workers' results, rank order."""
    env = {"OMP_NUM_THREADS": "1"}
    if bound is not None:
        env["MXNET_KVSTORE_BIGARRAY_BOUND"] = str(bound)
    roles = dist.mxnet_job(
        [os.path.abspath(__file__), "--worker", json.dumps(config)],
        servers=servers,
        workers=WORKERS,
        env=env,
        python=sys.executable,
        timeout=TIMEOUT,
    )
    results = []
    for role, rc, out, err in roles:
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if rc != 0 or (role == "worker" and not lines):
            raise RuntimeError(f"MXNet {role} exited {rc} for {config}:\n{out}\n{err[-3000:]}")
        results += [json.loads(line[len("RESULT ") :]) for line in lines]
    return sorted(results, key=lambda r: r["rank"])


def record_run(run: dict, xs: dict[int, np.ndarray]) -> dict:
    config = {k: v for k, v in run.items() if k not in ("servers", "bound")}
    results = job(config, run["servers"], run["bound"])
    assert results[0]["pulls"] == results[1]["pulls"], "the workers pulled different values"
    pulls = {int(k): np.array(v, np.float32) for k, v in results[0]["pulls"].items()}
    sgd = run.get("optimizer", {}).get("sgd") if run.get("optimizer") else None
    for key, first in results[0]["first"].items():
        assert (np.array(first) == INIT).all(), (run, key, first)
    for key, x in xs.items():
        expected = model(x, run["threshold"], sgd)
        if not (pulls[key] == expected).all():
            raise AssertionError(
                f"MXNet and the model differ for {run}, key {key}:\n"
                f"MXNet {pulls[key].tolist()}\nmodel {expected.tolist()}"
            )
    print(f"recorded {run}: matches the model", file=sys.stderr)
    return {
        "store": run.get("store", "dist_sync"),
        "threshold": run["threshold"],
        "server_threshold": float(str(server_threshold(run["threshold"]))),
        "servers": run["servers"],
        "bigarray_bound": run["bound"],
        "optimizer": run.get("optimizer"),
        "pulls": {str(k): _f32(v) for k, v in pulls.items()},
    }


def _numbers(obj) -> int | None:
    """How many numbers a nested list holds, or None if it holds anything else."""
    if isinstance(obj, list):
        counts = [_numbers(v) for v in obj]
        return None if None in counts else sum(counts)
    return 1 if isinstance(obj, int | float) and not isinstance(obj, bool) else None


def _dumps(obj, indent: int = 0) -> str:
    """JSON with every nested list of at most 24 numbers (a step's value) on one line."""
    pad = " " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{pad}{json.dumps(k)}: {_dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(obj, list) and obj and (_numbers(obj) or 25) > 24:
        items = [pad + _dumps(v, indent + 1) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
    return json.dumps(obj)


def main() -> None:
    xs = inputs()
    runs = [record_run(run, xs) for run in RUNS]
    edges = job({"edges": True}, 1, None)
    assert edges[0]["refusals"].keys() == edges[1]["refusals"].keys()
    per_device_differs = {
        t: [key for key, x in xs.items() if not (model_per_device(x, t) == model(x, t)).all()]
        for t in (0.5, 0.25)
    }
    out = {
        "mxnet": "1.9.1",
        "workers": WORKERS,
        "steps": STEPS,
        "init": INIT,
        "notes": [
            "Each run: one dist_sync job (MXNET_KVSTORE_BIGARRAY_BOUND = bigarray_bound, null = "
            "MXNet's default 10**6), kv.set_gradient_compression({'type': '2bit', 'threshold'}) "
            "right after create, every key init to `init`, then per step: each worker pushes "
            "every key from its devices (fresh arrays: keys[k].inputs[rank][step][device]), then "
            "pulls every key into fresh arrays on the same contexts (all equal; one recorded). "
            "runs[i].pulls[k][step] is the pulled value after that step's pushes; both workers "
            "pulled the same.",
            "Semantics (every run matches this NumPy model exactly): a worker sums its own "
            "devices' values at full precision (float32; no compression between devices, in "
            "dist_sync and dist_sync_device alike), then compresses that sum once, with ONE "
            "residual per worker and key: residual += sum; where residual >= t it sends +t and "
            "residual -= t; where residual <= -t it sends -t and residual += t; else 0. A worker "
            "with a single device compresses too. The servers decode, sum the 2 workers' "
            "values, and (no optimizer) assign the sum: the init value and earlier pulls are "
            "not kept. With SGD(learning_rate=lr) on the servers: stored -= lr * sum.",
            "A per-device model (each device compressing with its own residual, as the "
            "single-process 'device' store does) differs from MXNet for the 2-device keys "
            f"(threshold: keys where it differs: {per_device_differs}): MXNet dist_sync does not "
            "compress per device.",
            "Splitting a big key over servers (20 elements >= bigarray_bound 10, 2 servers: "
            "the compressed key is cut at 16-element words, 16 + 4 elements) does not change "
            "any value: 1 and 2 servers, bound 10 and the default, all give the model's values.",
            "The servers decode with server_threshold, not threshold: workers send the "
            "threshold to the servers as C++ std::to_string(float) ('%f', 6 decimals). "
            "threshold 0.1234567 decodes as +-0.123457; threshold 3e-7 as +-0 (every pull 0) "
            "while the workers' residuals still subtract 3e-7 (a decoded -t of -0 pulls as -0.0).",
            "Sizes (MXNet's source, kvstore_dist.h): a compressed push of a key of n elements "
            "sends ceil(n / 16) 32-bit words (16 two-bit codes each; a big key is cut between "
            "servers at word boundaries) and a zero-length key that carries n; init is sent "
            "uncompressed, cut the same way; pulls are not compressed (n float32). A pull "
            "before any push gives the init value.",
            "Inputs: keys[k].inputs, float32 [worker][step][device][rows][cols]; 'hand' is "
            "np.roll(G, step).reshape(shape) * (worker + 1) * (device + 1); 'random' is "
            "np.random.default_rng(seed).uniform(-1.2, 1.2, (workers, steps, devices, *shape))"
            ".round(2), drawn for the random keys in key order; both cast to float32.",
            "Numbers are float32 values written as the shortest decimal that reads back to the "
            "same float32: read them with np.float32.",
        ],
        "seed": SEED,
        "G": G,
        "keys": {
            str(key): {
                "shape": list(shape),
                "devices": devices,
                "kind": kind,
                "inputs": _f32(xs[key]),
            }
            for key, (shape, devices, kind) in KEYS.items()
        },
        "runs": runs,
        "default_threshold": {
            "pushes": "{'type': '2bit'} (no threshold); key 3 (2, 3) init 0; each worker pushes "
            "0.3 from 1 device, 3 steps",
            "pulls": edges[0]["default_threshold_pulls"],
            "model_threshold_0.5": model(np.full((WORKERS, 3, 1, 1), 0.3, np.float32), 0.5)
            .ravel()
            .tolist(),
        },
        "refusals": {
            "store": "dist_sync, 2 workers, 1 server; messages are rank 0's (the last line)",
            **edges[0]["refusals"],
        },
    }
    assert out["default_threshold"]["pulls"] == [0.0, 1.0, 0.0]
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write(_dumps(out) + "\n")
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    role = os.environ.get("DMLC_ROLE")
    if role in ("scheduler", "server"):
        import mxnet  # noqa: F401  (runs the role, then returns when the job ends)
    elif len(sys.argv) == 3 and sys.argv[1] == "--worker":
        config = json.loads(sys.argv[2])
        result = worker_edges() if config.get("edges") else worker_run(config)
        print("RESULT " + json.dumps(result), flush=True)
    else:
        main()
