r"""CUDA FlashAttention, tiled as FlashAttention-2: register micro-tiles, shared-memory tiles.

Every kernel here runs blocks of ``TR x TC`` threads over a tile of
``BR = TR * RM`` rows (query rows in the forward and the :math:`dQ` pass,
key rows in the :math:`dK, dV` pass) against tiles of ``BC = TC * CM``
entries of the other sequence, both staged in shared memory. Thread
``(ty, tx)`` owns rows ``ty + i * TR`` (``i < RM``) and, of each tile,
columns ``tx + j * TC`` (``j < CM``): an ``RM x CM`` micro-tile of scores,
computed as a sum of outer products of ``RM`` numbers of one operand by
``CM`` of the other, feature by feature, so each number read from shared
memory feeds several multiply-adds held in registers (the thread's arrays
have compile-time sizes). It also owns features ``tx + f * TC`` of its
rows' outputs: an ``RM x ceil(Ev / TC)`` register tile that the
probabilities, written once to shared memory, update the same way.

Forward (FlashAttention-2, Dao 2023, Algorithm 1): one block per (batch
entry, tile of query rows). Each row's running maximum and normaliser live
in the registers of the ``TC`` threads that share the row; the tile's
maximum is agreed through shared memory, and the normaliser is summed over
those threads once, at the end. Backward (Algorithm 2, split in two kernels
so that no gradient needs atomic additions): a :math:`dQ` pass over query
tiles, which also writes :math:`D_i = dO_i \cdot O_i`, then a :math:`dK, dV`
pass over key tiles; both recompute the probabilities from the saved
log-sum-exp. Every sum runs in a fixed order, so the same input gives the
same bits.

Positions a row may not attend (masked, causal, padding) get probability
exactly 0 and are never read: a tile that holds a non-finite number takes a
slower loop that skips zero weights, so garbage in padding cannot leak into
a result (``0 * nan`` would).
"""

import functools
import math
from typing import NamedTuple

import numpy as np

from tfmath import _cuda, _cuda_switches
from tfmath._contract.attention import CUDA_SHARED_MEMORY_BYTES
from tfmath._contract.checks import is_half
from tfmath.kernels.cuda import half
from tfmath.kernels.cuda.masks import dense_bias

cuda = _cuda.numba_cuda()


class Tiles(NamedTuple):
    """A block's thread grid and each thread's micro-tile (see the module docstring)."""

    row_threads: int  # TR
    col_threads: int  # TC
    rows_per_thread: int  # RM
    cols_per_thread: int  # CM

    @property
    def block_rows(self):
        return self.row_threads * self.rows_per_thread

    @property
    def block_cols(self):
        return self.col_threads * self.cols_per_thread


#: Tile shapes in order of preference; a launch takes the first whose shared memory
#: fits in :data:`CUDA_SHARED_MEMORY_BYTES` and whose block rows do not outnumber the rows
#: to compute. 128 threads of 4 x 4 micro-tiles (64 x 32 tiles) for head sizes up to
#: 64 in float32; smaller micro-tiles, then fewer threads, for wider heads, float64
#: and short sequences (a decoding step's few query rows).
TILE_CHOICES = (
    Tiles(16, 8, 4, 4),
    Tiles(16, 8, 2, 4),
    Tiles(16, 8, 2, 2),
    Tiles(16, 8, 1, 2),
    Tiles(16, 8, 1, 1),
    Tiles(4, 8, 1, 4),
    Tiles(2, 16, 1, 4),
    Tiles(1, 32, 1, 2),
    Tiles(8, 8, 1, 1),
    Tiles(4, 4, 1, 1),
)


def _kernel_jit():
    """``cuda.jit`` for the flash kernels, with ``TFMATH_CUDA_MAX_REGISTERS``'s cap on a
    real GPU (:func:`tfmath._cuda_switches.cuda_max_registers`; the simulator has no registers)."""
    registers = _cuda_switches.cuda_max_registers()
    if registers is None or not _cuda.status().real_gpu:
        return cuda.jit
    return functools.partial(cuda.jit, max_registers=registers)


