r"""Products of bfloat16 operands on AVX512_BF16's dot-product instruction, ``vdpbf16ps``.

``vdpbf16ps`` multiplies 32 pairs of bfloat16 numbers and adds each two
neighbouring products into one of 16 float32 sums: twice the multiply-adds of
a float32 fused multiply-add of the same width. The product of two bfloat16
numbers is exact in float32 (8 significant bits each), so a sum built this way
rounds like a float32 product of the widened operands, except that the
instruction treats subnormal inputs as zero and flushes subnormal results
(Intel's definition; AMD's Zen 4 and 5 run it too).

The operands are 32-bit words, each holding two bfloat16 numbers of the
product's reduction dimension (the low half first):

- ``a`` rows, ``(M, P)`` words: row ``r`` holds pairs ``(a[r, 2p], a[r, 2p+1])``,
  which is a row-major bfloat16 matrix ``(M, 2P)`` read as ``uint32``;
- ``b`` packed, ``(P, N)`` words: word ``(p, n)`` holds ``(b[2p, n], b[2p+1, n])``
  of a bfloat16 matrix ``(2P, N)``, two of its rows interleaved
  (:func:`pack_row_pairs`, :func:`round_row_pairs`).

so that ``c[r, n] = sum_k a[r, k] b[k, n]`` is, for every pair ``p``, one word of
``a`` broadcast to all 16 lanes times 16 words of ``b`` (:func:`pair_gemm`).

Only a CPU whose compile target has AVX512_BF16 can compile these kernels
(:func:`tfmath._jit.target_has_bfloat16_dot`); elsewhere Numba refuses them with a
typing error, before LLVM sees an instruction it cannot select.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tfmath._jit import cpu_kernel, target_has_bfloat16_dot
from tfmath.kernels.cpu.half import BFLOAT16, narrow_scalar, widen_scalar
from tfmath.kernels.cpu.vector_width import prefer_wide_vectors

#: float32 sums per vector, and bfloat16 operands per vector (two per sum).
LANES = 16
#: Rows of ``c`` one call of the micro-kernel computes, and vectors of ``LANES`` columns.
TILE_ROWS, TILE_VECTORS = 4, 4


class _BFloat16Type(ir.Type):
    """LLVM's ``bfloat``, which llvmlite's IR builder does not name."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat16Type)

    def __hash__(self):
        return hash("bfloat")


_FLOAT_VECTOR = ir.VectorType(ir.FloatType(), LANES)
_WORD_VECTOR = ir.VectorType(ir.IntType(32), LANES)
_PAIR_VECTOR = ir.VectorType(_BFloat16Type(), 2 * LANES)
_DPBF16PS = "llvm.x86.avx512bf16.dpbf16ps.512"


def _splat(builder, value, vector_type):
    """``value`` in every lane of a ``vector_type`` vector."""
    one = builder.insert_element(ir.Constant(vector_type, None), value, ir.IntType(32)(0))
    return builder.shuffle_vector(
        one, ir.Constant(vector_type, None), ir.Constant(_WORD_VECTOR, [0] * LANES)
    )


def _vector_pointer(builder, first, offset, vector_type):
    """A pointer to the ``vector_type`` vector at element ``offset`` from ``first``."""
    return builder.bitcast(builder.gep(first, [offset]), vector_type.as_pointer())


class _Matrix:
    """A 2-D array argument of an intrinsic: its data pointer and its row stride in
    elements (every element here is 4 bytes)."""

    def __init__(self, context, builder, array_type, value):
        array = context.make_array(array_type)(context, builder, value)
        stride = cgutils.unpack_tuple(builder, array.strides)[0]
        self.data = array.data
        self.row_stride = builder.sdiv(stride, stride.type(4))

    def row(self, builder, row):
        return builder.gep(self.data, [builder.mul(row, self.row_stride)])


