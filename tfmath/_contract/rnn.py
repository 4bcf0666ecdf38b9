"""The problem of :func:`tfmath.rnn.elman_rnn`: validated inputs, weights and initial state."""

import math
from dataclasses import dataclass, replace

import numpy as np

from tfmath import _cuda
from tfmath._contract.checks import float_operand, require_ndim
from tfmath._contract.layout import as_batched_3d, batch_index, broadcast_batch_shapes, shape_of
from tfmath.errors import BackendUnavailableError, DTypeError, ShapeError

#: The widest hidden state the CUDA kernel takes: it runs one thread per hidden unit, in
#: one block, and a block has at most 1024 threads.
CUDA_MAX_HIDDEN = 1024


def cuda_takes_hidden(w_xh):
    """``backend="auto"``'s question before any check: whether the CUDA kernel takes the
    hidden width of ``w_xh``; yes where its shape cannot tell, so that the checks
    refuse it."""
    shape = np.shape(w_xh)
    return not shape or shape[0] <= CUDA_MAX_HIDDEN


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
    backend : str
        The backend that runs it; ``inputs`` live in host memory unless it is ``"cuda"``.
    """

    inputs: object
    w_xh: object
    w_hh: object
    bias: object
    h0: object
    batch_shape: tuple
    dtype: np.dtype
    backend: str

    @property
    def n_steps(self):
        return shape_of(self.inputs)[-2]

    @property
    def hidden_size(self):
        return shape_of(self.w_hh)[0]

    @property
    def on_device(self):
        return _cuda.is_device_array(self.inputs)

    @property
    def is_empty(self):
        """Whether there is no step, no unit or no batch entry to compute."""
        return 0 in (math.prod(self.batch_shape), self.n_steps, self.hidden_size)

    def on_host(self):
        """The same problem with the inputs in host memory."""
        return replace(self, inputs=_cuda.to_host(self.inputs)) if self.on_device else self

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


def rnn_problem(inputs, w_xh, w_hh, bias, h0, *, backend):
    """Validate the arguments of :func:`~tfmath.rnn.elman_rnn` as an :class:`RnnProblem`."""
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
    if backend == "cuda" and hidden > CUDA_MAX_HIDDEN:
        raise BackendUnavailableError(
            f"the cuda backend runs one thread per hidden unit and takes d_h <= "
            f"{CUDA_MAX_HIDDEN}, got d_h = {hidden} (w_xh of shape {w_xh.shape}); use "
            "backend='cpu'"
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
    problem = RnnProblem(
        inputs,
        *(np.ascontiguousarray(a, dtype=dtype) for a in (w_xh, w_hh, bias, h0)),
        batch_shape,
        dtype,
        backend,
    )
    return problem if backend == "cuda" else problem.on_host()


def _host_float(name, value):
    return float_operand(name, _cuda.to_host(value))
