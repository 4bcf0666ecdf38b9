"""Just-in-time compilation settings shared by every tfmath kernel.

This is the only place that chooses how kernels are compiled, so that a change
of policy (a fast-math flag, caching, the threading layer) is one edit.

Environment variables read once, at the first kernel compilation:

``TFMATH_CACHE``
    ``0`` disables the on-disk cache of compiled CPU kernels (default ``1``).
``TFMATH_CACHE_DIR``
    Where tfmath keeps what it can recompute (compiled kernels, trained sweep
    points); default ``$XDG_CACHE_HOME/tfmath``, else ``~/.cache/tfmath``.
    Without it, ``NUMBA_CACHE_DIR`` (when set) holds the compiled kernels, in
    its ``tfmath`` subfolder.
``TFMATH_THREADING_LAYER``
    Numba threading layer for the parallel CPU kernels: ``default`` (Numba's own
    choice among tbb, omp and workqueue), ``tbb``, ``omp`` or ``workqueue``.
``TFMATH_CUDA_TENSOR_CORES``
    ``1`` runs half-precision flash attention forwards on the GPU's tensor
    cores (read at each call; default ``0``: widened to float32). Opt-in until
    a GPU has measured it; see :func:`cuda_tensor_cores`.

Compiled kernels are never written beside the installed sources: an install may
be read-only, and files left there outlive ``pip uninstall`` (a later editable
install of the same name then imports the leftover folder as a namespace
package). They go to :func:`kernel_cache`'s folder instead, one subfolder per
version of the kernel sources.
"""

import contextlib
import functools
import hashlib
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

#: LLVM fast-math flags for CPU kernels. ``nnan`` and ``ninf`` are left out on
#: purpose: masks are written as ``-inf`` and NaN inputs must propagate, and
#: both flags would let LLVM assume neither ever occurs. ``arcp`` (a division
#: may become a multiplication by a reciprocal) is left out too: with
#: ``reassoc`` it let a kernel compiled in the process and the same kernel loaded
#: from the kernel cache round differently (the fused step's cross-entropy
#: gradient, in its last bits), so that a training run's result depended on
#: whether it was the first on the machine. The kernels divide once and multiply
#: by the reciprocal where that is the intent.
FASTMATH_FLAGS = frozenset({"nsz", "contract", "afn", "reassoc"})

_THREADING_LAYERS = ("default", "tbb", "omp", "workqueue")

_log = logging.getLogger("tfmath")

#: Every function Numba compiles for tfmath lives under this folder.
KERNELS_FOLDER = Path(__file__).parent / "kernels"


def cache_dir():
    """Where tfmath keeps results it can recompute, between runs and processes.

    ``$TFMATH_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/tfmath``, else
    ``~/.cache/tfmath`` (``%LOCALAPPDATA%\\tfmath`` on Windows). Nothing is
    created here; deleting the folder only costs recomputation.
    """
    if os.environ.get("TFMATH_CACHE_DIR"):
        return Path(os.environ["TFMATH_CACHE_DIR"]).expanduser()
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "tfmath"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "tfmath"


def kernel_sources_digest(folder=KERNELS_FOLDER):
    """SHA-256 of every ``.py`` file under ``folder`` and of this module, in a fixed order."""
    digest = hashlib.sha256()
    for path in [*sorted(folder.rglob("*.py")), Path(__file__)]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def kernel_cache_folder(digest):
    """The folder of compiled kernels for kernel sources with SHA-256 ``digest``.

    Keyed by the sources, not by the version number or the install location:
    two checkouts or versions share compiled code exactly when their kernel
    sources (and this module's compiler options) are identical, so neither can
    load the other's stale code. Numba's own index adds the Numba version, the
    Python version and the CPU to the key of each entry.
    """
    if not os.environ.get("TFMATH_CACHE_DIR") and os.environ.get("NUMBA_CACHE_DIR"):
        root = Path(os.environ["NUMBA_CACHE_DIR"]).expanduser() / "tfmath"
    else:
        root = cache_dir() / "kernels"
    return root / digest[:16]


@dataclass(frozen=True)
class KernelCache:
    """Where compiled CPU kernels are cached, or why they are not.

    Attributes
    ----------
    folder : pathlib.Path or None
        The writable folder of this version's compiled kernels; None when off.
    reason : str
        Why the cache is off (empty when it is on).
    """

    folder: Path | None
    reason: str = ""

    @property
    def enabled(self):
        return self.folder is not None

    def describe(self):
        """One line for ``tfmath info``."""
        return f"on, in {self.folder}" if self.enabled else f"off ({self.reason})"


@functools.cache
def kernel_cache():
    """The kernel cache of this process: decided once, at the first kernel compilation."""
    if os.environ.get("TFMATH_CACHE", "1") == "0":
        return KernelCache(None, "TFMATH_CACHE=0")
    folder = kernel_cache_folder(_cached_kernel_sources_digest())
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as error:
        return KernelCache(
            None,
            f"cannot write to {folder}: {error.strerror or error}; "
            "set TFMATH_CACHE_DIR to a writable folder",
        )
    return KernelCache(folder)


