r"""Neural scaling laws as code: Kaplan et al. (2020), Hoffmann et al. (2022), and fits.

Seed 003 quotes :math:`L(N) \propto N^{-0.076}`, :math:`L(D) \propto D^{-0.095}`
and :math:`L(C) \propto C^{-0.050}`. Those are the exponents of Kaplan et al.
(2020, "Scaling Laws for Neural Language Models", arXiv:2001.08361), whose
laws, with their constants, are here:

* :func:`kaplan_loss` -- :math:`L(X) = (X_c / X)^{\alpha_X}` for
  :math:`X \in \{N, D, C_{min}, C\}` (:data:`KAPLAN_LAWS`);
* :func:`kaplan_joint_loss` -- :math:`L(N, D)`, their equation (1.5);
* :func:`critical_batch_size` -- :math:`B_{crit}(L)`, their equation (1.4);
* :func:`kaplan_compute_efficient` -- the compute-efficient model and data
  sizes of their table 6.

Hoffmann et al. (2022, "Training Compute-Optimal Large Language Models",
arXiv:2203.15556, "Chinchilla") fit :math:`L(N, D) = E + A/N^\alpha + B/D^\beta`
(:class:`ChinchillaLaw`, :data:`CHINCHILLA`) and minimise it under
:math:`C = 6ND` in closed form (:func:`chinchilla_optimal`).

:func:`fit_scaling_law` fits :math:`y = E + (x_c/x)^\alpha` to measurements,
with :math:`E` absent, known or fitted, and returns the exponent with a
confidence interval.

Units are the papers': :math:`N` parameters (Kaplan: non-embedding ones;
Hoffmann: all), :math:`D` tokens, Kaplan's compute in PF-days
(:data:`PF_DAY` floating-point operations) and Hoffmann's in FLOPs, losses
in nats per token. Kaplan et al. note that :math:`N_c`, :math:`D_c` and
:math:`C_c` depend on the vocabulary and tokenisation (WebText2, byte-pair
encoding with 50257 tokens) and have no meaning of their own; the exponents
are what transfers.
"""

import math
import warnings
from dataclasses import dataclass

import numpy as np

from tfmath._contract.checks import confidence_level, host_array, integer
from tfmath.errors import ArgumentError, DTypeError, FitWarning

__all__ = [
    "BESIROGLU",
    "CHINCHILLA",
    "CRITICAL_BATCH",
    "KAPLAN_JOINT",
    "KAPLAN_LAWS",
    "PF_DAY",
    "ChinchillaLaw",
    "ComputeOptimal",
    "CriticalBatchLaw",
    "KaplanJointLaw",
    "PowerLaw",
    "ScalingLawFit",
    "chinchilla_loss",
    "chinchilla_optimal",
    "critical_batch_size",
    "fit_scaling_law",
    "kaplan_compute_efficient",
    "kaplan_joint_loss",
    "kaplan_law",
    "kaplan_loss",
    "training_flops",
]

#: One petaflop/s-day in floating-point operations, :math:`10^{15} \cdot 24 \cdot 3600`
#: (Kaplan et al. 2020, section 1.3).
PF_DAY = 1e15 * 24 * 3600


def _positive(name, value, meaning=""):
    """``value`` as float64 (a float for a scalar), refusing non-finite or non-positive entries."""
    if isinstance(value, str | bool | np.bool_) or np.asarray(value).dtype == np.bool_:
        raise DTypeError(f"{name} must be a positive number or array, got {value!r}")
    array = host_array(name, value, np.float64)
    bad = ~(np.isfinite(array) & (array > 0))
    if np.any(bad):
        meaning = f" ({meaning})" if meaning else ""
        raise ArgumentError(
            f"{name}{meaning} must be finite and > 0, got {float(array[bad].flat[0])}"
        )
    return float(array) if array.ndim == 0 else array


def _constants(law, **floors):
    """Refuse a law whose named constants are not real numbers above their floors."""
    for name, floor in floors.items():
        value = getattr(law, name)
        if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.number):
            raise DTypeError(f"{type(law).__name__}'s {name} must be a real number, got {value!r}")
        if not (math.isfinite(value) and value > floor):
            raise ArgumentError(
                f"{type(law).__name__}'s {name} must be finite and > {floor:g}, got {value!r}"
            )


def _law_of(law, kind):
    """``law`` if it is a ``kind``, else a DTypeError naming what was given."""
    if not isinstance(law, kind):
        raise DTypeError(f"law must be a {kind.__name__}, got {type(law).__name__} {law!r:.60}")
    return law


