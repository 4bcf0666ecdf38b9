"""asv benchmarks of exact scaled dot-product attention and softmax.

Run them with airspeed velocity (``pip install -e ".[bench]"``) from the
repository root, where ``asv.conf.json`` lives::

    asv machine --yes                 # once per machine: record what it is

    # Benchmark the tfmath installed in the current Python environment (an
    # editable install of the working tree, say). Nothing is built, and the
    # results are only printed, not saved...
    asv run -E existing --quick --show-stderr
    # ...unless a commit is named to file them under:
    asv run -E existing --set-commit-hash $(git rev-parse HEAD)

    # Build a virtualenv under .asv/env, install the wheel of the repository's
    # HEAD (the last commit, not the working tree) and benchmark that:
    asv run --quick                   # every benchmark once: a smoke test
    asv run                           # proper timings, saved to .asv/results
    asv continuous main HEAD          # compare two commits

    asv publish && asv preview        # HTML report in .asv/html

``--quick`` runs each benchmark a single time (asv 0.6 still saves what it
measured, unless ``-E existing`` runs without ``--set-commit-hash``), so use
it to check that the suite works, not to measure. ``--bench REGEX`` selects
benchmarks, for example ``--bench "Attention.time_attention"``; the whole
suite has over 600 parameter combinations and takes tens of minutes even with
``--quick`` on two cores (the ``Small`` rows alone about five), so select.

What is measured
----------------
One head (``q``, ``k``, ``v`` of shape ``(1, n, d)``, float32, drawn from
``np.random.default_rng(0)``) for sequence lengths ``n`` in ``SEQUENCE_LENGTHS``
and head dims ``d`` in ``HEAD_DIMS``, on every backend worth timing here:
``cpu`` and ``reference`` always, ``cuda`` only on a real GPU (the Numba
simulator is far too slow to time). Combinations that are skipped raise
``NotImplementedError`` in ``setup``, which asv reports as ``n/a``: the
``reference`` backend materialises the ``n x n`` score matrix several times
over, so it stops at ``REFERENCE_MAX_N``.

Every ``setup`` makes one untimed call first, so JIT compilation (and CUDA
context creation) is never part of a timing. CUDA inputs are device arrays
and the timed call ends with ``numba.cuda.synchronize()``, so a CUDA timing
is the kernel and its launch (which copies a few small index arrays to the
device), not the copies of ``q``, ``k`` and ``v``.

``track_peak_memory`` is the memory one call adds at its peak, in MiB, above what
was resident before it (:func:`tfmath.analysis.timing.measure_peak_bytes`): not
asv's ``peakmem_``, the whole process's peak, which the setup's compilation or
kernel-cache loading dominates (tens of MB that vary with the cache, hiding a
16 MiB score matrix).
"""

from typing import ClassVar

import numpy as np

import tfmath
from tfmath import _cuda
from tfmath.analysis.timing import best_time, measure_peak_bytes

#: Sequence lengths ``n`` (query rows = key rows).
SEQUENCE_LENGTHS = [128, 256, 512, 1024, 2048, 4096]
#: Head dims ``d`` (query/key features = value features).
HEAD_DIMS = [32, 64, 128]
#: The reference backend allocates several ``n x n`` arrays; beyond this it is skipped.
REFERENCE_MAX_N = 2048
#: The head dim of the causal and throughput benchmarks.
THROUGHPUT_HEAD_DIM = 64
#: Exact-attention methods: the row-at-a-time kernel and the tiled FlashAttention one.
METHODS = ["naive", "flash"]
SEED = 0
DTYPE = np.float32


def usable_backends():
    """The backends worth benchmarking on this machine, in ``tfmath.backends()`` order:
    every available one except the CUDA simulator (correct, but far too slow to time)."""
    return [
        name for name, info in tfmath.backends().items() if info.available and not info.simulated
    ]


def compiled_backends():
    """The usable backends that run tfmath's own kernels (all but the NumPy reference)."""
    return [name for name in usable_backends() if name != "reference"]


def skip_unless_runnable(n, backend):
    """Raise ``NotImplementedError`` (asv's "skip this combination") when it should not run."""
    if backend not in usable_backends():
        raise NotImplementedError(f"backend {backend!r} is not benchmarked on this machine")
    if backend == "reference" and n > REFERENCE_MAX_N:
        raise NotImplementedError(
            f"the reference backend materialises n x n arrays; skipped for n > {REFERENCE_MAX_N}"
        )


def on_backend(array, backend):
    """``array`` where ``backend`` reads it: in GPU memory for cuda, as it is otherwise."""
    return _cuda.to_device(array) if backend == "cuda" else array


