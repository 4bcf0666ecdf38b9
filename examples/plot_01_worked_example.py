"""
Attention weights of a worked example
=====================================

Seed 003 works through self-attention on three tokens by hand: embeddings
``X``, projections ``W_Q``, ``W_K``, ``W_V``, scores ``Q K^T / sqrt(d_k)``
and a softmax per row. :func:`tfmath.analysis.worked_examples.projection_example`
computes the same example exactly, and :func:`tfmath.plotting.attention_heatmap`
draws its weights, one row per query token.
"""

import numpy as np

import tfmath
from tfmath.analysis.worked_examples import projection_example
from tfmath.plotting import attention_heatmap

example = projection_example()
print("Q =\n", example.query)
print("attention weights =\n", np.round(example.weights, 4))

tokens = ["token 1", "token 2", "token 3"]
ax = attention_heatmap(
    example.weights, query_labels=tokens, key_labels=tokens, title="seed 003, exact weights"
)

# %%
# The same weights come from :func:`tfmath.scaled_dot_product_attention`
# given the projected ``Q``, ``K`` and ``V``: the default scale is
# ``1/sqrt(d_k)``.
out, weights = tfmath.scaled_dot_product_attention(
    example.query, example.key, example.value, return_weights=True
)
print("largest difference:", np.max(np.abs(weights - example.weights)))
