r"""How a fixed compute budget should be split between parameters and tokens, from runs.

The three methods of Hoffmann et al. (2022), "Training Compute-Optimal Large
Language Models" (arXiv:2203.15556), applied to any set of training runs, each
also through one door, :func:`fit_compute_optimal`:

* :func:`fit_envelope` (their approach 1): the lowest loss any run's training
  curve reached at each compute; where it switches from one size to the next,
  the optimum lies between the two, and straight lines through those switches
  give :math:`N_{opt}(C)` and :math:`D_{opt}(C)`.
* :func:`fit_isoflop` (their approach 2, IsoFLOP profiles): at each compute
  budget :math:`C`, models of several sizes :math:`N` are trained on
  :math:`D(N) \approx C / (6N)` tokens; the lowest point of a model of each
  budget's valley, between the sizes trained, is :math:`N_{opt}(C)`, and
  straight lines through :math:`\log N_{opt}` and :math:`\log D_{opt}` against
  :math:`\log C` give :math:`N_{opt} \propto C^a` and :math:`D_{opt} \propto
  C^b`; the minima trace the compute-efficient frontier :math:`L(C)`.
* :func:`fit_parametric_loss` (their approach 3): :math:`L(N, D) = E + A/N^\alpha
  + B/D^\beta` fitted to every run at once by minimising the Huber loss
  (:math:`\delta = 10^{-3}`) of :math:`\log L`, with L-BFGS started from the
  best points of their grid; its compute-optimal split follows in closed form
  (:meth:`tfmath.formulas.scaling.ChinchillaLaw.optimal`).

All give intervals from a bootstrap. The envelope resamples each run's level
by its loss noise. The IsoFLOP fit resamples the loss noise
of the runs (given, or estimated from seeds), reads every optimum again, and
adds the scatter of the optima about the power law that the noise does not
explain (docs/scaling_laws.rst, "Approach 2 on anyone's runs", gives the
design and its calibration). Approach 3 resamples the runs, and names the
parameters the runs do not determine (:attr:`ParametricLossFit.unidentified`:
on a solver bound, or belonging to a term that contributes nothing over the
runs) instead of giving them an interval. :func:`fit_kaplan_loss` fits Kaplan
et al.'s (2020) pure power law :math:`L(N, D)` (their equation 1.5) the same way.
"""

import inspect
import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tfmath._blas_threads import blas_threads
from tfmath._contract.checks import choice, confidence_level, integer, real
from tfmath.errors import ArgumentError, FitWarning, ShapeError
from tfmath.formulas.scaling import ChinchillaLaw, fit_scaling_law

__all__ = [
    "APPROACHES",
    "ENVELOPE_POINTS",
    "OPTIMUM_MODELS",
    "ComputeOptimalFit",
    "EnvelopeFit",
    "IsoFlopCurve",
    "IsoFlopFit",
    "KaplanLossFit",
    "ParametricLossFit",
    "fit_compute_optimal",
    "fit_envelope",
    "fit_isoflop",
    "fit_kaplan_loss",
    "fit_parametric_loss",
    "huber",
]

#: Hoffmann et al.'s Huber threshold on log-loss residuals (section 3.3).
HUBER_DELTA = 1e-3


# -- approach 1: the envelope of training curves -----------------------------------------

#: Log-spaced budgets the envelope is read at (Hoffmann et al. read theirs at 1500).
ENVELOPE_POINTS = 1500
#: Resamples drawn at once in the envelope's bootstrap (runs x points x this many
#: losses in memory).
_ENVELOPE_CHUNK = 64


@dataclass(frozen=True)
class EnvelopeFit:
    r"""Compute-optimal allocation from the envelope of training curves (see
    :func:`fit_envelope`).

    Attributes
    ----------
    compute, n_opt, d_opt : numpy.ndarray
        Where the envelope changes size, increasing in :math:`C`: the budget, and
        the geometric means of the two sizes and of their tokens there (the
        optimum lies between two sizes that reach one loss).
    grid_compute, grid_loss, grid_n : numpy.ndarray
        The envelope at every budget it was read at: the lowest loss any run
        reached there, and that run's size.
    grid_run : tuple
        The label of that run at each of them (a tuple of labels where runs
        repeated over seeds entered as their mean curve).
    grid_readable : numpy.ndarray of bool
        Where the envelope says something of the optimum (see ``left_out``).
    a, b : float
        :math:`N_{opt} \propto C^a`, :math:`D_{opt} \propto C^b`: least-squares
        lines through the switches in log-log.
    a_interval, b_interval : tuple of float
        Bootstrap percentile intervals at ``confidence``.
    n_coefficient, d_coefficient : float
        :math:`N_{opt} = k_N C^a`, :math:`D_{opt} = k_D C^b`.
    confidence : float
    loss_std : float
        The loss noise of one run the bootstrap drew (the root mean square over
        the checkpoints when it was given per checkpoint).
    noise_source : str
        ``"given"``, ``"seed repeats"`` (the scatter of the final losses of the
        runs ``repeats`` marks as one configuration) or ``"curve roughness"`` (the
        residuals of parabolas through five neighbouring checkpoints of each
        curve).
    n_bootstrap : int
    left_out : tuple of (str, str)
        The stretches of :math:`C` where the envelope says nothing of the optimum,
        and why; runs with one checkpoint.
    """

    compute: np.ndarray
    n_opt: np.ndarray
    d_opt: np.ndarray
    grid_compute: np.ndarray
    grid_loss: np.ndarray
    grid_n: np.ndarray
    grid_run: tuple
    grid_readable: np.ndarray
    a: float
    b: float
    a_interval: tuple
    b_interval: tuple
    n_coefficient: float
    d_coefficient: float
    confidence: float
    loss_std: float
    noise_source: str
    n_bootstrap: int
    left_out: tuple

    def __repr__(self):
        percent = f"{100 * self.confidence:g}%"
        sizes = np.unique(self.grid_n[self.grid_readable])
        lines = [
            f"EnvelopeFit(approach 1, {sizes.size} sizes on the envelope, changing "
            f"{self.compute.size} times from C = {self.compute[0]:.3g} to {self.compute[-1]:.3g})",
            f"  N_opt ~ C^a: a = {self.a:.3f} {_bracket(self.a_interval)} ({percent})",
            f"  D_opt ~ C^b: b = {self.b:.3f} {_bracket(self.b_interval)}",
            f"  loss noise {self.loss_std:.3g} ({self.noise_source}); {self.n_bootstrap} resamples",
        ]
        lines += [f"  left out: {what}: {why}" for what, why in self.left_out]
        return "\n".join(lines)

    def n_opt_at(self, compute):
        """The fitted :math:`N_{opt}(C)`."""
        return self.n_coefficient * np.asarray(compute, dtype=float) ** self.a

    def d_opt_at(self, compute):
        """The fitted :math:`D_{opt}(C)`."""
        return self.d_coefficient * np.asarray(compute, dtype=float) ** self.b