@dataclass(frozen=True)
class PowerLaw:
    r"""A pure power law :math:`L(X) = (X_c / X)^{\alpha}`, in nats per token.

    Attributes
    ----------
    name : str
        The variable's symbol in the paper.
    exponent : float
        :math:`\alpha`.
    scale : float
        :math:`X_c`, in ``unit``.
    variable, unit : str
        What :math:`X` is and its unit.
    source : str
        Where the constants are printed.
    """

    name: str
    exponent: float
    scale: float
    variable: str
    unit: str
    source: str

    def __post_init__(self):
        _constants(self, exponent=0.0, scale=0.0)

    def __call__(self, value):
        """:math:`(X_c / X)^\\alpha` for ``value`` :math:`= X > 0` (a number or an array)."""
        return (self.scale / _positive("value", value, self._meaning)) ** self.exponent

    @property
    def _meaning(self):
        return f"{self.name}: {self.variable} in {self.unit}"

    def inverse(self, loss):
        r""":math:`X = X_c\, L^{-1/\alpha}`: the size at which the law reaches ``loss``."""
        return self.scale * _positive("loss", loss) ** (-1.0 / self.exponent)


_KAPLAN = "Kaplan et al. (2020)"

#: Kaplan et al.'s single-variable laws, each holding when the other two
#: resources are not the bottleneck (section 1.2, equations (1.1)--(1.3), and
#: table 5 in appendix A). ``"N"``: models trained to convergence on enough
#: data; ``"D"``: large models trained on :math:`D` tokens with early stopping;
#: ``"C_min"``: compute used optimally (optimal model size, batch size well
#: below the critical one); ``"C"``: the naive trend at a fixed batch size
#: (table 5 and figure 1), which the paper says not to use for predictions.
KAPLAN_LAWS = {
    "N": PowerLaw(
        "N", 0.076, 8.8e13, "non-embedding parameters", "parameters",
        f"{_KAPLAN}, equation (1.1) and table 5",
    ),
    "D": PowerLaw(
        "D", 0.095, 5.4e13, "dataset size", "tokens", f"{_KAPLAN}, equation (1.2) and table 5"
    ),
    "C_min": PowerLaw(
        "C_min", 0.050, 3.1e8, "minimum non-embedding training compute", "PF-days",
        f"{_KAPLAN}, equation (1.3) and table 5",
    ),
    "C": PowerLaw(
        "C", 0.057, 1.6e7, "non-embedding training compute at fixed batch size", "PF-days",
        f"{_KAPLAN}, table 5",
    ),
}  # fmt: skip


def kaplan_law(law):
    """The :class:`PowerLaw` named ``law`` in :data:`KAPLAN_LAWS`.

    Raises
    ------
    ValueError
        For a name not in :data:`KAPLAN_LAWS`, listing the known ones.
    """
    try:
        return KAPLAN_LAWS[law]
    except (KeyError, TypeError):
        raise ArgumentError(
            f"law must be one of the Kaplan et al. laws {sorted(KAPLAN_LAWS)}, got {law!r}"
        ) from None


def kaplan_loss(law, value):
    r"""Kaplan et al.'s (2020) loss :math:`L(X) = (X_c / X)^{\alpha_X}`, in nats per token.

    ============  ==============================  =================  ==========================
    ``law``       :math:`X`                       :math:`\alpha_X`   :math:`X_c`
    ============  ==============================  =================  ==========================
    ``"N"``       non-embedding parameters        0.076              :math:`8.8 \times 10^{13}`
    ``"D"``       tokens                          0.095              :math:`5.4 \times 10^{13}`
    ``"C_min"``   PF-days, optimal allocation     0.050              :math:`3.1 \times 10^{8}`
    ``"C"``       PF-days, fixed batch size       0.057              :math:`1.6 \times 10^{7}`
    ============  ==============================  =================  ==========================

    Equations (1.1)--(1.3) and table 5 of the paper. Figure 1 of the paper labels
    its compute line :math:`(C_{min} / 2.3 \times 10^8)^{-0.050}`; the equation and
    table give :math:`3.1 \times 10^8`, used here.

    Parameters
    ----------
    law : {"N", "D", "C_min", "C"}
    value : float or array_like
        :math:`X > 0` in the law's unit.

    Returns
    -------
    float or numpy.ndarray

    Raises
    ------
    ValueError
        For an unknown ``law`` or a non-positive ``value``.

    Examples
    --------
    >>> from tfmath.formulas.scaling import kaplan_loss
    >>> round(kaplan_loss("N", 8.8e9), 4)  # (10^4)^0.076
    2.0137
    >>> round(kaplan_loss("D", 5.4e13), 4)
    1.0
    """
    return kaplan_law(law)(value)


