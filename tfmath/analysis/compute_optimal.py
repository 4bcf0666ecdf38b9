r"""How a fixed compute budget should be split between parameters and tokens, from runs.

Two of the methods of Hoffmann et al. (2022), "Training Compute-Optimal Large
Language Models" (arXiv:2203.15556), applied to any set of training runs:

* :func:`fit_isoflop` (their approach 2, IsoFLOP profiles): at each compute
  budget :math:`C`, models of several sizes :math:`N` are trained on
  :math:`D(N) \approx C / (6N)` tokens; a parabola in :math:`\log N` through
  each budget's final losses has its minimum at :math:`N_{opt}(C)`, where
  :math:`D_{opt}(C)` and :math:`L_{opt}(C)` are read off the same budget's runs.
  Straight lines through :math:`\log N_{opt}` and :math:`\log D_{opt}` against
  :math:`\log C` give :math:`N_{opt} \propto C^a` and :math:`D_{opt} \propto
  C^b`, and the minima trace the compute-efficient frontier :math:`L(C)`.
* :func:`fit_parametric_loss` (their approach 3): :math:`L(N, D) = E + A/N^\alpha
  + B/D^\beta` fitted to every run at once by minimising the Huber loss
  (:math:`\delta = 10^{-3}`) of :math:`\log L`, with L-BFGS started from the
  best points of their grid; its compute-optimal split follows in closed form
  (:meth:`tfmath.formulas.scaling.ChinchillaLaw.optimal`).

Both give intervals from a bootstrap. The IsoFLOP fit resamples residuals:
each budget's parabola plus residuals drawn with replacement from all the
budgets' residuals (inflated for the three coefficients each parabola spends),
so every resample keeps every size, and the whole fit is repeated. Resampling
the runs themselves within a budget leaves half the resamples of a 5-point
curve with 3 distinct sizes, and intervals about 2.4 times wider than the
estimator's spread; the residual bootstrap's are calibrated by simulation in
the tests. Approach 3 resamples the runs, and names the parameters the runs do
not determine (:attr:`ParametricLossFit.unidentified`: on a solver bound, or
belonging to a term that contributes nothing over the runs) instead of giving
them an interval. :func:`fit_kaplan_loss` fits Kaplan et al.'s (2020) pure power
law :math:`L(N, D)` (their equation 1.5) the same way.
"""

import math
from dataclasses import dataclass

import numpy as np

from tfmath._contract.checks import integer, real
from tfmath.errors import ArgumentError, ShapeError
from tfmath.formulas.scaling import ChinchillaLaw, fit_scaling_law

__all__ = [
    "IsoFlopCurve",
    "IsoFlopFit",
    "KaplanLossFit",
    "ParametricLossFit",
    "fit_isoflop",
    "fit_kaplan_loss",
    "fit_parametric_loss",
    "huber",
]

#: Hoffmann et al.'s Huber threshold on log-loss residuals (section 3.3).
HUBER_DELTA = 1e-3


# -- approach 2: IsoFLOP profiles --------------------------------------------------------


@dataclass(frozen=True)
class IsoFlopCurve:
    r"""One budget's parabola :math:`L = p_2 x^2 + p_1 x + p_0`, :math:`x = \log N`.

    Attributes
    ----------
    compute : float
        The budget :math:`C`.
    coefficients : tuple of float
        :math:`(p_2, p_1, p_0)`.
    n_opt, d_opt, loss_opt : float
        The vertex :math:`N_{opt} = e^{-p_1 / 2 p_2}`, the tokens there (a
        quadratic in :math:`\log N` through the budget's :math:`\log D`,
        evaluated at the vertex), and the parabola's minimum.
    inside : bool
        Whether :math:`N_{opt}` lies within the sizes trained at this budget
        (outside, the vertex is an extrapolation).
    """

    compute: float
    coefficients: tuple
    n_opt: float
    d_opt: float
    loss_opt: float
    inside: bool


