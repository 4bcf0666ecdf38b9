r"""Efficient attention variants: linear attention and sparse attention.

Exact attention costs :math:`O(n^2 d)` time because every query meets every
key ([Seed000]_, complexity table). The seeds name three ways out; FlashAttention
([Dao2022]_) keeps the exact result and only changes the memory traffic (it is
``method="flash"`` of :func:`tfmath.scaled_dot_product_attention`). The other
two change *what* is computed, and live here:

- :func:`linear_attention` ([Katharopoulos2020]_) replaces
  :math:`\exp(q \cdot k)` by a kernel :math:`\phi(q) \cdot \phi(k)` with a
  positive feature map :math:`\phi`, so the sum over keys factors through a
  :math:`d \times d_v` state: :math:`O(n d d_v)` time, linear in :math:`n`.
- :func:`sparse_attention` ([Child2019]_) keeps the softmax but lets each
  query attend only to the keys of a fixed pattern (a sliding window, a
  stride, their union, or an explicit block layout): cost proportional to the
  number of attended pairs. It equals exact attention with the boolean mask
  :func:`sparse_attention_mask`, without ever forming that mask.

Each public function validates its arguments once, resolves the backend and
calls the registered implementation (cpu, cuda or the NumPy reference).
"""

import math
import numbers
from dataclasses import dataclass

import numpy as np

from tfmath._dispatch import register, resolve_backend
from tfmath._validation import boolean_flag, host_array, real_scalar
from tfmath.attention import _attention_problem

__all__ = [
    "FEATURE_MAPS",
    "PATTERNS",
    "SparsePattern",
    "default_window",
    "linear_attention",
    "sparse_attention",
    "sparse_attention_mask",
    "sparse_pattern",
]

LINEAR_ATTENTION = register(
    "linear_attention",
    cpu="tfmath.kernels.cpu.efficient:linear_attention",
    cuda="tfmath.kernels.cuda.efficient:linear_attention",
    reference="tfmath.reference.efficient:linear_attention",
)

SPARSE_ATTENTION = register(
    "sparse_attention",
    cpu="tfmath.kernels.cpu.efficient:sparse_attention",
    cuda="tfmath.kernels.cuda.efficient:sparse_attention",
    reference="tfmath.reference.efficient:sparse_attention",
)

#: Feature maps of :func:`linear_attention`; the kernels receive the index.
FEATURE_MAPS = ("elu+1", "relu")
#: Patterns of :func:`sparse_attention`; the kernels receive the index.
PATTERNS = ("local", "strided", "local+strided", "block")
LOCAL, STRIDED, LOCAL_STRIDED, BLOCK = range(len(PATTERNS))

#: Which keyword arguments each pattern needs.
_PATTERN_ARGUMENTS = {
    "local": ("window",),
    "strided": ("stride",),
    "local+strided": ("window", "stride"),
    "block": ("block_layout", "block_size"),
}


# --- linear attention ---------------------------------------------------------------------


