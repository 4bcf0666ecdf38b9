"""The problems of attention's variants: FlashAttention's options, packed sequences and
FlexAttention's modifications, checked and laid out for the kernels.

A :class:`VariantProblem` holds its operands as ``(entries, rows, features)`` arrays
in the compute dtype, with an index that maps each *batch entry* (one head of one
sequence) to its query entry, its key/value entry (fewer with grouped heads), the
``b`` and ``h`` a modification sees, and its *mask index*: which of the
:class:`Blocks` lists it runs. The modification is described (:class:`Modification`),
not compiled: the backend turns the description into code.
"""

from typing import NamedTuple

import numpy as np

from tfmath._contract.checks import (
    BEYOND_ANY_SEQUENCE,
    attention_scale,
    boolean_flag,
    float_operand,
    integer,
    is_half,
    real,
)
from tfmath._contract.tensors import any_tensor, needs_grad, to_array
from tfmath.errors import ArgumentError, DTypeError, ShapeError

#: Query rows and keys per tile of FlashAttention's variants (a block mask sets its own).
TILE = 64


class Blocks(NamedTuple):
    """Which (query tile, key tile) blocks run, per mask index.

    ``count[m, r]`` blocks for query tile ``r``: key tiles ``index[m, r, :count]``,
    each ``partial`` where some pair in it is masked out (the modification then
    applies the mask) and full where none is. :meth:`transposed` gives the same
    blocks listed per key tile, as the backward sweeps them.
    """

    query_tile: int
    key_tile: int
    count: np.ndarray
    index: np.ndarray
    partial: np.ndarray
    n_other_tiles: int

    def transposed(self):
        n_masks, n_rows = self.count.shape
        lists = [[[] for _ in range(self.n_other_tiles)] for _ in range(n_masks)]
        for m in range(n_masks):
            for r in range(n_rows):
                for slot in range(self.count[m, r]):
                    lists[m][self.index[m, r, slot]].append((r, self.partial[m, r, slot]))
        return _packed(self.key_tile, self.query_tile, lists, n_rows)

    def to_dense(self, n_query, n_key):
        """Boolean ``(masks, n_query, n_key)``: whether a pair's block runs."""
        n_masks = self.count.shape[0]
        dense = np.zeros((n_masks, self.count.shape[1], self.n_other_tiles), dtype=bool)
        for m in range(n_masks):
            for r in range(self.count.shape[1]):
                dense[m, r, self.index[m, r, : self.count[m, r]]] = True
        dense = dense.repeat(self.query_tile, axis=1).repeat(self.key_tile, axis=2)
        return dense[:, :n_query, :n_key]

    def partial_dense(self, n_query, n_key):
        """Boolean ``(masks, n_query, n_key)``: whether a pair's block is partial."""
        n_masks = self.count.shape[0]
        dense = np.zeros((n_masks, self.count.shape[1], self.n_other_tiles), dtype=bool)
        for m in range(n_masks):
            for r in range(self.count.shape[1]):
                keys = self.index[m, r, : self.count[m, r]]
                dense[m, r, keys] = self.partial[m, r, : self.count[m, r]]
        dense = dense.repeat(self.query_tile, axis=1).repeat(self.key_tile, axis=2)
        return dense[:, :n_query, :n_key]


def _packed(query_tile, key_tile, lists, n_other_tiles):
    """:class:`Blocks` from per-mask, per-row lists of ``(tile, partial)``."""
    n_masks, n_rows = len(lists), len(lists[0])
    width = max(1, max((len(row) for rows in lists for row in rows), default=1))
    count = np.zeros((n_masks, n_rows), dtype=np.int64)
    index = np.zeros((n_masks, n_rows, width), dtype=np.int64)
    partial = np.zeros((n_masks, n_rows, width), dtype=np.bool_)
    for m, rows in enumerate(lists):
        for r, row in enumerate(rows):
            count[m, r] = len(row)
            for slot, (tile, is_partial) in enumerate(row):
                index[m, r, slot] = tile
                partial[m, r, slot] = is_partial
    return Blocks(query_tile, key_tile, count, index, partial, n_other_tiles)


