"""asv benchmarks of the attention workload matrix, the rows of ``tfmath bench attention --matrix``.

Every row of :data:`tfmath.tools.workloads.MATRIX` (head sizes, causal,
key-padding and additive masks, float64, many short sequences, decoding with
multi-head, grouped-query and multi-query attention, a long causal sequence,
training steps) is timed (``time_``), and tracked as a ratio measured in the
same run: PyTorch's time over tfmath's (``track_``, when PyTorch is
importable), and the rate against the machine's roof (GFLOP/s against NumPy's
float32 GEMM rate, twice it for bfloat16 rows on ``vdpbf16ps``, or for decoding
GB/s against one core's read bandwidth).

``Small`` does the same for the per-call cost of small problems
(:data:`tfmath.tools.workloads.SMALL`), the rows of ``tfmath bench attention
--small``: tfmath's time over PyTorch's with both libraries loaded and called in
turn in one process, the same ratio with each library alone in a fresh process,
and how much slower tfmath is with PyTorch beside it than alone.

Run with ``asv run -E existing --quick --bench "Matrix|Small"``. The benchmarks
against PyTorch are skipped (by their setup: ``_peers.needs_torch``) where PyTorch is
not importable, as in the environment ``asv.conf.json`` builds; see
``docs/benchmarks.rst`` for how to add it there.
"""

from typing import ClassVar

import numpy as np

from tfmath.analysis.timing import best_time, interleaved_best_times
from tfmath.tools.bench import alone_seconds, gemm_roof, optional_torch
from tfmath.tools.workloads import MATRIX, SMALL, read_bandwidth, workload

from ._peers import needs_torch

SEED = 0


class Matrix:
    params: ClassVar = [[w.name for w in MATRIX]]
    param_names: ClassVar = ["workload"]
    timeout = 900
    number = 1
    repeat = (2, 3, 30.0)

    def setup(self, name):
        self.case = workload(name).build(np.random.default_rng(SEED), optional_torch())
        self.case.tfmath()  # compile, or load from the cache, before any timing

    def time_tfmath(self, name):
        self.case.tfmath()

    @needs_torch
    def track_torch_time_over_tfmath_time(self, name):
        case = self.case.repeated()
        times = interleaved_best_times({"torch": case.torch, "tfmath": case.tfmath}, 2)
        return times["torch"] / times["tfmath"]

    track_torch_time_over_tfmath_time.unit = "ratio"

    def track_fraction_of_roof(self, name):
        seconds = best_time(self.case.tfmath, 2)
        if self.case.flops is not None:
            return self.case.flops / seconds / 1e9 / (gemm_roof() * self.case.roof_multiple)
        return self.case.bytes_read / seconds / read_bandwidth()

    track_fraction_of_roof.unit = "fraction"


class Small:
    params: ClassVar = [[w.name for w in SMALL]]
    param_names: ClassVar = ["workload"]
    timeout = 600
    number = 0  # asv repeats a call until a sample is long enough, and reports one call
    repeat = (2, 5, 20.0)

    def setup(self, name):
        case = workload(name).build(np.random.default_rng(SEED), optional_torch())
        self.call = case.tfmath
        self.case = case.repeated()  # ``case.calls`` calls per ratio's timing
        self.case.tfmath()

    def time_tfmath_call(self, name):
        self.call()

    def _together(self):
        return interleaved_best_times({"torch": self.case.torch, "tfmath": self.case.tfmath}, 3)

    @needs_torch
    def track_tfmath_time_over_torch_time(self, name):
        times = self._together()
        return times["tfmath"] / times["torch"]

    track_tfmath_time_over_torch_time.unit = "ratio"

    @needs_torch
    def track_tfmath_time_over_torch_time_each_alone(self, name):
        return alone_seconds(name, "tfmath") / alone_seconds(name, "torch")

    track_tfmath_time_over_torch_time_each_alone.unit = "ratio"

    @needs_torch
    def track_tfmath_slowdown_with_torch_loaded(self, name):
        together = self._together()["tfmath"] / self.case.calls
        return together / alone_seconds(name, "tfmath")

    track_tfmath_slowdown_with_torch_loaded.unit = "ratio"