@dataclass(frozen=True)
class KaplanJointLaw:
    r"""Kaplan et al.'s :math:`L(N, D)` (equation (1.5); fitted values in table 2).

    .. math::

        L(N, D) = \left[\left(\frac{N_c}{N}\right)^{\alpha_N / \alpha_D}
            + \frac{D_c}{D}\right]^{\alpha_D}

    It reduces to :math:`(N_c/N)^{\alpha_N}` as :math:`D \to \infty` and to
    :math:`(D_c/D)^{\alpha_D}` as :math:`N \to \infty`. Table 2 fits it to
    early-stopped runs, giving constants a little different from the
    single-variable fits: :math:`\alpha_N = 0.076`, :math:`\alpha_D = 0.103`,
    :math:`N_c = 6.4 \times 10^{13}`, :math:`D_c = 1.8 \times 10^{13}`.
    """

    alpha_n: float = 0.076
    alpha_d: float = 0.103
    n_c: float = 6.4e13
    d_c: float = 1.8e13
    source: str = f"{_KAPLAN}, equation (1.5) and table 2"

    def __post_init__(self):
        _constants(self, alpha_n=0.0, alpha_d=0.0, n_c=0.0, d_c=0.0)

    def __call__(self, n, d):
        n, d = _positive("n", n), _positive("d", d)
        return ((self.n_c / n) ** (self.alpha_n / self.alpha_d) + self.d_c / d) ** self.alpha_d


#: :class:`KaplanJointLaw` with the constants of Kaplan et al.'s table 2.
KAPLAN_JOINT = KaplanJointLaw()


def kaplan_joint_loss(n, d, *, law=KAPLAN_JOINT):
    r"""Kaplan et al.'s early-stopped loss of :math:`N` non-embedding parameters on :math:`D`
    tokens, :math:`[(N_c/N)^{\alpha_N/\alpha_D} + D_c/D]^{\alpha_D}` (see :class:`KaplanJointLaw`).

    Parameters
    ----------
    n, d : float or array_like
        Positive; broadcast together.
    law : KaplanJointLaw, optional

    Returns
    -------
    float or numpy.ndarray

    Raises
    ------
    ValueError
        For non-positive ``n`` or ``d``.

    Examples
    --------
    >>> from tfmath.formulas.scaling import kaplan_joint_loss
    >>> round(kaplan_joint_loss(1.5e9, 2.3e10), 4)
    2.3101
    """
    return _law_of(law, KaplanJointLaw)(n, d)


@dataclass(frozen=True)
class CriticalBatchLaw:
    r"""The critical batch size :math:`B_{crit}(L) = B_* / L^{1/\alpha_B}` (Kaplan et al. 2020).

    Equation (1.4) gives :math:`B_* \approx 2 \times 10^8` tokens and
    :math:`\alpha_B \approx 0.21`; table 5 prints :math:`B_* = 2.1 \times 10^8`.
    The defaults are equation (1.4)'s. The law follows McCandlish et al.
    (2018): training at :math:`B_{crit}` costs about twice the minimum number
    of steps and twice the minimum compute.
    """

    b_star: float = 2e8
    alpha_b: float = 0.21
    source: str = f"{_KAPLAN}, equation (1.4) (table 5: B* = 2.1e8)"

    def __post_init__(self):
        _constants(self, b_star=0.0, alpha_b=0.0)

    def __call__(self, loss):
        return self.b_star / _positive("loss", loss) ** (1.0 / self.alpha_b)


#: :class:`CriticalBatchLaw` with equation (1.4)'s constants.
CRITICAL_BATCH = CriticalBatchLaw()


def critical_batch_size(loss, *, law=CRITICAL_BATCH):
    r"""Kaplan et al.'s critical batch size in tokens, :math:`B_* / L^{1/\alpha_B}`.

    Parameters
    ----------
    loss : float or array_like
        :math:`L > 0`, nats per token.
    law : CriticalBatchLaw, optional

    Returns
    -------
    float or numpy.ndarray
        Tokens per batch.

    Raises
    ------
    ValueError
        For a non-positive loss.

    Examples
    --------
    >>> from tfmath.formulas.scaling import critical_batch_size
    >>> f"{critical_batch_size(3.0):.4g}"  # 2e8 / 3^(1/0.21)
    '1.069e+06'
    """
    return _law_of(law, CriticalBatchLaw)(loss)


def kaplan_compute_efficient(compute_pf_days):
    r"""Kaplan et al.'s compute-efficient model size and data, table 6.

    .. math::

        N_{opt} = 1.3 \times 10^9\, C_{min}^{0.73}, \qquad
        D_{opt} = 2 \times 10^{10}\, C_{min}^{0.27},

    with :math:`C_{min}` in PF-days, :math:`N` non-embedding parameters and
    :math:`D` tokens (one epoch). Their product is not
    :math:`C / 6`, because these are separate fits to the frontier.

    Parameters
    ----------
    compute_pf_days : float or array_like

    Returns
    -------
    ComputeOptimal
        With ``loss`` from :func:`kaplan_loss` ``("C_min", ...)``.

    Examples
    --------
    >>> from tfmath.formulas.scaling import kaplan_compute_efficient
    >>> f"{kaplan_compute_efficient(1.0).n:.3g}"
    '1.3e+09'
    """
    c = _positive("compute_pf_days", compute_pf_days)
    return ComputeOptimal(n=1.3e9 * c**0.73, d=2e10 * c**0.27, loss=kaplan_loss("C_min", c))