def _is_matrix(array, dtype):
    return isinstance(array, types.Array) and array.ndim == 2 and array.dtype == dtype


def _micro_kernel(rows, vectors):
    """An intrinsic computing ``rows x (vectors * LANES)`` sums of ``c`` at once:

    ``c[c_row + r, c_col + n] (+)= alpha * sum_p a[a_row + r, p] . b[p, c_col + n]``

    over ``n_pairs`` pairs, the sums held in ``rows * vectors`` vector registers
    across the whole reduction (16 of AVX-512's 32 in the widest form) and written
    once, added to ``c`` when ``accumulate``, else replacing it. Typed for float32
    ``c``, word operands, 64-bit indices and a float32 ``alpha`` only."""

    @intrinsic
    def micro_kernel(typingctx, c, c_row, c_col, a, a_row, b, n_pairs, alpha, accumulate):
        indices = (c_row, c_col, a_row, n_pairs)
        if not (
            target_has_bfloat16_dot()
            and _is_matrix(c, types.float32)
            and _is_matrix(a, types.uint32)
            and _is_matrix(b, types.uint32)
            and all(index == types.int64 for index in indices)
            and alpha == types.float32
            and accumulate == types.boolean
        ):
            return None
        signature = types.void(c, c_row, c_col, a, a_row, b, n_pairs, alpha, accumulate)

        def codegen(context, builder, signature, args):
            c, c_row, c_col, a, a_row, b, n_pairs, alpha, accumulate = args
            c_type, _, _, a_type, _, b_type = signature.args[:6]
            c = _Matrix(context, builder, c_type, c)
            a = _Matrix(context, builder, a_type, a)
            b = _Matrix(context, builder, b_type, b)
            index = ir.IntType(64)
            dot = builder.module.declare_intrinsic(
                _DPBF16PS, fnty=ir.FunctionType(_FLOAT_VECTOR, [_FLOAT_VECTOR] + [_PAIR_VECTOR] * 2)
            )
            zero = ir.Constant(_FLOAT_VECTOR, None)
            sums = [
                [cgutils.alloca_once_value(builder, zero) for _ in range(vectors)]
                for _ in range(rows)
            ]
            a_rows = [a.row(builder, builder.add(a_row, index(r))) for r in range(rows)]
            with cgutils.for_range(builder, n_pairs) as loop:
                pair = loop.index
                b_first = builder.gep(b.row(builder, pair), [c_col])
                b_vectors = [
                    builder.bitcast(
                        builder.load(
                            _vector_pointer(builder, b_first, index(LANES * v), _WORD_VECTOR),
                            align=4,
                        ),
                        _PAIR_VECTOR,
                    )
                    for v in range(vectors)
                ]
                for r in range(rows):
                    word = builder.load(builder.gep(a_rows[r], [pair]))
                    a_vector = builder.bitcast(_splat(builder, word, _WORD_VECTOR), _PAIR_VECTOR)
                    for v in range(vectors):
                        total = builder.load(sums[r][v])
                        builder.store(
                            builder.call(dot, [total, a_vector, b_vectors[v]]), sums[r][v]
                        )
            scale = _splat(builder, alpha, _FLOAT_VECTOR)
            for r in range(rows):
                c_first = builder.gep(c.row(builder, builder.add(c_row, index(r))), [c_col])
                for v in range(vectors):
                    pointer = _vector_pointer(builder, c_first, index(LANES * v), _FLOAT_VECTOR)
                    value = builder.fmul(builder.load(sums[r][v]), scale)
                    with builder.if_else(accumulate) as (add, replace):
                        with add:
                            total = builder.fadd(builder.load(pointer, align=4), value)
                            builder.store(total, pointer, align=4)
                        with replace:
                            builder.store(value, pointer, align=4)
            return context.get_dummy_value()

        return signature, codegen

    return micro_kernel