def fit_envelope(
    run,
    compute,
    n,
    d,
    loss,
    *,
    repeats=None,
    loss_std=None,
    points=ENVELOPE_POINTS,
    confidence=0.95,
    n_bootstrap=1000,
    seed=0,
):
    r"""Hoffmann et al.'s approach 1: the envelope of training curves, then power laws.

    Each row is one checkpoint of one run: the run's label, the compute
    :math:`C` spent so far, the run's parameters :math:`N`, the tokens :math:`D`
    seen so far and the loss there. Each run's curve is interpolated linearly
    in :math:`L` against :math:`\log C` between its checkpoints (never beyond
    them); runs the caller marks as repeats of one configuration over seeds
    (``repeats``) enter as their mean curve, so that the envelope does not follow
    the luckiest seed. At ``points`` budgets log-spaced over the curves, the run with
    the lowest loss is on the envelope: its :math:`N` and its tokens at that
    :math:`C` are :math:`N_{opt}(C)` and :math:`D_{opt}(C)`, and straight lines
    through them in log-log give :math:`N_{opt} \propto C^a` and
    :math:`D_{opt} \propto C^b`. Runs of one size with schedules of several
    lengths (Hoffmann et al. trained four cosine cycles per size) let the
    envelope use each size where its schedule ends.

    Where the envelope's run is the smallest or the largest size whose curve
    reaches that :math:`C`, or fewer than three sizes reach it, a size not
    trained may be better: those budgets are left out (listed in
    :attr:`EnvelopeFit.left_out`), never read.

    The intervals come from the runs' noise: a run's seed moves its whole curve,
    so each resample shifts every curve by its own normal draw of ``loss_std``
    (given, else the scatter of the final losses of the ``repeats``, else the
    roughness of the curves), reads the envelope again and refits the lines.
    The switches are not independent (neighbouring ones share a size), so no
    interval is taken from the least-squares fit itself.

    Parameters
    ----------
    run : array_like, 1-D
        Which run each checkpoint belongs to (any labels: numbers or strings).
    compute, n, d, loss : array_like, 1-D
        Each checkpoint's compute spent, the run's parameters (one value per
        run), the tokens seen and the loss.
    repeats : array_like, 1-D, optional
        The configuration each checkpoint's run repeats (any labels): runs with
        one label are the same size and schedule trained with other seeds. None:
        every run is a configuration of its own, and the envelope takes the lowest
        of all (runs that differ in anything but the seed, a learning rate say,
        must not share a label).
    loss_std : None, float, array_like or callable, optional
        The standard deviation of a run's loss over seeds: one number, one per
        checkpoint, or a function of the loss array returning one per
        checkpoint. None: estimated (see above and :attr:`EnvelopeFit.noise_source`).
    points : int, optional
        Budgets the envelope is read at, log-spaced.
    confidence : float, optional
    n_bootstrap : int, optional
    seed : int, optional

    Returns
    -------
    EnvelopeFit

    Raises
    ------
    ShapeError
        For arrays of different lengths, or not 1-D.
    ArgumentError
        For non-positive values, a run whose ``n`` changes between checkpoints,
        repeats of different sizes or budgets, noise that cannot be estimated, or
        an envelope that changes size fewer than twice where it is read.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.analysis.compute_optimal import fit_envelope
    >>> sizes = np.geomspace(1e6, 1e9, 16)
    >>> tokens = np.geomspace(1e7, 1e12, 60)
    >>> run = np.repeat(np.arange(16), 60)
    >>> n, d = np.repeat(sizes, 60), np.tile(tokens, 16)
    >>> loss = 1.7 + 400 / n**0.34 + 400 / d**0.28
    >>> fit = fit_envelope(run, 6 * n * d, n, d, loss, loss_std=0.001, n_bootstrap=50)
    >>> round(fit.a, 2), round(0.28 / (0.34 + 0.28), 2)
    (0.45, 0.45)
    """
    compute, n, d, loss = _runs(compute=compute, n=n, d=d, loss=loss)
    labels = np.asarray(run)
    if labels.shape != compute.shape:
        raise ShapeError(
            f"run must give one label per checkpoint ({compute.size}), got shape {labels.shape}"
        )
    repeated = labels if repeats is None else np.asarray(repeats)
    if repeated.shape != compute.shape:
        raise ShapeError(
            f"repeats must give one label per checkpoint ({compute.size}), got shape "
            f"{repeated.shape}"
        )
    points = integer("points", points, minimum=2)
    confidence = confidence_level(confidence)
    n_bootstrap = integer("n_bootstrap", n_bootstrap, minimum=2)
    seed = integer("seed", seed, minimum=0)
    row_std = _loss_std(loss_std, loss)
    names, index = np.unique(labels, return_inverse=True)
    curves, left_out = [], []
    for k, name in enumerate(names.tolist()):
        rows = np.flatnonzero(index == k)
        rows = rows[np.argsort(compute[rows], kind="stable")]
        if np.ptp(n[rows]) > 0:
            raise ArgumentError(
                f"run {name!r} has more than one n ({np.unique(n[rows])}): each run is one size"
            )
        if rows.size < 2 or compute[rows[-1]] == compute[rows[0]]:
            left_out.append((f"run {name!r}", "one checkpoint: no curve to read"))
            continue
        curves.append((name, rows))
    configurations = _configurations(curves, repeated, n, compute)
    if len(curves) < 3:
        raise ArgumentError(f"fit_envelope needs curves of three runs at least, got {len(curves)}")
    if row_std is None:
        noise_source, noise = _curve_noise(compute, loss, curves, configurations)
        row_std = np.full(loss.size, noise)
    else:
        noise_source = "given"
    log_c = np.log(compute)
    grid = np.linspace(
        min(log_c[rows[0]] for _, rows in curves),
        max(log_c[rows[-1]] for _, rows in curves),
        points,
    )
    on_grid, sizes, group_labels = _mean_curves(grid, curves, configurations, log_c, n, d, loss,
                                                row_std)  # fmt: skip
    reached = ~np.isnan(on_grid["loss"])
    smallest = np.where(reached, sizes[:, None], np.inf).min(axis=0)
    largest = np.where(reached, sizes[:, None], -np.inf).max(axis=0)
    distinct = np.array([np.unique(sizes[column]).size for column in reached.T])
    loss_on_grid = on_grid["loss"]

    def envelope(losses):
        """The envelope's run per grid point, and which points say something."""
        winner = np.argmin(np.where(np.isnan(losses), np.inf, losses), axis=-2)
        n_win = sizes[winner]
        readable = (distinct >= 3) & (n_win > smallest) & (n_win < largest)
        return winner, readable

    winner, readable = envelope(loss_on_grid)
    stretches = (
        _stretches(grid, distinct < 3, "fewer than three sizes reach these budgets")
        + _stretches(
            grid,
            (distinct >= 3) & (sizes[winner] == smallest),
            "the envelope is on the smallest size that reaches them",
        )
        + _stretches(
            grid,
            (distinct >= 3) & (sizes[winner] == largest),
            "the envelope is on the largest size that reaches them",
        )
    )
    left_out += [item for _, item in sorted(stretches, key=lambda pair: pair[0])]
    columns = np.arange(points)
    log_d_on_envelope = on_grid["log_d"][winner, columns]
    x, log_n_opt, log_d_opt = _switches(grid, np.log(sizes), winner, readable, log_d_on_envelope)
    if x.size < 2:
        raise ArgumentError(
            f"fit_envelope: the envelope changes size {x.size} time(s) where it says something "
            "of the optimum, and a line needs two; train sizes on both sides of the optimum "
            "over a wider range of budgets" + "".join(f"; {what}: {why}" for what, why in left_out)
        )
    a, log_kn = np.polyfit(x, log_n_opt, 1)
    b, log_kd = np.polyfit(x, log_d_opt, 1)

    rng = np.random.default_rng(seed)
    slopes = []
    for start in range(0, n_bootstrap, _ENVELOPE_CHUNK):
        count = min(_ENVELOPE_CHUNK, n_bootstrap - start)
        shifts = rng.standard_normal((count, sizes.size, 1)) * on_grid["std"]
        chosen, ok = envelope(loss_on_grid + shifts)
        for pick, keep in zip(chosen, ok, strict=True):
            found = _switches(grid, np.log(sizes), pick, keep, on_grid["log_d"][pick, columns])
            if found[0].size >= 2:
                slopes.append([_slope(found[0], found[1]), _slope(found[0], found[2])])
    if len(slopes) < n_bootstrap / 2:
        raise ArgumentError(
            f"fit_envelope: in {n_bootstrap - len(slopes)} of {n_bootstrap} resamples the "
            "envelope changed size fewer than twice where readable; the runs cannot fix "
            "the exponents"
        )
    tails = 100 * np.array([(1 - confidence) / 2, (1 + confidence) / 2])
    a_interval, b_interval = (
        tuple(float(v) for v in bounds) for bounds in np.percentile(slopes, tails, axis=0).T
    )
    return EnvelopeFit(
        compute=np.exp(x),
        n_opt=np.exp(log_n_opt),
        d_opt=np.exp(log_d_opt),
        grid_compute=np.exp(grid),
        grid_loss=loss_on_grid[winner, columns],
        grid_n=sizes[winner],
        grid_run=tuple(group_labels[k] for k in winner),
        grid_readable=readable,
        a=float(a),
        b=float(b),
        a_interval=a_interval,
        b_interval=b_interval,
        n_coefficient=math.exp(log_kn),
        d_coefficient=math.exp(log_kd),
        confidence=confidence,
        loss_std=float(np.sqrt(np.mean(row_std**2))),
        noise_source=noise_source,
        n_bootstrap=len(slopes),
        left_out=tuple(left_out),
    )


