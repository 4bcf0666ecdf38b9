"""
Why scores are divided by √d_k
==============================

For ``q`` and ``k`` with independent components of mean 0 and variance 1,
``Var(q · k) = d_k``: unscaled scores spread wider as the head grows, and the
softmax saturates onto one key. Dividing by ``sqrt(d_k)`` keeps the variance
at 1. :func:`tfmath.variance.dot_product_variance` measures both by Monte
Carlo, with confidence intervals.
"""

from tfmath.analysis.variance import saturation_curve
from tfmath.plotting import saturation, scaled_variance, variance_against_dk
from tfmath.variance import dot_product_variance

dims = [1, 4, 16, 64, 256, 1024]
estimates = {
    "normal": dot_product_variance(dims, 5000, distribution="normal"),
    "uniform": dot_product_variance(dims, 5000, distribution="uniform"),
    "normal, mean 1": dot_product_variance(dims, 5000, mean=1.0),
}
figure = variance_against_dk(estimates)

# %%
# Scaled by ``1/sqrt(d_k)``, the i.i.d. cases sit at 1 within their intervals:
ax = scaled_variance(estimates, ["normal", "uniform"])

# %%
# Softmax saturation: without the scale the largest weight tends to 1 and the
# entropy to 0 as ``d_k`` grows; with it they stay put.
curve = saturation_curve(dims, 300, 32)
figure = saturation(curve)