def linear_attention(
    query, key, value, *, is_causal=False, feature_map="elu+1", eps=1e-6, backend="auto"
):
    r"""Linear attention: the softmax kernel replaced by a feature map (Katharopoulos et al.).

    With a feature map :math:`\phi \ge 0` applied to each row, query :math:`i`
    attends the keys :math:`A_i` (all keys, or :math:`j \le i` when causal,
    :math:`c_i = |A_i|` of them) with weights proportional to
    :math:`\phi(q_i) \cdot \phi(k_j)`:

    .. math::

        o_i = \frac{\phi(q_i)^\top S_i}{\phi(q_i)^\top z_i + \varepsilon},
        \qquad S_i = \frac{1}{c_i} \sum_{j \in A_i} \phi(k_j)\, v_j^\top,
        \qquad z_i = \frac{1}{c_i} \sum_{j \in A_i} \phi(k_j).

    Because :math:`\phi(q_i)` comes out of the sum, :math:`S` and :math:`z`
    are formed once (non-causal: :math:`S = \phi(K)^\top V / S_{len}`) or
    carried as a running prefix state (causal), and no :math:`L \times S`
    matrix is ever formed: :math:`O((L + S)\, E\, E_v)` time and
    :math:`O(E E_v + (L + S)(E + E_v))` memory [Katharopoulos2020]_.

    Parameters
    ----------
    query : array_like, shape (..., L, E)
    key : array_like, shape (..., S, E)
    value : array_like, shape (..., S, Ev)
        Leading (batch, head) dimensions broadcast against each other.
    is_causal : bool, optional
        Query :math:`i` attends only keys :math:`j \le i` (top-left aligned,
        as in :func:`tfmath.scaled_dot_product_attention`).
    feature_map : {"elu+1", "relu"}, optional
        :math:`\phi(x) = \operatorname{elu}(x) + 1` (the paper's choice;
        computed as :math:`e^x` for :math:`x \le 0`, without cancellation), or
        :math:`\max(x, 0)`, elementwise.
    eps : float, optional
        Added to the denominator, :math:`\ge 0`.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Which implementation runs (see :func:`tfmath.backends`).

    Returns
    -------
    numpy.ndarray, shape (..., L, Ev)
        float32 when every input is float32, else float64; a device array when an input was one.

    Raises
    ------
    ValueError
        For an unknown ``feature_map`` or a negative ``eps``.
    ShapeError, DTypeError
        As for :func:`tfmath.scaled_dot_product_attention`.

    Notes
    -----
    *The denominator guard.* A plain running sum :math:`\sum_j \phi(k_j)`
    grows like the sequence length, so for long sequences a float32 state
    overflows (large features) or loses the small late terms, and a fixed
    :math:`\varepsilon` means something different at every length. Here the
    state is accumulated in float64 whatever the input dtype, and both
    numerator and denominator are divided by the count :math:`c_i`, so
    :math:`\varepsilon` is compared with the *mean* kernel value
    :math:`\phi(q_i)^\top z_i` and its effect does not depend on :math:`n`.
    Without :math:`\varepsilon` the factor :math:`c_i` cancels and this is the
    paper's formula; with it, it is the paper's formula with
    :math:`\varepsilon c_i` in place of :math:`\varepsilon`. A query with no
    key to attend (``S == 0``) gets 0. With ``eps=0`` a zero denominator
    (``"relu"`` features orthogonal to every key) gives NaN.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.efficient import linear_attention
    >>> q = k = np.zeros((3, 2))
    >>> v = np.array([[1.0], [2.0], [6.0]])
    >>> linear_attention(q, k, v, is_causal=True, eps=0.0, backend="reference")[:, 0]
    array([1. , 1.5, 3. ])
    """
    backend = resolve_backend(backend, query, key, value)
    feature_code = _choice("feature_map", feature_map, FEATURE_MAPS)
    eps = real_scalar("eps", eps, allow_none=False)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    problem = _attention_problem(query, key, value, None, is_causal, 1.0, False)
    if backend != "cuda":
        problem = problem.on_host()
    return LINEAR_ATTENTION.implementation(backend)(problem, feature_code, eps)


