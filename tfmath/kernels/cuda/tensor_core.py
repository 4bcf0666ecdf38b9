r"""Half-precision flash attention on the tensor cores (opt-in, not yet measured on a GPU).

float16 and bfloat16 operands are read as they are stored (their 16-bit
patterns, as ``uint16``) and multiplied with ``mma.sync.m16n8k16``, which
accumulates in float32: the scores :math:`QK^\top` and the output update
:math:`PV`, with :math:`P` rounded to the operands' format, as in
FlashAttention-2. The instruction lives in a small CUDA C++ file,
``tensor_core.cu``, linked into the Numba kernel with numba-cuda's ``link=``
and compiled by NVRTC; the rest of the kernel (tiling, masks, the online
softmax in float32) is Numba. See docs/backends.rst for why this route and
not nvmath-python's cuBLASDx.

One block of four warps takes 64 query rows (16 per warp) against tiles of
32 keys; Q, K and V tiles, the scores and the output accumulator live in
shared memory (static arrays: the head sizes are compile-time constants).
Heads of 16, 32, 48 or 64 features (multiples of 16 for the scores' inner
dimension, at most 64 for shared memory) take this path; others, and every
backward pass, use the float32 kernels of :mod:`.flash_attention` on widened
operands.

The Numba simulator cannot run CUDA C++, so only a GPU runs this kernel: until
one has checked and timed it (tools/gpu_check.sh), it runs only when
``TFMATH_CUDA_TENSOR_CORES=1`` (see :func:`tfmath._cuda_switches.cuda_tensor_cores`).
"""

import functools
import math
from pathlib import Path

import numpy as np

from tfmath import _cuda
from tfmath._contract.attention import dense_additive_mask

cuda = _cuda.numba_cuda()

#: The CUDA C++ source of the warp-level products.
SOURCE = Path(__file__).with_name("tensor_core.cu")
#: The half-precision formats, by NumPy dtype name, and the suffix of their functions.
FORMATS = {"float16": "f16", "bfloat16": "bf16"}
#: Query rows per block (four warps of 16 rows) and keys per tile.
BLOCK_ROWS, TILE_KEYS = 64, 32
THREADS = 128
#: Largest head size whose tiles fit in 48 KiB of static shared memory.
MAX_HEAD_DIM = 64


def supports(problem):
    """Whether this kernel computes ``problem`` (its format, head sizes and mask)."""
    return (
        problem.dtype.name in FORMATS
        and 0 < problem.n_features <= MAX_HEAD_DIM
        and problem.n_features % 16 == 0
        and 0 < problem.value_dim <= MAX_HEAD_DIM
        and problem.value_dim % 8 == 0
    )


@functools.cache
def _device_functions(suffix):
    """The CUDA C++ functions of one format, declared for Numba (C ABI, linked from SOURCE)."""
    types = _cuda.numba_types()
    f32p, u16p = types.CPointer(types.float32), types.CPointer(types.uint16)
    i32 = types.int32
    link = [str(SOURCE)]
    scores = cuda.declare_device(
        f"tfmath_mma_nt_{suffix}",
        types.void(f32p, i32, u16p, i32, u16p, i32, i32, i32, i32),
        link=link,
        abi="c",
    )
    update = cuda.declare_device(
        f"tfmath_mma_nn_{suffix}",
        types.void(f32p, i32, f32p, i32, u16p, i32, i32, i32, i32),
        link=link,
        abi="c",
    )
    to_float = cuda.declare_device(
        f"tfmath_{suffix}_to_float", types.float32(types.uint16), link=link, abi="c"
    )
    return scores, update, to_float


def _is_finite_bits(bits, exponent_mask):
    """Whether a 16-bit pattern is a finite number (its exponent is not all ones)."""
    return (bits & exponent_mask) != exponent_mask