@dataclass(frozen=True)
class IsoFlopFit:
    r"""Compute-optimal allocation from IsoFLOP profiles (see :func:`fit_isoflop`).

    Attributes
    ----------
    curves : tuple of IsoFlopCurve
        One per budget, in increasing :math:`C`.
    a, b : float
        :math:`N_{opt} \propto C^a`, :math:`D_{opt} \propto C^b`.
    a_interval, b_interval : tuple of float
        Bootstrap percentile intervals.
    n_coefficient, d_coefficient : float
        :math:`N_{opt} = k_N C^a`, :math:`D_{opt} = k_D C^b`.
    frontier : ScalingLawFit
        :math:`L_{opt}(C) = E + (C_c / C)^{\alpha_C}` through the curves' minima
        (:func:`tfmath.formulas.scaling.fit_scaling_law`, with the
        ``irreducible`` given to :func:`fit_isoflop`).
    confidence : float
    n_bootstrap : int
        Bootstrap refits that had a minimum on every curve (the others are
        dropped, and counted in ``n_bootstrap_dropped``).
    n_bootstrap_dropped : int
    skipped_budgets : tuple of float
        Budgets left out for want of a minimum (see ``skip_curves_without_minimum``).
    bootstrap_optima : numpy.ndarray
        Shape ``(n_bootstrap, curves, 3)``: each refit's :math:`\log N_{opt}`,
        :math:`\log D_{opt}` and :math:`L_{opt}` per budget, from which any
        derived quantity's interval follows (see :meth:`optimum_intervals`).
    """

    curves: tuple
    a: float
    b: float
    a_interval: tuple
    b_interval: tuple
    n_coefficient: float
    d_coefficient: float
    frontier: object
    confidence: float
    n_bootstrap: int
    n_bootstrap_dropped: int
    skipped_budgets: tuple
    bootstrap_optima: np.ndarray

    def optimum_intervals(self):
        """Percentile intervals per budget: a dict of ``"n_opt"``, ``"d_opt"``,
        ``"tokens_per_parameter"`` and ``"loss_opt"`` to arrays of shape ``(curves, 2)``."""
        tails = 100 * np.array([(1 - self.confidence) / 2, (1 + self.confidence) / 2])
        log_n, log_d, loss = np.moveaxis(self.bootstrap_optima, -1, 0)
        values = {
            "n_opt": np.exp(log_n),
            "d_opt": np.exp(log_d),
            "tokens_per_parameter": np.exp(log_d - log_n),
            "loss_opt": loss,
        }
        return {name: np.percentile(v, tails, axis=0).T for name, v in values.items()}

    def n_opt(self, compute):
        """The fitted :math:`N_{opt}(C)`."""
        return self.n_coefficient * np.asarray(compute, dtype=float) ** self.a

    def d_opt(self, compute):
        """The fitted :math:`D_{opt}(C)`."""
        return self.d_coefficient * np.asarray(compute, dtype=float) ** self.b


