"""Just-in-time compilation settings shared by every tfmath kernel.

This is the only place that chooses how kernels are compiled, so that a change
of policy (a fast-math flag, caching, the threading layer) is one edit.

Environment variables read once, at the first kernel compilation:

``TFMATH_CACHE``
    ``0`` disables Numba's on-disk cache of compiled CPU kernels (default ``1``).
``TFMATH_THREADING_LAYER``
    Numba threading layer for the parallel CPU kernels: ``default`` (Numba's own
    choice among tbb, omp and workqueue), ``tbb``, ``omp`` or ``workqueue``.
"""

import functools
import os

#: LLVM fast-math flags for CPU kernels. ``nnan`` and ``ninf`` are left out on
#: purpose: masks are written as ``-inf`` and NaN inputs must propagate, and
#: both flags would let LLVM assume neither ever occurs.
FASTMATH_FLAGS = frozenset({"nsz", "arcp", "contract", "afn", "reassoc"})

_THREADING_LAYERS = ("default", "tbb", "omp", "workqueue")


def cache_enabled():
    """Whether compiled CPU kernels are cached on disk (``TFMATH_CACHE``)."""
    return os.environ.get("TFMATH_CACHE", "1") != "0"


def requested_threading_layer():
    """The threading layer asked for through ``TFMATH_THREADING_LAYER``."""
    layer = os.environ.get("TFMATH_THREADING_LAYER", "default")
    if layer not in _THREADING_LAYERS:
        raise ValueError(
            f"TFMATH_THREADING_LAYER must be one of {_THREADING_LAYERS}, got {layer!r}"
        )
    return layer


@functools.cache
def _configure_numba():
    import numba

    layer = requested_threading_layer()
    if layer != "default":
        numba.config.THREADING_LAYER = layer
    return numba


def cpu_kernel(function=None, *, parallel=False):
    """Compile ``function`` as a tfmath CPU kernel (``numba.njit`` with tfmath's options).

    Used bare (``@cpu_kernel``) for serial kernels and helpers, or as
    ``@cpu_kernel(parallel=True)`` for kernels with a ``prange`` loop.
    Compilation is lazy: it happens on the first call for each signature.
    """
    numba = _configure_numba()

    def decorate(func):
        return numba.njit(
            cache=cache_enabled(),
            fastmath=set(FASTMATH_FLAGS),
            parallel=parallel,
            nogil=True,
            error_model="numpy",
        )(func)

    return decorate if function is None else decorate(function)


@functools.cache
def _blas_controller():
    import scipy.linalg.cython_blas  # noqa: F401  (loads the BLAS that Numba's np.dot calls)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def serial_blas():
    """A context in which BLAS runs on the calling thread only.

    Parallel kernels that multiply tiles with ``np.dot`` already keep every
    core busy; if BLAS started its own threads inside them, the cores would be
    oversubscribed many times over, and OpenBLAS would print a warning per call
    under Numba's OpenMP threading layer.
    """
    return _blas_controller().limit(limits=1, user_api="blas")


def threading_layer():
    """The threading layer the parallel CPU kernels run on.

    Numba only settles on a layer when a parallel kernel first runs, so this
    runs a tiny one if none has run yet.
    """
    numba = _configure_numba()
    try:
        return numba.threading_layer()
    except ValueError:
        from tfmath.kernels.cpu.probe import touch_thread_pool

        touch_thread_pool()
        return numba.threading_layer()
