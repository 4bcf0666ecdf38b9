r"""CUDA kernel of the Elman RNN, :math:`h_t = \tanh(W_{hh} h_{t-1} + W_{xh} x_t + b)`.

One thread block per sequence and one thread per hidden unit: thread ``u``
computes unit ``u`` of each step from the previous state, which the block
shares through shared memory. Two barriers per step (everyone has read
:math:`h_{t-1}`; everyone has written :math:`h_t`) are the sequential
dependency made explicit: a GPU runs the units of one step in parallel, never
two steps.
"""

import functools
import math

from tfmath import _cuda

cuda = _cuda.numba_cuda()


@functools.cache
def _elman_kernel(numba_dtype):
    @cuda.jit
    def kernel(inputs, w_xh, w_hh, bias, h0, index, states):
        hidden = cuda.shared.array(0, dtype=numba_dtype)
        b, unit = cuda.blockIdx.x, cuda.threadIdx.x
        n_steps, n_hidden = states.shape[1], states.shape[2]
        x = index[b, 0]
        hidden[unit] = h0[index[b, 1], unit]
        cuda.syncthreads()
        for t in range(n_steps):
            total = bias[unit]
            for e in range(inputs.shape[2]):
                total += w_xh[unit, e] * inputs[x, t, e]
            for j in range(n_hidden):
                total += w_hh[unit, j] * hidden[j]
            cuda.syncthreads()
            hidden[unit] = math.tanh(total)
            states[b, t, unit] = hidden[unit]
            cuda.syncthreads()

    return kernel


def elman_rnn(problem):
    """Launch the Elman CUDA kernel on a validated :class:`~tfmath.rnn.RnnProblem`."""
    hidden = problem.hidden_size
    inputs, h0, index = problem.kernel_operands()
    dtype = problem.dtype
    states = _cuda.device_empty((index.shape[0], problem.n_steps, hidden), dtype)
    if index.shape[0] and problem.n_steps and hidden:
        _elman_kernel(_cuda.numba_dtype(dtype))[
            index.shape[0], hidden, _cuda.stream(), hidden * dtype.itemsize
        ](
            _cuda.to_device(inputs),
            _cuda.to_device(problem.w_xh),
            _cuda.to_device(problem.w_hh),
            _cuda.to_device(problem.bias),
            _cuda.to_device(h0),
            _cuda.to_device(index),
            states,
        )
    states = states.reshape(problem.output_shape())
    return states if problem.on_device else _cuda.to_host(states)