def _configurations(curves, repeated, n, compute):
    """The curves grouped by the configuration they repeat: lists of indices into
    ``curves``, each group of one size and one final budget."""
    groups = {}
    for k, (name, rows) in enumerate(curves):
        labels = np.unique(repeated[rows])
        if labels.size > 1:
            raise ArgumentError(f"run {name!r} has more than one repeats label: {labels}")
        groups.setdefault(labels[0].item(), []).append(k)
    for label, group in groups.items():
        ends = {(n[curves[k][1][0]], compute[curves[k][1][-1]]) for k in group}
        if len(ends) > 1:
            raise ArgumentError(
                f"the runs repeating {label!r} differ in size or final budget ({sorted(ends)}); "
                "repeats are one configuration trained with other seeds"
            )
    return list(groups.values())


def _mean_curves(grid, curves, configurations, log_c, n, d, loss, row_std):
    """``(curves on the grid, their sizes, their labels)``: L, log D and the noise of
    each configuration at every grid point, NaN beyond its checkpoints; the repeats of
    a configuration enter as their mean, as approach 2 takes the mean loss of each
    size: the envelope of the runs themselves would follow the luckiest seed."""
    each = {
        name: np.array(
            [
                np.interp(grid, log_c[rows], values[rows], left=np.nan, right=np.nan)
                for _, rows in curves
            ]
        )
        for name, values in (("loss", loss), ("log_d", np.log(d)), ("variance", row_std**2))
    }
    on_grid = {
        "loss": np.array([each["loss"][group].mean(axis=0) for group in configurations]),
        "log_d": np.array([each["log_d"][group].mean(axis=0) for group in configurations]),
        "std": np.array(
            [np.sqrt(each["variance"][group].sum(axis=0)) / len(group) for group in configurations]
        ),
    }
    labels = [
        curves[group[0]][0] if len(group) == 1 else tuple(curves[k][0] for k in group)
        for group in configurations
    ]
    sizes = np.array([n[curves[group[0]][1][0]] for group in configurations])
    return on_grid, sizes, labels


def _switches(grid, log_sizes, winner, readable, log_d):
    """``(log C, log N_opt, log D_opt)`` where the envelope changes size between two
    readable neighbouring points: there the two sizes reach the same loss, so the
    optimum lies between them, at their geometric mean where the valley is symmetric
    in log N over one step (its asymmetry shifts every switch alike, and so leaves the
    slope). The staircase itself would not do: a line through K whole steps of it is
    tilted by about -a / K^2, and through cut steps by wherever the cuts fall."""
    j = np.flatnonzero(readable[1:] & readable[:-1] & (winner[1:] != winner[:-1]))
    j = j[log_sizes[winner[j]] != log_sizes[winner[j + 1]]]
    return (
        0.5 * (grid[j] + grid[j + 1]),
        0.5 * (log_sizes[winner[j]] + log_sizes[winner[j + 1]]),
        0.5 * (log_d[j] + log_d[j + 1]),
    )


def _slope(x, y):
    """The least-squares slope of ``y`` against ``x``."""
    x = x - x.mean()
    return float(x @ (y - y.mean()) / (x @ x))


def _stretches(grid, mask, why):
    """``(first point, (range of C, why))`` for each run of consecutive True points in ``mask``."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [
        (start, (f"C from {math.exp(grid[start]):.3g} to {math.exp(grid[stop - 1]):.3g}", why))
        for start, stop in zip(edges[::2], edges[1::2], strict=True)
    ]


def _curve_noise(compute, loss, curves, configurations):
    """``(source, std)`` of a run's loss: from the repeats' final losses if any
    configuration was repeated, else from the curves' roughness."""
    repeats = [np.array([loss[curves[k][1][-1]] for k in group]) for group in configurations]
    repeats = [group for group in repeats if group.size > 1]
    if repeats:
        squares = sum(float(np.sum((g - g.mean()) ** 2)) for g in repeats)
        return "seed repeats", math.sqrt(squares / sum(g.size - 1 for g in repeats))
    std = _local_fit_noise([(np.log(compute[rows]), loss[rows]) for _, rows in curves])
    if std is None:
        raise ArgumentError(
            "cannot estimate the loss noise: no configuration was repeated (repeats) and no "
            f"curve has {2 * _WINDOW_HALF_WIDTH + 1} checkpoints; give loss_std"
        )
    return "curve roughness", std


# -- approach 2: IsoFLOP profiles --------------------------------------------------------

#: How each budget's optimum is read off its runs (see :func:`fit_isoflop`).
OPTIMUM_MODELS = ("auto", "akima", "local_parabola", "parabola")

#: A budget whose minimum leaves the sizes trained in more than this share of the
#: resamples is left out; beyond ``_WARN_DROPPED`` of them lost, the fit warns.
_MAX_EDGE_SHARE = 0.5
_WARN_DROPPED = 0.1
#: Sizes on each side of the lowest run in a local parabola's window, and of the centre
#: of the parabolas that estimate the loss noise.
_WINDOW_HALF_WIDTH = 2


@dataclass(frozen=True)
class IsoFlopCurve:
    r"""One budget's runs and the optimum read off them (see :func:`fit_isoflop`).

    Attributes
    ----------
    compute : float
        The budget :math:`C` (the geometric mean of its runs' budgets when they
        were grouped by a tolerance or by bins).
    sizes : tuple of float
        The distinct :math:`N` trained at this budget, increasing.
    losses : tuple of float
        The mean final loss at each size (over the runs repeated at that size).
    loss_std : tuple of float
        The noise of each of those means (what the resamples draw).
    optimum : str
        The model of the valley: ``"akima"``, ``"local_parabola"`` or ``"parabola"``.
    n_opt, d_opt, loss_opt : float
        The model's minimum :math:`N_{opt}` (always between the smallest and the
        largest size trained), the tokens there (interpolated in
        :math:`\log D` against :math:`\log N` between the runs) and the loss
        there.
    """

    compute: float
    sizes: tuple
    losses: tuple
    loss_std: tuple
    optimum: str
    n_opt: float
    d_opt: float
    loss_opt: float

    def loss_at(self, n):
        """The model of the valley at sizes ``n`` (NaN outside the sizes it was fitted to)."""
        model = _valley_model(self.optimum, np.log(self.sizes), np.asarray(self.losses))
        return model(np.log(np.asarray(n, dtype=float)))


