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

from tfmath._contract.attention import attention_problem
from tfmath._contract.backend import resolve_backend
from tfmath._contract.checks import choice, integer, real
from tfmath._contract.efficient import FEATURE_MAPS, PATTERNS, SparsePattern, sparse_pattern
from tfmath._contract.tensors import accepts_tensors
from tfmath._dispatch import narrowed, run

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

# --- linear attention ---------------------------------------------------------------------


@accepts_tensors
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
        The inputs' dtype promoted as NumPy does (float32 when every input is float32,
        float64 when one is); float16 and bfloat16 inputs are computed in float32 and
        returned in their dtype. A device array when an input was one.

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
    feature_code = FEATURE_MAPS.index(choice("feature_map", feature_map, FEATURE_MAPS))
    eps = real("eps", eps, at_least=0.0)
    problem = attention_problem(
        query, key, value, None, is_causal, 1.0, backend=resolve_backend(backend, query, key, value)
    )
    return narrowed(problem, run("linear_attention", problem, feature_code, eps))


# --- sparse attention ---------------------------------------------------------------------


@accepts_tensors
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
    sparsity = sparse_pattern(
        pattern,
        window=window,
        stride=stride,
        block_layout=block_layout,
        block_size=block_size,
        is_causal=is_causal,
    )
    problem = attention_problem(
        query,
        key,
        value,
        None,
        sparsity.is_causal,
        scale,
        backend=resolve_backend(backend, query, key, value),
    )
    sparsity.check_lengths(problem.n_query, problem.n_key)
    return narrowed(problem, run("sparse_attention", problem, sparsity))


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
    n_query = integer("n_query", n_query, minimum=0)
    n_key = integer("n_key", n_key, minimum=0)
    sparsity = sparse_pattern(
        pattern,
        window=window,
        stride=stride,
        block_layout=block_layout,
        block_size=block_size,
        is_causal=is_causal,
    )
    return sparsity.mask(n_query, n_key)


def default_window(n):
    r"""Child et al.'s window and stride for length :math:`n \ge 1`:
    :math:`\lceil\sqrt{n}\rceil`."""
    n = integer("n", n, minimum=1)
    return math.isqrt(n - 1) + 1