_FULL_TILE = _micro_kernel(TILE_ROWS, TILE_VECTORS)
_ROW = _micro_kernel(1, TILE_VECTORS)
_NARROW_TILE = _micro_kernel(TILE_ROWS, 1)
_NARROW_ROW = _micro_kernel(1, 1)


@cpu_kernel
def pair_gemm(alpha, a, b, accumulate, c):
    """``c = alpha * A @ B``, or ``c += alpha * A @ B`` when ``accumulate``, where ``a``
    holds ``A`` ``(M, 2P)`` as words ``(M, P)`` and ``b`` holds ``B`` ``(2P, N)`` as
    packed words ``(P, N)`` (see the module's docstring); ``c`` is float32 ``(M, N)``
    with contiguous rows, and ``N`` a multiple of ``LANES``."""
    m, n = c.shape
    n_pairs = a.shape[1]
    if a.shape[0] != m or b.shape[0] != n_pairs or b.shape[1] != n or n % LANES:
        raise ValueError("pair_gemm: operand shapes do not match")
    alpha = np.float32(alpha)
    wide = TILE_VECTORS * LANES
    full_rows = m - m % TILE_ROWS
    # Column blocks outside, so that a block of b stays in the L1 cache for every row.
    for column in range(0, n - n % wide, wide):
        for row in range(0, full_rows, TILE_ROWS):
            _FULL_TILE(c, row, column, a, row, b, n_pairs, alpha, accumulate)
        for row in range(full_rows, m):
            _ROW(c, row, column, a, row, b, n_pairs, alpha, accumulate)
    for column in range(n - n % wide, n, LANES):
        for row in range(0, full_rows, TILE_ROWS):
            _NARROW_TILE(c, row, column, a, row, b, n_pairs, alpha, accumulate)
        for row in range(full_rows, m):
            _NARROW_ROW(c, row, column, a, row, b, n_pairs, alpha, accumulate)


@cpu_kernel
def _pair_word(low, high):
    return np.uint32(low) | (np.uint32(high) << np.uint32(16))


