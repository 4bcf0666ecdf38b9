"""Timing and peak memory of the variants over a grid of sequence lengths and head sizes."""

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tfmath.analysis.complexity.counts import LOCAL_WINDOW, sparse_arguments
from tfmath.analysis.timing import CLOCKS, measure_peak_bytes, repeat_times
from tfmath.attention import scaled_dot_product_attention
from tfmath.efficient import linear_attention, sparse_attention
from tfmath.errors import ArgumentError
from tfmath.rnn import elman_rnn


@dataclass(frozen=True)
class Measurement:
    """Time and memory of one routine at one grid point.

    Attributes
    ----------
    routine : str
    n, d : int
    seconds : float
        Median of ``times``.
    times : tuple of float
        Time of each repeat on the sweep's clock, in seconds (the warm-up calls excluded).
    peak_bytes : int or None
        :func:`measure_peak_bytes` of one more call, if measured.
    """

    routine: str
    n: int
    d: int
    seconds: float
    times: tuple
    peak_bytes: int | None


def sweep(
    routines,
    lengths,
    dims,
    *,
    repeats=5,
    warmup=1,
    measure_memory=True,
    threads=None,
    clock="wall",
    progress=None,
):
    """Time, and measure the peak memory of, routines over a grid of ``n`` and ``d``.

    Parameters
    ----------
    routines : dict of str to callable
        ``factory(n, d)`` builds the inputs and returns the call to measure
        (a function of no arguments); for the variants, :func:`workload_factories`.
    lengths, dims : sequence of int
        The grid; each routine runs at every ``(n, d)``, lengths in increasing order.
    repeats : int, optional
        Timed calls per point; the median is reported.
    warmup : int, optional
        Untimed calls first (compilation, caches, thread pool start-up).
    measure_memory : bool, optional
        Also run :func:`measure_peak_bytes` once per point.
    threads : int, optional
        Run Numba's parallel kernels on this many threads during the sweep
        (``numba.set_num_threads``; restored afterwards). One thread gives the
        cleanest exponents on a shared machine: a parallel kernel whose second
        thread finds no free core waits for a scheduler time slice
        (milliseconds), which swamps small problems.
    progress : callable, optional
        Called with a line of text after each point.

    Returns
    -------
    list of Measurement
    """
    if repeats < 1 or warmup < 0:
        raise ArgumentError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if clock not in CLOCKS:
        raise ArgumentError(f"clock must be one of {tuple(CLOCKS)}, got {clock!r}")
    import numba

    previous_threads = numba.get_num_threads()
    if threads is not None:
        numba.set_num_threads(threads)
    try:
        return [
            _measure(name, factory, n, d, repeats, warmup, measure_memory, clock, progress)
            for name, factory in routines.items()
            for d in dims
            for n in sorted(lengths)
        ]
    finally:
        numba.set_num_threads(previous_threads)


def _measure(name, factory, n, d, repeats, warmup, measure_memory, clock, progress):
    call = factory(n, d)
    times = repeat_times(call, repeats, warmup=warmup, clock=clock)
    peak = measure_peak_bytes(call) if measure_memory else None
    result = Measurement(name, n, d, float(np.median(times)), tuple(times), peak)
    if progress is not None:
        progress(f"{name} n={n} d={d}: {1e3 * result.seconds:.2f} ms")
    return result


@dataclass(frozen=True)
class Workload:
    """An attention variant (or the RNN) ready to time: its inputs and its call.

    Attributes
    ----------
    name : str
    description : str
    time_order, memory_order : tuple of float
        The exponents :math:`(a, b)` theory predicts for :math:`n^a d^b`.
    make : callable
        ``make(n, d, heads, dtype, backend, rng)`` returns the call.
    """

    name: str
    description: str
    time_order: tuple
    memory_order: tuple
    make: Callable = field(repr=False)


def _qkv(n, d, heads, dtype, rng):
    return [rng.standard_normal((1, heads, n, d)).astype(dtype) for _ in range(3)]


def _make_exact(method):
    def make(n, d, heads, dtype, backend, rng):
        query, key, value = _qkv(n, d, heads, dtype, rng)
        weights = method == "naive"
        return lambda: scaled_dot_product_attention(
            query, key, value, method=method, return_weights=weights, backend=backend
        )

    return make


def _make_linear(n, d, heads, dtype, backend, rng):
    query, key, value = _qkv(n, d, heads, dtype, rng)
    return lambda: linear_attention(query, key, value, backend=backend)


def _make_sparse(pattern):
    def make(n, d, heads, dtype, backend, rng):
        query, key, value = _qkv(n, d, heads, dtype, rng)
        arguments = sparse_arguments(pattern, n, None, None)
        return lambda: sparse_attention(
            query, key, value, pattern=pattern, backend=backend, **arguments
        )

    return make


def _make_rnn(n, d, heads, dtype, backend, rng):
    inputs = rng.standard_normal((heads, n, d)).astype(dtype)
    w_xh, w_hh = (rng.standard_normal((d, d)).astype(dtype) / np.sqrt(d) for _ in range(2))
    return lambda: elman_rnn(inputs, w_xh, w_hh, backend=backend)


#: The variants :func:`sweep` measures, by name.
WORKLOADS = {
    w.name: w
    for w in (
        Workload(
            "naive",
            "exact attention forming the n x n weights (method='naive', return_weights=True)",
            (2, 1),
            (2, 0),
            _make_exact("naive"),
        ),
        Workload(
            "flash",
            "exact attention in tiles (method='flash')",
            (2, 1),
            (1, 1),
            _make_exact("flash"),
        ),
        Workload("linear", "linear attention, elu+1 features", (1, 2), (1, 1), _make_linear),
        Workload(
            "local", f"sliding window w = {LOCAL_WINDOW}", (1, 1), (1, 1), _make_sparse("local")
        ),
        Workload(
            "local+strided",
            "window = stride = ceil(sqrt(n)) (Child et al.)",
            (1.5, 1),
            (1, 1),
            _make_sparse("local+strided"),
        ),
        Workload(
            "rnn", "Elman RNN, d_h = d_x = d, one sequence per head", (1, 2), (1, 1), _make_rnn
        ),
    )
}


def workload_factories(names, *, heads=2, dtype=np.float32, backend="cpu", seed=0):
    """``{name: factory(n, d)}`` for :func:`sweep`, from the :data:`WORKLOADS` named.

    Inputs have shape ``(1, heads, n, d)``; each grid point draws its own from
    a generator seeded with ``(seed, n, d)``, so runs are reproducible.
    """
    factories = {}
    for name in names:
        if name not in WORKLOADS:
            raise ArgumentError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")

        def factory(n, d, workload=WORKLOADS[name]):
            rng = np.random.default_rng([seed, n, d])
            return workload.make(n, d, heads, np.dtype(dtype), backend, rng)

        factories[name] = factory
    return factories


def cpu_count():
    """Cores this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
