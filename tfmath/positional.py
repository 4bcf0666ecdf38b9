r"""Positional information: the sinusoidal encoding, RoPE, ALiBi, and token embedding.

The sinusoidal encoding of Vaswani et al. (2017, section 3.5) gives position
:math:`p` the vector

.. math::

    \mathrm{PE}_{p,\,2i} = \sin(\omega_i p), \qquad
    \mathrm{PE}_{p,\,2i+1} = \cos(\omega_i p), \qquad
    \omega_i = \text{base}^{-2i/d_{\text{model}}},

which is added to the token embeddings (:func:`embed`). Rotary embeddings
(RoPE, Su et al. 2021) instead rotate each query and key pair of features by
the angle :math:`\omega_i p` (:func:`rotary_embedding`), and ALiBi (Press et
al. 2022) adds a per-head linear penalty on the query–key distance to the
attention scores (:func:`alibi_bias`).

Accurate angles at any position
-------------------------------
Computing :math:`\omega_i p` in float64 and then its sine loses accuracy as
:math:`p` grows: the product is rounded to a relative :math:`2^{-53}`, so at
:math:`p = 10^6` the angle, and with it the encoding, is wrong by about
:math:`10^{-10}`. tfmath reduces the angle exactly instead. The frequency in
turns per position, :math:`f_i = \omega_i / 2\pi`, is computed once to 60
significant digits (Python's :mod:`decimal`) and stored as a 64-bit binary
fraction :math:`F_i = \lfloor 2^{64} f_i \rfloor`, split into two 32-bit
halves, plus the float64 remainder :math:`c_i = f_i - 2^{-64} F_i`. For an
integer position :math:`|p| < 2^{31}` the fractional part of :math:`p f_i` is
then

.. math::

    p f_i \equiv \left[(p F_i^{\text{high}}) \bmod 2^{32}\right] 2^{-32}
        + p F_i^{\text{low}}\, 2^{-64} + p\, c_i \pmod 1,

where both integer products fit in 63 bits, so they are exact; only the last
two terms are rounded, each by at most :math:`2^{-54}` turns. The sine and
cosine are then taken of :math:`2\pi r` with :math:`r \in [-\tfrac12, \tfrac12]`,
so every value is within a few units in the last place of the exact
encoding, at position :math:`2^{31} - 1` as at position 1. This is the idea of
Payne and Hanek's reduction ("Radian reduction for trigonometric
functions", SIGNUM Newsletter 18(1), 1983), done once per frequency
instead of once per argument.
"""

import math

import numpy as np

from tfmath import _cuda
from tfmath._contract.backend import resolve_backend
from tfmath._contract.checks import (
    boolean_flag,
    float_operand,
    host_array,
    integer,
    is_half,
    require_ndim,
)
from tfmath._contract.layout import as_batched_3d, shape_of
from tfmath._contract.positional import (
    FrequencyTable,
    check_position_range,
    frequency_table,
    output_dtype,
    wavelength_base,
)
from tfmath._contract.tensors import accepts_tensors
from tfmath._dispatch import implementation
from tfmath.errors import ArgumentError, DTypeError, ShapeError

__all__ = [
    "FrequencyTable",
    "alibi_bias",
    "alibi_slopes",
    "embed",
    "frequency_table",
    "rotary_embedding",
    "sinusoidal_encoding",
]


# --- sinusoidal encoding ----------------------------------------------------------------------


