"""How many threads BLAS runs on, set around the calls that need it.

Numba's ``np.dot`` and :func:`tfmath.kernels.cpu.blas.gemm` call the BLAS that
SciPy loads; its thread count is process-wide. :func:`serial_blas` holds it to
one thread inside parallel kernels (which already keep every core busy), and
:func:`blas_threads` caps it for a block of work. The libraries are found once,
through threadpoolctl; an OpenBLAS on its own threads is then set through its
own functions, called through ctypes (:func:`_thread_controls` says why).
"""

import contextlib
import functools


@functools.cache
def blas_controller():
    """threadpoolctl's controller of the loaded libraries, SciPy's BLAS (the one Numba's
    ``np.dot`` calls) loaded first; made once per process."""
    import scipy.linalg.cython_blas  # noqa: F401  (loads the BLAS that Numba's np.dot calls)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


@functools.cache
def _blas_libraries():
    """threadpoolctl's controller of each BLAS library loaded, found once per process."""
    return tuple(blas_controller().select(user_api="blas").lib_controllers)


@contextlib.contextmanager
def blas_threads(count):
    """A context in which BLAS runs on at most ``count`` threads (restored on exit)."""
    libraries = _blas_libraries()
    previous = [library.get_num_threads() for library in libraries]
    for library in libraries:
        library.set_num_threads(count)
    try:
        yield
    finally:
        for library, threads in zip(libraries, previous, strict=True):
            library.set_num_threads(threads)


#: The names OpenBLAS builds give ``openblas_{get,set}_num_threads``: SciPy's and
#: NumPy's wheels prefix ``scipy_``, 64-bit-integer builds append ``64_`` or ``_64``.
_OPENBLAS_AFFIXES = [(p, s) for p in ("", "scipy_") for s in ("", "64_", "_64")]


def _openblas_thread_functions(library):
    """``(get, set)``: OpenBLAS's own thread-count functions, called through ctypes,
    for an OpenBLAS on its own threads (pthreads); None for any other library."""
    if (
        getattr(library, "internal_api", None) != "openblas"
        or getattr(library, "threading_layer", None) != "pthreads"
    ):
        return None
    import ctypes

    dynlib = ctypes.CDLL(library.filepath)  # the loaded library, not a second copy
    for prefix, suffix in _OPENBLAS_AFFIXES:
        get = getattr(dynlib, f"{prefix}openblas_get_num_threads{suffix}", None)
        set_ = getattr(dynlib, f"{prefix}openblas_set_num_threads{suffix}", None)
        if get is not None and set_ is not None:
            set_.restype = None
            return get, set_
    return None


@functools.cache
def _thread_controls(libraries):
    """``(get, set)`` of the thread count of each of ``libraries``: OpenBLAS's own
    functions where :func:`_openblas_thread_functions` finds them, threadpoolctl's
    methods otherwise. threadpoolctl's wrappers (a lock, a check of which Python
    thread sets limits) cost about five times the call itself, and a training step
    enters :func:`serial_blas` at every attention call, forward and backward."""
    return tuple(
        _openblas_thread_functions(library) or (library.get_num_threads, library.set_num_threads)
        for library in libraries
    )


class _SerialBlas:
    """The context :func:`serial_blas` returns, a class rather than a generator: it is
    entered and left in a fraction of a generator-based context manager's time, most
    of all inside a drop-in's training step, where the model's other work has evicted
    this code from the caches (docs/benchmarks.rst, "Measurements behind constants")."""

    __slots__ = ("_changed",)

    def __enter__(self):
        changed = []
        for get, set_ in _thread_controls(_blas_libraries()):
            threads = get()
            if threads != 1:
                # Already serial (OMP_NUM_THREADS=1, or one core): left alone.
                set_(1)
                changed.append((set_, threads))
        self._changed = changed

    def __exit__(self, *exception):
        for set_, threads in self._changed:
            set_(threads)


def serial_blas():
    """A context in which BLAS runs on the calling thread only.

    Parallel kernels that multiply tiles with BLAS (``np.dot``, or
    :func:`tfmath.kernels.cpu.blas.gemm`) already keep every core busy; if
    BLAS started its own threads inside them, the cores would be oversubscribed
    many times over, and OpenBLAS would print a warning per call under Numba's
    OpenMP threading layer. The libraries are found once; entering and leaving
    the context costs a few calls into each (threadpoolctl's ``limit`` would
    inspect every loaded library again on every call).
    """
    return _SerialBlas()