@dataclass(frozen=True)
class ComputeOptimal:
    """A compute-optimal allocation: parameters ``n``, tokens ``d``, and the loss reached."""

    n: object
    d: object
    loss: object

    @property
    def tokens_per_parameter(self):
        """:math:`D / N`."""
        return self.d / self.n


def training_flops(n, d):
    r"""The training compute :math:`C \approx 6 N D` in FLOPs.

    Two FLOPs per parameter per token for the forward pass (a multiply and an
    add) and four for the backward pass (Kaplan et al. 2020, section 2.1;
    Hoffmann et al. 2022, section 3). See :func:`tfmath.formulas.accounting.flops_per_token`
    for the exact count.
    """
    return 6.0 * _positive("n", n) * _positive("d", d)


@dataclass(frozen=True)
class ChinchillaLaw:
    r"""Hoffmann et al.'s (2022) parametric loss :math:`L(N, D) = E + A/N^\alpha + B/D^\beta`.

    :math:`E` is the entropy of natural text, the loss of an ideal model;
    :math:`A/N^\alpha` is what a model of :math:`N` parameters falls short of
    it when trained to convergence; :math:`B/D^\beta` is what :math:`D` tokens
    of training fall short of convergence. The defaults are the fit of their
    approach 3 (section 3.3; appendix D.2): :math:`E = 1.69`, :math:`A = 406.4`,
    :math:`B = 410.7`, :math:`\alpha = 0.34`, :math:`\beta = 0.28`, with
    :math:`N` all parameters and :math:`D` tokens.
    """

    e: float = 1.69
    a: float = 406.4
    b: float = 410.7
    alpha: float = 0.34
    beta: float = 0.28
    source: str = "Hoffmann et al. (2022), section 3.3 (approach 3), appendix D.2"

    def __post_init__(self):
        # E may be 0 (a pure sum of power laws); the terms must fall with N and D.
        _constants(self, a=0.0, b=0.0, alpha=0.0, beta=0.0)
        if not (math.isfinite(self.e) and self.e >= 0):
            raise ArgumentError(f"ChinchillaLaw's e must be finite and >= 0, got {self.e!r}")

    def loss(self, n, d):
        """:math:`E + A/N^\\alpha + B/D^\\beta`."""
        n, d = _positive("n", n), _positive("d", d)
        return self.e + self.a / n**self.alpha + self.b / d**self.beta

    @property
    def g(self):
        r""":math:`G = (\alpha A / (\beta B))^{1/(\alpha+\beta)}`."""
        return (self.alpha * self.a / (self.beta * self.b)) ** (1.0 / (self.alpha + self.beta))

    @property
    def n_exponent(self):
        r""":math:`a = \beta / (\alpha + \beta)`: :math:`N_{opt} \propto C^a`."""
        return self.beta / (self.alpha + self.beta)

    @property
    def d_exponent(self):
        r""":math:`b = \alpha / (\alpha + \beta)`: :math:`D_{opt} \propto C^b`."""
        return self.alpha / (self.alpha + self.beta)

    def optimal(self, compute):
        r"""The compute-optimal :math:`N_{opt}(C)` and :math:`D_{opt}(C)` under :math:`C = 6ND`.

        Substituting :math:`D = C / (6N)` leaves one variable,

        .. math::

            L(N) = E + A N^{-\alpha} + B \left(\frac{6N}{C}\right)^{\beta},
            \qquad
            \frac{dL}{dN} = -\alpha A N^{-\alpha - 1}
                + \beta B \left(\frac{6}{C}\right)^{\beta} N^{\beta - 1} = 0,

        so :math:`N^{\alpha+\beta} = \frac{\alpha A}{\beta B} (C/6)^{\beta}` and

        .. math::

            N_{opt}(C) = G \left(\frac{C}{6}\right)^{a}, \qquad
            D_{opt}(C) = \frac{C}{6 N_{opt}} = G^{-1} \left(\frac{C}{6}\right)^{b},

        with :math:`G = (\alpha A / (\beta B))^{1/(\alpha+\beta)}`,
        :math:`a = \beta/(\alpha+\beta)`, :math:`b = \alpha/(\alpha+\beta)`
        (Hoffmann et al. 2022, equation (4)). The stationary point is the
        minimum: :math:`L(N) \to \infty` at both ends and :math:`dL/dN`
        changes sign once.
        """
        c = _positive("compute", compute)
        n = self.g * (c / 6.0) ** self.n_exponent
        d = (c / 6.0) ** self.d_exponent / self.g
        return ComputeOptimal(n=n, d=d, loss=self.loss(n, d))