def sinusoidal_encoding(
    n_positions, d_model, *, base=10000.0, offset=0, dtype=np.float64, backend="auto"
):
    r"""The sinusoidal positional encoding of Vaswani et al., one row per position.

    .. math::

        \mathrm{PE}_{p,\,2i} = \sin(\omega_i p), \qquad
        \mathrm{PE}_{p,\,2i+1} = \cos(\omega_i p), \qquad
        \omega_i = \text{base}^{-2i/d_{\text{model}}},

    for positions :math:`p = \text{offset}, \dots, \text{offset} + n_{\text{positions}} - 1`
    (Vaswani et al. 2017, section 3.5, with base 10000).

    Parameters
    ----------
    n_positions : int
        Number of positions (rows), at least 0.
    d_model : int
        Encoding dimension (columns), at least 1. When it is odd, the last
        column is :math:`\sin(\omega_m p)` with :math:`m = (d_{\text{model}} - 1)/2`,
        whose cosine partner would be column :math:`d_{\text{model}}`.
    base : float, optional
        Wavelengths run geometrically from :math:`2\pi` to almost
        :math:`2\pi \cdot \text{base}`; greater than 1.
    offset : int, optional
        The first position, so that long encodings can be computed in blocks.
    dtype : {numpy.float64, numpy.float32}, optional
        Output dtype. The angles are reduced exactly and the sines computed in
        float64 either way, then rounded once.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Which implementation runs (see :func:`tfmath.backends`).

    Returns
    -------
    numpy.ndarray, shape (n_positions, d_model)
        Every value lies in :math:`[-1, 1]` and is within a few float64 units in
        the last place of the exact encoding for every :math:`|p| < 2^{31}`
        (see the notes of :mod:`tfmath.positional`).

    Raises
    ------
    ValueError
        For ``n_positions < 0``, ``d_model < 1``, ``base <= 1``, or positions
        outside :math:`(-2^{31}, 2^{31})`.
    TypeError
        For non-integer sizes, a non-real base or a dtype other than float32/float64.

    Examples
    --------
    >>> import tfmath.positional as tp
    >>> tp.sinusoidal_encoding(2, 4, backend="reference")
    array([[0.        , 1.        , 0.        , 1.        ],
           [0.84147098, 0.54030231, 0.00999983, 0.99995   ]])
    """
    n_positions = integer("n_positions", n_positions, minimum=0)
    d_model = integer("d_model", d_model, minimum=1)
    base = wavelength_base(base)
    offset = integer("offset", offset)
    dtype = output_dtype(dtype)
    check_position_range("offset and n_positions", offset, offset + max(n_positions - 1, 0))
    backend = resolve_backend(backend)
    table = frequency_table(d_model, base)
    return implementation("sinusoidal_encoding", backend)(
        n_positions, d_model, offset, table, dtype
    )


# --- rotary embedding -------------------------------------------------------------------------


