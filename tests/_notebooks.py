"""Running the notebooks in tests: a kernel of this interpreter, the text a cell printed, and
the check that a notebook is saved without outputs with its devices set first."""

import json
import sys
from pathlib import Path

import nbformat
from jupyter_client import kernelspec, manager

__all__ = ["cell_text", "kernel_manager", "saved_clean"]


def _runs_this_python(spec) -> bool:
    """Whether a kernel spec starts this interpreter (``python`` is replaced by it at launch)."""
    exe = spec.argv[0]
    if exe in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
        return True
    return Path(exe).resolve() == Path(sys.executable).resolve()


def kernel_manager(tmp_path: Path):
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


def cell_text(nb, cell_id: str) -> str:
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


def saved_clean(path: Path) -> None:
    """The notebook at ``path`` is saved without outputs, and its first cell sets the 8 CPU
    devices before anything imports jaxkv."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    first = nb.cells[0]
    assert first.cell_type == "code"
    assert 'jax.config.update("jax_num_cpu_devices", 8)' in first.source
    assert "jaxkv" not in first.source