#: :class:`ChinchillaLaw` with the approach-3 fit of Hoffmann et al. (2022).
CHINCHILLA = ChinchillaLaw()

#: :class:`ChinchillaLaw` refitted by Besiroglu, Erdil, Barnett and You (2024), "Chinchilla
#: Scaling: A replication attempt" (Epoch AI, arXiv:2404.10102), to data read off
#: Hoffmann et al.'s figures, with the Huber loss minimised to convergence. Its
#: exponents a = 0.513 and b = 0.487 agree with Hoffmann et al.'s approaches 1 and 2
#: (about 0.5 each), where the original approach-3 constants give 0.452 and 0.548.
BESIROGLU = ChinchillaLaw(
    e=1.8172,
    a=482.01,
    b=2085.43,
    alpha=0.3478,
    beta=0.3658,
    source="Besiroglu et al. (2024), arXiv:2404.10102, Chinchilla approach 3 refitted",
)


def chinchilla_loss(n, d, *, law=CHINCHILLA):
    r"""Hoffmann et al.'s loss :math:`E + A/N^\alpha + B/D^\beta` of :math:`N` parameters
    trained on :math:`D` tokens (see :class:`ChinchillaLaw`).

    Parameters
    ----------
    n, d : float or array_like
        Positive; broadcast together.
    law : ChinchillaLaw, optional

    Returns
    -------
    float or numpy.ndarray

    Raises
    ------
    ValueError
        For non-positive ``n`` or ``d``.

    Examples
    --------
    >>> from tfmath.formulas.scaling import chinchilla_loss
    >>> round(chinchilla_loss(70e9, 1.4e12), 4)  # Chinchilla itself
    1.9366
    """
    return _law_of(law, ChinchillaLaw).loss(n, d)


def chinchilla_optimal(compute, *, law=CHINCHILLA):
    r"""The compute-optimal parameters and tokens for a budget of ``compute`` FLOPs.

    :math:`N_{opt} = G (C/6)^{a}`, :math:`D_{opt} = G^{-1} (C/6)^{b}`; the
    derivation is in :meth:`ChinchillaLaw.optimal`. With the approach-3
    constants, :math:`a \approx 0.452` and :math:`b \approx 0.548` (the paper's
    table 2 prints 0.46 and 0.54, from unrounded constants).

    Parameters
    ----------
    compute : float or array_like
        :math:`C > 0` in FLOPs.
    law : ChinchillaLaw, optional

    Returns
    -------
    ComputeOptimal

    Raises
    ------
    ValueError
        For non-positive ``compute``.

    Examples
    --------
    >>> from tfmath.formulas.scaling import chinchilla_optimal
    >>> best = chinchilla_optimal(5.76e23)  # Gopher's and Chinchilla's budget
    >>> f"{best.n:.3g} parameters, {best.d:.3g} tokens"
    '3.22e+10 parameters, 2.98e+12 tokens'

    The Epoch AI replication's constants (:data:`BESIROGLU`) put the optimum at
    about 18 tokens per parameter instead of 93:

    >>> from tfmath.formulas.scaling import BESIROGLU
    >>> best = chinchilla_optimal(5.76e23, law=BESIROGLU)
    >>> f"{best.n:.3g} parameters, {best.d:.3g} tokens, {best.tokens_per_parameter:.1f} each"
    '7.22e+10 parameters, 1.33e+12 tokens, 18.4 each'
    """
    return _law_of(law, ChinchillaLaw).optimal(compute)


# -- fitting -------------------------------------------------------------------------------

_IRREDUCIBLE_CHOICES = "None, 'fit' or a number"
_METHODS = ("covariance", "bootstrap")


@dataclass(frozen=True)
class ScalingLawFit:
    r"""A fitted :math:`y = E + (x_c / x)^{\alpha}`.

    Attributes
    ----------
    exponent : float
        :math:`\alpha`.
    exponent_interval : tuple of float
        Its confidence interval; ``(-inf, inf)`` when there are no degrees of
        freedom left to estimate the scatter.
    scale : float
        :math:`x_c`.
    scale_interval : tuple of float
    irreducible : float
        :math:`E` (0 for a pure power law).
    irreducible_interval : tuple of float or None
        None unless :math:`E` was fitted; within :math:`E`'s range
        :math:`[0, \min y]` (a covariance interval reaching beyond it is cut there).
    irreducible_fitted : bool
    confidence : float
    method : {"covariance", "bootstrap"}
    n_points, dof : int
        Points, and points minus fitted parameters.
    residual_std : float
        Standard deviation of the residuals of the fitted response,
        :math:`\log(y - E)` for a known :math:`E` and :math:`\log y` for a
        fitted one, with ``dof`` in the denominator (nan when ``dof`` is 0).
    """

    exponent: float
    exponent_interval: tuple
    scale: float
    scale_interval: tuple
    irreducible: float
    irreducible_interval: tuple | None
    irreducible_fitted: bool
    confidence: float
    method: str
    n_points: int
    dof: int
    residual_std: float

    def __call__(self, x):
        """The fitted curve at ``x > 0``."""
        return self.irreducible + (self.scale / _positive("x", x)) ** self.exponent


