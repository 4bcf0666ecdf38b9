r"""FlashAttention-2's forward on the tensor cores, for float16 and bfloat16 (opt-in).

The kernel is CUDA C++, ``tensor_core.cu`` (its comment gives the design:
``mma.sync.m16n8k16`` products with ``ldmatrix`` loads, scores and output held
in registers across the key loop, the online softmax on every thread,
asynchronous copies overlapping the two products, causal tiles above the
diagonal skipped), linked into a Numba kernel with numba-cuda's ``link=`` and
compiled by NVRTC: the Numba kernel maps its block to a batch entry and a tile
of query rows and calls the C++ with pointers to that entry's rows. See
docs/backends.rst for why this route.

Heads of 64 or 128 features, with values as wide as keys, take this path;
others, and every backward pass, use the float32 kernels of
:mod:`.flash_attention` on widened operands. The output comes back in the
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

from tfmath import _cuda
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
    """Whether this machine's GPU and packages run the kernel: a compute capability of at
    least :data:`MIN_COMPUTE_CAPABILITY`, and cffi (which hands Numba's arrays to the C++)
    installed. Asked once per process, on a real GPU only."""
    import importlib.util

    if importlib.util.find_spec("cffi") is None:
        return False
    return tuple(cuda.get_current_device().compute_capability) >= MIN_COMPUTE_CAPABILITY


def supports(problem):
    """Whether this kernel computes ``problem`` (its format and head sizes)."""
    return (
        problem.dtype.name in FORMATS
        and problem.n_features in HEAD_DIMS
        and problem.value_dim == problem.n_features
    )


def entry_name(format_name, head_dim, warps):
    """The C++ entry point of one format, head size and number of warps per block."""
    return f"tfmath_flash_forward_{FORMATS[format_name]}_{head_dim}_w{warps}"


@functools.cache
def _entry(format_name, head_dim, warps):
    """The C++ forward of one format, head size and warps per block, declared for Numba
    (C ABI)."""
    types = _cuda.numba_types()
    u16p, f32p, i32 = types.CPointer(types.uint16), types.CPointer(types.float32), types.int32
    signature = types.void(
        u16p, u16p, u16p, f32p, i32, i32, i32, i32, types.float32, i32, u16p, f32p
    )
    return cuda.declare_device(
        entry_name(format_name, head_dim, warps), signature, link=[str(SOURCE)], abi="c"
    )


def forward_function(format_name, head_dim, warps):
    """The forward kernel as a Python function, for :func:`_forward_kernel` and PTX checks.

    Block ``x`` takes query-row tile ``n_tiles - 1 - x // n_batch`` of batch entry
    ``x % n_batch``: under a causal mask the tiles with the most keys start first,
    so the short ones fill the GPU's tail.
    """
    import cffi

    ffi = cffi.FFI()
    forward = _entry(format_name, head_dim, warps)
    i32 = _cuda.numba_types().int32
    block_rows = 16 * warps

    def kernel(query, key, value, mask, index, is_causal, scale, out, log_sum_exp):
        n_batch, n_query, n_key = index.shape[0], query.shape[1], key.shape[1]
        n_tiles = (n_query + block_rows - 1) // block_rows
        b = cuda.blockIdx.x % n_batch
        row_tile = n_tiles - 1 - cuda.blockIdx.x // n_batch
        has_mask = mask.shape[0] != 0
        mask_start = index[b, 3] * n_query * n_key if has_mask else 0
        forward(
            ffi.from_buffer(query[index[b, 0]]),
            ffi.from_buffer(key[index[b, 1]]),
            ffi.from_buffer(value[index[b, 2]]),
            ffi.from_buffer(mask[mask_start:]),
            i32(1) if has_mask else i32(0),
            i32(n_query),
            i32(n_key),
            i32(1) if is_causal else i32(0),
            scale,
            i32(row_tile),
            ffi.from_buffer(out[b]),
            ffi.from_buffer(log_sum_exp[b]),
        )

    return kernel


@functools.cache
def _forward_kernel(format_name, head_dim, warps, max_registers=None):
    options = {} if max_registers is None else {"max_registers": max_registers}
    return cuda.jit(**options)(forward_function(format_name, head_dim, warps))


def forward_signature():
    """The Numba signature of the forward kernel (for compiling it ahead, to PTX)."""
    types = _cuda.numba_types()
    u16 = types.Array(types.uint16, 3, "C")
    f32_1 = types.Array(types.float32, 1, "C")
    return types.void(
        u16, u16, u16, f32_1, types.Array(types.int64, 2, "C"), types.boolean, types.float32,
        u16, types.Array(types.float32, 2, "C"),
    )  # fmt: skip


def _bits(array):
    """A half-precision array's 16-bit patterns, as uint16, where it lives."""
    if _cuda.is_device_array(array):
        return _cuda.as_device_array(array).view(np.uint16)
    return _cuda.to_device(np.ascontiguousarray(array).view(np.uint16))


@functools.cache
def _device_index(index_bytes, n_batch):
    """The batch index on the device, copied once per distinct index: a host-to-device
    copy waits for the GPU, and the same shapes come call after call."""
    return _cuda.to_device(np.frombuffer(index_bytes, np.int64).reshape(n_batch, 4))


@functools.cache
def _no_mask():
    return _cuda.to_device(np.zeros(1, np.float32))[:0]


def launch(problem, warps=None, max_registers=None):
    """The kernel, its grid, its block and its arguments for ``problem`` (the outputs
    last: the output's 16-bit patterns and the log-sum-exp), with every operand on the
    device: what :func:`flash_attention` launches. Without ``warps`` per block, the head
    size's :data:`BLOCK_SHAPES` gives them and the register cap (``max_registers``,
    else none)."""
    query, key, value, mask, index = problem.kernel_operands()
    mask = dense_additive_mask(mask, problem.n_query, problem.n_key, np.float32)
    # One flat row of biases per mask batch entry: the kernel points into it.
    mask = _no_mask() if mask is None else _cuda.to_device(_cuda.to_host(mask).reshape(-1))
    n_batch, head_dim = index.shape[0], problem.n_features
    if warps is None:
        warps, max_registers = BLOCK_SHAPES[head_dim]
    out = _cuda.device_empty((n_batch, problem.n_query, head_dim), np.uint16)
    log_sum_exp = _cuda.device_empty((n_batch, problem.n_query), np.float32)
    kernel = _forward_kernel(problem.dtype.name, head_dim, warps, max_registers)
    n_blocks = n_batch * math.ceil(problem.n_query / (16 * warps))
    index = _device_index(np.ascontiguousarray(index, np.int64).tobytes(), n_batch)
    arguments = (
        _bits(query), _bits(key), _bits(value), mask, index, problem.is_causal,
        np.float32(problem.scale), out, log_sum_exp,
    )  # fmt: skip
    return kernel, (n_blocks, 32 * warps), arguments


def flash_attention(problem):
    """Output and log-sum-exp of a validated half-precision ``problem`` that
    :func:`supports` accepts, on the tensor cores: the output in the operands' format
    (rounded on the device), the log-sum-exp in float32."""
    kernel, shape, arguments = launch(problem)
    kernel[shape](*arguments)
    bits, log_sum_exp = arguments[-2:]
    bits = bits.reshape(problem.output_shape())
    log_sum_exp = log_sum_exp.reshape((*problem.batch_shape, problem.n_query))
    if problem.on_device:
        # Device operands are float16 (no CUDA array shares bfloat16 with Numba).
        return bits.view(problem.dtype), log_sum_exp
    return bits.copy_to_host().view(problem.dtype), log_sum_exp.copy_to_host()
