r"""Attention's variants by their definitions, in float64 with whole score matrices.

For each batch entry: raw scores :math:`s = \text{scale}\, QK^\top`; the
modification (FlashAttention's soft-capping, then ALiBi, then the window; or
FlexAttention's ``score_mod``, with ``mask_mod`` applied in a block mask's
partial blocks and every unlisted block masked out); the softmax with the sink
logit in the normaliser; and, backward, the chain rule written out:

.. math::

    dP = dO\, V^\top, \quad D_i = \sum_e dO_{ie} O_{ie}, \quad
    dS'_{ij} = P_{ij}(dP_{ij} - D_i + g_i), \quad
    dS_{ij} = dS'_{ij}\, \frac{\partial s'_{ij}}{\partial s_{ij}},

    dQ = \text{scale}\; dS\, K, \quad dK = \text{scale}\; dS^\top Q, \quad
    dV = P^\top dO, \quad
    \frac{\partial}{\partial \sigma} = \sum_i e^{\sigma - \text{lse}_i} (g_i - D_i)

with :math:`g_i` the gradient reaching row :math:`i`'s log-sum-exp.
"""

import numpy as np


def _entry(problem, b):
    q_entry, kv_entry, batch, head, m = problem.index[b]
    n_query, n_key = problem.lengths[b]
    query = problem.query[q_entry, :n_query].astype(np.float64)
    key = problem.key[kv_entry, :n_key].astype(np.float64)
    value = problem.value[kv_entry, :n_key].astype(np.float64)
    return query, key, value, batch, head, m, n_query, n_key


def _elementwise(function, *arrays):
    """A user's scalar function over broadcast integer and float arrays, one call
    per element (the definition, for the small shapes the tests use)."""
    arrays = np.broadcast_arrays(*arrays)
    out = np.empty(arrays[0].shape)
    for position in np.ndindex(out.shape):
        out[position] = function(*(a[position] for a in arrays))
    return out


def _modified(problem, b):
    """``(s', ds'/ds, masked)`` of batch entry ``b``, each ``(n_query, n_key)``."""
    query, key, _, batch, head, m, n_query, n_key = _entry(problem, b)
    scores = problem.scale * query @ key.T
    derivative = np.ones_like(scores)
    rows, cols = np.arange(n_query)[:, None], np.arange(n_key)[None, :]
    modification = problem.modification
    fp, ip = modification.float_params, modification.int_params
    if modification.kind == "flash":
        softcap, (left, right, has_alibi, slope_rows, heads) = fp[0], ip
        if softcap > 0:
            capped = np.tanh(scores / softcap)
            scores, derivative = softcap * capped, 1 - capped**2
        diagonal = rows + n_key - n_query
        if has_alibi:
            scores = scores - fp[1 + (batch % slope_rows) * heads + head] * np.abs(diagonal - cols)
        masked = np.zeros(scores.shape, dtype=bool)
        if left >= 0:
            masked |= cols < diagonal - left
        if right >= 0:
            masked |= cols > diagonal + right
    else:
        score = modification.score
        if score == "relative_bias":
            reach = ip[0]
            distance = np.clip(cols - rows, -reach, reach)
            scores = scores + fp[head * (2 * reach + 1) + reach + distance]
        elif score is not None:
            raw = scores
            scores = _elementwise(score, raw, batch, head, rows, cols)
            if modification.derivative is not None:
                derivative = _elementwise(modification.derivative, raw, batch, head, rows, cols)
        blocks = problem.blocks
        masked = ~blocks.to_dense(n_query, n_key)[m]
        if modification.mask_mod is not None:
            partial = blocks.partial_dense(n_query, n_key)[m]
            allowed = _elementwise(modification.mask_mod, batch, head, rows, cols).astype(bool)
            masked |= partial & ~allowed
    scores = np.where(masked, -np.inf, scores)
    return scores, np.where(masked, 0.0, derivative), masked


def _product(weights, rows):
    """``weights @ rows`` summed over the pairs of nonzero weight only: a NaN or inf
    where nothing attends (a masked key's value) never reaches the result, as the
    sum over attended pairs defines it (0 * NaN is NaN in a matrix product)."""
    terms = weights[:, :, None] * rows[None, :, :]
    return np.where(weights[:, :, None] != 0, terms, 0.0).sum(axis=1)


