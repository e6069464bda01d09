"""The tutorial notebook runs top to bottom in a fresh kernel and shows what the tutorial shows."""

import re
from pathlib import Path

import numpy as np
import pytest
from _jobs import cpu_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("jupyter_client")
from _notebooks import cell_text, kernel_manager, saved_clean  # noqa: E402  (after the skips)

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "kvstore_tutorial.ipynb"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook after running every cell (with cwd = the repository root)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    km = kernel_manager(tmp_path_factory.mktemp("kernelspec"))
    client = nbclient.NotebookClient(
        nb, km=km, timeout=300, resources={"metadata": {"path": str(ROOT)}}
    )
    # The tutorial is a tour of 8 simulated CPU devices (jax.devices()): its kernel runs on CPU
    # whatever this machine's default backend is. cleanup_kc: shut the kernel down and close
    # its sockets afterwards.
    client.execute(cleanup_kc=True, env=cpu_env())
    return nb


def _filled(value) -> str:
    """How the tutorial's 2x3 array holding ``value`` prints."""
    return str(np.full((2, 3), value, np.float32))


def test_saved_without_outputs_and_devices_set_first():
    saved_clean(NOTEBOOK)


def test_imperative_walkthrough(executed):
    assert "8 devices" in cell_text(executed, "imports")
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
        text = cell_text(executed, cell_id)
        for v in values:
            assert _filled(v) in text, (cell_id, text)
    assert "update on key" not in cell_text(executed, "set-updater")
    assert "update on key: 3" in cell_text(executed, "push-updater")
    for cell_id in ("list-keys", "list-keys-devices"):
        assert "update on key: 5\nupdate on key: 7\nupdate on key: 9" in cell_text(
            executed, cell_id
        )
    assert "[cpu(0), cpu(1), cpu(2), cpu(3)]" in cell_text(executed, "pull-devices")


def test_functional_walkthrough(executed):
    assert _filled(2) in cell_text(executed, "functional-init")
    push = cell_text(executed, "functional-push")
    assert push.index(_filled(8)) < push.index(_filled(4))
    updater = cell_text(executed, "functional-updater")
    assert _filled(6) in updater
    assert "still holds 4.0" in updater
    assert "devices [0, 1, 2, 3]" in cell_text(executed, "functional-pull-devices")
    lists = cell_text(executed, "functional-list-keys")
    assert lists.index(_filled(3)) < lists.index(_filled(11))
    assert "KVState(keys=[3, 5, 7, 9], devices=8)" in lists


def test_training_loss_falls(executed):
    text = cell_text(executed, "train-loop")
    losses = [float(v) for v in re.findall(r"^step +\d+ +loss ([0-9.]+)$", text, re.M)]
    assert len(losses) >= 5, text
    assert losses[-1] < losses[0] / 2, text
    assert all(np.isfinite(losses))
    diff = re.search(r"single-device training: (\S+)", cell_text(executed, "train-check"))
    assert diff is not None and float(diff.group(1)) < 1e-4