def qkv(n, d, backend):
    """Query, key and value of shape ``(1, n, d)`` from a fixed seed, placed for ``backend``."""
    rng = np.random.default_rng(SEED)
    arrays = [rng.standard_normal((1, n, d), dtype=DTYPE) for _ in range(3)]
    return [on_backend(a, backend) for a in arrays]


def synchronize(backend):
    """Wait for queued GPU work, so a CUDA timing covers the kernel and not just its launch."""
    if backend == "cuda":
        _cuda.numba_cuda().synchronize()


def attention_flops(n, d, *, causal=False):
    """Floating-point operations of one head: ``2 n^2 d`` for ``QK^T`` and as many for ``PV``."""
    flops = 4 * n * n * d
    return flops // 2 if causal else flops


class _Timing:
    """asv timing settings shared by every benchmark class here.

    One call per sample: the largest problems take ~0.5 s on a CPU, and asv re-runs
    ``setup`` (with its warm-up call) before each sample anyway. Each of
    asv's two rounds takes 3 to 20 samples and stops sampling after ~10 s,
    so small problems get enough samples to beat scheduler noise and large
    ones stay affordable. ``--quick`` overrides all this with a single call.
    """

    timeout = 300
    number = 1
    repeat = (3, 20, 10.0)
    warmup_time = 0


class _AttentionCase(_Timing):
    """Shared setup: one head of length ``n`` and width ``d`` on ``backend``, compiled."""

    is_causal = False

    def _setup(self, n, d, backend, method):
        skip_unless_runnable(n, backend)
        if backend == "reference" and method != "naive":
            raise NotImplementedError("the reference has one method: the formula")
        self.backend, self.method = backend, method
        self.query, self.key, self.value = qkv(n, d, backend)
        self.attend()  # warm-up: compilation is never timed

    def attend(self):
        out = tfmath.scaled_dot_product_attention(
            self.query, self.key, self.value, is_causal=self.is_causal,
            method=self.method, backend=self.backend,
        )  # fmt: skip
        synchronize(self.backend)
        return out


class Attention(_AttentionCase):
    """Non-causal attention of one head, across ``n``, ``d``, backends and methods."""

    params: ClassVar[list] = [SEQUENCE_LENGTHS, HEAD_DIMS, usable_backends(), METHODS]
    param_names: ClassVar[list] = ["n", "d", "backend", "method"]

    def setup(self, n, d, backend, method):
        self._setup(n, d, backend, method)

    def time_attention(self, n, d, backend, method):
        self.attend()

    def track_peak_memory(self, n, d, backend, method):
        return measure_peak_bytes(self.attend) / 2**20

    track_peak_memory.unit = "MiB"


class CausalAttention(_AttentionCase):
    """Causal attention (``is_causal=True``): half the score matrix, ideally half the time."""

    is_causal = True
    params: ClassVar[list] = [SEQUENCE_LENGTHS, HEAD_DIMS, usable_backends(), METHODS]
    param_names: ClassVar[list] = ["n", "d", "backend", "method"]

    def setup(self, n, d, backend, method):
        self._setup(n, d, backend, method)

    def time_causal_attention(self, n, d, backend, method):
        self.attend()


class AttentionThroughput(_AttentionCase):
    """Achieved GFLOP/s of non-causal attention at ``d = THROUGHPUT_HEAD_DIM``.

    Tracks ``4 n^2 d`` FLOPs over the best of several timed calls, for the
    compiled backends (the NumPy reference is left out).
    """

    params: ClassVar[list] = [SEQUENCE_LENGTHS, compiled_backends(), METHODS]
    param_names: ClassVar[list] = ["n", "backend", "method"]
    #: Timed calls per measurement (the best is kept; see tfmath.analysis.timing.best_time).
    REPEATS = 5

    def setup(self, n, backend, method):
        self._setup(n, THROUGHPUT_HEAD_DIM, backend, method)

    def track_gflops(self, n, backend, method):
        seconds = best_time(self.attend, self.REPEATS)
        return attention_flops(n, THROUGHPUT_HEAD_DIM) / seconds / 1e9

    track_gflops.unit = "GFLOP/s"


class Softmax(_Timing):
    """Softmax of ``n`` rows of length ``n`` (the score matrix of one head)."""

    params: ClassVar[list] = [SEQUENCE_LENGTHS, usable_backends()]
    param_names: ClassVar[list] = ["n", "backend"]

    def setup(self, n, backend):
        skip_unless_runnable(n, backend)
        self.backend = backend
        rng = np.random.default_rng(SEED)
        self.x = on_backend(rng.standard_normal((n, n), dtype=DTYPE), backend)
        self.softmax()  # warm-up: compilation is never timed

    def softmax(self):
        out = tfmath.softmax(self.x, backend=self.backend)
        synchronize(self.backend)
        return out

    def time_softmax(self, n, backend):
        self.softmax()
