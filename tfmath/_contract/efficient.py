"""Linear and sparse attention: feature maps and pattern codes, sparsity patterns, key runs.

The problem of both routines is the :class:`~tfmath._contract.attention.AttentionProblem`;
what they add is here: the integer codes the kernels receive, the feature maps by
their definition (:func:`feature_map`, for the NumPy oracle and the analysis), the validated
:class:`SparsePattern`, and how a pattern enumerates the keys of a query row
(:func:`run_count`, :func:`run_bounds`: plain Python, compiled by both the CPU
and the CUDA kernels, and read by the NumPy oracle through :meth:`SparsePattern.allows`).
"""

from dataclasses import dataclass

import numpy as np

from tfmath._contract.checks import (
    BEYOND_ANY_SEQUENCE,
    boolean_flag,
    choice,
    host_array,
    integer,
)
from tfmath.errors import ArgumentError, DTypeError, ShapeError

#: Feature maps of :func:`~tfmath.efficient.linear_attention`; the kernels receive the index.
FEATURE_MAPS = ("elu+1", "relu")
ELU_PLUS_ONE, RELU = range(len(FEATURE_MAPS))


def feature_map(x, feature_code):
    r"""The feature map, elementwise in float64.

    .. math::

        \phi_{\text{elu+1}}(x) = \begin{cases} x + 1 & x > 0 \\ e^x & x \le 0 \end{cases}
        \qquad \phi_{\text{relu}}(x) = \max(x, 0)

    (:math:`\operatorname{elu}(x) + 1 = e^x - 1 + 1` for :math:`x \le 0`, written
    as :math:`e^x` so that tiny values do not cancel). NaN stays NaN.
    """
    x = np.asarray(x, dtype=np.float64)
    if feature_code == ELU_PLUS_ONE:
        return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))
    return np.where(x < 0, 0.0, x)


#: Patterns of :func:`~tfmath.efficient.sparse_attention`; the kernels receive the index.
PATTERNS = ("local", "strided", "local+strided", "block")
LOCAL, STRIDED, LOCAL_STRIDED, BLOCK = range(len(PATTERNS))

#: Which keyword arguments each pattern needs.
_PATTERN_ARGUMENTS = {
    "local": ("window",),
    "strided": ("stride",),
    "local+strided": ("window", "stride"),
    "block": ("block_layout", "block_size"),
}


