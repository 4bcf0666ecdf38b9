r"""Cost of attention and its efficient variants: counted, measured, fitted.

Seed 000 tabulates the cost of self-attention [Seed000]_ — :math:`QK^\top` in
:math:`O(n^2 d)` time and :math:`O(n^2)` space, the softmax in :math:`O(n^2)`,
the product with :math:`V` in :math:`O(n^2 d)` time and :math:`O(nd)` space —
and seed 003 contrasts it with an RNN's :math:`n` sequential steps of
:math:`O(d^2)` each [Seed003]_. This module makes those statements executable:

- **Counts.** :func:`attention_operation_costs` is the seed's table as exact
  FLOP and memory counts; :func:`variant_cost` gives the same for exact
  (naive and flash), linear, sparse attention and the RNN, as functions of
  :math:`n`, :math:`d`, heads and batch; :func:`sequential_depth` counts the
  dependent steps.
- **Approximation error.** :func:`approximation_error` compares a variant's
  output (and its weights, where it has any) with exact attention, on the
  random and structured inputs of :func:`structured_inputs`.
- **Measurement.** :func:`sweep` times any callable over a grid of :math:`n`
  and :math:`d` (warm-up excluded, repeats, medians) and measures its peak
  memory with :func:`measure_peak_bytes`; :data:`WORKLOADS` are the variants
  ready to sweep.
- **Fits.** :func:`fit_scaling` fits :math:`t = c\, n^a d^b` by least squares
  in log-log space with confidence intervals; :func:`crossover` finds the
  length where a variant overtakes exact attention, with a bootstrap interval.

All counts are per call, in floating-point operations (an addition, a
multiplication, an exponential or a comparison each count 1) and in array
elements (multiply by the item size for bytes).
"""

import ctypes
import gc
import math
import os
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tfmath.attention import scaled_dot_product_attention
from tfmath.efficient import (
    default_window,
    linear_attention,
    sparse_attention,
    sparse_attention_mask,
    sparse_pattern,
)
from tfmath.reference.efficient import feature_map as _feature_map
from tfmath.rnn import elman_rnn

__all__ = [
    "INPUT_KINDS",
    "LOCAL_WINDOW",
    "SOFTMAX_FLOPS_PER_SCORE",
    "VARIANTS",
    "WORKLOADS",
    "ApproximationError",
    "Crossover",
    "Measurement",
    "OperationCost",
    "ScalingFit",
    "SequentialDepth",
    "VariantCost",
    "Workload",
    "approximation_error",
    "attention_operation_costs",
    "cpu_count",
    "crossover",
    "fit_scaling",
    "linear_attention_weights",
    "measure_peak_bytes",
    "peak_memory_method",
    "relative_error",
    "sequential_depth",
    "structured_inputs",
    "sweep",
    "variant_cost",
    "workload_factories",
]

#: Operations per score in a stable softmax: the running maximum, the
#: subtraction, the exponential, the sum and the division.
SOFTMAX_FLOPS_PER_SCORE = 5
#: The window of the ``"local"`` variant in the sweeps: :math:`2w - 1 = 255` keys per query.
LOCAL_WINDOW = 128
#: The variants :func:`variant_cost` and :data:`WORKLOADS` know.
VARIANTS = ("naive", "flash", "linear", "local", "strided", "local+strided", "rnn")


# --- counts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class OperationCost:
    """One row of the seed's complexity table, counted exactly.

    Attributes
    ----------
    operation : str
    flops : int
        Floating-point operations.
    memory : int
        Elements of the array the operation produces (what must be held).
    time_order, space_order : str
        The seed's :math:`O(\\cdot)` entries.
    """

    operation: str
    flops: int
    memory: int
    time_order: str
    space_order: str


