"""jaxkv in one run: MXNet's KVStore tutorial, then data-parallel training on 8 devices.

The first part replays MXNet's KVStore tutorial ("Basic Push and Pull", "List Key-Value
Pairs") through ``import jaxkv.mx as mx``, with ``mx.cpu(i)`` standing in for ``mx.gpu(i)``, and
again through the functional core (``jaxkv.init``/``push``/``pull`` on an immutable
``KVState``). The second part trains a small MLP on synthetic data with ``jax.shard_map`` over 8
simulated CPU devices, updating the parameters in the store with ``optax.sgd`` inside the step.

Run it with ``make demo`` or ``.venv/bin/python examples/demo.py``.
"""

import time

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxkv
import jaxkv.mx as mx

# Eight simulated CPU devices, set before anything uses a JAX backend (importing does not).
jax.config.update("jax_num_cpu_devices", 8)

SHAPE = (2, 3)
BATCH = 256
STEPS = 30
LEARNING_RATE = 0.1


def section(title):
    """Print a section header."""
    print(f"\n== {title} ==")


def show(label, value):
    """Print a label, then an array (``NDArray`` or ``jax.Array``) as NumPy prints it."""
    array = value.asnumpy() if isinstance(value, mx.nd.NDArray) else value
    print(f"{label}:\n{array}")


def imperative_walkthrough():
    """MXNet's KVStore tutorial, line for line, through ``import jaxkv.mx as mx``."""
    section("Initialization")
    kv = mx.kv.create("local")
    kv.init(3, mx.nd.ones(SHAPE) * 2)
    a = mx.nd.zeros(SHAPE)
    kv.pull(3, out=a)
    show("kv.init(3, ones * 2); kv.pull(3, out=a)", a)

    section("Push, aggregation and updater")
    kv.push(3, mx.nd.ones(SHAPE) * 8)
    kv.pull(3, out=a)
    show("kv.push(3, ones * 8) assigns", a)

    gpus = [mx.cpu(i) for i in range(4)]  # mx.gpu(i) in MXNet
    b = [mx.nd.ones(SHAPE, gpu) for gpu in gpus]
    kv.push(3, b)
    kv.pull(3, out=a)
    show(f"kv.push(3, ones on {gpus}) sums the four values", a)

    def update(key, input, stored):
        """MXNet's in-place updater; it runs (and prints) when jaxkv compiles the push."""
        print(f"update on key: {key}")
        stored += input * 2

    kv._set_updater(update)
    kv.pull(3, out=a)
    show("after kv._set_updater(update), nothing stored has changed", a)
    kv.push(3, mx.nd.ones(SHAPE))
    kv.pull(3, out=a)
    show("kv.push(3, ones) with the updater: 4 + 2 * 1", a)

    section("Pull to several devices")
    b = [mx.nd.ones(SHAPE, gpu) for gpu in gpus]
    kv.pull(3, out=b)
    show("kv.pull(3, out=b); b[1]", b[1])
    print("each b[i] was filled on its own device:", [x.context for x in b])

    section("List key-value pairs")
    keys = [5, 7, 9]
    kv.init(keys, [mx.nd.ones(SHAPE)] * len(keys))
    kv.push(keys, [mx.nd.ones(SHAPE)] * len(keys))
    b = [mx.nd.zeros(SHAPE)] * len(keys)
    kv.pull(keys, out=b)
    show("keys [5, 7, 9]: 1 + 2 * 1; b[1]", b[1])

    b = [[mx.nd.ones(SHAPE, gpu) for gpu in gpus]] * len(keys)
    kv.push(keys, b)
    kv.pull(keys, out=b)
    show("keys [5, 7, 9] pushed from four devices: 3 + 2 * 4; b[1][1]", b[1][1])
    print(kv)


