r"""The Elman recurrent network: the sequential baseline the seeds compare attention with.

.. math:: h_t = \tanh\left(W_{hh} h_{t-1} + W_{xh} x_t + b\right), \qquad t = 1, \dots, n

([Elman1990]_; the recurrence as seed 003 writes it [Seed003]_). Each step
costs :math:`O(d_h^2 + d_h d_x)`, so a sequence costs :math:`O(n d^2)`, less
than attention's :math:`O(n^2 d)` once :math:`n > d`; but step :math:`t`
needs :math:`h_{t-1}`, so the :math:`n` steps cannot run at the same time,
whereas attention computes all positions at once. Only the input projections
:math:`W_{xh} x_t` are independent across time, and the kernels compute
those first, all together.
"""

import math
from dataclasses import dataclass

import numpy as np

from tfmath import _cuda
from tfmath._dispatch import register, resolve_backend
from tfmath._validation import (
    as_batched_3d,
    batch_index,
    broadcast_batch_shapes,
    float_operand,
    require_ndim,
    shape_of,
)
from tfmath.errors import DTypeError, ShapeError

__all__ = ["RnnProblem", "elman_rnn"]

ELMAN_RNN = register(
    "elman_rnn",
    cpu="tfmath.kernels.cpu.rnn:elman_rnn",
    cuda="tfmath.kernels.cuda.rnn:elman_rnn",
    reference="tfmath.reference.rnn:elman_rnn",
)


@dataclass(frozen=True)
class RnnProblem:
    """Validated inputs of one :func:`elman_rnn` call, as every backend receives them.

    Attributes
    ----------
    inputs : array, shape ``input_batch + (n, d_x)``
    w_xh : array, shape ``(d_h, d_x)``
    w_hh : array, shape ``(d_h, d_h)``
    bias : array, shape ``(d_h,)``
    h0 : array, shape ``state_batch + (d_h,)``
    batch_shape : tuple
        The broadcast of the two batch shapes.
    dtype : numpy.dtype
    """

    inputs: object
    w_xh: object
    w_hh: object
    bias: object
    h0: object
    batch_shape: tuple
    dtype: np.dtype

    @property
    def n_steps(self):
        return shape_of(self.inputs)[-2]

    @property
    def hidden_size(self):
        return shape_of(self.w_hh)[0]

    @property
    def on_device(self):
        return _cuda.is_device_array(self.inputs)

    def output_shape(self):
        return (*self.batch_shape, self.n_steps, self.hidden_size)

    def kernel_operands(self):
        """``(inputs (B_x, n, d_x), h0 (B_h, d_h), index (B, 2))``: flattened batches and,
        for each output batch entry, the entries of ``inputs`` and ``h0`` to read."""
        input_batch = shape_of(self.inputs)[:-2]
        state_batch = shape_of(self.h0)[:-1]
        inputs = as_batched_3d(self.inputs, math.prod(input_batch))
        h0 = np.ascontiguousarray(_cuda.to_host(self.h0)).reshape(
            math.prod(state_batch), self.hidden_size
        )
        index = np.stack(
            [
                batch_index(input_batch, self.batch_shape),
                batch_index(state_batch, self.batch_shape),
            ],
            axis=1,
        )
        return inputs, h0, np.ascontiguousarray(index)


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
    The cpu kernel computes all input projections :math:`W_{xh} x_t` with one
    matrix product and then runs the :math:`n` dependent steps; batch entries
    run in parallel, the steps of one sequence cannot. The cuda kernel runs a
    block per sequence and a thread per hidden unit, so it needs
    :math:`d_h \le 1024`.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.rnn import elman_rnn
    >>> x = np.array([[1.0], [0.0]])
    >>> elman_rnn(x, w_xh=[[1.0]], w_hh=[[2.0]], backend="reference").round(4)
    array([[0.7616],
           [0.9093]])
    """
    backend = resolve_backend(backend, inputs, w_xh, w_hh, bias, h0)
    problem = _rnn_problem(inputs, w_xh, w_hh, bias, h0)
    if backend != "cuda":
        problem = _on_host(problem)
    return ELMAN_RNN.implementation(backend)(problem)


def _rnn_problem(inputs, w_xh, w_hh, bias, h0):
    inputs = float_operand("inputs", inputs)
    require_ndim("inputs", inputs, 2, "(..., n, d_x)")
    w_xh = _host_float("w_xh", w_xh)
    w_hh = _host_float("w_hh", w_hh)
    for name, weight in (("w_xh", w_xh), ("w_hh", w_hh)):
        if weight.ndim != 2:
            raise ShapeError(f"{name} must be 2-D, got shape {weight.shape}")
    hidden, features = w_xh.shape
    if features != shape_of(inputs)[-1]:
        raise ShapeError(
            f"w_xh must have shape (d_h, d_x) with d_x = {shape_of(inputs)[-1]} (the last "
            f"dimension of inputs {shape_of(inputs)}), got {w_xh.shape}"
        )
    if w_hh.shape != (hidden, hidden):
        raise ShapeError(
            f"w_hh must have shape (d_h, d_h) = {(hidden, hidden)} (d_h from w_xh), "
            f"got {w_hh.shape}"
        )
    bias = np.zeros(hidden, dtype=w_hh.dtype) if bias is None else _host_float("bias", bias)
    if bias.shape != (hidden,):
        raise ShapeError(f"bias must have shape ({hidden},), got {bias.shape}")
    h0 = np.zeros(hidden, dtype=w_hh.dtype) if h0 is None else _host_float("h0", h0)
    if h0.ndim < 1 or h0.shape[-1] != hidden:
        raise ShapeError(f"h0 must have shape (..., {hidden}), got {h0.shape}")
    batch_shape = broadcast_batch_shapes({"inputs": shape_of(inputs)[:-2], "h0": shape_of(h0)[:-1]})
    dtype = np.result_type(inputs.dtype, w_xh.dtype, w_hh.dtype, bias.dtype, h0.dtype)
    if inputs.dtype != dtype:
        if _cuda.is_device_array(inputs):
            raise DTypeError(
                f"inputs is a {inputs.dtype} device array but the weights make the "
                f"computation {dtype}; give the weights the inputs' dtype"
            )
        inputs = inputs.astype(dtype)
    return RnnProblem(
        inputs,
        *(np.ascontiguousarray(a, dtype=dtype) for a in (w_xh, w_hh, bias, h0)),
        batch_shape,
        dtype,
    )


def _host_float(name, value):
    return float_operand(name, _cuda.to_host(value))


def _on_host(problem):
    if not problem.on_device:
        return problem
    return RnnProblem(
        _cuda.to_host(problem.inputs),
        problem.w_xh,
        problem.w_hh,
        problem.bias,
        problem.h0,
        problem.batch_shape,
        problem.dtype,
    )