def attention_operation_costs(n, d, *, heads=1, batch=1):
    r"""Seed 000's complexity table for self-attention of ``n`` tokens, head size ``d``.

    Per head:

    ===============  ===================================  ============
    operation        FLOPs                                memory
    ===============  ===================================  ============
    :math:`QK^\top`  :math:`2n^2 d` (:math:`O(n^2 d)`)    :math:`n^2`
    softmax          :math:`5n^2` (:math:`O(n^2)`)        :math:`n^2`
    :math:`AV`       :math:`2n^2 d` (:math:`O(n^2 d)`)    :math:`nd`
    ===============  ===================================  ============

    (a length-:math:`d` dot product is :math:`d` multiplications and
    :math:`d` additions; the softmax count is :data:`SOFTMAX_FLOPS_PER_SCORE`
    per score), times ``heads * batch``.

    Returns
    -------
    list of OperationCost

    Examples
    --------
    >>> from tfmath.analysis.complexity import attention_operation_costs
    >>> [c.flops for c in attention_operation_costs(4, 2)]
    [64, 80, 64]
    """
    copies = _count("heads", heads) * _count("batch", batch)
    n, d = _count("n", n), _count("d", d)
    return [
        OperationCost("QK^T", copies * 2 * n * n * d, copies * n * n, "O(n^2 d)", "O(n^2)"),
        OperationCost(
            "softmax", copies * SOFTMAX_FLOPS_PER_SCORE * n * n, copies * n * n, "O(n^2)", "O(n^2)"
        ),
        OperationCost("AV", copies * 2 * n * n * d, copies * n * d, "O(n^2 d)", "O(n d)"),
    ]


@dataclass(frozen=True)
class VariantCost:
    """What one call of an attention variant (or the RNN) costs.

    Attributes
    ----------
    variant : str
    flops : int
        Floating-point operations.
    memory : int
        Elements allocated beyond the inputs: the output and the working arrays
        whose size depends on :math:`n` (the :math:`n \\times n` weights for
        ``"naive"``; constant-size tiles are left out).
    pairs : int
        Query-key pairs scored (0 for linear attention and the RNN).
    sequential_steps : int
        Steps that must run one after another along the sequence.
    time_order, memory_order : tuple of float
        The exponents :math:`(a, b)` of :math:`n^a d^b` for large :math:`n`.
    """

    variant: str
    flops: int
    memory: int
    pairs: int
    sequential_steps: int
    time_order: tuple
    memory_order: tuple


