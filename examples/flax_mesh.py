"""A flax MLP trained on a 2 x 4 mesh: data parallel along "data" through jaxkv, tensor parallel
along "model" with the store keeping each device's block, in one jitted ``jax.shard_map`` step
that compiles once.

The mesh is 8 devices as 2 x 4, ``("data", "model")``. Along ``"data"`` the batch is split in
two halves and jaxkv averages the gradients (``reduce="mean"``); along ``"model"`` the 4 devices
of a row share one half of the batch and split the hidden units of the MLP between them,
Megatron-style: the first hidden layer by columns, the second by rows, the partial outputs
summed with ``jax.lax.psum``.

The parameters are stored that way too. The flax tree is put on the mesh with the Megatron
shardings (``hidden_0``'s kernel ``P(None, "model")`` and bias ``P("model")``, ``hidden_1``'s
kernel ``P("model", None)``, the rest replicated) before ``jaxkv.init``, which keeps them, and
the store adds ``"data"`` on dimension 0 of both hidden kernels (``bigarray_bound`` is chosen
for it): each device holds 1/8 of those kernels and of their Adam moments (ZeRO over tensor
parallelism). Inside the step ``jaxkv.pull`` gives each device its local block, the modules
declare the local shapes, and nothing is sliced.

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
def _parts(axis: str | None) -> int:
    """The devices along the mesh axis ``axis`` (inside ``shard_map``), 1 without one."""
    return 1 if axis is None else jax.lax.axis_size(axis)


class ColumnParallelDense(nn.Module):
    """``nn.Dense`` whose output units are split along ``model_axis``: each device holds and
    computes its ``features / n`` columns (``n`` the devices along the axis). Its parameters
    have the local shapes, ``kernel`` ``(inputs, features / n)`` and ``bias`` ``(features / n,)``:
    this device's block, as ``jaxkv.pull`` gives it inside the step. Without ``model_axis``
    it is a plain ``nn.Dense`` with the whole shapes."""

    features: int
    model_axis: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        local = self.features // _parts(self.model_axis)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], local))
        bias = self.param("bias", nn.initializers.zeros_init(), (local,))
        return x @ kernel + bias


class RowParallelDense(nn.Module):
    """``nn.Dense`` whose input units are split along ``model_axis``: each device holds its
    ``inputs / n`` rows of the kernel, multiplies its block of the input (the output of a
    :class:`ColumnParallelDense`) by them, and ``psum`` adds the partial outputs; the bias,
    whole on every device, is added once, after the sum."""

    features: int
    inputs: int  # the whole input width (each device holds inputs / n rows)
    model_axis: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        rows = self.inputs // _parts(self.model_axis)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (rows, self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        if self.model_axis is None:
            return x @ kernel + bias
        return jax.lax.psum(x @ kernel, self.model_axis) + bias


class MLP(nn.Module):
    """Two hidden layers of ``hidden`` units and a linear head. With ``model_axis`` the hidden
    layers run tensor parallel over that mesh axis (inside ``shard_map``) on the local blocks
    of their parameters; without it, on one device with the whole ones. The tree's structure
    is the same either way, ``{"params": {"hidden_0": {"kernel", "bias"}, "hidden_1": {...},
    "head": {...}}}``; flax checks the leaves' shapes at ``apply``."""

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
    """The flax parameter tree of :class:`MLP`, whole (the same initial values for the one
    device and for the mesh, where :func:`shard_params` puts them in the Megatron layout)."""
    return MLP(hidden).init(jax.random.key(seed), jnp.zeros((1, FEATURES), jnp.float32))


def hidden_of(params) -> int:
    """The hidden width of :class:`MLP`'s parameter tree."""
    return params["params"]["hidden_0"]["kernel"].shape[1]


def tensor_parallel_specs(params):
    """The Megatron layout of :class:`MLP`'s parameter tree, one ``PartitionSpec`` per leaf:
    ``hidden_0`` split by columns (its kernel ``P(None, "model")``, its bias ``P("model")``),
    ``hidden_1``'s kernel by rows (``P("model", None)``), ``hidden_1``'s bias and the head
    replicated (``P()``)."""
    specs = jax.tree.map(lambda _: P(), params)
    specs["params"]["hidden_0"] = {"kernel": P(None, "model"), "bias": P("model")}
    specs["params"]["hidden_1"]["kernel"] = P("model", None)
    return specs


def shard_params(mesh: Mesh, params):
    """``params`` on ``mesh`` in the layout of :func:`tensor_parallel_specs`: each leaf a
    ``jax.Array`` with its ``NamedSharding``, as ``jaxkv.init`` takes it to keep it."""
    return jax.tree.map(
        lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)),
        params,
        tensor_parallel_specs(params),
    )


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
def bigarray_bound(mesh: Mesh, params) -> int:
    """The store's ``bigarray_bound`` that splits both hidden kernels along ``"data"`` and
    nothing else: the elements of ``hidden_0``'s kernel on one ``"model"`` device
    (``16 x 128 / 4 = 512``; ``hidden_1``'s block, ``128 / 4 x 128``, is bigger). The biases
    (at most ``hidden``) and the head (``hidden x 1``) stay below it."""
    inputs, hidden = params["params"]["hidden_0"]["kernel"].shape
    return inputs * hidden // mesh.shape["model"]


