"""
The sinusoidal encoding and its properties
==========================================

``PE[p, 2i] = sin(p / base^(2i/d))`` and ``PE[p, 2i+1] = cos(...)``. Drawn as a
matrix, each row is one position; columns oscillate ever more slowly from left
to right, like the digits of a counter. Every value lies in [-1, 1], and the
dot product of two encodings depends only on the distance between their
positions.
"""

import numpy as np

from tfmath.analysis.positional import relative_dot_products
from tfmath.plotting import (
    encoding_columns,
    encoding_heatmap,
    new_figure,
    similarity_by_offset,
    wavelengths,
)
from tfmath.positional import sinusoidal_encoding

encoding = sinusoidal_encoding(100, 128)
figure, axes = new_figure(11, 4.2, ncols=2)
encoding_heatmap(encoding, ax=axes[0, 0])
encoding_columns(encoding, ax=axes[0, 1])
print("range:", encoding.min(), encoding.max())

# %%
# Wavelengths grow geometrically, from 2π to 2π · base:
ax = wavelengths([64, 512])

# %%
# ``PE[p] · PE[p + k]`` is the same for every start ``p``: the closed form
# ``sum_i cos(ω_i k)`` (lines), and the smallest and largest values measured
# over 50 starts (circles), which sit on the line.
offsets = np.arange(1, 1001)
measured = np.unique(np.geomspace(1, 1000, 15).astype(int))
lines = {d: relative_dot_products(1, offsets, d) for d in (32, 128)}
checks = {d: relative_dot_products(50, measured, d) for d in (32, 128)}
print("largest spread over p:", max(c.spread.max() for c in checks.values()))
ax = similarity_by_offset(lines, checks, n_starts=50)
