"""Timing and memory measurement shared by ``tfmath bench``, the analysis sweeps and asv.

- :func:`best_time` and :func:`interleaved_best_times`: best wall time of a
  call, or of several contenders timed in alternating rounds, after a pause
  that lets the previous library's worker threads go to sleep.
- :func:`repeat_times`: every repeat's time after warm-up calls, on a chosen clock.
- :func:`measure_peak_bytes`: the memory a call adds at its peak, read in-process.
"""

import ctypes
import gc
import math
import time
import tracemalloc

#: The clocks :func:`repeat_times` can read: wall time, or this process's CPU time.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def repeat_times(call, repeats, *, warmup=1, clock="wall"):
    """Seconds of each of ``repeats`` calls, after ``warmup`` untimed ones (compilation,
    caches, thread-pool start-up), on the clock named (see :data:`CLOCKS`)."""
    read = CLOCKS[clock]
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start = read()
        call()
        times.append(read() - start)
    return times


def _timed(call):
    return repeat_times(call, 1, warmup=0)[0]


#: Seconds to wait before timing a contender (see :func:`best_time`).
SETTLE_SECONDS = 0.3


def best_time(call, repeats):
    """Best wall time of ``repeats`` calls after a pause and one warm-up call.

    Worker threads of the previous contender's library (OpenBLAS, PyTorch's
    OpenMP pool) keep spinning for a while after its last call and would take
    the cores from the next one (docs/benchmarks.rst, "Measurements behind
    constants"). The pause lets them go to sleep first.
    """
    return interleaved_best_times({"call": call}, repeats, rounds=1)["call"]


#: Rounds of :func:`interleaved_best_times`.
ROUNDS = 3


def interleaved_best_times(calls, repeats, rounds=ROUNDS):
    """Best wall time of each call in ``calls`` (a mapping of names to calls), from
    ``rounds`` rounds that time every contender in turn, ``repeats`` calls each.

    Other work on a shared machine comes and goes over seconds. Timed one after
    the other, one contender can catch a busy spell the other misses, and a
    contender's time moves between runs by more than the differences compared
    (see docs/benchmarks.rst, "Measurements behind constants"). Rounds in turn
    give each contender samples from the same stretch of time. Each contender
    gets one untimed warm-up call in the first round, and every timing follows
    the pause of :func:`best_time`.
    """
    best = dict.fromkeys(calls, math.inf)
    for round_index in range(rounds):
        for name, call in calls.items():
            time.sleep(SETTLE_SECONDS)
            if round_index == 0:
                call()
            best[name] = min(best[name], *(_timed(call) for _ in range(repeats)))
    return best


# --- memory ---------------------------------------------------------------------------------


def peak_memory_method():
    r"""How :func:`measure_peak_bytes` measures on this machine: ``"rss"`` or ``"tracemalloc"``.

    ``"rss"`` (Linux): writing ``5`` to ``/proc/self/clear_refs`` resets the
    process's peak resident set size (``VmHWM`` in ``/proc/self/status``) to
    the current one, so the peak *during one call* can be read in-process,
    without a subprocess per measurement. It counts every page the call
    touches, whoever allocated it: NumPy, Numba's runtime, BLAS work buffers,
    thread stacks, ``malloc`` in any C library.

    ``"tracemalloc"`` is the fallback where ``/proc`` cannot be written. It
    counts bytes requested through Python's allocators. That includes NumPy's
    array data and, in current Numba, the arrays a kernel allocates: Numba's
    runtime is switched to ``PyMem_RawMalloc`` when it loads
    (``memsys_use_cpython_allocator`` in ``numba/core/runtime/nrt.py``), a
    domain tracemalloc traces. It misses what C code allocates with plain
    ``malloc`` or ``mmap`` (OpenBLAS's buffers, thread stacks), and counts
    requested rather than touched bytes.
    """
    return "rss" if _can_reset_peak_rss() else "tracemalloc"


def _can_reset_peak_rss():
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return _status_kib("VmHWM") is not None
    except OSError:
        return False


def _status_kib(field_name):
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _release_free_memory():
    """Collect garbage and hand freed heap pages back to the OS (glibc's malloc_trim),
    so a call's allocations show up as new resident pages instead of reusing old ones."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure_peak_bytes(call, method=None):
    """Bytes of memory a call adds at its peak, above what was resident before it.

    Parameters
    ----------
    call : callable
        Called once, without arguments; its inputs should already exist (they
        are part of the baseline), and its result is discarded after the peak
        is read (the output is part of the peak).
    method : {"rss", "tracemalloc"}, optional
        Default :func:`peak_memory_method`.

    Returns
    -------
    int
        Peak resident bytes during the call minus resident bytes before it
        (page granularity: a few KiB of noise; allocator caching can hide
        up to a few MiB for small calls, so compare sizes well above that).
    """
    method = peak_memory_method() if method is None else method
    _release_free_memory()
    if method == "tracemalloc":
        tracemalloc.start()
        try:
            baseline = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            call()
            return max(tracemalloc.get_traced_memory()[1] - baseline, 0)
        finally:
            tracemalloc.stop()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    baseline = _status_kib("VmRSS")
    call()
    peak = _status_kib("VmHWM")
    return max(peak - baseline, 0) * 1024
