r"""The optimiser of seed 002 and Vaswani et al. (2017, section 5.3): Adam with warm-up.

:class:`Adam` is Kingma and Ba's (2015) algorithm with the transformer's
settings :math:`\beta_1 = 0.9`, :math:`\beta_2 = 0.98`, :math:`\epsilon = 10^{-9}`
as defaults. It is functional: :meth:`Adam.init` makes an :class:`AdamState`
and :meth:`Adam.update` returns new parameters and a new state, changing
neither input, so nothing is hidden between steps.

:class:`WarmupSchedule` is the learning rate

.. math::

    \mathrm{lr}(t) = d^{-1/2} \min\big(t^{-1/2},\; t\, w^{-3/2}\big),

which rises linearly for :math:`w` warm-up steps and then decays as
:math:`t^{-1/2}`. Both branches meet where :math:`t^{-1/2} = t\,w^{-3/2}`,
i.e. :math:`t^{3/2} = w^{3/2}`, so the peak is at step :math:`t^* = w` with
value :math:`\mathrm{lr}(w) = d^{-1/2} w^{-1/2} = 1/\sqrt{d\,w}`.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tfmath._contract.checks import integer, real
from tfmath.errors import ArgumentError, DTypeError, ShapeError
from tfmath.training.params import Parameters

__all__ = ["Adam", "AdamState", "ConstantSchedule", "CosineSchedule", "WarmupSchedule"]


@dataclass(frozen=True)
class WarmupSchedule:
    r"""The transformer's learning rate, :math:`d^{-1/2} \min(t^{-1/2}, t\, w^{-3/2})`.

    Seed 002 and Vaswani et al. (2017), equation 3, with :math:`d = d_{model}`
    and :math:`w` the warm-up steps (4000 in the paper).

    Parameters
    ----------
    d_model : float
        Positive.
    warmup : float
        Warm-up steps, at least 1.

    Raises
    ------
    ValueError
        For ``d_model <= 0`` or ``warmup < 1``.

    Examples
    --------
    >>> from tfmath.training.optim import WarmupSchedule
    >>> schedule = WarmupSchedule(d_model=512, warmup=4000)
    >>> schedule.peak_step, round(schedule.peak_learning_rate, 10)
    (4000.0, 0.0006987712)
    >>> float(schedule(4000)) == schedule.peak_learning_rate
    True
    """

    d_model: float
    warmup: float

    def __post_init__(self):
        object.__setattr__(self, "d_model", real("d_model", self.d_model, above=0))
        object.__setattr__(self, "warmup", real("warmup", self.warmup, at_least=1))

    def __call__(self, step):
        r"""The learning rate at ``step`` (a number or an array, each :math:`\ge 1`)."""
        steps = np.asarray(step, dtype=np.float64)
        if steps.size and not np.all(steps >= 1):
            raise ArgumentError(
                f"step must be >= 1 (step^-0.5 is infinite at 0), got {np.min(steps)}"
            )
        rate = self.d_model**-0.5 * np.minimum(steps**-0.5, steps * self.warmup**-1.5)
        return rate if rate.ndim else float(rate)

    @property
    def peak_step(self):
        """:math:`t^* = w`, where the linear rise meets the :math:`t^{-1/2}` decay."""
        return self.warmup

    @property
    def peak_learning_rate(self):
        r""":math:`\mathrm{lr}(w) = (d\, w)^{-1/2}`."""
        return 1 / math.sqrt(self.d_model * self.warmup)


@dataclass(frozen=True)
class CosineSchedule:
    r"""Linear warm-up, then a cosine decay that ends with the run (Hoffmann et al. 2022).

    .. math::

        \mathrm{lr}(t) = \begin{cases}
            \eta\, t / w & t \le w, \\
            \eta \big(f + (1 - f)\, \tfrac12 [1 + \cos(\pi \tfrac{t - w}{T - w})]\big)
                & w < t \le T,
        \end{cases}

    with peak :math:`\eta`, warm-up :math:`w`, run length :math:`T` and final
    fraction :math:`f`: the rate reaches :math:`f \eta` on the run's last step.
    Hoffmann et al. (2022, section 3.1 and appendix B) decay to 10% of the peak
    over a cycle matched to each run's tokens, and find that a cycle longer than
    the run biases the compute-optimal model size; this schedule is that cycle.

    Parameters
    ----------
    peak : float
        :math:`\eta > 0`.
    steps : int
        :math:`T`, the run's last step.
    warmup : int
        :math:`w`, at least 1 and below ``steps``.
    final_fraction : float, optional
        :math:`f` in [0, 1]; default 0.1.

    Examples
    --------
    >>> from tfmath.training.optim import CosineSchedule
    >>> schedule = CosineSchedule(peak=0.01, steps=1000, warmup=50)
    >>> schedule(25), schedule(50), round(schedule(1000), 12)
    (0.005, 0.01, 0.001)
    """

    peak: float
    steps: int
    warmup: int
    final_fraction: float = 0.1

    def __post_init__(self):
        real("peak", self.peak, above=0)
        fraction = real("final_fraction", self.final_fraction, at_least=0)
        if fraction > 1:
            raise ArgumentError(f"final_fraction must lie in [0, 1], got {fraction}")
        integer("steps", self.steps, minimum=2)
        integer("warmup", self.warmup, minimum=1)
        if not 1 <= self.warmup < self.steps:
            raise ArgumentError(
                f"warmup must lie in [1, steps), got warmup = {self.warmup}, steps = {self.steps}"
            )

    def __call__(self, step):
        """The learning rate at ``step`` (a number or an array, each in [1, steps])."""
        t = np.asarray(step, dtype=np.float64)
        if t.size and not (np.all(t >= 1) and np.all(t <= self.steps)):
            raise ArgumentError(f"step must lie in [1, {self.steps}], got {t.min()} to {t.max()}")
        progress = np.clip((t - self.warmup) / (self.steps - self.warmup), 0, 1)
        decay = self.final_fraction + (1 - self.final_fraction) * 0.5 * (
            1 + np.cos(np.pi * progress)
        )
        rate = self.peak * np.where(t <= self.warmup, t / self.warmup, decay)
        return rate if rate.ndim else float(rate)


@dataclass(frozen=True)
class ConstantSchedule:
    r"""Linear warm-up to a peak, then the peak to the end: Kaplan et al.'s (2020) schedule
    before its decay, and the one a run without decay keeps.

    .. math::

        \mathrm{lr}(t) = \eta \min(1, t / w).

    The rate does not depend on the run's length, so the first :math:`s` steps of
    a longer run are the run of :math:`s` steps. The warm-up may be longer than
    the run, as a warm-up fixed in steps is for the shortest runs of a sweep: the
    rate then never reaches the peak.

    Parameters
    ----------
    peak : float
        :math:`\eta > 0`.
    warmup : int
        :math:`w`, at least 1.

    Examples
    --------
    >>> from tfmath.training.optim import ConstantSchedule
    >>> schedule = ConstantSchedule(peak=0.01, warmup=100)
    >>> schedule(50), schedule(100), schedule(5000)
    (0.005, 0.01, 0.01)
    """

    peak: float
    warmup: int

    def __post_init__(self):
        real("peak", self.peak, above=0)
        integer("warmup", self.warmup, minimum=1)

    def __call__(self, step):
        """The learning rate at ``step`` (a number or an array, each at least 1)."""
        if isinstance(step, int | float) and not isinstance(step, bool):
            # The trainer's path, once a step: the same IEEE operations as the array
            # path below, without its conversions.
            if not step >= 1:
                raise ArgumentError(f"step must be >= 1, got {step}")
            return self.peak * min(1.0, step / self.warmup)
        t = np.asarray(step, dtype=np.float64)
        if t.size and not np.all(t >= 1):
            raise ArgumentError(f"step must be >= 1, got {t.min()}")
        rate = self.peak * np.minimum(1.0, t / self.warmup)
        return rate if rate.ndim else float(rate)


@dataclass(frozen=True)
class AdamState:
    """Adam's state between steps.

    Attributes
    ----------
    step : int
        Steps taken so far.
    first_moment, second_moment : Parameters
        :math:`m` and :math:`v`, named as the parameters.
    """

    step: int
    first_moment: Parameters
    second_moment: Parameters


@dataclass(frozen=True)
class Adam:
    r"""Adam (Kingma and Ba 2015, algorithm 1) with the transformer's defaults.

    For each parameter :math:`\theta` with gradient :math:`g`, at step :math:`t`:

    .. math::

        m_t = \beta_1 m_{t-1} + (1 - \beta_1)\, g, \qquad
        v_t = \beta_2 v_{t-1} + (1 - \beta_2)\, g^2,

        \theta_t = \theta_{t-1} - \alpha_t\,
            \frac{m_t / (1 - \beta_1^t)}{\sqrt{v_t / (1 - \beta_2^t)} + \epsilon} .

    The divisions by :math:`1 - \beta^t` undo the moments' bias towards their
    zero start; on the first step the update is
    :math:`\alpha\, g / (|g| + \epsilon)`, a step of size about :math:`\alpha`
    in the direction of :math:`-\operatorname{sign}(g)`. The arithmetic is in float64,
    rounded to the parameters' dtype once; the moments are kept in that dtype.

    Parameters
    ----------
    learning_rate : float or callable, optional
        :math:`\alpha`, or a function of the step :math:`t = 1, 2, \dots`
        returning it, such as :class:`WarmupSchedule`.
    beta1, beta2 : float, optional
        In [0, 1); default 0.9 and 0.98 (Vaswani et al. 2017, section 5.3).
    eps : float, optional
        Default :math:`10^{-9}`.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.training.optim import Adam, WarmupSchedule
    >>> from tfmath.training.params import Parameters
    >>> params = Parameters({"w": np.array([1.0, -2.0])})
    >>> adam = Adam(learning_rate=0.1)
    >>> state = adam.init(params)
    >>> params, state = adam.update(params, Parameters({"w": np.array([0.5, -3.0])}), state)
    >>> params["w"].round(6)
    array([ 0.9, -1.9])
    """

    learning_rate: float | Callable = 1e-3
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-9

    def __post_init__(self):
        if not callable(self.learning_rate):
            real("learning_rate", self.learning_rate, at_least=0)
        real("beta1", self.beta1, at_least=0, below=1)
        real("beta2", self.beta2, at_least=0, below=1)
        real("eps", self.eps, at_least=0)

    def init(self, params):
        """The state before the first step: zero moments, step 0."""
        params = _parameters("params", params)
        return AdamState(0, params.zeros_like(), params.zeros_like())

    def rate(self, step):
        """:math:`\\alpha_t` at step ``step``."""
        rate = self.learning_rate(step) if callable(self.learning_rate) else self.learning_rate
        return real("learning_rate", rate, at_least=0)

    def update(self, params, grads, state):
        """One step: new parameters and state (the inputs are not modified).

        Parameters
        ----------
        params, grads : Parameters
            With the same names and shapes.
        state : AdamState
            From :meth:`init` or the previous :meth:`update`.

        Returns
        -------
        params : Parameters
        state : AdamState

        Raises
        ------
        ShapeError
            When ``grads`` and ``params`` differ in names or shapes.
        """
        params, grads = _parameters("params", params), _parameters("grads", grads)
        _check_matching(params, grads, state)
        step = state.step + 1
        rate = self.rate(step)
        first_correction = 1 - self.beta1**step
        second_correction = 1 - self.beta2**step
        new_params, first, second = {}, {}, {}
        for name, theta in params.items():
            # In float64, rounded to the parameters' dtype once, as the fused step's kernel
            # does: in float32, v / (1 - beta2^t) (g^2 on the first step) overflowed from
            # |g| = 1.8e19 and the parameter did not move.
            g = grads[name].astype(np.float64)
            m = self.beta1 * state.first_moment[name] + (1 - self.beta1) * g
            with np.errstate(over="ignore"):  # g^2 beyond float64: v = inf, no step (as PyTorch)
                v = self.beta2 * state.second_moment[name] + (1 - self.beta2) * g * g
            step_size = (m / first_correction) / (np.sqrt(v / second_correction) + self.eps)
            new_params[name] = (theta - rate * step_size).astype(theta.dtype)
            first[name], second[name] = m.astype(theta.dtype), v.astype(theta.dtype)
        return Parameters(new_params), AdamState(step, Parameters(first), Parameters(second))


def _parameters(name, value):
    if not isinstance(value, Parameters):
        raise DTypeError(
            f"{name} must be a tfmath.training.params.Parameters, got {type(value).__name__}"
        )
    return value


def _check_matching(params, grads, state):
    if not isinstance(state, AdamState):
        raise DTypeError(f"state must be an AdamState, got {type(state).__name__}")
    if set(params) != set(grads):
        raise ShapeError(
            f"grads must have the names of params: missing {sorted(set(params) - set(grads))}, "
            f"extra {sorted(set(grads) - set(params))}"
        )
    for moments in ("first_moment", "second_moment"):
        if set(getattr(state, moments)) != set(params):
            raise ShapeError(
                f"state.{moments} must have the names of params: missing "
                f"{sorted(set(params) - set(getattr(state, moments)))}, extra "
                f"{sorted(set(getattr(state, moments)) - set(params))} (a state of other "
                "parameters?)"
            )
    for name, theta in params.items():
        for what, array in (
            (f"grads[{name!r}]", grads[name]),
            (f"state.first_moment[{name!r}]", state.first_moment[name]),
            (f"state.second_moment[{name!r}]", state.second_moment[name]),
        ):
            if array.shape != theta.shape:
                raise ShapeError(
                    f"{what} has shape {array.shape} but the parameter has {theta.shape}"
                )
