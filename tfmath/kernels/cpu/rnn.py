r"""CPU kernel of the Elman RNN, :math:`h_t = \tanh(W_{hh} h_{t-1} + W_{xh} x_t + b)`.

The input projections :math:`W_{xh} x_t + b` do not depend on the state, so
each task computes them for a chunk of steps at once with one small GEMM
(``np.dot``, with BLAS on the calling thread: :func:`tfmath._blas_threads.serial_blas`),
then runs those steps of the recurrence one after another. Batch entries run
in parallel, one per task: the steps of one sequence cannot.
"""

import numba
import numpy as np

from tfmath._blas_threads import serial_blas
from tfmath._jit import cpu_kernel

#: Most steps whose input projections are computed together.
MAX_CHUNK = 256
#: Largest projection product (M*N*K): keeps its operands within a core's L2 cache.
CHUNK_PRODUCT_LIMIT = 65536 * 4


def chunk_size(n_inputs, n_hidden):
    """Steps per projection GEMM: at most ``MAX_CHUNK``, within ``CHUNK_PRODUCT_LIMIT``."""
    return max(1, min(MAX_CHUNK, CHUNK_PRODUCT_LIMIT // max(n_inputs * n_hidden, 1)))


@cpu_kernel
def _steps(projected, w_hh, previous, states):
    """``states[t] = tanh(projected[t] + w_hh @ h)`` row by row, carrying ``h`` in ``previous``."""
    n_hidden = states.shape[1]
    for t in range(states.shape[0]):
        current = states[t]
        for unit in range(n_hidden):
            row = w_hh[unit]
            total = projected[t, unit]
            for j in range(n_hidden):
                total += row[j] * previous[j]
            current[unit] = total
        # tanh in its own loop keeps the dot products above free of calls.
        for unit in range(n_hidden):
            current[unit] = np.tanh(current[unit])
            previous[unit] = current[unit]


@cpu_kernel(parallel=True)
def _elman_kernel(inputs, w_xh_t, w_hh, bias, h0, index, chunk, states):
    n_batch, n_steps, n_hidden = states.shape
    for b in numba.prange(n_batch):
        x = inputs[index[b, 0]]
        previous = h0[index[b, 1]].copy()
        projected = np.zeros((chunk, n_hidden), dtype=states.dtype)
        for start in range(0, n_steps, chunk):
            rows = min(chunk, n_steps - start)
            if x.shape[1] > 0:
                np.dot(x[start : start + rows], w_xh_t, projected[:rows])
            else:
                projected[:rows] = 0
            for t in range(rows):
                for unit in range(n_hidden):
                    projected[t, unit] += bias[unit]
            _steps(projected[:rows], w_hh, previous, states[b, start : start + rows])


def elman_rnn(problem):
    """Run the Elman kernel on a validated :class:`~tfmath.rnn.RnnProblem`."""
    inputs, h0, index = problem.kernel_operands()
    states = np.empty((index.shape[0], problem.n_steps, problem.hidden_size), problem.dtype)
    if states.size:
        w_xh_t = np.ascontiguousarray(problem.w_xh.T)
        chunk = chunk_size(w_xh_t.shape[0], problem.hidden_size)
        with serial_blas():
            _elman_kernel(inputs, w_xh_t, problem.w_hh, problem.bias, h0, index, chunk, states)
    return states.reshape(problem.output_shape())