def window_blocks(lengths, n_query_tiles, n_key_tiles, left, right, query_tile, key_tile):
    """:class:`Blocks` of a window ``i + S - L - left <= j <= i + S - L + right``
    (``-1``: unbounded on that side), one mask index per ``(L, S)`` in ``lengths``.
    A block is listed when some pair in it is inside the window and both lengths,
    and partial when some pair in it is not."""
    lists = []
    for n_query, n_key in lengths:
        rows = []
        offset = n_key - n_query
        for r in range(n_query_tiles):
            first_row, last_row = r * query_tile, min((r + 1) * query_tile, n_query) - 1
            row = []
            if first_row < n_query:
                lowest = 0 if left < 0 else max(first_row + offset - left, 0)
                highest = n_key - 1 if right < 0 else min(last_row + offset + right, n_key - 1)
                for t in range(lowest // key_tile, highest // key_tile + 1 if highest >= 0 else 0):
                    first_key, last_key = t * key_tile, (t + 1) * key_tile - 1
                    inside = (left < 0 or first_key >= last_row + offset - left) and (
                        right < 0 or last_key <= first_row + offset + right
                    )
                    row.append((t, not inside))
            rows.append(row)
        lists.append(rows)
    return _packed(query_tile, key_tile, lists, n_key_tiles)


class Modification(NamedTuple):
    """What a variant does to the raw scores, as the backends read it.

    ``kind`` ``"flash"``: FlashAttention's soft-capping, ALiBi and window, with
    ``float_params = [softcap, *alibi_slopes]`` and ``int_params = [left, right,
    has_alibi, slope_rows, heads]``. ``kind`` ``"flex"``: ``score`` (a user's
    ``score_mod`` or a built-in's name), ``derivative`` (its derivative, a user's
    function, ``"unit"`` or None) and ``mask_mod`` (None for none), with the
    built-in's parameters; the first ``n_learnable`` float parameters get gradients.
    """

    kind: str
    float_params: np.ndarray
    int_params: np.ndarray
    n_learnable: int = 0
    score: object = None
    derivative: object = None
    mask_mod: object = None

    @property
    def differentiable(self):
        return self.kind == "flash" or self.score is None or self.derivative is not None


class VariantProblem(NamedTuple):
    """One call of a variant, laid out for the kernels (see the module)."""

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    index: np.ndarray
    lengths: np.ndarray
    sinks: np.ndarray
    scale: float
    modification: Modification
    blocks: Blocks
    backend: str
    dtype: np.dtype
    operand_dtype: np.dtype

    @property
    def n_query(self):
        return self.query.shape[1]

    @property
    def is_empty(self):
        """Nothing to compute: no batch entry, no query row or no feature (no key is
        not empty: its rows attend nothing, or the sink)."""
        return 0 in (self.index.shape[0], self.n_query, self.query.shape[2], self.value_dim)

    @property
    def on_device(self):
        return False

    def on_host(self):
        return self

    @property
    def n_key(self):
        return self.key.shape[1]

    @property
    def value_dim(self):
        return self.value.shape[2]


def compute_dtype_of(*arrays):
    """The dtype the variants compute in: float64 if any operand is, else float32
    (half precision included); and the operands' dtype, which results come back in."""
    dtypes = [np.dtype(a.dtype) for a in arrays]
    if len(set(dtypes)) > 1:
        raise DTypeError(
            "query, key and value must share one dtype, got "
            + ", ".join(str(d) for d in dtypes)
            + " (cast them to one)"
        )
    operand = dtypes[0]
    return (np.dtype(np.float32) if is_half(operand) else operand), operand


def operands(query, key, value, minimum_ndim, layout):
    """The three operands as floating arrays of at least ``minimum_ndim`` dimensions."""
    arrays = []
    for name, value_ in (("query", query), ("key", key), ("value", value)):
        array = float_operand(name, value_, half=True)
        if not isinstance(array, np.ndarray):
            raise ArgumentError(
                f"{name} is a device array: attention's variants run on the CPU "
                "(backend='cpu' or 'reference'); copy it to the host first"
            )
        if array.ndim < minimum_ndim:
            raise ShapeError(f"{name} must have shape {layout}, got shape {array.shape}")
        arrays.append(array)
    return arrays


def head_groups(n_heads, n_kv_heads, what="key and value"):
    """Query heads per key/value head, or a ShapeError naming both counts (no heads on
    either side: one, for an empty result as for any other empty dimension)."""
    if n_heads == n_kv_heads:
        return 1
    if n_kv_heads < 1 or n_heads < n_kv_heads or n_heads % n_kv_heads:
        raise ShapeError(
            f"the query's {n_heads} heads must be a positive multiple of the {n_kv_heads} heads of "
            f"{what} (grouped-query attention shares each key/value head among a group)"
        )
    return n_heads // n_kv_heads


def slopes_array(alibi_slopes):
    """``alibi_slopes`` as given, or a tensor's as an array; refused if it requires grad
    (checked in the public function, where grad mode is the caller's)."""
    if not any_tensor(alibi_slopes):
        return alibi_slopes
    if needs_grad(alibi_slopes):
        raise ArgumentError(
            "alibi_slopes requires grad, but the variants differentiate q, k, v and sinks "
            "only, as FlashAttention does: the slopes would get no gradient; pass "
            "alibi_slopes.detach()"
        )
    return to_array("alibi_slopes", alibi_slopes)


def flash_options(scale, causal, window_size, softcap, alibi_slopes, sinks, n_heads, n_slope_rows,
                  query_shape, dtype):  # fmt: skip
    """FlashAttention's keyword arguments checked, for scores computed in ``dtype``:
    returns ``(scale, left, right, softcap, slopes (rows, heads) float64 or None, sinks
    (heads,) float64 or None)``."""
    scale = attention_scale(scale, query_shape, dtype)
    causal = boolean_flag("causal", causal)
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ArgumentError(
            f"window_size must be a pair (left, right), -1 for unbounded, got {window_size!r}"
        ) from None
    left = min(integer("window_size[0]", left, minimum=-1), BEYOND_ANY_SEQUENCE)
    right = min(integer("window_size[1]", right, minimum=-1), BEYOND_ANY_SEQUENCE)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    softcap = real("softcap", softcap, at_least=0.0)
    slopes = None
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64)
        if slopes.shape == (n_heads,):
            slopes = slopes[None]
        elif slopes.shape != (n_slope_rows, n_heads):
            raise ShapeError(
                f"alibi_slopes must have shape ({n_heads},) or ({n_slope_rows}, {n_heads}) "
                f"(heads, or batch and heads), got shape {np.shape(alibi_slopes)}"
            )
        if not np.all(np.isfinite(slopes)):
            raise ArgumentError("alibi_slopes must be finite")
    sink_logits = None
    if sinks is not None:
        sink_logits = np.asarray(sinks, dtype=np.float64)
        if sink_logits.shape != (n_heads,):
            raise ShapeError(
                f"sinks must have shape ({n_heads},), one logit per query head, "
                f"got shape {np.shape(sinks)}"
            )
        if np.isnan(sink_logits).any() or (sink_logits == np.inf).any():
            raise ArgumentError(
                "sinks must be finite, or -inf for a head without a sink, got "
                f"{sink_logits[np.isnan(sink_logits) | (sink_logits == np.inf)][0]}"
            )
    return scale, left, right, softcap, slopes, sink_logits


def flash_modification(left, right, softcap, slopes, n_heads):
    """The :class:`Modification` of FlashAttention's options."""
    has_alibi = slopes is not None
    float_params = np.concatenate([[softcap], slopes.ravel() if has_alibi else []])
    rows = slopes.shape[0] if has_alibi else 1
    int_params = np.array([left, right, int(has_alibi), rows, n_heads], dtype=np.int64)
    return Modification("flash", float_params.astype(np.float64), int_params)


def tile_for(n_rows):
    """Tile size for ``n_rows`` rows: :data:`TILE`, or fewer (a multiple of 8) for
    shorter sequences."""
    return int(min(TILE, max(8, -(-n_rows // 8) * 8)))