@dataclass(frozen=True)
class SparsePattern:
    r"""A validated sparsity pattern: which keys each query may attend.

    With :math:`0 \le i < L` the query and :math:`0 \le j < S` the key, a pair is
    attended when (and, with ``is_causal``, also :math:`j \le i`):

    ``"local"``
        :math:`|i - j| < w` (``window`` :math:`w`): the sliding window.
    ``"strided"``
        :math:`(i - j) \bmod s = 0` (``stride`` :math:`s`).
    ``"local+strided"``
        Either of the two: Child et al.'s strided pattern with both of its
        heads merged into one [Child2019]_ (they take :math:`w = s \approx
        \sqrt{n}`, so every row attends :math:`O(\sqrt{n})` keys).
    ``"block"``
        ``block_layout[i // b, j // b]`` (``block_size`` :math:`b`).

    Attributes
    ----------
    kind : str
        One of :data:`PATTERNS`.
    window, stride, block_size : int or None
        Those the pattern uses; the others are None.
    block_layout : numpy.ndarray of bool or None
        Shape ``(ceil(L / b), ceil(S / b))``.
    is_causal : bool
    """

    kind: str
    window: int | None
    stride: int | None
    block_layout: np.ndarray | None
    block_size: int | None
    is_causal: bool

    @property
    def code(self):
        """The pattern's index in :data:`PATTERNS`, as the kernels receive it."""
        return PATTERNS.index(self.kind)

    def check_lengths(self, n_query, n_key):
        """Raise unless the block layout fits ``L = n_query`` and ``S = n_key``."""
        if self.kind != "block":
            return
        expected = (-(-n_query // self.block_size), -(-n_key // self.block_size))
        if self.block_layout.shape != expected:
            raise ShapeError(
                f"block_layout must have shape (ceil(L / block_size), ceil(S / block_size)) = "
                f"{expected} for L = {n_query}, S = {n_key}, block_size = {self.block_size}, "
                f"got {self.block_layout.shape}"
            )
        if self.is_causal:
            rows, columns = np.nonzero(self.block_layout)
            last_query = np.minimum((rows + 1) * self.block_size, n_query) - 1
            above = columns * self.block_size > last_query
            if np.any(above):
                block = (int(rows[above][0]), int(columns[above][0]))
                raise ArgumentError(
                    f"is_causal=True contradicts block_layout: block {block} lies wholly "
                    f"above the causal diagonal (every key in it is later than every query), "
                    f"so it could never be attended; clear it or pass is_causal=False"
                )

    def allows(self, rows, columns):
        """Whether query ``rows`` may attend key ``columns`` (broadcasting integer arrays)."""
        rows, columns = np.asarray(rows), np.asarray(columns)
        offset = rows - columns
        if self.kind == "local":
            allowed = np.abs(offset) < self.window
        elif self.kind == "strided":
            allowed = offset % self.stride == 0
        elif self.kind == "local+strided":
            allowed = (np.abs(offset) < self.window) | (offset % self.stride == 0)
        else:
            allowed = self.block_layout[rows // self.block_size, columns // self.block_size]
        if self.is_causal:
            allowed = allowed & (columns <= rows)
        return allowed

    def mask(self, n_query, n_key):
        """The equivalent boolean mask, shape ``(n_query, n_key)`` (True = attended)."""
        self.check_lengths(n_query, n_key)
        return self.allows(np.arange(n_query)[:, None], np.arange(n_key)[None, :])

    def row_counts(self, n_query, n_key):
        """How many keys each query attends, shape ``(n_query,)``, without forming the mask.

        Closed forms for the banded and strided patterns (:math:`O(L)`); the
        block pattern sums the widths of the attended blocks (:math:`O(L S / b)`).
        """
        self.check_lengths(n_query, n_key)
        i = np.arange(n_query, dtype=np.int64)
        top = np.minimum(i + 1, n_key) if self.is_causal else np.full_like(i, n_key)
        if self.kind == "block":
            return self._block_row_counts(i, top, n_key)
        counts = np.zeros_like(i)
        if self.kind in ("local", "local+strided"):
            low = np.maximum(i - self.window + 1, 0)
            high = np.minimum(top, i + self.window)
            counts += np.maximum(high - low, 0)
        if self.kind in ("strided", "local+strided"):
            counts += _congruent_below(top, i, self.stride)
        if self.kind == "local+strided":
            # Keys in the window that the stride also reaches are counted once.
            high = np.maximum(high, low)
            counts -= _congruent_below(high, i, self.stride) - _congruent_below(low, i, self.stride)
        return counts

    def _block_row_counts(self, i, top, n_key):
        b = self.block_size
        starts = np.arange(self.block_layout.shape[1], dtype=np.int64) * b
        stops = np.minimum(starts + b, n_key)
        layout_rows = self.block_layout[i // b]
        widths = np.clip(np.minimum(stops[None, :], top[:, None]) - starts[None, :], 0, None)
        return np.sum(np.where(layout_rows, widths, 0), axis=1)

    def n_pairs(self, n_query, n_key):
        """The number of attended (query, key) pairs."""
        return int(np.sum(self.row_counts(n_query, n_key)))

    def block_rows(self):
        """The layout in compressed-row form: ``(row_starts, key_blocks)`` (int64).

        Row ``r`` of the layout attends key blocks
        ``key_blocks[row_starts[r]:row_starts[r + 1]]``, in increasing order.
        """
        if self.kind != "block":
            return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64)
        rows, columns = np.nonzero(self.block_layout)
        row_starts = np.zeros(self.block_layout.shape[0] + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=self.block_layout.shape[0]), out=row_starts[1:])
        return row_starts, columns.astype(np.int64)


def _congruent_below(limit, residue_of, stride):
    """How many ``j`` in ``[0, limit)`` have ``j = residue_of (mod stride)``, elementwise."""
    residue = residue_of % stride
    return np.maximum(limit - residue + stride - 1, 0) // stride


def sparse_pattern(
    pattern, *, window=None, stride=None, block_layout=None, block_size=None, is_causal=False
):
    """Validate a sparsity pattern's arguments and return it as a :class:`SparsePattern`.

    Parameters are those of :func:`sparse_attention`; every argument the
    pattern uses must be given, and none that it does not use.

    Raises
    ------
    ValueError
        For an unknown pattern, a missing or superfluous argument, ``window``,
        ``stride`` or ``block_size`` below 1, or a layout that is not 2-D.
    TypeError
        For a pattern that is not a string, a size that is not an integer, or
        a layout that is not boolean.

    Examples
    --------
    >>> from tfmath.efficient import sparse_pattern
    >>> sparse_pattern("local", window=2).mask(3, 3).astype(int)
    array([[1, 1, 0],
           [1, 1, 1],
           [0, 1, 1]])
    """
    choice("pattern", pattern, PATTERNS)
    given = {
        "window": window,
        "stride": stride,
        "block_layout": block_layout,
        "block_size": block_size,
    }
    needed = _PATTERN_ARGUMENTS[pattern]
    for name, value in given.items():
        if name in needed and value is None:
            raise ArgumentError(f"pattern={pattern!r} needs {name}")
        if name not in needed and value is not None:
            users = [p for p, names in _PATTERN_ARGUMENTS.items() if name in names]
            raise ArgumentError(
                f"{name} is only used by pattern {' or '.join(map(repr, users))}, "
                f"not by pattern={pattern!r}; leave it out"
            )
    sizes = {
        name: integer(name, given[name], minimum=1, allow_none=True)
        for name in ("window", "stride", "block_size")
    }
    sizes = {
        name: None if size is None else min(size, BEYOND_ANY_SEQUENCE)
        for name, size in sizes.items()
    }
    layout = None if block_layout is None else _block_layout(block_layout)
    return SparsePattern(
        pattern,
        sizes["window"],
        sizes["stride"],
        layout,
        sizes["block_size"],
        boolean_flag("is_causal", is_causal),
    )


def _block_layout(block_layout):
    layout = host_array("block_layout", block_layout)
    if layout.dtype != np.bool_:
        raise DTypeError(
            f"block_layout must be boolean (True = the query block attends the key block), "
            f"got dtype {layout.dtype}"
        )
    if layout.ndim != 2:
        raise ShapeError(
            f"block_layout must be 2-D (query blocks, key blocks), got shape {layout.shape}"
        )
    layout = layout.copy()
    layout.flags.writeable = False
    return layout


# --- the runs of keys a query row attends (compiled by each kernel backend) ---------------


def run_count(code, row, block_size, row_starts):
    """How many runs of keys :func:`run_bounds` describes for query ``row``."""
    if code == BLOCK:
        block_row = row // block_size
        return row_starts[block_row + 1] - row_starts[block_row]
    return 3


def run_bounds(code, row, part, window, stride, block_size, row_starts, key_blocks, top):
    """Run ``part`` of the keys query ``row`` attends: ``(start, stop, step)``, maybe empty.

    ``top`` is one past the last key the row may see (``S``, or ``min(row + 1, S)``
    when causal). The three runs of a banded pattern are: the strided keys
    below the window, the window, and the strided keys above it, so the union
    pattern visits no key twice.
    """
    if code == BLOCK:
        start = key_blocks[row_starts[row // block_size] + part] * block_size
        return start, min(start + block_size, top), 1
    low = max(row - window + 1, 0)
    high = min(row + window, top)
    if code == LOCAL:
        return (low, high, 1) if part == 1 else (0, 0, 1)
    residue = row % stride
    if code == STRIDED or high <= low:
        return (residue, top, stride) if part == 1 else (0, 0, 1)
    if part == 0:
        return residue, low, stride
    if part == 1:
        return low, high, 1
    # The first key at or above `high` congruent to the row (written so that it
    # holds under either sign convention of %).
    return high + ((residue - high) % stride + stride) % stride, top, stride


def sparse_kernel_arguments(pattern):
    """The pattern as the sparse kernels take it: ``(code, window, stride, block_size,
    row_starts, key_blocks)``, with placeholders (1, empty arrays) for what it does not use."""
    row_starts, key_blocks = pattern.block_rows()
    return (
        pattern.code,
        pattern.window or 1,
        pattern.stride or 1,
        pattern.block_size or 1,
        row_starts,
        key_blocks,
    )