@dataclass(frozen=True)
class IsoFlopFit:
    r"""Compute-optimal allocation from IsoFLOP profiles (see :func:`fit_isoflop`).

    Attributes
    ----------
    curves : tuple of IsoFlopCurve
        One per budget kept, in increasing :math:`C`.
    a, b : float
        :math:`N_{opt} \propto C^a`, :math:`D_{opt} \propto C^b`.
    a_interval, b_interval : tuple of float
        Bootstrap percentile intervals at ``confidence``.
    n_coefficient, d_coefficient : float
        :math:`N_{opt} = k_N C^a`, :math:`D_{opt} = k_D C^b`.
    frontier : ScalingLawFit
        :math:`L_{opt}(C) = E + (C_c / C)^{\alpha_C}` through the curves' minima
        (:func:`tfmath.formulas.scaling.fit_scaling_law`, with the
        ``irreducible`` given to :func:`fit_isoflop`).
    confidence : float
    optimum : str
        The model of each valley.
    loss_std : float
        The loss noise of one run the bootstrap drew (the root mean square over
        runs when it was given per run).
    noise_source : str
        Where ``loss_std`` came from: ``"given"``, ``"seed repeats"`` (the
        scatter of runs repeated at one size and budget) or ``"local fits"``
        (the residuals of parabolas through each run and its two neighbours on
        each side).
    scatter : float
        The scatter of :math:`\log N_{opt}` about the power law beyond what the
        loss noise explains (0 when the noise explains it all), added to each
        budget's variance in the weights and to every resample.
    n_bootstrap : int
        Resamples the intervals were built from.
    n_bootstrap_dropped : int
        Resamples lost because a kept budget's minimum left its sizes in them.
    left_out : tuple of (float, str)
        Each budget left out, with the reason.
    skipped_budgets : tuple of float
        The budgets of ``left_out``.
    bootstrap_optima : numpy.ndarray
        Shape ``(n_bootstrap, curves, 3)``: each resample's :math:`\log N_{opt}`,
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
    optimum: str
    loss_std: float
    noise_source: str
    scatter: float
    n_bootstrap: int
    n_bootstrap_dropped: int
    left_out: tuple
    skipped_budgets: tuple
    bootstrap_optima: np.ndarray

    def __repr__(self):
        percent = f"{100 * self.confidence:g}%"
        lines = [
            f"IsoFlopFit(approach 2, {len(self.curves)} budgets, optimum={self.optimum!r})",
            f"  N_opt ~ C^a: a = {self.a:.3f} [{self.a_interval[0]:.3f}, "
            f"{self.a_interval[1]:.3f}] ({percent})",
            f"  D_opt ~ C^b: b = {self.b:.3f} [{self.b_interval[0]:.3f}, {self.b_interval[1]:.3f}]",
            f"  loss noise {self.loss_std:.3g} ({self.noise_source}); scatter of log N_opt "
            f"beyond it {self.scatter:.3g}; {self.n_bootstrap} resamples"
            + (f", {self.n_bootstrap_dropped} dropped" if self.n_bootstrap_dropped else ""),
        ]
        lines += [f"  left out: C = {c:.3g}: {why}" for c, why in self.left_out]
        return "\n".join(lines)

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

    def exponent_drift(self):
        r"""Whether :math:`a` depends on the budgets sampled: how much the local
        exponent :math:`d \log N_{opt} / d \log C` changes per decade of :math:`C`,
        from a parabola in :math:`\log C` through the optima (least squares, each
        budget weighted by the inverse variance of its resampled optimum), with a
        percentile interval at ``confidence`` from the same fit to each resample's
        optima.

        A power law's drift is 0, and the interval then holds 0 as often as
        ``confidence`` says; an interval that excludes it says the optima bend
        across the budgets beyond their loss noise, so that :math:`a` is an average
        over the range sampled, and the line's :attr:`scatter` is partly that bend.
        Counting :math:`N` without parameters that every model has (the embeddings)
        makes the drift negative at small scale: :math:`N_{opt} = G C^a - N_{emb}`
        has the local exponent :math:`a G C^a / (G C^a - N_{emb})`, above :math:`a`
        and falling towards it (Pearce and Song 2024).

        Returns
        -------
        dict
            ``"per_decade"`` and its ``"interval"``; ``"first"`` and ``"last"``, the
            parabola's local exponents at the first and the last budget, whose
            ``"budgets"`` it also gives.
        """
        if len(self.curves) < 4:
            raise ArgumentError(
                f"the exponent's drift needs four budgets or more (a parabola and its "
                f"noise), this fit has {len(self.curves)}"
            )
        log_c = np.log([curve.compute for curve in self.curves])
        x = log_c - log_c.mean()
        resampled = self.bootstrap_optima[..., 0]
        weights = np.sqrt(1 / np.maximum(resampled.var(axis=0), 1e-12))
        # The weighted least-squares fit is linear in the optima: one matrix maps a set
        # of optima to the parabola's coefficients (x^2, x, 1).
        basis = np.stack([x**2, x, np.ones_like(x)], axis=1)
        solve = np.linalg.pinv(basis * weights[:, None]) * weights[None, :]
        curvature, slope, _ = solve @ np.log([curve.n_opt for curve in self.curves])
        per_decade = 2 * math.log(10) * (resampled @ solve[0])
        tails = 100 * np.array([(1 - self.confidence) / 2, (1 + self.confidence) / 2])
        return {
            "per_decade": float(2 * math.log(10) * curvature),
            "interval": tuple(float(v) for v in np.percentile(per_decade, tails)),
            "first": float(slope + 2 * curvature * x[0]),
            "last": float(slope + 2 * curvature * x[-1]),
            "budgets": (self.curves[0].compute, self.curves[-1].compute),
        }

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
    optimum="auto",
    loss_std=None,
    budget_tolerance=0.0,
    budget_edges=None,
    irreducible=None,
    skip_curves_without_minimum=True,
    confidence=0.95,
    n_bootstrap=1000,
    seed=0,
):
    r"""Hoffmann et al.'s approach 2: each budget's optimum from its runs, then power laws.

    The runs are grouped into budgets (equal :math:`C`, or :math:`C` within
    ``budget_tolerance`` of each other, or the bins ``budget_edges``). At each
    budget the mean loss of each size is modelled against :math:`x = \log N`
    in :math:`\log L` (``optimum``):

    * ``"akima"`` (default): Akima's piecewise cubic through every size, which
      follows the valley's own shape (asymmetric, or flat on one side as
      byte-level models are) without overshooting; its lowest point between
      the sizes is :math:`N_{opt}`. Porian et al. (2024) read their optima the
      same way.
    * ``"local_parabola"``: a parabola through the lowest size and its two
      neighbours on each side.
    * ``"parabola"``: one parabola through every size (Hoffmann et al.'s
      fit), biased wherever the valley is not a parabola over the whole span.

    A budget whose lowest run is its smallest or largest size, or whose model
    has no minimum between the sizes, has no optimum to read: it is left out
    (listed in :attr:`IsoFlopFit.left_out`, with a :class:`~tfmath.errors.FitWarning`),
    never extrapolated. :math:`D_{opt}` interpolates :math:`\log D` between
    the runs at :math:`N_{opt}`.

    Intervals come from the loss noise: each resample adds to every size's
    mean loss normal noise of its standard deviation (``loss_std``, else the
    scatter of runs repeated over seeds, else the residuals of local parabolas
    through five neighbouring sizes) and reads every optimum again. The power
    laws :math:`\log N_{opt} = a \log C + \log k_N` (and likewise for
    :math:`D`) are fitted by weighted least squares, each budget weighted by
    the inverse of its optimum's variance over the resamples plus the scatter
    of the optima about the line that the noise does not explain (a common
    variance, chosen so that the weighted residuals have their expected sum;
    zero when the noise explains them). Each resample draws that scatter too,
    from its estimate's :math:`\chi^2` distribution, so the intervals hold the
    uncertainty of the line as well as of the optima.

    Parameters
    ----------
    compute : array_like, 1-D
        The budget of each run.
    n, d, loss : array_like, 1-D
        Each run's parameters, training tokens and final loss.
    optimum : {"akima", "local_parabola", "parabola"}, optional
        The model of each budget's valley (see above).
    loss_std : None, float, array_like or callable, optional
        The standard deviation of a run's final loss over seeds: one number, one
        per run, or a function of the loss array returning one per run. None:
        estimated from the runs (see above, and :attr:`IsoFlopFit.noise_source`).
    budget_tolerance : float, optional
        Runs whose budgets differ by at most this fraction of the smaller are one
        budget (0: equal budgets only). For budgets read off a figure.
    budget_edges : None or array_like, optional
        Increasing bin edges: the runs with :math:`C` in ``[edges[i], edges[i+1])``
        are one budget; runs outside every bin are left out. Overrides
        ``budget_tolerance``.
    irreducible : None or float, optional
        :math:`E` of the frontier :math:`L_{opt}(C) = E + (C_c/C)^{\alpha_C}`:
        known (a number), or None for a pure power law.
    skip_curves_without_minimum : bool, optional
        True (default): leave out budgets with no optimum to read, and warn.
        False: raise instead.
    confidence : float, optional
    n_bootstrap : int, optional
        Resamples of the loss noise.
    seed : int, optional

    Returns
    -------
    IsoFlopFit

    Raises
    ------
    ShapeError
        For arrays of different lengths, or not 1-D.
    ArgumentError
        For non-positive values, an unknown ``optimum``, a ``loss_std`` that is
        not positive for every run, fewer than two budgets with an optimum, or
        (with ``skip_curves_without_minimum=False``) a budget without one.

    Warns
    -----
    FitWarning
        When budgets are left out, or more than 10% of the resamples are lost
        to a minimum leaving its sizes.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.analysis.compute_optimal import fit_isoflop
    >>> c = np.repeat([1e15, 1e16, 1e17], 5)
    >>> n_opt = 0.1 * c**0.5
    >>> n = n_opt * np.tile([0.25, 0.5, 1.0, 2.0, 4.0], 3)
    >>> loss = 2 + 0.1 * np.log(n / n_opt) ** 2 + (1e18 / c) ** 0.1
    >>> fit = fit_isoflop(c, n, c / (6 * n), loss, loss_std=0.01, n_bootstrap=50)
    >>> round(fit.a, 6), round(fit.b, 6)
    (0.5, 0.5)
    """
    compute, n, d, loss = _runs(compute=compute, n=n, d=d, loss=loss)
    optimum = choice("optimum", optimum, OPTIMUM_MODELS)
    run_std = _loss_std(loss_std, loss)
    confidence = confidence_level(confidence)
    n_bootstrap = integer("n_bootstrap", n_bootstrap, minimum=2)
    seed = integer("seed", seed, minimum=0)
    budgets, groups, outside = _budget_groups(compute, budget_tolerance, budget_edges)
    profiles = [_profile(n[rows], d[rows], loss[rows]) for rows in groups]
    if run_std is None:
        noise_source, noise = _estimated_noise(profiles)
        run_std = np.full(loss.size, noise)
    else:
        noise_source = "given"
    sigmas = [np.sqrt(np.bincount(p.index, run_std[rows] ** 2) / p.count**2)
              for p, rows in zip(profiles, groups, strict=True)]  # fmt: skip
    if optimum == "auto":
        optimum = "parabola" if _parabolas_fit(profiles, sigmas) else "akima"
    left_out = [(float(c), "outside every bin of budget_edges") for c in outside]
    rng = np.random.default_rng(seed)
    kept = []
    for c, profile, sigma in zip(budgets, profiles, sigmas, strict=True):
        reason, curve, draws = _budget_optimum(c, profile, sigma, optimum, n_bootstrap, rng)
        if reason is None:
            kept.append((curve, draws))
        else:
            left_out.append((float(c), reason))
    left_out.sort()
    if left_out and not skip_curves_without_minimum:
        raise ArgumentError(
            "no optimum to read at "
            + "; ".join(f"C = {c:.4g} ({why})" for c, why in left_out)
            + ": train sizes on both sides of the optimum, or pass "
            "skip_curves_without_minimum=True to leave these budgets out"
        )
    if len(kept) < 2:
        raise ArgumentError(
            f"fit_isoflop needs two budgets with an optimum between their sizes, got "
            f"{len(kept)} of {len(budgets)}"
            + "".join(f"; C = {c:.4g}: {why}" for c, why in left_out)
        )
    if left_out:
        warnings.warn(
            f"fit_isoflop left out {len(left_out)} budget(s): "
            + "; ".join(f"C = {c:.4g} ({why})" for c, why in left_out),
            FitWarning,
            stacklevel=2,
        )
    curves = [curve for curve, _ in kept]
    draws = [draw for _, draw in kept]
    used = min(len(draw) for draw in draws)
    dropped = n_bootstrap - used
    if dropped > _WARN_DROPPED * n_bootstrap:
        warnings.warn(
            f"fit_isoflop: {dropped} of {n_bootstrap} resamples lost a minimum between the "
            "sizes trained at some budget; the intervals stand on the other "
            f"{used}. Sizes further past each optimum, or less noise, would keep them.",
            FitWarning,
            stacklevel=2,
        )
    optima = np.stack([draw[:used] for draw in draws], axis=1)  # (used, curves, 3)
    log_c = np.log([curve.compute for curve in curves])
    fits = [
        _power_law(log_c, np.log([getattr(curve, name) for curve in curves]),
                   optima[:, :, column], confidence, rng)
        for name, column in (("n_opt", 0), ("d_opt", 1))
    ]  # fmt: skip
    (a, log_kn, a_interval, scatter), (b, log_kd, b_interval, _) = fits
    frontier = fit_scaling_law(
        [curve.compute for curve in curves], [curve.loss_opt for curve in curves],
        irreducible=irreducible, confidence=confidence,
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
        optimum=optimum,
        loss_std=float(np.sqrt(np.mean(run_std**2))),
        noise_source=noise_source,
        scatter=scatter,
        n_bootstrap=used,
        n_bootstrap_dropped=dropped,
        left_out=tuple(left_out),
        skipped_budgets=tuple(c for c, _ in left_out),
        bootstrap_optima=optima,
    )


class _Profile(NamedTuple):
    """One budget's runs by size: the distinct sizes, increasing, and ``x = log N``; the
    mean loss, mean ``log D`` and run count at each; each run's index into them."""

    sizes: np.ndarray
    x: np.ndarray
    loss: np.ndarray
    log_d: np.ndarray
    count: np.ndarray
    index: np.ndarray
    run_loss: np.ndarray


