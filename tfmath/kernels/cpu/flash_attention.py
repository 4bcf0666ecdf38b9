r"""FlashAttention-style tiled attention on the CPU: forward and backward.

Forward (Dao et al. 2022, Algorithm 1, with the FlashAttention-2 loop order):
each parallel task owns a tile of ``QUERY_TILE`` query rows of one batch entry
and sweeps the key/value tiles, keeping per row a running maximum :math:`m`,
a running normaliser :math:`\ell` and an unnormalised output :math:`O`:

.. math::

    m' = \max(m, \max_j s_j), \quad
    \ell' = \ell\, 2^{m - m'} + \sum_j 2^{s_j - m'}, \quad
    O' = O\, 2^{m - m'} + P V, \quad P_{j} = 2^{s_j - m'}

The scores are kept in base 2 (the product that forms them is scaled by
``scale * log2(e)``) so the exponential is :func:`exp2_scalar`, which LLVM
vectorises. Only a ``QUERY_TILE x key_tile`` block of scores ever exists, so
the extra memory per task is :math:`O((\text{tile} + d)\,\text{tile})`,
independent of :math:`L S`. The log-sum-exp of each row is kept for the
backward pass.

Once every row of a task has a finite :math:`m`, a key tile is first tried
in one pass that skips the search for :math:`\max_j s_j`: :math:`m` stays
the reference, :math:`\ell' = \ell + \sum_j 2^{s_j - m}` and
:math:`O' = O + PV` with no rescaling. The sums are exact either way (any
reference works, as long as nothing overflows); a tile where a row's new
weights add up to :math:`2^{16}` is redone the two-pass way
(:func:`_softmax_tile_against_reference`). Random inputs redo no tile, and the
forward is faster for the pass it skips (docs/benchmarks.rst, "Measurements
behind constants").

Backward (Dao 2023, FlashAttention-2, Algorithm 2): with the saved
log-sum-exp, each key tile recomputes :math:`P`, and with
:math:`D_i = \sum_e dO_{ie} O_{ie}`:

.. math::

    dV = P^\top dO, \quad dP = dO\, V^\top, \quad dS = P \circ (dP - D), \quad
    dQ = s\, dS\, K, \quad dK = s\, dS^\top Q

As in the forward, pairs of weight 0 are never read (a block with a non-finite
operand is taken without BLAS's products, which multiply zeros too), and a row
with one attended key gets :math:`dS = 0` exactly (see :func:`_backward_kernel`).

The tile products go to BLAS through :func:`tfmath.kernels.cpu.blas.gemm`,
whose :math:`\alpha` applies the scale and whose :math:`\beta = 1` adds
products straight into the output and the gradients, with BLAS held to the
calling thread (:func:`tfmath._blas_threads.serial_blas`): the parallel loop already
occupies every core, and BLAS threads started inside it would oversubscribe
them (and, under Numba's OpenMP layer, make OpenBLAS print a warning per
call). Tiles of 64 rows keep each product in cache and near BLAS's best
single-thread rate.
"""

import math

import numba
import numpy as np
from numba import types
from numba.extending import overload

from tfmath._blas_threads import serial_blas
from tfmath._contract.checks import is_half
from tfmath._jit import cpu_kernel, sized
from tfmath.kernels.cpu.attention import (
    LOG2E,
    _scores_row,
    _softmax_inplace,
    _weighted_sum,
    balanced_tile,
)
from tfmath.kernels.cpu.bfloat16_dot import (
    LANES,
    add_pair_products_skipping_zeros,
    pack_tiles_in_row_pairs,
    pack_transposed_tiles,
    pair_gemm,
    round_column_pairs,
    round_row_pairs,
    words_are_finite,
)
from tfmath.kernels.cpu.blas import gemm, transpose_into
from tfmath.kernels.cpu.exp2 import exp2_scalar
from tfmath.kernels.cpu.half import widen
from tfmath.kernels.cpu.vector_width import prefer_wide_vectors

#: Query rows per task (fewer for shorter sequences, down to 8).
QUERY_TILE = 64
#: Largest tile product (M*N*K): keeps a tile's operands within a core's L2 cache.
TILE_PRODUCT_LIMIT = 65536 * 8
LN2 = 0.6931471805599453
#: How far (base 2) a score may exceed its row's reference maximum in the
#: single-pass softmax step; its weight, at most 2**16, stays far from overflow.
SOFTMAX_HEADROOM = 16.0
#: Key tiles the backward pass holds while it sweeps the query tiles once.
KEY_TILES_PER_SWEEP = 4
#: What a mask does to a (key tile, query tile) block of scores (see :func:`mask_operand`):
#: forbids every pair (the block is skipped), changes some, or leaves all as they are.
MASKED, PARTIAL, OPEN = 0, 1, 2