def fit_isoflop(
    compute,
    n,
    d,
    loss,
    *,
    irreducible=None,
    skip_curves_without_minimum=False,
    confidence=0.95,
    n_bootstrap=1000,
    seed=0,
):
    r"""Hoffmann et al.'s approach 2: parabolas through IsoFLOP profiles, then power laws.

    Parameters
    ----------
    compute : array_like, 1-D
        The budget of each run (runs of one budget share the same value; it
        groups the runs into curves).
    n, d, loss : array_like, 1-D
        Each run's parameters, training tokens and final loss.
    irreducible : None or float, optional
        :math:`E` of the frontier :math:`L_{opt}(C) = E + (C_c/C)^{\alpha_C}`:
        known (a number), or None for a pure power law.
    skip_curves_without_minimum : bool, optional
        Leave out budgets whose parabola opens downwards (noisy runs, or sizes
        that do not straddle the optimum) and list them in
        :attr:`IsoFlopFit.skipped_budgets`, instead of raising.
    confidence : float, optional
    n_bootstrap : int, optional
        Resamples of the runs, within each budget.
    seed : int, optional

    Returns
    -------
    IsoFlopFit

    Raises
    ------
    ShapeError
        For arrays of different lengths, or not 1-D.
    ArgumentError
        For non-positive values, fewer than two budgets, a budget with fewer
        than three distinct sizes, or a budget whose parabola has no minimum
        (it opens downwards: the sizes do not straddle the optimum).

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.analysis.compute_optimal import fit_isoflop
    >>> c = np.repeat([1e15, 1e16, 1e17], 5)
    >>> n_opt = 0.1 * c**0.5
    >>> n = n_opt * np.tile([0.25, 0.5, 1.0, 2.0, 4.0], 3)
    >>> loss = 2 + 0.1 * np.log(n / n_opt) ** 2 + (1e18 / c) ** 0.1
    >>> fit = fit_isoflop(c, n, c / (6 * n), loss, n_bootstrap=50)
    >>> round(fit.a, 6), round(fit.b, 6)
    (0.5, 0.5)
    """
    compute, n, d, loss = _runs(compute=compute, n=n, d=d, loss=loss)
    confidence = _confidence(confidence)
    n_bootstrap = integer("n_bootstrap", n_bootstrap, minimum=2)
    seed = integer("seed", seed, minimum=0)
    budgets = np.unique(compute)
    if budgets.size < 2:
        raise ArgumentError(f"fit_isoflop needs at least two budgets, got {budgets.size}")
    groups = [np.flatnonzero(compute == c) for c in budgets]
    for c, rows in zip(budgets, groups, strict=True):
        if np.unique(n[rows]).size < 3:
            raise ArgumentError(
                f"budget C = {c:g} has {np.unique(n[rows]).size} distinct sizes; a parabola "
                "needs at least 3"
            )
    curves = [_curve(c, n[r], d[r], loss[r]) for c, r in zip(budgets, groups, strict=True)]
    skipped = tuple(float(c) for c, curve in zip(budgets, curves, strict=True) if curve is None)
    if skipped and not skip_curves_without_minimum:
        raise ArgumentError(
            f"the IsoFLOP curves of C = {', '.join(f'{c:g}' for c in skipped)} have no minimum "
            "(their parabolas open downwards): train sizes on both sides of the optimum at "
            "every budget, or pass skip_curves_without_minimum=True"
        )
    kept = [k for k, curve in enumerate(curves) if curve is not None]
    if len(kept) < 2:
        raise ArgumentError(
            f"fit_isoflop needs two curves with a minimum, got {len(kept)} of {budgets.size}"
        )
    budgets = budgets[kept]
    groups = [groups[k] for k in kept]
    curves = [curves[k] for k in kept]
    a, log_kn, b, log_kd = _exponents(budgets, curves)
    draws, optima = _residual_bootstrap(budgets, groups, curves, n, d, loss, n_bootstrap, seed)
    dropped = n_bootstrap - len(draws)
    if not draws:
        raise ArgumentError(
            "no bootstrap resample had a minimum on every curve: the curves are too flat "
            "for their noise; train sizes further from the optimum, or more seeds"
        )
    draws = np.array(draws)
    tails = 100 * np.array([(1 - confidence) / 2, (1 + confidence) / 2])
    a_interval = tuple(float(v) for v in np.percentile(draws[:, 0], tails))
    b_interval = tuple(float(v) for v in np.percentile(draws[:, 1], tails))
    frontier = fit_scaling_law(
        budgets, [curve.loss_opt for curve in curves], irreducible=irreducible,
        confidence=confidence,
    )  # fmt: skip
    return IsoFlopFit(
        curves=tuple(curves),
        a=a,
        b=b,
        a_interval=a_interval,
        b_interval=b_interval,
        n_coefficient=math.exp(log_kn),
        d_coefficient=math.exp(log_kd),
        frontier=frontier,
        confidence=confidence,
        n_bootstrap=len(draws),
        n_bootstrap_dropped=dropped,
        skipped_budgets=skipped,
        bootstrap_optima=np.array(optima),
    )


def _residual_bootstrap(budgets, groups, curves, n, d, loss, n_bootstrap, seed):
    """Refits to each parabola plus pooled residuals drawn with replacement.

    Returns the exponents ``(a, b)`` of each refit with a minimum on every curve,
    and that refit's ``(log N_opt, log D_opt, L_opt)`` per curve.
    """
    fitted = [
        np.polyval(curve.coefficients, np.log(n[rows]))
        for curve, rows in zip(curves, groups, strict=True)
    ]
    residuals = np.concatenate([loss[rows] - f for rows, f in zip(groups, fitted, strict=True)])
    # Each parabola spends 3 degrees of freedom: residuals are smaller than the noise.
    spare = residuals.size - 3 * len(curves)
    residuals = residuals * math.sqrt(residuals.size / spare) if spare > 0 else residuals
    rng = np.random.default_rng(seed)
    draws, optima = [], []
    for _ in range(n_bootstrap):
        sample = [
            _curve(c, n[rows], d[rows], f + rng.choice(residuals, size=rows.size))
            for c, rows, f in zip(budgets, groups, fitted, strict=True)
        ]
        if any(curve is None for curve in sample):
            continue
        draws.append(_exponents(budgets, sample)[::2])
        optima.append([(math.log(c.n_opt), math.log(c.d_opt), c.loss_opt) for c in sample])
    return draws, optima


#: How far (in log N) a vertex may lie from the sizes trained, and the largest log
#: of a size or token count, before a parabola counts as having no minimum.
_MAX_VERTEX_DISTANCE = 50.0
_MAX_LOG = 700.0


