"""Exact operation and memory counts: seed 000's complexity table, the variants, the depth."""

from dataclasses import dataclass

from tfmath._contract.checks import integer
from tfmath.efficient import default_window, sparse_pattern
from tfmath.errors import ArgumentError

#: Operations per score in a stable softmax: the running maximum, the
#: subtraction, the exponential, the sum and the division.
SOFTMAX_FLOPS_PER_SCORE = 5
#: The window of the ``"local"`` variant in the sweeps: :math:`2w - 1 = 255` keys per query.
LOCAL_WINDOW = 128
#: The variants :func:`variant_cost` and :data:`WORKLOADS` know.
VARIANTS = ("naive", "flash", "linear", "local", "strided", "local+strided", "rnn")


@dataclass(frozen=True)
class OperationCost:
    """One row of the seed's complexity table, counted exactly.

    Attributes
    ----------
    operation : str
    flops : int
        Floating-point operations.
    memory : int
        Elements of the array the operation produces (what must be held).
    time_order, space_order : str
        The seed's :math:`O(\\cdot)` entries.
    """

    operation: str
    flops: int
    memory: int
    time_order: str
    space_order: str


def attention_operation_costs(n, d, *, heads=1, batch=1):
    r"""Seed 000's complexity table for self-attention of ``n`` tokens, head size ``d``.

    Per head:

    ===============  ===================================  ============
    operation        FLOPs                                memory
    ===============  ===================================  ============
    :math:`QK^\top`  :math:`2n^2 d` (:math:`O(n^2 d)`)    :math:`n^2`
    softmax          :math:`5n^2` (:math:`O(n^2)`)        :math:`n^2`
    :math:`AV`       :math:`2n^2 d` (:math:`O(n^2 d)`)    :math:`nd`
    ===============  ===================================  ============

    (a length-:math:`d` dot product is :math:`d` multiplications and
    :math:`d` additions; the softmax count is :data:`SOFTMAX_FLOPS_PER_SCORE`
    per score), times ``heads * batch``.

    Returns
    -------
    list of OperationCost

    Examples
    --------
    >>> from tfmath.analysis.complexity import attention_operation_costs
    >>> [c.flops for c in attention_operation_costs(4, 2)]
    [64, 80, 64]
    """
    copies = integer("heads", heads, minimum=1) * integer("batch", batch, minimum=1)
    n, d = integer("n", n, minimum=1), integer("d", d, minimum=1)
    return [
        OperationCost("QK^T", copies * 2 * n * n * d, copies * n * n, "O(n^2 d)", "O(n^2)"),
        OperationCost(
            "softmax", copies * SOFTMAX_FLOPS_PER_SCORE * n * n, copies * n * n, "O(n^2)", "O(n^2)"
        ),
        OperationCost("AV", copies * 2 * n * n * d, copies * n * d, "O(n^2 d)", "O(n d)"),
    ]


@dataclass(frozen=True)
class VariantCost:
    """What one call of an attention variant (or the RNN) costs.

    Attributes
    ----------
    variant : str
    flops : int
        Floating-point operations.
    memory : int
        Elements allocated beyond the inputs: the output and the working arrays
        whose size depends on :math:`n` (the :math:`n \\times n` weights for
        ``"naive"``; constant-size tiles are left out).
    pairs : int
        Query-key pairs scored (0 for linear attention and the RNN).
    sequential_steps : int
        Steps that must run one after another along the sequence.
    time_order, memory_order : tuple of float
        The exponents :math:`(a, b)` of :math:`n^a d^b` for large :math:`n`.
    """

    variant: str
    flops: int
    memory: int
    pairs: int
    sequential_steps: int
    time_order: tuple
    memory_order: tuple