def compilation_notice(cache=None):
    """A line saying that kernels compile now, or None when the kernel cache holds them.

    The first call of a routine compiles its kernels (about 10 s for attention,
    on two cores); with a warm cache it loads them in under a second. The
    cache is cold when its folder holds no compiled kernel yet (no Numba index
    file), as after an install or an edit of the kernel sources.
    """
    cache = kernel_cache() if cache is None else cache
    if not cache.enabled:
        return (
            "compiling kernels (first call, about 10 s; the kernel cache is off, "
            f"{cache.reason}, so every new process compiles again)"
        )
    if any(cache.folder.rglob("*.nbi")):
        return None
    return f"compiling kernels (first call, about 10 s; cached in {cache.folder})"


def cache_enabled():
    """Whether compiled CPU kernels are cached on disk (see :func:`kernel_cache`)."""
    return kernel_cache().enabled


def cuda_tensor_cores():
    """Whether ``TFMATH_CUDA_TENSOR_CORES=1`` asks for the tensor-core flash forward
    (:mod:`tfmath.kernels.cuda.tensor_core`) for float16 and bfloat16 on a real GPU."""
    return os.environ.get("TFMATH_CUDA_TENSOR_CORES", "0") == "1"


def cuda_max_registers():
    """The cap on registers per thread that ``TFMATH_CUDA_MAX_REGISTERS`` sets for the
    float32/float64 CUDA flash kernels, or None (unset or empty: the compiler's choice).

    Read when a kernel is first compiled. On an H200, 128 made the float32 forward at
    d = 64 1.12 to 1.15 times as fast (occupancy 25 % instead of 12 %, no spills); 72
    and 64 spilled and were slower (docs/flash_attention.rst, "On a GPU").
    """
    value = os.environ.get("TFMATH_CUDA_MAX_REGISTERS", "").strip()
    if not value:
        return None
    registers = int(value) if value.isdigit() else 0
    if not 1 <= registers <= 255:
        raise ValueError(
            f"TFMATH_CUDA_MAX_REGISTERS must be an integer from 1 to 255, got {value!r}"
        )
    return registers


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


@functools.cache
def _log_compilation_notice():
    """Log :func:`compilation_notice` (at INFO, on the ``tfmath`` logger) once per process."""
    notice = compilation_notice()
    if notice is not None:
        _log.info("tfmath: %s", notice)


@functools.cache
def _cached_kernel_sources_digest():
    return kernel_sources_digest()


@functools.cache
def _kernel_function_cache_class(variant):
    """Numba's function cache, located in :func:`kernel_cache`'s folder.

    ``variant`` names a subfolder for the serial twin of a parallel kernel
    (see :func:`cpu_kernel`): Numba keys a cached entry by the function's name,
    line and signature, not by its compiler flags, so the two must not share files.

    Numba would write next to the source file (``__pycache__``), and it stamps
    a cached function with its own file only; tfmath's kernels call kernels in
    other files (the exponential, the tile helpers), so after an edit of one of
    those, callers would load stale machine code. This cache is attached to
    tfmath's kernels only, so a user's own ``cache=True`` functions keep
    Numba's defaults. It relies on Numba's cache classes (stable since 0.49).
    """
    from numba.core import caching

    _log_compilation_notice()
    KeyCheckedCacheFile = _key_checked_cache_file_class()

    class KernelCacheLocator(caching._CacheLocator):
        def __init__(self, py_func, py_file):
            self._lineno = py_func.__code__.co_firstlineno
            self._py_file = py_file  # Numba's warning that code cannot be cached names it
            subfolder = Path(py_file).resolve().parent.relative_to(KERNELS_FOLDER.resolve())
            self._cache_path = str(kernel_cache().folder / subfolder / variant)

        def get_cache_path(self):
            return self._cache_path

        def get_source_stamp(self):
            return _cached_kernel_sources_digest()

        def get_disambiguator(self):
            return str(self._lineno)

        @classmethod
        def from_function(cls, py_func, py_file):
            locator = cls(py_func, py_file)
            locator.ensure_cache_path()
            return locator

    class KernelCacheImpl(caching.CompileResultCacheImpl):
        _locator_classes = (KernelCacheLocator,)

    class KernelFunctionCache(caching.FunctionCache):
        _impl_class = KernelCacheImpl

        def __init__(self, py_func):
            super().__init__(py_func)
            self._cache_file = KeyCheckedCacheFile(
                cache_path=self._cache_path,
                filename_base=self._impl.filename_base,
                source_stamp=self._impl.locator.get_source_stamp(),
            )

    return KernelFunctionCache


