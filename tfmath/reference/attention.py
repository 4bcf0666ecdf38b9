"""NumPy oracles for softmax and attention by its definition (the naive method)."""

import numpy as np

from tfmath._contract.checks import is_half
from tfmath.reference.half import sequential_sum


def softmax(x):
    r"""Softmax along the last axis.

    .. math:: p_j = \frac{e^{x_j - m}}{\sum_k e^{x_k - m}}, \qquad m = \max_k x_k

    A row of all ``-inf`` gives zeros; NaN anywhere in a row makes it NaN
    (``np.max`` propagates NaN, and so does everything after it). A
    half-precision ``x`` (``accumulate="input"``) is computed in its own
    precision, the normaliser summed one term at a time.
    """
    if x.shape[-1] == 0:
        return x.copy()
    row_max = np.max(x, axis=-1, keepdims=True)
    nothing_to_attend = row_max == -np.inf
    # A zero of the operands' dtype, not the literal 0: NumPy before 2.0 makes a literal
    # an int64 array, which bfloat16 (ml_dtypes) cannot be promoted with.
    zero = np.zeros((), x.dtype)
    # inf - inf and NaN arithmetic are meant to give NaN here, quietly.
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        shifted = x - np.where(nothing_to_attend, zero, row_max).astype(x.dtype)
        exponentials = np.exp(shifted)
        if is_half(x.dtype):
            total = sequential_sum(exponentials, axis=-1)[..., None]
        else:
            total = np.sum(exponentials, axis=-1, keepdims=True)
        probabilities = exponentials / total
    return np.where(nothing_to_attend, zero, probabilities).astype(x.dtype, copy=False)


def naive_attention(problem):
    r"""Attention by its definition, on a validated attention problem.

    Half-precision operands (``accumulate="input"``) go to
    :func:`attention_in_input_precision`.

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
    if is_half(problem.dtype):
        output, weights = attention_in_input_precision(problem)
        return output, (weights if problem.return_weights else None)
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


#: Query rows per block in :func:`attention_in_input_precision`, to bound the memory of
#: its (rows, keys, features) products.
_ROWS_PER_BLOCK = 32


def attention_in_input_precision(problem):
    """Naive attention with every product, scaled score, exponential and partial sum
    rounded to the operands' half precision: ``(output, weights)``.

    Scores sum their ``E`` products one at a time, the softmax its ``S``
    exponentials, and each output its ``S`` weighted values, as a kernel that
    accumulated in half precision would (the worst case of recursive summation).
    """
    dtype = problem.dtype
    query, key, value = problem.query, problem.key, problem.value
    scale = np.asarray(problem.scale).astype(dtype)
    outputs, weights = [], []
    for first in range(0, max(problem.n_query, 1), _ROWS_PER_BLOCK):
        rows = query[..., first : first + _ROWS_PER_BLOCK, :]
        products = rows[..., :, None, :] * key[..., None, :, :]
        scores = sequential_sum(products, axis=-1) * scale
        scores = _masked(problem, scores, first, rows.shape[-2])
        block_weights = np.broadcast_to(softmax(scores), (*problem.batch_shape, *scores.shape[-2:]))
        terms = block_weights[..., :, :, None] * value[..., None, :, :]
        outputs.append(sequential_sum(terms, axis=-2))
        weights.append(block_weights)
    output = np.concatenate(outputs, axis=-2)[..., : problem.n_query, :]
    return np.broadcast_to(output, problem.output_shape()), np.concatenate(weights, axis=-2)


def _masked(problem, scores, first_row, n_rows):
    """Scores of rows ``first_row ...`` with the mask added (in the scores' precision) and
    forbidden pairs at -inf."""
    rows = np.arange(first_row, first_row + n_rows)[:, None]
    forbidden = np.zeros((n_rows, problem.n_key), dtype=bool)
    if problem.is_causal:
        forbidden |= np.arange(problem.n_key)[None, :] > rows
    mask = problem.attn_mask
    if mask is not None:
        mask = mask[..., first_row : first_row + n_rows, :] if mask.shape[-2] > 1 else mask
        if mask.dtype == np.bool_:
            forbidden = forbidden | ~mask
        else:
            forbidden = forbidden | (mask == -np.inf)
            scores = scores + mask.astype(scores.dtype)
    return np.where(forbidden, np.asarray(-np.inf).astype(scores.dtype), scores)
