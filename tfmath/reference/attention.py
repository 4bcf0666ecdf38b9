"""NumPy oracles for softmax and attention by its definition (the naive method)."""

import numpy as np


def softmax(x):
    r"""Softmax of each row of a 2-D array.

    .. math:: p_j = \frac{e^{x_j - m}}{\sum_k e^{x_k - m}}, \qquad m = \max_k x_k

    A row of all ``-inf`` gives zeros; NaN anywhere in a row makes it NaN
    (``np.max`` propagates NaN, and so does everything after it).
    """
    if x.shape[-1] == 0:
        return x.copy()
    row_max = np.max(x, axis=-1, keepdims=True)
    nothing_to_attend = row_max == -np.inf
    # inf - inf and NaN arithmetic are meant to give NaN here, quietly.
    with np.errstate(invalid="ignore", divide="ignore"):
        shifted = x - np.where(nothing_to_attend, 0.0, row_max)
        exponentials = np.exp(shifted)
        total = np.sum(exponentials, axis=-1, keepdims=True)
        probabilities = exponentials / total
    return np.where(nothing_to_attend, 0.0, probabilities).astype(x.dtype, copy=False)


def naive_attention(problem):
    r"""Attention by its definition, on a validated attention problem.

    .. math::

        B_{ij} = \begin{cases} -\infty & \text{if } i \text{ may not attend } j \\
                 s\, q_i \cdot k_j + M_{ij} & \text{otherwise} \end{cases}
        \qquad W = \operatorname{softmax}_j(B), \qquad O_i = \sum_{j : W_{ij} > 0} W_{ij} v_j

    where "may not attend" means a boolean mask entry False, a float mask
    entry of ``-inf``, or ``j > i`` when causal. Positions with weight exactly
    zero are left out of the sum so that NaN or inf stored there (padding)
    does not turn ``0 * nan`` into NaN.

    Returns
    -------
    output : numpy.ndarray, shape ``batch_shape + (L, Ev)``
    weights : numpy.ndarray or None, shape ``batch_shape + (L, S)``
    """
    weights = attention_weights(problem)
    value = problem.value
    if np.all(np.isfinite(value)):
        output = weights @ value
    else:
        output = _sum_over_attended(weights, value)
    output = np.broadcast_to(output, problem.output_shape()).astype(problem.dtype)
    return output, (weights.astype(problem.dtype) if problem.return_weights else None)


def attention_weights(problem):
    """``softmax(scale * Q K^T + M)`` with forbidden pairs at ``-inf``, broadcast to
    ``batch_shape + (L, S)``."""
    return softmax(masked_scores(problem))


def masked_scores(problem):
    """``scale * Q K^T + M`` with forbidden pairs at ``-inf``, broadcast to
    ``batch_shape + (L, S)``."""
    query, key = problem.query, problem.key
    n_query, n_key = problem.n_query, problem.n_key
    scores = problem.scale * (query @ np.swapaxes(key, -1, -2))
    forbidden = np.zeros((n_query, n_key), dtype=bool)
    if problem.is_causal:
        forbidden |= np.triu(np.ones((n_query, n_key), dtype=bool), k=1)
    mask = problem.attn_mask
    if mask is not None:
        if mask.dtype == np.bool_:
            forbidden = forbidden | ~mask
        else:
            forbidden = forbidden | (mask == -np.inf)
            scores = scores + mask
    scores = np.where(forbidden, -np.inf, scores)
    return np.broadcast_to(scores, problem.weights_shape())


def _sum_over_attended(weights, value):
    """``weights @ value`` summing only where the weight is non-zero, one row at a time."""
    value = np.broadcast_to(value, weights.shape[:-2] + value.shape[-2:])
    output = np.zeros(weights.shape[:-1] + value.shape[-1:], dtype=np.result_type(weights, value))
    for index in np.ndindex(weights.shape[:-1]):
        attended = weights[index] != 0
        output[index] = weights[index][attended] @ value[index[:-1]][attended]
    return output
