r"""NumPy oracle of the Elman RNN."""

import numpy as np


def elman_rnn(problem):
    r"""The recurrence step by step, in float64, for every batch entry at once.

    .. math:: h_t = \tanh\left(W_{hh} h_{t-1} + W_{xh} x_t + b\right), \qquad h_0 \text{ given}
    """
    inputs = np.asarray(problem.inputs, dtype=np.float64)
    w_xh, w_hh = problem.w_xh.astype(np.float64), problem.w_hh.astype(np.float64)
    state = np.broadcast_to(
        problem.h0.astype(np.float64), (*problem.batch_shape, problem.hidden_size)
    )
    states = np.empty(problem.output_shape())
    for t in range(problem.n_steps):
        state = np.tanh(state @ w_hh.T + inputs[..., t, :] @ w_xh.T + problem.bias)
        states[..., t, :] = state
    return states.astype(problem.dtype)
