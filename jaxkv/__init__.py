"""jaxkv: MXNet's KVStore rebuilt on JAX.

A functional core (:class:`KVState`, :func:`init`, :func:`push`, :func:`pull`, ...) for JAX
training loops, and an imperative :class:`KVStore` with MXNet's API (:func:`create`).

In a process started by ``python -m jaxkv.launch`` (and only there), importing jaxkv joins the
launcher's job: ``jax.distributed.initialize`` must run before JAX starts its backends, and
MXNet code may compute before it creates its store (docs/design.md, "Many processes").
"""

from jaxkv._src.processes import join as _join

# First, before anything that could start JAX's backends (a no-op outside jaxkv.launch).
_join.join_launched_job()

# isort: split
from jaxkv import nd as nd
from jaxkv._src.checkpoint.manager import CheckpointManager as CheckpointManager
from jaxkv._src.checkpoint.npz import load_state as load_state
from jaxkv._src.checkpoint.npz import save_state as save_state
from jaxkv._src.core.ops import Updater as Updater
from jaxkv._src.core.ops import gather as gather
from jaxkv._src.core.ops import init as init
from jaxkv._src.core.ops import init_optimizer as init_optimizer
from jaxkv._src.core.ops import pull as pull
from jaxkv._src.core.ops import push as push
from jaxkv._src.core.ops import pushpull as pushpull
from jaxkv._src.core.ops import specs as specs
from jaxkv._src.core.updater import pure_updater as pure_updater
from jaxkv._src.devices import Context as Context
from jaxkv._src.devices import cpu as cpu
from jaxkv._src.devices import current_context as current_context
from jaxkv._src.devices import gpu as gpu
from jaxkv._src.errors import DiskError as DiskError
from jaxkv._src.errors import DtypeError as DtypeError
from jaxkv._src.errors import DuplicateKeyError as DuplicateKeyError
from jaxkv._src.errors import KeyTypeError as KeyTypeError
from jaxkv._src.errors import KVStoreError as KVStoreError
from jaxkv._src.errors import ShapeError as ShapeError
from jaxkv._src.errors import SumError as SumError
from jaxkv._src.errors import UnknownKeyError as UnknownKeyError
from jaxkv._src.mxnet.kvstore import KVStore as KVStore
from jaxkv._src.mxnet.kvstore import create as create
from jaxkv._src.rows.ops import pull_rows as pull_rows
from jaxkv._src.rows.ops import push_rows as push_rows
from jaxkv._src.rows.ops import pushpull_rows as pushpull_rows
from jaxkv._src.rows.ops import row_sparse_pull as row_sparse_pull
from jaxkv._src.state.kvstate import KVState as KVState
from jaxkv._src.state.kvstate import empty as empty
from jaxkv._src.state.policy import Placement as Placement


def _version() -> str:
    """The installed distribution's version (one source: ``pyproject.toml``); in a source tree
    that is not installed, the version ``pyproject.toml`` beside the package gives."""
    from importlib import metadata

    try:
        return metadata.version("jaxkv")
    except metadata.PackageNotFoundError:
        import tomllib
        from pathlib import Path

        try:
            with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as f:
                return str(tomllib.load(f)["project"]["version"])
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "0+unknown"


__version__ = _version()

__all__ = [
    "CheckpointManager",
    "Context",
    "DuplicateKeyError",
    "KVState",
    "KVStore",
    "KVStoreError",
    "KeyTypeError",
    "Placement",
    "ShapeError",
    "SumError",
    "DiskError",
    "DtypeError",
    "UnknownKeyError",
    "Updater",
    "cpu",
    "create",
    "current_context",
    "empty",
    "gather",
    "gpu",
    "init",
    "init_optimizer",
    "load_state",
    "nd",
    "pull",
    "pull_rows",
    "push",
    "push_rows",
    "pushpull",
    "pure_updater",
    "pushpull_rows",
    "row_sparse_pull",
    "save_state",
    "specs",
]
