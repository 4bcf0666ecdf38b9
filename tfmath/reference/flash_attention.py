"""NumPy oracles of the flash method: the output with each row's log-sum-exp, and the gradients.

The mathematics is the naive method's (:mod:`tfmath.reference.attention`);
only what is kept for the backward pass differs.
"""

import numpy as np

from tfmath._contract.checks import is_half
from tfmath.reference.attention import (
    _sum_over_attended,
    attention_weights,
    masked_scores,
    naive_attention,
)
from tfmath.reference.half import widen


def flash_attention(problem):
    r"""The attention output and each row's log-sum-exp of its scores.

    .. math::

        \operatorname{lse}_i = \log \sum_{j} e^{B_{ij}}, \qquad
        W_{ij} = e^{B_{ij} - \operatorname{lse}_i}

    with :math:`B` as in :func:`~tfmath.reference.attention.naive_attention`; a row with
    nothing to attend has :math:`\operatorname{lse}_i = -\infty`. The
    log-sum-exp is what a FlashAttention forward keeps for its backward.

    Returns
    -------
    output : numpy.ndarray, shape ``batch_shape + (L, Ev)``
    log_sum_exp : numpy.ndarray, shape ``batch_shape + (L,)``
    """
    output, _ = naive_attention(problem)
    if is_half(problem.dtype):
        # accumulate="input" emulates the output; the log-sum-exp, auxiliary, is
        # computed from the same half-precision operands in float64.
        _, log_sum_exp = flash_attention(problem.widened(widen))
        return output, log_sum_exp.astype(problem.dtype)
    scores = masked_scores(problem)
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

    As in the forward, pairs of weight exactly 0 (forbidden, or in a row with
    nothing to attend) are never read: NaN or inf stored there (a masked value, a
    query with nothing to attend) reaches no gradient. A row that attends one key
    has weight exactly 1 there, and its row sum is that key's :math:`dP_{ij}`
    itself (rather than :math:`\sum_e dO_{ie} O_{ie}`, equal to it only up to
    rounding), so that its :math:`dS`, and its share of dQ and dK, is exactly 0,
    as the softmax of one score is 1 whatever the score.

    Returns the gradients broadcast to ``batch_shape + (rows, features)``.
    """
    # NaN and inf in the operands give NaN where they are read, without a warning.
    with np.errstate(invalid="ignore"):
        grad_weights = grad_output @ np.swapaxes(problem.value, -1, -2)
        scores = masked_scores(problem)
        forbidden = scores == -np.inf
        # A row with one attended key: its softmax is 1 whatever the score.
        one_key = np.sum(~forbidden, axis=-1, keepdims=True) == 1
        if saved is None:
            weights = attention_weights(problem)
        else:
            output, log_sum_exp = saved
            lse = log_sum_exp[..., None]
            weights = np.where(lse == -np.inf, 0.0, np.exp(scores - lse))
        # Weight 0 where a pair is forbidden, even in a row of NaN; 1 at a row's one key.
        weights = np.where(forbidden, 0.0, np.where(one_key & (weights > 0), 1.0, weights))
        attended_grads = np.where(weights == 0, 0.0, weights * grad_weights)
        row_dot = np.sum(attended_grads, axis=-1, keepdims=True)
        if saved is not None:
            # sum_k P_ik dP_ik = sum_e dO_ie O_ie, except where it must be exact: a row
            # with one key, where it is that key's dP.
            row_dot = np.where(one_key, row_dot, np.sum(grad_output * output, -1, keepdims=True))
        # Pairs of weight 0 are never read: 0 * NaN (a NaN value, output or gradient
        # stored where nothing attends) would be NaN.
        grad_scores = np.where(weights == 0, 0.0, weights * (grad_weights - row_dot))
        grad_query = problem.scale * _product(grad_scores, problem.key)
        grad_key = problem.scale * _product(np.swapaxes(grad_scores, -1, -2), problem.query)
        grad_value = _product(np.swapaxes(weights, -1, -2), grad_output)
    batch = problem.batch_shape
    return tuple(
        np.broadcast_to(grad, batch + grad.shape[-2:]).astype(problem.dtype)
        for grad in (grad_query, grad_key, grad_value)
    )


def _product(weights, operand):
    """``weights @ operand``, reading ``operand`` only at nonzero weights when it holds
    NaN or inf (as the forward reads the values)."""
    if np.all(np.isfinite(operand)):
        return weights @ operand
    return _sum_over_attended(weights, operand)