def fit_scaling_law(
    x, y, *, irreducible=None, confidence=0.95, method="covariance", n_bootstrap=1000, seed=0
):
    r"""Fit :math:`y = E + (x_c / x)^{\alpha}` in log space, with a confidence interval on
    :math:`\alpha`.

    Residuals are taken in log space, since scaling-law measurements have
    roughly constant relative error across decades.

    * ``irreducible=None``: a pure power law, :math:`E = 0`. Then
      :math:`\log y = \alpha \log x_c - \alpha \log x` is a straight line, fitted
      by ordinary least squares (2 parameters).
    * ``irreducible=E`` (a number): :math:`E` is known, and
      :math:`\log(y - E) = \alpha \log x_c - \alpha \log x` is the same line
      (2 parameters). Every :math:`y` must exceed :math:`E`.
    * ``irreducible="fit"``: :math:`E`, :math:`\alpha` and :math:`\log x_c`
      are fitted together by nonlinear least squares
      (:func:`scipy.optimize.least_squares`, :math:`0 \le E < \min y`), started
      from the best of a grid of :math:`E` with the line fitted for each, so
      that a handful of points suffices (3 parameters).

    Intervals:

    * ``method="covariance"``: :math:`\hat\theta \pm t_{n-p}\, \mathrm{se}`,
      with the covariance :math:`s^2 (J^\top J)^{-1}` of the estimates
      (:math:`J` the Jacobian of the residuals, :math:`s^2` their sum of
      squares over :math:`n - p`) and Student's :math:`t` with :math:`n-p`
      degrees of freedom, which is exact for the line with normal errors and
      wide enough with few points;
    * ``method="bootstrap"``: percentiles of ``n_bootstrap`` refits to the
      fitted curve plus residuals resampled with replacement (scaled by
      :math:`\sqrt{n/(n-p)}`), each side widened about the estimate by
      :math:`t_{n-p}/z`, as an estimated scatter widens a normal interval;
      this suits the nonlinear fit better. (With 10 points, unwidened 95%
      intervals missed a planted exponent 44 times in 400, widened 20:
      ``tests/test_scaling.py``.)

    Parameters
    ----------
    x, y : array_like, 1-D
        Positive sizes and measurements, at least as many as parameters.
    irreducible : None, "fit" or float, optional
    confidence : float, optional
        In (0, 1).
    method : {"covariance", "bootstrap"}, optional
    n_bootstrap : int, optional
    seed : int, optional
        Seeds the bootstrap.

    Returns
    -------
    ScalingLawFit

    Raises
    ------
    ValueError
        For non-positive or non-finite ``x`` or ``y``, fewer points (or
        distinct ``x``) than parameters, the same ``y`` at every ``x``, ``y <= E``
        for a known ``E``, or an unknown ``irreducible`` or ``method``.
    TypeError
        For a ``n_bootstrap`` or ``seed`` that is not an integer.

    Warns
    -----
    FitWarning
        Where the fitted exponent is not positive: ``y`` does not fall with ``x``.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.formulas.scaling import fit_scaling_law
    >>> n = np.array([1e3, 1e4, 1e5, 1e6])
    >>> fit = fit_scaling_law(n, 1.5 + (2e3 / n) ** 0.3, irreducible=1.5)
    >>> round(fit.exponent, 6), round(fit.scale, 3)
    (0.3, 2000.0)
    """
    x, y = _fit_data(x, y)
    known = _irreducible(irreducible, y)
    if method not in _METHODS:
        raise ArgumentError(f"method must be one of {_METHODS}, got {method!r}")
    confidence = confidence_level(confidence)
    n_bootstrap = integer("n_bootstrap", n_bootstrap, minimum=2)
    seed = integer("seed", seed, minimum=0)
    model = _FittedIrreducible() if known is None else _KnownIrreducible(known)
    if x.size < model.n_params or np.unique(x).size < model.n_params:
        raise ArgumentError(
            f"fitting {model.n_params} parameters needs at least {model.n_params} points with "
            f"distinct x, got {x.size} points ({np.unique(x).size} distinct x)"
        )
    if np.ptp(y) <= 4 * np.finfo(np.float64).eps * y.max():
        # Every exponent fits a constant: the estimate would be 0 (with a zero-width
        # interval and no scale), or wherever the solver stopped.
        raise ArgumentError(
            f"y is the same ({y[0]:g}) at every x: it determines no exponent; a scaling "
            f"law is fitted to measurements that change with x"
        )
    log_x, response = np.log(x), model.response(y)
    theta, covariance = model.fit(log_x, response)
    if not theta[1] > 0:
        warnings.warn(
            f"the fitted exponent {theta[1]:.3g} is not positive: y does not fall as x "
            f"grows, and E + (x_c / x)^alpha describes a scaling law only for alpha > 0",
            FitWarning,
            stacklevel=2,
        )
    residuals = response - model.predict(theta, log_x)
    dof = x.size - model.n_params
    if not dof:
        intervals = dict.fromkeys(_ESTIMATES, (-math.inf, math.inf))
    elif method == "covariance":
        intervals = _covariance_intervals(theta, covariance, dof, confidence)
    else:
        intervals = _bootstrap_intervals(
            model, theta, log_x, residuals, dof, confidence, n_bootstrap, seed
        )
    if known is None:
        # E is fitted within [0, min y): an interval beyond that range would claim
        # values the model excludes (the covariance interval is symmetric about E).
        low, high = intervals["irreducible"]
        intervals["irreducible"] = (max(low, 0.0), min(high, float(y.min())))
    residual_std = math.sqrt(residuals @ residuals / dof) if dof else math.nan
    return _packaged(theta, intervals, known, confidence, method, x.size, dof, residual_std)


