"""The Monte Carlo score problem of :func:`tfmath.variance.sample_scores`, and its random streams.

The constants of SplitMix64 and of the stream layout are shared by the CPU and
CUDA kernels and the NumPy oracle, which must draw the same numbers.
"""

import math
import numbers
from dataclasses import dataclass

import numpy as np

from tfmath._contract.checks import choice, integer, real
from tfmath.errors import ArgumentError, DTypeError

#: The component laws of :func:`~tfmath.variance.sample_scores`, each of mean 0 and variance 1.
DISTRIBUTIONS = ("normal", "uniform", "rademacher")
#: Codes of :data:`DISTRIBUTIONS` as the kernels receive them.
NORMAL, UNIFORM, RADEMACHER = range(len(DISTRIBUTIONS))
#: :math:`E[x^4]` of each unit-variance component law: 3, 9/5 and 1.
FOURTH_MOMENTS = {"normal": 3.0, "uniform": 9.0 / 5.0, "rademacher": 1.0}

#: SplitMix64's increment, :math:`\lfloor 2^{64} / \varphi \rfloor` [Steele2014]_.
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
#: The two multipliers of SplitMix64's output function [Steele2014]_.
SPLITMIX_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
#: Rademacher signs per xoroshiro128+ output: only the upper half is used, because the
#: lowest bits of a ``+``-scrambled generator have low linear complexity [Blackman2021]_.
SIGN_BITS_PER_WORD = 32
_MASK64 = (1 << 64) - 1