@functools.cache
def _key_checked_cache_file_class():
    from numba.core import caching

    class KeyCheckedCacheFile(caching.IndexDataCacheFile):
        """Numba's index and data files, each data file also holding the key it was
        saved under; an entry whose data file holds another key is not loaded (the
        kernel is compiled again).

        Numba names a new entry's data file by the entries its index lists when it
        saves, so two processes compiling two signatures of one kernel at once
        (pytest's workers, a sweep's) can each take the same name: the index then
        lists one signature against the other's machine code, which a later process
        loads and calls with the wrong argument types ("can't unbox array", seen
        with two test workers compiling a product for float32 and float64).
        """

        def save(self, key, data):
            super().save(key, (_KEY_CHECKED_ENTRY, key, data))

        def load(self, key):
            entry = super().load(key)
            if isinstance(entry, tuple) and len(entry) == 3 and entry[0] == _KEY_CHECKED_ENTRY:
                _, saved_key, data = entry
                if saved_key == key:
                    return data
            return None

    return KeyCheckedCacheFile


#: Marks a data file of the kernel cache as holding its key (:func:`_key_checked_cache_file_class`).
_KEY_CHECKED_ENTRY = "tfmath kernel cache entry, keyed"


def _attach_kernel_cache(dispatcher, variant=""):
    """Cache a kernel's compiled code in the kernel cache, if it is on and writable.

    Functions compiled with :func:`cpu_kernel` outside ``tfmath/kernels`` (in
    tests, say) are not cached: the cache's key covers that folder only.
    """
    source = Path(dispatcher.py_func.__code__.co_filename).resolve()
    if not kernel_cache().enabled or not source.is_relative_to(KERNELS_FOLDER.resolve()):
        return
    try:
        # What numba.njit(cache=True) does, with tfmath's cache class.
        dispatcher._cache = _kernel_function_cache_class(variant)(dispatcher.py_func)
    except OSError:
        pass  # the folder went away or became read-only: compile without caching


#: Work (elements, or score-feature products, as each kernel counts it) below which
#: :func:`sized` picks a parallel kernel's serial twin. Waking Numba's thread pool
#: and sharing out the loop costs about 10 us on the 2-core development machine
#: (AMD EPYC, OpenMP layer), about what one core needs for this much work; see
#: ``tfmath bench attention --small``.
PARALLEL_MIN_WORK = 2**15


def cpu_kernel(function=None, *, parallel=False):
    """Compile ``function`` as a tfmath CPU kernel (``numba.njit`` with tfmath's options).

    Used bare (``@cpu_kernel``) for serial kernels and helpers, or as
    ``@cpu_kernel(parallel=True)`` for kernels with a ``prange`` loop; such a
    kernel also carries ``.serial``, the same function compiled without
    threads (``prange`` runs as ``range``), for problems too small to share out
    (see :func:`sized`). Compilation is lazy: it happens on the first call for
    each signature.
    """
    numba = _configure_numba()

    def compile_(func, parallel, variant):
        dispatcher = numba.njit(
            fastmath=set(FASTMATH_FLAGS), parallel=parallel, nogil=True, error_model="numpy"
        )(func)
        _attach_kernel_cache(dispatcher, variant)
        return dispatcher

    def decorate(func):
        dispatcher = compile_(func, parallel, "")
        if parallel:
            dispatcher.serial = compile_(func, False, "serial")
        return dispatcher

    return decorate if function is None else decorate(function)


def sized(kernel, work):
    """``kernel``, or its serial twin when ``work`` is below :data:`PARALLEL_MIN_WORK`."""
    return kernel if work >= PARALLEL_MIN_WORK else kernel.serial


@functools.cache
def _blas_controller():
    import scipy.linalg.cython_blas  # noqa: F401  (loads the BLAS that Numba's np.dot calls)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


@functools.cache
def _blas_libraries():
    """threadpoolctl's controller of each BLAS library loaded, found once per process."""
    return tuple(_blas_controller().select(user_api="blas").lib_controllers)


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
    """The context :func:`serial_blas` returns, a class rather than a generator. With
    OpenBLAS's own functions (:func:`_thread_controls`), entering and leaving it took
    1.3 µs against 4.7 alone, and about 15 against 35 inside a drop-in's training
    step, where the model's other work has evicted this code from the caches."""

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


def threading_layer():
    """The threading layer the parallel CPU kernels run on.

    Numba only settles on a layer when a parallel kernel first runs, so this
    runs a tiny one if none has run yet.
    """
    numba = _configure_numba()
    try:
        return numba.threading_layer()
    except ValueError:
        _run_a_parallel_loop(numba)
        return numba.threading_layer()


def _run_a_parallel_loop(numba):
    import numpy as np

    @numba.njit(parallel=True)
    def fill_with_index(out):
        for i in numba.prange(out.shape[0]):
            out[i] = i

    fill_with_index(np.empty(2, dtype=np.int64))
