r"""The Elman recurrent network: the sequential baseline the seeds compare attention with.

.. math:: h_t = \tanh\left(W_{hh} h_{t-1} + W_{xh} x_t + b\right), \qquad t = 1, \dots, n

([Elman1990]_; the recurrence as seed 003 writes it [Seed003]_). Each step
costs :math:`O(d_h^2 + d_h d_x)`, so a sequence costs :math:`O(n d^2)`, less
than attention's :math:`O(n^2 d)` once :math:`n > d`; but step :math:`t`
needs :math:`h_{t-1}`, so the :math:`n` steps cannot run at the same time,
whereas attention computes all positions at once. Only the input projections
:math:`W_{xh} x_t` are independent across time: the CPU kernel computes them
a chunk of steps at a time, in one matrix product per chunk.
"""

from tfmath._contract.backend import resolve_backend
from tfmath._contract.rnn import RnnProblem, cuda_takes_hidden, rnn_problem
from tfmath._contract.tensors import accepts_tensors
from tfmath._dispatch import run

__all__ = ["RnnProblem", "elman_rnn"]


@accepts_tensors
def elman_rnn(inputs, w_xh, w_hh, bias=None, h0=None, *, backend="auto"):
    r"""Run an Elman RNN over a sequence and return every hidden state.

    .. math:: h_t = \tanh\left(W_{hh} h_{t-1} + W_{xh} x_t + b\right)

    Parameters
    ----------
    inputs : array_like, shape (..., n, d_x)
        The sequence :math:`x_1, \dots, x_n`; leading dimensions are batch.
    w_xh : array_like, shape (d_h, d_x)
        Input-to-hidden weights :math:`W_{xh}`.
    w_hh : array_like, shape (d_h, d_h)
        Hidden-to-hidden weights :math:`W_{hh}`.
    bias : array_like, shape (d_h,), optional
        :math:`b`; default zeros.
    h0 : array_like, shape (..., d_h), optional
        The state before the first step, :math:`h_0`; default zeros. Its
        leading dimensions broadcast against those of ``inputs``.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Which implementation runs.

    Returns
    -------
    numpy.ndarray, shape (..., n, d_h)
        :math:`h_1, \dots, h_n`; float32 when every input is float32, else
        float64. A device array when ``inputs`` was one.

    Raises
    ------
    ShapeError
        When the weights, bias or initial state do not fit the inputs.
    DTypeError
        For non-float arrays.

    Notes
    -----
    The cpu kernel computes the input projections :math:`W_{xh} x_t` of a chunk
    of steps with one matrix product (at most 256 steps, fewer for wide layers
    so that the product's operands stay in a core's L2 cache: one step at
    :math:`d_x = d_h = 512`), then runs those dependent steps; batch entries
    run in parallel, the steps of one sequence cannot. The cuda kernel runs a
    block per sequence and a thread per hidden unit, computing each projection
    in its step, so it needs :math:`d_h \le 1024`.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.rnn import elman_rnn
    >>> x = np.array([[1.0], [0.0]])
    >>> elman_rnn(x, w_xh=[[1.0]], w_hh=[[2.0]], backend="reference").round(4)
    array([[0.7616],
           [0.9093]])
    """
    backend = resolve_backend(
        backend, inputs, w_xh, w_hh, bias, h0, cuda_takes=lambda: cuda_takes_hidden(w_xh)
    )
    problem = rnn_problem(inputs, w_xh, w_hh, bias, h0, backend=backend)
    return run("elman_rnn", problem)