def _softmax_with_sink(scores, sink):
    """``(P, lse)`` of each row, the sink's weight in the normaliser."""
    top = np.maximum(scores.max(axis=1, initial=-np.inf), sink)
    finite_top = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(scores - finite_top[:, None])
    total = weights.sum(axis=1) + np.exp(sink - finite_top)
    # A row with nothing attended (total 0) gives zeros and -inf; a NaN score makes
    # the total NaN, and the row NaN with it.
    with np.errstate(divide="ignore", invalid="ignore"):
        probabilities = np.where(total[:, None] == 0, 0.0, weights / total[:, None])
        log_sum_exp = np.where(total == 0, -np.inf, finite_top + np.log(total))
    return probabilities, log_sum_exp


def variant_attention(problem):
    """``(output, log_sum_exp)`` by the definition (see the module)."""
    n_batch = problem.index.shape[0]
    output = np.zeros((n_batch, problem.n_query, problem.value_dim))
    log_sum_exp = np.full((n_batch, problem.n_query), -np.inf)
    for b in range(n_batch):
        _, _, value, _, _, _, n_query, _ = _entry(problem, b)
        scores, _, _ = _modified(problem, b)
        probabilities, lse = _softmax_with_sink(scores, problem.sinks[b])
        output[b, :n_query] = _product(probabilities, value)
        log_sum_exp[b, :n_query] = lse
    return output, log_sum_exp


def variant_attention_grad(problem, grad_output, grad_log_sum_exp, saved=None):
    """``(grad_query, grad_key, grad_value, grad_sinks, grad_params)`` by the chain
    rule (see the module); ``saved`` is ignored, everything is recomputed."""
    n_batch = problem.index.shape[0]
    grad_query = np.zeros(problem.query.shape[1:], dtype=np.float64)[None].repeat(n_batch, 0)
    grad_key = np.zeros((n_batch, problem.n_key, problem.key.shape[2]))
    grad_value = np.zeros((n_batch, problem.n_key, problem.value_dim))
    grad_sinks = np.zeros(n_batch)
    modification = problem.modification
    grad_params = np.zeros(modification.n_learnable)
    for b in range(n_batch):
        query, key, value, _, head, _, n_query, n_key = _entry(problem, b)
        scores, derivative, masked = _modified(problem, b)
        probabilities, lse = _softmax_with_sink(scores, problem.sinks[b])
        output = _product(probabilities, value)
        d_output = np.asarray(grad_output[b, :n_query], dtype=np.float64)
        g = np.zeros(n_query)
        if grad_log_sum_exp is not None:
            g = np.where(np.isfinite(lse), grad_log_sum_exp[b, :n_query], 0.0)
        delta = (d_output * output).sum(axis=1)
        d_modified = probabilities * (d_output @ value.T - delta[:, None] + g[:, None])
        d_modified = np.where(masked, 0.0, d_modified)
        d_scores = d_modified * derivative
        grad_query[b, :n_query] = problem.scale * _product(d_scores, key)
        grad_key[b, :n_key] = problem.scale * _product(d_scores.T, query)
        grad_value[b, :n_key] = _product(probabilities.T, d_output)
        present = np.isfinite(lse) & np.isfinite(problem.sinks[b])
        sink_weight = np.exp(
            np.where(present, problem.sinks[b] - np.where(present, lse, 0), -np.inf)
        )
        grad_sinks[b] = (sink_weight * (g - delta)).sum()
        if modification.score == "relative_bias":
            reach = modification.int_params[0]
            rows, cols = np.arange(n_query)[:, None], np.arange(n_key)[None, :]
            distance = np.clip(cols - rows, -reach, reach) + reach + head * (2 * reach + 1)
            np.add.at(grad_params, distance.ravel(), d_modified.ravel())
    return grad_query, grad_key, grad_value, grad_sinks, grad_params


def variant_weights(problem):
    """The attention weights by the definition, ``(n_batch, L, S)``, and the sink's
    weight as a last column when the problem has sinks."""
    has_sinks = bool(np.isfinite(problem.sinks).any())
    n_batch = problem.index.shape[0]
    weights = np.zeros((n_batch, problem.n_query, problem.n_key + has_sinks))
    for b in range(n_batch):
        n_query, n_key = problem.lengths[b]
        scores, _, _ = _modified(problem, b)
        probabilities, lse = _softmax_with_sink(scores, problem.sinks[b])
        weights[b, :n_query, :n_key] = probabilities
        if has_sinks:
            present = np.isfinite(lse)
            weights[b, :n_query, -1] = np.exp(
                np.where(present, problem.sinks[b] - np.where(present, lse, 0), -np.inf)
            )
    return weights