def _choose_tiles(shared_elements, itemsize, n_rows):
    """The first of :data:`TILE_CHOICES` whose ``shared_elements(tiles)`` numbers fit and
    whose block rows are at most ``n_rows``; else the fitting one with the fewest rows."""
    fitting = [t for t in TILE_CHOICES if shared_elements(t) * itemsize <= CUDA_SHARED_MEMORY_BYTES]
    if not fitting:  # the head limit the contract checks (CUDA_FLASH_MAX_HEAD_DIM) prevents it
        raise ValueError("no tile shape fits in shared memory")
    short_enough = [t for t in fitting if t.block_rows <= n_rows]
    return short_enough[0] if short_enough else min(fitting, key=lambda t: t.block_rows)


def _forward_shared(tiles, n_features, n_values):
    """Shared numbers of the forward: Q, K, V and P tiles, and one number per (row, column
    thread) for agreeing on maxima and summing normalisers. Q and K rows are padded by one
    so that threads reading different rows at one feature hit different banks."""
    br, bc = tiles.block_rows, tiles.block_cols
    stride = n_features + 1
    return br * stride + bc * stride + bc * n_values + br * (bc + 1) + br * tiles.col_threads


@cuda.jit(device=True)
def _stage(tile, stride, source, batch, start, n_rows, width, tid, n_threads):
    """Copy rows ``start .. start + n_rows`` of ``source[batch]`` into the shared ``tile``
    (row ``r`` at ``r * stride``), zeros past the source's end; the block's threads read
    consecutive numbers (coalesced). Returns 1 if this thread copied a non-finite one, else 0
    (an integer, as ``cuda.syncthreads_or`` takes)."""
    n_source = source.shape[1]
    bad = 0
    for flat in range(tid, n_rows * width, n_threads):
        r = flat // width
        e = flat - r * width
        x = source[batch, start + r, e] if start + r < n_source else source.dtype.type(0)
        if not abs(x) < math.inf:
            bad = 1
        tile[r * stride + e] = x
    return bad


@cuda.jit(device=True)
def _masked(x, bias, has_mask, row, col, n_rows, n_cols, is_causal):
    """Score ``x`` of (query ``row``, key ``col``) with its mask applied: ``-inf`` where the
    row may not attend (padding, causal, a ``-inf`` bias), whatever ``x`` is."""
    if row >= n_rows or col >= n_cols or (is_causal and col > row):
        return -math.inf
    if has_mask:
        if bias == -math.inf:
            return -math.inf
        return x + bias
    return x