def variant_cost(variant, n, d, *, heads=1, batch=1, window=None, stride=None, is_causal=False):
    r"""FLOPs and memory of one call of ``variant`` on ``n`` tokens of head size ``d``.

    With :math:`P` the attended pairs per head (:math:`n^2`, or
    :math:`n(n+1)/2` when causal; the pattern's count for sparse variants),
    every softmax attention costs :math:`P(4d + 5)` FLOPs: :math:`2d` for a
    score, 5 for its softmax, :math:`2d` to add its value. The others:

    ``"linear"`` [Katharopoulos2020]_
        :math:`\phi(K)^\top V` and :math:`\phi(Q) S`: :math:`4 n d^2`, plus
        :math:`4 n d` for the normaliser and its dot products, and :math:`2 n d`
        feature maps: :math:`O(n d^2)` time, :math:`d^2 + nd` memory.
    ``"rnn"`` [Elman1990]_
        Per step :math:`W_{xh} x_t` and :math:`W_{hh} h_{t-1}` (:math:`4d^2`),
        the bias and the :math:`\tanh` (:math:`2d`): :math:`n(4d^2 + 2d)`
        FLOPs in :math:`n` sequential steps, :math:`2nd` memory (projected
        inputs and states).

    Parameters
    ----------
    variant : {"naive", "flash", "linear", "local", "strided", "local+strided", "rnn"}
        ``"naive"`` is exact attention that forms the :math:`n \times n`
        weights (:math:`O(n^2)` memory), ``"flash"`` the same result in tiles
        (:math:`O(nd)`).
    n, d : int
        Sequence length and head size (key, query and value width).
    heads, batch : int, optional
        Everything scales with ``heads * batch``, except the RNN's steps.
    window, stride : int, optional
        For the sparse variants; default :data:`LOCAL_WINDOW` for ``"local"``
        and :math:`\lceil\sqrt{n}\rceil` otherwise (Child et al.'s choice).
    is_causal : bool, optional

    Returns
    -------
    VariantCost

    Examples
    --------
    >>> from tfmath.analysis.complexity import variant_cost
    >>> variant_cost("flash", 1024, 64).flops == 1024**2 * (4 * 64 + 5)
    True
    >>> variant_cost("rnn", 1024, 64).sequential_steps
    1024
    """
    if variant not in VARIANTS:
        raise ArgumentError(f"variant must be one of {VARIANTS}, got {variant!r}")
    n, d = integer("n", n, minimum=1), integer("d", d, minimum=1)
    copies = integer("heads", heads, minimum=1) * integer("batch", batch, minimum=1)
    if variant == "rnn":
        return VariantCost(
            variant, copies * n * (4 * d * d + 2 * d), copies * 2 * n * d, 0, n, (1, 2), (1, 1)
        )
    if variant == "linear":
        flops = copies * (4 * n * d * d + 6 * n * d)
        return VariantCost(variant, flops, copies * (d * d + n * d), 0, 1, (1, 2), (1, 1))
    pairs = _pairs(variant, n, window, stride, is_causal)
    flops = copies * pairs * (4 * d + SOFTMAX_FLOPS_PER_SCORE)
    if variant in ("naive", "flash"):
        time_order = (2, 1)
    elif variant == "local":
        time_order = (1, 1)
    else:
        # A stride s reaches n / s keys per query: n^1.5 with s = sqrt(n), n^2 with s fixed.
        time_order = (1.5, 1) if stride is None else (2, 1)
    memory = copies * (n * n + n * d) if variant == "naive" else copies * n * d
    memory_order = (2, 0) if variant == "naive" else (1, 1)
    return VariantCost(variant, flops, memory, pairs, 1, time_order, memory_order)


def _pairs(variant, n, window, stride, is_causal):
    if variant in ("naive", "flash"):
        return n * (n + 1) // 2 if is_causal else n * n
    arguments = sparse_arguments(variant, n, window, stride)
    return sparse_pattern(variant, is_causal=is_causal, **arguments).n_pairs(n, n)


@dataclass(frozen=True)
class SequentialDepth:
    """How much of a computation must run in order.

    Attributes
    ----------
    steps : int
        Steps along the sequence that depend on each other (an RNN's :math:`n`;
        1 for attention, whose positions are all computed at once).
    critical_path : int
        Operations on the longest chain of dependent operations, with every
        sum of :math:`m` terms done as a tree of depth :math:`\\lceil \\log_2 m
        \\rceil`: the time with unboundedly many processors.
    """

    steps: int
    critical_path: int


def sequential_depth(variant, n, d):
    r"""The dependent steps and critical path of attention or the RNN on ``n`` tokens.

    Attention (every softmax variant): a score is a dot product
    (:math:`1 + \lceil\log_2 d\rceil`: the products in parallel, then a
    tree), the softmax a tree maximum, the subtraction and exponential, a
    tree sum and the division (:math:`2\lceil\log_2 n\rceil + 3`), and the
    output a tree sum over keys (:math:`1 + \lceil\log_2 n\rceil`): depth
    :math:`O(\log n + \log d)` in one step. The RNN: each step is a matrix-vector
    product over :math:`2d` inputs (:math:`1 + \lceil\log_2 2d\rceil`), the
    bias and the :math:`\tanh` (2), and the :math:`n` steps are a chain:
    depth :math:`n(\lceil\log_2 2d\rceil + 3)`, linear in :math:`n` [Seed003]_.

    Examples
    --------
    >>> from tfmath.analysis.complexity import sequential_depth
    >>> sequential_depth("rnn", 100, 64).critical_path
    1000
    """
    n, d = integer("n", n, minimum=1), integer("d", d, minimum=1)
    log2 = _ceil_log2
    if variant == "rnn":
        return SequentialDepth(n, n * (log2(2 * d) + 3))
    if variant not in VARIANTS:
        raise ArgumentError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return SequentialDepth(1, (1 + log2(d)) + (2 * log2(n) + 3) + (1 + log2(n)))


def _ceil_log2(m):
    return max(int(m - 1).bit_length(), 0)


def sparse_arguments(variant, n, window, stride):
    arguments = {}
    if variant in ("local", "local+strided"):
        default = LOCAL_WINDOW if variant == "local" else default_window(n)
        arguments["window"] = default if window is None else window
    if variant in ("strided", "local+strided"):
        arguments["stride"] = default_window(n) if stride is None else stride
    return arguments