def _fit_data(x, y):
    arrays = []
    for name, value in (("x", x), ("y", y)):
        array = host_array(name, value, np.float64)
        if array.ndim != 1:
            raise ArgumentError(f"{name} must be 1-D, got shape {array.shape}")
        arrays.append(np.atleast_1d(_positive(name, array)))
    if arrays[0].shape != arrays[1].shape:
        raise ArgumentError(
            f"x and y must have one length, got {arrays[0].size} and {arrays[1].size}"
        )
    return arrays


def _irreducible(irreducible, y):
    """None for a fitted E, else the known E (0 for a pure power law)."""
    if irreducible is None:
        return 0.0
    if isinstance(irreducible, str):
        if irreducible != "fit":
            raise ArgumentError(f"irreducible must be {_IRREDUCIBLE_CHOICES}, got {irreducible!r}")
        return None
    if isinstance(irreducible, bool) or not isinstance(irreducible, int | float | np.number):
        raise ArgumentError(f"irreducible must be {_IRREDUCIBLE_CHOICES}, got {irreducible!r}")
    e = float(irreducible)
    if not math.isfinite(e) or np.any(y <= e):
        raise ArgumentError(
            f"every y must exceed the irreducible term {e} (y - E is fitted in log space); "
            f"smallest y is {y.min()}"
        )
    return e


#: The estimates every fit reports, from theta = (E, alpha, c) with c = alpha log x_c.
_ESTIMATES = ("irreducible", "exponent", "log_scale")


class _KnownIrreducible:
    """E known: the response log(y - E) is the line c - alpha log x (ordinary least squares)."""

    n_params = 2

    def __init__(self, e):
        self.e = e

    def response(self, y):
        return np.log(y - self.e)

    def predict(self, theta, log_x):
        return theta[2] - theta[1] * log_x

    def fit(self, log_x, response):
        design = np.column_stack([-log_x, np.ones_like(log_x)])
        (alpha, c), *_ = np.linalg.lstsq(design, response, rcond=None)
        residuals = response - design @ (alpha, c)
        dof = log_x.size - self.n_params
        covariance = np.zeros((3, 3))
        if dof:
            s2 = residuals @ residuals / dof
            covariance[1:, 1:] = s2 * np.linalg.inv(design.T @ design)
        return np.array([self.e, alpha, c]), covariance


