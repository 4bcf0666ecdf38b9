"""tfmath: a Numba-accelerated toolkit for the mathematics of transformers.

Every numerical routine has a CPU kernel (``numba.njit``), a CUDA kernel
(``numba.cuda.jit``) and a NumPy reference, chosen with ``backend=``.
"""

from tfmath._dispatch import BackendInfo, backends
from tfmath._version import __version__
from tfmath.attention import attention_grad, scaled_dot_product_attention, softmax
from tfmath.errors import BackendUnavailableError, DTypeError, ShapeError, TfmathError

__all__ = [
    "BackendInfo",
    "BackendUnavailableError",
    "DTypeError",
    "ShapeError",
    "TfmathError",
    "__version__",
    "attention_grad",
    "backends",
    "scaled_dot_product_attention",
    "softmax",
]