def splitmix64_mix(z):
    """SplitMix64's output function on a Python integer (taken modulo :math:`2^{64}`)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * SPLITMIX_MULTIPLIERS[0]) & _MASK64
    z = ((z ^ (z >> 27)) * SPLITMIX_MULTIPLIERS[1]) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True)
class ScoreSampling:
    r"""A validated Monte Carlo problem, as every backend of :func:`sample_scores` receives it.

    Row :math:`r` holds one query :math:`q` and ``n_keys`` keys :math:`k_j`, all independent
    vectors whose components are

    .. math:: c_i = \mu + \sqrt{\rho}\, z + \sqrt{1 - \rho}\, x_i, \qquad i = 1, \dots, d_k,

    with :math:`z, x_1, \dots, x_{d_k}` independent draws of the unit-variance ``distribution``
    (one :math:`z` per vector). The random numbers come from xoroshiro128+ [Blackman2021]_
    streams: the query of row :math:`r` from stream :math:`2r`, its keys, one after the
    other, from stream :math:`2r + 1`. Stream :math:`t` starts from the state

    .. math::

        (s_0, s_1) = \bigl(m(b + (2t + 1)\gamma),\; m(b + (2t + 2)\gamma)\bigr),
        \qquad b = m\bigl(m(\text{seed} + \gamma) + d_k \gamma\bigr) \bmod 2^{64},

    where :math:`m` is SplitMix64's output function and :math:`\gamma` its increment
    [Steele2014]_. So every number is a function of ``(seed, d_k, row)`` alone: the
    same on every run, thread count and backend, and the same for a row whatever
    ``n_rows`` or the other parameters are (common random numbers across
    distributions' means and correlations).

    Within a stream a vector takes, in order:

    ``normal``
        :math:`\lceil (d_k + 1)/2 \rceil` pairs from Marsaglia's polar method
        [Marsaglia1964]_ (two uniforms per attempt, an attempt accepted when
        :math:`0 < u^2 + v^2 < 1`), giving :math:`z, x_1, x_2, \dots`; a last unused
        normal is dropped.
    ``uniform``
        :math:`d_k + 1` outputs, each :math:`\sqrt{3}\,(2U - 1)` with
        :math:`U = \lfloor w / 2^{11} \rfloor \, 2^{-53}` (the uniform of
        ``numba.cuda.random``).
    ``rademacher``
        one output whose bit 63 gives :math:`z = 1 - 2\,\text{bit}`, then
        :math:`\lceil d_k / 32 \rceil` outputs whose bits 32 to 63 give
        :math:`x_1, x_2, \dots` the same way.
    """

    d_k: int
    n_rows: int
    n_keys: int
    distribution: str
    mean: float
    correlation: float
    seed: int
    backend: str

    @property
    def kind(self):
        """The distribution's code for the kernels (an index into :data:`DISTRIBUTIONS`)."""
        return DISTRIBUTIONS.index(self.distribution)

    @property
    def shared_weight(self):
        r""":math:`\sqrt{\rho}`, the weight of the component shared by a whole vector."""
        return math.sqrt(self.correlation)

    @property
    def own_weight(self):
        r""":math:`\sqrt{1 - \rho}`, the weight of each component's own draw."""
        return math.sqrt(1.0 - self.correlation)

    @property
    def is_empty(self):
        """Never: every count is at least 1."""
        return False

    def on_host(self):
        return self

    @property
    def on_device(self):
        return False

    def stream_base(self):
        """The SplitMix64 position ``b`` the row streams of this ``(seed, d_k)`` start from."""
        return splitmix64_mix(splitmix64_mix(self.seed + GOLDEN_GAMMA) + self.d_k * GOLDEN_GAMMA)


def score_sampling(d_k, n_rows, n_keys, distribution, mean, correlation, seed, *, backend):
    """Validate :func:`~tfmath.variance.sample_scores`'s arguments as a :class:`ScoreSampling`."""
    return ScoreSampling(
        d_k=integer("d_k", d_k, minimum=1),
        n_rows=integer("n_rows", n_rows, minimum=1),
        n_keys=integer("n_keys", n_keys, minimum=1),
        distribution=choice("distribution", distribution, DISTRIBUTIONS),
        mean=real("mean", mean),
        correlation=component_correlation(correlation),
        seed=stream_seed(seed),
        backend=backend,
    )


def component_correlation(correlation):
    r"""The correlation :math:`\rho \in [0, 1]` of a vector's components: the shared factor
    the samplers draw can only correlate them positively."""
    correlation = real("correlation", correlation)
    if not 0.0 <= correlation <= 1.0:
        raise ArgumentError(f"correlation must lie in [0, 1], got {correlation}")
    return correlation


def dimension_array(d_k):
    """``d_k`` as a float64 array of whole numbers >= 1 (an integer, or an array of them)."""
    if isinstance(d_k, numbers.Integral) and not isinstance(d_k, bool):
        return np.float64(integer("d_k", d_k, minimum=1))
    array = np.asarray(d_k)
    if array.dtype.kind not in "iuf":
        raise DTypeError(f"d_k must hold integers, got dtype {array.dtype} ({d_k!r:.60})")
    dims = array.astype(np.float64)
    whole = np.isfinite(dims) & (dims == np.round(dims)) & (dims >= 1)
    if not whole.all():
        bad = dims[~whole].flat[0]
        raise ArgumentError(f"d_k must hold whole numbers >= 1, got {bad:g} in d_k")
    return dims


def stream_seed(seed):
    """A seed of the random streams: an integer in :math:`[0, 2^{64})`."""
    seed = integer("seed", seed, minimum=0)
    if seed > _MASK64:
        raise ArgumentError(f"seed must lie in [0, 2**64), got {seed}")
    return seed


def dimension_list(d_k):
    """``d_k`` as a non-empty tuple of integers >= 1, naming the bad entry if any."""
    if isinstance(d_k, numbers.Integral) and not isinstance(d_k, bool):
        return (integer("d_k", d_k, minimum=1),)
    if isinstance(d_k, str) or not hasattr(d_k, "__len__"):
        raise DTypeError(f"d_k must be an integer or a sequence of integers, got {d_k!r}")
    if len(d_k) == 0:
        raise ArgumentError("d_k must hold at least one dimension, got an empty sequence")
    return tuple(integer(f"d_k[{i}]", value, minimum=1) for i, value in enumerate(d_k))
