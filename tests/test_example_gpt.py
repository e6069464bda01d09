"""``examples/gpt_mesh.py``: a small flax GPT (AdamW with a weight-decay mask by path,
warmup-cosine, clipping by the global norm, 4 micro-batches in a ``lax.scan``, bfloat16 compute
over float32 master weights) trained on a 2 x 4 mesh with jaxkv's plain-``jit`` recipe equals
the same model under GSPMD with optax, compiles its step once, runs across 2 launched processes
with checkpoints, and resumes onto 1 and 4 processes where an uninterrupted run ends."""

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from _jobs import cpu_env, load_example

pytest.importorskip("flax", reason="flax (the examples extra) is not installed")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "gpt_mesh.py"


ex = load_example("gpt_mesh")
F32 = dataclasses.replace(ex.SMALL, compute="float32")


@pytest.mark.standard_promotion
def test_the_gpt_equals_gspmd_and_optax_and_compiles_once():
    """bfloat16 compute: the same partitioning as GSPMD's (tensor parallel, and leaves of at
    least ``ex.BOUND`` elements split along "data": FSDP's placement) gives the same numbers;
    the mask by path is optax's on the flax tree."""
    mesh = ex.make_mesh(jax.devices("cpu"))
    params, losses, compiles = ex.train_jaxkv(3, ex.SMALL, mesh)
    ref, ref_losses = ex.train_gspmd(3, ex.SMALL, mesh, fsdp=True)
    assert ex.max_difference(params, ref) < 1e-6
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert compiles[0] >= 1 and compiles[1:] == [0, 0], compiles
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(ref)


def _launch(n, per_process, *args, timeout=400):
    command = [sys.executable, "-m", "jaxkv.launch", "-n", str(n)]
    command += ["--devices-per-process", str(per_process), str(EXAMPLE), "--small", "--f32"]
    return subprocess.run(
        [*command, *map(str, args)],
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def _difference(run):
    found = re.findall(r"max \|jaxkv - GSPMD\| = (\S+)", run.stdout)
    assert found, run.stdout + run.stderr
    return float(found[-1])


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """2 launched processes of 4 devices train 4 steps, checkpointing every 2 (each process its
    shards): the checkpoint directory."""
    ckpt = tmp_path_factory.mktemp("gpt") / "ckpt"
    run = _launch(2, 4, "--ckpt", ckpt, "--steps", 4, "--every", 2)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 process(es)" in run.stdout and "step 4 loss" in run.stdout, run.stdout
    assert _difference(run) < 1e-5  # float32 compute: FSDP's partitioning rounds alike
    return ckpt


@pytest.mark.standard_promotion
def test_across_two_processes_and_resumed_in_one(two_processes, tmp_path):
    """The 2 processes' checkpoint resumes to step 6 in this one process of 8 devices, ending
    where GSPMD's uninterrupted 6 steps end."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_processes, ckpt)
    mesh = ex.make_mesh(jax.devices("cpu"))
    params, losses, compiles = ex.train_jaxkv(6, F32, mesh, ckpt=str(ckpt))
    assert len(losses) == 2 and compiles[1:] == [0], (losses, compiles)
    ref, _ = ex.train_gspmd(6, F32, mesh)
    assert ex.max_difference(params, ref) < 1e-5


# A third launch of the GPT (a minute and more on 2 cores): make test-deep.
@pytest.mark.deep
def test_resumed_onto_four_processes(two_processes, tmp_path):
    """The 2 processes' checkpoint resumes to step 6 in 4 launched processes of 2 devices."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_processes, ckpt)
    run = _launch(4, 2, "--ckpt", ckpt, "--steps", 6, "--every", 2)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "4 process(es)" in run.stdout and "step 5 loss" in run.stdout, run.stdout
    assert "step 1 loss" not in run.stdout, run.stdout  # resumed, not started again
    assert _difference(run) < 1e-5
