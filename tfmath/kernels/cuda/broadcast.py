"""Gradients summed back to the shape of a broadcast operand, on the device.

A gradient computed per output batch entry, ``(*batch, rows, features)``, belongs to
an operand whose batch dimensions broadcast to ``batch``: a key shared by the heads of
a group (grouped-query attention), a mask or bias shared by a batch. Each of the
operand's batch entries sums the entries it was read by. The host lists which those
are (a few integers per batch entry) and one thread per number of the result adds
them up, in ascending order, so the bits are the same on every run; nothing crosses
to the host.
"""

import functools
import math

import numpy as np

from tfmath import _cuda
from tfmath._contract import layout

cuda = _cuda.numba_cuda()


def batch_sources(batch_shape, operand_batch):
    """For each batch entry of an operand of batch shape ``operand_batch`` broadcast to
    ``batch_shape``: the entries of ``batch_shape`` (flat, ascending) that read it, as
    an int64 array ``(prod(operand_batch), prod(batch_shape) // prod(operand_batch))``."""
    padded = (1,) * (len(batch_shape) - len(operand_batch)) + tuple(operand_batch)
    n_entries = math.prod(padded)
    owner = np.broadcast_to(np.arange(n_entries).reshape(padded), batch_shape).ravel()
    return np.argsort(owner, kind="stable").reshape(n_entries, -1)


@functools.cache
def _sum_kernel():
    """``out[t, e]`` = the sum over ``j`` of ``grad[sources[t, j], e]``, in order of ``j``."""

    @cuda.jit
    def sum_entries(grad, sources, out):
        i = cuda.grid(1)
        width = out.shape[1]
        if i < out.size:
            t, e = i // width, i % width
            total = grad[sources[t, 0], e]
            for j in range(1, sources.shape[1]):
                total += grad[sources[t, j], e]
            out[t, e] = total

    return sum_entries


def sum_to_shape(grad, shape):
    """``grad`` (a C-contiguous device array, or a host array) summed over the batch
    dimensions its operand (of ``shape``, the same last two dimensions) was broadcast
    along; on the device for a device array."""
    grad_shape, shape = tuple(grad.shape), tuple(shape)
    if grad_shape == shape:
        return grad
    if not _cuda.is_device_array(grad):
        return layout.sum_to_shape(grad, shape)
    grad = _cuda.as_device_array(grad)
    if grad.size == 0:  # an empty batch: nothing was read, so nothing to sum
        return _cuda.to_device(np.zeros(shape, grad.dtype))
    sources = batch_sources(grad_shape[:-2], shape[:-2])
    width = math.prod(shape[-2:])
    out = _cuda.device_empty((sources.shape[0], width), grad.dtype)
    if out.size:
        flat = grad.reshape((math.prod(grad_shape[:-2]), width))
        blocks, threads = _cuda.launch_shape(out.size)
        _sum_kernel()[blocks, threads, _cuda.stream()](flat, _cuda.to_device(sources), out)
    return out.reshape(shape)