def _profile(n, d, loss):
    sizes, index, count = np.unique(n, return_inverse=True, return_counts=True)
    return _Profile(
        sizes=sizes,
        x=np.log(sizes),
        loss=np.bincount(index, loss) / count,
        log_d=np.bincount(index, np.log(d)) / count,
        count=count,
        index=index,
        run_loss=loss,
    )


def _budget_groups(compute, tolerance, edges):
    """``(budgets, row groups, budgets outside every bin)``: one group per budget."""
    if edges is not None:
        edges = np.asarray(edges, dtype=float)
        if edges.ndim != 1 or edges.size < 2 or not np.all(np.diff(edges) > 0):
            raise ArgumentError(
                f"budget_edges must be increasing bin edges, at least two, got {edges!r}"
            )
        bins = np.searchsorted(edges, compute, side="right") - 1
        inside = (bins >= 0) & (bins < edges.size - 1)
        outside = tuple(np.unique(compute[~inside]))
        groups = [np.flatnonzero(inside & (bins == k)) for k in np.unique(bins[inside])]
    else:
        tolerance = real("budget_tolerance", tolerance)
        if not 0 <= tolerance < 1:
            raise ArgumentError(f"budget_tolerance must lie in [0, 1), got {tolerance}")
        order = np.argsort(compute, kind="stable")
        groups, start = [], 0
        for k in range(1, order.size + 1):
            if k == order.size or compute[order[k]] > compute[order[start]] * (1 + tolerance):
                groups.append(np.sort(order[start:k]))
                start = k
        outside = ()
    budgets = np.array([_centre(compute[rows]) for rows in groups])
    if len(groups) < 2:
        raise ArgumentError(f"fit_isoflop needs at least two budgets, got {len(groups)}")
    return budgets, groups, outside


def _centre(budgets):
    """A group's budget: the common value, or the geometric mean of unequal ones."""
    return float(budgets[0]) if np.all(budgets == budgets[0]) else math.exp(np.log(budgets).mean())


def _loss_std(loss_std, loss):
    """Each run's loss noise from the ``loss_std`` argument, or None to estimate it."""
    if loss_std is None:
        return None
    value = loss_std(loss.copy()) if callable(loss_std) else loss_std
    std = (
        np.broadcast_to(np.asarray(value, dtype=float), loss.shape)
        if np.ndim(value) == 0
        else np.asarray(value, dtype=float)
    )
    if std.shape != loss.shape:
        raise ShapeError(
            f"loss_std must be a number or one value per run ({loss.size}), got shape {std.shape}"
        )
    if not np.all(np.isfinite(std) & (std >= 0)):
        raise ArgumentError("loss_std must be finite and non-negative for every run")
    return np.array(std)


def _estimated_noise(profiles):
    """``(source, std)`` of one run's loss: from runs repeated at one size and budget if
    any, else from the residuals of local parabolas (five neighbouring sizes)."""
    squares = sum(float(np.sum((p.run_loss - p.loss[p.index]) ** 2)) for p in profiles)
    spare = sum(int(np.sum(p.count - 1)) for p in profiles)
    if spare > 0:
        return "seed repeats", math.sqrt(squares / spare)
    std = _local_fit_noise([(p.x, p.loss) for p in profiles])
    if std is None:
        raise ArgumentError(
            "cannot estimate the loss noise: no size was trained twice at one budget and no "
            f"budget has {2 * _WINDOW_HALF_WIDTH + 1} sizes; give loss_std (one number, or one "
            "per run), or group nearly equal budgets with budget_tolerance or budget_edges"
        )
    return "local fits", std


