"""
Masks: causal and padding
=========================

A boolean ``attn_mask`` says which keys each query may attend (True = may
attend), as in PyTorch; ``is_causal=True`` lets query ``i`` see keys ``0..i``
only. Both can be combined. A masked key gets weight exactly 0 and the rest
of its row is renormalised.
"""

import numpy as np

import tfmath
from tfmath.plotting import attention_heatmap, new_figure

rng = np.random.default_rng(0)
tokens = ["the", "cat", "sat", "<pad>", "<pad>"]
q, k, v = (rng.standard_normal((5, 4)) for _ in range(3))

# Padding: the two last keys are not real tokens, so no query may attend them.
padding = np.array([True, True, True, False, False])[None, :]

figure, axes = new_figure(12, 3.8, ncols=3)
for ax, (title, arguments) in zip(
    axes[0],
    [
        ("no mask", {}),
        ("causal", {"is_causal": True}),
        ("causal and padding", {"is_causal": True, "attn_mask": padding}),
    ],
    strict=True,
):
    _, weights = tfmath.scaled_dot_product_attention(q, k, v, return_weights=True, **arguments)
    attention_heatmap(
        weights, query_labels=tokens, key_labels=tokens, title=title, colorbar=False, ax=ax
    )

# %%
# Every row still sums to 1 over the keys it may attend:
print(weights.sum(axis=-1))
