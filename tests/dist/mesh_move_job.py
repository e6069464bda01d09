"""Run by tests/test_user_mesh.py under ``python -m jaxkv.launch -n 2 --devices-per-process 4``:
a tree of 48 leaves placed on the user's 2 x 4 mesh ("data", "model"; some split along "model",
the rest whole), given to ``jaxkv.init`` on a store over the same devices on one axis that
splits every leaf of 1024 elements or more (the README's sharded step beside a GSPMD model).
Each leaf is moved by a reshard with collectives across the processes; issued together, they hung
in XLA:CPU's collective-permute. Each process prints ``rank R ok 48 keys``; a value that differs
from the tree's raises, naming the key."""

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv

SHAPES = [(64, 64), (256,), (32, 96), (1024,), (16, 256), (8,)]
SPECS = [P(None, "model"), P("model"), P(None, "model"), P("model"), P("model", None), P()]


def main():
    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(0)
    tree, whole = {}, {}
    for i in range(48):
        shape, spec = SHAPES[i % len(SHAPES)], SPECS[i % len(SPECS)]
        host = rng.normal(size=shape).astype(np.float32)
        whole[f"layer{i}/w"] = host
        sharding = NamedSharding(mesh, spec)
        tree.setdefault(f"layer{i}", {})["w"] = jax.make_array_from_callback(
            shape, sharding, host.__getitem__
        )
    state = jaxkv.init(jaxkv.empty(devices, bigarray_bound=1024), tree)
    for key, host in whole.items():
        got = np.asarray(multihost_utils.process_allgather(state[key], tiled=True))
        if not np.array_equal(got, host):
            raise AssertionError(f"key {key!r}: differs from the tree's value")
    print(f"rank {jax.process_index()} ok {len(whole)} keys", flush=True)


if __name__ == "__main__":
    main()