def make_store(mesh: Mesh, params, tx: optax.GradientTransformation) -> jaxkv.KVState:
    """A store on the mesh that averages along ``"data"``, holding ``params`` (whole, on one
    device) in the tensor-parallel layout and ``tx``'s state.

    The parameters go to ``jaxkv.init`` on the mesh (:func:`shard_params`): the store keeps
    each leaf's split along ``"model"``, and adds ``"data"`` on dimension 0 of the leaves whose
    block on one ``"model"`` device has at least :func:`bigarray_bound` elements (the two
    hidden kernels: ``P("data", "model")`` and ``P(("model", "data"))``), and of their Adam
    moments. ``init_optimizer`` makes Adam's state now, so that the first step already has the
    state's final structure and the step compiles once.
    """
    store = jaxkv.empty(
        mesh=mesh, axis_name="data", reduce="mean", bigarray_bound=bigarray_bound(mesh, params)
    )
    state = jaxkv.init(store, shard_params(mesh, params))
    return jaxkv.init_optimizer(state, tx)


def optimizer_state_per_device(state: jaxkv.KVState) -> list[tuple[str, int, int]]:
    """For each optimizer-state leaf split along both mesh axes: its name (``"mu/params/
    hidden_0/kernel"``), its elements, and the most elements of it on one device."""
    out = []
    leaves = jax.tree_util.tree_flatten_with_path(list(state.opt_states.values()))[0]
    for path, leaf in leaves:
        entries = [e if isinstance(e, tuple) else (e,) for e in leaf.sharding.spec if e]
        if not set(state.mesh.axis_names) <= {a for e in entries for a in e}:
            continue
        name = "/".join(
            str(getattr(k, "name", getattr(k, "key", ""))) for k in path if not hasattr(k, "idx")
        )
        out.append((name, leaf.size, max(s.data.size for s in leaf.addressable_shards)))
    return out


def make_step(
    state: jaxkv.KVState, params, tx: optax.GradientTransformation
) -> Callable[[jaxkv.KVState, jax.Array, jax.Array], tuple[jaxkv.KVState, jax.Array]]:
    """One training step over the whole mesh: ``step(state, x, y) -> (state, loss)``.

    ``x`` and ``y`` are the whole batch, split along ``"data"`` (``P("data")``): each row of
    the mesh gets half of it, the same half on its 4 ``"model"`` devices. ``loss`` is the
    full batch's loss before the update. The state is donated. The hidden width is that of
    ``params`` (the whole tree, or its shapes: only its structure and width are read).
    """
    model = MLP(hidden_of(params), model_axis="model")
    like = jax.eval_shape(lambda: params)  # pull reads only the tree's structure
    specs = jaxkv.specs(state, "data")  # where the store keeps each of its arrays

    def step(state, x, y):
        # This device's blocks of the parameter tree, the same flax tree with local leaves:
        # hidden_0's kernel (16, 128 / 4) and bias (128 / 4,), hidden_1's kernel (128 / 4, 128),
        # the rest whole. The hidden kernels, split along "data" as well, are all-gathered along
        # "data" (over the 2 devices of this column of the mesh); nothing moves along "model".
        params = jaxkv.pull(state, like, axis_name="data")
        # The gradients, of the same local shapes. Why they are exactly the full batch's once
        # pushed, with nothing summed by hand here:
        # - Along "model". A local block (hidden_0's kernel and bias, hidden_1's kernel)
        #   differs along "model" and only this device uses it: the loss depends on it through
        #   this device's columns of h, and on those through the psum, whose transpose hands
        #   every "model" device the whole cotangent of the sum. So its gradient is complete
        #   as it is, and is not summed over "model" (summing would add the other devices'
        #   blocks). The replicated leaves (hidden_1's bias, the head) act after the psum, on
        #   values the same on every "model" device: their gradients need no sum over "model"
        #   either, and get none.
        # - Along "data". Each row of the mesh sees its half of the batch. The hidden kernels
        #   come out of the pull's all-gather marked varying along "data": their gradients are
        #   this row's half only. Every other leaf is the same on both rows. Under shard_map's
        #   checks of varying axes (check_vma, the default), where such a leaf meets a value
        #   that differs along "data" (anything computed from this row's x) it is first marked
        #   varying along it (an implicit jax.lax.pvary), and AD transposes pvary into a psum:
        #   jax.grad returns its gradient already summed over "data", the same on both rows.
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, x, y))(params)
        # push sums each leaf along "data" exactly once (it knows which leaves AD has summed
        # already: those are invariant along "data"), reduce-scattering the hidden kernels'
        # gradients to each device's rows (its 1/8 of the kernel), then divides by the 2
        # devices along "data" (reduce="mean", as jax.lax.pmean counts): the mean of the two
        # halves' mean losses is the full batch's mean loss, so this is exactly the full-batch
        # gradient. Then Adam, on each device's part of the state.
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
    params = init_params()
    state = make_store(mesh, params, make_optimizer())
    bound = state.bigarray_bound
    print(f"where the store keeps each parameter (jaxkv.specs; bigarray_bound {bound}):")
    for path, spec in jax.tree_util.tree_flatten_with_path(jaxkv.specs(state, "data", params))[0]:
        key = jax.tree_util.keystr(path, simple=True, separator="/")
        block = state[key].addressable_shards[0].data.shape
        print(f"  {key:24} {str(spec):24} {state[key].shape} -> per device {block}")
    print("Adam's state split along both axes, per device:")
    for name, size, per_device in optimizer_state_per_device(state):
        share = per_device / (size / mesh.devices.size)
        print(f"  {name:28} {per_device:6d} of {size:6d} elements = {share:.2f} x size / 8")
        assert share <= 1.05, (name, size, per_device)
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
