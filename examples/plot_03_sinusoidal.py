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
from tfmath.plotting import encoding_columns, encoding_heatmap, new_figure, wavelengths
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
# ``PE[p] · PE[p + k]`` is the same for every start ``p``: measured at 50
# starts, its spread over ``p`` is rounding.
offsets = np.arange(1, 200)
dots = relative_dot_products(50, offsets, 128)
print("largest spread over p:", dots.spread.max())
similarity = new_figure(6, 3.5)[1][0, 0]
similarity.plot(offsets, dots.closed_form / 64)
similarity.set(xlabel="offset k", ylabel="PE[p]·PE[p+k] / (d/2)", title="Depends on k only")
