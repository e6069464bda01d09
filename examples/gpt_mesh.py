"""A small flax GPT trained on a 2 x 4 mesh ("data", "model") with jaxkv's plain-``jit`` recipe,
beside the same model under XLA's own sharding (GSPMD) with optax.

The recipe a JAX engineer writes, with nothing changed in the model:

- the parameters are made on the mesh with tensor-parallel shardings (attention heads and MLP
  columns split along "model", Megatron-style: ``P(None, "model")`` in, ``P("model", None)``
  out), and given to ``jaxkv.init`` on ``jaxkv.empty(mesh=mesh, axis_name="data",
  bigarray_bound=1024)``, which keeps them and splits along "data" as well, with their
  optimizer state (ZeRO), those whose piece on one device has 1024 elements or more;
- the step is one ``jax.jit``: the gradient of the loss with respect to ``state.tree()`` (the
  flax tree) over 4 micro-batches accumulated in a ``lax.scan``, in bfloat16 compute over the
  float32 master weights, then ``jaxkv.push`` of the gradients with the optax chain: clipping
  by the global norm, AdamW on a warmup-cosine schedule, no weight decay on biases, LayerNorm
  scales and the position embedding (a mask by path: optax is handed the flax tree);
- XLA partitions the model (GSPMD): no local shapes, no ``psum`` by hand.

``train_gspmd`` is the rival: the same model, data and optimizer as a plain ``jax.jit`` with
NamedShardings (``fsdp=True``: every big leaf also split along "data", ZeRO's placement), and
optax's state placed as the parameters it follows, the step keeping both where they are.

Run it:

    .venv/bin/python examples/gpt_mesh.py                 # one process, 8 simulated CPU devices
    python -m jaxkv.launch -n 2 --devices-per-process 4 examples/gpt_mesh.py --ckpt DIR --steps 4
    python -m jaxkv.launch -n 4 --devices-per-process 2 examples/gpt_mesh.py --ckpt DIR --steps 6

With ``--ckpt`` each process writes its shards through ``jaxkv.CheckpointManager`` every
``--every`` steps, and a later run (on any number of processes of a 2 x 4 mesh) resumes from the
latest step. At the end, process 0 prints the largest difference of the parameters from the
GSPMD run of the same steps (``--no-compare`` skips it).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv

MESH_SHAPE = (2, 4)  # ("data", "model")


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 512
    block: int = 64  # tokens per sequence
    d_model: int = 256
    n_layer: int = 4
    n_head: int = 4
    batch: int = 32  # sequences per step, split along "data"
    micro: int = 4  # micro-batches accumulated per step
    lr: float = 3e-3
    warmup: int = 4
    total: int = 100  # steps of the cosine decay
    weight_decay: float = 0.1
    compute: str = "bfloat16"  # the dtype of the activations; the parameters are float32


SMALL = Config(vocab=128, block=16, d_model=64, n_layer=2, n_head=4, batch=16, micro=4)


# -- the model: a GPT in flax, bfloat16 compute over float32 parameters --------------------------
class Block(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        dt = jnp.dtype(c.compute)
        b, t, d = x.shape
        heads, width = c.n_head, d // c.n_head
        h = nn.LayerNorm(dtype=dt, name="ln_1")(x)
        # No key bias: it adds the same to every score of a row, which the softmax cancels, so
        # its gradient is rounding noise (that Adam would scale up to whole steps).
        q, k, v = (
            nn.Dense(d, dtype=dt, use_bias=n != "key", name=n)(h).reshape(b, t, heads, width)
            for n in ("query", "key", "value")
        )
        att = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / math.sqrt(width)
        causal = jnp.tril(jnp.ones((t, t), bool))
        att = jax.nn.softmax(jnp.where(causal, att, -1e9), axis=-1).astype(dt)
        y = jnp.einsum("bhts,bshd->bthd", att, v).reshape(b, t, d)
        x = x + nn.Dense(d, dtype=dt, name="attn_out")(y)
        h = nn.LayerNorm(dtype=dt, name="ln_2")(x)
        h = jax.nn.gelu(nn.Dense(4 * d, dtype=dt, name="mlp_in")(h))
        return x + nn.Dense(d, dtype=dt, name="mlp_out")(h)


class GPT(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.cfg
        dt = jnp.dtype(c.compute)
        wte = nn.Embed(c.vocab, c.d_model, dtype=dt, name="wte")
        wpe = self.param("wpe", nn.initializers.normal(0.02), (c.block, c.d_model))
        x = wte(tokens) + wpe[: tokens.shape[1]].astype(dt)
        for i in range(c.n_layer):
            x = Block(c, name=f"h_{i}")(x)
        x = nn.LayerNorm(dtype=dt, name="ln_f")(x)
        return wte.attend(x).astype(jnp.float32)  # tied input and output embeddings


def tensor_parallel_spec(path: tuple, leaf: Any) -> P:
    """Megatron's layout by path: the query, key, value and first MLP kernels (and biases)
    split by columns along "model", the attention output and second MLP kernels by rows, the
    token embedding by vocabulary rows and the position embedding by columns; LayerNorms and
    the other biases replicated."""
    names = [str(getattr(e, "key", e)) for e in path]
    layer, name = names[-2], names[-1]
    if layer in ("query", "key", "value", "mlp_in"):
        return P(None, "model") if name == "kernel" else P("model")
    if layer in ("attn_out", "mlp_out") and name == "kernel":
        return P("model", None)
    if name == "embedding":
        return P("model", None)
    if name == "wpe":
        return P(None, "model")
    return P()


# Leaves whose piece on one device of "model" has at least this many elements are split along
# "data" too, with their optimizer state, by both sides alike: GSPMD's FSDP placement and the
# store (its ``bigarray_bound``, whose rule this is; the store's default, 16384, would keep this
# small model's biases whole on each device).
BOUND = 1024


def fsdp_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """``spec`` with "data" added on dimension 0 where the leaf's piece on one device of
    "model" has at least ``BOUND`` elements and rows that "data" divides (ZeRO / FSDP's
    placement; the store's rule for a value of its own sharding)."""
    local = [n // (mesh.shape["model"] if "model" in str(e) else 1) for n, e in zip(shape, spec)]
    local += shape[len(local) :]
    if not shape or local[0] % mesh.shape["data"] or math.prod(local) < BOUND:
        return spec
    first = spec[0] if len(spec) else None
    if first is None:
        return P("data", *spec[1:])
    return P((first, "data") if isinstance(first, str) else (*first, "data"), *spec[1:])


def no_decay(params: Any) -> Any:
    """The weight-decay mask by path: no decay on biases, LayerNorm scales, the positions."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: str(getattr(path[-1], "key", "")) not in ("bias", "scale", "wpe"), params
    )


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.total)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=no_decay),
    )


def make_mesh(devices: list | None = None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    n = MESH_SHAPE[0] * MESH_SHAPE[1]
    if len(devices) != n:
        raise RuntimeError(f"expected {n} devices for a 2 x 4 mesh, found {len(devices)}")
    return Mesh(np.array(devices).reshape(MESH_SHAPE), ("data", "model"))


def init_params(mesh: Mesh, cfg: Config, fsdp: bool = False, seed: int = 0) -> Any:
    """The flax parameters, made where they live: each leaf's tensor-parallel sharding (with
    "data" added on dimension 0 for ``fsdp``), so no device holds a whole split leaf."""
    model = GPT(cfg)
    args = (jax.random.key(seed), jnp.zeros((1, cfg.block), jnp.int32))
    shapes = jax.eval_shape(model.init, *args)

    def where(path: tuple, leaf: Any) -> NamedSharding:
        spec = tensor_parallel_spec(path, leaf)
        if fsdp:
            spec = fsdp_spec(spec, leaf.shape, mesh)
        return NamedSharding(mesh, spec)

    return jax.jit(model.init, out_shardings=jax.tree_util.tree_map_with_path(where, shapes))(*args)


def tokens(cfg: Config, step: int, mesh: Mesh) -> jax.Array:
    """Step ``step``'s batch of ``cfg.block + 1`` tokens per sequence (a synthetic, learnable
    sequence: each token the previous plus a per-sequence stride), rows split along "data"."""
    rng = np.random.default_rng([7, step])
    start = rng.integers(0, cfg.vocab, (cfg.batch, 1))
    stride = rng.integers(1, 4, (cfg.batch, 1))
    seq = (start + stride * np.arange(cfg.block + 1)) % cfg.vocab
    seq = seq.astype(np.int32)
    return jax.make_array_from_callback(seq.shape, NamedSharding(mesh, P("data")), lambda i: seq[i])


def loss_and_grads(cfg: Config, params: Any, batch: jax.Array) -> tuple[jax.Array, Any]:
    """The mean next-token loss of ``batch`` and its gradient with respect to ``params``, over
    ``cfg.micro`` micro-batches accumulated in a ``lax.scan`` (float32 gradients)."""
    model = GPT(cfg)

    def loss(p: Any, seq: jax.Array) -> jax.Array:
        logits = model.apply(p, seq[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, seq[:, 1:]).mean()

    micro = batch.reshape(cfg.micro, cfg.batch // cfg.micro, cfg.block + 1)

    def one(carry: Any, seq: jax.Array) -> tuple[Any, None]:
        total, grads = carry
        value, g = jax.value_and_grad(loss)(params, seq)
        return (total + value, jax.tree.map(jnp.add, grads, g)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (total, grads), _ = jax.lax.scan(one, (jnp.zeros((), jnp.float32), zeros), micro)
    return total / cfg.micro, jax.tree.map(lambda g: g / cfg.micro, grads)


# -- jaxkv: the plain-jit recipe ---------------------------------------------------------------
def make_store(mesh: Mesh, cfg: Config, tx: optax.GradientTransformation) -> jaxkv.KVState:
    store = jaxkv.empty(mesh=mesh, axis_name="data", bigarray_bound=BOUND)
    return jaxkv.init_optimizer(jaxkv.init(store, init_params(mesh, cfg)), tx)


def jaxkv_step(cfg: Config, tx: optax.GradientTransformation) -> Callable:
    """``step(state, batch) -> (state, loss)``: one ``jax.jit``, the state donated."""

    def step(state: jaxkv.KVState, batch: jax.Array) -> tuple[jaxkv.KVState, jax.Array]:
        loss, grads = loss_and_grads(cfg, state.tree(), batch)
        return jaxkv.push(state, grads, updater=tx), loss

    return jax.jit(step, donate_argnums=0)


# -- the rival: GSPMD and optax ---------------------------------------------------------------
def gspmd_state(params: Any, tx: optax.GradientTransformation) -> tuple[Any, Any]:
    """optax's state for ``params``, each leaf that follows a parameter placed as that parameter
    (the rest replicated), and the shardings of ``(params, state)``: where the step keeps
    them, so the state stays in FSDP's placement (left to XLA, a step's outputs are placed as
    its propagation chooses, which differs from the inputs' placement and from step to step)."""
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    where = jax.tree.map(lambda x: x.sharding, params)
    shapes = jax.eval_shape(tx.init, params)
    whole = NamedSharding(mesh, P())
    opt_where = optax.tree_utils.tree_map_params(
        tx, lambda _, w: w, shapes, where, transform_non_params=lambda _: whole
    )
    return jax.jit(tx.init, out_shardings=opt_where)(params), (where, opt_where)


