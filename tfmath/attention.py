r"""Exact attention: softmax and scaled dot-product attention.

.. math::

    \operatorname{Attention}(Q, K, V) = \operatorname{softmax}\!\left(
        \frac{Q K^\top}{\sqrt{d_k}} + M \right) V

Each public function validates its arguments once, resolves the backend,
calls the registered implementation and packages the result. The kernels
live in :mod:`tfmath.kernels` and the NumPy oracles in :mod:`tfmath.reference`.
"""

import math
from dataclasses import dataclass

import numpy as np

from tfmath import _cuda
from tfmath._dispatch import register, resolve_backend
from tfmath._validation import (
    as_batched_3d,
    batch_index,
    boolean_flag,
    broadcast_batch_shapes,
    float_operand,
    host_array,
    real_scalar,
    require_ndim,
    shape_of,
)
from tfmath.errors import DTypeError, ShapeError

__all__ = ["attention_grad", "scaled_dot_product_attention", "softmax"]

SOFTMAX = register(
    "softmax",
    cpu="tfmath.kernels.cpu.attention:softmax_rows",
    cuda="tfmath.kernels.cuda.attention:softmax_rows",
    reference="tfmath.reference.attention:softmax_rows",
)

SCALED_DOT_PRODUCT_ATTENTION = register(
    "scaled_dot_product_attention",
    cpu="tfmath.kernels.cpu.attention:scaled_dot_product_attention",
    cuda="tfmath.kernels.cuda.attention:scaled_dot_product_attention",
    reference="tfmath.reference.attention:scaled_dot_product_attention",
)

FLASH_ATTENTION = register(
    "flash_attention",
    cpu="tfmath.kernels.cpu.flash_attention:scaled_dot_product_attention",
    cuda="tfmath.kernels.cuda.flash_attention:scaled_dot_product_attention",
    # The math is the naive path's plus each row's log-sum-exp; only the order of work differs.
    reference="tfmath.reference.attention:flash_attention",
)

ATTENTION_GRAD = register(
    "attention_grad",
    cpu="tfmath.kernels.cpu.flash_attention:attention_grad",
    cuda="tfmath.kernels.cuda.flash_attention:attention_grad",
    reference="tfmath.reference.attention:attention_grad",
)

_METHODS = ("auto", "naive", "flash")


def softmax(x, axis=-1, *, backend="auto"):
    r"""Numerically stable softmax along one axis.

    .. math:: \operatorname{softmax}(x)_j = \frac{e^{x_j - m}}{\sum_k e^{x_k - m}},
              \qquad m = \max_k x_k

    Subtracting the maximum changes nothing mathematically and keeps every
    exponent :math:`\le 0`, so large logits cannot overflow.

    Parameters
    ----------
    x : array_like
        Logits, float32 or float64 (nested Python sequences become float64).
    axis : int, optional
        The axis to normalise over. Default: the last.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Which implementation runs (see :func:`tfmath.backends`).

    Returns
    -------
    numpy.ndarray
        Same shape and dtype as ``x``; a device array when ``x`` is one.

    Notes
    -----
    A slice whose entries are all ``-inf`` has nothing to normalise and gives
    zeros, the convention :func:`scaled_dot_product_attention` uses for a
    query that may attend to nothing. NaN anywhere in a slice makes the whole
    slice NaN.

    Examples
    --------
    >>> import tfmath
    >>> tfmath.softmax([0.0, 0.0, float("-inf")], backend="reference")
    array([0.5, 0.5, 0. ])
    """
    x = float_operand("x", x)
    require_ndim("x", x, 1, "(the axis to normalise over)")
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        raise DTypeError(f"axis must be an integer, got {axis!r}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for x of shape {tuple(x.shape)}")
    backend = resolve_backend(backend, x)
    axis = axis % x.ndim
    if _cuda.is_device_array(x) and backend != "cuda":
        x = _cuda.to_host(x)
    if _cuda.is_device_array(x) and axis != x.ndim - 1:
        raise ValueError(
            f"softmax of a device array runs along its last axis only, got axis={axis} "
            f"for shape {tuple(x.shape)}; move the axis on the device first"
        )
    if x.size == 0:
        return x.copy()
    moved = x if _cuda.is_device_array(x) else np.ascontiguousarray(np.moveaxis(x, axis, -1))
    rows = moved.reshape(-1, shape_of(moved)[-1])
    result = SOFTMAX.implementation(backend)(rows).reshape(moved.shape)
    if _cuda.is_device_array(result):
        return result
    return np.moveaxis(result, -1, axis)


