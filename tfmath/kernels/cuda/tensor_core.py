r"""FlashAttention-2's forward on the tensor cores, for float16 and bfloat16 (opt-in).

The kernel is CUDA C++, ``tensor_core.cu`` (its comment gives the design:
``mma.sync.m16n8k16`` products with ``ldmatrix`` loads, scores and output held
in registers across the key loop, the online softmax on every thread,
asynchronous copies overlapping the two products, causal tiles above the
diagonal skipped), linked into a Numba kernel with numba-cuda's ``link=`` and
compiled by NVRTC: the Numba kernel maps its block to a batch entry and a tile
of query rows and calls the C++ with the device addresses of that entry's rows.
See docs/backends.rst for why this route. :func:`flash_attention` serves the
general path (validated problems, Numba device arrays or host arrays);
:func:`plain_forward` the public short path of plain CUDA tensors, which passes
their addresses and torch's stream.

Heads of 64 or 128 features, with values as wide as keys, take this path;
others, and every backward pass, use the float32 kernels of
:mod:`.flash_attention` on operands widened on the device. The output comes back in the
operands' format, rounded on the device; the log-sum-exp in float32.

The Numba simulator cannot run CUDA C++, so only a GPU runs this kernel; there it
serves every problem :func:`supports` unless ``TFMATH_CUDA_TENSOR_CORES=0`` (see
:func:`tfmath._cuda_switches.cuda_tensor_cores`). It was checked against the float64
reference and timed on an H200 (docs/flash_attention.rst, "On a GPU").
``python -m tfmath.tools.ptx`` compiles it without a GPU and reports its
registers, spills and shared memory.
"""

import functools
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tfmath import _cuda, _cuda_switches
from tfmath._contract.attention import dense_additive_mask

cuda = _cuda.numba_cuda()

#: The CUDA C++ source of the kernel.
SOURCE = Path(__file__).with_name("tensor_core.cu")
#: The half-precision formats, by NumPy dtype name, and the suffix of their functions.
FORMATS = {"float16": "f16", "bfloat16": "bf16"}
#: The head sizes compiled (the swizzled tiles need 8 or 16 chunks of 16 bytes a row).
HEAD_DIMS = (64, 128)
#: Warps per block compiled; each warp takes 16 query rows.
WARP_CHOICES = (4, 8)


class BlockShape(NamedTuple):
    """How a head size's kernel is launched: warps per block, and the cap on registers
    per thread that numba-cuda passes to the compiler."""

    warps: int
    max_registers: int


#: The block shape by head size, the fastest of those tried on an H200 at L = 4096
#: (docs/flash_attention.rst, "On a GPU"). Linked into the Numba kernel, the C++ needs
#: more registers than alone (132 instead of 128 at d = 64, 226 instead of 169 at
#: d = 128); the caps hold it where ptxas puts it alone, without spills, so that a
#: multiprocessor keeps 2 blocks of 8 warps at d = 64 and 3 blocks of 4 at d = 128.
BLOCK_SHAPES = {64: BlockShape(8, 128), 128: BlockShape(4, 168)}


#: The oldest GPU with every instruction the kernel uses (cp.async, ldmatrix, mma.sync
#: m16n8k16 with bfloat16): Ampere.
MIN_COMPUTE_CAPABILITY = (8, 0)


@functools.cache
def runs_here():
    """Whether this machine's GPU runs the kernel: a compute capability of at least
    :data:`MIN_COMPUTE_CAPABILITY`. Asked once per process, on a real GPU only."""
    return tuple(cuda.get_current_device().compute_capability) >= MIN_COMPUTE_CAPABILITY


def supports(problem):
    """Whether this kernel computes ``problem`` (its format and head sizes)."""
    return (
        problem.dtype.name in FORMATS
        and problem.n_features in HEAD_DIMS
        and problem.value_dim == problem.n_features
    )


def serves(format_name, head_dim):
    """Whether the tensor-core forward takes operands of ``format_name`` (a NumPy dtype
    name) and heads of ``head_dim`` here: the switch on, a real GPU that runs it."""
    return (
        format_name in FORMATS
        and head_dim in HEAD_DIMS
        and _cuda_switches.cuda_tensor_cores()
        and _cuda.status().real_gpu
        and runs_here()
    )