def functional_walkthrough():
    """The same walkthrough with the functional core: every operation returns a new state."""
    section("Functional style")
    devices = jax.devices()[:4]
    state = jaxkv.empty()
    state = jaxkv.init(state, 3, jnp.ones(SHAPE) * 2)
    show("jaxkv.init(state, 3, ones * 2); jaxkv.pull(state, 3)", jaxkv.pull(state, 3))

    state = jaxkv.push(state, 3, jnp.ones(SHAPE) * 8)
    show("jaxkv.push(state, 3, ones * 8)", jaxkv.pull(state, 3))

    b = [jax.device_put(jnp.ones(SHAPE), d) for d in devices]
    state = jaxkv.push(state, 3, b)
    show("jaxkv.push(state, 3, [ones on 4 devices])", jaxkv.pull(state, 3))

    update = lambda key, pushed, stored: stored + 2 * pushed
    new_state = jaxkv.push(state, 3, jnp.ones(SHAPE), updater=update)
    show("jaxkv.push(state, 3, ones, updater=update)", jaxkv.pull(new_state, 3))
    print("the previous state is unchanged; it still holds", jaxkv.pull(state, 3)[0, 0])
    state = new_state

    pulled = jaxkv.pull(state, 3, devices=devices)
    print(
        "jaxkv.pull(state, 3, devices=...) is replicated on devices",
        sorted(d.id for d in pulled.devices()),
    )

    keys = [5, 7, 9]
    state = jaxkv.init(state, keys, [jnp.ones(SHAPE)] * len(keys))
    state = jaxkv.push(state, keys, [jnp.ones(SHAPE)] * len(keys), updater=update)
    show("keys [5, 7, 9]: 1 + 2 * 1", jaxkv.pull(state, keys)[1])
    b = [[jax.device_put(jnp.ones(SHAPE), d) for d in devices]] * len(keys)
    state = jaxkv.push(state, keys, b, updater=update)
    show("keys [5, 7, 9] pushed from four devices: 3 + 2 * 4", jaxkv.pull(state, keys)[1])
    print(state)


def make_problem():
    """Synthetic regression data and initial MLP parameters: ``(x, y, params)``."""
    kx, kw, kn, k1, k2 = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(kx, (BATCH, 4))
    y = jnp.sin(x) @ jax.random.normal(kw, (4, 1)) + 0.05 * jax.random.normal(kn, (BATCH, 1))
    params = {
        "w1": 0.5 * jax.random.normal(k1, (4, 32)),
        "b1": jnp.zeros(32),
        "w2": 0.2 * jax.random.normal(k2, (32, 1)),
        "b2": jnp.zeros(1),
    }
    return x, y, params


def predict(params, x):
    """A one-hidden-layer MLP."""
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def local_loss(params, x, y):
    """This device's share of the mean squared error over the whole batch."""
    return jnp.sum((predict(params, x) - y) ** 2) / BATCH


def make_train_step(mesh):
    """A jitted data-parallel step ``(state, x, y) -> (state, loss)`` over ``mesh``'s axis 'd'.

    The state is replicated and the batch split along 'd'. The gradients of the replicated
    parameters come back from autodiff already summed over 'd', and ``jaxkv.push`` with
    ``axis_name='d'`` does not sum them again; it only sums values that still vary along 'd'.
    """
    optimizer = optax.sgd(LEARNING_RATE)

    def step(state, x, y):
        loss, grads = jax.value_and_grad(local_loss)(dict(state.values), x, y)
        state = jaxkv.push(state, grads, updater=optimizer, axis_name="d")
        return state, jax.lax.psum(loss, "d")

    return jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
    )


def reference_params(params, x, y):
    """The parameters after the same number of plain full-batch SGD steps on one device."""

    @jax.jit
    def step(params):
        grads = jax.grad(local_loss)(params, x, y)
        return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)

    for _ in range(STEPS):
        params = step(params)
    return params


def train():
    """Train the MLP data-parallel on all devices, printing progress; returns the losses."""
    devices = jax.devices()
    section(f"Data-parallel training on {len(devices)} devices")
    x, y, params = make_problem()
    print(
        f"{BATCH} rows split over {len(devices)} devices ({BATCH // len(devices)} each); "
        f"parameters {sorted(params)} in a KVState, updater optax.sgd({LEARNING_RATE})"
    )
    train_step = make_train_step(Mesh(devices, ("d",)))
    state = jaxkv.init(jaxkv.empty(), params)
    losses = []
    start = time.perf_counter()
    for i in range(STEPS):
        state, loss = train_step(state, x, y)
        losses.append(float(loss))
        if i % 5 == 0 or i == STEPS - 1:
            print(f"step {i:2d}  loss {losses[-1]:.4f}  ({time.perf_counter() - start:.1f} s)")
    print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")

    reference = reference_params(params, x, y)
    diff = max(float(jnp.max(jnp.abs(jaxkv.pull(state, k) - reference[k]))) for k in reference)
    print(f"largest difference from single-device training: {diff:.1e}")
    return losses


def main():
    """Run the tutorial walkthroughs, then the training run."""
    start = time.perf_counter()
    print(f"jaxkv {jaxkv.__version__} on {len(jax.devices())} {jax.devices()[0].platform} devices")
    imperative_walkthrough()
    functional_walkthrough()
    train()
    print(f"\ndone in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