@accepts_tensors
def rotary_embedding(x, positions=None, *, base=10000.0, backend="auto"):
    r"""Rotary position embedding (RoPE): rotate feature pairs by position-dependent angles.

    For a vector :math:`x` at position :math:`m` with an even number :math:`d`
    of features, each interleaved pair :math:`(x_{2i}, x_{2i+1})` is rotated by
    the angle :math:`m\theta_i`, :math:`\theta_i = \text{base}^{-2i/d}`
    (Su et al. 2021, equation 34):

    .. math::

        \begin{pmatrix} y_{2i} \\ y_{2i+1} \end{pmatrix} =
        \begin{pmatrix} \cos m\theta_i & -\sin m\theta_i \\
                        \sin m\theta_i & \cos m\theta_i \end{pmatrix}
        \begin{pmatrix} x_{2i} \\ x_{2i+1} \end{pmatrix}.

    Because rotations compose, :math:`\langle R_m q, R_n k\rangle = \langle q,
    R_{n-m} k\rangle` depends on the positions only through :math:`n - m`.

    Parameters
    ----------
    x : array_like, shape (..., n, d)
        Queries or keys, float16, bfloat16, float32 or float64 (half precision
        is rotated in float32 and rounded back once); ``d`` must be even.
    positions : array_like of int, shape (n,), optional
        The position of each of the ``n`` rows; default ``0, 1, ..., n - 1``.
        Every position must satisfy :math:`|m| < 2^{31}`.
    base : float, optional
        Greater than 1; 10000 in RoFormer.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Which implementation runs (see :func:`tfmath.backends`).

    Returns
    -------
    numpy.ndarray, shape (..., n, d)
        Same dtype as ``x``; a device array when ``x`` is one.

    Raises
    ------
    ShapeError
        When ``x`` has fewer than 2 dimensions, ``d`` is odd, or ``positions``
        is not of shape ``(n,)`` (a subclass of ``ValueError``).
    DTypeError
        For a non-floating ``x`` or non-integer ``positions`` (a subclass of ``TypeError``).

    Notes
    -----
    The pairs are interleaved, :math:`(x_0, x_1), (x_2, x_3), \dots`, as in the
    RoFormer paper. Some implementations (GPT-NeoX, Hugging Face's LLaMA) pair
    feature :math:`i` with feature :math:`i + d/2` instead; the two conventions
    differ by a fixed permutation of the features, applied to both queries and
    keys, so they give the same attention after that permutation.

    Examples
    --------
    >>> import numpy as np, tfmath.positional as tp
    >>> tp.rotary_embedding(np.array([[1.0, 0.0], [1.0, 0.0]]), backend="reference")
    array([[1.        , 0.        ],
           [0.54030231, 0.84147098]])
    """
    x = float_operand("x", x, half=True)
    require_ndim("x", x, 2, "(..., n, d)")
    n_rows, n_features = shape_of(x)[-2:]
    if n_features % 2:
        raise ShapeError(
            f"x must have an even number of features d (RoPE rotates pairs of them), "
            f"got shape {tuple(x.shape)}"
        )
    positions = _positions(positions, n_rows)
    base = wavelength_base(base)
    backend = resolve_backend(backend, x)
    if _cuda.is_device_array(x) and backend != "cuda":
        x = _cuda.to_host(x)
    table = frequency_table(max(n_features, 1), base)
    dtype = np.dtype(x.dtype)
    half = is_half(dtype)
    if half:  # rotated in float32 and rounded once, as the attention kernels compute
        x = implementation("widen", backend)(x)
    batch = math.prod(shape_of(x)[:-2])
    rows = as_batched_3d(x, batch)
    rotated = implementation("rotary_embedding", backend)(rows, positions, table)
    rotated = rotated.reshape(shape_of(x))
    return implementation("narrow", backend)(rotated, dtype) if half else rotated


def _positions(positions, n_rows):
    if positions is None:
        return np.arange(n_rows, dtype=np.int64)
    array = host_array("positions", _cuda.to_host(positions))
    # An empty list has NumPy's default float dtype but holds no non-integer.
    if array.dtype.kind not in "iu" and array.size:
        raise DTypeError(f"positions must be integers, got dtype {array.dtype}")
    if array.shape != (n_rows,):
        raise ShapeError(
            f"positions must have shape (n,) = ({n_rows},), one per row of x, "
            f"got shape {array.shape}"
        )
    if array.size:
        check_position_range("positions", int(array.min()), int(array.max()))
    return np.ascontiguousarray(array, dtype=np.int64)


# --- ALiBi ------------------------------------------------------------------------------------


def alibi_slopes(n_heads):
    r"""The per-head slopes of ALiBi (Press et al. 2022, section 3).

    For :math:`n` heads, :math:`n` a power of two, head :math:`h = 1, \dots, n`
    gets :math:`m_h = 2^{-8h/n}`: a geometric sequence starting and stepping at
    :math:`2^{-8/n}` (for 8 heads, :math:`1/2, 1/4, \dots, 1/256`). For other
    :math:`n`, with :math:`P = 2^{\lfloor \log_2 n \rfloor}`, the slopes are the
    :math:`P` slopes of :math:`P` heads followed by the first :math:`n - P` of the
    odd-numbered slopes of :math:`2P` heads, :math:`2^{-4(2j+1)/P}`, as in the
    authors' reference implementation (``get_slopes`` in
    github.com/ofirpress/attention_with_linear_biases).

    Parameters
    ----------
    n_heads : int
        At least 1.

    Returns
    -------
    numpy.ndarray of float64, shape (n_heads,)

    Examples
    --------
    >>> from tfmath.positional import alibi_slopes
    >>> alibi_slopes(4)
    array([0.25      , 0.0625    , 0.015625  , 0.00390625])
    """
    n_heads = integer("n_heads", n_heads, minimum=1)
    power = 1 << (n_heads.bit_length() - 1)
    slopes = np.exp2(-8.0 * np.arange(1, power + 1) / power)
    extra = np.exp2(-4.0 * (2 * np.arange(n_heads - power) + 1) / power)
    return np.concatenate([slopes, extra])