def _local_fit_noise(sequences):
    """The noise of ``y`` from the residuals of parabolas through every five neighbouring
    points of each ``(x, y)`` sequence, at each window's centre; None without any."""
    width = 2 * _WINDOW_HALF_WIDTH + 1
    scaled = []
    for x_all, y_all in sequences:
        for start in range(x_all.size - width + 1):
            x = x_all[start : start + width] - x_all[start + _WINDOW_HALF_WIDTH]
            design = np.vander(x, 3)
            coefficients, *_ = np.linalg.lstsq(design, y_all[start : start + width])
            residual = y_all[start + _WINDOW_HALF_WIDTH] - coefficients[-1]
            # The residual at the window's centre has variance (1 - h) sigma^2.
            hat = design[_WINDOW_HALF_WIDTH] @ np.linalg.pinv(design.T @ design)
            leverage = float(hat @ design[_WINDOW_HALF_WIDTH])
            scaled.append(residual**2 / (1 - leverage))
    return math.sqrt(float(np.mean(scaled))) if scaled else None


def _budget_optimum(compute, profile, sigma, optimum, n_bootstrap, rng):
    """``(reason left out or None, curve, resampled optima (k, 3))`` of one budget."""
    if profile.x.size < 3:
        return f"{profile.x.size} distinct sizes; a minimum needs 3", None, None
    lowest = int(np.argmin(profile.loss))
    if lowest in (0, profile.x.size - 1):
        edge = "smallest" if lowest == 0 else "largest"
        return f"its lowest loss is at its {edge} size", None, None
    found = _valley_minimum(optimum, profile.x, profile.loss)
    if found is None:
        return "its model has no minimum between the sizes trained", None, None
    noisy = profile.loss + sigma * rng.standard_normal((n_bootstrap, profile.x.size))
    noisy = noisy[np.all(noisy > 0, axis=1)]
    draw_x, draw_loss = _valley_minima(optimum, profile.x, noisy)
    kept = ~np.isnan(draw_x)
    draws = np.column_stack([draw_x, np.interp(draw_x, profile.x, profile.log_d), draw_loss])[kept]
    if len(draws) < (1 - _MAX_EDGE_SHARE) * n_bootstrap:
        lost = n_bootstrap - len(draws)
        reason = f"its minimum left the sizes trained in {lost} of {n_bootstrap} resamples"
        return reason, None, None
    x, loss = found
    curve = IsoFlopCurve(
        compute=float(compute),
        sizes=tuple(float(v) for v in profile.sizes),
        losses=tuple(float(v) for v in profile.loss),
        loss_std=tuple(float(v) for v in sigma),
        optimum=optimum,
        n_opt=math.exp(x),
        d_opt=math.exp(float(np.interp(x, profile.x, profile.log_d))),
        loss_opt=loss,
    )
    return None, curve, draws


def _akima(x, loss):
    """Akima's interpolant of log L against log N (shape-preserving, in log-log)."""
    from scipy.interpolate import Akima1DInterpolator

    return Akima1DInterpolator(x, np.log(loss))


def _window(x, loss):
    """The lowest size and up to ``_WINDOW_HALF_WIDTH`` neighbours on each side."""
    return _window_around(int(np.argmin(loss)), x.size)


def _window_around(centre, size):
    """Size ``centre`` and up to ``_WINDOW_HALF_WIDTH`` neighbours on each side."""
    return slice(max(0, centre - _WINDOW_HALF_WIDTH), min(size, centre + _WINDOW_HALF_WIDTH + 1))


def _parabolas_fit(profiles, sigmas):
    """Whether one parabola in log N through every size of each budget (with a lowest
    run between its sizes) fits the mean losses within their noise: the chi-squared
    summed over the budgets at or below its 95th percentile."""
    from scipy.stats import chi2

    misfit, spare = 0.0, 0
    for profile, sigma in zip(profiles, sigmas, strict=True):
        if profile.x.size < 4 or int(np.argmin(profile.loss)) in (0, profile.x.size - 1):
            continue
        fitted = np.polyval(np.polyfit(profile.x, profile.loss, 2), profile.x)
        scale = np.maximum(sigma, 1e-9 * profile.loss)
        misfit += float(np.sum(((profile.loss - fitted) / scale) ** 2))
        spare += profile.x.size - 3
    return spare == 0 or misfit <= chi2.ppf(0.95, spare)


def _valley_model(optimum, x, loss):
    """The model of one valley as a function of ``log N``, NaN outside its sizes."""
    if optimum == "akima":
        spline = _akima(x, loss)
        return lambda at: np.exp(spline(at, extrapolate=False))
    window = _window(x, loss) if optimum == "local_parabola" else slice(None)
    coefficients = np.polyfit(x[window], loss[window], 2)
    low, high = x[window][0], x[window][-1]
    return lambda at: np.where((at >= low) & (at <= high), np.polyval(coefficients, at), np.nan)


def _valley_minimum(optimum, x, loss):
    """``(log N, L)`` at the lowest point of the valley model strictly between the sizes
    it is fitted to, or None when its lowest point is at an end of them."""
    found_x, found_loss = _valley_minima(optimum, x, loss[None, :])
    return None if np.isnan(found_x[0]) else (float(found_x[0]), float(found_loss[0]))


def _valley_minima(optimum, x, losses):
    """``(log N, L)`` arrays of the lowest points of the valley models of ``losses``
    (one valley per row, over the sizes ``x``), NaN where the lowest point is at an end
    of the sizes it is fitted to. Parabolas are fitted to L (as Hoffmann et al. fit
    theirs), Akima's interpolant to log L. Every row at once: the bootstrap reads
    thousands of valleys."""
    found_x = np.full(losses.shape[0], np.nan)
    found_loss = np.full(losses.shape[0], np.nan)
    if optimum == "akima":
        _akima_minima(x, np.log(losses), found_x, found_loss)
        return found_x, found_loss
    if optimum == "parabola":
        _parabola_minima(x, losses, np.arange(losses.shape[0]), found_x, found_loss)
        return found_x, found_loss
    lowest = np.argmin(losses, axis=1)
    for centre in np.unique(lowest):
        if centre in (0, x.size - 1):
            continue
        rows = np.flatnonzero(lowest == centre)
        window = _window_around(centre, x.size)
        _parabola_minima(x[window], losses[rows, window], rows, found_x, found_loss)
    return found_x, found_loss


def _parabola_minima(x, losses, rows, found_x, found_loss):
    """Least-squares parabolas in ``x`` through each row of ``losses``; the vertices
    strictly inside ``x`` of those opening upwards go to ``found_*[rows]``."""
    shift = x.mean()  # centred, so that the normal equations stay well conditioned
    coefficients, *_ = np.linalg.lstsq(np.vander(x - shift, 3), losses.T, rcond=None)
    p2, p1, p0 = coefficients
    with np.errstate(divide="ignore", invalid="ignore"):
        vertex = -p1 / (2 * p2)
    inside = (p2 > 0) & (vertex > x[0] - shift) & (vertex < x[-1] - shift)
    found_x[rows[inside]] = vertex[inside] + shift
    found_loss[rows[inside]] = (p0 - p1 * p1 / (4 * p2))[inside]


def _akima_minima(x, log_losses, found_x, found_loss):
    """The lowest points of Akima's interpolants through each row of ``log_losses``:
    each piece is a cubic, so its stationary points are the roots of a quadratic,
    taken in closed form for every piece and row at once."""
    from scipy.interpolate import Akima1DInterpolator

    c3, c2, c1, c0 = Akima1DInterpolator(x, log_losses, axis=1).c  # (pieces, rows) each
    width = np.diff(x)[:, None]
    # Stationary points t of c3 t^3 + c2 t^2 + c1 t + c0 on each piece [0, width].
    qa, qb, qc = 3 * c3, 2 * c2, c1
    with np.errstate(divide="ignore", invalid="ignore"):
        root = np.sqrt(qb * qb - 4 * qa * qc)
        # The stable pair of quadratic roots (no cancellation), and the linear case.
        q = -0.5 * (qb + np.copysign(root, qb))
        quadratic = np.abs(qa) > 1e-12 * (np.abs(qb) + np.abs(qc))
        first = np.where(quadratic, q / qa, -qc / qb)
        second = np.where(quadratic, qc / q, np.nan)
    best_t = np.full(c0.shape, np.nan)
    best_value = np.full(c0.shape, np.inf)
    for t in (first, second):
        t = np.where((t >= 0) & (t <= width), t, np.nan)
        value = ((c3 * t + c2) * t + c1) * t + c0
        better = value < best_value  # False where t is NaN
        best_t = np.where(better, t, best_t)
        best_value = np.where(better, value, best_value)
    piece = np.argmin(best_value, axis=0)
    rows = np.arange(log_losses.shape[0])
    value = best_value[piece, rows]
    # Inside only where strictly below both ends (an end wins ties).
    inside = (value < log_losses[:, 0]) & (value < log_losses[:, -1])
    found_x[inside] = (x[piece] + best_t[piece, rows])[inside]
    found_loss[inside] = np.exp(value[inside])


