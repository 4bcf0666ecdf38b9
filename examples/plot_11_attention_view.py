"""
The interactive attention view
==============================

:func:`tfmath.attention_view` writes attention weights of shape
``(heads, L, S)`` or ``(layers, heads, L, S)`` into a standalone HTML view:
click (or focus and use the arrow keys on) a query token to see its weights
over the keys; the selectors choose the layer and the head. It needs no
network. Below, the view is embedded in this page; in Jupyter it displays
inline, and ``view.save("attention.html")`` writes it as a page of its own.
"""

import numpy as np

import tfmath
from tfmath.plotting import attention_heatmap, new_figure

tokens = ["the", "cat", "sat", "on", "the", "mat"]
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, len(tokens), 8)) for _ in range(3))
_, weights = tfmath.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)

view = tfmath.attention_view(tokens, weights, title="two causal heads")
view  # noqa: B018 (the last expression: the gallery and Jupyter show its HTML)

# %%
# The same weights as static heatmaps, one per head:
figure, axes = new_figure(10, 4, ncols=2)
for head, ax in enumerate(axes[0]):
    attention_heatmap(weights[head], query_labels=tokens, key_labels=tokens, annotate=False,
                      title=f"head {head}", colorbar=False, ax=ax)  # fmt: skip
