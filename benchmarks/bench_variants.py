"""asv benchmarks of attention's variants, the rows of ``tfmath bench attention --variants``.

Every row of :data:`tfmath.tools.variant_workloads.VARIANTS` (causal, sliding
window, ALiBi, sinks, soft cap, packed sequences, FlexAttention with a
``score_mod`` and with a block mask; forward, and forward and backward through
autograd) is timed (``time_``) and tracked as PyTorch's time over tfmath's,
measured in the same run, against ``scaled_dot_product_attention`` given the
equivalent dense mask or bias (``track_``, when PyTorch is importable and an
equivalent exists). ``Window`` tracks the sliding window's cost against L at a
fixed window of 512 keys.

Run with ``asv run -E existing --quick --bench "Variants|Window"``.
"""

from typing import ClassVar

import numpy as np

from tfmath.analysis.timing import interleaved_best_times
from tfmath.tools.bench import optional_torch
from tfmath.tools.variant_workloads import VARIANTS, has_peer, variant_workload
from tfmath.variants import flash_attention

SEED = 0


def needs_peer(benchmark):
    """Give ``benchmark`` a setup that skips it (asv's ``n/a``) where PyTorch is not
    importable or has no equivalent of the variant (see ``_peers.needs_torch``)."""

    def require_peer(name):
        if optional_torch() is None:
            raise NotImplementedError("PyTorch is not installed")
        if not has_peer(name):
            raise NotImplementedError("PyTorch's SDPA has no equivalent of this variant")

    benchmark.setup = require_peer
    return benchmark


class Variants:
    params: ClassVar = [[w.name for w in VARIANTS]]
    param_names: ClassVar = ["variant"]
    timeout = 900
    number = 1
    repeat = (2, 3, 30.0)

    def setup(self, name):
        self.case = variant_workload(name).build(np.random.default_rng(SEED), optional_torch())
        self.case.tfmath()  # compile, or load from the cache, before any timing

    def time_tfmath(self, name):
        self.case.tfmath()

    @needs_peer
    def track_torch_time_over_tfmath_time(self, name):
        times = interleaved_best_times({"torch": self.case.torch, "tfmath": self.case.tfmath}, 2)
        return times["torch"] / times["tfmath"]

    track_torch_time_over_tfmath_time.unit = "ratio"


class Window:
    """Causal attention with a window of 512 keys: time grows as L w, not L^2."""

    params: ClassVar = [[2048, 4096, 8192, 16384]]
    param_names: ClassVar = ["length"]
    timeout = 600
    number = 1
    repeat = (2, 3, 30.0)

    def setup(self, length):
        rng = np.random.default_rng(SEED)
        self.operands = [
            rng.standard_normal((1, 1, length, 64)).astype(np.float32) for _ in range(3)
        ]
        self.time_window(length)  # compile before timing

    def time_window(self, length):
        flash_attention(*self.operands, causal=True, window_size=(512, 0))

    def time_full_causal(self, length):
        flash_attention(*self.operands, causal=True)