def query_tile_size(n_query):
    """Query rows per task: ``QUERY_TILE``, or the sequence rounded up to 8 if shorter."""
    return min(QUERY_TILE, max(8, -(-n_query // 8) * 8))


def key_tile_size(n_features, n_values, n_key):
    """Keys per tile: the largest multiple of 16, at most 128, within ``TILE_PRODUCT_LIMIT``,
    and no larger than the keys rounded up to 16 (a tile of padding is wasted work)."""
    widest = max(n_features, n_values, 1)
    size = TILE_PRODUCT_LIMIT // (QUERY_TILE * widest) // 16 * 16
    return max(16, min(128, size, -(-n_key // 16) * 16))


def tile_sizes(problem):
    """``(key_tile, query_tile)`` of a problem, the same for its forward and backward.

    Causal problems take key tiles no wider than ``QUERY_TILE``: a block on the
    diagonal computes every score of its tile and masks those above the diagonal, and
    with tiles as wide as the query tile that waste halves; the gain is largest at short
    L and fades by L = 2048. Without the causal mask the width made no measurable
    difference, so 128 stays (docs/benchmarks.rst, "Measurements behind constants").
    """
    key_tile = key_tile_size(problem.n_features, problem.value_dim, problem.n_key)
    if problem.is_causal:
        key_tile = min(key_tile, QUERY_TILE)
    return key_tile, query_tile_size(problem.n_query)


@cpu_kernel
def _mask_tile(
    scores, mask, mask_transposed, m, kind, is_causal, first_key, first_row, n_key, n_query, block
):  # fmt: skip
    """Mask a transposed tile of base-2 scores, ``scores[j, i]`` for key j and query i:
    add the mask of a ``PARTIAL`` block (``block``, of the tile's shape, is scratch
    space; ``mask_transposed``: see :func:`kernel_mask`), and write -inf where the
    key is beyond the sequence, above the causal diagonal, or masked by -inf (even
    over a NaN score)."""
    key_tile, query_tile = scores.shape
    n_keys = min(key_tile, n_key - first_key)
    n_rows = min(query_tile, n_query - first_row)
    if mask is not None and kind == PARTIAL:
        if mask_transposed:
            # Keys by rows, in base 2 already: each key's row of the block is an add.
            for j in range(n_keys):
                _add_row_bias(scores[j], mask[m, first_key + j, first_row : first_row + n_rows])
        else:
            _add_mask(scores, mask, m, first_key, first_row, n_keys, n_rows, block)
    for j in range(n_keys, key_tile):
        scores[j, :] = -np.inf
    if is_causal:
        for j in range(n_keys):
            for i in range(min(query_tile, first_key + j - first_row)):
                scores[j, i] = -np.inf


#: Mask rows transposed together into a block: eight values of one key land side by
#: side in its row of the block (one row at a time writes a cache line per value; eight
#: measured fastest, docs/benchmarks.rst, "Measurements behind constants").
TRANSPOSE_ROWS = 8


@cpu_kernel
def _add_mask(scores, mask, m, first_key, first_row, n_keys, n_rows, block):
    """``scores[j, i] += log2(e) * mask[m, i, j]`` with -inf forcing -inf (over a NaN
    score too), for an additive mask of shape ``(mask_batch, L or 1, S or 1)`` read
    where it lies. One loop per layout: a key-padding mask (one value per key) costs a
    broadcast add; a full mask block is first transposed into ``block``, so that the
    add runs along the scores' contiguous query axis (an add scattered straight from
    the mask is slower: docs/benchmarks.rst, "Measurements behind constants")."""
    if mask.shape[1] == 1:
        _add_key_bias(scores, mask[m, 0], first_key if mask.shape[2] > 1 else -1, n_keys, n_rows)
        return
    if mask.shape[2] == 1:
        # One value per query row, the same for every key.
        for i in range(n_rows):
            block[0, i] = mask[m, first_row + i, 0] * LOG2E
        for j in range(n_keys):
            _add_row_bias(scores[j], block[0, :n_rows])
        return
    for i in range(0, n_rows, TRANSPOSE_ROWS):
        rows = min(TRANSPOSE_ROWS, n_rows - i)
        for j in range(n_keys):
            out = block[j, i : i + rows]
            for r in range(rows):
                out[r] = mask[m, first_row + i + r, first_key + j] * LOG2E
    for j in range(n_keys):
        _add_row_bias(scores[j], block[j, :n_rows])


@cpu_kernel
def _add_row_bias(scores, bias):
    """``scores[i] += bias[i]``, or -inf where the bias is -inf, along one key's row."""
    prefer_wide_vectors()
    for i in range(bias.shape[0]):
        b = bias[i]
        total = scores[i] + b
        scores[i] = total if b != -np.inf else -np.inf


@cpu_kernel
def _add_key_bias(scores, mask_row, first_key, n_keys, n_rows):
    """One mask value per key (``first_key`` < 0: one for every key), in base e,
    added to every row of the base-2 scores."""
    prefer_wide_vectors()
    for j in range(n_keys):
        b = scores.dtype.type((mask_row[0] if first_key < 0 else mask_row[first_key + j]) * LOG2E)
        if b == -np.inf:
            scores[j, :n_rows] = -np.inf
        elif b != 0:
            for i in range(n_rows):
                scores[j, i] += b


def _tile_product(alpha, rows, columns, out):
    """``out = alpha * rows @ columns``: float operands by BLAS, bfloat16 operands as
    words (``rows``) and packed pairs (``columns``) by ``vdpbf16ps`` (see
    :mod:`tfmath.kernels.cpu.bfloat16_dot`). Chosen by the operands' types when a
    kernel compiles, so that the kernels are written once for both."""


@overload(_tile_product)
def _tile_product_overload(alpha, rows, columns, out):
    if rows.dtype == types.uint32:

        def by_pairs(alpha, rows, columns, out):
            pair_gemm(alpha, rows, columns, False, out)

        return by_pairs

    def by_blas(alpha, rows, columns, out):
        gemm(alpha, rows, columns, 0.0, out)

    return by_blas


@cpu_kernel
def _score_tile(
    scores, key_rows, query_columns, score_scale,
    mask, mask_transposed, m, kind, is_causal, first_key, first_row, n_key, n_query, block,
):  # fmt: skip
    """A transposed tile of base-2 scores, ``scores[j, i]`` for key j and query i,
    masked (see :func:`_mask_tile`)."""
    _tile_product(score_scale, key_rows, query_columns, scores)
    _mask_tile(
        scores, mask, mask_transposed, m, kind, is_causal, first_key, first_row, n_key, n_query,
        block,
    )  # fmt: skip


@cpu_kernel
def _block_kind(tile_kinds, m, key_block, query_block):
    """The kind of a (key tile, query tile) block, for masks broadcast along either axis
    (``tile_kinds`` None: no mask, every block OPEN)."""
    if tile_kinds is None:
        return OPEN
    return tile_kinds[
        m,
        key_block if tile_kinds.shape[1] > 1 else 0,
        query_block if tile_kinds.shape[2] > 1 else 0,
    ]


@cpu_kernel
def _block_counts(mask, is_boolean, m, k0, k1, r0, r1):
    """How many entries of a mask block (keys ``k0:k1``, rows ``r0:r1``) forbid
    attention, and how many leave it open (boolean masks as bytes, 0 forbidding;
    additive ones -inf forbidding, 0 open), counted until the block is known to be
    PARTIAL (then they add up to less than its size). Counting rather than and-ing,
    against constants of the mask's own type, so that the loop vectorises: it reads
    the mask at memory speed."""
    prefer_wide_vectors()
    n_masked = 0
    n_open = 0
    # Loops over a slice from 0, not over k0:k1 of the row: LLVM vectorises only the
    # former (a third of the time on ALiBi's mask). A row that leaves the block
    # neither all forbidden nor all open ends the count: the block is PARTIAL, and a
    # dense bias (ALiBi) is read once, by the kernel, rather than twice.
    seen = 0
    if is_boolean:
        false = mask.dtype.type(0)
        for i in range(r0, r1):
            segment = mask[m, i, k0:k1]
            for j in range(segment.shape[0]):
                n_masked += segment[j] == false
            seen += k1 - k0
            if 0 < n_masked < seen:
                break
        return n_masked, seen - n_masked
    forbidden, allowed = mask.dtype.type(-np.inf), mask.dtype.type(0)
    for i in range(r0, r1):
        segment = mask[m, i, k0:k1]
        for j in range(segment.shape[0]):
            n_masked += segment[j] == forbidden
            n_open += segment[j] == allowed
        seen += k1 - k0
        if n_masked < seen and n_open < seen:
            break
    return n_masked, n_open


@cpu_kernel(parallel=True)
def _classify_blocks(mask, is_boolean, key_tile, query_tile, additive, tile_kinds):
    """``tile_kinds[m, t, r]``: whether block (key tile t, query tile r) of a mask
    ``(mask_batch, L or 1, S or 1)`` is all forbidden (MASKED), all open (OPEN) or
    anything else (PARTIAL); one block per axis along which the mask is broadcast.
    A boolean mask (as bytes) is also written, block by block while it is in cache,
    into ``additive`` as 0 and -inf."""
    n_masks, n_key_blocks, n_query_blocks = tile_kinds.shape
    n_rows, n_keys = mask.shape[1], mask.shape[2]
    key_span = key_tile if n_keys > 1 else 1
    row_span = query_tile if n_rows > 1 else 1
    allowed, forbidden = additive.dtype.type(0), additive.dtype.type(-np.inf)
    for task in numba.prange(n_masks * n_key_blocks * n_query_blocks):
        m = task // (n_key_blocks * n_query_blocks)
        t = task // n_query_blocks % n_key_blocks
        r = task % n_query_blocks
        k0, k1 = t * key_span, min((t + 1) * key_span, n_keys)
        r0, r1 = r * row_span, min((r + 1) * row_span, n_rows)
        n_masked, n_open = _block_counts(mask, is_boolean, m, k0, k1, r0, r1)
        size = (k1 - k0) * (r1 - r0)
        tile_kinds[m, t, r] = MASKED if n_masked == size else (OPEN if n_open == size else PARTIAL)
        if is_boolean:
            for i in range(r0, r1):
                segment, out = mask[m, i, k0:k1], additive[m, i, k0:k1]
                for j in range(segment.shape[0]):
                    out[j] = allowed if segment[j] else forbidden


#: Rows and keys of a block that :func:`_transposed_base2` transposes at once: both
#: blocks, read and written, stay in a core's L1 cache.
TRANSPOSE_BLOCK = 64


@cpu_kernel(parallel=True)
def _transposed_base2(mask, out):
    """``out[m, j, i] = log2(e) * mask[m, i, j]``, computed in float64 and rounded to
    ``out``'s dtype as :func:`_add_mask` rounds it, one task per (mask, block of
    ``TRANSPOSE_BLOCK`` rows and keys).

    Eight rows at a time, each read along its keys and each key's eight values
    written side by side, named one by one so that LLVM keeps the eight rows'
    addresses in registers: a loop over the eight took three times as long
    (docs/benchmarks.rst)."""
    n_masks, n_rows, n_keys = mask.shape
    row_blocks = -(-n_rows // TRANSPOSE_BLOCK)
    key_blocks = -(-n_keys // TRANSPOSE_BLOCK)
    for task in numba.prange(n_masks * row_blocks * key_blocks):
        m = task // (row_blocks * key_blocks)
        first_row = task // key_blocks % row_blocks * TRANSPOSE_BLOCK
        first_key = task % key_blocks * TRANSPOSE_BLOCK
        last_row = min(first_row + TRANSPOSE_BLOCK, n_rows)
        last_key = min(first_key + TRANSPOSE_BLOCK, n_keys)
        rows, columns = mask[m], out[m]
        i = first_row
        while i + 8 <= last_row:
            r0, r1, r2, r3 = rows[i], rows[i + 1], rows[i + 2], rows[i + 3]
            r4, r5, r6, r7 = rows[i + 4], rows[i + 5], rows[i + 6], rows[i + 7]
            for j in range(first_key, last_key):
                column = columns[j]
                column[i], column[i + 1] = r0[j] * LOG2E, r1[j] * LOG2E
                column[i + 2], column[i + 3] = r2[j] * LOG2E, r3[j] * LOG2E
                column[i + 4], column[i + 5] = r4[j] * LOG2E, r5[j] * LOG2E
                column[i + 6], column[i + 7] = r6[j] * LOG2E, r7[j] * LOG2E
            i += 8
        for j in range(first_key, last_key):
            for r in range(i, last_row):
                columns[j, r] = rows[r, j] * LOG2E


def kernel_mask(mask, n_batch):
    """``(mask, transposed)``: the additive mask of :func:`mask_operand` as the flash
    kernels read it. A dense mask (``L x S``, L and S above 1) that fewer mask
    entries than ``n_batch`` batch entries share (one bias for every head) comes
    transposed, ``(mask_batch, S, L)``, and in base 2, in a copy made once: each
    tile then adds it key by key, rather than transposing it for every head that
    reads it (half the time a tile, see docs/flash_attention.rst), with the same
    bits. Any other mask comes as it is."""
    if mask is None or mask.shape[0] >= n_batch or mask.shape[1] == 1 or mask.shape[2] == 1:
        return mask, False
    n_masks, n_rows, n_keys = mask.shape
    transposed = np.empty((n_masks, n_keys, n_rows), dtype=mask.dtype)
    _transposed_base2(mask, transposed)
    return transposed, True


def mask_operand(mask, dtype, key_tile, query_tile):
    """The mask as the CPU flash kernels read it: ``(additive, tile_kinds)``.

    ``additive`` is the mask as given, ``(mask_batch, L or 1, S or 1)``, never
    broadcast to every head nor copied when it is already additive (a boolean one
    becomes 0 and -inf: a copy the size of the mask as given); the kernels add it
    block by block where it lies. ``tile_kinds`` says, per block of the kernels'
    tiles, whether the mask forbids it whole (the kernels skip it: a key-padding
    mask costs what the unpadded lengths would), leaves it open, or must be added
    score by score. Without a mask both are one-element placeholders of an open
    block.
    """
    if mask is None:
        return None, None
    n_masks, mask_rows, mask_keys = mask.shape
    n_key_blocks = -(-mask_keys // key_tile)
    n_query_blocks = -(-mask_rows // query_tile)
    tile_kinds = np.empty((n_masks, n_key_blocks, n_query_blocks), dtype=np.int8)
    is_boolean = mask.dtype == np.bool_
    additive = np.empty(mask.shape, dtype=dtype) if is_boolean else mask.astype(dtype, copy=False)
    # An additive mask is only read: the kernel writes a boolean one's 0 and -inf, and
    # gets a placeholder otherwise, so that a read-only mask (from np.broadcast_to, a
    # memory map, np.frombuffer) is never typed as the kernel's output.
    written = additive if is_boolean else np.empty((1, 1, 1), dtype=dtype)
    _classify_blocks(
        mask.view(np.uint8) if is_boolean else additive, is_boolean, key_tile, query_tile,
        written, tile_kinds,
    )  # fmt: skip
    return additive, tile_kinds


@cpu_kernel
def _softmax_tile(scores, running_max, running_sum, rescale, new_max):
    """Online-softmax step over a transposed tile: scores become 2^(s - m'), and
    ``rescale`` receives each row's factor 2^(m - m') for its old sum and output
    (``new_max`` is scratch space, one entry per row).

    Every loop runs along query rows, the contiguous axis, so each is plain
    elementwise SIMD work rather than a reduction (LLVM will not vectorise a
    max reduction without the no-NaN flag this project leaves off), and the
    shift, the exponential and the row sums share one pass.
    """
    prefer_wide_vectors()
    key_tile, query_tile = scores.shape
    for i in range(query_tile):
        new_max[i] = running_max[i]
    # Four keys per step: each step updates the running maximum and sum through
    # memory, and one update per four keys shortens that dependency chain.
    for j in range(0, key_tile, 4):
        for i in range(query_tile):
            first_pair = max(scores[j, i], scores[j + 1, i])
            second_pair = max(scores[j + 2, i], scores[j + 3, i])
            new_max[i] = max(new_max[i], max(first_pair, second_pair))
    for i in range(query_tile):
        # A row with nothing attended so far keeps shift 0: its -inf scores give
        # weight 0 and any NaN score stays NaN.
        shift = 0 if new_max[i] == -np.inf else new_max[i]
        grown = running_max[i] - shift if running_max[i] != -np.inf else -np.inf
        factor = exp2_scalar(grown)
        rescale[i] = 1 if running_sum[i] == 0 or new_max[i] == -np.inf else factor
        running_sum[i] *= rescale[i]
        running_max[i] = new_max[i]
        new_max[i] = shift
    for j in range(0, key_tile, 4):
        for i in range(query_tile):
            w0 = exp2_scalar(scores[j, i] - new_max[i])
            w1 = exp2_scalar(scores[j + 1, i] - new_max[i])
            w2 = exp2_scalar(scores[j + 2, i] - new_max[i])
            w3 = exp2_scalar(scores[j + 3, i] - new_max[i])
            scores[j, i], scores[j + 1, i], scores[j + 2, i], scores[j + 3, i] = w0, w1, w2, w3
            running_sum[i] += (w0 + w1) + (w2 + w3)


@cpu_kernel
def _has_reference_maximum(running_max):
    """Whether every row has a finite running maximum (it has attended to something)."""
    for i in range(running_max.shape[0]):
        if running_max[i] == -np.inf:
            return False
    return True


@cpu_kernel
def _softmax_tile_against_reference(scores, running_max, running_sum, tile_sum):
    """The online-softmax step in one pass, for rows that already have a finite
    running maximum m: scores become 2^(s - m) without this tile's maximum being
    searched for first, and m stays the reference of the row's sums and output.

    Scores may exceed m; their weights are capped at ``2**SOFTMAX_HEADROOM``, and
    a tile in which any row's weights add up to that much (or to NaN) is
    refused: the caller then recomputes its scores, which this pass has
    overwritten, and takes the exact two-pass step of :func:`_softmax_tile`.
    Returns whether the tile was accepted; ``tile_sum`` is scratch space.
    """
    prefer_wide_vectors()
    key_tile, query_tile = scores.shape
    # float32, so that float32 scores stay float32 (float64 ones stay float64).
    cap = np.float32(SOFTMAX_HEADROOM)
    for i in range(query_tile):
        tile_sum[i] = 0
    for j in range(0, key_tile, 4):
        for i in range(query_tile):
            w0 = exp2_scalar(min(scores[j, i] - running_max[i], cap))
            w1 = exp2_scalar(min(scores[j + 1, i] - running_max[i], cap))
            w2 = exp2_scalar(min(scores[j + 2, i] - running_max[i], cap))
            w3 = exp2_scalar(min(scores[j + 3, i] - running_max[i], cap))
            scores[j, i], scores[j + 1, i], scores[j + 2, i], scores[j + 3, i] = w0, w1, w2, w3
            tile_sum[i] += (w0 + w1) + (w2 + w3)
    for i in range(query_tile):
        if not tile_sum[i] < 2.0**SOFTMAX_HEADROOM:
            return False
    for i in range(query_tile):
        running_sum[i] += tile_sum[i]
    return True


@cpu_kernel
def _accumulate_skipping_zeros(weights_t, values, accumulator):
    """``accumulator += values.T @ weights_t`` (the output accumulator is kept
    transposed) without reading values at zero weight, so that NaN or inf stored
    at masked positions cannot leak in through 0 * nan."""
    for j in range(weights_t.shape[0]):
        for i in range(weights_t.shape[1]):
            w = weights_t[j, i]
            if w != 0:
                for e in range(values.shape[1]):
                    accumulator[e, i] += w * values[j, e]


@cpu_kernel
def _is_finite_tile(tile):
    """Whether every entry of a tile is finite: a non-finite entry makes the sum
    non-finite (a finite tile whose float64 sum overflowed only takes the slower,
    equally exact path)."""
    total = 0.0
    for j in range(tile.shape[0]):
        for e in range(tile.shape[1]):
            total += tile[j, e]
    return np.isfinite(total)


@cpu_kernel
def _accumulate_values(value_tile, check_values, weights, accumulator):
    """Add V^T P for one key tile to the transposed output accumulator: by BLAS, or,
    with ``check_values`` and a non-finite value in the tile, reading values only at
    nonzero weights.

    BLAS reads the value tile transposed in place, rather than a transposed copy
    of the values made first: the copy costs more than a product without a
    transposed operand saves, most at short sequences (see docs/benchmarks.rst,
    "Measurements behind constants").
    """
    if not check_values or _is_finite_tile(value_tile):
        gemm(1.0, value_tile, weights, 1.0, accumulator, True)
    else:
        _accumulate_skipping_zeros(weights, value_tile, accumulator)


def _pairs_scratch(value_tiles, key_tile, query_tile):
    """Where a task rounds its weights to bfloat16 pairs, ``(key_tile / 2, query_tile)``
    words, when the values are bfloat16 words; None for float values."""


@overload(_pairs_scratch)
def _pairs_scratch_overload(value_tiles, key_tile, query_tile):
    if value_tiles.dtype == types.uint32:
        return lambda value_tiles, key_tile, query_tile: np.empty(
            ((key_tile + 1) // 2, query_tile), dtype=np.uint32
        )
    return lambda value_tiles, key_tile, query_tile: None


def _add_weighted_values(value_tile, check_values, weights, scratch, accumulator):
    """:func:`_accumulate_values` for float values; for bfloat16 values, packed words
    ``(Ev, key_tile / 2)``, the weights rounded to bfloat16 pairs in ``scratch`` first,
    as PyTorch's CPU flash attention rounds them to the operands' precision before
    their product with V, and the product by ``vdpbf16ps``."""


@overload(_add_weighted_values)
def _add_weighted_values_overload(value_tile, check_values, weights, scratch, accumulator):
    if value_tile.dtype == types.uint32:

        def by_pairs(value_tile, check_values, weights, scratch, accumulator):
            if not check_values or words_are_finite(value_tile):
                round_row_pairs(weights, scratch)
                pair_gemm(1.0, value_tile, scratch, True, accumulator)
            else:
                add_pair_products_skipping_zeros(value_tile, weights, accumulator)

        return by_pairs

    def by_blas(value_tile, check_values, weights, scratch, accumulator):
        _accumulate_values(value_tile, check_values, weights, accumulator)

    return by_blas


@cpu_kernel(parallel=True)
def _forward_kernel(
    query_tiles, key_tiles, value_tiles, mask, mask_transposed, tile_kinds,
    index, is_causal, n_query, n_key, scale, out, log_sum_exp,
):  # fmt: skip
    """One task per (batch entry, query tile).

    The operands are float tiles, or, for products by ``vdpbf16ps``, bfloat16
    words: queries and keys ``(batch, tiles, rows, E / 2)``, values packed
    ``(batch, tiles, Ev, key_tile / 2)`` (see :func:`flash_forward`).

    A task first multiplies every value tile by BLAS, as if all values were finite.
    A non-finite value, even at a weight of 0 (0 * inf is NaN), leaves the
    accumulator non-finite, and the task then runs again, reading each non-finite
    value tile only at nonzero weights, so that NaN or inf stored at masked
    positions cannot leak in. Checking the values on the way, in a pass of its own,
    cost a parallel loop's start per call.
    """
    n_batch, n_query_tiles, query_tile = out.shape[0], out.shape[1], out.shape[2]
    n_key_tiles, key_tile = key_tiles.shape[1], key_tiles.shape[2]
    n_values = out.shape[3]
    dtype = out.dtype
    # Scores in base 2, so that the exponential is 2^x.
    score_scale = scale * LOG2E
    for task in numba.prange(n_batch * n_query_tiles):
        prefer_wide_vectors()
        b = task // n_query_tiles
        tile = balanced_tile(task % n_query_tiles, n_query_tiles)
        first_row = tile * query_tile
        q, k, v, m = index[b, 0], index[b, 1], index[b, 2], index[b, 3]
        scores = np.empty((key_tile, query_tile), dtype=dtype)
        mask_block = np.empty((key_tile, query_tile), dtype=dtype)
        query_columns = np.empty((query_tiles.shape[3], query_tile), dtype=query_tiles.dtype)
        transpose_into(query_tiles[q, tile], query_columns)
        # Transposed, (values, queries): see _accumulate_values.
        accumulator = np.empty((n_values, query_tile), dtype=dtype)
        pairs = _pairs_scratch(value_tiles, key_tile, query_tile)
        running_max = np.empty(query_tile, dtype=dtype)
        running_sum = np.empty(query_tile, dtype=dtype)
        rescale = np.empty(query_tile, dtype=dtype)
        new_max = np.empty(query_tile, dtype=dtype)
        n_tiles = n_key_tiles
        if is_causal:
            last_row = min(first_row + query_tile, n_query) - 1
            n_tiles = min(n_key_tiles, last_row // key_tile + 1)
        for attempt in range(2):
            check_values = attempt == 1
            accumulator[:] = 0
            running_max[:] = -np.inf
            running_sum[:] = 0
            # A refused tile means this block's scores climb from key tile to key tile
            # (as an ALiBi bias makes them up to the diagonal); the next tiles would
            # likely be refused too, each at the cost of its scores computed twice, so
            # the rest of the block takes the two-pass step.
            try_single_pass = True
            for t in range(n_tiles):
                kind = _block_kind(tile_kinds, m, t, tile)
                if kind == MASKED:
                    continue
                first_key = t * key_tile
                _score_tile(
                    scores, key_tiles[k, t], query_columns, score_scale, mask, mask_transposed,
                    m, kind, is_causal, first_key, first_row, n_key, n_query, mask_block,
                )  # fmt: skip
                if try_single_pass and _has_reference_maximum(running_max):
                    if _softmax_tile_against_reference(scores, running_max, running_sum, new_max):
                        _add_weighted_values(
                            value_tiles[v, t], check_values, scores, pairs, accumulator
                        )
                        continue
                    # Refused, after the single pass overwrote the scores.
                    try_single_pass = False
                    _score_tile(
                        scores, key_tiles[k, t], query_columns, score_scale, mask,
                        mask_transposed, m, kind, is_causal, first_key, first_row, n_key, n_query,
                        mask_block,
                    )  # fmt: skip
                _softmax_tile(scores, running_max, running_sum, rescale, new_max)
                # A loop, not an array expression, which cost a sixth of the kernel.
                for e in range(n_values):
                    for i in range(query_tile):
                        accumulator[e, i] *= rescale[i]
                _add_weighted_values(value_tiles[v, t], check_values, scores, pairs, accumulator)
            if check_values or _is_finite_tile(accumulator):
                break
        for i in range(min(query_tile, n_query - first_row)):
            total = running_sum[i]
            inverse = 0 if total == 0 else 1 / total  # one division a row
            for e in range(n_values):
                # 0, not accumulator * 0, for a row with nothing to attend.
                out[b, tile, i, e] = 0 if total == 0 else accumulator[e, i] * inverse
            lse = (running_max[i] + np.log2(total)) * LN2
            log_sum_exp[b, tile, i] = -np.inf if total == 0 else lse


@cpu_kernel
def _probabilities_and_score_gradients(scores, grad_probabilities, shift, delta):
    """One pass over a transposed tile: scores become P = 2^(s - lse) and
    dP becomes dS = P (dP - D), without the scale, which the products into dQ
    and dK apply."""
    prefer_wide_vectors()
    for j in range(scores.shape[0]):
        for i in range(scores.shape[1]):
            p = exp2_scalar(scores[j, i] - shift[i])
            scores[j, i] = p
            grad_probabilities[j, i] = p * (grad_probabilities[j, i] - delta[i])


@cpu_kernel
def _shift_and_delta(
    log_sum_exp, b, first_row, n_query, log2e, grad_columns, output_columns, shift, delta
):  # fmt: skip
    r"""For the rows of one query tile: ``shift``, each row's log2-sum-exp, or +inf for
    a row with nothing to attend (and a padding row), so that its probabilities come
    out 0; and ``delta``, :math:`D_i = \sum_e dO_{ie} O_{ie}`, from the transposed
    tiles of the output gradient and the output (summed over ``e`` in order, each row
    in its own vector lane)."""
    for i in range(shift.shape[0]):
        row = first_row + i
        lse = log_sum_exp[b, row] if row < n_query else -np.inf
        shift[i] = np.inf if lse == -np.inf else lse * log2e
        delta[i] = 0
    for e in range(grad_columns.shape[0]):
        for i in range(delta.shape[0]):
            delta[i] += grad_columns[e, i] * output_columns[e, i]


@cpu_kernel
def _careful_probabilities_and_score_gradients(scores, grad_probabilities, shift, delta, one_key):
    r""":func:`_probabilities_and_score_gradients` for a block that may hold non-finite
    values or rows with one attended key.

    A pair of weight 0 (a score of -inf: masked, above the causal diagonal, a padding
    key; or a row with nothing to attend, ``shift`` +inf, padding rows included) gets
    P = 0 and dS = 0 exactly, whatever NaN or inf its score, :math:`dP` or
    :math:`D_i` holds: 0 * NaN would otherwise carry a NaN stored where nothing
    attends into the gradients. A row with one attended key (``one_key``) has P = 1
    there, and :math:`D_i = \sum_j P_{ij} dP_{ij} = dP_{ij}` taken from that very
    :math:`dP_{ij}`, so that its dS is exactly 0, as the softmax of one score is 1
    whatever the score (:math:`D_i` from the output, :math:`\sum_e dO_{ie} O_{ie}`,
    equals it only up to rounding)."""
    prefer_wide_vectors()
    zero, one = scores.dtype.type(0), scores.dtype.type(1)
    for j in range(scores.shape[0]):
        for i in range(scores.shape[1]):
            score, dp = scores[j, i], grad_probabilities[j, i]
            p = exp2_scalar(score - shift[i])
            p = zero if score == -np.inf or shift[i] == np.inf else p
            p = one if one_key[i] and p > 0 else p
            d = dp if one_key[i] else delta[i]
            scores[j, i] = p
            grad_probabilities[j, i] = zero if p == 0 else p * (dp - d)


@cpu_kernel
def _add_product_skipping_zeros(alpha, weights, rows, out):
    """``out += alpha * weights @ rows`` for ``weights`` ``(n, m)`` (or a transposed
    view) and ``rows`` ``(m, features)``, without reading a row at a zero weight: the
    BLAS product of a block whose ``rows`` hold NaN or inf (0 * NaN is NaN)."""
    for j in range(weights.shape[0]):
        for i in range(weights.shape[1]):
            w = weights[j, i]
            if w != 0:
                w = alpha * w
                for e in range(rows.shape[1]):
                    out[j, e] += w * rows[i, e]


@cpu_kernel
def _rows_are_clean(shift, delta):
    """Whether no row of a query tile has a NaN probability shift or a non-finite
    :math:`D_i` (a row that attended NaN or inf, or a NaN output gradient)."""
    clean = True
    for i in range(shift.shape[0]):
        clean &= shift[i] > -np.inf and np.isfinite(delta[i])
    return clean


@cpu_kernel
def _one_key_flags(one_key_rows, m, first_row, n_query, n_key, is_causal, flags):
    """``flags[i]``: whether row ``first_row + i`` attends exactly one key, as the mask's
    :func:`one_key_rows` says, or, without a mask, as ``n_key`` and the causal
    diagonal do (one key, or the first row of a causal problem). Returns whether any
    row does."""
    any_row = False
    for i in range(flags.shape[0]):
        row = first_row + i
        if row >= n_query:
            flags[i] = False
        elif one_key_rows is None:
            flags[i] = n_key == 1 or (is_causal and row == 0)
        else:
            flags[i] = one_key_rows[m, row]
        any_row |= flags[i]
    return any_row


@cpu_kernel
def _count_open_keys(mask_row, stop):
    """How many of the first ``stop`` keys an additive mask row leaves open (not
    -inf), counted 16 at a time (a loop that vectorises) until there are two."""
    prefer_wide_vectors()
    forbidden = mask_row.dtype.type(-np.inf)
    count = 0
    for start in range(0, stop, 16):
        segment = mask_row[start : min(start + 16, stop)]
        for j in range(segment.shape[0]):
            count += segment[j] != forbidden
        if count >= 2:
            break
    return count


@cpu_kernel
def _one_key_rows_kernel(mask, is_causal, n_query, n_key, out):
    """``out[m, i]``: whether row i of mask ``m`` (additive, ``(n_masks, L or 1, S or
    1)``) leaves exactly one key open, before the causal diagonal when ``is_causal``.
    Each row is read up to its second open key, which most rows have among their
    first few: on the calling thread (waking the thread pool would cost more)."""
    n_masks, mask_rows, mask_keys = mask.shape
    forbidden = mask.dtype.type(-np.inf)
    for task in range(n_masks * mask_rows):
        m, r = task // mask_rows, task % mask_rows
        # The rows this mask row serves: all of them when it is broadcast.
        lo, hi = (0, n_query) if mask_rows == 1 else (r, r + 1)
        if mask_keys == 1 or mask_rows == 1:
            # The first two open keys, once for every row served.
            first, second = -1, -1
            for j in range(n_key if mask_keys > 1 else min(n_key, 2)):
                if mask[m, r, j if mask_keys > 1 else 0] != forbidden:
                    if first < 0:
                        first = j
                    else:
                        second = j
                        break
            for i in range(lo, hi):
                visible = min(i + 1, n_key) if is_causal else n_key
                out[m, i] = 0 <= first < visible and not 0 <= second < visible
        else:
            visible = min(r + 1, n_key) if is_causal else n_key
            out[m, r] = _count_open_keys(mask[m, r], visible) == 1


def one_key_rows(mask, is_causal, n_query, n_key):
    """For an additive mask ``(n_masks, L or 1, S or 1)`` as :func:`mask_operand`
    gives it: ``(n_masks, L)`` booleans, whether each row attends exactly one key
    (whose softmax is 1 whatever its score, and whose score gradients are 0); None
    without a mask."""
    if mask is None:
        return None
    out = np.empty((mask.shape[0], n_query), dtype=np.bool_)
    _one_key_rows_kernel(mask, is_causal, n_query, n_key, out)
    return out


def _tile_is_finite(tile):
    """:func:`_is_finite_tile` of a float tile, or of the bfloat16 numbers of a tile
    of words."""


@overload(_tile_is_finite)
def _tile_is_finite_overload(tile):
    if tile.dtype == types.uint32:
        return lambda tile: words_are_finite(tile)
    return lambda tile: _is_finite_tile(tile)


def _operand_rows(query_tiles, key_tiles, grad_tiles, row_pairs):
    """The rows the backward's products into dK, dQ and dV read: the float tiles
    themselves, or the packed pairs of ``row_pairs`` (see :func:`_backward_kernel`)."""


@overload(_operand_rows)
def _operand_rows_overload(query_tiles, key_tiles, grad_tiles, row_pairs):
    if isinstance(row_pairs, types.NoneType):
        return lambda query_tiles, key_tiles, grad_tiles, row_pairs: (
            query_tiles,
            key_tiles,
            grad_tiles,
        )
    return lambda query_tiles, key_tiles, grad_tiles, row_pairs: (
        row_pairs[0],
        row_pairs[1],
        row_pairs[2],
    )


def _backward_scratch(value_tiles, key_tile, query_tile, n_values):
    """A backward task's scratch for products by ``vdpbf16ps`` (bfloat16 words): the
    weights rounded to words along their rows ``(key_tile, query_tile / 2)`` and in
    packed pairs of rows ``(key_tile / 2, query_tile)``, and a query tile's output
    gradient in float32 columns ``(n_values, query_tile)``; Nones for floats."""


@overload(_backward_scratch)
def _backward_scratch_overload(value_tiles, key_tile, query_tile, n_values):
    if value_tiles.dtype == types.uint32:

        def words(value_tiles, key_tile, query_tile, n_values):
            return (
                np.empty((key_tile, query_tile // 2), dtype=np.uint32),
                np.empty((key_tile // 2, query_tile), dtype=np.uint32),
                np.empty((n_values, query_tile), dtype=np.float32),
            )

        return words
    return lambda value_tiles, key_tile, query_tile, n_values: (None, None, None)


def _float_grad_columns(grad_columns, row_pairs, b, tile, scratch):
    """The output gradient of query tile ``tile`` in float columns, for :math:`D_i`:
    the product's operand itself for float operands, else the float32 tile of
    ``row_pairs`` transposed into ``scratch``."""


@overload(_float_grad_columns)
def _float_grad_columns_overload(grad_columns, row_pairs, b, tile, scratch):
    if isinstance(row_pairs, types.NoneType):
        return lambda grad_columns, row_pairs, b, tile, scratch: grad_columns

    def transposed(grad_columns, row_pairs, b, tile, scratch):
        transpose_into(row_pairs[3][b, tile], scratch)
        return scratch

    return transposed


def _add_weights_times_rows(alpha, weights, rows, finite, scratch, out):
    """``out += alpha * weights @ rows`` for float weights ``(n, m)``: by BLAS, or, when
    ``rows`` is not ``finite``, without reading rows at zero weights. For ``rows`` in
    packed bfloat16 pairs, words ``(m / 2, E)``, the weights are rounded to words in
    ``scratch`` and multiplied by ``vdpbf16ps``; such rows are finite
    (:func:`attention_grad` widens operands that are not)."""


@overload(_add_weights_times_rows)
def _add_weights_times_rows_overload(alpha, weights, rows, finite, scratch, out):
    if rows.dtype == types.uint32:

        def by_pairs(alpha, weights, rows, finite, scratch, out):
            round_column_pairs(weights, scratch)
            pair_gemm(alpha, scratch, rows, True, out)

        return by_pairs

    def by_blas(alpha, weights, rows, finite, scratch, out):
        if finite:
            gemm(alpha, weights, rows, 1.0, out)
        else:
            _add_product_skipping_zeros(alpha, weights, rows, out)

    return by_blas


def _add_transposed_weights_times_rows(alpha, weights, rows, finite, scratch, out):
    """``out += alpha * weights.T @ rows`` for float weights ``(n, m)`` and rows ``(n,
    E)``, as :func:`_add_weights_times_rows` does it. For bfloat16 words the product
    is computed transposed, so that no operand is transposed per block: ``rows``
    holds the rows' transpose ``R`` ``(E, n)`` as words ``(E, n / 2)``, ``out`` is
    ``(E, m)`` and gets ``alpha * R @ weights``, the weights rounded to packed pairs
    in ``scratch`` (the caller transposes ``out`` once, at the end)."""


@overload(_add_transposed_weights_times_rows)
def _add_transposed_weights_times_rows_overload(alpha, weights, rows, finite, scratch, out):
    if rows.dtype == types.uint32:

        def by_pairs(alpha, weights, rows, finite, scratch, out):
            round_row_pairs(weights, scratch)
            pair_gemm(alpha, rows, scratch, True, out)

        return by_pairs

    def by_blas(alpha, weights, rows, finite, scratch, out):
        if finite:
            gemm(alpha, weights, rows, 1.0, out, True)
        else:
            _add_product_skipping_zeros(alpha, weights.T, rows, out)

    return by_blas


@cpu_kernel(parallel=True)
def _backward_kernel(
    query_tiles, key_tiles, value_tiles, grad_tiles, output_tiles, log_sum_exp,
    mask, mask_transposed, tile_kinds, one_key_rows, index, is_causal, n_query, n_key, scale,
    log2e, grad_query_parts, grad_key, grad_value, row_pairs,
):  # fmt: skip
    """One task per (batch entry, part of its key sweeps); part ``c`` of
    ``n_parts = grad_query_parts.shape[0]`` takes sweeps ``c, c + n_parts, ...``
    (taken in turn, so causal parts get equal work), writes the dK and dV of
    its keys, and adds its share of dQ into ``grad_query_parts[c]``; the parts
    are then summed in a fixed order into ``grad_query_parts[0]``.

    The kernel applies ``scale`` (in base 2 for the scores) inside the tile
    products. Each task derives its rows' probability shifts and the
    :math:`D_i` of the score gradients from the forward's output and log-sum-exp
    (``log2e`` is log2(e) in the operands' dtype), rather than the caller in passes
    of its own.

    Pairs of weight 0 are never read, as in the forward. The tile products run by
    BLAS, which multiplies zeros too (0 * NaN is NaN), as long as a block's operand
    tiles, :math:`D_i` and shifts are finite, which each task checks once per tile
    (a pass over its operands, against the products' passes over their blocks). A
    block with a non-finite one takes
    :func:`_careful_probabilities_and_score_gradients`, which sets P and dS to exactly
    0 at weight 0, and multiplies each non-finite operand tile without reading it at
    zero weights (:func:`_add_product_skipping_zeros`). So do the blocks of rows with
    one attended key (``one_key_rows``, from the mask, or None: one key, or the first
    row of a causal problem), whose dS is exactly 0.

    ``row_pairs`` is None for float operands. For products by ``vdpbf16ps`` the
    operands are bfloat16 words (queries, keys, values and the output gradient
    ``(batch, tiles, rows, features / 2)``), and ``row_pairs`` holds the queries'
    and output gradient's rows in packed pairs per tile ``(batch, tiles, rows / 2,
    features)``, the keys transposed in words per tile ``(batch, tiles, E, key_tile
    / 2)`` and the output gradient's float32 tiles (for :math:`D_i`), as
    :func:`attention_grad` lays them out; dQ is then accumulated transposed,
    ``(E, query_tile)`` per tile. The weights P and dS are rounded to bfloat16
    before their products, as PyTorch's CPU flash attention rounds them.
    """
    n_batch, n_query_tiles, query_tile = (
        grad_tiles.shape[0],
        grad_tiles.shape[1],
        grad_tiles.shape[2],
    )
    n_key_tiles, key_tile = key_tiles.shape[1], key_tiles.shape[2]
    n_values = grad_value.shape[3]
    dtype = grad_key.dtype
    score_scale = scale * LOG2E
    n_parts = grad_query_parts.shape[0]
    n_sweeps = -(-n_key_tiles // KEY_TILES_PER_SWEEP)
    for task in numba.prange(n_batch * n_parts):
        prefer_wide_vectors()
        b, part = task // n_parts, task % n_parts
        grad_query = grad_query_parts[part]
        q, k, v, m = index[b, 0], index[b, 1], index[b, 2], index[b, 3]
        probabilities = np.empty((key_tile, query_tile), dtype=dtype)
        grad_scores = np.empty((key_tile, query_tile), dtype=dtype)
        query_columns = np.empty(
            (n_query_tiles, query_tiles.shape[3], query_tile), dtype=query_tiles.dtype
        )
        grad_columns = np.empty(
            (n_query_tiles, grad_tiles.shape[3], query_tile), dtype=grad_tiles.dtype
        )
        weight_rows, weight_pairs, float_grads = _backward_scratch(
            value_tiles, key_tile, query_tile, n_values
        )
        query_rows, key_rows, grad_rows = _operand_rows(
            query_tiles, key_tiles, grad_tiles, row_pairs
        )
        output_columns = np.empty((n_values, query_tile), dtype=dtype)
        shift = np.empty((n_query_tiles, query_tile), dtype=dtype)
        delta = np.empty((n_query_tiles, query_tile), dtype=dtype)
        one_key = np.empty((n_query_tiles, query_tile), dtype=np.bool_)
        # Per query tile: whether its query rows, its output gradient rows, and its rows'
        # D_i and shifts are finite, and whether a row attends one key.
        query_finite = np.empty(n_query_tiles, dtype=np.bool_)
        grad_finite = np.empty(n_query_tiles, dtype=np.bool_)
        rows_clean = np.empty(n_query_tiles, dtype=np.bool_)
        has_one_key = np.empty(n_query_tiles, dtype=np.bool_)
        key_finite = np.empty(KEY_TILES_PER_SWEEP, dtype=np.bool_)
        value_finite = np.empty(KEY_TILES_PER_SWEEP, dtype=np.bool_)
        queries, grads = query_tiles[q], grad_tiles[b]
        for tile in range(n_query_tiles):
            transpose_into(queries[tile], query_columns[tile])
            transpose_into(grads[tile], grad_columns[tile])
            transpose_into(output_tiles[b, tile], output_columns)
            _shift_and_delta(
                log_sum_exp, b, tile * query_tile, n_query, log2e,
                _float_grad_columns(grad_columns[tile], row_pairs, b, tile, float_grads),
                output_columns, shift[tile], delta[tile],
            )  # fmt: skip
            query_finite[tile] = _tile_is_finite(query_columns[tile])
            grad_finite[tile] = _tile_is_finite(grad_columns[tile])
            rows_clean[tile] = (
                query_finite[tile]
                and grad_finite[tile]
                and _rows_are_clean(shift[tile], delta[tile])
            )
            has_one_key[tile] = _one_key_flags(
                one_key_rows, m, tile * query_tile, n_query, n_key, is_causal, one_key[tile]
            )
        grad_query[b] = 0
        for sweep in range(part, n_sweeps, n_parts):
            sweep_start = sweep * KEY_TILES_PER_SWEEP
            sweep_end = min(sweep_start + KEY_TILES_PER_SWEEP, n_key_tiles)
            keys, values = (
                key_tiles[k, sweep_start:sweep_end],
                value_tiles[v, sweep_start:sweep_end],
            )
            for t in range(sweep_start, sweep_end):
                grad_key[b, t] = 0
                grad_value[b, t] = 0
                key_finite[t - sweep_start] = _tile_is_finite(keys[t - sweep_start])
                value_finite[t - sweep_start] = _tile_is_finite(values[t - sweep_start])
            for tile in range(n_query_tiles):
                last_row = (tile + 1) * query_tile - 1
                for t in range(sweep_start, sweep_end):
                    if is_causal and last_row < t * key_tile:
                        continue  # the whole tile lies above the diagonal
                    kind = _block_kind(tile_kinds, m, t, tile)
                    if kind == MASKED:
                        continue
                    first_row = tile * query_tile
                    # grad_scores is free until the product below overwrites it.
                    in_sweep = t - sweep_start
                    _score_tile(
                        probabilities, keys[in_sweep], query_columns[tile], score_scale,
                        mask, mask_transposed, m, kind, is_causal, t * key_tile, first_row,
                        n_key, n_query, grad_scores,
                    )  # fmt: skip
                    _tile_product(1.0, values[in_sweep], grad_columns[tile], grad_scores)
                    clean = rows_clean[tile] and key_finite[in_sweep] and value_finite[in_sweep]
                    if clean and not has_one_key[tile]:
                        _probabilities_and_score_gradients(
                            probabilities, grad_scores, shift[tile], delta[tile]
                        )
                    else:
                        _careful_probabilities_and_score_gradients(
                            probabilities, grad_scores, shift[tile], delta[tile], one_key[tile]
                        )
                    # The products add straight into the gradients.
                    _add_weights_times_rows(
                        1.0, probabilities, grad_rows[b, tile], grad_finite[tile], weight_rows,
                        grad_value[b, t],
                    )  # fmt: skip
                    _add_weights_times_rows(
                        scale, grad_scores, query_rows[q, tile], query_finite[tile], weight_rows,
                        grad_key[b, t],
                    )  # fmt: skip
                    _add_transposed_weights_times_rows(
                        scale, grad_scores, key_rows[k, t], key_finite[in_sweep], weight_pairs,
                        grad_query[b, tile],
                    )  # fmt: skip
    for task in numba.prange(n_batch * n_query_tiles):
        b, tile = task // n_query_tiles, task % n_query_tiles
        total = grad_query_parts[0, b, tile]
        for part in range(1, n_parts):
            _add_into(total, grad_query_parts[part, b, tile])


@cpu_kernel
def _add_into(total, term):
    """``total += term`` for 2-D tiles."""
    prefer_wide_vectors()
    for i in range(total.shape[0]):
        for e in range(total.shape[1]):
            total[i, e] += term[i, e]


def backward_parts(n_batch, n_key_tiles):
    """How many parts the backward splits each batch entry's keys into: enough
    for every thread to have a task when there are fewer batch entries than
    threads, and one (no partial dQ to add up) otherwise."""
    if n_batch >= numba.config.NUMBA_NUM_THREADS:
        # As many entries as threads can ever run: one part, whatever the thread count
        # now. numba.get_num_threads() takes a process lock, which a drop-in's backward
        # inside a training step can wait on (docs/benchmarks.rst).
        return 1
    n_sweeps = -(-n_key_tiles // KEY_TILES_PER_SWEEP)
    return max(1, min(n_sweeps, -(-numba.get_num_threads() // max(n_batch, 1))))


def _row_tiles(array, tile):
    """Zero-pad the rows of ``(batch, rows, features)`` to whole tiles:
    ``(batch, n_tiles, tile, features)``; a view, without copying, when the rows
    already fill whole tiles and BLAS can read them where they are (the kernels only
    read these)."""
    batch, rows, features = array.shape
    n_tiles = max(math.ceil(rows / tile), 1)
    if rows == n_tiles * tile:
        if not _blas_readable_rows(array):
            array = np.ascontiguousarray(array)
        return array.reshape(batch, n_tiles, tile, features)
    padded = np.zeros((batch, n_tiles * tile, features), dtype=array.dtype)
    padded[:, :rows] = array
    return padded.reshape(batch, n_tiles, tile, features)


def _blas_readable_rows(array):
    """Whether BLAS can read the rows of ``(batch, rows, features)`` in place, through
    a leading dimension: aligned, features adjacent, each row at least a row's length
    after the one before, no negative strides."""
    batch_stride, row_stride, feature_stride = array.strides
    itemsize = array.itemsize
    return (
        array.flags.aligned
        and (feature_stride == itemsize or array.shape[2] == 1)
        and row_stride >= array.shape[2] * itemsize
        and row_stride % itemsize == 0
        and batch_stride >= 0
    )


def _heads_interleaved(query, n_batch):
    """Whether the rows of the query ``(batch, rows, features)`` interleave its
    ``n_batch`` entries: a ``(L, heads, E)`` view, whose entries lie closer together
    than its rows."""
    return query.shape[0] == n_batch > 1 and 0 <= query.strides[0] < query.strides[1]


def _output_tiles(interleaved, shape, dtype):
    """The forward's output, ``shape = (n_batch, n_query_tiles, query_tile, value_dim)``.

    When the query's heads are interleaved in its rows (:func:`_heads_interleaved`),
    the output is laid out the same way, ``(rows, batch, value_dim)`` in memory: the
    block that called attention transposes it back to ``(L, heads * Ev)``, which then
    needs no copy. PyTorch's CPU flash attention returns the same layout.
    """
    if not interleaved:
        return np.empty(shape, dtype=dtype)
    n_batch, n_query_tiles, query_tile, value_dim = shape
    memory = np.empty((n_query_tiles, query_tile, n_batch, value_dim), dtype=dtype)
    return memory.transpose(2, 0, 1, 3)


def _feature_pairs(array):
    """The bfloat16 ``(batch, rows, E)`` as words ``(batch, rows, ceil(E / 2))``, two
    features each (an odd E padded with a 0): a view where the rows allow one."""
    bits = array.view(np.uint16) if array.strides[2] == array.itemsize else None
    if bits is not None and array.shape[2] % 2 == 0 and _word_aligned(bits):
        return bits.view(np.uint32)
    batch, rows, features = array.shape
    padded = np.zeros((batch, rows, features + features % 2), dtype=np.uint16)
    padded[:, :, :features] = array.view(np.uint16) if bits is not None else _bits(array)
    return padded.view(np.uint32)


def _word_aligned(bits):
    return bits.ctypes.data % 4 == 0 and all(stride % 4 == 0 for stride in bits.strides[:2])


def _bits(array):
    return np.ascontiguousarray(array).view(np.uint16)


def _transposed_pairs(rows, key_tile):
    """The bfloat16 rows of values or keys ``(batch, S, C)``, transposed and packed per
    key tile as ``a`` operands of products over the keys (``V^T P`` in the forward,
    ``K^T dS^T`` in the backward): ``(batch, tiles, C, key_tile / 2)`` words (see
    :func:`tfmath.kernels.cpu.bfloat16_dot.pack_transposed_tiles`)."""
    batch, n_key, n_columns = rows.shape
    n_tiles = max(math.ceil(n_key / key_tile), 1)
    out = np.empty((batch, n_tiles, n_columns, key_tile // 2), dtype=np.uint32)
    bits = rows.view(np.uint16) if rows.strides[2] == rows.itemsize else _bits(rows)
    sized(pack_transposed_tiles, rows.size)(bits, key_tile, out)
    return out


def flash_forward(problem):
    """Tiled forward pass: returns ``(output, log_sum_exp)`` of shapes
    ``(n_batch, L, Ev)`` and ``(n_batch, L)`` (``-inf`` for rows with nothing to attend).

    bfloat16 operands (sent here unwidened where the CPU has ``vdpbf16ps``, see
    :data:`tfmath._dispatch.BFLOAT16_PRODUCTS`) are multiplied as they are, two
    features a word, and give float32 results; query tiles are then a multiple of
    16 rows, the width of the instruction's sums."""
    query, key, value, mask, index = problem.kernel_operands(strided_rows=True)
    key_tile, query_tile = tile_sizes(problem)
    if problem.dtype.name == "bfloat16":
        dtype = np.dtype(np.float32)
        query_tile = -(-query_tile // LANES) * LANES
        query_tiles = _row_tiles(_feature_pairs(query), query_tile)
        key_tiles = _row_tiles(_feature_pairs(key), key_tile)
        value_tiles = _transposed_pairs(value, key_tile)
    else:
        dtype = problem.dtype
        query_tiles = _row_tiles(query, query_tile)
        key_tiles = _row_tiles(key, key_tile)
        value_tiles = _row_tiles(value, key_tile)
    n_batch, n_query_tiles = index.shape[0], query_tiles.shape[1]
    out = _output_tiles(
        _heads_interleaved(query, n_batch),
        (n_batch, n_query_tiles, query_tile, problem.value_dim),
        dtype,
    )
    log_sum_exp = np.empty((n_batch, n_query_tiles, query_tile), dtype=dtype)
    mask, tile_kinds = mask_operand(mask, dtype, key_tile, query_tile)
    mask, mask_transposed = kernel_mask(mask, n_batch)
    with serial_blas():
        _forward_kernel(
            query_tiles, key_tiles, value_tiles, mask, mask_transposed, tile_kinds, index,
            problem.is_causal, problem.n_query, problem.n_key, problem.scale, out, log_sum_exp,
        )  # fmt: skip
    n_query = problem.n_query
    padded_rows = n_query_tiles * query_tile
    output = out.reshape(n_batch, padded_rows, problem.value_dim)[:, :n_query]
    return output, log_sum_exp.reshape(n_batch, padded_rows)[:, :n_query]


#: Below this many score-feature products (batch * L * S * (E + Ev)), the forward
#: runs on the calling thread, a row at a time: starting the thread pool and
#: laying out tiles costs more than the tiled kernel saves (crossover measured
#: with tfmath bench attention --small).
SERIAL_WORK = 2**17


@cpu_kernel
def _rows_forward(query, key, value, mask, index, is_causal, scale):
    """Each row's scores, softmax and weighted sum in turn, on the calling thread:
    ``(output, log_sum_exp)``. ``mask`` is additive, ``(mask_batch, L or 1, S or 1)``,
    or None. The results are allocated here: on problems this small, every array
    passed in costs the dispatcher a type check worth a tenth of the call."""
    n_batch, n_query, n_key = index.shape[0], query.shape[1], key.shape[1]
    out = np.empty((n_batch, n_query, value.shape[2]), dtype=query.dtype)
    log_sum_exp = np.empty((n_batch, n_query), dtype=query.dtype)
    scores = np.empty(n_key, dtype=out.dtype)
    for b in range(n_batch):
        q, k, v, m = index[b, 0], index[b, 1], index[b, 2], index[b, 3]
        for i in range(n_query):
            n_visible = min(i + 1, n_key) if is_causal else n_key
            if mask is None:
                _scores_row(query[q, i], key[k], scores, False, scale, n_visible, scores)
            else:
                mask_row = mask[m, i if mask.shape[1] > 1 else 0]
                _scores_row(query[q, i], key[k], mask_row, True, scale, n_visible, scores)
            log_sum_exp[b, i] = _softmax_inplace(scores[:n_visible])
            _weighted_sum(scores, value[v], n_visible, out[b, i])
    return out, log_sum_exp


def _small_forward(problem):
    """The forward of a problem below ``SERIAL_WORK``: ``(output, log_sum_exp)`` flat."""
    query, key, value, mask, index = problem.kernel_operands()
    dtype = problem.dtype
    if mask is not None:
        mask = np.where(mask, 0, -np.inf) if mask.dtype == np.bool_ else mask
        mask = mask.astype(dtype, copy=False)
    # The scale as a Python float: building a NumPy scalar costs more than the kernel
    # saves by multiplying in the input's precision on problems this small.
    return _rows_forward(query, key, value, mask, index, problem.is_causal, problem.scale)


def _is_small(problem):
    work = problem.n_query * problem.n_key * (problem.n_features + problem.value_dim)
    return work * math.prod(problem.batch_shape) < SERIAL_WORK


def flash_attention(problem):
    """The flash forward: the output, ``batch_shape + (L, Ev)``, and the log-sum-exp of
    each row, ``batch_shape + (L,)``. bfloat16 operands (see :func:`flash_forward`)
    below ``SERIAL_WORK`` are widened for the one-thread row forward."""
    if not _is_small(problem):
        output, log_sum_exp = flash_forward(problem)
    else:
        if is_half(problem.dtype):
            problem = problem.widened(widen)
        output, log_sum_exp = _small_forward(problem)
    return (
        output.reshape(problem.output_shape()),
        log_sum_exp.reshape((*problem.batch_shape, problem.n_query)),
    )


def attention_grad(problem, grad_output, saved=None):
    """Gradients ``(dq, dk, dv)`` for every broadcast batch entry:
    shapes ``batch_shape + (rows, features)``.

    ``saved``, the forward's ``(output, log_sum_exp)``, spares a forward pass.

    bfloat16 operands (sent here unwidened where the CPU has ``vdpbf16ps``, see
    :func:`flash_forward`) are multiplied as they are, with the weights P and dS
    rounded to bfloat16 before their products, when E and Ev are whole vectors (16
    features at a time) and every operand is finite; otherwise they are widened
    here, as the dispatch widens them elsewhere. Their gradients come back in
    float32.
    """
    if problem.dtype.name == "bfloat16" and not _bfloat16_backward_applies(
        problem, grad_output, saved
    ):
        problem, grad_output, saved = _widened_gradient_call(problem, grad_output, saved)
    query, key, value, mask, index = problem.kernel_operands(strided_rows=True)
    bfloat16 = problem.dtype.name == "bfloat16"
    dtype = np.dtype(np.float32) if bfloat16 else problem.dtype
    n_batch = index.shape[0]
    if saved is None:
        output, log_sum_exp = flash_forward(problem)
    else:
        output = saved[0].reshape(n_batch, problem.n_query, problem.value_dim)
        log_sum_exp = saved[1].reshape(n_batch, problem.n_query)
    key_tile, query_tile = tile_sizes(problem)
    grad_rows = np.asarray(grad_output, dtype=problem.dtype).reshape(output.shape)
    if bfloat16:
        query_tile = -(-query_tile // LANES) * LANES
        if is_half(output.dtype):
            output = widen(output)
        query_tiles = _row_tiles(_feature_pairs(query), query_tile)
        key_tiles = _row_tiles(_feature_pairs(key), key_tile)
        value_tiles = _row_tiles(_feature_pairs(value), key_tile)
        grad_tiles = _row_tiles(_feature_pairs(grad_rows), query_tile)
        row_pairs = (
            _packed_row_pairs(query, query_tile),
            _transposed_pairs(key, key_tile),
            _packed_row_pairs(grad_rows, query_tile),
            _row_tiles(widen(grad_rows), query_tile),
        )
    else:
        # Read in place where BLAS can (_row_tiles), as a model's transposed gradient is.
        query_tiles = _row_tiles(query, query_tile)
        key_tiles = _row_tiles(key, key_tile)
        value_tiles = _row_tiles(value, key_tile)
        grad_tiles = _row_tiles(grad_rows, query_tile)
        row_pairs = None
    n_query_tiles, n_key_tiles = query_tiles.shape[1], key_tiles.shape[1]
    n_parts = backward_parts(n_batch, n_key_tiles)
    # dQ's tiles are (E, query_tile) for bfloat16 words: see _backward_kernel.
    dq_tile = (problem.n_features, query_tile) if bfloat16 else (query_tile, problem.n_features)
    grad_query_parts = np.empty((n_parts, n_batch, n_query_tiles, *dq_tile), dtype=dtype)
    grad_key = np.empty((n_batch, n_key_tiles, key_tile, problem.n_features), dtype=dtype)
    grad_value = np.empty((n_batch, n_key_tiles, key_tile, problem.value_dim), dtype=dtype)
    mask, tile_kinds = mask_operand(mask, dtype, key_tile, query_tile)
    # Rows with one attended key are found in the mask as given.
    one_key = one_key_rows(mask, problem.is_causal, problem.n_query, problem.n_key)
    mask, mask_transposed = kernel_mask(mask, n_batch)
    with serial_blas():
        _backward_kernel(
            query_tiles, key_tiles, value_tiles, grad_tiles, _row_tiles(output, query_tile),
            log_sum_exp, mask, mask_transposed, tile_kinds, one_key, index, problem.is_causal,
            problem.n_query, problem.n_key, problem.scale, dtype.type(LOG2E),
            grad_query_parts, grad_key, grad_value, row_pairs,
        )  # fmt: skip
    grad_query = grad_query_parts[0].swapaxes(2, 3) if bfloat16 else grad_query_parts[0]
    return (
        _untile(grad_query, problem.batch_shape, problem.n_query),
        _untile(grad_key, problem.batch_shape, problem.n_key),
        _untile(grad_value, problem.batch_shape, problem.n_key),
    )


def _bfloat16_backward_applies(problem, grad_output, saved):
    """Whether :func:`attention_grad` multiplies a bfloat16 problem as it is: heads of
    whole vectors, a bfloat16 output gradient, and every operand (and the saved
    output) finite: the bfloat16 products multiply every pair, weights of 0
    included."""
    if problem.n_features % LANES or problem.value_dim % LANES:
        return False
    if getattr(grad_output, "dtype", None) != problem.dtype:
        return False
    operands = [problem.query, problem.key, problem.value, grad_output]
    if saved is not None:
        operands.append(saved[0])
    return all(_all_finite(array) for array in operands)


def _all_finite(array):
    if array.dtype.name != "bfloat16":
        return bool(np.isfinite(array).all())
    exponent = np.asarray(array).view(np.uint16) & np.uint16(0x7F80)
    return not (exponent == np.uint16(0x7F80)).any()


def _widened_gradient_call(problem, grad_output, saved):
    """``(problem, grad_output, saved)`` with every half-precision array widened to
    float32, as :func:`tfmath._dispatch.run` widens them for other routines."""
    grad_output = np.asarray(grad_output)
    if is_half(grad_output.dtype):
        grad_output = widen(grad_output)
    if saved is not None:
        output, log_sum_exp = saved
        saved = (widen(output) if is_half(output.dtype) else output, log_sum_exp)
    return problem.widened(widen), grad_output, saved


def _packed_row_pairs(array, tile):
    """The bfloat16 rows ``(batch, rows, C)`` in packed pairs per tile of ``tile``
    rows, ``(batch, tiles, tile / 2, C)`` words: the ``b`` operands of the backward's
    products over rows (see :func:`tfmath.kernels.cpu.bfloat16_dot.pack_row_pairs`)."""
    batch, rows, columns = array.shape
    n_tiles = max(math.ceil(rows / tile), 1)
    out = np.empty((batch, n_tiles, tile // 2, columns), dtype=np.uint32)
    bits = array.view(np.uint16) if array.strides[2] == array.itemsize else _bits(array)
    sized(pack_tiles_in_row_pairs, array.size)(bits, tile, out)
    return out


class PlainFlash:
    """The flash forward and backward of plain calls of one layout, without the
    general path's per-call work.

    A plain call (see :func:`tfmath._contract.attention.plain_attention_problem`)
    whose rows fill whole tiles and whose operands the kernels can read in place (a
    drop-in's every call: the heads of a ``(B, L, heads, E)`` projection) differs
    from the next call of its layout (shapes, strides, dtype, causality, scale) only
    in its numbers. Everything else, from the tiles to the batch index, is worked
    out once, by :meth:`of`; :meth:`forward` and :meth:`backward` then reshape,
    allocate and run the kernels. Inside a model's training step, where the step's
    other work has evicted this Python code from the caches, each line saved is
    worth microseconds.
    """

    __slots__ = (
        "_dtype",
        "_grad_rows",
        "_gradient_shapes",
        "_index",
        "_interleaved",
        "_is_causal",
        "_key_tiles",
        "_log2e",
        "_n_key",
        "_n_query",
        "_output_shape",
        "_output_tiles",
        "_query_tiles",
        "_scale",
        "_value_tiles",
    )  # fmt: skip

    @classmethod
    def of(cls, problem):
        """The plan of a plain problem's layout, or None when the general path must
        serve it: a problem small enough for the one-thread forward, rows that need
        padding to whole tiles, or operands the kernels cannot read in place."""
        if _is_small(problem):
            return None
        key_tile, query_tile = tile_sizes(problem)
        n_query, n_key = problem.n_query, problem.n_key
        if n_query % query_tile or n_key % key_tile:
            return None
        query, key, value, _, index = problem.kernel_operands(strided_rows=True)
        if not all(map(_blas_readable_rows, (query, key, value))):
            return None
        plan = cls()
        n_batch, value_dim = index.shape[0], problem.value_dim
        plan._query_tiles = (n_batch, n_query // query_tile, query_tile, problem.n_features)
        plan._key_tiles = (n_batch, n_key // key_tile, key_tile, problem.n_features)
        plan._value_tiles = (n_batch, n_key // key_tile, key_tile, value_dim)
        plan._output_tiles = (n_batch, n_query // query_tile, query_tile, value_dim)
        plan._interleaved = _heads_interleaved(query, n_batch)
        plan._output_shape = problem.output_shape()
        plan._grad_rows = (n_batch, n_query, value_dim)
        plan._gradient_shapes = tuple(a.shape for a in (problem.query, problem.key, problem.value))
        plan._index = index
        plan._is_causal, plan._n_query, plan._n_key = problem.is_causal, n_query, n_key
        plan._scale, plan._dtype = problem.scale, problem.dtype
        plan._log2e = problem.dtype.type(LOG2E)
        return plan

    def forward(self, query, key, value):
        """``(output, saved)``: the output, ``batch + (L, Ev)`` (laid out as the
        query's rows are, see :func:`_output_tiles`), and what :meth:`backward`
        takes."""
        query_tiles = query.reshape(self._query_tiles)
        key_tiles = key.reshape(self._key_tiles)
        value_tiles = value.reshape(self._value_tiles)
        n_batch, n_query_tiles, query_tile, _ = self._output_tiles
        out = _output_tiles(self._interleaved, self._output_tiles, self._dtype)
        log_sum_exp = np.empty((n_batch, self._n_query), self._dtype)
        with serial_blas():
            _forward_kernel(
                query_tiles, key_tiles, value_tiles, None, False, None, self._index,
                self._is_causal, self._n_query, self._n_key, self._scale, out,
                log_sum_exp.reshape(n_batch, n_query_tiles, query_tile),
            )  # fmt: skip
        saved = (query_tiles, key_tiles, value_tiles, out, log_sum_exp)
        return out.reshape(self._output_shape), saved

    def backward(self, saved, grad_output):
        """``(dq, dk, dv)``, shaped as the operands, from :meth:`forward`'s ``saved``
        and the output's gradient (any strides)."""
        query_tiles, key_tiles, value_tiles, out, log_sum_exp = saved
        grad_rows = np.asarray(grad_output, dtype=self._dtype).reshape(self._grad_rows)
        if not _blas_readable_rows(grad_rows):
            grad_rows = np.ascontiguousarray(grad_rows)
        n_batch, n_key_tiles = key_tiles.shape[0], key_tiles.shape[1]
        n_parts = backward_parts(n_batch, n_key_tiles)
        grad_query_parts = np.empty((n_parts, *query_tiles.shape), self._dtype)
        grad_key = np.empty(key_tiles.shape, self._dtype)
        grad_value = np.empty(value_tiles.shape, self._dtype)
        with serial_blas():
            _backward_kernel(
                query_tiles, key_tiles, value_tiles, grad_rows.reshape(self._output_tiles),
                out, log_sum_exp, None, False, None, None, self._index, self._is_causal,
                self._n_query, self._n_key, self._scale, self._log2e, grad_query_parts, grad_key,
                grad_value, None,
            )  # fmt: skip
        query_shape, key_shape, value_shape = self._gradient_shapes
        return (
            grad_query_parts[0].reshape(query_shape),
            grad_key.reshape(key_shape),
            grad_value.reshape(value_shape),
        )


class PlainSmall:
    """The forward and backward of plain calls of one layout below ``SERIAL_WORK``,
    without the general path's per-call work: :class:`PlainFlash`'s counterpart for
    the one-thread row forward, which small problems (a sweep over d_k, a tiny model's
    heads) call by the thousand. The backward is the general path's, on the problem
    rebuilt around the call's operands.
    """

    __slots__ = ("_index", "_key_rows", "_output_shape", "_problem", "_query_rows",
                 "_value_rows")  # fmt: skip

    @classmethod
    def of(cls, problem):
        """The plan of a plain problem's layout below ``SERIAL_WORK`` whose operands
        are C-contiguous (so that every reshape is a view), or None."""
        if not (
            _is_small(problem)
            and problem.query.flags.c_contiguous
            and problem.key.flags.c_contiguous
            and problem.value.flags.c_contiguous
        ):
            return None
        query, key, value, _, index = problem.kernel_operands()
        plan = cls()
        plan._query_rows, plan._key_rows, plan._value_rows = query.shape, key.shape, value.shape
        plan._index = index
        plan._output_shape = problem.output_shape()
        # The plan outlives the call: it keeps the problem's settings, not its operands.
        plan._problem = problem._replace(query=None, key=None, value=None)
        return plan

    def forward(self, query, key, value):
        """``(output, saved)``: the output, ``batch + (L, Ev)``, and what
        :meth:`backward` takes."""
        problem = self._problem
        output, log_sum_exp = _rows_forward(
            query.reshape(self._query_rows), key.reshape(self._key_rows),
            value.reshape(self._value_rows), None, self._index, problem.is_causal, problem.scale,
        )  # fmt: skip
        return output.reshape(self._output_shape), (query, key, value, output, log_sum_exp)

    def backward(self, saved, grad_output):
        """``(dq, dk, dv)``, shaped as the operands, from :meth:`forward`'s ``saved``
        and the output's gradient."""
        query, key, value, output, log_sum_exp = saved
        problem = self._problem._replace(query=query, key=key, value=value)
        return attention_grad(problem, grad_output, (output, log_sum_exp))


def plain_plan(problem):
    """The plan of a plain problem's layout (:class:`PlainSmall` or
    :class:`PlainFlash`), or None when the general path must serve it. The caller
    keeps plans per layout: :func:`tfmath.attention.scaled_dot_product_attention`
    checks each layout once, and later calls of it go straight to the plan."""
    return PlainSmall.of(problem) or PlainFlash.of(problem)


def _untile(tiles, batch_shape, n_rows):
    """``(n_batch, n_tiles, tile, features)`` back to ``batch_shape + (n_rows, features)``."""
    n_batch, n_tiles, tile, features = tiles.shape
    rows = tiles.reshape(n_batch, n_tiles * tile, features)[:, :n_rows]
    return rows.reshape(*batch_shape, n_rows, features)
