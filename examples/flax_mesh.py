"""A flax MLP trained on a 2 x 4 mesh: data parallel along "data" through jaxkv, tensor parallel
along "model" inside the step, in one jitted ``jax.shard_map`` step that compiles once.

The mesh is 8 devices as 2 x 4, ``("data", "model")``. Along ``"data"`` the batch is split in
two halves and jaxkv averages the gradients (``reduce="mean"``); along ``"model"`` the 4 devices
of a row share one half of the batch and split the hidden units of the MLP between them,
Megatron-style: the first hidden layer by columns, the second by rows, the partial outputs
summed with ``jax.lax.psum``. The store keeps every parameter replicated along ``"model"`` (and
its big ones split along ``"data"``); each model device takes its slice of the pulled values
with ``jax.lax.axis_index("model")`` and ``dynamic_slice``.

After the last step the parameters are compared with the same model trained by plain optax on
one device (the full batch, the same initial parameters, the same steps): they agree to float
rounding.

Run it with ``.venv/bin/python examples/flax_mesh.py`` (it needs the ``examples`` extra: flax).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv

FEATURES, HIDDEN, OUTPUTS = 16, 128, 1
BATCH = 1024
STEPS = 200
LEARNING_RATE = 1e-3
MESH_SHAPE = (2, 4)  # ("data", "model")


# -- the model: one flax module, tensor parallel when given a mesh axis -------------------------
def _block(x: jax.Array, axis: str, dim: int) -> jax.Array:
    """This device's block of ``x`` along dimension ``dim``: the ``i``-th of ``n`` equal blocks,
    ``i`` its index along the mesh axis ``axis`` and ``n`` the axis' size."""
    n = jax.lax.axis_size(axis)
    size = x.shape[dim] // n
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * size, size, axis=dim)


class ColumnParallelDense(nn.Module):
    """``nn.Dense`` whose output units are split along ``model_axis``: each device computes its
    ``features / n`` columns of the output. Without ``model_axis`` it is a plain ``nn.Dense``.
    Its parameters are always whole (``kernel`` of shape ``(inputs, features)``): the slicing
    happens on the values given to ``apply``."""

    features: int
    model_axis: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        if self.model_axis is not None:  # this device's columns, and their biases
            kernel, bias = _block(kernel, self.model_axis, 1), _block(bias, self.model_axis, 0)
        return x @ kernel + bias