def _power_law(log_c, log_opt, resampled, confidence, rng):
    """``(slope, intercept, interval, scatter)`` of ``log_opt`` against ``log_c``.

    Weighted least squares, each budget weighted by ``1 / (v + tau^2)`` with ``v`` the
    variance of its resampled optima and ``tau^2`` the scatter about the line the noise
    does not explain (Paule and Mandel's estimate: the weighted residuals' sum equals
    its expectation, ``budgets - 2``). The interval: the slopes through each resample's
    optima, each offset by that scatter drawn from its estimate's chi-squared law."""
    variance = np.maximum(resampled.var(axis=0), 1e-12)
    k = log_c.size
    spare = k - 2

    def line(values, weights):
        w = weights / weights.sum()
        x_mean, y_mean = w @ log_c, w @ values
        slope = (
            (w * (log_c - x_mean)) @ (values - y_mean) / ((w * (log_c - x_mean)) @ (log_c - x_mean))
        )
        return slope, y_mean - slope * x_mean

    def excess(tau2):
        weights = 1 / (variance + tau2)
        slope, intercept = line(log_opt, weights)
        return float(weights @ (log_opt - slope * log_c - intercept) ** 2) - spare

    tau2 = 0.0
    if spare > 0 and excess(0.0) > 0:
        from scipy.optimize import brentq

        high = float(np.var(log_opt)) + float(variance.max())
        while excess(high) > 0:
            high *= 4
        tau2 = brentq(excess, 0.0, high, xtol=1e-14)
    slope, intercept = line(log_opt, 1 / (variance + tau2))
    slopes = np.empty(resampled.shape[0])
    for i, sample in enumerate(resampled):
        tau2_i = tau2 * spare / rng.chisquare(spare) if tau2 > 0 else 0.0
        offsets = math.sqrt(tau2_i) * rng.standard_normal(k)
        slopes[i] = line(sample + offsets, 1 / (variance + tau2_i))[0]
    tails = 100 * np.array([(1 - confidence) / 2, (1 + confidence) / 2])
    interval = tuple(float(v) for v in np.percentile(slopes, tails))
    return float(slope), float(intercept), interval, math.sqrt(tau2)


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
        Refits the intervals come from; 0 with as many runs as parameters, which
        leave no degree of freedom to estimate them from (every interval is then
        ``(nan, nan)``).
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

    Warns
    -----
    FitWarning
        With as many runs as fitted parameters: no degree of freedom is left to
        estimate intervals from (each is ``(nan, nan)``).

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
    confidence = confidence_level(confidence)
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
    if n.size == n_parameters:
        # The law can pass through every run, and so can every refit to a resample,
        # whose repeated runs leave fewer distinct runs than parameters: the refits'
        # spread would measure where the solver stops, not how the runs scatter.
        warnings.warn(
            f"fitting {n_parameters} parameters to {n.size} runs leaves no spare degree of "
            "freedom, so no interval can be estimated (each is nan); give more runs for "
            "intervals",
            FitWarning,
            stacklevel=2,
        )
        n_bootstrap = 0
    rng = np.random.default_rng(seed)
    draws, flat_draws = [], []
    for _ in range(n_bootstrap):
        rows = rng.integers(0, n.size, size=n.size)
        sample = tuple(x[rows] for x in data)
        # Each refit starts from the full fit: a resample moves the optimum a little.
        draw, value = _minimise(sample, log_e, delta, [theta])
        draws.append(draw)
        flat_draws.append(_flat_terms(draw, sample, value, log_e, delta, confidence))
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
    flat = _flat_terms(theta, data, objective, log_e, delta, confidence)
    if n_bootstrap:
        flat |= np.mean(flat_draws, axis=0) > share
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
        if name in lost or not n_bootstrap
        else tuple(float(v) for v in np.percentile(values, tails))
        for name, values in columns.items()
    }
    if log_e is not None:
        intervals["e"] = (law.e, law.e)
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


def _on_bounds(theta, draws, bounds, share):
    """Per parameter, whether the solver left it on one of its ``bounds`` (within a
    millionth of their span) in the fit ``theta`` or in over ``share`` of the ``draws``."""
    low, high = np.array(bounds).T
    margin = 1e-6 * (high - low)

    def on_bound(values):
        return (values <= low + margin) | (values >= high - margin)

    hit = on_bound(theta)
    if len(draws):
        hit |= on_bound(draws).mean(axis=0) > share
    return hit


