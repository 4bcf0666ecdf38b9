"""
The compute-optimal frontier from a few tiny runs
=================================================

Hoffmann et al. (2022, "Chinchilla"): at each compute budget, train models of
several sizes ``N``, each on the tokens ``D`` the budget leaves it. The loss
against ``N`` is a valley (an IsoFLOP profile) whose bottom is the best size
for that budget. Their approach 3 fits one law to every run,
``L(N, D) = E + A / N^α + B / D^β``, whose optimum grows as
``N_opt ∝ C^a`` with ``a = β / (α + β)`` (they found about 0.46 to 0.5).
:func:`tfmath.analysis.compute_optimal.fit_parametric_loss` does this fit,
with bootstrap intervals. Here: three budgets, five one-layer models each,
trained for seconds on a synthetic language of known entropy ``E``. With so
few and so small runs the exponent's interval is wide; ``tfmath reproduce``
trains a larger grid.
"""

import numpy as np

from tfmath.analysis.compute_optimal import fit_parametric_loss
from tfmath.formulas.accounting import flops_per_token
from tfmath.plotting import new_figure, power_law, sweep_results
from tfmath.training import TrainingConfig, language_model_config
from tfmath.training.hierarchical import HierarchicalLanguage
from tfmath.training.sweep import TrainingRun, run_sweep

source = HierarchicalLanguage(seed=0)
words = 40 // source.tokens_per_word
context = words * source.tokens_per_word
batch = 32
budgets, runs = [], []
for budget in (6e9, 1.2e10, 2.4e10):
    for width in (8, 12, 16, 24, 32):
        model = language_model_config(width, 1, vocab_size=source.vocab_size, context=context)
        per_token = flops_per_token(model, n_ctx=context).training
        steps = round(budget / (per_token * batch * context))
        training = TrainingConfig(
            steps=steps, batch_size=batch, words_per_sequence=words, warmup=30,
            learning_rate_scale=0.5, eval_every=steps,
        )  # fmt: skip
        budgets.append(budget)
        runs.append(TrainingRun(model, source, training, "cpu"))

results = run_sweep(runs)
compute = np.array(budgets)
n = np.array([r.non_embedding_parameters for r in results], dtype=float)
d = np.array([r.tokens_seen for r in results], dtype=float)
loss = np.array([r.validation_loss for r in results])
entropy = results[0].entropy_rate
fit = fit_parametric_loss(n, d, loss, irreducible=entropy)
law = fit.law
low, high = fit.intervals["n_exponent"]
print(f"alpha = {law.alpha:.2f}, beta = {law.beta:.2f}: N_opt grows as C^{law.n_exponent:.2f} "
      f"(95% interval {low:.2f} to {high:.2f})")  # fmt: skip


# %%
# Left: each budget's runs, and the fitted law along that budget (``D`` falls
# as ``N`` grows, so that ``N D`` stays what the budget allows); stars mark
# each curve's bottom. Right: the loss at those bottoms against the compute,
# the frontier.

nd_per_flop = np.mean(n * d / compute)  # N D per FLOP: about 1/6, less attention's share


def along_budget(budget, sizes):
    """The fitted loss of models of ``sizes`` trained on what ``budget`` leaves them."""
    return law.loss(sizes, nd_per_flop * budget / sizes)


def frontier(budgets):
    """The lowest fitted loss each budget reaches, over model sizes."""
    sizes = np.geomspace(n.min() / 4, n.max() * 4, 400)
    return np.array([along_budget(b, sizes).min() for b in np.atleast_1d(budgets)])


figure, axes = new_figure(11, 4.4, ncols=2)
curves, best = axes[0]
unique_budgets = np.unique(compute)
for i, budget in enumerate(unique_budgets):
    here = compute == budget
    sweep_results(n[here], loss[here], label=f"C = {budget:.1e} FLOPs", color=f"C{i}", ax=curves)
    sizes = np.geomspace(n[here].min(), n[here].max(), 100)
    fitted = along_budget(budget, sizes)
    curves.plot(sizes, fitted, color=f"C{i}")
    curves.plot(sizes[fitted.argmin()], fitted.min(), "*", color=f"C{i}", ms=12)
curves.set_title(rf"IsoFLOP profiles; fit: $\alpha$ = {law.alpha:.2f}, $\beta$ = {law.beta:.2f}")
curves.legend(fontsize=8)

best.plot(unique_budgets, [loss[compute == b].min() for b in unique_budgets], "o", color="C3",
          label="best run of each budget")  # fmt: skip
optimum = f"the fitted law's optimum: N_opt ∝ C^{law.n_exponent:.2f} [{low:.2f}, {high:.2f}]"
power_law(frontier, unique_budgets, label=optimum, color="C3", ax=best)
best.axhline(entropy, color="grey", ls=":", label=f"entropy E = {entropy:.3f}")
best.set(xlabel="compute C (FLOPs)", ylabel="loss (nats per token)",
         title="The compute-efficient frontier")  # fmt: skip
best.legend(fontsize=8)
