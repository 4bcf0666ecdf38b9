"""Just-in-time compilation settings shared by every tfmath kernel.

This is the only place that chooses how kernels are compiled, so that a change
of policy (a fast-math flag, caching, the threading layer) is one edit.

Environment variables read once, at the first kernel compilation:

``TFMATH_CACHE``
    ``0`` disables Numba's on-disk cache of compiled CPU kernels (default ``1``).
    A cached kernel is reused only while every file under ``tfmath/kernels``
    (and this module) is unchanged.
``TFMATH_THREADING_LAYER``
    Numba threading layer for the parallel CPU kernels: ``default`` (Numba's own
    choice among tbb, omp and workqueue), ``tbb``, ``omp`` or ``workqueue``.
"""

import functools
import hashlib
import os
from pathlib import Path

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
    _stamp_kernel_caches_with_all_kernel_sources()
    return numba


#: Every function Numba compiles for tfmath lives under this folder.
KERNELS_FOLDER = Path(__file__).parent / "kernels"


def kernel_sources_digest(folder=KERNELS_FOLDER):
    """SHA-256 of every ``.py`` file under ``folder`` and of this module, in a fixed order."""
    digest = hashlib.sha256()
    for path in [*sorted(folder.rglob("*.py")), Path(__file__)]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _stamp_kernel_caches_with_all_kernel_sources():
    """Make Numba's on-disk cache of a tfmath kernel depend on every kernel file.

    Numba stamps a cached function with its own source file only, but tfmath's
    kernels call kernels in other files (the exponential, the tile helpers):
    after an edit of one of those, callers would load stale machine code from
    the cache. For functions defined under ``tfmath/kernels``, each of Numba's
    own cache locators is given a stamp that covers all of them (and this
    module's compiler options); other functions are left to Numba. This uses
    Numba's internal list of locator classes; if that ever moves, caching
    falls back to Numba's default stamps.
    """
    from numba.core import caching

    # Named CacheImpl since Numba 0.62 and _CacheImpl before.
    implementation = getattr(caching, "CacheImpl", getattr(caching, "_CacheImpl", None))
    if implementation is None or not hasattr(implementation, "_locator_classes"):
        return
    defaults = [c for c in implementation._locator_classes if not getattr(c, "_tfmath", False)]
    stamped = [_kernel_stamped(locator) for locator in defaults]
    implementation._locator_classes = [*stamped, *defaults]


def _kernel_stamped(locator):
    class KernelSourcesLocator(locator):
        _tfmath = True

        @classmethod
        def from_function(cls, py_func, py_file):
            if not Path(py_file).resolve().is_relative_to(KERNELS_FOLDER.resolve()):
                return None
            return super().from_function(py_func, py_file)

        def get_source_stamp(self):
            return _cached_kernel_sources_digest()

    KernelSourcesLocator.__name__ = KernelSourcesLocator.__qualname__ = f"Kernel{locator.__name__}"
    return KernelSourcesLocator


@functools.cache
def _cached_kernel_sources_digest():
    return kernel_sources_digest()


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

    Parallel kernels that multiply tiles with BLAS (``np.dot``, or
    :func:`tfmath.kernels.cpu.blas.gemm`) already keep every core busy; if
    BLAS started its own threads inside them, the cores would be oversubscribed
    many times over, and OpenBLAS would print a warning per call under Numba's
    OpenMP threading layer.
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