def alibi_bias(n_heads, n_query, n_key, *, dtype=np.float64, backend="auto"):
    r"""The ALiBi attention bias: a linear penalty on query–key distance, one slope per head.

    .. math:: B_{h,i,j} = -m_h\, |i - j|,

    with the slopes :math:`m_h` of :func:`alibi_slopes`. Query :math:`i` and key
    :math:`j` sit at positions :math:`i` and :math:`j` (the top-left alignment
    of ``is_causal=True`` in :func:`tfmath.scaled_dot_product_attention`).

    Parameters
    ----------
    n_heads, n_query, n_key : int
        At least 1, 0 and 0.
    dtype : {numpy.float64, numpy.float32}, optional
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Which implementation runs (see :func:`tfmath.backends`).

    Returns
    -------
    numpy.ndarray, shape (n_heads, n_query, n_key)
        Pass it as ``attn_mask`` to :func:`tfmath.scaled_dot_product_attention`
        with queries of shape ``(..., n_heads, n_query, E)``.

    Notes
    -----
    Press et al. train causal language models: they add
    :math:`-m_h (i - j)` for the keys :math:`j \le i` that the causal mask keeps,
    which is :math:`B` on those keys. For :math:`j > i`, which their models never
    see, :math:`B` uses the distance :math:`|i - j|` (the symmetric extension
    used for bidirectional attention) rather than the raw :math:`m_h (j - i)`,
    which would favour far-future keys when no causal mask is applied.

    Examples
    --------
    >>> import tfmath.positional as tp
    >>> tp.alibi_bias(8, 3, 3, backend="reference")[0]  # head 1 of 8: slope 1/2
    array([[ 0. , -0.5, -1. ],
           [-0.5,  0. , -0.5],
           [-1. , -0.5,  0. ]])
    """
    slopes = alibi_slopes(n_heads)
    n_query = integer("n_query", n_query, minimum=0)
    n_key = integer("n_key", n_key, minimum=0)
    dtype = output_dtype(dtype)
    backend = resolve_backend(backend)
    return implementation("alibi_bias", backend)(slopes.astype(dtype), n_query, n_key)


# --- embedding --------------------------------------------------------------------------------

_POSITIONAL_CHOICES = ("sinusoidal", None, "an array of shape (n_max, d_model)")


