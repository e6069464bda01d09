"""MXNet-style NDArrays: ``jaxkv.nd.ones((2, 3), jaxkv.cpu(1))`` and friends.

``jaxkv.nd.sparse`` holds MXNet's row-sparse arrays (``row_sparse_array``, ``zeros``,
``RowSparseNDArray``, ...); like ``os.path``, it is a module reached as an attribute, and
``import jaxkv.nd.sparse`` works too.
"""

import sys

from jaxkv import _sparse as sparse
from jaxkv._nd import NDArray as NDArray
from jaxkv._nd import arange as arange
from jaxkv._nd import array as array
from jaxkv._nd import empty as empty
from jaxkv._nd import full as full
from jaxkv._nd import ones as ones
from jaxkv._nd import waitall as waitall
from jaxkv._nd import zeros as zeros

sys.modules[__name__ + ".sparse"] = sparse

__all__ = [
    "NDArray",
    "arange",
    "array",
    "empty",
    "full",
    "ones",
    "sparse",
    "waitall",
    "zeros",
]