class RowParallelDense(nn.Module):
    """``nn.Dense`` whose input units are split along ``model_axis``: each device multiplies its
    block of the input (the output of a :class:`ColumnParallelDense`) by its rows of the
    kernel, and ``psum`` adds the partial outputs; the bias is added once, after the sum."""

    features: int
    inputs: int  # the whole input width (each device sees inputs / n of it)
    model_axis: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (self.inputs, self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        if self.model_axis is None:
            return x @ kernel + bias
        partial = x @ _block(kernel, self.model_axis, 0)
        return jax.lax.psum(partial, self.model_axis) + bias


class MLP(nn.Module):
    """Two hidden layers of ``hidden`` units and a linear head. With ``model_axis`` the hidden
    layers run tensor parallel over that mesh axis (inside ``shard_map``); without it, on one
    device. The parameter tree is the same either way:
    ``{"params": {"hidden_0": {"kernel", "bias"}, "hidden_1": {...}, "head": {...}}}``."""

    hidden: int = HIDDEN
    outputs: int = OUTPUTS
    model_axis: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = jnp.tanh(ColumnParallelDense(self.hidden, self.model_axis, name="hidden_0")(x))
        h = RowParallelDense(self.hidden, self.hidden, self.model_axis, name="hidden_1")(h)
        h = jnp.tanh(h)
        return nn.Dense(self.outputs, name="head")(h)  # replicated: h is whole on every device


def loss_fn(model: MLP, params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean squared error over the rows of ``x`` (this device's rows inside the step)."""
    return jnp.mean((model.apply(params, x) - y) ** 2)


# -- data, parameters, mesh ---------------------------------------------------------------------
def make_data(seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """A synthetic regression: ``BATCH`` rows of ``FEATURES`` normal inputs, a smooth target
    plus noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    w = rng.normal(size=(FEATURES, OUTPUTS)).astype(np.float32) / np.sqrt(FEATURES)
    noise = rng.normal(scale=0.1, size=(BATCH, OUTPUTS))
    y = np.sin(2 * x @ w) + 0.5 * np.cos(x[:, :OUTPUTS]) + noise
    return jnp.asarray(x), jnp.asarray(y.astype(np.float32))


def init_params(seed: int = 0, hidden: int = HIDDEN):
    """The flax parameter tree of :class:`MLP` (the same for the mesh and the one device)."""
    return MLP(hidden).init(jax.random.key(seed), jnp.zeros((1, FEATURES), jnp.float32))


def hidden_of(params) -> int:
    """The hidden width of :class:`MLP`'s parameter tree."""
    return params["params"]["hidden_0"]["kernel"].shape[1]


def make_mesh(devices=None) -> Mesh:
    """The 2 x 4 mesh ``("data", "model")`` over 8 CPU devices."""
    devices = jax.devices("cpu") if devices is None else devices
    n = MESH_SHAPE[0] * MESH_SHAPE[1]
    if len(devices) < n:
        raise RuntimeError(
            f"expected {n} devices, found {len(devices)}: call "
            f'jax.config.update("jax_num_cpu_devices", {n}) before any JAX computation'
        )
    return Mesh(np.array(devices[:n]).reshape(MESH_SHAPE), ("data", "model"))


def make_optimizer() -> optax.GradientTransformation:
    return optax.adam(LEARNING_RATE)


# -- the jaxkv step ------------------------------------------------------------------------------
def make_store(mesh: Mesh, params, tx: optax.GradientTransformation) -> jaxkv.KVState:
    """A store on the mesh that averages along ``"data"``, holding ``params`` and ``tx``'s state.

    Values of at least ``bigarray_bound`` elements (16K by default: ``hidden_1``'s 128 x 128
    kernel) are split in two along ``"data"`` (each row of the mesh holds half of them, and half
    of their Adam moments); the rest are replicated. Along ``"model"`` everything is
    replicated. ``init_optimizer`` makes Adam's state now, so that the first step already has
    the state's final structure and the step compiles once.
    """
    state = jaxkv.init(jaxkv.empty(mesh=mesh, axis_name="data", reduce="mean"), params)
    return jaxkv.init_optimizer(state, tx)


def make_step(
    state: jaxkv.KVState, params, tx: optax.GradientTransformation
) -> Callable[[jaxkv.KVState, jax.Array, jax.Array], tuple[jaxkv.KVState, jax.Array]]:
    """One training step over the whole mesh: ``step(state, x, y) -> (state, loss)``.

    ``x`` and ``y`` are the whole batch, split along ``"data"`` (``P("data")``): each row of
    the mesh gets half of it, the same half on its 4 ``"model"`` devices. ``loss`` is the
    full batch's loss before the update. The state is donated. The hidden width is that of
    ``params``.
    """
    model = MLP(hidden_of(params), model_axis="model")
    like = jax.eval_shape(lambda: params)  # pull reads only the tree's structure
    specs = jaxkv.specs(state, "data")  # where the store keeps each of its arrays

    def step(state, x, y):
        # The whole parameter tree on every device (big values all-gathered along "data"),
        # the same flax tree that init_params made.
        params = jaxkv.pull(state, like, axis_name="data")
        # The gradients. Each "model" device slices its block of the hidden units out of the
        # whole parameters, so its own contribution to a hidden layer's gradient is partial:
        # nonzero only on its block. JAX's AD adds the contributions up itself. Under
        # shard_map's checks of varying axes (check_vma, the default) a value that is the same
        # on every device of an axis and meets one that differs along it (the slice taken at
        # this device's index along "model"; this row's half of the batch along "data") is
        # first marked as varying (an implicit jax.lax.pvary), and AD transposes pvary into a
        # psum. So for a parameter the store keeps replicated, jax.grad returns the gradient
        # summed over the whole mesh: over "model" the blocks, over "data" the two halves of
        # the batch, the same on every device. hidden_1's kernel, which the store splits along
        # "data", was all-gathered along "data" by the pull: its gradient is this row's half
        # of the batch only (summed over "model" by AD as above), and the push reduce-scatters
        # it along "data". The head reads h after the psum, whole on every "model" device: its
        # gradient needs no sum over "model" at all. Nothing is summed by hand here.
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, x, y))(params)
        # The tree of gradients, summed along "data" exactly once (push knows which leaves AD
        # has summed already), then divided by the 2 devices along "data" (reduce="mean", as
        # jax.lax.pmean counts): the mean of the two halves' mean losses is the full batch's
        # mean loss, so this is exactly the full-batch gradient. Then Adam, on each device's
        # part of the state.
        state = jaxkv.push(state, grads, updater=tx, axis_name="data")
        return state, jax.lax.pmean(loss, "data")

    batch = P("data")
    sharded = jax.shard_map(
        step, mesh=state.mesh, in_specs=(specs, batch, batch), out_specs=(specs, P())
    )
    return jax.jit(sharded, donate_argnums=0)


def put_batch(mesh: Mesh, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The batch placed as the step takes it: rows split along ``"data"``."""
    rows = NamedSharding(mesh, P("data"))
    return jax.device_put(x, rows), jax.device_put(y, rows)


# -- counting compilations -----------------------------------------------------------------------
class CompileCounter(logging.Handler):
    """Counts the compilations that ``jax.log_compiles`` reports (its "Compiling ..." record)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "Compiling" in record.getMessage():
            self.count += 1


@contextlib.contextmanager
def counting_compiles() -> Iterator[CompileCounter]:
    """``with counting_compiles() as c: ...``: ``c.count`` compilations happened inside."""
    counter = CompileCounter()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    propagate, logger.propagate = logger.propagate, False  # count them, print nothing
    try:
        with jax.log_compiles(True):
            yield counter
    finally:
        logger.removeHandler(counter)
        logger.propagate = propagate


# -- training -------------------------------------------------------------------------------------
def train_jaxkv(
    steps: int = STEPS, mesh: Mesh | None = None, seed: int = 0
) -> tuple[dict, list[float], list[int]]:
    """Train on the mesh with jaxkv: the final parameter tree, the loss at each step, and the
    compilations during each call of the step."""
    mesh = make_mesh() if mesh is None else mesh
    params, tx = init_params(seed), make_optimizer()
    state = make_store(mesh, params, tx)
    step = make_step(state, params, tx)
    x, y = put_batch(mesh, *make_data(seed))
    losses, compiles = [], []
    for _ in range(steps):
        with counting_compiles() as c:
            state, loss = step(state, x, y)
            loss = float(loss)
        losses.append(loss)
        compiles.append(c.count)
    return jaxkv.pull(state, params), losses, compiles


def train_optax(steps: int = STEPS, seed: int = 0) -> tuple[dict, list[float]]:
    """The same model, data, initial parameters and steps with plain optax on one device and
    the whole batch: the final parameter tree and the loss at each step."""
    model, tx = MLP(), make_optimizer()
    device = jax.devices("cpu")[0]
    params = jax.device_put(init_params(seed), device)
    opt_state = tx.init(params)
    x, y = jax.device_put(make_data(seed), device)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, x, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
    return params, losses


def max_abs_difference(a, b) -> float:
    """The largest ``|a - b|`` over the leaves of two trees of the same structure."""
    diffs = jax.tree.map(lambda u, v: float(np.max(np.abs(np.asarray(u) - np.asarray(v)))), a, b)
    return max(jax.tree.leaves(diffs))


def main(steps: int = STEPS, every: int = 25) -> float:
    mesh = make_mesh()
    platform = mesh.devices.flat[0].platform
    print(f"mesh {dict(mesh.shape)} over {mesh.devices.size} {platform} devices")
    state = make_store(mesh, init_params(), make_optimizer())
    print("where the store keeps each parameter (jaxkv.specs):")
    for path, spec in jax.tree_util.tree_flatten_with_path(
        jaxkv.specs(state, "data", init_params())
    )[0]:
        print(f"  {jax.tree_util.keystr(path, simple=True, separator='/'):24} {spec}")
    params, losses, compiles = train_jaxkv(steps, mesh)
    ref, ref_losses = train_optax(steps)
    for i in range(0, steps, every):
        print(f"step {i:4d}  loss {losses[i]:.4e}  (one-device optax {ref_losses[i]:.4e})")
    print(f"step {steps - 1:4d}  loss {losses[-1]:.4e}  (one-device optax {ref_losses[-1]:.4e})")
    print(f"compilations of the step: {compiles[0]} at the first call, {sum(compiles[1:])} after")
    diff = max_abs_difference(params, ref)
    print(f"max |difference| of the parameters from one-device optax: {diff:.3g}")
    return diff


if __name__ == "__main__":
    # Eight simulated CPU devices, set before any JAX computation.
    jax.config.update("jax_num_cpu_devices", 8)
    main()
