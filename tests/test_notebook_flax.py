"""``notebooks/flax_mesh.ipynb`` runs top to bottom in a fresh kernel: a flax MLP on a 2 x 4 mesh
through jaxkv (the store keeping the tensor-parallel blocks, and 1/8 of the hidden kernels and
their Adam moments per device) equals one-device optax, its step compiles once, and it draws the
loss curves. flax is the ``examples`` extra."""

import re
import time
from pathlib import Path

import pytest
from _jobs import cpu_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("flax", reason="flax (the examples extra) is not installed")
pytest.importorskip("matplotlib", reason="matplotlib (the examples extra) is not installed")
pytest.importorskip("jupyter_client")
from _notebooks import cell_text, kernel_manager, saved_clean  # noqa: E402  (after the skips)

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "flax_mesh.ipynb"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook after running every cell (cwd = the repository root, on CPU devices), and
    the seconds it took."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    km = kernel_manager(tmp_path_factory.mktemp("kernelspec"))
    client = nbclient.NotebookClient(
        nb, km=km, timeout=300, resources={"metadata": {"path": str(ROOT)}}
    )
    start = time.perf_counter()
    client.execute(cleanup_kc=True, env=cpu_env(MPLBACKEND="Agg"))  # headless: no display
    return nb, time.perf_counter() - start


def test_saved_without_outputs_and_devices_set_first():
    saved_clean(NOTEBOOK)


def test_the_store_and_its_specs(executed):
    nb, _ = executed
    assert "8 devices" in cell_text(nb, "imports")
    assert "{'data': 2, 'model': 4} bigarray_bound 512" in cell_text(nb, "store")
    specs = cell_text(nb, "specs")
    assert "params/hidden_0/kernel   P('data', 'model')" in specs
    assert "params/hidden_0/bias     P('model',)" in specs
    assert "params/hidden_1/kernel   P(('model', 'data'),)" in specs
    assert "params/hidden_1/bias     P()" in specs
    assert "(16, 128) -> per device (8, 32)" in specs
    assert "(128, 128) -> per device (16, 128)" in specs


def test_each_device_holds_an_eighth_of_the_kernels_adam_moments(executed):
    nb, _ = executed
    text = cell_text(nb, "memory")
    shares = re.findall(r"^(mu|nu) (\S+) +\d+ of +\d+ = (\S+) x size / 8$", text, re.M)
    assert sorted((m, k) for m, k, _ in shares) == [
        (m, f"params/hidden_{i}/kernel") for m in ("mu", "nu") for i in (0, 1)
    ], text
    assert all(float(v) <= 1.05 for _, _, v in shares), text


def test_the_loss_falls_and_the_step_compiles_once(executed):
    nb, _ = executed
    text = cell_text(nb, "train-loop")
    losses = [float(v) for v in re.findall(r"^step +\d+ +loss (\S+)$", text, re.M)]
    assert len(losses) >= 5, text
    assert losses[-1] < losses[0] / 10, text
    assert "compilations of the step: 1 at the first call, 0 after" in text


def test_the_params_equal_one_device_optax(executed):
    nb, _ = executed
    found = re.search(r"from one-device optax: (\S+)", cell_text(nb, "train-check"))
    assert found is not None and float(found.group(1)) < 1e-5


def test_the_loss_curves_are_drawn(executed):
    nb, _ = executed
    (cell,) = [c for c in nb.cells if c.get("id") == "plot"]
    images = [o for o in cell.outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(images) == 1, [o.output_type for o in cell.outputs]
    assert len(images[0].data["image/png"]) > 10_000  # a drawn figure, base64


def test_mean_against_sum(executed):
    nb, _ = executed
    text = cell_text(nb, "mean-vs-sum")
    ratios = dict(re.findall(r"reduce='(\w+)': pushed gradient = (\S+) x", text))
    assert ratios.keys() == {"sum", "mean"}, text
    assert abs(float(ratios["sum"]) - 2) < 1e-3 and abs(float(ratios["mean"]) - 1) < 1e-3


def test_it_runs_in_under_a_minute(executed):
    _, seconds = executed
    assert seconds < 90, seconds  # about 10 s on 2 cores
