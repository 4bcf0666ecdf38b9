"""
RoPE and ALiBi
==============

Rotary embeddings (RoPE) rotate each pair of query and key components by an
angle proportional to the position, so ``q_m · k_n`` depends on ``m - n``
only. ALiBi adds to each score a bias ``-slope · (i - j)`` growing with the
distance, with one slope per head.
"""

import numpy as np

from tfmath.plotting import attention_heatmap, new_figure
from tfmath.positional import alibi_bias, alibi_slopes, rotary_embedding

rng = np.random.default_rng(0)
q = rng.standard_normal(64)
k = rng.standard_normal(64)
positions = np.arange(32)

# The same q and k placed at every position: rotate them, then score every pair.
rotated_q = rotary_embedding(np.tile(q, (32, 1)), positions)
rotated_k = rotary_embedding(np.tile(k, (32, 1)), positions)
scores = rotated_q @ rotated_k.T
print("norms kept:", np.allclose(np.linalg.norm(rotated_q, axis=1), np.linalg.norm(q)))

figure, axes = new_figure(11, 4.2, ncols=2)
image = axes[0, 0].imshow(scores, cmap="RdBu_r")
axes[0, 0].set(xlabel="key position n", ylabel="query position m",
               title="RoPE: q_m·k_n is constant along diagonals")  # fmt: skip
figure.colorbar(image, ax=axes[0, 0], label="score")
for shift in (0, 5, 15):
    diagonal = np.diagonal(scores, offset=-shift)
    axes[0, 1].plot(np.arange(shift, 32), diagonal, "o-", ms=3, label=f"m - n = {shift}")
axes[0, 1].set(xlabel="query position m", ylabel="q_m·k_n", title="Scores along three diagonals")
axes[0, 1].legend()

# %%
# ALiBi: the bias of four heads, and its effect on uniform scores.
bias = alibi_bias(4, 12, 12)
print("slopes:", alibi_slopes(4))
figure, axes = new_figure(12, 3.4, ncols=4)
for head, ax in enumerate(axes[0]):
    biased = np.where(np.tri(12, dtype=bool), bias[head], -np.inf)
    weights = np.exp(biased - biased.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    attention_heatmap(weights, annotate=False, colorbar=False, ax=ax,
                      title=f"head {head}: slope {alibi_slopes(4)[head]:g}")  # fmt: skip
