"""Pushes are bit-for-bit reproducible: across runs, across processes, and whatever the order
in which a push lists its keys.

The values are random float32 normals pushed from all 8 devices, so that a change in the order
of the floating-point sums would show in the low bits.
"""

import itertools
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from _devices import cpu_empty, cpu_store

import jaxkv
import jaxkv.mx as mx

NUM_DEVS = 8
SHAPES = {"w": (5, 3), "b": (7,), "t": (2, 3, 4), "s": ()}
STEPS = 6


def _updater(key, input, stored):
    """MXNet style: ``stored += input * 0.1``."""
    stored += input * 0.1


def _pure_updater(key, pushed, stored):
    return stored + pushed * 0.1


def _per_device(rng, shape):
    """One random normal float32 value on each of the 8 devices, as ``NDArray``s."""
    return [
        mx.nd.array(rng.standard_normal(shape).astype(np.float32), ctx=mx.cpu(d))
        for d in range(NUM_DEVS)
    ]


def run_program(seed: int = 1234) -> dict:
    """A fixed random sequence of inits and pushes; returns each key's stored bytes."""
    rng = np.random.default_rng(seed)
    kv = cpu_store("device")
    names = sorted(SHAPES)
    kv.init(names, [mx.nd.array(rng.standard_normal(SHAPES[k])) for k in names])
    kv._set_updater(_updater)
    for step in range(STEPS):
        # Alternate single-key pushes, key-list pushes and a push naming one key twice.
        if step % 3 == 0:
            key = names[int(rng.integers(len(names)))]
            kv.push(key, _per_device(rng, SHAPES[key]))
        elif step % 3 == 1:
            keys = [names[i] for i in rng.permutation(len(names))]
            kv.push(keys, [_per_device(rng, SHAPES[k]) for k in keys])
        else:
            keys = ["w", "t", "w"]
            kv.push(keys, [_per_device(rng, SHAPES[k]) for k in keys])
    return {k: np.asarray(v).tobytes() for k, v in zip(names, kv.pull(names))}


def test_same_program_twice_gives_identical_bits():
    first, second = run_program(), run_program()
    assert first.keys() == second.keys() == set(SHAPES)
    for key in first:
        assert first[key] == second[key], key
    # The program really did something: the values are not the initial ones.
    assert run_program(seed=99)["w"] != first["w"]


def test_same_program_in_another_process_gives_identical_bits(tmp_path):
    out = tmp_path / "bits.npz"
    here = Path(__file__).resolve().parent
    code = textwrap.dedent(
        f"""
        import jax
        jax.config.update("jax_num_cpu_devices", {NUM_DEVS})
        import sys
        import numpy as np
        sys.path.insert(0, {str(here)!r})
        import test_determinism as t
        bits = t.run_program()
        np.savez({str(out)!r}, **{{k: np.frombuffer(v, np.uint8) for k, v in bits.items()}})
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    here_bits = run_program()
    with np.load(out) as there:
        assert set(there.files) == set(here_bits)
        for key, value in here_bits.items():
            assert there[key].tobytes() == value, key


def _permutations(n: int, count: int, seed: int):
    """``count`` distinct orders of ``range(n)``, the identity first."""
    rng = np.random.default_rng(seed)
    every = list(itertools.permutations(range(n)))
    picked = [every[0]] + [every[i] for i in rng.choice(range(1, len(every)), count - 1, False)]
    return [list(p) for p in picked]


def test_multi_key_push_bits_do_not_depend_on_key_order():
    rng = np.random.default_rng(7)
    names = sorted(SHAPES)
    initial = {k: rng.standard_normal(SHAPES[k]).astype(np.float32) for k in names}
    pushes = [{k: _per_device(rng, SHAPES[k]) for k in names} for _ in range(3)]

    results = []
    for order in _permutations(len(names), 6, seed=3):
        kv = cpu_store("device")
        kv.init(names, [mx.nd.array(initial[k]) for k in names])
        kv._set_updater(_updater)
        for values in pushes:
            keys = [names[i] for i in order]
            kv.push(keys, [values[k] for k in keys])
        outs = [mx.nd.zeros(SHAPES[k]) for k in names]
        kv.pull(names, out=outs)
        results.append({k: o.asnumpy().tobytes() for k, o in zip(names, outs)})
    for result in results[1:]:
        assert result == results[0]


def _jax_per_device(rng, shape):
    devices = jax.devices("cpu")[:NUM_DEVS]
    return [jax.device_put(rng.standard_normal(shape).astype(np.float32), d) for d in devices]


@pytest.mark.parametrize("updater", [None, _pure_updater], ids=["assign", "stored+0.1*input"])
def test_functional_push_bits_do_not_depend_on_key_order(updater):
    rng = np.random.default_rng(11)
    names = sorted(SHAPES)
    state = jaxkv.init(
        cpu_empty(), {k: rng.standard_normal(SHAPES[k]).astype(np.float32) for k in names}
    )
    values = {k: _jax_per_device(rng, SHAPES[k]) for k in names}

    reference = None
    for order in _permutations(len(names), 8, seed=5):
        keys = [names[i] for i in order]
        vals = [values[k] for k in keys]

        pushed = jaxkv.push(state, keys, vals, updater=updater)
        bits = {k: np.asarray(jaxkv.pull(pushed, k)).tobytes() for k in names}
        if reference is None:
            reference = bits
        assert bits == reference, keys

        # pushpull: the new state and the pulled values (listed in the call's key order).
        new, pulled = jaxkv.pushpull(state, keys, vals, updater=updater)
        assert [np.asarray(p).tobytes() for p in pulled] == [reference[k] for k in keys]
        assert {k: np.asarray(jaxkv.pull(new, k)).tobytes() for k in names} == reference

    # The state pushed into was never changed, and the sums were not trivially exact.
    assert np.asarray(jaxkv.pull(state, "w")).tobytes() != reference["w"]