@cpu_kernel
def round_row_pairs(x, out):
    """``out[p, n]``: ``x[2p, n]`` and ``x[2p+1, n]`` (float32) rounded to nearest even
    in bfloat16, as one packed word; an odd last row is paired with 0."""
    prefer_wide_vectors()
    n_rows = x.shape[0]
    for p in range(n_rows // 2):
        for column in range(x.shape[1]):
            low = narrow_scalar(x[2 * p, column], BFLOAT16)
            high = narrow_scalar(x[2 * p + 1, column], BFLOAT16)
            out[p, column] = _pair_word(low, high)
    if n_rows % 2:
        for column in range(x.shape[1]):
            out[n_rows // 2, column] = np.uint32(narrow_scalar(x[n_rows - 1, column], BFLOAT16))


@cpu_kernel
def round_column_pairs(x, out):
    """``out[r, p]``: ``x[r, 2p]`` and ``x[r, 2p+1]`` (float32) rounded to bfloat16, as
    one word: the rows of ``x`` as ``a`` operand words (``x`` has an even number of
    columns)."""
    prefer_wide_vectors()
    for r in range(x.shape[0]):
        for p in range(out.shape[1]):
            low = narrow_scalar(x[r, 2 * p], BFLOAT16)
            high = narrow_scalar(x[r, 2 * p + 1], BFLOAT16)
            out[r, p] = _pair_word(low, high)


@cpu_kernel
def pack_row_pairs(bits, out):
    """``out[p, n]``: the bfloat16 numbers ``bits[2p, n]`` and ``bits[2p+1, n]`` (16-bit
    patterns) as one packed word; an odd last row is paired with 0."""
    n_rows = bits.shape[0]
    for p in range(n_rows // 2):
        for column in range(bits.shape[1]):
            out[p, column] = _pair_word(bits[2 * p, column], bits[2 * p + 1, column])
    if n_rows % 2:
        for column in range(bits.shape[1]):
            out[n_rows // 2, column] = np.uint32(bits[n_rows - 1, column])


@cpu_kernel
def pack_column_pairs(bits, out):
    """``out[n, p]``: ``bits[2p, n]`` and ``bits[2p+1, n]`` as one packed word, for
    ``bits`` ``(rows, N)``: the transpose of :func:`pack_row_pairs`, the rows of a
    matrix whose transpose is an ``a`` operand; rows beyond ``bits`` are 0."""
    n_rows = bits.shape[0]
    for p in range(out.shape[1]):
        low_row, high_row = 2 * p, 2 * p + 1
        for column in range(bits.shape[1]):
            low = bits[low_row, column] if low_row < n_rows else np.uint16(0)
            high = bits[high_row, column] if high_row < n_rows else np.uint16(0)
            out[column, p] = _pair_word(low, high)


@cpu_kernel
def words_are_finite(words):
    """Whether every bfloat16 number in a 2-D array of packed words is finite."""
    for r in range(words.shape[0]):
        for p in range(words.shape[1]):
            word = words[r, p]
            if (word & np.uint32(0x7F80)) == np.uint32(0x7F80):
                return False
            if (word & np.uint32(0x7F800000)) == np.uint32(0x7F800000):
                return False
    return True


@cpu_kernel
def add_pair_products_skipping_zeros(a, weights, accumulator):
    """``accumulator[e, i] += sum_j A[e, j] w[j, i]`` with ``a`` holding ``A`` as words
    ``(E, P)`` and ``weights`` float32 ``(2P or fewer, N)``, each weight rounded to
    bfloat16 as :func:`round_row_pairs` rounds it, and ``A`` read only where a weight
    is not 0: NaN or inf stored at masked positions cannot leak in through 0 * inf."""
    for j in range(weights.shape[0]):
        p, shift = j // 2, np.uint32(16 * (j % 2))
        for i in range(weights.shape[1]):
            w = widen_scalar(narrow_scalar(weights[j, i], BFLOAT16), BFLOAT16)
            if w != 0:
                for e in range(a.shape[0]):
                    half_bits = np.uint16((a[e, p] >> shift) & np.uint32(0xFFFF))
                    accumulator[e, i] += w * widen_scalar(half_bits, BFLOAT16)


@cpu_kernel(parallel=True)
def pack_transposed_tiles(bits, key_tile, out):
    """Rows ``(batch, S, C)`` (bfloat16 bit patterns, values or keys) transposed, as the
    ``a`` operands of products over the keys, per tile of ``key_tile`` keys:
    ``out[b, t, c, p]`` packs keys ``t * key_tile + 2p`` and ``+ 2p + 1`` of column
    ``c``, zero beyond ``S``."""
    n_batch, n_tiles = out.shape[0], out.shape[1]
    n_key = bits.shape[1]
    for task in numba.prange(n_batch * n_tiles):
        b, t = task // n_tiles, task % n_tiles
        first = t * key_tile
        pack_column_pairs(bits[b, first : min(first + key_tile, n_key)], out[b, t])


@cpu_kernel(parallel=True)
def pack_tiles_in_row_pairs(bits, tile, out):
    """Rows ``(batch, rows, C)`` (bfloat16 bit patterns) as ``b`` operands per tile of
    ``tile`` rows: ``out[b, t] = pack_row_pairs(rows t * tile ...)``, zero beyond the
    rows."""
    n_batch, n_tiles = out.shape[0], out.shape[1]
    n_rows = bits.shape[1]
    for task in numba.prange(n_batch * n_tiles):
        b, t = task // n_tiles, task % n_tiles
        first = t * tile
        stop = min(first + tile, n_rows)
        pairs = out[b, t]
        pairs[:] = 0
        if stop > first:
            pack_row_pairs(bits[b, first:stop], pairs[: (stop - first + 1) // 2])
