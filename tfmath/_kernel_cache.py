"""The disk caches: where tfmath keeps what it can recompute, and Numba's cache of
compiled CPU kernels in it.

Environment variables, read once, at the first kernel compilation:

``TFMATH_CACHE``
    ``0`` disables the on-disk cache of compiled CPU kernels (default ``1``).
``TFMATH_CACHE_DIR``
    Where tfmath keeps what it can recompute (compiled kernels, trained sweep
    points); default ``$XDG_CACHE_HOME/tfmath``, else ``~/.cache/tfmath``.
    Without it, ``NUMBA_CACHE_DIR`` (when set) holds the compiled kernels, in
    its ``tfmath`` subfolder.

Compiled kernels are never written beside the installed sources: an install may
be read-only, and files left there outlive ``pip uninstall`` (a later editable
install of the same name then imports the leftover folder as a namespace
package). They go to :func:`kernel_cache`'s folder instead, one subfolder per
version of the kernel sources. :func:`tfmath._jit.cpu_kernel` attaches the cache
to each kernel it compiles (:func:`attach_kernel_cache`).
"""

import functools
import hashlib
import logging
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

_log = logging.getLogger("tfmath")

#: Every function Numba compiles for tfmath lives under this folder.
KERNELS_FOLDER = Path(__file__).parent / "kernels"

#: The modules that decide how kernels compile and how their code is cached: the
#: compiler options (:mod:`tfmath._jit`) and this module. A change to either makes
#: cached code stale, so both are part of the cache's key with the kernel sources.
COMPILATION_MODULES = (Path(__file__).with_name("_jit.py"), Path(__file__))


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
    """SHA-256 of every ``.py`` file under ``folder`` and of :data:`COMPILATION_MODULES`,
    in a fixed order."""
    digest = hashlib.sha256()
    for path in [*sorted(folder.rglob("*.py")), *COMPILATION_MODULES]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def kernel_cache_folder(digest):
    """The folder of compiled kernels for kernel sources with SHA-256 ``digest``.

    Keyed by the sources, not by the version number or the install location:
    two checkouts or versions share compiled code exactly when their kernel
    sources (and the compiler options and cache format of
    :data:`COMPILATION_MODULES`) are identical, so neither can
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
    try:
        folder = kernel_cache_folder(_cached_kernel_sources_digest())
    except RuntimeError as error:  # Path.home(): no home folder to be found
        return KernelCache(None, f"{error}; set TFMATH_CACHE_DIR to a writable folder")
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
    (see :func:`tfmath._jit.cpu_kernel`): Numba keys a cached entry by the function's name,
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
            try:
                super().save(key, (_KEY_CHECKED_ENTRY, key, data))
            except OSError as error:
                # A full disk or quota: the kernel was compiled, and runs; it is only not
                # kept (an empty file, the writability check, fits where its code does not).
                _warn_once(
                    f"tfmath could not write a compiled kernel to its cache in "
                    f"{self._cache_path} ({error.strerror or error}); kernels compile "
                    "again in every process until it can (set TFMATH_CACHE_DIR to another "
                    "folder, or TFMATH_CACHE=0)"
                )

        def _load_index(self):
            try:
                return super()._load_index()
            except Exception:  # a truncated or garbled index: as if empty, and rewritten
                return {}

        def load(self, key):
            try:
                entry = super().load(key)
            except Exception:  # a truncated or garbled data file: compile again
                return None
            if isinstance(entry, tuple) and len(entry) == 3 and entry[0] == _KEY_CHECKED_ENTRY:
                _, saved_key, data = entry
                if saved_key == key:
                    return data
            return None

    return KeyCheckedCacheFile


@functools.cache
def _warn_once(message):
    warnings.warn(message, RuntimeWarning, stacklevel=2)


#: Marks a data file of the kernel cache as holding its key (:func:`_key_checked_cache_file_class`).
_KEY_CHECKED_ENTRY = "tfmath kernel cache entry, keyed"


def attach_kernel_cache(dispatcher, variant=""):
    """Cache a kernel's compiled code in the kernel cache, if it is on and writable.

    Functions compiled with :func:`tfmath._jit.cpu_kernel` outside ``tfmath/kernels`` (in
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
