"""NumPy oracles for softmax and scaled dot-product attention."""

import numpy as np


def softmax_rows(x):
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


def scaled_dot_product_attention(problem):
    r"""Attention by its definition, on a validated :class:`~tfmath.attention.AttentionProblem`.

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
    weights = _attention_weights(problem)
    value = problem.value
    output = weights @ value
    if not np.all(np.isfinite(value)):
        output = _sum_over_attended(weights, value)
    output = np.broadcast_to(output, problem.output_shape()).astype(problem.dtype)
    return output, (weights.astype(problem.dtype) if problem.return_weights else None)


def _attention_weights(problem):
    """``softmax(scale * Q K^T + M)`` with forbidden pairs at ``-inf``, broadcast to
    ``batch_shape + (L, S)``."""
    return softmax_rows(_masked_scores(problem))


def _masked_scores(problem):
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


def flash_attention(problem):
    r"""The attention output and each row's log-sum-exp of its scores.

    .. math::

        \operatorname{lse}_i = \log \sum_{j} e^{B_{ij}}, \qquad
        W_{ij} = e^{B_{ij} - \operatorname{lse}_i}

    with :math:`B` as in :func:`scaled_dot_product_attention`; a row with
    nothing to attend has :math:`\operatorname{lse}_i = -\infty`. The
    log-sum-exp is what a FlashAttention forward keeps for its backward.

    Returns
    -------
    output : numpy.ndarray, shape ``batch_shape + (L, Ev)``
    log_sum_exp : numpy.ndarray, shape ``batch_shape + (L,)``
    """
    output, _ = scaled_dot_product_attention(problem)
    scores = _masked_scores(problem)
    if problem.n_key == 0:
        return output, np.full((*problem.batch_shape, problem.n_query), -np.inf, problem.dtype)
    row_max = scores.max(axis=-1, keepdims=True)
    shift = np.where(row_max == -np.inf, 0.0, row_max)
    # Rows of NaN scores give NaN, as they do in the output.
    with np.errstate(invalid="ignore", divide="ignore"):
        log_sum_exp = np.log(np.exp(scores - shift).sum(axis=-1)) + shift[..., 0]
    return output, log_sum_exp.astype(problem.dtype)


def attention_grad(problem, grad_output, saved=None):
    r"""Gradients of attention by the chain rule, derived by hand.

    With :math:`O = PV`, :math:`P = \operatorname{softmax}(S)` row by row and
    :math:`S = s\,QK^\top + M`:

    * :math:`\partial L / \partial V = P^\top dO` (O is linear in V);
    * :math:`dP = dO\,V^\top` (O is linear in P);
    * the softmax Jacobian of one row is :math:`\operatorname{diag}(p) - pp^\top`,
      so :math:`dS_{ij} = P_{ij}(dP_{ij} - \sum_k P_{ik} dP_{ik})`, and
      :math:`\sum_k P_{ik} dP_{ik} = \sum_e dO_{ie} O_{ie}`;
    * :math:`S` is bilinear in Q and K: :math:`dQ = s\,dS\,K`,
      :math:`dK = s\,dS^\top Q`.

    With ``saved = (output, log_sum_exp)`` from the forward pass, the weights
    are rebuilt as :math:`P_{ij} = e^{B_{ij} - \operatorname{lse}_i}` and the row
    sums use the saved output, :math:`\sum_e dO_{ie} O_{ie}`: the identities the
    FlashAttention-2 backward rests on, here with whole matrices.

    Returns the gradients broadcast to ``batch_shape + (rows, features)``.
    """
    grad_weights = grad_output @ np.swapaxes(problem.value, -1, -2)
    if saved is None:
        weights = _attention_weights(problem)
        row_dot = np.sum(weights * grad_weights, axis=-1, keepdims=True)
    else:
        output, log_sum_exp = saved
        lse = log_sum_exp[..., None]
        with np.errstate(invalid="ignore"):
            weights = np.where(lse == -np.inf, 0.0, np.exp(_masked_scores(problem) - lse))
        row_dot = np.sum(grad_output * output, axis=-1, keepdims=True)
    grad_scores = weights * (grad_weights - row_dot)
    batch = problem.batch_shape
    grad_query = problem.scale * grad_scores @ problem.key
    grad_key = problem.scale * np.swapaxes(grad_scores, -1, -2) @ problem.query
    grad_value = np.swapaxes(weights, -1, -2) @ grad_output
    return tuple(
        np.broadcast_to(grad, batch + grad.shape[-2:]).astype(problem.dtype)
        for grad in (grad_query, grad_key, grad_value)
    )


def _sum_over_attended(weights, value):
    """``weights @ value`` summing only where the weight is non-zero, one row at a time."""
    value = np.broadcast_to(value, weights.shape[:-2] + value.shape[-2:])
    output = np.zeros(weights.shape[:-1] + value.shape[-1:], dtype=np.result_type(weights, value))
    for index in np.ndindex(weights.shape[:-1]):
        attended = weights[index] != 0
        output[index] = weights[index][attended] @ value[index[:-1]][attended]
    return output