@dataclass(frozen=True)
class AttentionProblem:
    """Validated inputs of one attention call, as every backend receives them.

    The reference implementation reads the arrays as the user shaped them
    (after dtype conversion); the kernels call :meth:`kernel_operands`.
    """

    query: object
    key: object
    value: object
    attn_mask: object
    is_causal: bool
    scale: float
    return_weights: bool
    batch_shape: tuple
    dtype: np.dtype

    @property
    def n_query(self):
        return shape_of(self.query)[-2]

    @property
    def n_features(self):
        return shape_of(self.query)[-1]

    @property
    def n_key(self):
        return shape_of(self.key)[-2]

    @property
    def value_dim(self):
        return shape_of(self.value)[-1]

    @property
    def on_device(self):
        return any(_cuda.is_device_array(a) for a in (self.query, self.key, self.value))

    def output_shape(self):
        return (*self.batch_shape, self.n_query, self.value_dim)

    def weights_shape(self):
        return (*self.batch_shape, self.n_query, self.n_key)

    def additive_mask(self):
        """The mask as a bias of the compute dtype (boolean False becomes ``-inf``), or None."""
        mask = self.attn_mask
        if mask is None or mask.dtype != np.bool_:
            return mask
        return np.where(mask, 0.0, -np.inf).astype(self.dtype)

    def kernel_operands(self):
        """The operands as the kernels take them.

        Returns
        -------
        query, key, value : arrays of shape ``(batch, rows, features)``
            Each operand's own batch dimensions flattened (no broadcast copies).
        mask : array of shape ``(mask_batch, L, S)``, or None
            Additive bias, broadcast over its last two dimensions only.
        index : int64 array of shape ``(prod(batch_shape), 4)``
            For each output batch entry, the batch entry of query, key, value
            and mask to read.
        """
        operands = {"query": self.query, "key": self.key, "value": self.value}
        mask = self.additive_mask()
        if mask is not None:
            mask_batch = shape_of(mask)[:-2]
            operands["mask"] = np.broadcast_to(mask, (*mask_batch, self.n_query, self.n_key))
        flat = []
        columns = []
        for array in operands.values():
            batch = shape_of(array)[:-2]
            flat.append(as_batched_3d(array, math.prod(batch)))
            columns.append(batch_index(batch, self.batch_shape))
        if mask is None:
            flat.append(None)
            columns.append(np.zeros(math.prod(self.batch_shape), dtype=np.int64))
        index = np.ascontiguousarray(np.stack(columns, axis=1))
        return (*flat, index)

    def on_host(self):
        """The same problem with every operand copied to host memory."""
        if not self.on_device:
            return self
        return AttentionProblem(
            _cuda.to_host(self.query),
            _cuda.to_host(self.key),
            _cuda.to_host(self.value),
            self.attn_mask,
            self.is_causal,
            self.scale,
            self.return_weights,
            self.batch_shape,
            self.dtype,
        )


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    is_causal=False,
    scale=None,
    *,
    return_weights=False,
    return_log_sum_exp=False,
    method="auto",
    backend="auto",
):
    r"""Exact scaled dot-product attention, with the semantics of PyTorch's function.

    .. math::

        \operatorname{Attention}(Q, K, V) = \operatorname{softmax}\!\left(
            s\,Q K^\top + M \right) V, \qquad s = \frac{1}{\sqrt{E}}

    Parameters
    ----------
    query : array_like, shape (..., L, E)
        Queries; leading dimensions are batch and heads.
    key : array_like, shape (..., S, E)
        Keys.
    value : array_like, shape (..., S, Ev)
        Values. The leading dimensions of query, key, value and the mask
        broadcast against each other.
    attn_mask : array_like, optional
        Broadcastable to ``(..., L, S)``. Boolean: True where the query may
        attend to the key. Floating: added to the scaled scores, so ``-inf``
        forbids a pair.
    is_causal : bool, optional
        Let query ``i`` attend only to keys ``j <= i`` (the top-left-aligned
        lower triangle, as in PyTorch). Combines with ``attn_mask``.
    scale : float, optional
        Multiplies :math:`QK^\top`; default :math:`1/\sqrt{E}`.
    return_weights : bool, optional
        Also return the attention weights ``softmax(s Q K^T + M)``.
    return_log_sum_exp : bool, optional
        Also return each row's log-sum-exp of its scores,
        :math:`\log \sum_j e^{s\,q_i \cdot k_j + M_{ij}}` (``-inf`` for a row
        with nothing to attend): what the flash forward keeps for the
        backward. Pass it, with the output, to :func:`attention_grad` to spare
        the backward a second forward pass. Flash method only.
    method : {"auto", "naive", "flash"}, optional
        ``"naive"`` forms each row of weights in full; ``"flash"`` sweeps
        key/value tiles with an online softmax (FlashAttention) and never
        holds more than a tile of scores, so memory stays :math:`O((L+S)d)`;
        it cannot return the weights. ``"auto"`` is flash unless
        ``return_weights=True``. Both give the same result to rounding.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Which implementation runs (see :func:`tfmath.backends`).

    Returns
    -------
    output : numpy.ndarray, shape (..., L, Ev)
        The attention output: float32 when every input is float32, else float64. A device array
        when query, key or value was one.
    weights : numpy.ndarray, shape (..., L, S)
        Only with ``return_weights=True``.
    log_sum_exp : numpy.ndarray, shape (..., L)
        Only with ``return_log_sum_exp=True``.

    Raises
    ------
    ShapeError
        When E differs between query and key, S between key and value, the
        batch dimensions or the mask do not broadcast, or an input has fewer
        than two dimensions (a subclass of ``ValueError``).
    DTypeError
        For integer, boolean, complex or half-precision arrays (a subclass of
        ``TypeError``).
    BackendUnavailableError
        For an unknown backend, or ``"cuda"`` without a GPU.

    Notes
    -----
    The softmax subtracts each row's maximum, so large logits do not
    overflow. A query that may attend to no key (a fully masked row, or
    ``S == 0``) gets output 0 and weights 0, as PyTorch does. NaN in an
    attended position makes the row NaN; positions masked out (weight exactly
    0) are never read, so garbage in padding cannot leak into the output.

    Examples
    --------
    >>> import numpy as np, tfmath
    >>> q = k = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    >>> v = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    >>> out = tfmath.scaled_dot_product_attention(q, k, v, backend="reference")
    >>> out.shape
    (3, 2)
    """
    backend = resolve_backend(backend, query, key, value, attn_mask)
    problem = _attention_problem(query, key, value, attn_mask, is_causal, scale, return_weights)
    return_log_sum_exp = boolean_flag("return_log_sum_exp", return_log_sum_exp)
    routine = _attention_routine(method, problem.return_weights, return_log_sum_exp)
    if backend != "cuda":
        problem = problem.on_host()
    output, extra = routine.implementation(backend)(problem)
    if problem.return_weights or return_log_sum_exp:
        return output, extra
    return output