def _curve(compute, n, d, loss):
    """One budget's :class:`IsoFlopCurve`, or None when its parabola has no minimum."""
    x = np.log(n)
    if np.unique(x).size < 3:
        return None
    p2, p1, p0 = np.polyfit(x, loss, 2)
    if not p2 > 0:
        return None
    vertex = -p1 / (2 * p2)
    # A nearly flat parabola puts its vertex at any distance (and exp() past the
    # float range): beyond 50 e-folds of the sizes trained it has no minimum to read.
    if not abs(vertex - x.mean()) < _MAX_VERTEX_DISTANCE:
        return None
    log_d = np.polyval(np.polyfit(x, np.log(d), 2), vertex)
    if not abs(log_d) < _MAX_LOG:
        return None
    return IsoFlopCurve(
        compute=float(compute),
        coefficients=(float(p2), float(p1), float(p0)),
        n_opt=math.exp(vertex),
        d_opt=math.exp(log_d),
        loss_opt=float(p0 - p1 * p1 / (4 * p2)),
        inside=bool(x.min() <= vertex <= x.max()),
    )


def _exponents(budgets, curves):
    """Slopes and intercepts of log N_opt and log D_opt against log C."""
    log_c = np.log(budgets)
    a, log_kn = np.polyfit(log_c, np.log([curve.n_opt for curve in curves]), 1)
    b, log_kd = np.polyfit(log_c, np.log([curve.d_opt for curve in curves]), 1)
    return float(a), float(log_kn), float(b), float(log_kd)


# -- approach 3: the parametric loss -----------------------------------------------------


def huber(residuals, delta=HUBER_DELTA):
    r"""The Huber loss :math:`\frac12 r^2` for :math:`|r| \le \delta`, else
    :math:`\delta (|r| - \frac12 \delta)`, elementwise: quadratic near zero and
    linear beyond, so a few outlying runs pull the fit far less than under
    least squares."""
    r = np.abs(np.asarray(residuals, dtype=float))
    return np.where(r <= delta, 0.5 * r * r, delta * (r - 0.5 * delta))


@dataclass(frozen=True)
class ParametricLossFit:
    r""":math:`L(N, D) = E + A/N^\alpha + B/D^\beta` fitted to runs (see
    :func:`fit_parametric_loss`).

    Attributes
    ----------
    law : ChinchillaLaw
        The fitted constants, whose :meth:`~ChinchillaLaw.optimal` gives the
        compute-optimal split under :math:`C = 6ND`.
    intervals : dict of str to (float, float)
        Bootstrap percentile intervals of ``"e"``, ``"a"``, ``"b"``,
        ``"alpha"``, ``"beta"``, ``"n_exponent"`` (:math:`\beta/(\alpha+\beta)`)
        and ``"d_exponent"``; for a known :math:`E`, ``"e"`` is that value twice.
        A parameter in :attr:`unidentified` has ``(nan, nan)``: no interval.
    at_bound : tuple of str
        The parameters (``"alpha"``, ``"beta"``, ``"e"``, ``"a"``, ``"b"``, and
        ``"n_exponent"``, ``"d_exponent"`` when alpha or beta is one) that the
        solver left on one of its bounds, in the fit or in more than
        :math:`(1 - \text{confidence})/2` of the refits: the data do not
        determine them, and the bound is not an interval end.
    unidentified : tuple of str
        Every parameter the runs do not determine, each with no interval: those
        :attr:`at_bound`, and ``"a"`` and ``"alpha"`` (``"b"`` and ``"beta"``)
        when the term :math:`A/N^\alpha` (:math:`B/D^\beta`) contributes
        nothing over the runs, in the fit or in more than
        :math:`(1 - \text{confidence})/2` of the refits, with ``"n_exponent"``
        and ``"d_exponent"`` (both depend on both exponents). A term contributes
        nothing when replacing it by its mean over the runs (a constant, which
        :math:`E` takes up) raises the objective by no more than the solver
        resolves (its stopping tolerance) or than the runs' scatter explains (an
        :math:`F` test at ``confidence``). Such a term's exponent is wherever
        the solver's road left it (at a bound, or anywhere its scale makes the
        term vanish), just as if it sat on a bound; and a fitted ``"e"`` is
        listed too, since such a term can carry any part of :math:`E`'s level
        (its exponent near 0, its scale a second :math:`E`). A superset of
        :attr:`at_bound`, in the order of :attr:`intervals`.
    irreducible_fitted : bool
    objective : float
        The summed Huber loss at the fit.
    confidence : float
    n_bootstrap : int
    """

    law: ChinchillaLaw
    intervals: dict
    at_bound: tuple
    unidentified: tuple
    irreducible_fitted: bool
    objective: float
    confidence: float
    n_bootstrap: int


