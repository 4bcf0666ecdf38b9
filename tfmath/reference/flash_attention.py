"""NumPy oracles of the flash method: the output with each row's log-sum-exp, and the gradients.

The mathematics is the naive method's (:mod:`tfmath.reference.attention`);
only what is kept for the backward pass differs.
"""

import numpy as np

from tfmath._contract.checks import is_half
from tfmath.reference.attention import attention_weights, masked_scores, naive_attention
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

    Returns the gradients broadcast to ``batch_shape + (rows, features)``.
    """
    grad_weights = grad_output @ np.swapaxes(problem.value, -1, -2)
    if saved is None:
        weights = attention_weights(problem)
        row_dot = np.sum(weights * grad_weights, axis=-1, keepdims=True)
    else:
        output, log_sum_exp = saved
        lse = log_sum_exp[..., None]
        with np.errstate(invalid="ignore"):
            weights = np.where(lse == -np.inf, 0.0, np.exp(masked_scores(problem) - lse))
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
