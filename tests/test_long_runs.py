"""Long runs of one store: after a warm-up, thousands of pushes compile nothing more and the
process's resident memory stays flat."""

import gc
import pathlib

import jax
import numpy as np
import optax
import pytest

import jaxkv
import jaxkv.mx as mx

KEYS = [0, 1, 2]
SHAPES = {0: (4, 3), 1: (16,), 2: (2, 2, 2)}
WARM_UP = 60  # pushes: every computation of the loop compiled, every cache filled
# Resident memory a run may gain after its warm-up: allocator noise, not a leak (measured:
# 20 KiB for jaxkv's store, 420 KiB for the mx one over 2,000 pushes; a leak of 2 KiB a push
# shows in the default run, of 200 bytes a push in the deep one).
RSS_BOUND = 4 * 2**20


def _rss() -> int:
    """The process's resident memory, in bytes (Linux's /proc/self/status)."""
    gc.collect()
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no VmRSS in /proc/self/status")


def _store(kind):
    if kind == "jaxkv":  # jaxkv's own store over one device, an optax optimizer
        kv = jaxkv.KVStore("local", devices=jax.devices("cpu")[:1])
        kv.set_optimizer(optax.sgd(0.01, momentum=0.9))
        return kv, None
    opt = mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4)
    kv = mx.kv.create("local")  # the MXNet drop-in, MXNet's optimizer, a new rate each step
    kv.set_optimizer(opt)
    return kv, opt


def _run(kind, pushes, compiles):
    """``pushes`` pushes of one key at a time (MXNet's loop), a pull of every key after each
    round; returns the compiles and the resident memory gained after the warm-up."""
    kv, opt = _store(kind)
    rng = np.random.default_rng(0)
    for k in KEYS:
        kv.init(k, mx.nd.array(rng.standard_normal(SHAPES[k]).astype(np.float32)))
    grads = {k: mx.nd.array(rng.standard_normal(SHAPES[k]).astype(np.float32)) for k in KEYS}
    outs = {k: mx.nd.zeros(SHAPES[k]) for k in KEYS}

    def round_(step):
        if opt is not None:
            opt.set_learning_rate(0.1 / (1 + step))  # a host number: compiles nothing
        for k in KEYS:
            kv.push(k, grads[k])
        kv.pull(KEYS, out=[outs[k] for k in KEYS])

    rounds = pushes // len(KEYS)
    warm = WARM_UP // len(KEYS)
    for step in range(warm):
        round_(step)
    before = _rss()
    with compiles() as c:
        for step in range(warm, rounds):
            round_(step)
    gained = _rss() - before
    assert all(np.isfinite(outs[k].asnumpy()).all() for k in KEYS)
    return c.count, gained


@pytest.mark.parametrize(
    "pushes", [2_000, pytest.param(20_000, marks=pytest.mark.deep)], ids=["2k", "20k"]
)
@pytest.mark.parametrize("kind", ["jaxkv", "mx"])
def test_a_long_run_compiles_nothing_after_its_warm_up_and_keeps_its_memory(kind, pushes, compiles):
    with compiles() as counter:  # the counter counts: a new function compiles once
        jax.jit(lambda x: x + 1)(np.float32(pushes))
    assert counter.count == 1
    count, gained = _run(kind, pushes, compiles)
    assert count == 0, f"{count} compiles after the warm-up of {WARM_UP} pushes"
    assert gained < RSS_BOUND, f"resident memory grew by {gained / 2**20:.1f} MiB"