def forward_function(format_name, n_features, n_values):
    """The forward kernel as a Python function, for :func:`_forward_kernel` and PTX checks."""
    import cffi

    ffi = cffi.FFI()
    scores_product, output_update, to_float = _device_functions(FORMATS[format_name])
    exponent_mask = 0x7C00 if format_name == "float16" else 0x7F80
    E, EV, BR, BC, NT = n_features, n_values, BLOCK_ROWS, TILE_KEYS, THREADS
    QS, VS = E + 8, EV + 8  # padded strides: a warp's fragment loads hit distinct banks
    SS, OS = BC + 4, EV + 4
    # Array sizes must be constants, not expressions.
    Q_SIZE, K_SIZE, V_SIZE, S_SIZE, O_SIZE = BR * QS, BC * QS, BC * VS, BR * SS, BR * OS
    f32, u16 = _cuda.numba_types().float32, _cuda.numba_types().uint16
    is_finite_bits = cuda.jit(device=True)(_is_finite_bits)

    def kernel(query, key, value, mask, index, is_causal, scale, out, log_sum_exp):
        q_tile = cuda.shared.array(Q_SIZE, dtype=u16)
        k_tile = cuda.shared.array(K_SIZE, dtype=u16)
        v_tile = cuda.shared.array(V_SIZE, dtype=u16)
        s_tile = cuda.shared.array(S_SIZE, dtype=f32)
        o_tile = cuda.shared.array(O_SIZE, dtype=f32)
        row_max = cuda.shared.array(BR, dtype=f32)
        row_sum = cuda.shared.array(BR, dtype=f32)
        rescale = cuda.shared.array(BR, dtype=f32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        n_query, n_key = query.shape[1], key.shape[1]
        tiles_per_batch = (n_query + BR - 1) // BR
        b = cuda.blockIdx.x // tiles_per_batch
        first_row = (cuda.blockIdx.x - b * tiles_per_batch) * BR
        q, k, v, m = index[b, 0], index[b, 1], index[b, 2], index[b, 3]
        has_mask = mask.shape[1] != 0
        zero = f32(0)
        for flat in range(tid, BR * E, NT):
            r = flat // E
            row = first_row + r
            q_tile[r * QS + flat - r * E] = query[q, row, flat - r * E] if row < n_query else 0
        for flat in range(tid, BR * OS, NT):
            o_tile[flat] = 0
        for r in range(tid, BR, NT):
            row_max[r] = -math.inf
            row_sum[r] = 0
        n_visible = min(first_row + BR, n_key) if is_causal else n_key
        for start in range(0, n_visible, BC):
            for flat in range(tid, BC * E, NT):
                t = flat // E
                in_range = start + t < n_key
                k_tile[t * QS + flat - t * E] = key[k, start + t, flat - t * E] if in_range else 0
            bad = 0
            for flat in range(tid, BC * EV, NT):
                t = flat // EV
                bits = value[v, start + t, flat - t * EV] if start + t < n_key else u16(0)
                if not is_finite_bits(bits, exponent_mask):
                    bad = 1
                v_tile[t * VS + flat - t * EV] = bits
            value_has_garbage = cuda.syncthreads_or(bad)
            scores_product(
                ffi.from_buffer(s_tile[warp * 16 * SS :]), SS,
                ffi.from_buffer(q_tile[warp * 16 * QS :]), QS,
                ffi.from_buffer(k_tile), QS, BC, E, 0,
            )  # fmt: skip
            cuda.syncthreads()
            if tid < BR:
                row = first_row + tid
                tile_max = f32(-math.inf)
                for t in range(BC):
                    col = start + t
                    s = f32(-math.inf)
                    if row < n_query and col < n_key and not (is_causal and col > row):
                        bias = mask[m, row, col] if has_mask else zero
                        if bias != -math.inf:
                            s = scale * s_tile[tid * SS + t] + bias
                    s_tile[tid * SS + t] = s
                    tile_max = max(tile_max, s)
                new_max = max(row_max[tid], tile_max)
                factor = f32(1) if new_max == -math.inf else math.exp(row_max[tid] - new_max)
                total = row_sum[tid] * factor
                for t in range(BC):
                    s = s_tile[tid * SS + t]
                    p = zero if s == -math.inf else math.exp(s - new_max)
                    total += p
                    s_tile[tid * SS + t] = p
                row_max[tid] = new_max
                row_sum[tid] = total
                rescale[tid] = factor
            cuda.syncthreads()
            for flat in range(tid, BR * EV, NT):
                r = flat // EV
                o_tile[r * OS + flat - r * EV] *= rescale[r]
            cuda.syncthreads()
            if not value_has_garbage:
                output_update(
                    ffi.from_buffer(o_tile[warp * 16 * OS :]), OS,
                    ffi.from_buffer(s_tile[warp * 16 * SS :]), SS,
                    ffi.from_buffer(v_tile), VS, EV, BC, 1,
                )  # fmt: skip
            else:
                # Weights of exactly 0 must not read the values: 0 * nan is nan.
                for flat in range(tid, BR * EV, NT):
                    r = flat // EV
                    acc = o_tile[r * OS + flat - r * EV]
                    for t in range(BC):
                        p = s_tile[r * SS + t]
                        if p != 0:
                            acc += p * to_float(v_tile[t * VS + flat - r * EV])
                    o_tile[r * OS + flat - r * EV] = acc
            cuda.syncthreads()
        for flat in range(tid, BR * EV, NT):
            r = flat // EV
            row, f = first_row + r, flat - r * EV
            if row < n_query:
                total = row_sum[r]
                empty = row_max[r] == -math.inf and total == 0
                out[b, row, f] = zero if empty else o_tile[r * OS + f] / total
        for r in range(tid, BR, NT):
            row = first_row + r
            if row < n_query:
                empty = row_max[r] == -math.inf and row_sum[r] == 0
                log_sum_exp[b, row] = -math.inf if empty else row_max[r] + math.log(row_sum[r])

    return kernel


@functools.cache
def _forward_kernel(format_name, n_features, n_values):
    return cuda.jit(forward_function(format_name, n_features, n_values))


def forward_signature(n_batch_dims=3):
    """The Numba signature of the forward kernel (for compiling it ahead, to PTX)."""
    types = _cuda.numba_types()
    u16 = types.Array(types.uint16, n_batch_dims, "C")
    f32_3 = types.Array(types.float32, 3, "C")
    return types.void(
        u16, u16, u16, f32_3, types.Array(types.int64, 2, "C"), types.boolean, types.float32,
        f32_3, types.Array(types.float32, 2, "C"),
    )  # fmt: skip


def _bits(array):
    """A half-precision array's 16-bit patterns, as uint16, where it lives."""
    if _cuda.is_device_array(array):
        return _cuda.as_device_array(array).view(np.uint16)
    return _cuda.to_device(np.ascontiguousarray(array).view(np.uint16))


def flash_attention(problem):
    """Output (float32) and log-sum-exp of a validated half-precision ``problem`` that
    :func:`supports` accepts, on the tensor cores."""
    query, key, value, mask, index = problem.kernel_operands()
    mask = dense_additive_mask(mask, problem.n_query, problem.n_key, np.float32)
    mask = np.empty((1, 0, 0), np.float32) if mask is None else _cuda.to_host(mask)
    n_batch, Ev = index.shape[0], problem.value_dim
    out = _cuda.device_empty((n_batch, problem.n_query, Ev), np.float32)
    log_sum_exp = _cuda.device_empty((n_batch, problem.n_query), np.float32)
    kernel = _forward_kernel(problem.dtype.name, problem.n_features, Ev)
    n_blocks = n_batch * math.ceil(problem.n_query / BLOCK_ROWS)
    kernel[n_blocks, THREADS](
        _bits(query), _bits(key), _bits(value), _cuda.to_device(mask.astype(np.float32)),
        _cuda.to_device(index), problem.is_causal, np.float32(problem.scale), out, log_sum_exp,
    )  # fmt: skip
    out = out.reshape(problem.output_shape())
    log_sum_exp = log_sum_exp.reshape((*problem.batch_shape, problem.n_query))
    if problem.on_device:
        return out, log_sum_exp
    return out.copy_to_host(), log_sum_exp.copy_to_host()