def variant_cost(variant, n, d, *, heads=1, batch=1, window=None, stride=None, is_causal=False):
    r"""FLOPs and memory of one call of ``variant`` on ``n`` tokens of head size ``d``.

    With :math:`P` the attended pairs per head (:math:`n^2`, or
    :math:`n(n+1)/2` when causal; the pattern's count for sparse variants),
    every softmax attention costs :math:`P(4d + 5)` FLOPs: :math:`2d` for a
    score, 5 for its softmax, :math:`2d` to add its value. The others:

    ``"linear"`` [Katharopoulos2020]_
        :math:`\phi(K)^\top V` and :math:`\phi(Q) S`: :math:`4 n d^2`, plus
        :math:`4 n d` for the normaliser and its dot products, and :math:`2 n d`
        feature maps: :math:`O(n d^2)` time, :math:`d^2 + nd` memory.
    ``"rnn"`` [Elman1990]_
        Per step :math:`W_{xh} x_t` and :math:`W_{hh} h_{t-1}` (:math:`4d^2`),
        the bias and the :math:`\tanh` (:math:`2d`): :math:`n(4d^2 + 2d)`
        FLOPs in :math:`n` sequential steps, :math:`2nd` memory (projected
        inputs and states).

    Parameters
    ----------
    variant : {"naive", "flash", "linear", "local", "strided", "local+strided", "rnn"}
        ``"naive"`` is exact attention that forms the :math:`n \times n`
        weights (:math:`O(n^2)` memory), ``"flash"`` the same result in tiles
        (:math:`O(nd)`).
    n, d : int
        Sequence length and head size (key, query and value width).
    heads, batch : int, optional
        Everything scales with ``heads * batch``, except the RNN's steps.
    window, stride : int, optional
        For the sparse variants; default :data:`LOCAL_WINDOW` for ``"local"``
        and :math:`\lceil\sqrt{n}\rceil` otherwise (Child et al.'s choice).
    is_causal : bool, optional

    Returns
    -------
    VariantCost

    Examples
    --------
    >>> from tfmath.analysis.complexity import variant_cost
    >>> variant_cost("flash", 1024, 64).flops == 1024**2 * (4 * 64 + 5)
    True
    >>> variant_cost("rnn", 1024, 64).sequential_steps
    1024
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    n, d = _count("n", n), _count("d", d)
    copies = _count("heads", heads) * _count("batch", batch)
    if variant == "rnn":
        return VariantCost(
            variant, copies * n * (4 * d * d + 2 * d), copies * 2 * n * d, 0, n, (1, 2), (1, 1)
        )
    if variant == "linear":
        flops = copies * (4 * n * d * d + 6 * n * d)
        return VariantCost(variant, flops, copies * (d * d + n * d), 0, 1, (1, 2), (1, 1))
    pairs = _pairs(variant, n, window, stride, is_causal)
    flops = copies * pairs * (4 * d + SOFTMAX_FLOPS_PER_SCORE)
    if variant in ("naive", "flash"):
        time_order = (2, 1)
    elif variant == "local":
        time_order = (1, 1)
    else:
        # A stride s reaches n / s keys per query: n^1.5 with s = sqrt(n), n^2 with s fixed.
        time_order = (1.5, 1) if stride is None else (2, 1)
    memory = copies * (n * n + n * d) if variant == "naive" else copies * n * d
    memory_order = (2, 0) if variant == "naive" else (1, 1)
    return VariantCost(variant, flops, memory, pairs, 1, time_order, memory_order)


def _pairs(variant, n, window, stride, is_causal):
    if variant in ("naive", "flash"):
        return n * (n + 1) // 2 if is_causal else n * n
    arguments = _sparse_arguments(variant, n, window, stride)
    return sparse_pattern(variant, is_causal=is_causal, **arguments).n_pairs(n, n)


def _count(name, value):
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


@dataclass(frozen=True)
class SequentialDepth:
    """How much of a computation must run in order.

    Attributes
    ----------
    steps : int
        Steps along the sequence that depend on each other (an RNN's :math:`n`;
        1 for attention, whose positions are all computed at once).
    critical_path : int
        Operations on the longest chain of dependent operations, with every
        sum of :math:`m` terms done as a tree of depth :math:`\\lceil \\log_2 m
        \\rceil`: the time with unboundedly many processors.
    """

    steps: int
    critical_path: int


def sequential_depth(variant, n, d):
    r"""The dependent steps and critical path of attention or the RNN on ``n`` tokens.

    Attention (every softmax variant): a score is a dot product
    (:math:`1 + \lceil\log_2 d\rceil`: the products in parallel, then a
    tree), the softmax a tree maximum, the subtraction and exponential, a
    tree sum and the division (:math:`2\lceil\log_2 n\rceil + 3`), and the
    output a tree sum over keys (:math:`1 + \lceil\log_2 n\rceil`): depth
    :math:`O(\log n + \log d)` in one step. The RNN: each step is a matrix-vector
    product over :math:`2d` inputs (:math:`1 + \lceil\log_2 2d\rceil`), the
    bias and the :math:`\tanh` (2), and the :math:`n` steps are a chain:
    depth :math:`n(\lceil\log_2 2d\rceil + 3)`, linear in :math:`n` [Seed003]_.

    Examples
    --------
    >>> from tfmath.analysis.complexity import sequential_depth
    >>> sequential_depth("rnn", 100, 64).critical_path
    1000
    """
    n, d = _count("n", n), _count("d", d)
    log2 = _ceil_log2
    if variant == "rnn":
        return SequentialDepth(n, n * (log2(2 * d) + 3))
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return SequentialDepth(1, (1 + log2(d)) + (2 * log2(n) + 3) + (1 + log2(n)))


def _ceil_log2(m):
    return max(int(m - 1).bit_length(), 0)


# --- approximation error ------------------------------------------------------------------

#: The inputs :func:`structured_inputs` draws.
INPUT_KINDS = ("random", "local", "periodic")


def structured_inputs(
    kind, n, d, *, seed=0, width=2.0, period=16, peak_logit=8.0, dtype=np.float64
):
    r"""Queries, keys and values of shape ``(n, d)`` whose attention has a known shape.

    With the default scale :math:`s = 1/\sqrt{d}`:

    ``"random"``
        Independent standard normal entries: scores of variance 1, so every
        query spreads its weight over all keys.
    ``"local"``
        :math:`q_i = \sqrt{d}\, \beta\, (2i, -1, 0, \dots)` and
        :math:`k_j = (j, j^2, 0, \dots)`, so :math:`s\, q_i \cdot k_j =
        -\beta (i - j)^2 + \beta i^2`. The last term is the same for every key
        and cancels in the softmax, which leaves a Gaussian in :math:`i - j`:
        :math:`w_{ij} \propto e^{-(i-j)^2 / 2\sigma^2}`, with
        :math:`\beta = 1/2\sigma^2` (``width`` :math:`\sigma`). Every token
        attends to its neighbours only.
    ``"periodic"``
        :math:`q_i = k_i = a\,(\cos 2\pi m i/p, \sin 2\pi m i/p)_{m=1}^{H}`
        (``period`` :math:`p`, :math:`H` the largest multiple of :math:`p` up
        to :math:`d/2`; the other features are 0), so :math:`q_i \cdot k_j =
        a^2 \sum_{m=1}^{H} \cos 2\pi m (i-j)/p`, which is :math:`a^2 H` where
        :math:`p` divides :math:`i - j` and exactly 0 elsewhere (a sum over
        whole periods of the :math:`p`-th roots of unity). :math:`a` makes
        the peak scaled score ``peak_logit``. Every token attends every
        :math:`p`-th token.

    Values are standard normal in every kind. Build the structured kinds in
    float64: their scores are differences of terms of size :math:`\beta n^2`.

    Returns
    -------
    query, key, value : numpy.ndarray, shape (n, d)
    """
    if kind not in INPUT_KINDS:
        raise ValueError(f"kind must be one of {INPUT_KINDS}, got {kind!r}")
    smallest_d = {"random": 1, "local": 2, "periodic": 2 * period}[kind]
    if d < smallest_d:
        raise ValueError(f"kind={kind!r} needs d >= {smallest_d}, got d = {d}")
    rng = np.random.default_rng(seed)
    value = rng.standard_normal((n, d))
    positions = np.arange(n, dtype=np.float64)
    if kind == "random":
        query, key = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    elif kind == "local":
        beta = 1 / (2 * width**2)
        query, key = np.zeros((n, d)), np.zeros((n, d))
        query[:, 0], query[:, 1] = 2 * math.sqrt(d) * beta * positions, -math.sqrt(d) * beta
        key[:, 0], key[:, 1] = positions, positions**2
    else:
        harmonics = np.arange(1, (d // 2) // period * period + 1)
        angles = 2 * np.pi * np.outer(positions, harmonics) / period
        features = np.zeros((n, d))
        features[:, 0 : 2 * harmonics.size : 2] = np.cos(angles)
        features[:, 1 : 2 * harmonics.size : 2] = np.sin(angles)
        amplitude = math.sqrt(peak_logit * math.sqrt(d) / harmonics.size)
        query = key = amplitude * features
    return query.astype(dtype), key.astype(dtype), value.astype(dtype)


def linear_attention_weights(query, key, *, is_causal=False, feature_map="elu+1", eps=1e-6):
    r"""The :math:`L \times S` weights linear attention implies (NumPy; for analysis only).

    .. math::

        W_{ij} = \frac{\phi(q_i) \cdot \phi(k_j) / c_i}{\phi(q_i)^\top z_i + \varepsilon}
        \quad (j \in A_i), \qquad o_i = \sum_j W_{ij} v_j

    in the notation of :func:`tfmath.efficient.linear_attention`; rows sum to
    slightly less than 1 because of :math:`\varepsilon`. Forms the whole
    matrix, which :func:`~tfmath.efficient.linear_attention` never does.
    """
    code = ("elu+1", "relu").index(feature_map)
    kernel = _feature_map(query, code) @ _feature_map(key, code).T
    n_query, n_key = kernel.shape
    if is_causal:
        kernel = np.where(np.tril(np.ones((n_query, n_key), dtype=bool)), kernel, 0.0)
        counts = np.minimum(np.arange(1, n_query + 1), n_key)[:, None]
    else:
        counts = np.full((n_query, 1), n_key)
    mean_kernel = kernel / counts
    return mean_kernel / (mean_kernel.sum(axis=1, keepdims=True) + eps)


def relative_error(approximation, exact):
    r""":math:`\lVert \tilde X - X \rVert_F / \lVert X \rVert_F` (0 when both are 0)."""
    approximation = np.asarray(approximation, dtype=np.float64)
    exact = np.asarray(exact, dtype=np.float64)
    norm = np.linalg.norm(exact)
    difference = np.linalg.norm(approximation - exact)
    return float(difference / norm) if norm > 0 else float(difference)


@dataclass(frozen=True)
class ApproximationError:
    """How far a variant's attention is from exact attention.

    Attributes
    ----------
    output : float
        :func:`relative_error` of the output.
    weights : float or None
        :func:`relative_error` of the :math:`n \\times n` weights, when asked for.
    """

    output: float
    weights: float | None


def approximation_error(
    variant,
    query,
    key,
    value,
    *,
    window=None,
    stride=None,
    feature_map="elu+1",
    is_causal=False,
    with_weights=True,
    backend="auto",
):
    r"""Relative Frobenius error of a variant against exact softmax attention.

    The exact output is :func:`tfmath.scaled_dot_product_attention`
    (``method="naive"`` with its weights when ``with_weights``, else
    FlashAttention, whose memory is :math:`O(nd)` so long sequences fit).
    The variant's weights are the masked softmax for the sparse patterns
    (exact attention with :func:`~tfmath.efficient.sparse_attention_mask`)
    and :func:`linear_attention_weights` for linear attention.

    Parameters
    ----------
    variant : {"linear", "local", "strided", "local+strided"}
    query, key, value : numpy.ndarray, shape (..., n, d)
    window, stride : int, optional
        As for :func:`tfmath.efficient.sparse_attention`; defaults as in
        :func:`variant_cost`.
    feature_map : str, optional
        For ``"linear"``.
    is_causal : bool, optional
    with_weights : bool, optional
        Also compare the weights (forms :math:`n \times n` matrices).
    backend : str, optional

    Returns
    -------
    ApproximationError
    """
    n_query, n_key = query.shape[-2], key.shape[-2]
    if with_weights:
        exact, exact_weights = scaled_dot_product_attention(
            query, key, value, is_causal=is_causal, return_weights=True, backend=backend
        )
    else:
        exact = scaled_dot_product_attention(
            query, key, value, is_causal=is_causal, backend=backend
        )
    if variant == "linear":
        output = linear_attention(
            query, key, value, is_causal=is_causal, feature_map=feature_map, backend=backend
        )
        weights = None
        if with_weights:
            weights = linear_attention_weights(
                query, key, is_causal=is_causal, feature_map=feature_map
            )
    elif variant in ("local", "strided", "local+strided"):
        arguments = _sparse_arguments(variant, max(n_query, n_key), window, stride)
        output = sparse_attention(
            query, key, value, pattern=variant, is_causal=is_causal, backend=backend, **arguments
        )
        weights = None
        if with_weights:
            mask = sparse_attention_mask(
                n_query, n_key, pattern=variant, is_causal=is_causal, **arguments
            )
            _, weights = scaled_dot_product_attention(
                query, key, value, attn_mask=mask, return_weights=True, backend=backend
            )
    else:
        raise ValueError(
            f"variant must be 'linear', 'local', 'strided' or 'local+strided', got {variant!r}"
        )
    weights_error = relative_error(weights, exact_weights) if with_weights else None
    return ApproximationError(relative_error(output, exact), weights_error)


def _sparse_arguments(variant, n, window, stride):
    arguments = {}
    if variant in ("local", "local+strided"):
        default = LOCAL_WINDOW if variant == "local" else default_window(n)
        arguments["window"] = default if window is None else window
    if variant in ("strided", "local+strided"):
        arguments["stride"] = default_window(n) if stride is None else stride
    return arguments


# --- measurement --------------------------------------------------------------------------


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
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if clock not in _CLOCKS:
        raise ValueError(f"clock must be one of {tuple(_CLOCKS)}, got {clock!r}")
    import numba

    previous_threads = numba.get_num_threads()
    if threads is not None:
        numba.set_num_threads(threads)
    try:
        return [
            _measure(name, factory, n, d, repeats, warmup, measure_memory, _CLOCKS[clock], progress)
            for name, factory in routines.items()
            for d in dims
            for n in sorted(lengths)
        ]
    finally:
        numba.set_num_threads(previous_threads)


_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _measure(name, factory, n, d, repeats, warmup, measure_memory, clock, progress):
    call = factory(n, d)
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start = clock()
        call()
        times.append(clock() - start)
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
        arguments = _sparse_arguments(pattern, n, None, None)
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
            raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")

        def factory(n, d, workload=WORKLOADS[name]):
            rng = np.random.default_rng([seed, n, d])
            return workload.make(n, d, heads, np.dtype(dtype), backend, rng)

        factories[name] = factory
    return factories


# --- fits ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScalingFit:
    r"""Least-squares fit of :math:`y = c\, n^a d^b` in log-log space.

    Attributes
    ----------
    exponents : dict of str to float
        ``{"n": a}``, and ``"d": b`` when the data have more than one ``d``.
    standard_errors : dict of str to float
    intervals : dict of str to (float, float)
        Two-sided confidence intervals, Student's :math:`t` with the
        residual degrees of freedom (NaN when there are none).
    prefactor : float
        :math:`c`.
    r_squared : float
    n_points : int
    confidence : float
    """

    exponents: dict
    standard_errors: dict
    intervals: dict
    prefactor: float
    r_squared: float
    n_points: int
    confidence: float

    def predict(self, n, d=1):
        """:math:`c\\, n^a d^b` at the given sizes."""
        result = self.prefactor * np.asarray(n, dtype=float) ** self.exponents["n"]
        if "d" in self.exponents:
            result = result * np.asarray(d, dtype=float) ** self.exponents["d"]
        return result

    def describe(self, name="n"):
        """``"n^2.01 [1.95, 2.07]"``: the exponent and its interval."""
        low, high = self.intervals[name]
        return f"{name}^{self.exponents[name]:.2f} [{low:.2f}, {high:.2f}]"


def fit_scaling(n, d, y, *, confidence=0.95):
    r"""Fit :math:`\log y = \log c + a \log n + b \log d` by ordinary least squares.

    The covariance of the coefficients is :math:`\hat\sigma^2 (X^\top X)^{-1}`
    with :math:`\hat\sigma^2` the residual variance on :math:`m - p` degrees of
    freedom, and the intervals are :math:`\hat\beta \pm t_{m-p}\,
    \mathrm{se}(\hat\beta)` (``scipy.stats.t``). Multiplicative noise on
    :math:`y` (timings) is additive in log space, where least squares suits it.

    Parameters
    ----------
    n, d : array_like
        The sizes of each point; ``d`` is left out of the model when it takes a single value.
    y : array_like
        Positive measurements (seconds, bytes, FLOPs).
    confidence : float, optional

    Returns
    -------
    ScalingFit

    Examples
    --------
    >>> from tfmath.analysis.complexity import fit_scaling
    >>> fit = fit_scaling([1, 2, 4, 8], [1, 1, 1, 1], [3, 12, 48, 192])
    >>> round(fit.exponents["n"], 6), round(fit.prefactor, 6)
    (2.0, 3.0)
    """
    from scipy.stats import t as student_t

    n, d, y = (np.asarray(a, dtype=float).ravel() for a in (n, d, y))
    if not (n.shape == d.shape == y.shape):
        raise ValueError(f"n, d and y must have the same length, got {n.size}, {d.size}, {y.size}")
    if np.any(n <= 0) or np.any(d <= 0) or np.any(y <= 0):
        raise ValueError("n, d and y must be positive for a log-log fit")
    names = ["n", "d"] if np.unique(d).size > 1 else ["n"]
    columns = [np.ones_like(n), np.log(n)] + ([np.log(d)] if "d" in names else [])
    design = np.stack(columns, axis=1)
    if np.linalg.matrix_rank(design) < design.shape[1]:
        raise ValueError("the grid needs at least two distinct n (and two d if d varies)")
    target = np.log(y)
    coefficients, *_ = np.linalg.lstsq(design, target, rcond=None)
    residuals = target - design @ coefficients
    dof = len(y) - design.shape[1]
    total = np.sum((target - target.mean()) ** 2)
    r_squared = 1.0 - np.sum(residuals**2) / total if total > 0 else 1.0
    if dof > 0:
        variance = np.sum(residuals**2) / dof
        errors = np.sqrt(np.diag(variance * np.linalg.inv(design.T @ design)))
        quantile = student_t.ppf(0.5 + confidence / 2, dof)
    else:
        errors = np.full(design.shape[1], np.nan)
        quantile = np.nan
    exponents = {name: float(c) for name, c in zip(names, coefficients[1:], strict=True)}
    standard_errors = {name: float(e) for name, e in zip(names, errors[1:], strict=True)}
    intervals = {
        name: (exponents[name] - quantile * standard_errors[name],
               exponents[name] + quantile * standard_errors[name])
        for name in names
    }  # fmt: skip
    return ScalingFit(
        exponents,
        standard_errors,
        intervals,
        float(np.exp(coefficients[0])),
        float(r_squared),
        len(y),
        confidence,
    )


@dataclass(frozen=True)
class Crossover:
    """The sequence length at which a variant becomes faster than a reference.

    Attributes
    ----------
    variant, reference : str
    d : int
    length : float
        The estimate: where the log time ratio, interpolated linearly in
        :math:`\\log n` between grid points, changes sign for the last time
        (the variant is faster at every measured length above it). When it
        never changes sign in the grid: ``status`` says which way, and
        ``length`` is extrapolated from power laws fitted to the last three
        points of each (``inf`` when they never meet).
    interval : (float, float)
        Bootstrap percentile interval: each grid point's repeats are
        resampled with replacement, the medians recomputed, and the crossover
        re-estimated.
    status : {"crossed", "faster throughout", "slower throughout"}
    grid : (int, int)
        The smallest and largest ``n`` measured.
    """

    variant: str
    reference: str
    d: int
    length: float
    interval: tuple
    status: str
    grid: tuple


def crossover(measurements, variant, reference, d, *, confidence=0.95, n_boot=2000, seed=0):
    """Where ``variant`` overtakes ``reference`` at head size ``d`` (see :class:`Crossover`).

    Parameters
    ----------
    measurements : list of Measurement
        From :func:`sweep`, with both routines at the same lengths.
    variant, reference : str
    d : int
    confidence : float, optional
    n_boot : int, optional
        Bootstrap resamples.
    seed : int, optional

    Returns
    -------
    Crossover
    """
    by_n = {}
    for m in measurements:
        if m.d == d and m.routine in (variant, reference):
            by_n.setdefault(m.n, {})[m.routine] = np.asarray(m.times)
    lengths = np.array(sorted(n for n, row in by_n.items() if len(row) == 2), dtype=float)
    if lengths.size < 2:
        raise ValueError(f"need {variant} and {reference} at two or more lengths with d = {d}")
    samples = [(by_n[int(n)][variant], by_n[int(n)][reference]) for n in lengths]
    medians = np.array([[np.median(v), np.median(r)] for v, r in samples])
    length, status = _crossing(lengths, medians)
    rng = np.random.default_rng(seed)
    boot = np.empty(n_boot)
    for b in range(n_boot):
        resampled = np.array(
            [[np.median(rng.choice(v, v.size)), np.median(rng.choice(r, r.size))]
             for v, r in samples]
        )  # fmt: skip
        boot[b], _ = _crossing(lengths, resampled)
    tail = (1 - confidence) / 2
    # No interpolation between order statistics, which may be infinite.
    low, high = np.quantile(boot, [tail, 1 - tail], method="inverted_cdf")
    interval = (float(low), float(high))
    return Crossover(
        variant, reference, d, length, interval, status, (int(lengths[0]), int(lengths[-1]))
    )


def _crossing(lengths, medians):
    """Crossover estimate from median times ``medians[:, (variant, reference)]``."""
    log_n = np.log(lengths)
    ratio = np.log(medians[:, 0]) - np.log(medians[:, 1])  # < 0: the variant is faster
    slower = np.nonzero(ratio >= 0)[0]
    if slower.size == 0:
        return _extrapolate(log_n[:3], np.log(medians[:3])), "faster throughout"
    last = slower[-1]
    if last == len(lengths) - 1:
        return _extrapolate(log_n[-3:], np.log(medians[-3:])), "slower throughout"
    fraction = ratio[last] / (ratio[last] - ratio[last + 1])
    return float(np.exp(log_n[last] + fraction * (log_n[last + 1] - log_n[last]))), "crossed"


def _extrapolate(log_n, log_times):
    """Where power laws fitted to each column of ``log_times`` meet (inf if never)."""
    slopes, intercepts = np.polyfit(log_n, log_times, 1)
    if slopes[0] == slopes[1]:
        return math.inf
    meeting = (intercepts[1] - intercepts[0]) / (slopes[0] - slopes[1])
    return float(np.exp(meeting)) if np.isfinite(meeting) and meeting < 700 else math.inf


def cpu_count():
    """Cores this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