def _attention_routine(method, return_weights, return_log_sum_exp):
    if not isinstance(method, str) or method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if return_weights and return_log_sum_exp:
        raise ValueError(
            "return_weights and return_log_sum_exp come from different methods "
            "(naive and flash); ask for one of them"
        )
    if method == "flash" and return_weights:
        raise ValueError(
            "method='flash' never forms the attention weights, so it cannot return them; "
            "use method='naive' (or 'auto') with return_weights=True"
        )
    if method == "naive" and return_log_sum_exp:
        raise ValueError(
            "the log-sum-exp is kept by method='flash' (or 'auto'), not by method='naive'"
        )
    if method == "naive" or return_weights:
        return SCALED_DOT_PRODUCT_ATTENTION
    return FLASH_ATTENTION


def attention_grad(
    query,
    key,
    value,
    grad_output,
    attn_mask=None,
    is_causal=False,
    scale=None,
    *,
    output=None,
    log_sum_exp=None,
    backend="auto",
):
    r"""Gradients of scaled dot-product attention with respect to query, key and value.

    With :math:`S = s\,QK^\top + M`, :math:`P = \operatorname{softmax}(S)`,
    :math:`O = PV` and the incoming gradient :math:`dO`:

    .. math::

        dV = P^\top dO, \qquad dP = dO\,V^\top, \qquad
        dS = P \circ \left(dP - \operatorname{rowsum}(dO \circ O)\right),

        dQ = s\, dS\, K, \qquad dK = s\, dS^\top Q

    The ``cpu`` and ``cuda`` backends run the FlashAttention-2 backward
    (Dao 2023): the forward pass keeps each row's log-sum-exp, and the
    backward recomputes :math:`P` tile by tile from it, so, as in the forward
    pass, no :math:`L \times S` matrix is ever held. Rows with nothing to
    attend contribute no gradient.

    Parameters
    ----------
    query, key, value, attn_mask, is_causal, scale
        As for :func:`scaled_dot_product_attention`.
    grad_output : array_like, shape (..., L, Ev)
        Gradient of the loss with respect to the attention output.
    output, log_sum_exp : array_like, optional
        The forward pass's output, shape (..., L, Ev), and log-sum-exp, shape
        (..., L), as ``scaled_dot_product_attention(...,
        return_log_sum_exp=True)`` returns them for the same inputs. Given
        together, the backward uses them instead of running the forward
        again, as a training step does.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Which implementation runs.

    Returns
    -------
    grad_query, grad_key, grad_value : numpy.ndarray
        Same shapes as ``query``, ``key`` and ``value``; where an operand was
        broadcast, its gradient is summed over the broadcast dimensions.

    Notes
    -----
    The result is deterministic: the same inputs (and, on the CPU, thread
    count) give the same bits; no backend sums with atomic additions. NaN or
    inf anywhere in the inputs makes the affected gradients NaN.

    Examples
    --------
    >>> import numpy as np, tfmath
    >>> q = k = v = np.eye(3)
    >>> dq, dk, dv = tfmath.attention_grad(q, k, v, np.ones((3, 3)), backend="reference")
    >>> dv.shape
    (3, 3)
    """
    backend = resolve_backend(backend, query, key, value, grad_output, attn_mask)
    problem = _attention_problem(query, key, value, attn_mask, is_causal, scale, False)
    grad_output = _cast("grad_output", float_operand("grad_output", grad_output), problem.dtype)
    if shape_of(grad_output) != problem.output_shape():
        raise ShapeError(
            f"grad_output must have the attention output's shape {problem.output_shape()}, "
            f"got {shape_of(grad_output)}"
        )
    saved = _saved_forward(problem, output, log_sum_exp)
    if backend != "cuda":
        problem = problem.on_host()
        grad_output = _cuda.to_host(grad_output)
        if saved is not None:
            saved = tuple(_cuda.to_host(a) for a in saved)
    grads = ATTENTION_GRAD.implementation(backend)(problem, grad_output, saved)
    return tuple(
        _sum_to_shape(grad, shape_of(operand))
        for grad, operand in zip(grads, (problem.query, problem.key, problem.value), strict=True)
    )


