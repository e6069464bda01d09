"""MXNet-style NDArrays: ``jaxkv.nd.ones((2, 3), jaxkv.cpu(1))`` and friends."""

from ._nd import NDArray as NDArray
from ._nd import array as array
from ._nd import empty as empty
from ._nd import full as full
from ._nd import ones as ones
from ._nd import waitall as waitall
from ._nd import zeros as zeros

__all__ = ["NDArray", "array", "empty", "full", "ones", "waitall", "zeros"]
