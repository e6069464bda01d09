"""The tutorial notebook runs top to bottom in a fresh kernel and shows what the tutorial shows."""

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from _jobs import cpu_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
kernelspec = pytest.importorskip("jupyter_client.kernelspec")
manager = pytest.importorskip("jupyter_client.manager")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "kvstore_tutorial.ipynb"


def _runs_this_python(spec) -> bool:
    """Whether a kernel spec starts this interpreter (``python`` is replaced by it at launch)."""
    exe = spec.argv[0]
    if exe in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
        return True
    return Path(exe).resolve() == Path(sys.executable).resolve()


def _kernel_manager(tmp_path: Path):
    """A kernel manager for a ``python3`` kernel that runs this interpreter (the venv's).

    The installed ``python3`` spec is used when it starts this interpreter; otherwise (say, a
    user-level spec pointing at another Python) a spec for ``sys.executable`` is written to
    ``tmp_path`` and used instead.
    """
    from ipykernel.kernelspec import write_kernel_spec

    try:
        spec = kernelspec.KernelSpecManager().get_kernel_spec("python3")
    except kernelspec.NoSuchKernel:
        spec = None
    if spec is not None and _runs_this_python(spec):
        return manager.AsyncKernelManager(kernel_name="python3")
    spec_dir = write_kernel_spec(tmp_path / "kernels" / "python3")
    argv = json.loads((Path(spec_dir) / "kernel.json").read_text())["argv"]
    assert Path(argv[0]).resolve() == Path(sys.executable).resolve()
    specs = kernelspec.KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    return manager.AsyncKernelManager(kernel_name="python3", kernel_spec_manager=specs)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook after running every cell (with cwd = the repository root)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    km = _kernel_manager(tmp_path_factory.mktemp("kernelspec"))
    client = nbclient.NotebookClient(
        nb, km=km, timeout=300, resources={"metadata": {"path": str(ROOT)}}
    )
    # The tutorial is a tour of 8 simulated CPU devices (jax.devices()): its kernel runs on CPU
    # whatever this machine's default backend is. cleanup_kc: shut the kernel down and close
    # its sockets afterwards.
    client.execute(cleanup_kc=True, env=cpu_env())
    return nb


def _text(nb, cell_id: str) -> str:
    """All text a code cell printed (stdout, and any text/plain results)."""
    (cell,) = [c for c in nb.cells if c.get("id") == cell_id]
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}")
    return "".join(parts)


def _filled(value) -> str:
    """How the tutorial's 2x3 array holding ``value`` prints."""
    return str(np.full((2, 3), value, np.float32))


def test_saved_without_outputs_and_devices_set_first():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    first = nb.cells[0]
    assert first.cell_type == "code"
    assert 'jax.config.update("jax_num_cpu_devices", 8)' in first.source
    assert "jaxkv" not in first.source


def test_imperative_walkthrough(executed):
    assert "8 devices" in _text(executed, "imports")
    expected = {
        "init-pull": [2],
        "push-assign": [8],
        "push-aggregate": [4],
        "set-updater": [4],
        "push-updater": [6],
        "pull-devices": [6],
        "list-keys": [3],
        "list-keys-devices": [11],
    }
    for cell_id, values in expected.items():
        text = _text(executed, cell_id)
        for v in values:
            assert _filled(v) in text, (cell_id, text)
    assert "update on key" not in _text(executed, "set-updater")
    assert "update on key: 3" in _text(executed, "push-updater")
    for cell_id in ("list-keys", "list-keys-devices"):
        assert "update on key: 5\nupdate on key: 7\nupdate on key: 9" in _text(executed, cell_id)
    assert "[cpu(0), cpu(1), cpu(2), cpu(3)]" in _text(executed, "pull-devices")


def test_functional_walkthrough(executed):
    assert _filled(2) in _text(executed, "functional-init")
    push = _text(executed, "functional-push")
    assert push.index(_filled(8)) < push.index(_filled(4))
    updater = _text(executed, "functional-updater")
    assert _filled(6) in updater
    assert "still holds 4.0" in updater
    assert "devices [0, 1, 2, 3]" in _text(executed, "functional-pull-devices")
    lists = _text(executed, "functional-list-keys")
    assert lists.index(_filled(3)) < lists.index(_filled(11))
    assert "KVState(keys=[3, 5, 7, 9], devices=8)" in lists


def test_training_loss_falls(executed):
    text = _text(executed, "train-loop")
    losses = [float(v) for v in re.findall(r"^step +\d+ +loss ([0-9.]+)$", text, re.M)]
    assert len(losses) >= 5, text
    assert losses[-1] < losses[0] / 2, text
    assert all(np.isfinite(losses))
    diff = re.search(r"single-device training: (\S+)", _text(executed, "train-check"))
    assert diff is not None and float(diff.group(1)) < 1e-4
