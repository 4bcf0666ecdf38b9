"""asv benchmarks of FlashAttention-style tiled attention (``method="flash"``).

They track what the fast-exact-attention work promises, each as a ratio
measured in the same run, so machines and days stay comparable:

* ``FlashForward``: time and GFLOP/s of the flash and naive CPU kernels for
  B=1, H=8, d=64, float32, L=S in 512..4096, causal or not; the rate as a
  fraction of the machine's float32 GEMM roof (NumPy matmul of 2048x2048);
  and PyTorch's time over tfmath's when PyTorch is importable (n/a otherwise).
* ``FlashTrainingStep``: forward plus backward, against PyTorch's autograd.
* ``FlashLongSequence``: one head of L = S = 32768: the resident memory the call
  adds at its peak (``track_extra_memory``,
  :func:`tfmath.analysis.timing.measure_peak_bytes`), against the 4 GiB that the
  L x L float32 scores alone would need.

Run with ``asv run -E existing --quick --bench Flash`` (see bench_attention.py
for the other ways to run asv).
"""

from typing import ClassVar

import numpy as np

import tfmath
from tfmath.analysis.timing import best_time, interleaved_best_times, measure_peak_bytes
from tfmath.tools.bench import gemm_roof, optional_torch

from ._peers import needs_torch

HEADS = 8
HEAD_DIM = 64
SEED = 0


def _qkv(n, heads=HEADS):
    rng = np.random.default_rng(SEED)
    return [rng.standard_normal((1, heads, n, HEAD_DIM), dtype=np.float32) for _ in range(3)]


def _flops(n, causal, heads=HEADS):
    """4 L S d H floating-point operations, half of them when causal."""
    return 4 * n * n * HEAD_DIM * heads / (2 if causal else 1)


class FlashForward:
    params: ClassVar = ([512, 1024, 2048, 4096], [False, True], ["flash", "naive"])
    param_names: ClassVar = ["n", "causal", "method"]
    timeout = 600
    number = 1
    repeat = (2, 5, 20.0)

    def setup(self, n, causal, method):
        query, key, value = _qkv(n)

        def forward():
            return tfmath.scaled_dot_product_attention(
                query, key, value, is_causal=causal, method=method, backend="cpu"
            )

        self.forward = forward
        self.tensors = (query, key, value)
        forward()  # compile, or load from the cache, before any timing

    def time_forward(self, n, causal, method):
        self.forward()

    def track_gflops(self, n, causal, method):
        return _flops(n, causal) / best_time(self.forward, 3) / 1e9

    track_gflops.unit = "GFLOP/s"

    def track_fraction_of_gemm_roof(self, n, causal, method):
        rate = _flops(n, causal) / best_time(self.forward, 3) / 1e9
        return rate / gemm_roof()

    track_fraction_of_gemm_roof.unit = "fraction"

    @needs_torch
    def track_torch_time_over_tfmath_time(self, n, causal, method):
        torch = optional_torch()
        tensors = [torch.from_numpy(a) for a in self.tensors]

        def torch_forward():
            return torch.nn.functional.scaled_dot_product_attention(*tensors, is_causal=causal)

        times = interleaved_best_times({"torch": torch_forward, "tfmath": self.forward}, 2)
        return times["torch"] / times["tfmath"]

    track_torch_time_over_tfmath_time.unit = "ratio"


class FlashTrainingStep:
    params: ClassVar = [1024, 2048]
    param_names: ClassVar = ["n"]
    timeout = 600
    number = 1
    repeat = (2, 5, 20.0)

    def setup(self, n):
        query, key, value = _qkv(n)
        grad = np.random.default_rng(SEED + 1).standard_normal(query.shape, dtype=np.float32)

        def step():
            # The backward reuses the forward's output and log-sum-exp, as autograd would.
            output, log_sum_exp = tfmath.scaled_dot_product_attention(
                query, key, value, return_log_sum_exp=True, backend="cpu"
            )
            return tfmath.attention_grad(
                query, key, value, grad, output=output, log_sum_exp=log_sum_exp, backend="cpu"
            )

        self.step = step
        self.arrays = (query, key, value, grad)
        step()

    def time_forward_backward(self, n):
        self.step()

    @needs_torch
    def track_torch_time_over_tfmath_time(self, n):
        torch = optional_torch()
        query, key, value, grad = self.arrays
        tensors = [torch.from_numpy(a.copy()).requires_grad_() for a in (query, key, value)]
        torch_grad = torch.from_numpy(grad)

        def torch_step():
            torch.nn.functional.scaled_dot_product_attention(*tensors).backward(torch_grad)

        times = interleaved_best_times({"torch": torch_step, "tfmath": self.step}, 2)
        return times["torch"] / times["tfmath"]

    track_torch_time_over_tfmath_time.unit = "ratio"


class FlashLongSequence:
    """One head of 32768 tokens: the naive path would need 4 GiB for the scores alone."""

    n = 32768
    timeout = 600
    number = 1
    repeat = 1

    def setup(self):
        rng = np.random.default_rng(SEED)
        self.arrays = [rng.standard_normal((1, self.n, HEAD_DIM), dtype=np.float32)
                       for _ in range(3)]  # fmt: skip
        small = [a[:, :256] for a in self.arrays]
        tfmath.scaled_dot_product_attention(*small, backend="cpu")

    def track_extra_memory(self):
        """Resident memory the call adds at its peak, its 8 MiB output included."""
        return (
            measure_peak_bytes(
                lambda: tfmath.scaled_dot_product_attention(*self.arrays, backend="cpu")
            )
            / 2**20
        )

    track_extra_memory.unit = "MiB"
