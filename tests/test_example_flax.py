"""``examples/flax_mesh.py``: a flax MLP on a 2 x 4 mesh, data parallel along "data" through
jaxkv and tensor parallel along "model" (the store keeping each device's blocks: the hidden
kernels and their Adam moments 1/8 per device), equals plain optax on one device, compiles its
step once, and runs as a script. flax is the ``examples`` extra."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jobs import load_example, run_example
from jax.sharding import PartitionSpec as P

import jaxkv

pytest.importorskip("flax", reason="flax (the examples extra) is not installed")
from flax.errors import ScopeParamShapeError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "flax_mesh.py"


ex = load_example("flax_mesh")


@pytest.fixture(scope="module")
def runs():
    """Both trainings, once for the module (optax's Adam by hand needs standard promotion)."""
    with jax.numpy_dtype_promotion("standard"):
        params, losses, compiles = ex.train_jaxkv()
        ref, ref_losses = ex.train_optax()
    return params, losses, compiles, ref, ref_losses


@pytest.mark.standard_promotion
def test_the_params_equal_one_device_optax(runs):
    params, _, _, ref, _ = runs
    assert jax.tree.structure(params) == jax.tree.structure(ex.init_params())
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, ref)
    assert ex.max_abs_difference(params, ref) < 1e-5


@pytest.mark.standard_promotion
def test_the_step_compiles_once(runs):
    _, _, compiles, _, _ = runs
    assert len(compiles) == ex.STEPS
    assert compiles[0] == 1, compiles[:3]
    assert sum(compiles[1:]) == 0, compiles


@pytest.mark.standard_promotion
def test_the_loss_falls_as_one_device_optaxs(runs):
    _, losses, _, _, ref_losses = runs
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0] / 10, (losses[0], losses[-1])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)


@pytest.fixture(scope="module")
def store():
    mesh = ex.make_mesh()
    params = ex.init_params()
    with jax.numpy_dtype_promotion("standard"):
        return mesh, params, ex.make_store(mesh, params, ex.make_optimizer())


def test_the_store_keeps_the_megatron_layout_and_adds_data_on_the_kernels(store):
    mesh, params, state = store
    assert state.bigarray_bound == 16 * 128 // 4
    specs = jaxkv.specs(state, "data", params)["params"]
    assert specs == {
        "hidden_0": {"kernel": P("data", "model"), "bias": P("model")},
        "hidden_1": {"kernel": P(("model", "data")), "bias": P()},
        "head": {"kernel": P(), "bias": P()},
    }
    shapes = {
        k: {s.data.shape for s in state[k].addressable_shards}
        for k in ("params/hidden_0/kernel", "params/hidden_0/bias", "params/hidden_1/kernel")
    }
    assert shapes == {
        "params/hidden_0/kernel": {(8, 32)},  # (16, 128): rows by "data", columns by "model"
        "params/hidden_0/bias": {(32,)},
        "params/hidden_1/kernel": {(16, 128)},  # (128, 128): rows by "model", then "data"
    }
    # Device (d, m) of the mesh holds hidden_0's kernel from row 8d and column 32m, and
    # hidden_1's from row 32m + 16d (the rows of its "model" block, split by "data").
    for (d, m), device in np.ndenumerate(mesh.devices):
        (shard,) = [
            s for s in state["params/hidden_0/kernel"].addressable_shards if s.device == device
        ]
        assert (shard.index[0].start or 0, shard.index[1].start or 0) == (8 * d, 32 * m)
        (shard,) = [
            s for s in state["params/hidden_1/kernel"].addressable_shards if s.device == device
        ]
        assert (shard.index[0].start or 0) == 32 * m + 16 * d
    # The values as given.
    jax.tree.map(np.testing.assert_array_equal, jaxkv.pull(state, params), params)


def test_each_device_holds_an_eighth_of_the_kernels_adam_moments(store):
    mesh, _, state = store
    rows = ex.optimizer_state_per_device(state)
    assert sorted(name for name, _, _ in rows) == [
        f"{moment}/params/hidden_{i}/kernel" for moment in ("mu", "nu") for i in (0, 1)
    ]
    for name, size, per_device in rows:
        assert per_device <= 1.05 * size / mesh.devices.size, (name, size, per_device)
    ((adam, _),) = state.opt_states.values()
    assert adam.mu["params/hidden_1/kernel"].sharding.spec == P(("model", "data"))
    assert adam.nu["params/hidden_0/kernel"].sharding.spec == P("data", "model")


@pytest.mark.parametrize("source", ["sliced", "pulled"])
def test_the_tensor_parallel_model_equals_the_plain_one(store, source):
    """MLP(model_axis="model") inside shard_map on each device's local blocks (of the whole
    parameters, sliced by ``in_specs`` or pulled from the store) gives the outputs of MLP() on
    one device with the whole parameters."""
    mesh, params, state = store
    x, _ = ex.make_data()
    like = jax.eval_shape(lambda: params)
    model = ex.MLP(model_axis="model")
    if source == "sliced":
        specs, given = ex.tensor_parallel_specs(params), params
        local = lambda p: p  # noqa: E731
    else:
        specs, given = jaxkv.specs(state, "data"), state
        local = lambda s: jaxkv.pull(s, like, axis_name="data")  # noqa: E731

    def apply(p, x):
        p = local(p)
        assert jax.tree.map(jnp.shape, p)["params"]["hidden_1"]["kernel"] == (32, 128)
        return model.apply(p, x)

    tp = jax.jit(jax.shard_map(apply, mesh=mesh, in_specs=(specs, P("data")), out_specs=P("data")))
    np.testing.assert_allclose(tp(given, x), ex.MLP().apply(params, x), rtol=1e-5, atol=1e-6)


def test_the_modules_declare_local_shapes_only_with_a_model_axis(store):
    """flax checks the shapes at apply: the whole tree is refused inside the tensor-parallel
    step, as the local blocks are on one device."""
    mesh, params, _ = store
    x, _ = ex.make_data()
    fn = jax.shard_map(
        lambda p, x: ex.MLP(model_axis="model").apply(p, x),
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=P("data"),
    )
    with pytest.raises(ScopeParamShapeError, match=r"hidden_0.*\(16, 32\)"):
        fn(params, x)


@pytest.mark.whole
def test_the_script_prints_the_losses_and_the_difference():
    proc = run_example(EXAMPLE.name)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "mesh {'data': 2, 'model': 4} over 8 cpu devices" in out
    assert "params/hidden_0/kernel   P('data', 'model')" in out
    assert "params/hidden_1/kernel   P(('model', 'data'),)" in out
    assert "(128, 128) -> per device (16, 128)" in out
    shares = re.findall(r"^  (\S+) +\d+ of +\d+ elements = (\S+) x size / 8$", out, re.M)
    assert len(shares) == 4 and all(float(v) <= 1.05 for _, v in shares), out
    assert len([line for line in out.splitlines() if line.startswith("step ")]) >= 5
    assert "compilations of the step: 1 at the first call, 0 after" in out
    diff = float(out.rsplit("from one-device optax: ", 1)[1].split()[0])
    assert diff < 1e-5
