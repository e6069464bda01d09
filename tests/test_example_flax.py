"""``examples/flax_mesh.py``: a flax MLP on a 2 x 4 mesh, data parallel along "data" through
jaxkv and tensor parallel along "model" inside the step, equals plain optax on one device,
compiles its step once, and runs as a script. flax is the ``examples`` extra."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from _jobs import cpu_env
from jax.sharding import PartitionSpec as P

import jaxkv

pytest.importorskip("flax", reason="flax (the examples extra) is not installed")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "flax_mesh.py"


def _load():
    """The example as a module (registered first: flax's dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("flax_mesh", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ex = _load()


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


@pytest.mark.standard_promotion
def test_the_store_splits_the_big_kernel_along_data_only():
    mesh = ex.make_mesh()
    params = ex.init_params()
    state = ex.make_store(mesh, params, ex.make_optimizer())
    specs = jaxkv.specs(state, "data", params)["params"]
    assert specs["hidden_1"]["kernel"] == P("data")  # 128 x 128: at the 16K bound
    for name in ("hidden_0", "head"):
        assert specs[name] == {"kernel": P(), "bias": P()}
    # Half of the kernel per row of the mesh, the same half on its 4 "model" devices.
    kernel = state["params/hidden_1/kernel"]
    first_row = {s.device.id: s.index[0].start or 0 for s in kernel.addressable_shards}
    assert {first_row[d.id] for d in mesh.devices[0]} == {0}
    assert {first_row[d.id] for d in mesh.devices[1]} == {64}


def test_the_tensor_parallel_model_equals_the_plain_one():
    """MLP(model_axis="model") inside shard_map over the 4 "model" devices gives the outputs of
    MLP() on one device, from the same whole parameters."""
    mesh = ex.make_mesh()
    params = ex.init_params()
    x, _ = ex.make_data()
    tp = jax.jit(
        jax.shard_map(
            lambda p, x: ex.MLP(model_axis="model").apply(p, x),
            mesh=mesh,
            in_specs=(P(), P("data")),
            out_specs=P("data"),
        )
    )
    np.testing.assert_allclose(tp(params, x), ex.MLP().apply(params, x), rtol=1e-5, atol=1e-6)


def test_the_script_prints_the_losses_and_the_difference():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        cwd=ROOT,
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "mesh {'data': 2, 'model': 4} over 8 cpu devices" in out
    assert "params/hidden_1/kernel   P('data',)" in out
    assert len([line for line in out.splitlines() if line.startswith("step ")]) >= 5
    assert "compilations of the step: 1 at the first call, 0 after" in out
    diff = float(out.rsplit("from one-device optax: ", 1)[1].split()[0])
    assert diff < 1e-5