def entry_name(format_name, head_dim, warps):
    """The C++ entry point of one format, head size and number of warps per block."""
    return f"tfmath_flash_forward_{FORMATS[format_name]}_{head_dim}_w{warps}"


@functools.cache
def _entry(format_name, head_dim, warps):
    """The C++ forward of one format, head size and warps per block, declared for Numba
    (C ABI): every operand a device address, as a 64-bit integer."""
    types = _cuda.numba_types()
    i64, i32 = types.int64, types.int32
    signature = types.void(i64, i64, i64, i64, i32, i32, i32, i32, types.float32, i32, i64, i64)
    return cuda.declare_device(
        entry_name(format_name, head_dim, warps), signature, link=[str(SOURCE)], abi="c"
    )


def forward_function(format_name, head_dim, warps):
    """The forward kernel as a Python function, for :func:`_forward_kernel` and PTX checks.

    Its operands are device addresses (integers) of C-contiguous arrays: query
    ``(n_q, L, d)``, key and value ``(n_kv, S, d)``, an optional float32 bias
    ``(n_mask, L, S)`` (address 0 without one), the output ``(n_batch, L, d)`` in the
    operands' 16-bit format and the float32 log-sum-exp ``(n_batch, L)`` (address 0:
    not written). Row ``b`` of ``index`` gives the entries of query, key, value and
    bias that output entry ``b`` reads. Addresses keep the launch cheap: the
    dispatcher types integers at once, where each array argument costs it a
    descriptor, and any CUDA array (a torch tensor of bfloat16 too) has one.

    Block ``x`` takes query-row tile ``n_tiles - 1 - x // n_batch`` of batch entry
    ``x % n_batch``: under a causal mask the tiles with the most keys start first,
    so the short ones fill the GPU's tail.
    """
    forward = _entry(format_name, head_dim, warps)
    types = _cuda.numba_types()
    i32, i64 = types.int32, types.int64
    block_rows = 16 * warps
    row_bytes = 2 * head_dim

    def kernel(query, key, value, bias, index, n_query, n_key, is_causal, scale, out, lse):
        n_batch = index.shape[0]
        n_tiles = (n_query + block_rows - 1) // block_rows
        b = cuda.blockIdx.x % n_batch
        row_tile = n_tiles - 1 - cuda.blockIdx.x // n_batch
        query_bytes, key_bytes = i64(n_query * row_bytes), i64(n_key * row_bytes)
        forward(
            query + index[b, 0] * query_bytes,
            key + index[b, 1] * key_bytes,
            value + index[b, 2] * key_bytes,
            bias + index[b, 3] * i64(4 * n_query * n_key) if bias != 0 else i64(0),
            i32(1) if bias != 0 else i32(0),
            i32(n_query),
            i32(n_key),
            i32(1) if is_causal else i32(0),
            scale,
            i32(row_tile),
            out + b * query_bytes,
            lse + b * i64(4 * n_query) if lse != 0 else i64(0),
        )

    return kernel


@functools.cache
def _forward_kernel(format_name, head_dim, warps, max_registers=None):
    options = {} if max_registers is None else {"max_registers": max_registers}
    return cuda.jit(**options)(forward_function(format_name, head_dim, warps))


def forward_signature():
    """The Numba signature of the forward kernel (for compiling it ahead, to PTX)."""
    types = _cuda.numba_types()
    i64 = types.int64
    return types.void(
        i64, i64, i64, i64, types.Array(types.int64, 2, "C"), i64, i64, types.boolean,
        types.float32, i64, i64,
    )  # fmt: skip


def address(array):
    """The device address of a CUDA array's first element (any object with
    ``__cuda_array_interface__``: Numba's and CuPy's arrays, torch tensors)."""
    return array.__cuda_array_interface__["data"][0]


@functools.cache
def _device_index(index_bytes, n_batch):
    """The batch index on the device, copied once per distinct index: a host-to-device
    copy waits for the GPU, and the same shapes come call after call."""
    return _cuda.to_device(np.frombuffer(index_bytes, np.int64).reshape(n_batch, 4))


@functools.cache
def _identity_index(n_batch):
    """The device index of ``n_batch`` entries without broadcasting."""
    index = np.zeros((n_batch, 4), np.int64)
    index[:, :3] = np.arange(n_batch)[:, None]
    return _device_index(index.tobytes(), n_batch)


