"""jaxkv: MXNet's KVStore rebuilt on JAX.

A functional core (:class:`KVState`, :func:`init`, :func:`push`, :func:`pull`, ...) for JAX
training loops, and an imperative :class:`KVStore` with MXNet's API (:func:`create`).
"""

from . import _dist  # noqa: F401  (first: joins a jaxkv.launch job before JAX starts)
from . import nd as nd
from ._checkpoint import load_state as load_state
from ._checkpoint import save_state as save_state
from ._context import Context as Context
from ._context import cpu as cpu
from ._context import current_context as current_context
from ._context import gpu as gpu
from ._errors import DuplicateKeyError as DuplicateKeyError
from ._errors import KeyTypeError as KeyTypeError
from ._errors import KVStoreError as KVStoreError
from ._errors import ShapeError as ShapeError
from ._errors import UnknownKeyError as UnknownKeyError
from ._kvstore import KVStore as KVStore
from ._kvstore import create as create
from ._ops import Updater as Updater
from ._ops import gather as gather
from ._ops import init as init
from ._ops import init_optimizer as init_optimizer
from ._ops import pull as pull
from ._ops import pull_rows as pull_rows
from ._ops import push as push
from ._ops import push_rows as push_rows
from ._ops import pushpull as pushpull
from ._ops import pushpull_rows as pushpull_rows
from ._ops import row_sparse_pull as row_sparse_pull
from ._ops import specs as specs
from ._state import KVState as KVState
from ._state import empty as empty
from ._update import pure_updater as pure_updater


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
    "Context",
    "DuplicateKeyError",
    "KVState",
    "KVStore",
    "KVStoreError",
    "KeyTypeError",
    "ShapeError",
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