class _FittedIrreducible:
    """E fitted: the response log y against log(E + exp(c - alpha log x)), nonlinear."""

    n_params = 3
    #: Starting values of E, as fractions of min y, for the line fits that seed the solver.
    _START_FRACTIONS = (0.0, 0.3, 0.6, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995)

    def response(self, y):
        return np.log(y)

    def predict(self, theta, log_x):
        e, alpha, c = theta
        return np.log(e + np.exp(c - alpha * log_x))

    def fit(self, log_x, response):
        from scipy.optimize import least_squares

        upper = float(np.exp(response.min())) * (1 - 1e-9)
        solution = least_squares(
            lambda theta: self.predict(theta, log_x) - response,
            self._start(log_x, response, upper),
            bounds=([0.0, -np.inf, -np.inf], [upper, np.inf, np.inf]),
            x_scale="jac",
            xtol=1e-14,
            ftol=1e-14,
            gtol=1e-14,
        )
        dof = log_x.size - self.n_params
        covariance = np.zeros((3, 3))
        if dof:
            s2 = 2 * solution.cost / dof
            covariance = s2 * np.linalg.pinv(solution.jac.T @ solution.jac)
        return solution.x, covariance

    def _start(self, log_x, response, upper):
        """The best of the line fits with E fixed at fractions of min y."""
        best = None
        for fraction in self._START_FRACTIONS:
            line = _KnownIrreducible(fraction * upper)
            theta, _ = line.fit(log_x, line.response(np.exp(response)))
            error = float(np.sum((self.predict(theta, log_x) - response) ** 2))
            if best is None or error < best[0]:
                best = (error, theta)
        return best[1]


def _student_t(confidence, dof):
    from scipy.stats import t

    return float(t.ppf((1 + confidence) / 2, dof))


def _covariance_intervals(theta, covariance, dof, confidence):
    """Student-t intervals for E, alpha and log x_c = c / alpha (delta method for the last)."""
    quantile = _student_t(confidence, dof)
    e, alpha, c = (float(v) for v in theta)
    if alpha:
        gradient = np.array([0.0, -c / alpha**2, 1 / alpha])
        log_scale_variance = float(gradient @ covariance @ gradient)
    else:
        log_scale_variance = math.nan
    variances = (covariance[0, 0], covariance[1, 1], log_scale_variance)
    centres = (e, alpha, _log_scale(alpha, c))
    return {
        name: (centre - quantile * math.sqrt(max(var, 0.0)),
               centre + quantile * math.sqrt(max(var, 0.0)))
        for name, centre, var in zip(_ESTIMATES, centres, variances, strict=True)
    }  # fmt: skip


def _bootstrap_intervals(model, theta, log_x, residuals, dof, confidence, n_bootstrap, seed):
    """Percentile intervals from refits to the fitted response plus resampled residuals,
    each side widened about the estimate by :math:`t_{n-p} / z`.

    The refits see the residuals' scatter as if it were known; it is estimated from
    ``dof`` residuals, which widens a normal interval by that ratio (Student's), as the
    covariance intervals are.
    """
    from scipy.stats import norm

    rng = np.random.default_rng(seed)
    fitted = model.predict(theta, log_x)
    spread = residuals * math.sqrt(log_x.size / dof)
    draws = np.empty((int(n_bootstrap), 3))
    for i in range(int(n_bootstrap)):
        e, alpha, c = model.fit(log_x, fitted + rng.choice(spread, size=spread.size))[0]
        draws[i] = e, alpha, _log_scale(alpha, c)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(draws, [tail, 100 - tail], axis=0)
    widening = _student_t(confidence, dof) / float(norm.ppf((1 + confidence) / 2))
    centres = (theta[0], theta[1], _log_scale(theta[1], theta[2]))
    return {
        name: (float(centre - widening * (centre - low[i])),
               float(centre + widening * (high[i] - centre)))
        for i, (name, centre) in enumerate(zip(_ESTIMATES, centres, strict=True))
    }  # fmt: skip


def _packaged(theta, intervals, known, confidence, method, n_points, dof, residual_std):
    e, alpha, c = (float(v) for v in theta)
    log_low, log_high = intervals["log_scale"]
    log_scale = _log_scale(alpha, c)
    return ScalingLawFit(
        exponent=alpha,
        exponent_interval=tuple(float(v) for v in intervals["exponent"]),
        # An exponent near 0 (a flat fit of noisy points) puts the scale beyond
        # float range: it is then inf, not an OverflowError.
        scale=math.exp(log_scale) if not log_scale >= _LOG_FLOAT_MAX else math.inf,
        scale_interval=(_exp(log_low), _exp(log_high)),
        irreducible=e,
        irreducible_interval=None if known is not None else tuple(intervals["irreducible"]),
        irreducible_fitted=known is None,
        confidence=float(confidence),
        method=method,
        n_points=n_points,
        dof=dof,
        residual_std=residual_std,
    )


def _log_scale(alpha, c):
    r""":math:`\log x_c = c / \alpha`; undefined (nan) for :math:`\alpha = 0`, where
    :math:`(x_c / x)^0 = 1` whatever :math:`x_c`."""
    return c / alpha if alpha else math.nan


#: The log of the largest float: exp() of anything above overflows.
_LOG_FLOAT_MAX = math.log(np.finfo(np.float64).max)


def _exp(value):
    if math.isnan(value):
        return math.nan
    return math.exp(min(value, 700.0)) if math.isfinite(value) else (0.0 if value < 0 else math.inf)