def _saved_forward(problem, output, log_sum_exp):
    """Check the forward's saved ``(output, log_sum_exp)``, or return None if not given."""
    if output is None and log_sum_exp is None:
        return None
    if output is None or log_sum_exp is None:
        raise ValueError(
            "output and log_sum_exp come together from the forward pass; pass both or neither"
        )
    saved = []
    for name, array, shape in (
        ("output", output, problem.output_shape()),
        ("log_sum_exp", log_sum_exp, (*problem.batch_shape, problem.n_query)),
    ):
        array = _cast(name, float_operand(name, array), problem.dtype)
        if shape_of(array) != shape:
            raise ShapeError(
                f"{name} must have shape {shape} for these inputs, got {shape_of(array)}"
            )
        saved.append(array)
    return tuple(saved)


def _sum_to_shape(grad, shape):
    """Sum a gradient over the dimensions its operand was broadcast along."""
    if shape_of(grad) == shape:
        return grad
    grad = _cuda.to_host(grad)
    leading = grad.ndim - len(shape)
    grad = grad.sum(axis=tuple(range(leading)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=stretched, keepdims=True) if stretched else grad


def _attention_problem(query, key, value, attn_mask, is_causal, scale, return_weights):
    query = float_operand("query", query)
    key = float_operand("key", key)
    value = float_operand("value", value)
    for name, array, meaning in (
        ("query", query, "(..., L, E)"),
        ("key", key, "(..., S, E)"),
        ("value", value, "(..., S, Ev)"),
    ):
        require_ndim(name, array, 2, meaning)
    if shape_of(query)[-1] != shape_of(key)[-1]:
        raise ShapeError(
            f"query and key must have the same last dimension E, got query "
            f"{tuple(query.shape)} and key {tuple(key.shape)}"
        )
    if shape_of(key)[-2] != shape_of(value)[-2]:
        raise ShapeError(
            f"key and value must have the same sequence length S (second-to-last "
            f"dimension), got key {tuple(key.shape)} and value {tuple(value.shape)}"
        )
    if shape_of(query)[-1] == 0 and scale is None:
        raise ShapeError(
            f"query has E = 0 features (shape {tuple(query.shape)}), so the default "
            "scale 1/sqrt(E) is undefined; pass scale explicitly"
        )
    dtype = np.result_type(query.dtype, key.dtype, value.dtype)
    query, key, value = (
        _cast(name, a, dtype)
        for name, a in zip(("query", "key", "value"), (query, key, value), strict=True)
    )
    n_query, n_key = shape_of(query)[-2], shape_of(key)[-2]
    mask = _attention_mask(attn_mask, n_query, n_key, dtype)
    named_batches = {
        "query": shape_of(query)[:-2],
        "key": shape_of(key)[:-2],
        "value": shape_of(value)[:-2],
    }
    if mask is not None:
        named_batches["attn_mask"] = shape_of(mask)[:-2]
    batch_shape = broadcast_batch_shapes(named_batches)
    scale = real_scalar("scale", scale)
    if scale is None:
        scale = 1.0 / math.sqrt(shape_of(query)[-1])
    return AttentionProblem(
        query,
        key,
        value,
        mask,
        boolean_flag("is_causal", is_causal),
        scale,
        boolean_flag("return_weights", return_weights),
        batch_shape,
        dtype,
    )


def _cast(name, array, dtype):
    if array.dtype == dtype:
        return array
    if _cuda.is_device_array(array):
        raise DTypeError(
            f"{name} is a {array.dtype} device array but the other operands make the "
            f"computation {dtype}; give all device operands one dtype"
        )
    return array.astype(dtype)


def _attention_mask(attn_mask, n_query, n_key, dtype):
    if attn_mask is None:
        return None
    mask = host_array("attn_mask", _cuda.to_host(attn_mask))
    if mask.dtype != np.bool_:
        if mask.dtype.kind != "f":
            raise DTypeError(
                f"attn_mask must be boolean (True = may attend) or floating (added to "
                f"the scores), got dtype {mask.dtype}"
            )
        mask = mask.astype(dtype, copy=False)
    if mask.ndim < 2:
        mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)
    rows, columns = shape_of(mask)[-2:]
    if rows not in (1, n_query) or columns not in (1, n_key):
        raise ShapeError(
            f"attn_mask must broadcast to (..., L, S) = (..., {n_query}, {n_key}), "
            f"got shape {tuple(np.shape(attn_mask))}"
        )
    return mask
