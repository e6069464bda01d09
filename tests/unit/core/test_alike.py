"""jaxkv/_src/core/alike.py: a flat store's list push with MXNet's optimizers updates the keys
that lie end to end with one shape as one batch, with each key's own state and numbers: the same
bits as the per-key layout, which updates every key apart; rules that are not elementwise are
not batched."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
import jaxkv.mx as mx
from jaxkv import nd
from jaxkv._src.core import alike

# Runs of keys alike broken by keys of other shapes: (4, 3) x 5, then (2, 2), (4, 3) x 3, (5,) x 2.
SHAPES = [(4, 3)] * 5 + [(2, 2)] + [(4, 3)] * 3 + [(5,)] * 2


def _optimizer(name):
    opt = {
        "sgd": lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3),
        "adam": lambda: mx.optimizer.Adam(learning_rate=0.01, wd=1e-4),
        "rmsprop": lambda: mx.optimizer.RMSProp(learning_rate=0.01, centered=True),
        "ftrl": lambda: mx.optimizer.Ftrl(learning_rate=0.1, lamda1=0.01),
        "nadam": lambda: mx.optimizer.Nadam(learning_rate=0.01),
        "lamb": lambda: mx.optimizer.LAMB(learning_rate=0.01),
    }[name]()
    opt.set_lr_mult({1: 0.5, 7: 2.0})  # each key its own row of numbers
    opt.set_wd_mult({2: 0.0})
    return opt


def _loop(kv, devices, steps=3):  # (devices: how many)
    """init the keys as one list, then per step a list push of per-device gradients and a
    list pull: every pulled value."""
    keys = list(range(len(SHAPES)))
    rng = np.random.default_rng(7)
    kv.init(keys, [nd.array(rng.normal(size=s).astype(np.float32)) for s in SHAPES])
    got = []
    for _ in range(steps):
        grads = [
            [nd.array(rng.normal(size=s).astype(np.float32), jaxkv.cpu(d)) for d in range(devices)]
            for s in SHAPES
        ]
        kv.push(keys, grads)
        outs = [nd.zeros(s) for s in SHAPES]
        kv.pull(keys, out=outs)
        got.append([o.asnumpy() for o in outs])
    return got


def _batches_taken(monkeypatch):
    """Whether each flat push took the batch (``alike.update`` gave a state), in push order."""
    took = []
    real = alike.update

    def update(*args, **kwargs):
        new = real(*args, **kwargs)
        took.append(new is not None)
        return new

    monkeypatch.setattr(alike, "update", update)
    return took


@pytest.mark.parametrize(
    ("name", "batched"),
    [
        ("sgd", True),
        ("adam", True),
        ("rmsprop", True),
        ("ftrl", True),
        ("nadam", True),
        ("lamb", False),  # a norm per key: a reduction, not batched
    ],
)
def test_keys_alike_updated_as_one_batch_give_the_per_key_bits(devices, monkeypatch, name, batched):
    took = _batches_taken(monkeypatch)
    runs, states = {}, {}
    for layout in ("flat", "keys"):
        kv = jaxkv.KVStore("device", devices[:2], layout=layout)
        kv.set_optimizer(_optimizer(name))
        runs[layout] = _loop(kv, 2)
        states[layout] = kv.state
        if layout == "flat":
            packings = kv._state.packings
    for flat, keys in zip(runs["flat"], runs["keys"]):
        for a, b in zip(flat, keys):
            np.testing.assert_array_equal(a, b)
    # Each key's optimizer state, handed out, is the per-key layout's too: step counts and
    # moments (kept packed in the flat store: one leaf per place of a key's state).
    flat_opt, keys_opt = (dict(states[layout].opt_states) for layout in ("flat", "keys"))
    assert flat_opt.keys() == keys_opt.keys()
    for group in flat_opt:
        leaves = jax.tree_util.tree_leaves(flat_opt[group])
        for a, b in zip(leaves, jax.tree_util.tree_leaves(keys_opt[group]), strict=True):
            np.testing.assert_array_equal(a, b)
    if batched:  # the flat store keeps the group's state in a few leaves, not some per key
        (packing,) = packings
        assert packing is not None and packing.stride
        assert len(packing.slots()) == packing.stride, packing.slots()
    # The flat store's pushes after the first (which makes the optimizer state) went through
    # the batch; the per-key layout never does.
    assert took and all(t is batched for t in took[-2:]), took


def test_no_batch_without_two_keys_alike_end_to_end(devices, monkeypatch):
    """Keys of different shapes: nothing to batch, the per-key push runs as it is."""
    took = _batches_taken(monkeypatch)
    kv = jaxkv.KVStore("device", devices[:1], layout="flat")
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    kv.init([0, 1], [nd.ones((2, 3)), nd.ones((3, 2))])
    for _ in range(2):
        kv.push([0, 1], [nd.ones((2, 3)), nd.ones((3, 2))])
    np.testing.assert_allclose(np.asarray(kv.pull(0)), np.full((2, 3), 0.8), rtol=1e-6)
    assert took and not any(took), took


def test_a_reduction_anywhere_in_the_rule_is_not_elementwise():
    """A sum inside a call (a jit inside the rule) is found; sqrt and products are elementwise."""
    inner = jax.make_jaxpr(lambda x: jax.jit(lambda y: y.sum())(x) + x)(jnp.ones(3))
    assert not alike._elementwise(inner.jaxpr)
    assert alike._elementwise(jax.make_jaxpr(lambda x: jnp.sqrt(x) * 2)(jnp.ones(3)).jaxpr)
    assert not alike._elementwise(jax.make_jaxpr(lambda x: x @ x)(jnp.ones(3)).jaxpr)
