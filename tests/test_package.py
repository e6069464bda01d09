"""What a user installs: the version from the package metadata (one source: pyproject.toml),
py.typed, and the JAX floor that `make test-oldest` reads. `make wheel-check` builds the wheel
and runs the README's examples with it installed on its own."""

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import jaxkv

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_the_one_in_pyproject():
    assert jaxkv.__version__ == PYPROJECT["project"]["version"]
    try:
        installed = importlib.metadata.version("jaxkv")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path
        return
    assert jaxkv.__version__ == installed


def test_without_metadata_the_version_comes_from_the_source_tree(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert jaxkv._version() == PYPROJECT["project"]["version"]


def test_without_metadata_or_source_tree_the_version_says_unknown(monkeypatch, tmp_path):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    monkeypatch.setattr(jaxkv, "__file__", str(tmp_path / "jaxkv" / "__init__.py"))
    assert jaxkv._version() == "0+unknown"


def test_the_package_says_it_is_typed():
    assert (Path(jaxkv.__file__).parent / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["jaxkv"]


def _floor(name: str) -> str:
    found = [
        m.group(1)
        for d in PYPROJECT["project"]["dependencies"]
        if (m := re.fullmatch(rf"{name}>=([0-9]+\.[0-9]+(?:\.[0-9]+)?)", d))
    ]
    assert len(found) == 1, f"expected one {name}>=X.Y dependency: make test-oldest reads it"
    return found[0]


def test_jax_and_jaxlib_have_one_floor_and_no_ceiling():
    assert _floor("jax") == _floor("jaxlib")
    deps = PYPROJECT["project"]["dependencies"]
    assert not [d for d in deps if re.match(r"jax(lib)?\b.*<", d)]


def test_make_test_oldest_finds_the_floor():
    """`make test-oldest` pins the series of pyproject.toml's `"jax>=X.Y"` line, read by sed."""
    assert r"""s/^ *"jax>=\([0-9.]*\)".*/\1/p""" in (ROOT / "Makefile").read_text()
    text = (ROOT / "pyproject.toml").read_text()
    assert re.findall(r'(?m)^ *"jax>=([0-9.]*)"', text) == [_floor("jax")]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_test_newest_says_so_and_succeeds_where_no_index_offers_jaxlib(tmp_path):
    """A registry out of reach (or a mirror without JAX for the newest Python) is not a failure
    of the project: make test-newest asks three times, quotes pip and succeeds (``-n``: were
    jaxlib found, the suite would only be printed, not run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", MAKEFLAGS="")
    done = subprocess.run(
        [
            "make",
            "-n",
            "--no-print-directory",
            "test-newest",
            f"NEWEST_PYTHON={sys.executable}",
            "NEWEST_ASK_PAUSE=0",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stdout.splitlines()  # (-n echoes the recipe too: its lines start otherwise)
    assert sum(x.startswith("test-newest: no jaxlib on the index for") for x in said) == 2
    assert sum(x.startswith("test-newest: SKIPPED: the package indexes") for x in said) == 1
    assert "    ERROR: No matching distribution found for jaxlib" in said  # pip, quoted
    assert "pytest" not in done.stdout


def test_an_absent_mxnet_module_says_where_its_job_went():
    """``mx.gluon`` and MXNet's other modules that jaxkv.mx does not have raise an
    AttributeError naming the module, what takes its place and the migration guide; other
    unknown names raise Python's usual one."""
    import jaxkv.mx as mx

    for name in ("gluon", "autograd", "symbol", "module", "io"):
        with pytest.raises(AttributeError, match=rf"jaxkv.mx has no '{name}'.*migrating-from"):
            getattr(mx, name)
        assert not hasattr(mx, name)
    with pytest.raises(AttributeError, match="module 'jaxkv.mx' has no attribute 'nosuch'"):
        mx.nosuch  # noqa: B018
    assert mx.kv.create is not None  # what is here is untouched


def test_num_gpus_counts_this_processes_gpu_devices(monkeypatch):
    import jax

    import jaxkv.mx as mx
    from jaxkv._src import devices

    assert mx.context.num_gpus() == len([d for d in jax.local_devices() if d.platform == "gpu"])
    fake = [object(), object(), object()]
    monkeypatch.setattr(devices, "_local_devices", lambda p: fake if p == "gpu" else [])
    assert mx.context.num_gpus() == 3