#: Hoffmann et al.'s initialisation grid (appendix D.2) over (alpha, beta, e, a, b),
#: with e = log E, a = log A, b = log B.
_GRID = (
    np.arange(0.0, 2.01, 0.5),
    np.arange(0.0, 2.01, 0.5),
    np.arange(-1.0, 1.51, 0.5),
    np.arange(0.0, 25.1, 5.0),
    np.arange(0.0, 25.1, 5.0),
)
#: L-BFGS runs from this many of the grid's best points.
_STARTS = 16
#: Tolerances far below SciPy's defaults: with delta = 1e-3 the objective and its
#: gradient are tiny, and the default stopping rules end the search early, the
#: failure Besiroglu et al. (2024) found in Hoffmann et al.'s own fit.
_SOLVER_OPTIONS = {"ftol": 1e-15, "gtol": 1e-12, "maxiter": 5000}
#: Bounds that keep the solver where the model means something (positive
#: exponents, E neither vanishing nor huge).
_BOUNDS = ((1e-3, 4.0), (1e-3, 4.0), (-5.0, 5.0), (-20.0, 60.0), (-20.0, 60.0))


def fit_parametric_loss(
    n, d, loss, *, irreducible=None, delta=HUBER_DELTA, confidence=0.95, n_bootstrap=200, seed=0
):
    r"""Hoffmann et al.'s approach 3: :math:`L(N, D) = E + A/N^\alpha + B/D^\beta`.

    Minimises :math:`\sum_i \operatorname{Huber}_\delta\big(\operatorname{LSE}(a -
    \alpha \log N_i,\ b - \beta \log D_i,\ e) - \log L_i\big)` over
    :math:`(a, b, e, \alpha, \beta)` with :math:`A = e^a`, :math:`B = e^b`,
    :math:`E = e^e` (LSE the log-sum-exp), by L-BFGS-B from the 16 best points
    of the paper's grid, with the exact gradient; each bootstrap refit starts
    from the fit to all runs. Parameters the runs do not determine (on a
    solver bound, or belonging to a term that contributes nothing over the
    runs: see :attr:`ParametricLossFit.unidentified`) get no interval.

    Parameters
    ----------
    n, d, loss : array_like, 1-D
        Each run's parameters, tokens and final loss.
    irreducible : None or float, optional
        :math:`E` when it is known (a synthetic source's entropy rate), else fitted.
    delta : float, optional
    confidence : float, optional
    n_bootstrap : int, optional
        Refits to runs resampled with replacement.
    seed : int, optional

    Returns
    -------
    ParametricLossFit

    Raises
    ------
    ShapeError, ArgumentError
        For arrays of different lengths or non-positive values, fewer runs than
        fitted parameters, or a known :math:`E` not below every loss.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.analysis.compute_optimal import fit_parametric_loss
    >>> from tfmath.formulas.scaling import ChinchillaLaw
    >>> true = ChinchillaLaw(e=1.5, a=300.0, b=500.0, alpha=0.35, beta=0.3)
    >>> grid = np.meshgrid(np.geomspace(1e6, 1e9, 5), np.geomspace(1e8, 1e11, 5))
    >>> n, d = grid[0].ravel(), grid[1].ravel()
    >>> fit = fit_parametric_loss(n, d, true.loss(n, d), n_bootstrap=2)
    >>> round(fit.law.alpha, 3), round(fit.law.beta, 3), round(fit.law.e, 3)
    (0.35, 0.3, 1.5)
    """
    n, d, loss = _runs(n=n, d=d, loss=loss)
    delta = real("delta", delta, above=0.0)
    confidence = _confidence(confidence)
    n_bootstrap = integer("n_bootstrap", n_bootstrap, minimum=2)
    seed = integer("seed", seed, minimum=0)
    log_e = None
    if irreducible is not None:
        e = real("irreducible", irreducible, above=0.0)
        if not e < loss.min():
            raise ArgumentError(f"irreducible = {e} must lie below every loss (min {loss.min()})")
        log_e = math.log(e)
    n_parameters = 4 if log_e is not None else 5
    if n.size < n_parameters:
        raise ArgumentError(f"fitting {n_parameters} parameters needs as many runs, got {n.size}")
    data = (np.log(n), np.log(d), np.log(loss))
    theta, objective = _minimise(data, log_e, delta)
    rng = np.random.default_rng(seed)
    draws, flat = [], []
    for _ in range(n_bootstrap):
        rows = rng.integers(0, n.size, size=n.size)
        sample = tuple(x[rows] for x in data)
        # Each refit starts from the full fit: a resample moves the optimum a little.
        draw, value = _minimise(sample, log_e, delta, [theta])
        draws.append(draw)
        flat.append(_flat_terms(draw, sample, value, log_e, delta, confidence))
    law = _law(theta)
    tails = 100 * np.array([(1 - confidence) / 2, (1 + confidence) / 2])
    laws = [_law(t) for t in draws]
    columns = {
        "e": [x.e for x in laws],
        "a": [x.a for x in laws],
        "b": [x.b for x in laws],
        "alpha": [x.alpha for x in laws],
        "beta": [x.beta for x in laws],
        "n_exponent": [x.n_exponent for x in laws],
        "d_exponent": [x.d_exponent for x in laws],
    }
    share = (1 - confidence) / 2
    at_bound = _at_bound(theta, np.array(draws), log_e, share)
    flat = _flat_terms(theta, data, objective, log_e, delta, confidence) | (
        np.mean(flat, axis=0) > share
    )
    lost = set(at_bound)
    for vanished, names in zip(flat, (("a", "alpha"), ("b", "beta")), strict=True):
        if vanished:
            lost.update((*names, "n_exponent", "d_exponent"))
            # A term no different from a constant can carry any part of E's level (as
            # its exponent goes to 0 its scale is a second E): only E plus that level
            # is determined, and where E lands is the road's choice, not the runs'.
            if log_e is None:
                lost.add("e")
    unidentified = tuple(name for name in columns if name in lost)
    intervals = {
        name: (math.nan, math.nan)
        if name in lost
        else tuple(float(v) for v in np.percentile(values, tails))
        for name, values in columns.items()
    }
    return ParametricLossFit(
        law=law,
        intervals=intervals,
        at_bound=at_bound,
        unidentified=unidentified,
        irreducible_fitted=log_e is None,
        objective=objective,
        confidence=confidence,
        n_bootstrap=n_bootstrap,
    )