def _at_bound(theta, draws, log_e, share):
    """Names of the parameters on a solver bound in the fit or in over ``share`` of the draws."""
    hit = _on_bounds(theta, draws, _BOUNDS, share)
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
    # BLAS on one thread: the solver's BLAS calls are on vectors of five numbers, and
    # OpenBLAS's idle second thread spins through them, taking a core from any other
    # work for no gain (docs/benchmarks.rst, "Measurements behind constants").
    with blas_threads(1):
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
        Bootstrap percentile intervals of ``"alpha_n"``, ``"alpha_d"``, ``"n_c"``,
        ``"d_c"``; ``(nan, nan)`` for a parameter in :attr:`unidentified`.
    unidentified : tuple of str
        The parameters the runs do not determine, each with no interval: a term's
        exponent and scale (:math:`\alpha_N` and :math:`N_c`, or :math:`\alpha_D`
        and :math:`D_c`) when the solver left either on one of its bounds, in the fit
        or in more than :math:`(1 - \text{confidence})/2` of the refits (a bound is
        not an estimate, nor an interval's end), or when the runs do not need the
        term: the other term alone, a power law in :math:`N` (or :math:`D`) fitted by
        least squares, leaves residuals an :math:`F` test at ``confidence`` cannot
        tell from the full fit's (2 parameters fewer). Such a term can vanish in many
        ways (its scale small, its exponent anywhere), and wherever the solver left
        them is not the runs' answer.
    residual_std : float
        Of :math:`\log L`.
    confidence : float
    """

    alpha_n: float
    alpha_d: float
    n_c: float
    d_c: float
    intervals: dict
    unidentified: tuple
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
        For arrays of different lengths, non-positive values, fewer than 5 runs,
        or runs that all have one :math:`N` or one :math:`D`.

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
    confidence = confidence_level(confidence)
    n_bootstrap = integer("n_bootstrap", n_bootstrap, minimum=2)
    seed = integer("seed", seed, minimum=0)
    if n.size < 5:
        raise ArgumentError(f"fitting 4 parameters needs at least 5 runs, got {n.size}")
    for name, values, term in (("N", n, "(N_c/N)^(alpha_N/alpha_D)"), ("D", d, "D_c/D")):
        if np.unique(values).size < 2:
            # The term is then one number, whose exponent and scale the runs cannot
            # tell apart from the other term's: the fit would still give numbers,
            # and intervals that miss planted truths.
            raise ArgumentError(
                f"every run has {name} = {values[0]:g}: the term {term} is then a constant "
                f"and equation 1.5 is not determined; fit the loss against the other "
                f"variable alone with tfmath.fit_scaling_law"
            )
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
    lost = _kaplan_at_bound(theta, draws, (1 - confidence) / 2) | _kaplan_unneeded_terms(
        data, residual, confidence
    )
    unidentified = tuple(
        name for name, term in zip(columns, (0, 1, 0, 1), strict=True) if lost[term]
    )
    intervals = {
        name: (math.nan, math.nan)
        if name in unidentified
        else tuple(float(x) for x in np.percentile(values, tails))
        for name, values in columns.items()
    }
    return KaplanLossFit(
        alpha_n=float(theta[0]), alpha_d=float(theta[1]),
        n_c=math.exp(theta[2]), d_c=math.exp(theta[3]),
        intervals=intervals, unidentified=unidentified,
        residual_std=float(residual.std()), confidence=confidence,
    )  # fmt: skip


#: The solver's bounds on Kaplan et al.'s (alpha_N, alpha_D, log N_c, log D_c).
_KAPLAN_BOUNDS = ((1e-4, 5.0), (1e-4, 5.0), (-50.0, 200.0), (-50.0, 200.0))


def _kaplan_at_bound(theta, draws, share):
    """Whether the N term and the D term have a parameter on a bound, in the fit or in
    over ``share`` of the draws: a boolean array of two."""
    hit = _on_bounds(theta, draws, _KAPLAN_BOUNDS, share)
    return np.array([hit[0] or hit[2], hit[1] or hit[3]])


def _kaplan_unneeded_terms(data, residual, confidence):
    r"""Whether the runs need neither the N term nor the D term beyond the other: a
    boolean array of two (N term, D term).

    Without the D term, equation 1.5 is :math:`\log L = \alpha_N (\log N_c - \log N)`,
    a line fitted exactly by least squares (likewise in :math:`D`). The term is not
    needed when the line's residual sum of squares exceeds the full fit's by no more
    than the :math:`F` test at ``confidence`` allows for 2 parameters fewer, or than the
    solver resolves (a relative 1e-8 of the sum, for runs without scatter).
    """
    from scipy.stats import f as f_distribution

    log_n, log_d, log_loss = data
    full = float(residual @ residual)
    spare = log_loss.size - 4
    allowed = 2 * full / spare * f_distribution.ppf(confidence, 2, spare)
    unneeded = []
    for log_other in (log_d, log_n):  # the N term is unneeded when D alone fits
        design = np.column_stack([np.ones_like(log_other), log_other])
        _, line_sum, *_ = np.linalg.lstsq(design, log_loss, rcond=None)
        line = float(line_sum[0]) if line_sum.size else 0.0
        unneeded.append(line - full <= max(allowed, 1e-8 * line))
    return np.array(unneeded)


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
    bounds = tuple(zip(*_KAPLAN_BOUNDS, strict=True))
    start = np.clip(np.asarray(start, dtype=float), bounds[0], bounds[1])
    with blas_threads(1):  # as in _minimise
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


# -- one entry point ---------------------------------------------------------------------

#: The approaches :func:`fit_compute_optimal` runs, by Hoffmann et al.'s numbering.
APPROACHES = (1, 2, 3)


@dataclass(frozen=True)
class ComputeOptimalFit:
    r"""The compute-optimal split of a table of runs, by one approach (see
    :func:`fit_compute_optimal`).

    Attributes
    ----------
    approach : int
        1 (the envelope of training curves), 2 (IsoFLOP profiles) or 3 (the
        parametric loss).
    a, b : float
        :math:`N_{opt} \propto C^a`, :math:`D_{opt} \propto C^b`.
    a_interval, b_interval : tuple of float
        Their intervals at ``confidence``; ``(nan, nan)`` where the runs do not
        determine the exponent.
    confidence : float
    left_out : tuple of (str, str)
        What the fit could not use or determine, and why: stretches of budgets
        (approach 1), budgets (approach 2) or parameters (approach 3).
    fit : EnvelopeFit, IsoFlopFit or ParametricLossFit
        The approach's own result, with everything else it found.
    """

    approach: int
    a: float
    b: float
    a_interval: tuple
    b_interval: tuple
    confidence: float
    left_out: tuple
    fit: object

    def __repr__(self):
        percent = f"{100 * self.confidence:g}%"
        lines = [
            f"ComputeOptimalFit(approach {self.approach}, {type(self.fit).__name__})",
            f"  N_opt ~ C^a: a = {self.a:.3f} {_bracket(self.a_interval)} ({percent})",
            f"  D_opt ~ C^b: b = {self.b:.3f} {_bracket(self.b_interval)}",
        ]
        lines += [f"  left out: {what}: {why}" for what, why in self.left_out]
        return "\n".join(lines)


def _bracket(interval):
    low, high = interval
    if not (math.isfinite(low) and math.isfinite(high)):
        return "[no interval]"  # why: in left_out
    return f"[{low:.3f}, {high:.3f}]"


#: Why approach 3 gives no intervals with as many runs as parameters.
_NO_SPARE_RUNS = "as many runs as parameters: no spare degree of freedom to estimate them from"


def fit_compute_optimal(compute, n, d, loss, *, approach=2, run=None, **options):
    r"""How a compute budget should be split between parameters and tokens, from runs.

    One door to Hoffmann et al.'s three approaches, returning one result type
    whatever the approach:

    * approach 1 runs :func:`fit_envelope`: the rows are checkpoints of training
      curves, and ``run`` says which run each belongs to;
    * approach 2 runs :func:`fit_isoflop`: the rows are runs, grouped by budget;
    * approach 3 runs :func:`fit_parametric_loss` on ``n``, ``d`` and ``loss`` (its
      compute-optimal exponents follow from the fitted law,
      :math:`a = \beta/(\alpha+\beta)`).

    Parameters
    ----------
    compute, n, d, loss : array_like, 1-D
        Each row's compute, parameters, training tokens and loss: one per run's
        end (approaches 2 and 3), or one per checkpoint (approach 1).
    approach : {1, 2, 3}, optional
    run : array_like, optional
        Approach 1 only, and required there: the run of each checkpoint.
    **options
        Passed to the approach's function: ``confidence``, ``n_bootstrap`` and
        ``seed`` for all three; ``loss_std`` for approaches 1 and 2 (approach 3
        resamples runs, not their noise); ``repeats`` and ``points`` for approach 1;
        ``optimum``, ``budget_tolerance``, ... for approach 2; ``irreducible`` and
        ``delta`` for approach 3. Any other is refused, naming the approach's own.

    Returns
    -------
    ComputeOptimalFit

    Raises
    ------
    ArgumentError
        For an approach other than 1, 2 or 3, ``run`` missing for approach 1 or
        given for another, and as the approach's function raises.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.analysis.compute_optimal import fit_compute_optimal
    >>> c = np.repeat([1e15, 1e16, 1e17], 5)
    >>> n_opt = 0.1 * c**0.5
    >>> n = n_opt * np.tile([0.25, 0.5, 1.0, 2.0, 4.0], 3)
    >>> loss = 2 + 0.1 * np.log(n / n_opt) ** 2 + (1e18 / c) ** 0.1
    >>> fit = fit_compute_optimal(c, n, c / (6 * n), loss, loss_std=0.01, n_bootstrap=50)
    >>> fit.approach, round(fit.a, 6)
    (2, 0.5)
    """
    if approach not in APPROACHES or isinstance(approach, bool):
        raise ArgumentError(f"approach must be one of {APPROACHES}, got {approach!r}")
    if (run is None) != (approach != 1):
        raise ArgumentError(
            "approach 1 reads the envelope of training curves: give run, the run of each checkpoint"
            if approach == 1
            else f"run labels checkpoints of training curves, for approach 1 only (got approach "
            f"{approach}, whose rows are runs)"
        )
    function = {1: fit_envelope, 2: fit_isoflop, 3: fit_parametric_loss}[approach]
    accepted = [
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind is parameter.KEYWORD_ONLY
    ]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ArgumentError(
            f"approach {approach} ({function.__name__}) takes no option {', '.join(unknown)}; "
            f"its options are {', '.join(accepted)}"
        )
    if approach == 1:
        fit = fit_envelope(run, compute, n, d, loss, **options)
        return ComputeOptimalFit(
            approach=1,
            a=fit.a,
            b=fit.b,
            a_interval=fit.a_interval,
            b_interval=fit.b_interval,
            confidence=fit.confidence,
            left_out=fit.left_out,
            fit=fit,
        )
    if approach == 2:
        fit = fit_isoflop(compute, n, d, loss, **options)
        return ComputeOptimalFit(
            approach=2,
            a=fit.a,
            b=fit.b,
            a_interval=fit.a_interval,
            b_interval=fit.b_interval,
            confidence=fit.confidence,
            left_out=tuple((f"budget C = {c:.4g}", why) for c, why in fit.left_out),
            fit=fit,
        )
    _runs(compute=compute)
    fit = fit_parametric_loss(n, d, loss, **options)
    return ComputeOptimalFit(
        approach=3,
        a=fit.law.n_exponent,
        b=fit.law.d_exponent,
        a_interval=fit.intervals["n_exponent"],
        b_interval=fit.intervals["d_exponent"],
        confidence=fit.confidence,
        left_out=tuple(
            (name, "not determined by the runs (on a solver bound, or in a term without effect)")
            for name in fit.unidentified
        )
        + (() if fit.n_bootstrap else (("intervals", _NO_SPARE_RUNS),)),
        fit=fit,
    )
