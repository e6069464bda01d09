"""A flax MLP trained data-parallel by several processes through jaxkv, with checkpoints that
outlive a killed process.

    python -m jaxkv.launch -n 2 --max-restarts 1 examples/flax_processes.py CKPT_DIR

Every process runs this script; importing jaxkv joins the launcher's job, so ``jax.devices()``
is every process's devices. What it shows:

- **Sharded init.** The parameters are made by ``jax.jit(model.init, out_shardings=...)``
  directly in the layout the store keeps them in (big kernels split by rows over every device
  of every process, the rest replicated), and ``jaxkv.init`` on ``jaxkv.empty(mesh=mesh)``
  keeps them there: no process ever holds a whole split kernel.
- **Each process feeds its own data**: its rows of each step's batch
  (``jax.make_array_from_process_local_data``).
- **The step** is the README's: ``jaxkv.gather`` and ``jaxkv.push`` inside ``jax.shard_map``
  over the global mesh, the gradients averaged (``reduce="mean"``), AdamW on each device's rows.
- **Checkpoints** through ``jaxkv.CheckpointManager`` every ``--every`` steps (each process
  writes its own shards); a restarted job resumes from the latest complete step. ``--kill-at S``
  makes rank 1 of the first attempt kill itself (SIGKILL) at step S, once the checkpoint before
  it is complete; the launcher (``--max-restarts 1``) restarts the job, which resumes.

At the end, process 0 trains the same model on one device with plain optax (the whole batch,
the same initial parameters and steps) and prints ``max |jaxkv - optax| = D``: float rounding
only. Run it (it needs the ``examples`` extra, flax) with the command above.
"""

from __future__ import annotations

import argparse
import os
import signal
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv

FEATURES, HIDDEN, OUTPUTS = 16, 256, 1
BATCH = 96  # the whole batch of a step, split over every device of every process
BOUND = 1 << 14  # values of at least this many elements are split across the devices


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(HIDDEN, name="hidden_0")(x))
        x = jnp.tanh(nn.Dense(HIDDEN, name="hidden_1")(x))
        return nn.Dense(OUTPUTS, name="head")(x)


def loss_fn(params, x, y):
    return jnp.mean((MLP().apply(params, x) - y) ** 2)


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole batch of ``step`` (a function of the step only, so a resumed job sees the data
    an uninterrupted one would)."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
    return x, y


def make_optimizer() -> optax.GradientTransformation:
    return optax.adamw(3e-3, eps=1e-4, weight_decay=1e-4)


def init_inputs():
    return jax.random.key(0), jnp.zeros((1, FEATURES), jnp.float32)


def sharded_init(mesh: Mesh):
    """The parameters, made where the store keeps them: each leaf of at least ``BOUND``
    elements whose rows divide by the devices split by rows (``P("kv")``), the rest
    replicated; the store's own rule, so ``jaxkv.init`` moves nothing."""
    n = mesh.devices.size
    shapes = jax.eval_shape(MLP().init, *init_inputs())

    def where(leaf):
        split = leaf.size >= BOUND and leaf.shape[0] % n == 0
        return NamedSharding(mesh, P("kv") if split else P())

    return jax.jit(MLP().init, out_shardings=jax.tree.map(where, shapes))(*init_inputs())


def make_step(state: jaxkv.KVState, tx: optax.GradientTransformation):
    """``step(state, x, y) -> (state, loss)`` over every device of every process."""
    specs = jaxkv.specs(state, "kv")
    n = state.mesh.devices.size

    @jax.jit
    @partial(
        jax.shard_map, mesh=state.mesh, in_specs=(specs, P("kv"), P("kv")), out_specs=(specs, P())
    )
    def step(state, x, y):
        def loss(local):
            whole = jaxkv.gather(state, local, "kv")  # the flax tree, whole values: all-gathers
            return loss_fn(whole, x, y)  # on this device's rows of the batch

        # The flax tree of the store's leaves: the split kernels this device's rows.
        value, grads = jax.value_and_grad(loss)(state.tree())
        # The gradients of the split kernels come back already summed over the devices (AD's
        # sum through the gather), this device's rows; push sums the others and, with
        # reduce="mean", divides every sum by the n devices: the whole batch's mean gradient.
        state = jaxkv.push(state, grads, updater=tx, axis_name="kv")
        return state, jax.lax.psum(value, "kv") / n

    return step


def this_process_rows(mesh: Mesh, step: int) -> tuple[jax.Array, jax.Array]:
    """This process's rows of ``step``'s batch, as global arrays split over every device."""
    rows = NamedSharding(mesh, P("kv"))
    per = BATCH // jax.process_count()
    me = jax.process_index()
    return tuple(
        jax.make_array_from_process_local_data(rows, a[me * per : (me + 1) * per], a.shape)
        for a in batch(step)
    )


def train(directory: str, steps: int, every: int, kill_at: int | None) -> dict:
    mesh = Mesh(np.array(jax.devices()), ("kv",))
    tx = make_optimizer()
    store = jaxkv.empty(mesh=mesh, bigarray_bound=BOUND, reduce="mean")
    with jaxkv.CheckpointManager(directory, max_to_keep=2) as ckpt:
        start = ckpt.latest_step() or 0
        if start:
            state = ckpt.restore(into=store, optimizer=tx)
        else:
            state = jaxkv.init_optimizer(jaxkv.init(store, sharded_init(mesh)), tx)
        rank = jax.process_index()
        print(f"rank {rank} starts at step {start} of {steps}", flush=True)
        step = make_step(state, tx)
        for t in range(start, steps):
            state, loss = step(state, *this_process_rows(mesh, t))
            if (t + 1) % every == 0:
                ckpt.save(t + 1, state)
            if rank == 0:
                print(f"step {t + 1} loss {float(loss):.6f}", flush=True)
            first_attempt = os.environ.get("JAXKV_RESTART_COUNT", "0") == "0"
            if kill_at == t + 1 and rank == 1 and first_attempt:
                ckpt.wait_until_finished()
                print(f"rank {rank} kills itself at step {t + 1}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        ckpt.wait_until_finished()
    return jaxkv.pull(state, jax.eval_shape(MLP().init, *init_inputs()), devices=jax.devices())


def train_optax(steps: int) -> dict:
    """The same model, data and steps on one device with plain optax."""
    device = jax.local_devices()[0]
    tx = make_optimizer()
    params = jax.device_put(MLP().init(*init_inputs()), device)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for t in range(steps):
        x, y = (jax.device_put(a, device) for a in batch(t))
        params, opt_state = step(params, opt_state, x, y)
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="where the checkpoints go")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--kill-at", type=int, help="rank 1 of the first attempt dies here")
    args = parser.parse_args()
    params = train(args.directory, args.steps, args.every, args.kill_at)
    if jax.process_index() == 0:
        # Every process holds the whole pulled values; process 0 compares them.
        got = jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), params)
        want = jax.tree.map(np.asarray, train_optax(args.steps))
        diff = max(
            float(np.max(np.abs(g - w)))
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))
        )
        print(f"max |jaxkv - optax| = {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