def _at_bound(theta, draws, log_e, share):
    """Names of the parameters on a solver bound in the fit or in over ``share`` of the draws."""
    low, high = np.array(_BOUNDS).T
    margin = 1e-6 * (high - low)

    def on_bound(values):
        return (values <= low + margin) | (values >= high - margin)

    hit = on_bound(theta) | (on_bound(draws).mean(axis=0) > share)
    if log_e is not None:
        hit[2] = False  # E is given, not fitted
    names = [name for name, h in zip(("alpha", "beta", "e", "a", "b"), hit, strict=True) if h]
    if hit[0] or hit[1]:
        names += ["n_exponent", "d_exponent"]
    return tuple(names)


def _flat_terms(theta, data, objective, log_e, delta, confidence):
    r"""Whether the fitted :math:`A/N^\alpha` and :math:`B/D^\beta` contribute nothing
    over the runs ``data``: a boolean array of two.

    The rule: replace the term by its mean over the runs (a constant, which :math:`E`
    takes up) and measure the rise :math:`\Delta` of the objective. The term
    contributes nothing when :math:`\Delta` is no more than either of

    * what the solver resolves: L-BFGS-B stops once a step gains less than
      ``ftol`` times :math:`\max(f, 1)`, so a term worth less than that is one it
      neither needs nor places; on exact data this is the floor;
    * what the runs' scatter explains: the :math:`F` test of the model without the
      term's shape (2 parameters fewer with :math:`E` fitted, :math:`A` and
      :math:`\alpha` merging into it; 1 with :math:`E` known, a constant replacing
      them) at ``confidence``, :math:`\Delta \le q f F_{q, n-p} / (n - p)`,
      exact for normal residuals within the Huber threshold.

    The reason: a term that cannot be told from a constant leaves its exponent
    undetermined, as a bound does; the solver's road decides whether the exponent
    lands on a bound, or anywhere while the scale makes the term vanish (exponent
    3.998, scale 0.2, the same optimum), but every road to the optimum leaves the
    same residuals, and so the same :math:`\Delta`. The other parameters stay where
    they are and the constant is the plain mean, not the best one, so
    :math:`\Delta` is at least the rise of a refit without the term: the rule errs
    towards keeping a term.
    """
    alpha, beta, log_e_fit, log_a, log_b = theta
    log_n, log_d, log_loss = data
    # In logs, as in _objective: log of each run's A/N^alpha, B/D^beta and E.
    logs = np.stack([log_a - alpha * log_n, log_b - beta * log_d, np.full_like(log_n, log_e_fit)])
    base = huber(_log_sum(logs) - log_loss, delta).sum()
    rise = np.array([
        huber(
            np.logaddexp(_log_sum(np.delete(logs, k, axis=0)),
                         _log_sum(logs[k]) - math.log(log_n.size)) - log_loss,
            delta,
        ).sum() - base
        for k in (0, 1)
    ])  # fmt: skip
    floor = _SOLVER_OPTIONS["ftol"] * max(objective, 1.0)
    fitted = 4 if log_e is not None else 5
    spare = log_loss.size - fitted
    if spare > 0:
        from scipy.stats import f as f_distribution

        dropped = 1 if log_e is not None else 2
        quantile = f_distribution.ppf(confidence, dropped, spare)
        floor = max(floor, dropped * objective * quantile / spare)
    return rise <= floor


