"""
Attention in half precision
===========================

float16 overflows above 65504: unscaled scores ``q · k`` of wide heads reach
it, and so does ``exp`` of logits above about 11 when the softmax does not
subtract the row maximum. bfloat16 has float32's range but only 8 bits of
mantissa. tfmath stores half-precision inputs in 16 bits and computes in
float32, so its error is the final rounding; summing in the input precision
adds one rounding per key.
"""

import ml_dtypes
import numpy as np

from tfmath.analysis import precision
from tfmath.plotting import accumulation_error, new_figure, score_overflow

dims = [128, 256, 512, 1024]
measured, scaled = zip(
    *(precision.measure_score_overflow(d, 200, 128, component_std=32.0, seed=d) for d in dims),
    strict=True,
)
results = [
    precision.accumulation_error(dtype, [32, 64, 128, 256])
    for dtype in (np.float16, ml_dtypes.bfloat16)
]
figure, axes = new_figure(12, 4.6, ncols=2)
score_overflow(measured, scaled, n_keys=128, component_std=32.0, ax=axes[0, 0])
accumulation_error(results, ax=axes[0, 1])
