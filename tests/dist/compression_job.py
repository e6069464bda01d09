"""Run by tests/test_dist_compression.py under ``python -m jaxkv.launch -n 2
--devices-per-process 2``: gradient compression across processes, against Apache MXNet 1.9.1's
``dist_sync`` with 2 workers (recorded by conformance/record_dist_compression.py into
conformance/data/mxnet_dist_2bit.json) and against a NumPy model of its semantics.

    compression_job.py RECORDED.json CHECKPOINT_DIR

For each recorded run (threshold, store type, big-array bound, optimizer), a ``dist_sync``
store gets ``{'type': '2bit', 'threshold': t}``, every key is initialised to the recorded init
value, and each step every process pushes the recorded inputs from its devices (1 or 2), then
pulls every key. Each pull must be MXNet's, exactly. MXNet's servers decode with the threshold
written with 6 decimals (``%f``); where that differs from the threshold (0.1234567, 3e-7),
jaxkv decodes with the threshold itself, and the pulls must be the model's with it instead.

A run saved after 3 steps and loaded into a fresh store (its residuals, one per process,
with it) must go on exactly as MXNet's. Then fp16 and bf16 (beyond MXNet): each process's sum is rounded to 16 bits, sent, and the
processes' values are added in float32, in process order. Last, the bytes each process writes (to
its sockets) per push of a 2**20-element key, compressed and not: the compressed push must
send at most 1/14 as much.

Each process prints ``rank R ok <what>`` per check and ``rank R done``.
"""

import json
import os
import sys

import jax
import numpy as np
import optax

import jaxkv
import jaxkv.mx as mx

with open(sys.argv[1]) as f:
    RECORDED = json.load(f)
KEYS = RECORDED["keys"]
STEPS = RECORDED["steps"]


def say(line):
    os.write(1, (line + "\n").encode())  # one write: the processes share the pipe


def model(threshold, decode, optimizer):
    """Every key's pull after each step: each worker sums its devices' inputs, compresses the
    sum with its own residual (``threshold``), the servers decode (``decode``) and sum."""
    pulls = {}
    t, d = np.float32(threshold), np.float32(decode)
    for k, spec in KEYS.items():
        inputs = np.asarray(spec["inputs"], np.float32)  # [worker][step][device][...]
        residual = np.zeros((RECORDED["workers"], *spec["shape"]), np.float32)
        stored = np.full(spec["shape"], RECORDED["init"], np.float32)
        pulls[k] = []
        for step in range(STEPS):
            merged = np.zeros(spec["shape"], np.float32)
            for w in range(RECORDED["workers"]):
                residual[w] = residual[w] + inputs[w, step].sum(axis=0, dtype=np.float32)
                up, down = residual[w] >= t, residual[w] <= -t
                residual[w] = np.where(
                    up, residual[w] - t, np.where(down, residual[w] + t, residual[w])
                )
                merged = merged + np.where(up, d, np.where(down, -d, np.float32(0)))
            stored = stored - np.float32(optimizer["sgd"]) * merged if optimizer else merged
            pulls[k].append(stored)
    return pulls


def run_store(store, params, optimizer, bound, pushes, resume=None):
    """Pulls of every key after each step of ``pushes(key, step)`` (this process's values).
    ``resume=(step, directory)``: after that many steps, save the store there and go on in a
    fresh store that loads it (values and every process's residuals)."""
    if bound is None:
        os.environ.pop("MXNET_KVSTORE_BIGARRAY_BOUND", None)
    else:
        os.environ["MXNET_KVSTORE_BIGARRAY_BOUND"] = str(bound)
    # MXNet reads its type names by substring: it took 'dist_sync_device' for jaxkv's (and
    # its documented) 'dist_device_sync'.
    kv = mx.kv.create({"dist_sync_device": "dist_device_sync"}.get(store, store))
    kv.set_gradient_compression(params)
    if optimizer:
        kv.set_optimizer(optax.sgd(optimizer["sgd"]))
    keys = [int(k) for k in KEYS]
    kv.init(keys, [mx.nd.full(KEYS[str(k)]["shape"], RECORDED["init"]) for k in keys])
    pulls = {str(k): [] for k in keys}
    for step in range(STEPS):
        if resume and step == resume[0]:
            kv.save(resume[1])
            kv = mx.kv.create(store)
            kv.set_gradient_compression(params)
            if optimizer:
                kv.set_optimizer(optax.sgd(optimizer["sgd"]))
            kv.load(resume[1])
        kv.push(keys, [pushes(str(k), step) for k in keys])
        for k in keys:
            pulls[str(k)].append(np.asarray(kv.pull(k)))
    return kv, pulls


def recorded_inputs(rank):
    def pushes(k, step):
        blocks = np.asarray(KEYS[k]["inputs"], np.float32)[rank, step]
        return [mx.nd.array(b, ctx=mx.cpu(d)) for d, b in enumerate(blocks)]

    return pushes