def _log_sum(logs):
    """log(sum(exp(logs))) over the first axis, without overflow."""
    top = logs.max(axis=0)
    return top + np.log(np.exp(logs - top).sum(axis=0))


def _law(theta):
    alpha, beta, log_e, log_a, log_b = theta
    return ChinchillaLaw(
        e=math.exp(log_e), a=math.exp(log_a), b=math.exp(log_b), alpha=float(alpha),
        beta=float(beta), source="fit_parametric_loss",
    )  # fmt: skip


def _objective(theta, data, delta):
    """The summed Huber loss of log L and its gradient in (alpha, beta, e, a, b)."""
    alpha, beta, log_e, log_a, log_b = theta
    log_n, log_d, log_loss = data
    terms = np.stack([log_a - alpha * log_n, log_b - beta * log_d, np.full_like(log_n, log_e)])
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    residual = top + np.log(total) - log_loss
    weights /= total
    slope = np.clip(residual, -delta, delta)  # the Huber loss's derivative
    gradient = np.array([
        -(slope * weights[0] * log_n).sum(),
        -(slope * weights[1] * log_d).sum(),
        (slope * weights[2]).sum(),
        (slope * weights[0]).sum(),
        (slope * weights[1]).sum(),
    ])  # fmt: skip
    return float(huber(residual, delta).sum()), gradient


def _grid(log_e):
    """The initialisation grid as rows of (alpha, beta, e, a, b); e fixed when known."""
    axes = list(_GRID)
    if log_e is not None:
        axes[2] = np.array([log_e])
    return np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 5)


def _grid_objectives(grid, data, delta):
    """The summed Huber loss at every grid point at once (points x runs arrays)."""
    log_n, log_d, log_loss = data
    alpha, beta, log_e, log_a, log_b = (column[:, None] for column in grid.T)
    terms = np.stack([log_a - alpha * log_n, log_b - beta * log_d, log_e + 0 * log_n])
    top = terms.max(axis=0)
    predicted = top + np.log(np.exp(terms - top).sum(axis=0))
    return huber(predicted - log_loss, delta).sum(axis=1)


def _minimise(data, log_e, delta, starts=None):
    """The best of L-BFGS-B runs: ``(theta, objective)``. Started from ``starts``, or
    from the :data:`_STARTS` best points of the paper's grid."""
    from scipy.optimize import minimize

    if starts is None:
        grid = _grid(log_e)
        starts = grid[np.argsort(_grid_objectives(grid, data, delta))[:_STARTS]]
    bounds = list(_BOUNDS)
    if log_e is not None:
        bounds[2] = (log_e, log_e)
    low, high = np.array(bounds).T
    best_theta, best_value = None, math.inf
    for start in starts:
        result = minimize(
            _objective, np.clip(start, low, high), args=(data, delta), jac=True,
            method="L-BFGS-B", bounds=bounds, options=_SOLVER_OPTIONS,
        )  # fmt: skip
        if result.fun < best_value:
            best_theta, best_value = result.x, float(result.fun)
    return best_theta, best_value


# -- Kaplan et al.'s pure power law --------------------------------------------------------


@dataclass(frozen=True)
class KaplanLossFit:
    r"""Kaplan et al.'s (2020) equation 1.5, :math:`L(N, D) = \big[(N_c/N)^{\alpha_N/\alpha_D}
    + D_c/D\big]^{\alpha_D}`, fitted to runs (see :func:`fit_kaplan_loss`).

    Its limits are the pure power laws :math:`L(N) = (N_c/N)^{\alpha_N}` (data
    unlimited) and :math:`L(D) = (D_c/D)^{\alpha_D}` (model unlimited), with no
    irreducible term.

    Attributes
    ----------
    alpha_n, alpha_d, n_c, d_c : float
    intervals : dict of str to (float, float)
        Bootstrap percentile intervals of ``"alpha_n"``, ``"alpha_d"``, ``"n_c"``, ``"d_c"``.
    residual_std : float
        Of :math:`\log L`.
    confidence : float
    """

    alpha_n: float
    alpha_d: float
    n_c: float
    d_c: float
    intervals: dict
    residual_std: float
    confidence: float

    def loss(self, n, d):
        """:math:`L(N, D)` of the fit."""
        n, d = np.asarray(n, dtype=float), np.asarray(d, dtype=float)
        return ((self.n_c / n) ** (self.alpha_n / self.alpha_d) + self.d_c / d) ** self.alpha_d


