r"""FlashAttention-2 on the tensor cores, for float16 and bfloat16: the forward, and the
backward (opt-in until a GPU has checked it).

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
others use the float32 kernels of :mod:`.flash_attention` on operands widened on
the device. The output comes back in the operands' format, rounded on the device;
the log-sum-exp in float32.

The backward (:func:`attention_grad`) is FlashAttention-2's in two kernels of the
same ``.cu``, dQ over key tiles, then dK and dV over query tiles, so that no two
blocks add into one number (the same bits every run, as on the CPU). Its gradients
are float32, per broadcast batch entry, for the caller to sum and round. It runs
where :func:`serves_backward` says: ``TFMATH_CUDA_TENSOR_CORE_BACKWARD=1`` on a GPU
that runs the forward, until a GPU run of ``tools/gpu/check.sh`` has checked it
against the float64 reference; it was checked, with the forward, on the host by
:mod:`tfmath.tools.warp_emulator` (tests/test_tensor_core_emulated.py).

float32 heads of 64 run the same forward and backward as TF32
(``mma.sync.m16n8k8.tf32``) where ``TFMATH_CUDA_TF32=1``: opt-in, since TF32 keeps
float16's 10 significand bits (docs/backends.rst, "float32 on the tensor cores").

The Numba simulator cannot run CUDA C++ (the tests run it on the CPU through
:mod:`tfmath.tools.warp_emulator`), so only a GPU runs this kernel for users; there it
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
from tfmath.kernels.cuda.masks import dense_bias

cuda = _cuda.numba_cuda()

#: The CUDA C++ source of the kernel.
SOURCE = Path(__file__).with_name("tensor_core.cu")
#: The half-precision formats, by NumPy dtype name, and the suffix of their functions.
FORMATS = {"float16": "f16", "bfloat16": "bf16"}
#: The suffix of every format's functions, float32's (TF32) among them.
SUFFIXES = {**FORMATS, "float32": "tf32"}
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
#: The TF32 forward's only shape: heads of 64 and 4 warps, whose float32 tiles fill the
#: 48 KiB of static shared memory; no register cap (ptxas's choice, which a GPU has
#: yet to time against others).
TF32_HEAD_DIM = 64
TF32_BLOCK = BlockShape(4, None)


def block_shape(format_name, head_dim):
    """The :class:`BlockShape` of the forward of one format and head size."""
    return TF32_BLOCK if format_name == "float32" else BLOCK_SHAPES[head_dim]


#: Warps per block of the backward's two kernels, by head size (each warp takes 16
#: rows: queries in the dQ kernel, keys in the dK, dV kernel).
BACKWARD_WARPS = {64: 4, 128: 4}
#: Rows of the tiles the backward's kernels loop over (keys for dQ, queries for dK and
#: dV), by head size, as ``tensor_core.cu`` instantiates them: at d = 128, four tiles
#: of 64 and 32 rows fill the 48 KiB of static shared memory. ptxas gives both kernels
#: no spills (``python -m tfmath.tools.ptx``).
BACKWARD_TILE = {64: 64, 128: 32}
#: TF32's backward, at d = 64: rows of 128 16-bit words, as the 16-bit formats' at
#: d = 128, and so their tiles of 32 (``tensor_core.cu`` instantiates it so).
TF32_BACKWARD_TILE = 32


#: The oldest GPU with every instruction the kernel uses (cp.async, ldmatrix, mma.sync
#: m16n8k16 with bfloat16): Ampere.
MIN_COMPUTE_CAPABILITY = (8, 0)


@functools.cache
def runs_here():
    """Whether this machine's GPU runs the kernel: a compute capability of at least
    :data:`MIN_COMPUTE_CAPABILITY`. Asked once per process, on a real GPU only."""
    return tuple(cuda.get_current_device().compute_capability) >= MIN_COMPUTE_CAPABILITY


def supports(problem):
    """Whether this kernel computes ``problem``'s forward (its format and head sizes):
    float16 and bfloat16 heads of 64 and 128, float32 heads of 64 (TF32)."""
    heads = (TF32_HEAD_DIM,) if problem.dtype.name == "float32" else HEAD_DIMS
    return (
        problem.dtype.name in SUFFIXES
        and problem.n_features in heads
        and problem.value_dim == problem.n_features
    )


def serves(format_name, head_dim):
    """Whether the tensor-core forward takes operands of ``format_name`` (a NumPy dtype
    name) and heads of ``head_dim`` here: its switch on (``TFMATH_CUDA_TENSOR_CORES``
    for float16 and bfloat16, on by default; ``TFMATH_CUDA_TF32=1`` for float32), a real
    GPU that runs it."""
    if format_name == "float32":
        wanted = head_dim == TF32_HEAD_DIM and _cuda_switches.cuda_tf32()
    else:
        wanted = (
            format_name in FORMATS and head_dim in HEAD_DIMS and _cuda_switches.cuda_tensor_cores()
        )
    return wanted and _cuda.status().real_gpu and runs_here()


def serves_backward(problem):
    """Whether the tensor-core backward takes ``problem`` here: the forward's conditions,
    and for float16 and bfloat16 ``TFMATH_CUDA_TENSOR_CORE_BACKWARD=1`` (see
    :func:`tfmath._cuda_switches.cuda_tensor_core_backward`); float32 runs it as TF32
    where its forward does (``TFMATH_CUDA_TF32=1``)."""
    half = problem.dtype.name in FORMATS
    return (
        supports(problem)
        and (not half or _cuda_switches.cuda_tensor_core_backward())
        and serves(problem.dtype.name, problem.n_features)
    )


def entry_name(format_name, head_dim, warps):
    """The C++ entry point of one format, head size and number of warps per block."""
    return f"tfmath_flash_forward_{SUFFIXES[format_name]}_{head_dim}_w{warps}"


@functools.cache
def linked_source(kind, format_name, head_dim):
    """The C++ a Numba kernel links: ``tensor_core.cu`` with the entry points of one kind
    (``"FORWARD"`` or ``"BACKWARD"``), format and head size only. numba-cuda compiles
    and links the C++ afresh for each kernel: NVRTC and ptxas took 6.5 s over the whole
    file's sixteen entry points, 0.5 to 1.6 s over a kernel's own two (AMD EPYC Zen 5)."""
    wanted = f"TFMATH_WANT_{kind}_{SUFFIXES[format_name]}_{head_dim}"
    prefix = f'#define TFMATH_SELECT 1\n#define {wanted} 1\n#line 1 "{SOURCE.name}"\n'
    return cuda.CUSource(prefix + SOURCE.read_text(), name=SOURCE.name)


@functools.cache
def _entry(format_name, head_dim, warps):
    """The C++ forward of one format, head size and warps per block, declared for Numba
    (C ABI): every operand a device address, as a 64-bit integer."""
    types = _cuda.numba_types()
    i64, i32 = types.int64, types.int32
    signature = types.void(i64, i64, i64, i64, i32, i32, i32, i32, types.float32, i32, i64, i64)
    link = [linked_source("FORWARD", format_name, head_dim)]
    return cuda.declare_device(
        entry_name(format_name, head_dim, warps), signature, link=link, abi="c"
    )


@functools.cache
def _batch_operands():
    """The device function every kernel here starts with: for output batch entry ``b``,
    the device addresses of the query, key and value rows it reads, of its bias rows (0
    without a bias) and whether it has a bias, from row ``b`` of the batch ``index``
    (the entries of query, key, value and bias that output entry ``b`` reads)."""
    types = _cuda.numba_types()
    i32, i64 = types.int32, types.int64

    @cuda.jit(device=True)
    def operands(query, key, value, bias, index, b, n_query, n_key, row_bytes):
        query_bytes, key_bytes = i64(n_query * row_bytes), i64(n_key * row_bytes)
        return (
            query + index[b, 0] * query_bytes,
            key + index[b, 1] * key_bytes,
            value + index[b, 2] * key_bytes,
            bias + index[b, 3] * i64(4 * n_query * n_key) if bias != 0 else i64(0),
            i32(1) if bias != 0 else i32(0),
        )

    return operands


def forward_function(format_name, head_dim, warps):
    """The forward kernel as a Python function, for :func:`_forward_kernel` and PTX checks.

    Its operands are device addresses (integers) of C-contiguous arrays: query
    ``(n_q, L, d)``, key and value ``(n_kv, S, d)``, an optional float32 bias
    ``(n_mask, L, S)`` (address 0 without one), the output ``(n_batch, L, d)`` in the
    operands' format and the float32 log-sum-exp ``(n_batch, L)`` (address 0: not
    written). Row ``b`` of ``index`` gives the entries of query, key, value and
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
    row_bytes = (4 if format_name == "float32" else 2) * head_dim

    batch_operands = _batch_operands()

    def kernel(query, key, value, bias, index, n_query, n_key, is_causal, scale, out, lse):
        n_batch = index.shape[0]
        n_tiles = (n_query + block_rows - 1) // block_rows
        b = cuda.blockIdx.x % n_batch
        row_tile = n_tiles - 1 - cuda.blockIdx.x // n_batch
        query_bytes = i64(n_query * row_bytes)
        q, k, v, bias_rows, has_bias = batch_operands(
            query, key, value, bias, index, b, n_query, n_key, row_bytes
        )
        forward(
            q,
            k,
            v,
            bias_rows,
            has_bias,
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
    # The simulator has no registers to cap (and its jit no such option).
    capped = max_registers is not None and not _cuda.simulator_requested()
    options = {"max_registers": max_registers} if capped else {}
    return cuda.jit(**options)(forward_function(format_name, head_dim, warps))


def backward_entry_names(format_name, head_dim):
    """The C++ entry points of the backward's dQ kernel and its dK, dV kernel."""
    suffix = f"{SUFFIXES[format_name]}_{head_dim}_w{BACKWARD_WARPS[head_dim]}"
    return f"tfmath_flash_backward_query_{suffix}", f"tfmath_flash_backward_key_{suffix}"


@functools.cache
def _backward_entries(format_name, head_dim):
    """The backward's two C++ functions, declared for Numba as :func:`_entry` declares
    the forward's."""
    types = _cuda.numba_types()
    i64, i32, f32 = types.int64, types.int32, types.float32
    signature = types.void(
        i64, i64, i64, i64, i64, i64, i64, i32, i32, i32, i32, f32, i32, i64, i64
    )
    link = [linked_source("BACKWARD", format_name, head_dim)]
    return tuple(
        cuda.declare_device(name, signature, link=link, abi="c")
        for name in backward_entry_names(format_name, head_dim)
    )


def backward_functions(format_name, head_dim):
    """The backward's two kernels as Python functions (dQ and D, then dK and dV), for
    :func:`_backward_kernels` and PTX checks.

    Operands as :func:`forward_function`'s, plus the forward's output ``(n_batch, L,
    d)`` in the operands' format and its float32 log-sum-exp ``(n_batch, L)``, the
    output's gradient in the operands' format and ``delta``, float32 ``(n_batch, L)``,
    which the first kernel writes and the second reads. The gradients are float32,
    ``(n_batch, L, d)`` and ``(n_batch, S, d)``, one per output batch entry. The first
    kernel's block ``x`` takes query-row tile ``n_tiles - 1 - x // n_batch``, the
    second's key tile ``x // n_batch``: under a causal mask, the blocks with the most
    work start first.
    """
    query_entry, key_entry = _backward_entries(format_name, head_dim)
    types = _cuda.numba_types()
    i32, i64 = types.int32, types.int64
    block_rows = 16 * BACKWARD_WARPS[head_dim]
    row_bytes = (4 if format_name == "float32" else 2) * head_dim
    grad_row_bytes = 4 * head_dim  # the gradients are float32 in every format
    batch_operands = _batch_operands()

    def query_kernel(
        query, key, value, out, grad_out, lse, bias, index, n_query, n_key, is_causal, scale,
        grad_query, delta,
    ):  # fmt: skip
        n_batch = index.shape[0]
        n_tiles = (n_query + block_rows - 1) // block_rows
        b = cuda.blockIdx.x % n_batch
        query_bytes = i64(n_query * row_bytes)
        q, k, v, bias_rows, has_bias = batch_operands(
            query, key, value, bias, index, b, n_query, n_key, row_bytes
        )
        query_entry(
            q,
            k,
            v,
            out + b * query_bytes,
            grad_out + b * query_bytes,
            lse + b * i64(4 * n_query),
            bias_rows,
            has_bias,
            i32(n_query),
            i32(n_key),
            i32(1) if is_causal else i32(0),
            scale,
            i32(n_tiles - 1 - cuda.blockIdx.x // n_batch),
            grad_query + b * i64(n_query * grad_row_bytes),
            delta + b * i64(4 * n_query),
        )

    def key_kernel(
        query, key, value, grad_out, lse, delta, bias, index, n_query, n_key, is_causal, scale,
        grad_key, grad_value,
    ):  # fmt: skip
        n_batch = index.shape[0]
        b = cuda.blockIdx.x % n_batch
        query_bytes = i64(n_query * row_bytes)
        q, k, v, bias_rows, has_bias = batch_operands(
            query, key, value, bias, index, b, n_query, n_key, row_bytes
        )
        key_entry(
            q,
            k,
            v,
            grad_out + b * query_bytes,
            lse + b * i64(4 * n_query),
            delta + b * i64(4 * n_query),
            bias_rows,
            has_bias,
            i32(n_query),
            i32(n_key),
            i32(1) if is_causal else i32(0),
            scale,
            i32(cuda.blockIdx.x // n_batch),
            grad_key + b * i64(n_key * grad_row_bytes),
            grad_value + b * i64(n_key * grad_row_bytes),
        )

    return query_kernel, key_kernel


@functools.cache
def _backward_kernels(format_name, head_dim, max_registers=None):
    # The simulator has no registers to cap (and its jit no such option).
    capped = max_registers is not None and not _cuda.simulator_requested()
    options = {"max_registers": max_registers} if capped else {}
    return tuple(cuda.jit(**options)(f) for f in backward_functions(format_name, head_dim))


def backward_signature():
    """The Numba signature of both backward kernels (for compiling them ahead, to PTX)."""
    types = _cuda.numba_types()
    i64 = types.int64
    return types.void(
        i64, i64, i64, i64, i64, i64, i64, types.Array(types.int64, 2, "C"), i64, i64,
        types.boolean, types.float32, i64, i64,
    )  # fmt: skip


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


def launch(problem, warps=None, max_registers=None):
    """The kernel, its launch (grid, block, stream), its arguments and the arrays they point to for
    ``problem`` (the outputs last: the output's 16-bit patterns and the log-sum-exp),
    with every operand on the device: what :func:`flash_attention` launches. Without
    ``warps`` per block, the head size's :data:`BLOCK_SHAPES` gives them and the register
    cap (``max_registers``, else none). The caller keeps the arrays alive until the
    kernel has run."""
    query, key, value, mask, index = _problem_bias(problem)
    n_batch, head_dim = index.shape[0], problem.n_features
    if warps is None:
        warps, max_registers = block_shape(problem.dtype.name, head_dim)
    # The 16-bit formats' patterns, or float32.
    out_dtype = np.float32 if problem.dtype == np.float32 else np.uint16
    out = _cuda.device_empty((n_batch, problem.n_query, head_dim), out_dtype)
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
    return kernel, (n_blocks, 32 * warps, _cuda.stream()), arguments, arrays


def _on_device(array):
    """An operand on the device (copied there from the host; the kernels read its
    bytes)."""
    if _cuda.is_device_array(array):
        return array
    return _cuda.to_device(np.ascontiguousarray(array).view(np.uint16))


def _problem_bias(problem):
    """The kernel operands of ``problem`` with its mask as one flat float32 row of biases
    per mask batch entry on the device (None without a mask)."""
    query, key, value, mask, index = problem.kernel_operands()
    mask = dense_bias(mask, problem.n_query, problem.n_key, np.float32)
    mask = None if mask is None else mask.reshape(mask.size)
    return query, key, value, mask, index


def flash_attention(problem):
    """Output and log-sum-exp of a validated ``problem`` that :func:`supports` accepts,
    on the tensor cores: the output in the operands' format (rounded on the device; for
    float32, TF32's products), the log-sum-exp in float32."""
    kernel, shape, arguments, arrays = launch(problem)
    kernel[shape](*arguments)
    bits, log_sum_exp = arrays[-2:]
    bits = bits.reshape(problem.output_shape())
    log_sum_exp = log_sum_exp.reshape((*problem.batch_shape, problem.n_query))
    if problem.on_device:
        return bits.view(problem.dtype), log_sum_exp
    return _cuda.to_host(bits).view(problem.dtype), _cuda.to_host(log_sum_exp)


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
    kernel[n_blocks, 32 * warps, _cuda.stream_of(stream)](
        query, key, value, 0, _identity_index(n_batch), n_query, key_rows, is_causal,
        np.float32(scale), out, 0,
    )  # fmt: skip


#: The exponent bits of each format, which are all ones in inf and NaN, and the
#: unsigned type of its bit patterns.
_EXPONENTS = {
    "float16": (0x7C00, np.uint16),
    "bfloat16": (0x7F80, np.uint16),
    "float32": (0x7F800000, np.uint32),
}


def finite(array, dtype):
    """Whether every number of a ``dtype`` (float16, bfloat16 or float32) array is
    finite, on the host or the device (a device array holds its numbers, or their bit
    patterns as unsigned integers): the backward's condition (a 0 of P or dS times inf
    is NaN on the tensor cores)."""
    return all_finite([array], dtype)


def all_finite(arrays, dtype):
    """:func:`finite` of every array of ``arrays``, the device arrays scanned into one
    flag, which is read once: one wait for the GPU, not one per array."""
    exponent, word = _EXPONENTS[np.dtype(dtype).name]
    found = None
    for array in arrays:
        if not _cuda.is_device_array(array):
            if not np.isfinite(np.asarray(array, np.float32)).all():
                return False
            continue
        array = _cuda.as_device_array(array)
        if not array.is_c_contiguous():
            words = _cuda.to_host(array).view(word)
            if np.any((words & exponent) == exponent):
                return False
            continue
        if found is None:
            found = _cuda.to_device(np.zeros(1, np.int32))
        if array.size:
            words = array.reshape(array.size).view(word)
            blocks, threads = _cuda.launch_shape(array.size)
            _non_finite_kernel()[blocks, threads, _cuda.stream()](words, exponent, found)
    return found is None or int(_cuda.to_host(found)[0]) == 0


@functools.cache
def _non_finite_kernel():
    """Sets ``found[0]`` where a bit pattern is inf or NaN: its exponent bits
    (``exponent``) all ones."""

    @cuda.jit
    def scan(words, exponent, found):
        i = cuda.grid(1)
        if i < words.size and (words[i] & exponent) == exponent:
            found[0] = 1

    return scan


def attention_grad(problem, grad_output, saved=None, max_registers=None):
    """The gradients of a validated half-precision ``problem`` that
    :func:`serves_backward` accepts, on the tensor cores: the forward here too unless
    ``saved`` holds its ``(output, log_sum_exp)``; float32 gradients per broadcast batch
    entry (the caller sums and rounds them), on the device for device operands. Every
    operand, ``grad_output`` and the saved output must be finite (:func:`finite`).
    ``max_registers`` caps the backward kernels' registers (none by default; ``python3
    tools/gpu/check.py --backward-caps`` times the caps on a GPU)."""
    dtype, head_dim = problem.dtype, problem.n_features
    query, key, value, mask, index = _problem_bias(problem)
    n_batch, n_query, n_key = index.shape[0], problem.n_query, problem.n_key
    if saved is None:
        kernel, shape, arguments, arrays = launch(problem)
        kernel[shape](*arguments)
        out, log_sum_exp = arrays[-2:]
    else:
        out = _on_device(_in_format(saved[0], dtype))
        log_sum_exp = saved[1]
        if not _cuda.is_device_array(log_sum_exp):
            log_sum_exp = _cuda.to_device(np.ascontiguousarray(log_sum_exp, np.float32))
    grad_out = _on_device(_in_format(grad_output, dtype))
    query, key, value = (_on_device(array) for array in (query, key, value))
    grad_query = _cuda.device_empty((n_batch, n_query, head_dim), np.float32)
    delta = _cuda.device_empty((n_batch, n_query), np.float32)
    grad_key = _cuda.device_empty((n_batch, n_key, head_dim), np.float32)
    grad_value = _cuda.device_empty((n_batch, n_key, head_dim), np.float32)
    index = _device_index(np.ascontiguousarray(index, np.int64).tobytes(), n_batch)
    query_kernel, key_kernel = _backward_kernels(dtype.name, head_dim, max_registers)
    threads = 32 * BACKWARD_WARPS[head_dim]
    block_rows = 16 * BACKWARD_WARPS[head_dim]
    bias = 0 if mask is None else address(mask)
    common = (index, n_query, n_key, bool(problem.is_causal), np.float32(problem.scale))
    query_kernel[n_batch * math.ceil(n_query / block_rows), threads, _cuda.stream()](
        address(query), address(key), address(value), address(out), address(grad_out),
        address(log_sum_exp), bias, *common, address(grad_query), address(delta),
    )  # fmt: skip
    key_kernel[n_batch * math.ceil(n_key / block_rows), threads, _cuda.stream()](
        address(query), address(key), address(value), address(grad_out),
        address(log_sum_exp), address(delta), bias, *common, address(grad_key),
        address(grad_value),
    )  # fmt: skip
    batch = problem.batch_shape
    grads = (
        grad_query.reshape((*batch, n_query, head_dim)),
        grad_key.reshape((*batch, n_key, head_dim)),
        grad_value.reshape((*batch, n_key, head_dim)),
    )
    return grads if problem.on_device else tuple(_cuda.to_host(g) for g in grads)


def _in_format(array, dtype):
    """``array`` in the operands' 16-bit ``dtype``: a host array converted (contiguous),
    a device array as it is (of ``dtype``, or its patterns as uint16)."""
    if _cuda.is_device_array(array):
        if np.dtype(array.dtype) not in (np.dtype(dtype), np.dtype(np.uint16)):
            raise TypeError(f"expected a {dtype} device array, got {array.dtype}")
        return array
    return np.ascontiguousarray(array, dtype)