def _choice(name, value, choices):
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, one of {choices}, got {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return choices.index(value)


# --- sparse patterns ----------------------------------------------------------------------


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
            raise ValueError(
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
                raise ValueError(
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
    _choice("pattern", pattern, PATTERNS)
    given = {
        "window": window,
        "stride": stride,
        "block_layout": block_layout,
        "block_size": block_size,
    }
    needed = _PATTERN_ARGUMENTS[pattern]
    for name, value in given.items():
        if name in needed and value is None:
            raise ValueError(f"pattern={pattern!r} needs {name}")
        if name not in needed and value is not None:
            users = [p for p, names in _PATTERN_ARGUMENTS.items() if name in names]
            raise ValueError(
                f"{name} is only used by pattern {' or '.join(map(repr, users))}, "
                f"not by pattern={pattern!r}; leave it out"
            )
    sizes = {name: _positive_size(name, given[name]) for name in ("window", "stride", "block_size")}
    layout = None if block_layout is None else _block_layout(block_layout)
    return SparsePattern(
        pattern,
        sizes["window"],
        sizes["stride"],
        layout,
        sizes["block_size"],
        boolean_flag("is_causal", is_causal),
    )


def _positive_size(name, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _block_layout(block_layout):
    layout = host_array("block_layout", block_layout)
    if layout.dtype != np.bool_:
        raise TypeError(
            f"block_layout must be boolean (True = the query block attends the key block), "
            f"got dtype {layout.dtype}"
        )
    if layout.ndim != 2:
        raise ValueError(
            f"block_layout must be 2-D (query blocks, key blocks), got shape {layout.shape}"
        )
    layout = layout.copy()
    layout.flags.writeable = False
    return layout


# --- sparse attention ---------------------------------------------------------------------


def sparse_attention(
    query,
    key,
    value,
    *,
    pattern,
    window=None,
    stride=None,
    block_layout=None,
    block_size=None,
    is_causal=False,
    scale=None,
    backend="auto",
):
    r"""Softmax attention restricted to a fixed sparsity pattern (Child et al. 2019).

    .. math::

        o_i = \sum_{j \in A_i} \frac{e^{s\, q_i \cdot k_j}}
              {\sum_{l \in A_i} e^{s\, q_i \cdot k_l}}\, v_j

    where :math:`A_i` is the set of keys query :math:`i` may attend (see
    :class:`SparsePattern`). This is exactly
    ``scaled_dot_product_attention(query, key, value, attn_mask=M)`` with
    ``M = sparse_attention_mask(...)``, but the kernels enumerate :math:`A_i`
    directly (runs of consecutive or equally spaced keys), so time is
    :math:`O(\text{pairs} \cdot (E + E_v))` and no :math:`L \times S` array
    is formed: a window :math:`w` costs :math:`O(n w d)`, and
    ``"local+strided"`` with :math:`w = s = \sqrt{n}` costs
    :math:`O(n \sqrt{n}\, d)` [Child2019]_.

    Parameters
    ----------
    query : array_like, shape (..., L, E)
    key : array_like, shape (..., S, E)
    value : array_like, shape (..., S, Ev)
        Leading dimensions broadcast against each other.
    pattern : {"local", "strided", "local+strided", "block"}
        Which keys each query attends (:class:`SparsePattern`).
    window : int, optional
        ``"local"`` and ``"local+strided"``: keys closer than ``window``
        positions, :math:`|i - j| < w`, :math:`w \ge 1`.
    stride : int, optional
        ``"strided"`` and ``"local+strided"``: keys a multiple of ``stride``
        away, :math:`s \ge 1`.
    block_layout : array_like of bool, shape (ceil(L / b), ceil(S / b)), optional
        ``"block"``: True where a block of queries attends a block of keys.
    block_size : int, optional
        ``"block"``: the side :math:`b` of a block.
    is_causal : bool, optional
        Also require :math:`j \le i`. A block layout with a block wholly above
        the diagonal contradicts it and is refused.
    scale : float, optional
        Multiplies :math:`q \cdot k`; default :math:`1/\sqrt{E}`.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Which implementation runs.

    Returns
    -------
    numpy.ndarray, shape (..., L, Ev)
        Same dtype rule as :func:`tfmath.scaled_dot_product_attention`. A query
        that attends no key gets 0.

    Raises
    ------
    ValueError
        For an invalid pattern (see :func:`sparse_pattern`), a block layout of
        the wrong shape, or ``is_causal`` contradicting the layout.
    TypeError
        For a pattern or size of the wrong type.
    ShapeError, DTypeError
        As for :func:`tfmath.scaled_dot_product_attention`.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.efficient import sparse_attention
    >>> q = k = np.zeros((4, 2))
    >>> v = np.arange(4.0)[:, None]
    >>> sparse_attention(q, k, v, pattern="local", window=2, is_causal=True,
    ...                  backend="reference")[:, 0]
    array([0. , 0.5, 1.5, 2.5])
    """
    backend = resolve_backend(backend, query, key, value)
    sparsity = sparse_pattern(
        pattern,
        window=window,
        stride=stride,
        block_layout=block_layout,
        block_size=block_size,
        is_causal=is_causal,
    )
    problem = _attention_problem(query, key, value, None, sparsity.is_causal, scale, False)
    sparsity.check_lengths(problem.n_query, problem.n_key)
    if backend != "cuda":
        problem = problem.on_host()
    return SPARSE_ATTENTION.implementation(backend)(problem, sparsity)


def sparse_attention_mask(
    n_query,
    n_key,
    *,
    pattern,
    window=None,
    stride=None,
    block_layout=None,
    block_size=None,
    is_causal=False,
):
    """The boolean mask equivalent to a sparsity pattern, for tests and plots.

    ``scaled_dot_product_attention(q, k, v, attn_mask=mask)`` with this mask
    equals :func:`sparse_attention` with the same pattern. The mask has
    :math:`L S` entries, which is what :func:`sparse_attention` avoids.

    Parameters
    ----------
    n_query, n_key : int
        :math:`L` and :math:`S`.
    pattern, window, stride, block_layout, block_size, is_causal
        As for :func:`sparse_attention`.

    Returns
    -------
    numpy.ndarray of bool, shape (n_query, n_key)
        True where the query attends the key.

    Examples
    --------
    >>> from tfmath.efficient import sparse_attention_mask
    >>> sparse_attention_mask(4, 4, pattern="strided", stride=2, is_causal=True).astype(int)
    array([[1, 0, 0, 0],
           [0, 1, 0, 0],
           [1, 0, 1, 0],
           [0, 1, 0, 1]])
    """
    for name, value in (("n_query", n_query), ("n_key", n_key)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    sparsity = sparse_pattern(
        pattern,
        window=window,
        stride=stride,
        block_layout=block_layout,
        block_size=block_size,
        is_causal=is_causal,
    )
    return sparsity.mask(int(n_query), int(n_key))


def default_window(n):
    r"""Child et al.'s window and stride for length :math:`n`: :math:`\lceil\sqrt{n}\rceil`."""
    return max(1, math.isqrt(max(n - 1, 0)) + 1)