def gspmd_step(cfg: Config, tx: optax.GradientTransformation, shardings: Any = None) -> Callable:
    """``step(params, opt, batch) -> (params, opt, loss)``: one ``jax.jit``, the state donated
    and kept where ``shardings`` (from :func:`gspmd_state`) says."""

    def step(params: Any, opt: Any, batch: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = loss_and_grads(cfg, params, batch)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    out = None if shardings is None else (*shardings, None)
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=out)


def train_gspmd(
    steps: int, cfg: Config = SMALL, mesh: Mesh | None = None, fsdp: bool = True
) -> tuple[Any, list[float]]:
    """The same training under GSPMD with optax: the parameters and each step's loss."""
    mesh = make_mesh() if mesh is None else mesh
    tx = make_optimizer(cfg)
    params = init_params(mesh, cfg, fsdp=fsdp)
    opt, shardings = gspmd_state(params, tx)
    step, losses = gspmd_step(cfg, tx, shardings), []
    for t in range(steps):
        params, opt, loss = step(params, opt, tokens(cfg, t, mesh))
        losses.append(float(loss))
    return params, losses


# -- counting compilations ------------------------------------------------------------------------
class _Compiles(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "Compiling" in record.getMessage()


def train_jaxkv(
    steps: int,
    cfg: Config = SMALL,
    mesh: Mesh | None = None,
    ckpt: str | None = None,
    every: int = 2,
) -> tuple[Any, list[float], list[int]]:
    """Train with jaxkv (resuming from ``ckpt``'s latest step where there is one): the
    parameters, each step's loss and the compilations during each step."""
    mesh = make_mesh() if mesh is None else mesh
    tx = make_optimizer(cfg)
    manager = jaxkv.CheckpointManager(ckpt, max_to_keep=2) if ckpt else None
    start = (manager.latest_step() or 0) if manager else 0
    if start:
        assert manager is not None
        state = manager.restore(
            into=jaxkv.empty(mesh=mesh, axis_name="data", bigarray_bound=BOUND), optimizer=tx
        )
    else:
        state = make_store(mesh, cfg, tx)
    step, losses, compiles = jaxkv_step(cfg, tx), [], []
    logger = logging.getLogger("jax")
    counter = _Compiles()
    logger.addHandler(counter)
    propagate, logger.propagate = logger.propagate, False
    try:
        for t in range(start, steps):
            before = counter.count
            with jax.log_compiles(True):
                state, loss = step(state, tokens(cfg, t, mesh))
                losses.append(float(loss))
            compiles.append(counter.count - before)
            if manager and (t + 1) % every == 0:
                manager.save(t + 1, state)
    finally:
        logger.removeHandler(counter)
        logger.propagate = propagate
        if manager:
            manager.wait_until_finished()
            manager.close()
    return state.tree(), losses, compiles


def on_host(x: jax.Array) -> np.ndarray:
    """The whole of ``x`` on this process's host (gathered from every process's shards)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def max_difference(a: Any, b: Any) -> float:
    """The largest ``|a - b|`` over two trees of the same structure."""
    return max(
        float(np.max(np.abs(on_host(x) - on_host(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ckpt", help="a checkpoint directory: save to it, resume from it")
    parser.add_argument("--every", type=int, default=2, help="steps between checkpoints")
    parser.add_argument("--small", action="store_true", help="a smaller GPT (the tests')")
    parser.add_argument("--f32", action="store_true", help="float32 compute (no bfloat16)")
    parser.add_argument("--no-compare", action="store_true", help="skip the GSPMD run")
    args = parser.parse_args()
    cfg = SMALL if args.small else Config()
    if args.f32:
        cfg = dataclasses.replace(cfg, compute="float32")
    mesh = make_mesh()
    rank = jax.process_index()
    params, losses, compiles = train_jaxkv(args.steps, cfg, mesh, args.ckpt, args.every)
    n = sum(x.size for x in jax.tree.leaves(params))
    if rank == 0:
        print(f"GPT of {n} parameters on a 2 x 4 mesh, {jax.process_count()} process(es)")
        first = args.steps - len(losses)
        for t, (loss, c) in enumerate(zip(losses, compiles), start=first):
            print(f"step {t + 1} loss {loss:.5f} compiles {c}", flush=True)
    if not args.no_compare:
        ref, _ = train_gspmd(args.steps, cfg, mesh)
        diff = max_difference(params, ref)
        if rank == 0:
            print(f"max |jaxkv - GSPMD| = {diff:.3g}", flush=True)


if __name__ == "__main__":
    if "JAXKV_PROCESS_ID" not in os.environ:  # run alone: 8 simulated CPU devices
        jax.config.update("jax_num_cpu_devices", 8)
    main()