def fit_kaplan_loss(n, d, loss, *, confidence=0.95, n_bootstrap=200, seed=0):
    r"""Kaplan et al.'s (2020) :math:`L(N, D)` (equation 1.5) by least squares in :math:`\log L`.

    Parameters
    ----------
    n, d, loss : array_like, 1-D
        Each run's non-embedding parameters, tokens and final loss.
    confidence : float, optional
    n_bootstrap : int, optional
        Refits to runs resampled with replacement.
    seed : int, optional

    Returns
    -------
    KaplanLossFit

    Raises
    ------
    ShapeError, ArgumentError
        For arrays of different lengths, non-positive values, or fewer than 5 runs.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.analysis.compute_optimal import fit_kaplan_loss
    >>> grid = np.meshgrid(np.geomspace(1e3, 1e6, 5), np.geomspace(1e5, 1e8, 5))
    >>> n, d = grid[0].ravel(), grid[1].ravel()
    >>> loss = ((8.8e13 / n) ** (0.076 / 0.095) + 5.4e13 / d) ** 0.095
    >>> fit = fit_kaplan_loss(n, d, loss, n_bootstrap=2)
    >>> round(fit.alpha_n, 4), round(fit.alpha_d, 4)
    (0.076, 0.095)
    """
    n, d, loss = _runs(n=n, d=d, loss=loss)
    confidence = _confidence(confidence)
    n_bootstrap = integer("n_bootstrap", n_bootstrap, minimum=2)
    seed = integer("seed", seed, minimum=0)
    if n.size < 5:
        raise ArgumentError(f"fitting 4 parameters needs at least 5 runs, got {n.size}")
    data = (np.log(n), np.log(d), np.log(loss))
    theta = _kaplan_minimise(data, None)
    residual = _kaplan_residuals(theta, *data)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n_bootstrap):
        rows = rng.integers(0, n.size, size=n.size)
        draws.append(_kaplan_minimise(tuple(x[rows] for x in data), theta))
    draws = np.array(draws)
    tails = 100 * np.array([(1 - confidence) / 2, (1 + confidence) / 2])
    columns = {
        "alpha_n": draws[:, 0], "alpha_d": draws[:, 1],
        "n_c": np.exp(draws[:, 2]), "d_c": np.exp(draws[:, 3]),
    }  # fmt: skip
    return KaplanLossFit(
        alpha_n=float(theta[0]), alpha_d=float(theta[1]),
        n_c=math.exp(theta[2]), d_c=math.exp(theta[3]),
        intervals={k: tuple(float(x) for x in np.percentile(v, tails)) for k, v in columns.items()},
        residual_std=float(residual.std()), confidence=confidence,
    )  # fmt: skip


def _kaplan_residuals(theta, log_n, log_d, log_loss):
    """log L of equation 1.5 minus the measured one.

    ``theta`` is ``(alpha_N, alpha_D, log N_c, log D_c)``.
    """
    alpha_n, alpha_d, log_nc, log_dc = theta
    terms = np.stack([(alpha_n / alpha_d) * (log_nc - log_n), log_dc - log_d])
    top = terms.max(axis=0)
    return alpha_d * (top + np.log(np.exp(terms - top).sum(axis=0))) - log_loss


def _kaplan_minimise(data, start):
    """Least squares from ``start``, or from the best of a small grid of exponents and scales."""
    from scipy.optimize import least_squares

    log_n, log_d, _ = data
    if start is None:
        grid = [
            (an, ad, log_n.max() + k, log_d.max() + k)
            for an in (0.05, 0.2, 0.5) for ad in (0.05, 0.2, 0.5) for k in (0.0, 5.0, 20.0)
        ]  # fmt: skip
        start = min(grid, key=lambda t: float((_kaplan_residuals(t, *data) ** 2).sum()))
    bounds = ([1e-4, 1e-4, -50.0, -50.0], [5.0, 5.0, 200.0, 200.0])
    start = np.clip(np.asarray(start, dtype=float), bounds[0], bounds[1])
    return least_squares(_kaplan_residuals, start, args=data, bounds=bounds).x


# -- checks ------------------------------------------------------------------------------


def _runs(**arrays):
    """The named per-run arrays as positive, finite 1-D float64 arrays of one length."""
    checked = []
    for name, value in arrays.items():
        array = np.asarray(value, dtype=np.float64)
        if array.ndim != 1:
            raise ShapeError(f"{name} must be 1-D (one value per run), got shape {array.shape}")
        if not np.all(np.isfinite(array) & (array > 0)):
            raise ArgumentError(f"{name} must be finite and positive for every run")
        checked.append(array)
    lengths = {name: array.size for name, array in zip(arrays, checked, strict=True)}
    if len(set(lengths.values())) > 1:
        raise ShapeError(f"one value per run in each array, got lengths {lengths}")
    return checked


def _confidence(confidence):
    confidence = real("confidence", confidence)
    if not 0 < confidence < 1:
        raise ArgumentError(f"confidence must lie in (0, 1), got {confidence}")
    return confidence