@functools.cache
def _stream(handle):
    """Numba's view of the CUDA stream ``handle`` (0: the default stream)."""
    return cuda.external_stream(handle) if handle else cuda.default_stream()


def launch(problem, warps=None, max_registers=None):
    """The kernel, its grid, its block, its arguments and the arrays they point to for
    ``problem`` (the outputs last: the output's 16-bit patterns and the log-sum-exp),
    with every operand on the device: what :func:`flash_attention` launches. Without
    ``warps`` per block, the head size's :data:`BLOCK_SHAPES` gives them and the register
    cap (``max_registers``, else none). The caller keeps the arrays alive until the
    kernel has run."""
    query, key, value, mask, index = problem.kernel_operands()
    mask = dense_additive_mask(mask, problem.n_query, problem.n_key, np.float32)
    # One flat row of biases per mask batch entry: the kernel points into it.
    mask = None if mask is None else _cuda.to_device(_cuda.to_host(mask).reshape(-1))
    n_batch, head_dim = index.shape[0], problem.n_features
    if warps is None:
        warps, max_registers = BLOCK_SHAPES[head_dim]
    out = _cuda.device_empty((n_batch, problem.n_query, head_dim), np.uint16)
    log_sum_exp = _cuda.device_empty((n_batch, problem.n_query), np.float32)
    kernel = _forward_kernel(problem.dtype.name, head_dim, warps, max_registers)
    n_blocks = n_batch * math.ceil(problem.n_query / (16 * warps))
    index = _device_index(np.ascontiguousarray(index, np.int64).tobytes(), n_batch)
    query, key, value = (_on_device(array) for array in (query, key, value))
    arrays = (query, key, value, mask, out, log_sum_exp)
    arguments = (
        address(query), address(key), address(value), 0 if mask is None else address(mask),
        index, problem.n_query, problem.n_key, bool(problem.is_causal),
        np.float32(problem.scale), address(out), address(log_sum_exp),
    )  # fmt: skip
    return kernel, (n_blocks, 32 * warps), arguments, arrays


def _on_device(array):
    """A half-precision operand on the device (copied there from the host)."""
    if _cuda.is_device_array(array):
        return array
    return _cuda.to_device(np.ascontiguousarray(array).view(np.uint16))


def flash_attention(problem):
    """Output and log-sum-exp of a validated half-precision ``problem`` that
    :func:`supports` accepts, on the tensor cores: the output in the operands' format
    (rounded on the device), the log-sum-exp in float32."""
    kernel, shape, arguments, arrays = launch(problem)
    kernel[shape](*arguments)
    bits, log_sum_exp = arrays[-2:]
    bits = bits.reshape(problem.output_shape())
    log_sum_exp = log_sum_exp.reshape((*problem.batch_shape, problem.n_query))
    if problem.on_device:
        # Device operands are float16 (no CUDA array shares bfloat16 with Numba).
        return bits.view(problem.dtype), log_sum_exp
    return bits.copy_to_host().view(problem.dtype), log_sum_exp.copy_to_host()


def plain_forward(format_name, shape, key_rows, addresses, is_causal, scale, stream):
    """The output of a plain call on C-contiguous device operands, launched on
    ``stream`` (a CUDA stream handle; 0 for the default stream) and not waited for.

    ``shape`` is the query's ``(n_batch, L, d)``, with key and value ``(n_batch,
    key_rows, d)``; ``addresses`` those of query, key, value and the output (same
    shape as the query, allocated by the caller, which keeps every operand alive
    until the stream has run the kernel). Nothing is validated: the caller (the
    public short path of device tensors) has. The log-sum-exp is not written.
    """
    n_batch, n_query, head_dim = shape
    warps, max_registers = BLOCK_SHAPES[head_dim]
    kernel = _forward_kernel(format_name, head_dim, warps, max_registers)
    query, key, value, out = addresses
    n_blocks = n_batch * ((n_query + 16 * warps - 1) // (16 * warps))
    kernel[n_blocks, 32 * warps, _stream(stream)](
        query, key, value, 0, _identity_index(n_batch), n_query, key_rows, is_causal,
        np.float32(scale), out, 0,
    )  # fmt: skip
