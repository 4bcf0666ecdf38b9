"""Just-in-time compilation settings shared by every tfmath CPU kernel.

This is the only place that chooses how kernels are compiled, so that a change
of policy (a fast-math flag, the threading layer, when a kernel runs serially)
is one edit. Where compiled code is cached is :mod:`tfmath._kernel_cache`'s
concern.

Environment variable, read once, at the first kernel compilation:

``TFMATH_THREADING_LAYER``
    Numba threading layer for the parallel CPU kernels: ``default`` (Numba's own
    choice among tbb, omp and workqueue), ``tbb``, ``omp`` or ``workqueue``.
"""

import functools
import importlib
import os

from tfmath._kernel_cache import attach_kernel_cache

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
#: The Numba module each layer loads.
_LAYER_MODULES = {
    "tbb": "numba.np.ufunc.tbbpool",
    "omp": "numba.np.ufunc.omppool",
    "workqueue": "numba.np.ufunc.workqueue",
}


#: Work (elements, or score-feature products, as each kernel counts it) below which
#: :func:`sized` picks a parallel kernel's serial twin: waking Numba's thread pool
#: and sharing out the loop costs about what one core needs for this much work
#: (see docs/benchmarks.rst, "Measurements behind constants"; ``tfmath bench
#: attention --small`` times the small calls).
PARALLEL_MIN_WORK = 2**15


def requested_threading_layer():
    """The threading layer asked for through ``TFMATH_THREADING_LAYER``."""
    layer = os.environ.get("TFMATH_THREADING_LAYER", "default")
    if layer not in _THREADING_LAYERS:
        raise ValueError(
            f"TFMATH_THREADING_LAYER must be one of {_THREADING_LAYERS}, got {layer!r}"
        )
    if layer != "default":
        # Checked here, before any work: Numba would fail only at the first parallel
        # kernel, partway through a report or a benchmark.
        try:
            importlib.import_module(_LAYER_MODULES[layer])
        except ImportError as error:
            raise ValueError(
                f"TFMATH_THREADING_LAYER={layer}, which Numba cannot load here ({error}): "
                "unset it, or install what it needs (tbb: pip install tbb)"
            ) from None
    return layer


@functools.cache
def _configure_numba():
    import numba

    layer = requested_threading_layer()
    if layer != "default":
        numba.config.THREADING_LAYER = layer
    return numba


def cpu_kernel(
    function=None, *, parallel=False, inline=False, signatures=None, cached=True, reassociate=True
):
    """Compile ``function`` as a tfmath CPU kernel (``numba.njit`` with tfmath's options).

    Used bare (``@cpu_kernel``) for serial kernels and helpers, or as
    ``@cpu_kernel(parallel=True)`` for kernels with a ``prange`` loop; such a
    kernel also carries ``.serial``, the same function compiled without
    threads (``prange`` runs as ``range``), for problems too small to share out
    (see :func:`sized`). Compilation is lazy: it happens on the first call for
    each signature.

    ``@cpu_kernel(inline=True)`` is for a helper with a reduction that kernels of
    several modules share: Numba pastes its body into each caller before
    compiling it (``inline="always"``). Called as an ordinary function instead,
    LLVM inlines it into a freshly compiled caller but links the machine code of a
    callee loaded from the kernel cache, and vectorises the two reductions in
    different orders: the bits of a result would depend on what was cached.

    ``signatures`` (a list of Numba signatures) compiles the kernel for those
    signatures only, at once, from the kernel cache where it holds them, and no
    other: the form for a kernel that takes a function among its arguments, which
    Numba types by its signature (a first-class function, called through its
    address) only where the kernel's signature says so. Typed as the function
    itself, each function passed would compile the kernel again, and code so
    compiled cannot be cached. A parallel kernel compiled this way has no serial twin.

    ``cached=False`` keeps a function out of the kernel cache: one made in a
    process around a user's function (a closure), whose machine code depends on
    what the closure holds, which the cache's key does not cover.

    ``reassociate=False`` compiles without ``reassoc``, for a kernel whose order of
    operations is its point: with it, LLVM turns a log-softmax's
    ``(x - m) - log_sum``, per element, into ``x - (m + log_sum)``, hoisting the sum
    out of the loop and rounding ``log_sum`` to the precision of a large maximum
    ``m`` (at logits of 1e38 the result lost log 2 altogether). The flags are per
    instruction, so helpers it calls keep their own.
    """
    numba = _configure_numba()
    flags = set(FASTMATH_FLAGS) if reassociate else set(FASTMATH_FLAGS) - {"reassoc"}

    def compile_(func, parallel, variant):
        dispatcher = numba.njit(
            fastmath=flags,
            parallel=parallel,
            nogil=True,
            error_model="numpy",
            inline="always" if inline else "never",
        )(func)
        if cached:
            attach_kernel_cache(dispatcher, variant)
        return dispatcher

    def decorate(func):
        dispatcher = compile_(func, parallel, "")
        if signatures is not None:
            for signature in signatures:
                dispatcher.compile(signature)
            dispatcher.disable_compile()
            return dispatcher
        if parallel:
            dispatcher.serial = compile_(func, False, "serial")
        return dispatcher

    return decorate if function is None else decorate(function)


@functools.cache
def target_has_bfloat16_dot():
    """Whether the CPU kernels are compiled for a CPU with AVX512_BF16 (``vdpbf16ps``):
    the features Numba compiles for, ``NUMBA_CPU_FEATURES`` when set, else the host's.
    Kernels that use the instruction compile only then
    (:mod:`tfmath.kernels.cpu.bfloat16_dot`), and :mod:`tfmath._dispatch` sends
    bfloat16 products to them only then."""
    from numba.core import codegen, config

    features = config.CPU_FEATURES
    if features is None:
        features = codegen.get_host_cpu_features()
    return "+avx512bf16" in features.split(",")


def sized(kernel, work):
    """``kernel``, or its serial twin when ``work`` is below :data:`PARALLEL_MIN_WORK`."""
    return kernel if work >= PARALLEL_MIN_WORK else kernel.serial


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
