"""asv benchmarks of training steps, the rows of ``tfmath bench training``.

Every shape of :data:`tfmath.tools.bench_training.TRAINING_SHAPES` (widths 16 to
512, 1 to 4 layers, contexts 64 to 512, and the scaling sweeps' own models)
trains one float32 Adam step with tfmath's fused step (``time_``, ``track_peak_memory``);
``track_`` records tokens per second, the fraction of the machine's GEMM roof
measured in the same run, and, where PyTorch is importable, tfmath's tokens per
second over PyTorch's for the same model on the same threads.

Run with ``asv run -E existing --quick --bench Training``.
"""

from typing import ClassVar

from tfmath.analysis.timing import best_time, measure_peak_bytes
from tfmath.formulas.accounting import flops_per_token
from tfmath.tools.bench import gemm_roof
from tfmath.tools.bench_training import TRAINING_SHAPES, TorchPeer, tfmath_step

from ._peers import needs_torch

SHAPES = {
    f"{s.label} d={s.d_model} L={s.n_layers} T={s.context} V={s.vocab}": s for s in TRAINING_SHAPES
}


class Training:
    params: ClassVar = [list(SHAPES)]
    param_names: ClassVar = ["shape"]
    timeout = 900
    number = 1
    repeat = (2, 3, 30.0)

    def setup(self, name):
        self.shape = SHAPES[name]
        self.step = tfmath_step(self.shape)
        self.step()  # compile, or load from the cache, before any timing

    def time_tfmath_step(self, name):
        self.step()

    def track_peak_memory(self, name):
        """Memory one step adds at its peak, in MiB (not the process's peak, which the
        setup's compilation dominates)."""
        return measure_peak_bytes(self.step) / 2**20

    track_peak_memory.unit = "MiB"

    def track_tfmath_tokens_per_second(self, name):
        return self.shape.tokens / best_time(self.step, 2)

    track_tfmath_tokens_per_second.unit = "tokens/s"

    def track_fraction_of_gemm_roof(self, name):
        per_token = flops_per_token(self.shape.config(), n_ctx=self.shape.context).training
        rate = per_token * self.shape.tokens / best_time(self.step, 2) / 1e9
        return rate / gemm_roof()

    track_fraction_of_gemm_roof.unit = "fraction"

    @needs_torch
    def track_tfmath_tokens_per_second_over_torch(self, name):
        # PyTorch in a process of its own: see tfmath.tools.bench_training.TorchPeer.
        import numba

        peer = TorchPeer(numba.get_num_threads())
        try:
            peer.build(self.shape)
            torch_time = min(peer.best_time(2) for _ in range(3))
        finally:
            peer.close()
        return torch_time / best_time(self.step, 2)

    track_tfmath_tokens_per_second_over_torch.unit = "ratio"