def check_mxnet_runs(rank):
    for n, run in enumerate(RECORDED["runs"]):
        params = {"type": "2bit", "threshold": run["threshold"]}
        kv, got = run_store(
            run["store"], params, run["optimizer"], run["bigarray_bound"], recorded_inputs(rank)
        )
        exact = np.float32(run["threshold"]) == np.float32(run["server_threshold"])
        want = {k: [np.asarray(p, np.float32) for p in v] for k, v in run["pulls"].items()}
        if not exact:  # MXNet's decoding with a rounded threshold: jaxkv uses the threshold
            mxnet_model = model(run["threshold"], run["server_threshold"], run["optimizer"])
            for k in want:  # the recorded values are that model's: so the model is MXNet's
                np.testing.assert_array_equal(np.asarray(mxnet_model[k]), np.asarray(want[k]))
            want = model(run["threshold"], run["threshold"], run["optimizer"])
        for k in KEYS:
            for step in range(STEPS):
                np.testing.assert_array_equal(
                    got[k][step], want[k][step], err_msg=f"run {n} key {k} step {step}"
                )
        say(f"rank {rank} ok run {n} {'mxnet' if exact else 'model'} t={run['threshold']}")


def check_resumed_run(rank, directory):
    """Saved after 3 steps and loaded into a fresh store, a run goes on exactly as MXNet's."""
    run = RECORDED["runs"][0]
    params = {"type": "2bit", "threshold": run["threshold"]}
    _, got = run_store(
        "dist_sync", params, None, run["bigarray_bound"], recorded_inputs(rank), (3, directory)
    )
    for k in KEYS:
        for step in range(STEPS):
            want = np.asarray(run["pulls"][k][step], np.float32)
            np.testing.assert_array_equal(got[k][step], want, err_msg=f"key {k} step {step}")
    say(f"rank {rank} ok resumed from a checkpoint")


def check_half_precision(rank, processes):
    rng = np.random.default_rng(7)
    # [process][step][device][...]: values that 16 bits round, so a missed rounding shows.
    inputs = {
        k: rng.normal(size=(processes, STEPS, 2, *s["shape"])).astype(np.float32)
        for k, s in KEYS.items()
    }

    def pushes(k, step):
        return [mx.nd.array(b, ctx=mx.cpu(d)) for d, b in enumerate(inputs[k][rank, step])]

    for kind, low in (("fp16", np.float16), ("bf16", jax.numpy.bfloat16)):
        _, got = run_store("dist_sync", {"type": kind}, None, 10, pushes)
        for k in KEYS:
            for step in range(STEPS):
                sums = [inputs[k][p, step].sum(axis=0, dtype=np.float32) for p in range(processes)]
                want = np.zeros(KEYS[k]["shape"], np.float32)
                for s in sums:  # each process's sum sent in 16 bits, added in process order
                    want = want + s.astype(low).astype(np.float32)
                np.testing.assert_array_equal(got[k][step], want, err_msg=f"{kind} key {k}")
                exact = sum(sums[1:], sums[0])
                assert not np.array_equal(want, exact), f"{kind} key {k}: nothing was rounded"
        say(f"rank {rank} ok {kind} sums of 16-bit values")


def written_bytes():
    """Bytes this process has written so far (its sockets included: gloo writes its messages
    with writev)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def check_bytes(rank):
    n, pushes = 1 << 20, 5
    os.environ["MXNET_KVSTORE_BIGARRAY_BOUND"] = str(1 << 40)  # whole values: bytes of a sum
    ones = [mx.nd.ones((n,), mx.cpu(0)) * 0.7]
    sent = {}
    for kind in (None, "2bit"):
        kv = mx.kv.create("dist_sync")
        if kind:
            kv.set_gradient_compression({"type": kind, "threshold": 0.5})
        kv.init(0, mx.nd.zeros((n,)))
        kv.push(0, ones)  # compiled and warm
        kv.barrier()
        before = written_bytes()
        for _ in range(pushes):
            kv.push(0, ones)
        kv.barrier()
        sent[kind] = (written_bytes() - before) / pushes
    ratio = sent["2bit"] / sent[None]
    assert ratio <= 1 / 14, f"bytes per push per process: {sent}, ratio {ratio:.4f}"
    say(f"rank {rank} ok bytes per push {sent[None]:.0f}, compressed {sent['2bit']:.0f}")


def check_refusal(rank):
    """Across processes, a store with several devices in a process cannot compress once per
    process: refused, naming the layout to use."""
    try:
        jaxkv.empty(jax.devices(), compression={"type": "2bit", "threshold": 0.5})
    except jaxkv.KVStoreError as e:
        assert "one device per process" in str(e), e
    else:
        raise AssertionError("a compressed store over every device of every process was made")
    say(f"rank {rank} ok refused")


def main():
    rank, processes = jax.process_index(), jax.process_count()
    assert processes == RECORDED["workers"], "run with as many processes as MXNet had workers"
    check_refusal(rank)
    check_mxnet_runs(rank)
    check_resumed_run(rank, sys.argv[2])
    check_half_precision(rank, processes)
    check_bytes(rank)
    say(f"rank {rank} done")


if __name__ == "__main__":
    main()
