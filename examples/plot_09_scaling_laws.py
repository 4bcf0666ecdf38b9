"""
Scaling laws: the published ones, and a small sweep
===================================================

Kaplan et al. (2020) fit the loss of language models as power laws of the
parameters, ``L(N) = (N_c / N)^α_N``, and of the data, ``L(D) = (D_c / D)^α_D``
(:data:`tfmath.formulas.scaling.KAPLAN_LAWS`). tfmath can train tiny
transformers too: on a synthetic language whose entropy is known exactly, the
loss above that entropy, ``L(N) - E``, falls as a power of ``N`` as well. The
runs here are a few hundred steps of models of a few thousand parameters, so
their exponent belongs to that short budget; ``tfmath reproduce`` trains
longer.
"""

import numpy as np

from tfmath.formulas.scaling import KAPLAN_LAWS, fit_scaling_law
from tfmath.plotting import new_figure, power_law, sweep_results
from tfmath.training import TrainingConfig, language_model_config
from tfmath.training.sweep import TrainingRun, run_sweep
from tfmath.training.synthetic import ZipfLexicon

# sphinx_gallery_thumbnail_number = 2

figure, axes = new_figure(11, 4.2, ncols=2)
power_law(KAPLAN_LAWS["N"], [1e6, 1e11], ax=axes[0, 0])
axes[0, 0].set(xlabel="non-embedding parameters N", ylabel="loss (nats per token)")
power_law(KAPLAN_LAWS["D"], [1e7, 1e12], ax=axes[0, 1], color="C1")
axes[0, 1].set(xlabel="tokens D", ylabel="loss (nats per token)")
for ax in axes[0]:
    ax.legend(fontsize=7)

# %%
# A sweep over the model width, on a Zipf-distributed lexicon of random words
# (its entropy per token is the loss no model can beat):
source = ZipfLexicon(n_letters=16, word_length=5, n_words=32768, zipf_exponent=1.2)
words = 8
context = words * source.tokens_per_word
runs = [
    TrainingRun(
        language_model_config(width, 1, vocab_size=source.vocab_size, context=context),
        source,
        TrainingConfig(steps=200, warmup=20, words_per_sequence=words, eval_every=100),
        "cpu",
    )
    for width in (8, 12, 16, 24, 32, 48)
]
# One worker: a script that starts worker processes must do so under
# ``if __name__ == "__main__":`` (see run_sweep), and these runs take seconds.
results = run_sweep(runs, workers=1)
n = np.array([r.non_embedding_parameters for r in results], dtype=float)
loss = np.array([r.validation_loss for r in results])
entropy = source.entropy_rate
fit = fit_scaling_law(n, loss, irreducible=entropy)
low, high = fit.exponent_interval
print(f"entropy E = {entropy:.3f} nats/token; fitted L(N) = E + (N_c/N)^alpha with "
      f"alpha = {fit.exponent:.3f}, 95% interval [{low:.3f}, {high:.3f}]")  # fmt: skip

ax = sweep_results(n, loss, fit, label="tiny transformers, 200 steps")
ax.axhline(entropy, color="grey", ls=":", label="entropy of the language (E)")
ax.legend(fontsize=8)

# %%
# Six widths pin the exponent to about a fifth of its value (four gave an
# interval wider than the exponent itself, with two degrees of freedom left).