@accepts_tensors
def embed(
    tokens,
    embedding_matrix,
    *,
    positional="sinusoidal",
    scale_by_sqrt_d=True,
    base=10000.0,
    backend="auto",
):
    r"""Token embeddings plus positional encodings: the input of a transformer.

    .. math:: X_{t} = s\, E_{\text{tokens}[t]} + P_t, \qquad
              s = \sqrt{d_{\text{model}}} \text{ or } 1,

    where row :math:`t` of each sequence is position :math:`t` and :math:`P` is
    the sinusoidal encoding (:func:`sinusoidal_encoding`), a given table, or
    zero. Vaswani et al. (2017, section 3.4) multiply the embedding weights by
    :math:`\sqrt{d_{\text{model}}}`, so that embeddings of variance
    :math:`1/d_{\text{model}}` are of the same order as the encoding's entries.

    Parameters
    ----------
    tokens : array_like of int, shape (..., n)
        Token ids in ``0, ..., vocab_size - 1``; the last axis is the sequence.
    embedding_matrix : array_like, shape (vocab_size, d_model)
        float32 or float64.
    positional : {"sinusoidal", None} or array_like, optional
        ``"sinusoidal"`` adds :func:`sinusoidal_encoding`; None adds nothing
        (the permutation-equivariant case); an array of shape
        ``(n_max, d_model)``, ``n_max >= n``, adds its first ``n`` rows (a
        learned encoding, say). RoPE and ALiBi act inside attention instead:
        see :func:`rotary_embedding` and :func:`alibi_bias`.
    scale_by_sqrt_d : bool, optional
        Multiply the embeddings by :math:`\sqrt{d_{\text{model}}}`.
    base : float, optional
        Base of the sinusoidal encoding.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Which implementation runs (see :func:`tfmath.backends`).

    Returns
    -------
    numpy.ndarray, shape (..., n, d_model)
        In the dtype NumPy promotes ``embedding_matrix`` and a given
        positional table to (the matrix's own dtype otherwise).

    Raises
    ------
    TypeError
        For non-integer tokens, a non-floating embedding matrix or table, or a
        non-boolean ``scale_by_sqrt_d``.
    ValueError
        For tokens outside the vocabulary, a matrix that is not 2-D, a table
        of the wrong shape, or an unknown ``positional``.

    Examples
    --------
    >>> import numpy as np, tfmath.positional as tp
    >>> tp.embed([1, 0], np.eye(2), scale_by_sqrt_d=False, backend="reference")
    array([[0.        , 2.        ],
           [1.84147098, 0.54030231]])
    """
    embedding_matrix = float_operand("embedding_matrix", _cuda.to_host(embedding_matrix))
    if embedding_matrix.ndim != 2:
        raise ShapeError(
            f"embedding_matrix must have shape (vocab_size, d_model), "
            f"got shape {embedding_matrix.shape}"
        )
    vocab_size, d_model = embedding_matrix.shape
    tokens = _tokens(tokens, vocab_size)
    n_rows = tokens.shape[-1]
    table = _positional_table(positional, n_rows, d_model)
    scale = math.sqrt(d_model) if boolean_flag("scale_by_sqrt_d", scale_by_sqrt_d) else 1.0
    base = wavelength_base(base)
    backend = resolve_backend(backend)
    dtype = embedding_matrix.dtype
    if isinstance(table, np.ndarray):
        dtype = np.result_type(dtype, table.dtype)
    if isinstance(table, str):
        table = sinusoidal_encoding(n_rows, d_model, base=base, dtype=dtype, backend=backend)
    if table is not None:
        table = np.ascontiguousarray(table[:n_rows], dtype=dtype)
    matrix = np.ascontiguousarray(embedding_matrix, dtype=dtype)
    rows = tokens.reshape(math.prod(tokens.shape[:-1]), n_rows)
    embedded = implementation("embed", backend)(rows, matrix, table, dtype.type(scale))
    return embedded.reshape((*tokens.shape, d_model))


def _tokens(tokens, vocab_size):
    array = host_array("tokens", _cuda.to_host(tokens))
    if array.dtype.kind not in "iu" and array.size:
        raise DTypeError(f"tokens must be integer token ids, got dtype {array.dtype}")
    if array.ndim < 1:
        raise ShapeError(f"tokens must have at least 1 dimension (..., n), got shape {array.shape}")
    if array.size:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= vocab_size:
            culprit = low if low < 0 else high
            raise ArgumentError(
                f"tokens must lie in 0 .. {vocab_size - 1} (the rows of embedding_matrix), "
                f"got token {culprit}"
            )
    return np.ascontiguousarray(array, dtype=np.int64)


def _positional_table(positional, n_rows, d_model):
    """None, the string "sinusoidal", or a validated float table with at least n_rows rows."""
    if positional is None or (isinstance(positional, str) and positional == "sinusoidal"):
        return positional
    if isinstance(positional, str):
        if positional in ("rotary", "rope", "alibi"):
            raise ArgumentError(
                f"positional={positional!r} is not added to embeddings: RoPE rotates queries "
                "and keys (tfmath.positional.rotary_embedding) and ALiBi biases the scores "
                "(tfmath.positional.alibi_bias); use positional=None here"
            )
        raise ArgumentError(f"positional must be one of {_POSITIONAL_CHOICES}, got {positional!r}")
    table = float_operand("positional", _cuda.to_host(positional))
    if table.ndim != 2 or table.shape[1] != d_model or table.shape[0] < n_rows:
        raise ShapeError(
            f"positional must have shape (n_max, d_model) with n_max >= n = {n_rows} and "
            f"d_model = {d_model}, got shape {table.shape}"
        )
    return table
