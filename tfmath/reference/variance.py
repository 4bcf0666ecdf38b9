r"""NumPy oracles for the scaling-variance routines, and the attention derivative they use.

:func:`score_samples` draws the same random numbers as the kernels (the stream layout of
:class:`tfmath.variance.ScoreSampling`), one generator per row advanced in lock-step with
NumPy's wrapping ``uint64`` arithmetic, but builds every query and key vector component by
component and takes the dot product as written, where the kernels expand it (Rademacher
signs are packed in words and counted). :func:`softmax_row_statistics` builds the
Jacobian matrix itself and takes its norm.
"""

import numpy as np

from tfmath._contract.variance import (
    GOLDEN_GAMMA,
    NORMAL,
    RADEMACHER,
    SIGN_BITS_PER_WORD,
    SPLITMIX_MULTIPLIERS,
)
from tfmath.reference.attention import softmax

#: Rows generated at once, to bound the memory of the ``(rows, d_k)`` component arrays.
ROWS_PER_BLOCK = 512


def _mix64(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(SPLITMIX_MULTIPLIERS[0])
    z = (z ^ (z >> np.uint64(27))) * np.uint64(SPLITMIX_MULTIPLIERS[1])
    return z ^ (z >> np.uint64(31))


def _rotate_left(x, k):
    return (x << np.uint64(k)) | (x >> np.uint64(64 - k))


class XoroshiroStreams:
    """One xoroshiro128+ generator [Blackman2021]_ per lane, advanced together.

    Lane ``i`` is stream ``streams[i]`` of the layout in
    :class:`tfmath.variance.ScoreSampling`: its state is the pair of SplitMix64 outputs
    ``2 t + 1`` and ``2 t + 2`` after position ``base``.
    """

    def __init__(self, base, streams):
        counter = np.uint64(2) * np.asarray(streams, dtype=np.uint64)
        gamma = np.uint64(GOLDEN_GAMMA)
        base = np.uint64(base)
        self.s0 = _mix64(base + gamma * (counter + np.uint64(1)))
        self.s1 = _mix64(base + gamma * (counter + np.uint64(2)))

    @property
    def n_lanes(self):
        return self.s0.size

    def next(self, lanes=slice(None)):
        """The next 64-bit output of the chosen lanes (all by default), advancing only them."""
        s0, s1 = self.s0[lanes], self.s1[lanes]
        result = s0 + s1
        s1 = s1 ^ s0
        self.s0[lanes] = _rotate_left(s0, 55) ^ s1 ^ (s1 << np.uint64(14))
        self.s1[lanes] = _rotate_left(s1, 36)
        return result

    def uniform(self, lanes=slice(None)):
        r"""Uniforms on [0, 1): the top 53 bits of the next output times :math:`2^{-53}`."""
        return (self.next(lanes) >> np.uint64(11)).astype(np.float64) * 2.0**-53

    def normal_pair(self):
        r"""Two standard normals per lane by Marsaglia's polar method [Marsaglia1964]_.

        Draw :math:`u, v` uniform on :math:`[-1, 1)` until :math:`0 < s = u^2 + v^2 < 1`,
        then return :math:`u f, v f` with :math:`f = \sqrt{-2 \ln s / s}`. Lanes whose
        point fell outside the disk draw again; the others are left untouched.
        """
        first = np.empty(self.n_lanes)
        second = np.empty(self.n_lanes)
        pending = np.arange(self.n_lanes)
        while pending.size:
            u = 2.0 * self.uniform(pending) - 1.0
            v = 2.0 * self.uniform(pending) - 1.0
            s = u * u + v * v
            inside = (s > 0.0) & (s < 1.0)
            factor = np.sqrt(-2.0 * np.log(s[inside]) / s[inside])
            first[pending[inside]] = u[inside] * factor
            second[pending[inside]] = v[inside] * factor
            pending = pending[~inside]
        return first, second


def _unit_draws(streams, kind, d_k):
    """The ``d_k + 1`` unit-variance draws ``z, x_1 .. x_d`` of one vector per lane."""
    if kind == NORMAL:
        pairs = [streams.normal_pair() for _ in range((d_k + 2) // 2)]
        return np.stack([draw for pair in pairs for draw in pair], axis=1)[:, : d_k + 1]
    if kind == RADEMACHER:
        z = 1.0 - 2.0 * (streams.next() >> np.uint64(63)).astype(np.float64)
        n_words = -(-d_k // SIGN_BITS_PER_WORD)
        words = np.stack([streams.next() for _ in range(n_words)], axis=1)
        bit_index = np.arange(d_k)
        word = words[:, bit_index // SIGN_BITS_PER_WORD]
        shift = (SIGN_BITS_PER_WORD + bit_index % SIGN_BITS_PER_WORD).astype(np.uint64)
        bits = (word >> shift) & np.uint64(1)
        return np.concatenate([z[:, None], 1.0 - 2.0 * bits.astype(np.float64)], axis=1)
    draws = np.stack([streams.uniform() for _ in range(d_k + 1)], axis=1)
    return np.sqrt(3.0) * (2.0 * draws - 1.0)


def _vectors(streams, problem):
    r"""One vector per lane with components :math:`\mu + \sqrt{\rho} z + \sqrt{1-\rho} x_i`."""
    draws = _unit_draws(streams, problem.kind, problem.d_k)
    z, x = draws[:, :1], draws[:, 1:]
    return problem.mean + problem.shared_weight * z + problem.own_weight * x


def score_samples(problem):
    r"""Scores :math:`q_r \cdot k_{rj}` of a :class:`~tfmath.variance.ScoreSampling`, as defined.

    For each block of rows: draw every row's query from its stream :math:`2r`, then its
    keys one after the other from stream :math:`2r + 1`, and sum
    :math:`\sum_i q_{ri} k_{rji}`.
    """
    base = problem.stream_base()
    scores = np.empty((problem.n_rows, problem.n_keys))
    for start in range(0, problem.n_rows, ROWS_PER_BLOCK):
        rows = np.arange(start, min(start + ROWS_PER_BLOCK, problem.n_rows))
        queries = _vectors(XoroshiroStreams(base, 2 * rows), problem)
        key_streams = XoroshiroStreams(base, 2 * rows + 1)
        for j in range(problem.n_keys):
            keys = _vectors(key_streams, problem)
            scores[rows, j] = np.sum(queries * keys, axis=1)
    return scores


def softmax_row_statistics(scores, scale):
    r"""``(max weight, entropy, ||J||_F)`` of each row of ``softmax(scale * scores)``.

    .. math::

        p = \operatorname{softmax}(s x), \qquad H = -\sum_{j : p_j > 0} p_j \log p_j,
        \qquad \|J\|_F = \bigl\| \operatorname{diag}(p) - p p^\top \bigr\|_F

    with the Jacobian built as a matrix. Computed in float64 and rounded to the dtype of
    ``scores``. In a row that has saturated to one-hot, the entries of ``J`` are formed as
    differences of numbers near 1, so there this oracle is exact only to about ``1e-16``
    in absolute terms, where the kernels keep relative precision.
    """
    blocks = [
        _row_statistics_block(scores[start : start + ROWS_PER_BLOCK], scale)
        for start in range(0, scores.shape[0], ROWS_PER_BLOCK)
    ]
    statistics = np.concatenate(blocks, axis=1) if blocks else np.empty((3, 0))
    return statistics.astype(scores.dtype)


def _row_statistics_block(scores, scale):
    p = softmax(scale * scores.astype(np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    jacobian = np.einsum("ri,ij->rij", p, np.eye(p.shape[1])) - np.einsum("ri,rj->rij", p, p)
    return np.stack([p.max(axis=1), -plogp.sum(axis=1), np.linalg.norm(jacobian, axis=(1, 2))])
