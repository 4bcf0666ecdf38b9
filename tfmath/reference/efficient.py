r"""NumPy oracles for linear attention and sparse attention, written from the definitions."""

import numpy as np

from tfmath._contract.efficient import feature_map
from tfmath.reference.attention import naive_attention


def linear_attention(problem, feature_code, eps):
    r"""Linear attention by its definition, in float64.

    .. math::

        o_i = \frac{\phi(q_i)^\top S_i}{\phi(q_i)^\top z_i + \varepsilon}, \quad
        S_i = \frac{1}{c_i}\sum_{j \in A_i} \phi(k_j) v_j^\top, \quad
        z_i = \frac{1}{c_i}\sum_{j \in A_i} \phi(k_j)

    with :math:`A_i` all keys (non-causal) or :math:`j \le i` (causal), and
    :math:`c_i = |A_i|`. The causal prefix states are ``np.cumsum`` of the
    outer products :math:`\phi(k_j) v_j^\top`; queries past the last key see
    all keys. No keys (``S == 0``) gives 0.
    """
    n_query, n_key = problem.n_query, problem.n_key
    if n_key == 0:
        return np.zeros(problem.output_shape(), dtype=problem.dtype)
    query = feature_map(problem.query, feature_code)
    key = feature_map(problem.key, feature_code)
    value = np.asarray(problem.value, dtype=np.float64)
    outer = key[..., :, :, None] * value[..., :, None, :]
    if problem.is_causal:
        last_key = np.minimum(np.arange(n_query), n_key - 1)
        count = (last_key + 1.0)[:, None]
        state = np.cumsum(outer, axis=-3)[..., last_key, :, :] / count[..., None]
        normaliser = np.cumsum(key, axis=-2)[..., last_key, :] / count
        numerator = np.einsum("...ie,...ief->...if", query, state)
        denominator = np.einsum("...ie,...ie->...i", query, normaliser)
    else:
        state = np.sum(outer, axis=-3) / n_key
        normaliser = np.sum(key, axis=-2) / n_key
        numerator = query @ state
        denominator = query @ normaliser[..., None]
        denominator = denominator[..., 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        output = numerator / (denominator[..., None] + eps)
    return np.broadcast_to(output, problem.output_shape()).astype(problem.dtype)


def sparse_attention(problem, pattern):
    r"""Exact attention with the pattern's boolean mask :math:`M_{ij} = [j \in A_i]`.

    .. math:: o_i = \sum_{j \in A_i} \operatorname{softmax}_{j \in A_i}(s\, q_i \cdot k_j)\, v_j

    The mask comes from :meth:`~tfmath.efficient.SparsePattern.mask`, the
    vectorised definition of each pattern; the kernels never form it.
    """
    mask = pattern.mask(problem.n_query, problem.n_key)
    masked = problem._replace(attn_mask=mask, return_weights=False)
    output, _ = naive_attention(masked)
    return output