@functools.cache
def _forward_kernel(numba_dtype, n_features, n_values, tiles):
    """The forward kernel for one dtype, head size and tile shape (compile-time constants,
    so each thread's micro-tiles are fixed-size arrays kept in registers)."""
    TR, TC, RM, CM = tiles
    BR, BC = tiles.block_rows, tiles.block_cols
    E, EV = n_features, n_values
    QS = E + 1  # padded row stride of the Q and K tiles
    PS = BC + 1  # ... and of the P tile
    VP = max(1, -(-EV // TC))  # output features per thread
    Q0, K0 = 0, BR * QS
    V0 = K0 + BC * QS
    P0 = V0 + BC * EV
    R0 = P0 + BR * PS
    NT = TR * TC
    SCORES, OUTPUTS_V = RM * CM, RM * VP  # array sizes must be constants, not expressions

    @_kernel_jit()
    def kernel(query, key, value, mask, index, is_causal, scale, out, log_sum_exp):
        shared = cuda.shared.array(0, dtype=numba_dtype)
        scores = cuda.local.array(SCORES, dtype=numba_dtype)
        acc = cuda.local.array(OUTPUTS_V, dtype=numba_dtype)
        row_max = cuda.local.array(RM, dtype=numba_dtype)
        row_sum = cuda.local.array(RM, dtype=numba_dtype)
        q_reg = cuda.local.array(RM, dtype=numba_dtype)
        k_reg = cuda.local.array(CM, dtype=numba_dtype)
        v_reg = cuda.local.array(VP, dtype=numba_dtype)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        tid = ty * TC + tx
        n_query, n_key = query.shape[1], key.shape[1]
        tiles_per_batch = (n_query + BR - 1) // BR
        b = cuda.blockIdx.x // tiles_per_batch
        first_row = (cuda.blockIdx.x - b * tiles_per_batch) * BR
        q, k, v, m = index[b, 0], index[b, 1], index[b, 2], index[b, 3]
        has_mask = mask.shape[1] != 0
        zero = numba_dtype(0)
        _stage(shared[Q0:], QS, query, q, first_row, BR, E, tid, NT)
        # Causal: no row of this block attends past its last row.
        n_visible = min(first_row + BR, n_key) if is_causal else n_key
        # A value that is not finite, read at a weight that was positive against the
        # running maximum and is 0 against the final one, leaves the accumulator NaN or
        # infinite through the rescaling (inf * 0, or inf * tiny). Rows are then
        # computed again against their final maxima, never reading a value at weight 0,
        # as the reference reads them (and the CPU kernel retries).
        for attempt in range(2):
            retry = attempt == 1
            for i in range(RM):
                if not retry:
                    row_max[i] = -math.inf
                row_sum[i] = 0
                for f in range(VP):
                    acc[i * VP + f] = 0
            for start in range(0, n_visible, BC):
                bad = _stage(shared[K0:], QS, key, k, start, BC, E, tid, NT)
                bad |= _stage(shared[V0:], EV, value, v, start, BC, EV, tid, NT)
                value_has_garbage = cuda.syncthreads_or(bad)
                # S = Q K^T, one outer product per feature.
                for c in range(RM * CM):
                    scores[c] = 0
                for e in range(E):
                    for i in range(RM):
                        q_reg[i] = shared[Q0 + (ty + i * TR) * QS + e]
                    for j in range(CM):
                        k_reg[j] = shared[K0 + (tx + j * TC) * QS + e]
                    for i in range(RM):
                        for j in range(CM):
                            scores[i * CM + j] += q_reg[i] * k_reg[j]
                for i in range(RM):
                    row = first_row + ty + i * TR
                    tile_max = numba_dtype(-math.inf)
                    for j in range(CM):
                        col = start + tx + j * TC
                        bias = zero
                        if has_mask and row < n_query and col < n_key:
                            bias = mask[m, row, col]
                        s = _masked(
                            scale * scores[i * CM + j], bias, has_mask, row, col, n_query, n_key,
                            is_causal,
                        )  # fmt: skip
                        scores[i * CM + j] = s
                        tile_max = max(tile_max, s)
                    shared[R0 + (ty + i * TR) * TC + tx] = tile_max
                cuda.syncthreads()
                # The row's new maximum, agreed by its TC threads; rescale, then P = exp(S - m).
                for i in range(RM):
                    r = ty + i * TR
                    new_max = row_max[i]
                    for t in range(TC):
                        new_max = max(new_max, shared[R0 + r * TC + t])
                    if new_max != -math.inf:
                        rescale = math.exp(row_max[i] - new_max)
                        row_sum[i] *= rescale
                        for f in range(VP):
                            acc[i * VP + f] *= rescale
                    row_max[i] = new_max
                    for j in range(CM):
                        s = scores[i * CM + j]
                        p = zero if s == -math.inf else math.exp(s - new_max)
                        row_sum[i] += p
                        shared[P0 + r * PS + tx + j * TC] = p
                cuda.syncthreads()
                # O += P V, one outer product per key.
                for t in range(BC):
                    for f in range(VP):
                        feature = tx + f * TC
                        v_reg[f] = shared[V0 + t * EV + feature] if feature < EV else zero
                    for i in range(RM):
                        p = shared[P0 + (ty + i * TR) * PS + t]
                        if (value_has_garbage or retry) and p == 0:
                            continue
                        for f in range(VP):
                            acc[i * VP + f] += p * v_reg[f]
                cuda.syncthreads()
            not_finite = 0
            for c in range(RM * VP):
                if not math.isfinite(acc[c]):
                    not_finite = 1
            if retry or not cuda.syncthreads_or(not_finite):
                break
        # Each row's normaliser, summed over its TC threads in a fixed order.
        for i in range(RM):
            shared[R0 + (ty + i * TR) * TC + tx] = row_sum[i]
        cuda.syncthreads()
        for i in range(RM):
            r = ty + i * TR
            row = first_row + r
            if row < n_query:
                total = zero
                for t in range(TC):
                    total += shared[R0 + r * TC + t]
                empty = row_max[i] == -math.inf and total == 0
                for f in range(VP):
                    feature = tx + f * TC
                    if feature < EV:
                        out[b, row, feature] = zero if empty else acc[i * VP + f] / total
                if tx == 0:
                    log_sum_exp[b, row] = -math.inf if empty else row_max[i] + math.log(total)

    return kernel


def _query_gradient_shared(tiles, n_features, n_values):
    """Shared numbers of the dQ pass: Q, dO, K, V and dS tiles."""
    br, bc = tiles.block_rows, tiles.block_cols
    return (br + bc) * (n_features + 1 + n_values + 1) + br * (bc + 1)


@functools.cache
def _query_gradient_kernel(numba_dtype, n_features, n_values, tiles):
    r"""Backward, part one: :math:`dQ` and :math:`D`, one block per tile of query rows.

    For each key tile: :math:`S = QK^\top` and :math:`dP = dO\,V^\top` as register
    micro-tiles, :math:`P = e^{sS + M - \operatorname{lse}}`,
    :math:`dS = P \circ (dP - D)` written to shared memory, then
    :math:`dQ \mathrel{+}= dS\,K`; finally :math:`dQ` is scaled by :math:`s`.
    """
    TR, TC, RM, CM = tiles
    BR, BC = tiles.block_rows, tiles.block_cols
    E, EV = n_features, n_values
    QS, GS = E + 1, EV + 1
    PS = BC + 1
    EP = max(1, -(-E // TC))  # dQ features per thread
    Q0 = 0
    G0 = Q0 + BR * QS
    K0 = G0 + BR * GS
    V0 = K0 + BC * QS
    P0 = V0 + BC * GS
    NT = TR * TC
    SCORES, OUTPUTS_K = RM * CM, RM * EP  # array sizes must be constants, not expressions

    @_kernel_jit()
    def kernel(
        query, key, value, grad_output, output, log_sum_exp, mask, index, is_causal, scale,
        grad_query, delta,
    ):  # fmt: skip
        shared = cuda.shared.array(0, dtype=numba_dtype)
        scores = cuda.local.array(SCORES, dtype=numba_dtype)
        grad_p = cuda.local.array(SCORES, dtype=numba_dtype)
        acc = cuda.local.array(OUTPUTS_K, dtype=numba_dtype)
        lse = cuda.local.array(RM, dtype=numba_dtype)
        row_delta = cuda.local.array(RM, dtype=numba_dtype)
        a_reg = cuda.local.array(RM, dtype=numba_dtype)
        b_reg = cuda.local.array(CM, dtype=numba_dtype)
        k_reg = cuda.local.array(EP, dtype=numba_dtype)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        tid = ty * TC + tx
        n_query, n_key = query.shape[1], key.shape[1]
        tiles_per_batch = (n_query + BR - 1) // BR
        b = cuda.blockIdx.x // tiles_per_batch
        first_row = (cuda.blockIdx.x - b * tiles_per_batch) * BR
        q, k, v, m = index[b, 0], index[b, 1], index[b, 2], index[b, 3]
        has_mask = mask.shape[1] != 0
        zero = numba_dtype(0)
        _stage(shared[Q0:], QS, query, q, first_row, BR, E, tid, NT)
        _stage(shared[G0:], GS, grad_output, b, first_row, BR, EV, tid, NT)
        cuda.syncthreads()
        for i in range(RM):
            r = ty + i * TR
            row = first_row + r
            d = zero
            if row < n_query:
                for e in range(EV):
                    d += shared[G0 + r * GS + e] * output[b, row, e]
                lse[i] = log_sum_exp[b, row]
                if tx == 0:
                    delta[b, row] = d
            else:
                lse[i] = -math.inf
            row_delta[i] = d
            for f in range(EP):
                acc[i * EP + f] = 0
        n_visible = min(first_row + BR, n_key) if is_causal else n_key
        for start in range(0, n_visible, BC):
            bad = _stage(shared[K0:], QS, key, k, start, BC, E, tid, NT)
            _stage(shared[V0:], GS, value, v, start, BC, EV, tid, NT)
            key_has_garbage = cuda.syncthreads_or(bad)
            for c in range(RM * CM):
                scores[c] = 0
                grad_p[c] = 0
            for e in range(E):
                for i in range(RM):
                    a_reg[i] = shared[Q0 + (ty + i * TR) * QS + e]
                for j in range(CM):
                    b_reg[j] = shared[K0 + (tx + j * TC) * QS + e]
                for i in range(RM):
                    for j in range(CM):
                        scores[i * CM + j] += a_reg[i] * b_reg[j]
            for e in range(EV):
                for i in range(RM):
                    a_reg[i] = shared[G0 + (ty + i * TR) * GS + e]
                for j in range(CM):
                    b_reg[j] = shared[V0 + (tx + j * TC) * GS + e]
                for i in range(RM):
                    for j in range(CM):
                        grad_p[i * CM + j] += a_reg[i] * b_reg[j]
            for i in range(RM):
                row = first_row + ty + i * TR
                for j in range(CM):
                    col = start + tx + j * TC
                    bias = zero
                    if has_mask and row < n_query and col < n_key:
                        bias = mask[m, row, col]
                    scores[i * CM + j] = _masked(
                        scale * scores[i * CM + j], bias, has_mask, row, col, n_query, n_key,
                        is_causal,
                    )  # fmt: skip
            # A separate loop: small loop bodies are unrolled, so the micro-tiles stay
            # in registers (a loop left rolled indexes them at run time, in local memory).
            for i in range(RM):
                for j in range(CM):
                    s = scores[i * CM + j]
                    grad_s = zero
                    if s != -math.inf and lse[i] != -math.inf:
                        grad_s = math.exp(s - lse[i]) * (grad_p[i * CM + j] - row_delta[i])
                    shared[P0 + (ty + i * TR) * PS + tx + j * TC] = grad_s
            cuda.syncthreads()
            for t in range(BC):
                for f in range(EP):
                    feature = tx + f * TC
                    k_reg[f] = shared[K0 + t * QS + feature] if feature < E else zero
                for i in range(RM):
                    grad_s = shared[P0 + (ty + i * TR) * PS + t]
                    if key_has_garbage and grad_s == 0:
                        continue
                    for f in range(EP):
                        acc[i * EP + f] += grad_s * k_reg[f]
            cuda.syncthreads()
        for i in range(RM):
            row = first_row + ty + i * TR
            if row < n_query:
                for f in range(EP):
                    feature = tx + f * TC
                    if feature < E:
                        grad_query[b, row, feature] = scale * acc[i * EP + f]

    return kernel


def _key_gradient_shared(tiles, n_features, n_values):
    """Shared numbers of the dK, dV pass: K, V, Q, dO, P and dS tiles, log-sum-exps and D."""
    br, bc = tiles.block_rows, tiles.block_cols
    return (br + bc) * (n_features + 1 + n_values + 1) + 2 * br * (bc + 1) + 2 * bc


@functools.cache
def _key_gradient_kernel(numba_dtype, n_features, n_values, tiles):
    r"""Backward, part two: :math:`dK` and :math:`dV`, one block per tile of key rows.

    The block's rows are keys and its columns queries: for each query tile,
    :math:`S^\top = KQ^\top` and :math:`dP^\top = V\,dO^\top` as register
    micro-tiles, :math:`P^\top` and :math:`dS^\top` written to shared memory, then
    :math:`dV \mathrel{+}= P^\top dO` and :math:`dK \mathrel{+}= dS^\top Q`.
    """
    TR, TC, RM, CM = tiles
    BR, BC = tiles.block_rows, tiles.block_cols
    E, EV = n_features, n_values
    QS, GS = E + 1, EV + 1
    PS = BC + 1
    EP = max(1, -(-E // TC))
    VP = max(1, -(-EV // TC))
    K0 = 0
    V0 = K0 + BR * QS
    Q0 = V0 + BR * GS
    G0 = Q0 + BC * QS
    P0 = G0 + BC * GS
    D0 = P0 + BR * PS
    L0 = D0 + BR * PS
    DL0 = L0 + BC
    NT = TR * TC
    # Array sizes must be constants, not expressions.
    SCORES, OUTPUTS_K, OUTPUTS_V = RM * CM, RM * EP, RM * VP

    @_kernel_jit()
    def kernel(
        query, key, value, grad_output, log_sum_exp, delta, mask, index, is_causal, scale,
        grad_key, grad_value,
    ):  # fmt: skip
        shared = cuda.shared.array(0, dtype=numba_dtype)
        scores = cuda.local.array(SCORES, dtype=numba_dtype)
        grad_p = cuda.local.array(SCORES, dtype=numba_dtype)
        acc_k = cuda.local.array(OUTPUTS_K, dtype=numba_dtype)
        acc_v = cuda.local.array(OUTPUTS_V, dtype=numba_dtype)
        a_reg = cuda.local.array(RM, dtype=numba_dtype)
        b_reg = cuda.local.array(CM, dtype=numba_dtype)
        q_reg = cuda.local.array(EP, dtype=numba_dtype)
        g_reg = cuda.local.array(VP, dtype=numba_dtype)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        tid = ty * TC + tx
        n_query, n_key = query.shape[1], key.shape[1]
        tiles_per_batch = (n_key + BR - 1) // BR
        b = cuda.blockIdx.x // tiles_per_batch
        first_col = (cuda.blockIdx.x - b * tiles_per_batch) * BR
        q, k, v, m = index[b, 0], index[b, 1], index[b, 2], index[b, 3]
        has_mask = mask.shape[1] != 0
        zero = numba_dtype(0)
        _stage(shared[K0:], QS, key, k, first_col, BR, E, tid, NT)
        _stage(shared[V0:], GS, value, v, first_col, BR, EV, tid, NT)
        for i in range(RM):
            for f in range(EP):
                acc_k[i * EP + f] = 0
            for f in range(VP):
                acc_v[i * VP + f] = 0
        # Causal: no query before this block's first key attends to any of its keys.
        first_query = first_col if is_causal else 0
        for start in range(first_query, n_query, BC):
            bad = _stage(shared[Q0:], QS, query, q, start, BC, E, tid, NT)
            bad |= _stage(shared[G0:], GS, grad_output, b, start, BC, EV, tid, NT)
            for t in range(tid, BC, NT):
                in_range = start + t < n_query
                shared[L0 + t] = log_sum_exp[b, start + t] if in_range else -math.inf
                shared[DL0 + t] = delta[b, start + t] if in_range else zero
            query_has_garbage = cuda.syncthreads_or(bad)
            for c in range(RM * CM):
                scores[c] = 0
                grad_p[c] = 0
            for e in range(E):
                for i in range(RM):
                    a_reg[i] = shared[K0 + (ty + i * TR) * QS + e]
                for j in range(CM):
                    b_reg[j] = shared[Q0 + (tx + j * TC) * QS + e]
                for i in range(RM):
                    for j in range(CM):
                        scores[i * CM + j] += a_reg[i] * b_reg[j]
            for e in range(EV):
                for i in range(RM):
                    a_reg[i] = shared[V0 + (ty + i * TR) * GS + e]
                for j in range(CM):
                    b_reg[j] = shared[G0 + (tx + j * TC) * GS + e]
                for i in range(RM):
                    for j in range(CM):
                        grad_p[i * CM + j] += a_reg[i] * b_reg[j]
            for i in range(RM):
                col = first_col + ty + i * TR
                for j in range(CM):
                    t = tx + j * TC
                    row = start + t
                    bias = zero
                    if has_mask and row < n_query and col < n_key:
                        bias = mask[m, row, col]
                    scores[i * CM + j] = _masked(
                        scale * scores[i * CM + j], bias, has_mask, row, col, n_query, n_key,
                        is_causal,
                    )  # fmt: skip
            # A separate loop, so that both stay unrolled (see the dQ pass).
            for i in range(RM):
                for j in range(CM):
                    t = tx + j * TC
                    s = scores[i * CM + j]
                    lse = shared[L0 + t]
                    p = zero
                    grad_s = zero
                    if s != -math.inf and lse != -math.inf:
                        p = math.exp(s - lse)
                        grad_s = p * (grad_p[i * CM + j] - shared[DL0 + t])
                    shared[P0 + (ty + i * TR) * PS + t] = p
                    shared[D0 + (ty + i * TR) * PS + t] = grad_s
            cuda.syncthreads()
            for t in range(BC):
                for f in range(EP):
                    feature = tx + f * TC
                    q_reg[f] = shared[Q0 + t * QS + feature] if feature < E else zero
                for f in range(VP):
                    feature = tx + f * TC
                    g_reg[f] = shared[G0 + t * GS + feature] if feature < EV else zero
                for i in range(RM):
                    p = shared[P0 + (ty + i * TR) * PS + t]
                    grad_s = shared[D0 + (ty + i * TR) * PS + t]
                    if query_has_garbage and p == 0:
                        continue
                    for f in range(VP):
                        acc_v[i * VP + f] += p * g_reg[f]
                    for f in range(EP):
                        acc_k[i * EP + f] += grad_s * q_reg[f]
            cuda.syncthreads()
        for i in range(RM):
            col = first_col + ty + i * TR
            if col < n_key:
                for f in range(EP):
                    feature = tx + f * TC
                    if feature < E:
                        grad_key[b, col, feature] = scale * acc_k[i * EP + f]
                for f in range(VP):
                    feature = tx + f * TC
                    if feature < EV:
                        grad_value[b, col, feature] = acc_v[i * VP + f]

    return kernel


def _launch(build, shared_elements, problem, n_batch, n_rows, *args):
    """Build (once) and launch a kernel over ``n_rows`` rows of each of ``n_batch`` batch
    entries, with the first tile shape of :data:`TILE_CHOICES` whose shared memory fits."""
    dtype, n_features, n_values = problem.dtype, problem.n_features, problem.value_dim
    tiles = _choose_tiles(
        lambda t: shared_elements(t, n_features, n_values), dtype.itemsize, n_rows
    )
    kernel = build(_cuda.numba_dtype(dtype), n_features, n_values, tiles)
    n_blocks = n_batch * math.ceil(n_rows / tiles.block_rows)
    shared_bytes = shared_elements(tiles, n_features, n_values) * dtype.itemsize
    if n_blocks > 0:
        threads = (tiles.col_threads, tiles.row_threads)
        kernel[n_blocks, threads, _cuda.stream(), shared_bytes](*args)


def _mask_or_empty(mask, problem):
    mask = dense_bias(mask, problem.n_query, problem.n_key, problem.dtype)
    return np.empty((1, 0, 0), dtype=problem.dtype) if mask is None else mask


def _device_operands(problem):
    query, key, value, mask, index = problem.kernel_operands()
    mask = _mask_or_empty(mask, problem)
    return tuple(_cuda.to_device(a) for a in (query, key, value, mask, index))


def _launch_forward(problem, operands):
    query, key, value, mask, index = operands
    dtype = problem.dtype
    n_batch = index.shape[0]
    out = _cuda.device_empty((n_batch, problem.n_query, problem.value_dim), dtype)
    log_sum_exp = _cuda.device_empty((n_batch, problem.n_query), dtype)
    _launch(
        _forward_kernel, _forward_shared, problem, n_batch, problem.n_query,
        query, key, value, mask, index, problem.is_causal, dtype.type(problem.scale),
        out, log_sum_exp,
    )  # fmt: skip
    return out, log_sum_exp


def flash_attention(problem):
    """Launch the flash forward kernel on a validated ``AttentionProblem``: returns the
    output ``batch_shape + (L, Ev)`` and log-sum-exp ``batch_shape + (L,)``.

    Half-precision operands arrive as they are (see ``_dispatch.HALF_NATIVE``): on a
    real GPU they run on the tensor cores when :func:`.tensor_core.supports` the problem
    (unless ``TFMATH_CUDA_TENSOR_CORES=0``); otherwise they are widened to float32.
    Either way the results are float32, which the caller rounds. float32 heads of 64
    run on the tensor cores as TF32 where ``TFMATH_CUDA_TF32=1``.
    """
    if problem.needs_widening or problem.dtype == np.float32:
        if _tensor_cores_serve(problem):
            from tfmath.kernels.cuda import tensor_core

            return tensor_core.flash_attention(problem)
        if problem.needs_widening:
            problem = problem.widened(half.widen)
    out, log_sum_exp = _launch_forward(problem, _device_operands(problem))
    out = out.reshape(problem.output_shape())
    log_sum_exp = log_sum_exp.reshape((*problem.batch_shape, problem.n_query))
    if problem.on_device:
        return out, log_sum_exp
    return _cuda.to_host(out), _cuda.to_host(log_sum_exp)


def _tensor_cores_serve(problem):
    """Whether the tensor-core forward takes this half-precision problem: not turned off,
    on a real GPU that runs it (the simulator cannot run its CUDA C++), with heads it
    supports."""
    from tfmath.kernels.cuda import tensor_core

    return tensor_core.supports(problem) and tensor_core.serves(
        problem.dtype.name, problem.n_features
    )


def _widened(array):
    """A half-precision array as float32 (:func:`.half.widen`), any other as it is."""
    return half.widen(array) if is_half(np.dtype(array.dtype)) else array


def _tensor_core_backward_serves(problem, grad_output, saved):
    """Whether the tensor-core backward takes this half-precision (or float32, as TF32)
    call: switched on, on a GPU that runs it, heads it supports, and finite numbers only
    (a 0 of P or dS times inf would be NaN there; the float32 kernels skip such
    products)."""
    from tfmath.kernels.cuda import tensor_core

    if not tensor_core.serves_backward(problem):
        return False
    arrays = [problem.query, problem.key, problem.value, grad_output]
    if saved is not None:
        arrays.append(saved[0])
    return tensor_core.all_finite(arrays, problem.dtype)


def attention_grad(problem, grad_output, saved=None):
    """The flash forward (unless ``saved`` holds its ``(output, log_sum_exp)``), then the
    two backward kernels, all on the GPU; gradients per broadcast batch entry.

    Half-precision operands arrive as they are (see ``_dispatch.HALF_NATIVE``): the
    tensor cores take them where :func:`.tensor_core.serves_backward` says and every
    number involved is finite (:func:`.tensor_core.finite`); otherwise they, the
    output's gradient and the saved output are widened to float32 here. Either way
    the gradients are float32, which the caller rounds. float32 heads of 64 run on the
    tensor cores as TF32 where ``TFMATH_CUDA_TF32=1``, on the same conditions.
    """
    if problem.needs_widening or problem.dtype == np.float32:
        if _tensor_core_backward_serves(problem, grad_output, saved):
            from tfmath.kernels.cuda import tensor_core

            return tensor_core.attention_grad(problem, grad_output, saved)
    if problem.needs_widening:
        problem = problem.widened(half.widen)
        grad_output = _widened(grad_output)
        if saved is not None:
            saved = (_widened(saved[0]), saved[1])
    operands = _device_operands(problem)
    query, key, value, mask, index = operands
    dtype = problem.dtype
    n_batch, E, Ev = index.shape[0], problem.n_features, problem.value_dim
    n_query, n_key = problem.n_query, problem.n_key
    if saved is None:
        output, log_sum_exp = _launch_forward(problem, operands)
    else:
        output = _cuda.to_device(saved[0]).reshape((n_batch, n_query, Ev))
        log_sum_exp = _cuda.to_device(saved[1]).reshape((n_batch, n_query))
    grad_output = _cuda.to_device(grad_output).reshape((n_batch, n_query, Ev))
    scale = dtype.type(problem.scale)
    grad_query = _cuda.device_empty((n_batch, n_query, E), dtype)
    delta = _cuda.device_empty((n_batch, n_query), dtype)
    _launch(
        _query_gradient_kernel, _query_gradient_shared, problem, n_batch, n_query,
        query, key, value, grad_output, output, log_sum_exp, mask, index, problem.is_causal,
        scale, grad_query, delta,
    )  # fmt: skip
    grad_key = _cuda.device_empty((n_batch, n_key, E), dtype)
    grad_value = _cuda.device_empty((n_batch, n_key, Ev), dtype)
    _launch(
        _key_gradient_kernel, _key_gradient_shared, problem, n_batch, n_key,
        query, key, value, grad_output, log_sum_exp, delta, mask, index, problem.is_causal,
        scale, grad_key, grad_value,
    )  # fmt: skip
    batch = problem.batch_shape
    grads = (
        grad_query.reshape((*batch, n_query, E)),
        grad_key.reshape((*batch, n_key, E)),
        grad_value.reshape((*batch, n_key, Ev)),
    )
    return grads if problem.on_device else tuple(_cuda.to_host(g) for g in grads)
