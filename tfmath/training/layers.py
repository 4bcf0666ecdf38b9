r"""Transformer building blocks, each with a forward and an analytic backward pass.

The API is a pair of functions per block::

    out, cache = <block>_forward(...)       # the value, and what the gradient needs
    grads = <block>_backward(grad_out, cache)

``cache`` is an opaque :class:`Cache` recording which forward made it, so
passing it to the wrong backward is an error rather than a wrong gradient.
Parameters are a :class:`~tfmath.training.params.Parameters` (dotted names to NumPy
arrays) and parameter gradients come back as one with the same names. Pure
functions with explicit state, rather than layer objects holding weights,
keep every array visible: nothing is updated behind the caller's back, and a
finite-difference check can perturb any array it likes.

Where the cost is in elementwise or row-wise work (LayerNorm, RMSNorm, the
FFN activation, log-softmax and the loss) the work runs in a registered
kernel chosen by ``backend``; matrix products are NumPy's ``@`` (BLAS), and
attention is :func:`tfmath.scaled_dot_product_attention` on the same backend.
The blocks are plain Python over these pieces.

Shapes follow seed 000's PyTorch code: activations are ``(..., L, d_model)``
with any leading batch dimensions, heads are split as
``(..., L, h * d_k) -> (..., h, L, d_k)`` and merged back the same way, and a
linear map is ``x @ W + b`` with ``W`` of shape ``(d_in, d_out)``.
"""

from dataclasses import dataclass

import numpy as np

from tfmath import _cuda, attention
from tfmath._contract.attention import attention_problem
from tfmath._contract.checks import (
    boolean_flag,
    choice,
    float_operand,
    host_array,
    integer,
    real,
    require_ndim,
)
from tfmath._dispatch import implementation, resolve_backend
from tfmath.errors import DTypeError, ShapeError
from tfmath.training.params import Parameters, ParameterSpec

__all__ = [
    "ACTIVATIONS",
    "NORMS",
    "NORM_ORDERS",
    "REDUCTIONS",
    "BlockConfig",
    "Cache",
    "attention_parameters",
    "cross_entropy",
    "cross_entropy_backward",
    "cross_entropy_forward",
    "decoder_block_backward",
    "decoder_block_forward",
    "decoder_block_parameters",
    "embedding_backward",
    "embedding_forward",
    "encoder_block_backward",
    "encoder_block_forward",
    "encoder_block_parameters",
    "feed_forward_backward",
    "feed_forward_forward",
    "feed_forward_parameters",
    "ffn_activation",
    "ffn_activation_backward",
    "ffn_activation_forward",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_forward",
    "log_softmax",
    "log_softmax_backward",
    "log_softmax_forward",
    "merge_heads",
    "multi_head_attention_backward",
    "multi_head_attention_forward",
    "norm_parameters",
    "output_projection_backward",
    "output_projection_forward",
    "residual_backward",
    "residual_forward",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
    "split_heads",
]

#: FFN nonlinearities and the code the kernels know them by.
ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "swiglu": 3}
#: Normalisations a block can use.
NORMS = ("layer_norm", "rms_norm")
#: Where the normalisation sits: ``"post"``, LayerNorm(x + Sublayer(x)) as the
#: seeds and Vaswani et al. write it, or ``"pre"``, x + Sublayer(LayerNorm(x)).
NORM_ORDERS = ("post", "pre")


# -- caches and argument checks ------------------------------------------------


@dataclass(frozen=True)
class Cache:
    """What a forward pass saved for its backward pass.

    Attributes
    ----------
    op : str
        The block that made it (``"layer_norm"``, ``"multi_head_attention"``, ...).
    saved : dict
        Its saved arrays and settings; treat as private.
    """

    op: str
    saved: dict

    def of(self, op):
        """The saved values, after checking this cache comes from ``op``'s forward pass."""
        if self.op != op:
            raise ValueError(f"cache comes from {self.op}_forward, but was passed to {op}_backward")
        return self.saved


def _require_cache(cache, op):
    if not isinstance(cache, Cache):
        raise TypeError(f"cache must be the Cache returned by {op}_forward, got {type(cache)}")
    return cache.of(op)


def _host_operand(name, value, min_ndim=1, meaning="(..., d)"):
    """A float32/float64 host array (the compositions multiply with NumPy)."""
    array = _cuda.to_host(float_operand(name, value))
    require_ndim(name, array, min_ndim, meaning)
    return array


def _weight(name, value, shape, dtype, meaning):
    """A parameter array of exactly ``shape`` and ``dtype``, C-contiguous."""
    array = _cuda.to_host(float_operand(name, value))
    if array.shape != tuple(shape):
        raise ShapeError(f"{name} must have shape {tuple(shape)} ({meaning}), got {array.shape}")
    if array.dtype != dtype:
        raise DTypeError(
            f"{name} is {array.dtype} but the input is {dtype}; give parameters and "
            f"inputs one dtype"
        )
    return np.ascontiguousarray(array)


def _gradient(name, value, shape, dtype):
    """An upstream gradient shaped like the forward output, in its dtype."""
    if isinstance(value, np.ndarray) and value.dtype != dtype and value.size:
        raise DTypeError(f"{name} must have the forward output's dtype {dtype}, got {value.dtype}")
    array = np.asarray(_cuda.to_host(float_operand(name, value)), dtype=dtype)
    if array.shape != tuple(shape):
        raise ShapeError(
            f"{name} must have the forward output's shape {tuple(shape)}, got {array.shape}"
        )
    return array


def _rows(array):
    """``(..., d)`` viewed as C-contiguous rows ``(n, d)``."""
    return np.ascontiguousarray(array).reshape(-1, array.shape[-1])


def _eps(eps):
    return real("eps", eps, at_least=0.0)


def _features(name, x):
    if x.shape[-1] == 0:
        raise ShapeError(f"{name} must have at least one feature (last dimension), got {x.shape}")
    return x.shape[-1]


# -- normalisation ---------------------------------------------------------------


def layer_norm(x, weight, bias, eps=1e-5, *, backend="auto"):
    r"""Layer normalisation over the last dimension (the seeds' formula).

    .. math::

        \operatorname{LayerNorm}(x) = \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}}
            \odot \gamma + \beta, \qquad
        \mu = \frac1d \sum_j x_j, \quad \sigma^2 = \frac1d \sum_j (x_j - \mu)^2

    with the biased (population) variance, as Ba et al. (2016) and PyTorch use.

    Parameters
    ----------
    x : array_like, shape (..., d)
    weight, bias : array_like, shape (d,)
        :math:`\gamma` and :math:`\beta`, of the dtype of ``x``.
    eps : float, optional
        :math:`\epsilon \ge 0`.
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    numpy.ndarray, shape (..., d)

    Raises
    ------
    ShapeError
        When ``weight`` or ``bias`` is not of shape ``(d,)``, or ``d = 0``.
    DTypeError
        For non-float inputs or parameters of another dtype than ``x``.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.training.layers import layer_norm
    >>> y = layer_norm([[1.0, 2.0, 3.0]], np.ones(3), np.zeros(3), eps=0.0, backend="reference")
    >>> np.round(y, 4)
    array([[-1.2247,  0.    ,  1.2247]])
    """
    return layer_norm_forward(x, weight, bias, eps, backend=backend)[0]


def layer_norm_forward(x, weight, bias, eps=1e-5, *, backend="auto"):
    """:func:`layer_norm`, also returning the :class:`Cache` for :func:`layer_norm_backward`."""
    x = _host_operand("x", x)
    d = _features("x", x)
    weight = _weight("weight", weight, (d,), x.dtype, "one gamma per feature of x")
    bias = _weight("bias", bias, (d,), x.dtype, "one beta per feature of x")
    eps = _eps(eps)
    backend = resolve_backend(backend)
    rows = _rows(x)
    y, mean, rstd = implementation("layer_norm", backend)(rows, weight, bias, eps)
    saved = {"x": rows, "weight": weight, "mean": mean, "rstd": rstd, "shape": x.shape}
    return y.reshape(x.shape), Cache("layer_norm", {**saved, "backend": backend})


def layer_norm_backward(grad_y, cache):
    r"""Gradients of :func:`layer_norm`.

    With :math:`\hat x = (x - \mu)/\sqrt{\sigma^2+\epsilon}` and
    :math:`g = \gamma \odot \partial L/\partial y`, per row of :math:`d` features

    .. math::

        \frac{\partial L}{\partial x} = \frac{1}{\sqrt{\sigma^2+\epsilon}}
            \Big( g - \tfrac1d \textstyle\sum_j g_j
                  - \hat x\, \tfrac1d \sum_j g_j \hat x_j \Big),
        \quad
        \frac{\partial L}{\partial \gamma} = \sum_{\text{rows}}
            \frac{\partial L}{\partial y} \odot \hat x,
        \quad
        \frac{\partial L}{\partial \beta} = \sum_{\text{rows}} \frac{\partial L}{\partial y}.

    Parameters
    ----------
    grad_y : array_like, shape (..., d)
        :math:`\partial L / \partial y`.
    cache : Cache
        From :func:`layer_norm_forward`.

    Returns
    -------
    grad_x : numpy.ndarray, shape (..., d)
    grad_weight, grad_bias : numpy.ndarray, shape (d,)
    """
    saved = _require_cache(cache, "layer_norm")
    x = saved["x"]
    grad_y = _rows(_gradient("grad_y", grad_y, saved["shape"], x.dtype))
    grad_x, grad_weight, grad_bias = implementation("layer_norm_backward", saved["backend"])(
        grad_y, x, saved["weight"], saved["mean"], saved["rstd"]
    )
    return grad_x.reshape(saved["shape"]), grad_weight, grad_bias


def rms_norm(x, weight, eps=1e-6, *, backend="auto"):
    r"""Root-mean-square normalisation over the last dimension (Zhang and Sennrich 2019).

    .. math::

        \operatorname{RMSNorm}(x) = \frac{x}{\sqrt{\tfrac1d \sum_j x_j^2 + \epsilon}} \odot \gamma

    LayerNorm without the centring and without :math:`\beta`; LLaMA uses it.

    Parameters
    ----------
    x : array_like, shape (..., d)
    weight : array_like, shape (d,)
    eps : float, optional
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    numpy.ndarray, shape (..., d)

    Raises
    ------
    ShapeError, DTypeError
        As :func:`layer_norm`.

    Examples
    --------
    >>> from tfmath.training.layers import rms_norm
    >>> rms_norm([[3.0, 4.0]], [1.0, 1.0], eps=0.0, backend="reference").round(4)
    array([[0.8485, 1.1314]])
    """
    return rms_norm_forward(x, weight, eps, backend=backend)[0]


def rms_norm_forward(x, weight, eps=1e-6, *, backend="auto"):
    """:func:`rms_norm`, also returning the :class:`Cache` for :func:`rms_norm_backward`."""
    x = _host_operand("x", x)
    d = _features("x", x)
    weight = _weight("weight", weight, (d,), x.dtype, "one gamma per feature of x")
    eps = _eps(eps)
    backend = resolve_backend(backend)
    rows = _rows(x)
    y, rstd = implementation("rms_norm", backend)(rows, weight, eps)
    saved = {"x": rows, "weight": weight, "rstd": rstd, "shape": x.shape, "backend": backend}
    return y.reshape(x.shape), Cache("rms_norm", saved)


def rms_norm_backward(grad_y, cache):
    r"""Gradients of :func:`rms_norm`.

    With :math:`r = (\tfrac1d \sum_j x_j^2 + \epsilon)^{-1/2}`, whose derivative is
    :math:`\partial r/\partial x_j = -r^3 x_j / d`, and
    :math:`g = \gamma \odot \partial L/\partial y`:

    .. math::

        \frac{\partial L}{\partial x} = r \Big( g - x\, r^2\, \tfrac1d
            \textstyle\sum_j g_j x_j \Big),
        \qquad
        \frac{\partial L}{\partial \gamma} = \sum_{\text{rows}}
            \frac{\partial L}{\partial y} \odot x\, r .

    Returns
    -------
    grad_x : numpy.ndarray, shape (..., d)
    grad_weight : numpy.ndarray, shape (d,)
    """
    saved = _require_cache(cache, "rms_norm")
    x = saved["x"]
    grad_y = _rows(_gradient("grad_y", grad_y, saved["shape"], x.dtype))
    grad_x, grad_weight = implementation("rms_norm_backward", saved["backend"])(
        grad_y, x, saved["weight"], saved["rstd"]
    )
    return grad_x.reshape(saved["shape"]), grad_weight


def norm_parameters(d_model, norm="layer_norm"):
    """The :class:`~tfmath.training.params.ParameterSpec` of one norm.

    ``weight`` (ones), and ``bias`` (zeros) for LayerNorm."""
    d_model = integer("d_model", d_model, minimum=1)
    entries = {"weight": ((d_model,), "ones")}
    if choice("norm", norm, NORMS) == "layer_norm":
        entries["bias"] = ((d_model,), "zeros")
    return ParameterSpec(entries)


def _norm_forward(params, x, norm, eps, backend):
    if norm == "layer_norm":
        params.require(("weight", "bias"), owner="layer_norm")
        return layer_norm_forward(x, params["weight"], params["bias"], eps, backend=backend)
    params.require(("weight",), owner="rms_norm")
    return rms_norm_forward(x, params["weight"], eps, backend=backend)


def _norm_backward(grad_y, cache):
    if cache.op == "layer_norm":
        grad_x, grad_weight, grad_bias = layer_norm_backward(grad_y, cache)
        return grad_x, Parameters({"weight": grad_weight, "bias": grad_bias})
    grad_x, grad_weight = rms_norm_backward(grad_y, cache)
    return grad_x, Parameters({"weight": grad_weight})


# -- the position-wise feed-forward network -------------------------------------------


def ffn_activation(h, activation="gelu", *, backend="auto"):
    r"""The feed-forward network's nonlinearity, elementwise (ReLU, GELU) or gated (SwiGLU).

    .. math::

        \operatorname{ReLU}(h) = \max(0, h), \qquad
        \operatorname{GELU}(h) = h\, \Phi(h)
            = \tfrac{h}{2}\big(1 + \operatorname{erf}(h / \sqrt 2)\big),

        \operatorname{GELU}_{\tanh}(h) = \tfrac{h}{2}\Big(1 + \tanh\big(\sqrt{2/\pi}\,
            (h + 0.044715\, h^3)\big)\Big), \qquad
        \operatorname{SwiGLU}([a \,|\, b]) = \frac{a}{1 + e^{-a}} \odot b .

    ReLU is the seeds' and Vaswani et al.'s; GELU (Hendrycks and Gimpel 2016) is
    BERT's, and its tanh approximation GPT-2's; SwiGLU (Shazeer 2020) is LLaMA's.

    Parameters
    ----------
    h : array_like, shape (..., f), or (..., 2 f) for SwiGLU
        For SwiGLU, the gate :math:`a` fills the first half of the last axis and
        :math:`b` the second, so one matrix :math:`W_1 = [W_{gate} \,|\, W_{up}]`
        produces both.
    activation : {"relu", "gelu", "gelu_tanh", "swiglu"}, optional
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    numpy.ndarray, shape (..., f)

    Raises
    ------
    ValueError
        For an unknown ``activation``, or an odd last dimension with SwiGLU.

    Examples
    --------
    >>> from tfmath.training.layers import ffn_activation
    >>> ffn_activation([[-1.0, 0.0, 2.0]], "relu", backend="reference")
    array([[0., 0., 2.]])
    """
    return ffn_activation_forward(h, activation, backend=backend)[0]


def ffn_activation_forward(h, activation="gelu", *, backend="auto"):
    """:func:`ffn_activation`, also returning the :class:`Cache` for its backward."""
    code = ACTIVATIONS[choice("activation", activation, ACTIVATIONS)]
    h = _host_operand("h", h)
    if code == ACTIVATIONS["swiglu"] and h.shape[-1] % 2:
        raise ShapeError(
            f"h must have an even last dimension [gate | up] for swiglu, got shape {h.shape}"
        )
    backend = resolve_backend(backend)
    rows = _rows(h)
    out = implementation("ffn_activation", backend)(rows, code)
    out = out.reshape((*h.shape[:-1], out.shape[-1]))
    saved = {"h": rows, "code": code, "shape": h.shape, "out_shape": out.shape, "backend": backend}
    return out, Cache("ffn_activation", saved)


def ffn_activation_backward(grad_out, cache):
    r"""Gradient of :func:`ffn_activation` with respect to ``h``.

    .. math::

        \operatorname{ReLU}'(h) = [h > 0], \qquad
        \operatorname{GELU}'(h) = \Phi(h) + h\, \varphi(h),

        \operatorname{GELU}_{\tanh}'(h) = \tfrac12 (1 + t)
            + \tfrac{h}{2} (1 - t^2) \sqrt{2/\pi}\, (1 + 3 \cdot 0.044715\, h^2),

        \frac{\partial\, \operatorname{SwiGLU}}{\partial a} = b\, \sigma(a)
            \big(1 + a (1 - \sigma(a))\big), \qquad
        \frac{\partial\, \operatorname{SwiGLU}}{\partial b} = a\, \sigma(a),

    with :math:`\varphi` the standard normal density, :math:`t` the tanh of the
    forward formula and :math:`\sigma` the logistic function.

    Returns
    -------
    numpy.ndarray
        Shaped like the forward input ``h``.
    """
    saved = _require_cache(cache, "ffn_activation")
    h = saved["h"]
    grad_out = _rows(_gradient("grad_out", grad_out, saved["out_shape"], h.dtype))
    grad_h = implementation("ffn_activation_backward", saved["backend"])(grad_out, h, saved["code"])
    return grad_h.reshape(saved["shape"])


def _linear(x, weight, bias):
    y = x @ weight
    return y if bias is None else y + bias


def _linear_backward(grad_y, x, weight, has_bias):
    """``(grad_x, grad_weight, grad_bias)`` of ``y = x @ weight + bias``."""
    grad_rows = _rows(grad_y)
    grad_weight = _rows(x).T @ grad_rows
    grad_bias = grad_rows.sum(axis=0) if has_bias else None
    return grad_y @ weight.T, grad_weight, grad_bias


def _named_grads(**grads):
    return Parameters({name: g for name, g in grads.items() if g is not None})


def feed_forward_parameters(d_model, d_ff, *, activation="relu", bias=True):
    r"""The :class:`~tfmath.training.params.ParameterSpec` of the FFN.

    ``w_1`` is :math:`d_{model} \times d_{ff}` (:math:`d_{model} \times 2 d_{ff}`
    for SwiGLU: gate and up projections side by side), ``w_2`` is
    :math:`d_{ff} \times d_{model}`, and with ``bias`` ``b_1``, ``b_2``.
    """
    d_model, d_ff = integer("d_model", d_model, minimum=1), integer("d_ff", d_ff, minimum=1)
    width = 2 * d_ff if choice("activation", activation, ACTIVATIONS) == "swiglu" else d_ff
    entries = {"w_1": ((d_model, width), "normal"), "w_2": ((d_ff, d_model), "normal")}
    if bias:
        entries.update(b_1=((width,), "zeros"), b_2=((d_model,), "zeros"))
    return ParameterSpec(entries)


def feed_forward_forward(params, x, *, activation="relu", backend="auto"):
    r"""Position-wise feed-forward network, :math:`\operatorname{FFN}(x) = \operatorname{act}(x W_1
    + b_1) W_2 + b_2`.

    The seeds' FFN with ``activation="relu"``; each position (row) is
    transformed independently by the same weights (Vaswani et al. 2017, eq. 2).

    Parameters
    ----------
    params : Parameters
        ``w_1`` of shape ``(d_model, d_ff)`` (``(d_model, 2 d_ff)`` for SwiGLU),
        ``w_2`` of shape ``(d_ff, d_model)``, and optionally ``b_1`` and ``b_2``
        (both or neither).
    x : array_like, shape (..., d_model)
    activation : {"relu", "gelu", "gelu_tanh", "swiglu"}, optional
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Runs the activation.

    Returns
    -------
    out : numpy.ndarray, shape (..., d_model)
    cache : Cache

    Raises
    ------
    ShapeError
        When the weights do not fit ``x`` or each other.
    ValueError
        For an unknown activation.
    """
    activation = choice("activation", activation, ACTIVATIONS)
    x = _host_operand("x", x, 1, "(..., d_model)")
    w_1, b_1, w_2, b_2 = _ffn_weights(params, x.shape[-1], activation, x.dtype)
    h = _linear(x, w_1, b_1)
    a, activation_cache = ffn_activation_forward(h, activation, backend=backend)
    out = _linear(a, w_2, b_2)
    saved = {"x": x, "a": a, "w_1": w_1, "w_2": w_2, "bias": b_1 is not None}
    return out, Cache("feed_forward", {**saved, "activation": activation_cache})


def _ffn_weights(params, d_model, activation, dtype):
    params.require(("w_1", "w_2"), owner="feed_forward")
    w_1 = np.asarray(params["w_1"])
    if w_1.ndim != 2 or w_1.shape[0] != d_model:
        raise ShapeError(
            f"w_1 must have shape (d_model, d_ff) with d_model = {d_model} (the last "
            f"dimension of x), got {w_1.shape}"
        )
    gated = activation == "swiglu"
    if gated and w_1.shape[1] % 2:
        raise ShapeError(f"w_1 must have an even width [gate | up] for swiglu, got {w_1.shape}")
    d_ff = w_1.shape[1] // 2 if gated else w_1.shape[1]
    w_1 = _weight("w_1", w_1, w_1.shape, dtype, "(d_model, d_ff)")
    w_2 = _weight("w_2", params["w_2"], (d_ff, d_model), dtype, "(d_ff, d_model)")
    if "b_1" not in params and "b_2" not in params:
        return w_1, None, w_2, None
    params.require(("b_1", "b_2"), owner="feed_forward (biases come in pairs)")
    b_1 = _weight("b_1", params["b_1"], (w_1.shape[1],), dtype, "one per column of w_1")
    b_2 = _weight("b_2", params["b_2"], (d_model,), dtype, "(d_model,)")
    return w_1, b_1, w_2, b_2


def feed_forward_backward(grad_out, cache):
    r"""Gradients of :func:`feed_forward_forward`.

    With :math:`h = x W_1 + b_1`, :math:`a = \operatorname{act}(h)` and
    :math:`G = \partial L / \partial\,\mathrm{out}` (rows are positions):

    .. math::

        \frac{\partial L}{\partial W_2} = a^\top G, \quad
        \frac{\partial L}{\partial b_2} = \textstyle\sum_{\text{rows}} G, \quad
        \frac{\partial L}{\partial h} = \operatorname{act}'(h) \odot (G W_2^\top),

        \frac{\partial L}{\partial W_1} = x^\top \frac{\partial L}{\partial h}, \quad
        \frac{\partial L}{\partial b_1} = \textstyle\sum_{\text{rows}}
            \frac{\partial L}{\partial h}, \quad
        \frac{\partial L}{\partial x} = \frac{\partial L}{\partial h} W_1^\top .

    Returns
    -------
    grad_x : numpy.ndarray, shape (..., d_model)
    grads : Parameters
        Named as the forward's ``params``.
    """
    saved = _require_cache(cache, "feed_forward")
    x, a = saved["x"], saved["a"]
    grad_out = _gradient("grad_out", grad_out, (*a.shape[:-1], x.shape[-1]), x.dtype)
    grad_a, grad_w_2, grad_b_2 = _linear_backward(grad_out, a, saved["w_2"], saved["bias"])
    grad_h = ffn_activation_backward(grad_a, saved["activation"])
    grad_x, grad_w_1, grad_b_1 = _linear_backward(grad_h, x, saved["w_1"], saved["bias"])
    return grad_x, _named_grads(w_1=grad_w_1, b_1=grad_b_1, w_2=grad_w_2, b_2=grad_b_2)


# -- multi-head attention ------------------------------------------------------------


def split_heads(x, n_heads):
    """``(..., L, h d_k) -> (..., h, L, d_k)``: seed 000's ``view`` then ``transpose(1, 2)``.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.training.layers import split_heads, merge_heads
    >>> x = np.arange(12.0).reshape(1, 2, 6)
    >>> split_heads(x, 3).shape
    (1, 3, 2, 2)
    >>> bool((merge_heads(split_heads(x, 3)) == x).all())
    True
    """
    *batch, length, width = x.shape
    if width % n_heads:
        raise ShapeError(f"n_heads = {n_heads} does not divide the last dimension {width} of x")
    return np.swapaxes(x.reshape(*batch, length, n_heads, width // n_heads), -3, -2)


def merge_heads(x):
    """``(..., n_heads, L, d_k) -> (..., L, n_heads * d_k)``: seed 000's "concatenate heads"."""
    *batch, n_heads, length, d_k = x.shape
    return np.swapaxes(x, -3, -2).reshape(*batch, length, n_heads * d_k)


def attention_parameters(
    d_model, n_heads, *, n_kv_heads=None, d_head=None, d_source=None, bias=True
):
    r"""The :class:`~tfmath.training.params.ParameterSpec` of multi-head attention.

    ``w_q``: :math:`d_{model} \times h d_k`; ``w_k``, ``w_v``:
    :math:`d_{source} \times h_{kv} d_k`; ``w_o``: :math:`h d_k \times d_{model}`;
    with ``bias``, ``b_q``, ``b_k``, ``b_v``, ``b_o`` of the matching widths.

    Parameters
    ----------
    d_model, n_heads : int
    n_kv_heads : int, optional
        Key/value heads (grouped-query attention, Ainslie et al. 2023); default
        ``n_heads``. Must divide ``n_heads``.
    d_head : int, optional
        Default ``d_model // n_heads``, which then must divide exactly.
    d_source : int, optional
        Width of the key/value input (cross-attention); default ``d_model``.
    bias : bool, optional

    Raises
    ------
    ValueError
        When ``n_heads`` does not divide ``d_model`` (and no ``d_head`` is
        given), or ``n_kv_heads`` does not divide ``n_heads``.
    """
    d_model, n_heads = (
        integer("d_model", d_model, minimum=1),
        integer("n_heads", n_heads, minimum=1),
    )
    n_kv_heads = _kv_heads(n_heads, n_kv_heads)
    if d_head is None:
        if d_model % n_heads:
            raise ValueError(f"n_heads = {n_heads} must divide d_model = {d_model}")
        d_head = d_model // n_heads
    d_head = integer("d_head", d_head, minimum=1)
    d_source = d_model if d_source is None else integer("d_source", d_source, minimum=1)
    q_width, kv_width = n_heads * d_head, n_kv_heads * d_head
    entries = {
        "w_q": ((d_model, q_width), "normal"),
        "w_k": ((d_source, kv_width), "normal"),
        "w_v": ((d_source, kv_width), "normal"),
        "w_o": ((q_width, d_model), "normal"),
    }
    if bias:
        entries.update(
            b_q=((q_width,), "zeros"),
            b_k=((kv_width,), "zeros"),
            b_v=((kv_width,), "zeros"),
            b_o=((d_model,), "zeros"),
        )
    return ParameterSpec(entries)


def _kv_heads(n_heads, n_kv_heads):
    n_kv_heads = n_heads if n_kv_heads is None else integer("n_kv_heads", n_kv_heads, minimum=1)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads = {n_kv_heads} must divide n_heads = {n_heads}")
    return n_kv_heads


@dataclass(frozen=True)
class _HeadLayout:
    n_heads: int
    n_kv_heads: int
    d_head: int

    @property
    def group(self):
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads


def _attention_weights(params, d_model, d_source, n_heads, n_kv_heads, dtype):
    """Check the projections against the inputs and head counts; return them and the layout."""
    params.require(("w_q", "w_k", "w_v", "w_o"), owner="multi_head_attention")
    n_heads = integer("n_heads", n_heads, minimum=1)
    n_kv_heads = _kv_heads(n_heads, n_kv_heads)
    q_width = np.shape(params["w_q"])[-1]
    if q_width % n_heads:
        raise ShapeError(
            f"n_heads = {n_heads} does not divide the width {q_width} of w_q "
            f"(= n_heads * d_head; d_model = {d_model})"
        )
    layout = _HeadLayout(n_heads, n_kv_heads, q_width // n_heads)
    kv_width = n_kv_heads * layout.d_head
    weights = {
        "w_q": _weight("w_q", params["w_q"], (d_model, q_width), dtype, "(d_model, h d_k)"),
        "w_k": _weight("w_k", params["w_k"], (d_source, kv_width), dtype, "(d_source, h_kv d_k)"),
        "w_v": _weight("w_v", params["w_v"], (d_source, kv_width), dtype, "(d_source, h_kv d_k)"),
        "w_o": _weight("w_o", params["w_o"], (q_width, d_model), dtype, "(h d_k, d_model)"),
    }
    bias_widths = {"b_q": q_width, "b_k": kv_width, "b_v": kv_width, "b_o": d_model}
    present = [name for name in bias_widths if name in params]
    if present:
        params.require(tuple(bias_widths), owner="multi_head_attention (all four biases or none)")
    for name, width in bias_widths.items():
        weights[name] = (
            _weight(name, params[name], (width,), dtype, "one per output column")
            if present
            else None
        )
    return weights, layout


def multi_head_attention_forward(
    params,
    x,
    memory=None,
    *,
    n_heads,
    n_kv_heads=None,
    attn_mask=None,
    is_causal=False,
    backend="auto",
):
    r"""Multi-head attention with projections, as in seed 000's ``MultiHeadAttention``.

    .. math::

        \operatorname{MultiHead}(X, Y) = \operatorname{Concat}(\mathrm{head}_1, \dots,
            \mathrm{head}_h) W^O + b^O, \qquad
        \mathrm{head}_i = \operatorname{Attention}(X W_i^Q, Y W_{g(i)}^K, Y W_{g(i)}^V)

    with :math:`Y = X` for self-attention and :math:`Y` the encoder output
    ("memory") for cross-attention. With grouped-query attention
    (:math:`h_{kv} < h` key/value heads, Ainslie et al. 2023) query head
    :math:`i` uses key/value head :math:`g(i) = \lfloor i / (h / h_{kv}) \rfloor`;
    :math:`h_{kv} = h` is standard multi-head attention. The scale is
    :math:`1/\sqrt{d_k}`.

    Parameters
    ----------
    params : Parameters
        ``w_q``, ``w_k``, ``w_v``, ``w_o`` (see :func:`attention_parameters`) and
        optionally all of ``b_q``, ``b_k``, ``b_v``, ``b_o``.
    x : array_like, shape (..., L, d_model)
        The queries' input.
    memory : array_like, shape (..., S, d_source), optional
        The keys' and values' input for cross-attention, with the batch
        dimensions of ``x``. Default: ``x`` (self-attention).
    n_heads : int
        Must divide the width of ``w_q``.
    n_kv_heads : int, optional
        Default ``n_heads``; must divide ``n_heads``.
    attn_mask : array_like, optional
        Boolean (True = may attend) or additive, broadcastable to
        ``(..., n_heads, L, S)``, as in :func:`tfmath.scaled_dot_product_attention`.
    is_causal : bool, optional
        Query :math:`i` sees keys :math:`j \le i` only.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Runs the attention.

    Returns
    -------
    out : numpy.ndarray, shape (..., L, d_model)
    cache : Cache

    Raises
    ------
    ShapeError
        When ``n_heads`` does not divide the query width, the projections do not
        fit the inputs, or ``x`` and ``memory`` differ in batch dimensions.
    ValueError
        When ``n_kv_heads`` does not divide ``n_heads``.
    """
    x = _host_operand("x", x, 2, "(..., L, d_model)")
    self_attention = memory is None
    source = x if self_attention else _host_operand("memory", memory, 2, "(..., S, d_source)")
    if source.shape[:-2] != x.shape[:-2]:
        raise ShapeError(
            f"x and memory must have the same batch dimensions, got x {x.shape} and "
            f"memory {source.shape}"
        )
    weights, layout = _attention_weights(
        params, x.shape[-1], source.shape[-1], n_heads, n_kv_heads, x.dtype
    )
    is_causal = boolean_flag("is_causal", is_causal)
    query = split_heads(_linear(x, weights["w_q"], weights["b_q"]), layout.n_heads)
    key = split_heads(_linear(source, weights["w_k"], weights["b_k"]), layout.n_kv_heads)
    value = split_heads(_linear(source, weights["w_v"], weights["b_v"]), layout.n_kv_heads)
    key, value = (np.repeat(t, layout.group, axis=-3) for t in (key, value))
    # The heads are valid by construction; only the user's mask is checked, once.
    problem = attention_problem(
        query, key, value, attn_mask, is_causal, backend=resolve_backend(backend, x, attn_mask)
    )
    heads, log_sum_exp = attention.forward(problem, return_log_sum_exp=True)
    heads, log_sum_exp = _cuda.to_host(heads), _cuda.to_host(log_sum_exp)
    concat = merge_heads(heads)
    out = _linear(concat, weights["w_o"], weights["b_o"])
    saved = {
        "x": x,
        "source": None if self_attention else source,
        "problem": problem,
        "heads": heads,
        "log_sum_exp": log_sum_exp,
        "concat": concat,
        "weights": weights,
        "layout": layout,
    }
    return out, Cache("multi_head_attention", saved)


def multi_head_attention_backward(grad_out, cache):
    r"""Gradients of :func:`multi_head_attention_forward`.

    The output projection is a linear map (:math:`\partial L/\partial W^O =
    C^\top G` with :math:`C` the concatenated heads); each head's attention is
    differentiated by :func:`tfmath.attention_grad`
    (:math:`dV = P^\top dO`, :math:`dS = P \odot (dO V^\top - \operatorname{rowsum}(dO
    \odot O))`, :math:`dQ = s\, dS K`, :math:`dK = s\, dS^\top Q`); a shared
    key/value head (GQA) receives the sum of its query heads' gradients; and
    the input projections are linear maps again.

    Returns
    -------
    grad_x : numpy.ndarray, shape (..., L, d_model)
        For self-attention this includes the paths through keys and values.
    grad_memory : numpy.ndarray or None
        Shape (..., S, d_source) for cross-attention; None for self-attention.
    grads : Parameters
        Named as the forward's ``params``.
    """
    saved = _require_cache(cache, "multi_head_attention")
    x, weights, layout = saved["x"], saved["weights"], saved["layout"]
    has_bias = weights["b_q"] is not None
    grad_out = _gradient("grad_out", grad_out, x.shape, x.dtype)
    grad_concat, grad_w_o, grad_b_o = _linear_backward(
        grad_out, saved["concat"], weights["w_o"], has_bias
    )
    # The forward's problem (and so its backend), output and log-sum-exp: no second
    # validation, and no second forward pass.
    problem = saved["problem"]
    grad_query, grad_key, grad_value = (
        _cuda.to_host(g)
        for g in attention.gradients(
            problem,
            split_heads(grad_concat, layout.n_heads),
            (saved["heads"], saved["log_sum_exp"]),
        )
    )
    grad_key, grad_value = (_sum_groups(g, layout) for g in (grad_key, grad_value))
    source = x if saved["source"] is None else saved["source"]
    grad_x, grad_w_q, grad_b_q = _linear_backward(
        merge_heads(grad_query), x, weights["w_q"], has_bias
    )
    grad_source_k, grad_w_k, grad_b_k = _linear_backward(
        merge_heads(grad_key), source, weights["w_k"], has_bias
    )
    grad_source_v, grad_w_v, grad_b_v = _linear_backward(
        merge_heads(grad_value), source, weights["w_v"], has_bias
    )
    grads = _named_grads(
        w_q=grad_w_q,
        b_q=grad_b_q,
        w_k=grad_w_k,
        b_k=grad_b_k,
        w_v=grad_w_v,
        b_v=grad_b_v,
        w_o=grad_w_o,
        b_o=grad_b_o,
    )
    grad_source = grad_source_k + grad_source_v
    if saved["source"] is None:
        return grad_x + grad_source, None, grads
    return grad_x, grad_source, grads


def _sum_groups(grad, layout):
    """Sum the gradients of the query heads that share each key/value head (GQA)."""
    *batch, _, length, d_head = grad.shape
    grouped = grad.reshape(*batch, layout.n_kv_heads, layout.group, length, d_head)
    return grouped.sum(axis=-3)


# -- residual connections ------------------------------------------------------------


def residual_forward(
    x, sublayer, norm_params, *, order="post", norm="layer_norm", eps=1e-5, backend="auto"
):
    r"""A sublayer wrapped in a residual connection and a normalisation.

    .. math::

        \text{post-LN:}\quad y = \operatorname{Norm}(x + F(x)), \qquad
        \text{pre-LN:}\quad y = x + F(\operatorname{Norm}(x)).

    Post-LN is the seeds' and Vaswani et al.'s (section 3.1); pre-LN (GPT-2,
    LLaMA) keeps an identity path from input to output, which Xiong et al.
    (2020) show makes gradients well-behaved at initialisation without warm-up.

    Parameters
    ----------
    x : array_like, shape (..., d_model)
    sublayer : callable
        ``sublayer(z) -> (out, cache)`` with ``out`` shaped like ``z``: a
        closure over one of the ``*_forward`` functions.
    norm_params : Parameters
        ``weight`` (and ``bias`` for LayerNorm).
    order : {"post", "pre"}, optional
    norm : {"layer_norm", "rms_norm"}, optional
    eps : float, optional
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    y : numpy.ndarray, shape (..., d_model)
    cache : Cache
    """
    order = choice("order", order, NORM_ORDERS)
    norm = choice("norm", norm, NORMS)
    x = _host_operand("x", x)
    if order == "post":
        sub_out, sub_cache = sublayer(x)
        y, norm_cache = _norm_forward(norm_params, x + sub_out, norm, eps, backend)
    else:
        z, norm_cache = _norm_forward(norm_params, x, norm, eps, backend)
        sub_out, sub_cache = sublayer(z)
        y = x + sub_out
    saved = {"order": order, "sublayer": sub_cache, "norm": norm_cache, "shape": x.shape}
    return y, Cache("residual", {**saved, "dtype": x.dtype})


def residual_backward(grad_y, cache, sublayer_backward):
    r"""Gradients of :func:`residual_forward`.

    .. math::

        \text{post-LN:}\quad \bar h = \operatorname{Norm}^\top(\bar y), \;
            \bar x = \bar h + F^\top(\bar h); \qquad
        \text{pre-LN:}\quad \bar x = \bar y + \operatorname{Norm}^\top(F^\top(\bar y)),

    where :math:`\bar{\cdot}` are gradients and :math:`^\top` the backward maps.

    Parameters
    ----------
    grad_y : array_like
    cache : Cache
        From :func:`residual_forward`.
    sublayer_backward : callable
        ``sublayer_backward(grad_out, sublayer_cache) -> (grad_input, extra)``,
        the backward of the forward's ``sublayer``; ``extra`` (parameter
        gradients, say) is passed through.

    Returns
    -------
    grad_x : numpy.ndarray
    norm_grads : Parameters
    extra : object
        What ``sublayer_backward`` returned second.
    """
    saved = _require_cache(cache, "residual")
    grad_y = _gradient("grad_y", grad_y, saved["shape"], saved["dtype"])
    if saved["order"] == "post":
        grad_h, norm_grads = _norm_backward(grad_y, saved["norm"])
        grad_sub, extra = sublayer_backward(grad_h, saved["sublayer"])
        return grad_h + grad_sub, norm_grads, extra
    grad_z, extra = sublayer_backward(grad_y, saved["sublayer"])
    grad_x_norm, norm_grads = _norm_backward(grad_z, saved["norm"])
    return grad_y + grad_x_norm, norm_grads, extra


# -- encoder and decoder blocks --------------------------------------------------------


@dataclass(frozen=True)
class BlockConfig:
    """The hyperparameters a block needs beyond its weights' shapes.

    Attributes
    ----------
    n_heads : int
    n_kv_heads : int or None
        Key/value heads for grouped-query attention; None means ``n_heads``.
    activation : {"relu", "gelu", "gelu_tanh", "swiglu"}
    norm : {"layer_norm", "rms_norm"}
    norm_order : {"post", "pre"}
    eps : float
        The norms' :math:`\\epsilon`.
    """

    n_heads: int
    n_kv_heads: int | None = None
    activation: str = "relu"
    norm: str = "layer_norm"
    norm_order: str = "post"
    eps: float = 1e-5

    def __post_init__(self):
        _kv_heads(integer("n_heads", self.n_heads, minimum=1), self.n_kv_heads)
        choice("activation", self.activation, ACTIVATIONS)
        choice("norm", self.norm, NORMS)
        choice("norm_order", self.norm_order, NORM_ORDERS)
        _eps(self.eps)


def _block_config(config):
    if not isinstance(config, BlockConfig):
        raise TypeError(f"config must be a BlockConfig, got {type(config).__name__}")
    return config


def encoder_block_parameters(d_model, d_ff, config, *, bias=True):
    """The :class:`~tfmath.training.params.ParameterSpec` of :func:`encoder_block_forward`:
    ``self_attn.*``, ``norm1.*``, ``ffn.*``, ``norm2.*``."""
    config = _block_config(config)
    return ParameterSpec({}).merge(
        _attention_spec(d_model, config, bias).prefixed("self_attn"),
        norm_parameters(d_model, config.norm).prefixed("norm1"),
        feed_forward_parameters(d_model, d_ff, activation=config.activation, bias=bias).prefixed(
            "ffn"
        ),
        norm_parameters(d_model, config.norm).prefixed("norm2"),
    )


def decoder_block_parameters(d_model, d_ff, config, *, bias=True, d_memory=None):
    """The :class:`~tfmath.training.params.ParameterSpec` of :func:`decoder_block_forward`:
    ``self_attn.*``, ``norm1.*``, ``cross_attn.*``, ``norm2.*``, ``ffn.*``, ``norm3.*``."""
    config = _block_config(config)
    return ParameterSpec({}).merge(
        _attention_spec(d_model, config, bias).prefixed("self_attn"),
        norm_parameters(d_model, config.norm).prefixed("norm1"),
        _attention_spec(d_model, config, bias, d_memory).prefixed("cross_attn"),
        norm_parameters(d_model, config.norm).prefixed("norm2"),
        feed_forward_parameters(d_model, d_ff, activation=config.activation, bias=bias).prefixed(
            "ffn"
        ),
        norm_parameters(d_model, config.norm).prefixed("norm3"),
    )


def _attention_spec(d_model, config, bias, d_source=None):
    return attention_parameters(
        d_model, config.n_heads, n_kv_heads=config.n_kv_heads, d_source=d_source, bias=bias
    )


def _residual(x, sublayer, params, name, config, backend):
    return residual_forward(
        x,
        sublayer,
        params.scope(name),
        order=config.norm_order,
        norm=config.norm,
        eps=config.eps,
        backend=backend,
    )


def _self_attention(params, config, attn_mask, is_causal, backend):
    def forward(z):
        return multi_head_attention_forward(
            params.scope("self_attn"),
            z,
            n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads,
            attn_mask=attn_mask,
            is_causal=is_causal,
            backend=backend,
        )

    return forward


def _self_attention_backward(grad, cache):
    grad_x, _, grads = multi_head_attention_backward(grad, cache)
    return grad_x, grads


def _feed_forward(params, config, backend):
    def forward(z):
        return feed_forward_forward(
            params.scope("ffn"), z, activation=config.activation, backend=backend
        )

    return forward


def encoder_block_forward(params, x, config, *, attn_mask=None, is_causal=False, backend="auto"):
    r"""One encoder layer: self-attention then the FFN, each in a residual and a norm.

    .. math::

        h = \operatorname{Res}_1\big(x, \operatorname{MultiHead}(\cdot, \cdot)\big), \qquad
        y = \operatorname{Res}_2\big(h, \operatorname{FFN}\big)

    where :math:`\operatorname{Res}` is :func:`residual_forward` in the
    config's order. With ``is_causal=True`` this is also the block of
    decoder-only models (GPT, LLaMA), which have no cross-attention.

    Parameters
    ----------
    params : Parameters
        See :func:`encoder_block_parameters`.
    x : array_like, shape (..., L, d_model)
    config : BlockConfig
    attn_mask : array_like, optional
        As in :func:`multi_head_attention_forward` (padding, for example).
    is_causal : bool, optional
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    y : numpy.ndarray, shape (..., L, d_model)
    cache : Cache
    """
    config = _block_config(config)
    attend = _self_attention(params, config, attn_mask, is_causal, backend)
    h, attention_cache = _residual(x, attend, params, "norm1", config, backend)
    ffn = _feed_forward(params, config, backend)
    y, ffn_cache = _residual(h, ffn, params, "norm2", config, backend)
    return y, Cache("encoder_block", {"attention": attention_cache, "ffn": ffn_cache})


def encoder_block_backward(grad_y, cache):
    """Gradients of :func:`encoder_block_forward`: ``(grad_x, grads)``, with ``grads`` named as
    the forward's ``params``."""
    saved = _require_cache(cache, "encoder_block")
    grad_h, norm2, ffn = residual_backward(grad_y, saved["ffn"], feed_forward_backward)
    grad_x, norm1, attention = residual_backward(
        grad_h, saved["attention"], _self_attention_backward
    )
    grads = attention.prefixed("self_attn").merge(
        norm1.prefixed("norm1"), ffn.prefixed("ffn"), norm2.prefixed("norm2")
    )
    return grad_x, grads


def decoder_block_forward(
    params, x, memory, config, *, self_attn_mask=None, memory_mask=None, backend="auto"
):
    r"""One decoder layer of the encoder-decoder transformer (Vaswani et al. 2017, figure 1).

    .. math::

        h_1 = \operatorname{Res}_1\big(x, \operatorname{MaskedMultiHead}\big), \quad
        h_2 = \operatorname{Res}_2\big(h_1, \operatorname{MultiHead}(\cdot, m)\big), \quad
        y = \operatorname{Res}_3\big(h_2, \operatorname{FFN}\big)

    The self-attention is causal (position :math:`i` sees positions
    :math:`\le i`); the cross-attention takes queries from the decoder and keys
    and values from the encoder output :math:`m`.

    Parameters
    ----------
    params : Parameters
        See :func:`decoder_block_parameters`.
    x : array_like, shape (..., L, d_model)
    memory : array_like, shape (..., S, d_memory)
        The encoder's output.
    config : BlockConfig
    self_attn_mask : array_like, optional
        Combined with the causal mask (target padding, for example).
    memory_mask : array_like, optional
        Which memory positions each query may attend (source padding).
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    y : numpy.ndarray, shape (..., L, d_model)
    cache : Cache
    """
    config = _block_config(config)
    memory = _host_operand("memory", memory, 2, "(..., S, d_memory)")
    attend = _self_attention(params, config, self_attn_mask, True, backend)
    h_1, self_cache = _residual(x, attend, params, "norm1", config, backend)

    def cross_attend(z):
        return multi_head_attention_forward(
            params.scope("cross_attn"),
            z,
            memory,
            n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads,
            attn_mask=memory_mask,
            backend=backend,
        )

    h_2, cross_cache = _residual(h_1, cross_attend, params, "norm2", config, backend)
    ffn = _feed_forward(params, config, backend)
    y, ffn_cache = _residual(h_2, ffn, params, "norm3", config, backend)
    saved = {"self_attention": self_cache, "cross_attention": cross_cache, "ffn": ffn_cache}
    return y, Cache("decoder_block", saved)


def _cross_attention_backward(grad, cache):
    grad_x, grad_memory, grads = multi_head_attention_backward(grad, cache)
    return grad_x, (grads, grad_memory)


def decoder_block_backward(grad_y, cache):
    """Gradients of :func:`decoder_block_forward`: ``(grad_x, grad_memory, grads)``, with
    ``grads`` named as the forward's ``params``."""
    saved = _require_cache(cache, "decoder_block")
    grad_h2, norm3, ffn = residual_backward(grad_y, saved["ffn"], feed_forward_backward)
    grad_h1, norm2, (cross, grad_memory) = residual_backward(
        grad_h2, saved["cross_attention"], _cross_attention_backward
    )
    grad_x, norm1, attention = residual_backward(
        grad_h1, saved["self_attention"], _self_attention_backward
    )
    grads = attention.prefixed("self_attn").merge(
        norm1.prefixed("norm1"),
        cross.prefixed("cross_attn"),
        norm2.prefixed("norm2"),
        ffn.prefixed("ffn"),
        norm3.prefixed("norm3"),
    )
    return grad_x, grad_memory, grads


# -- embeddings, output projection, log-softmax and the loss ------------------------------


def _tokens(name, tokens, n_rows, what):
    array = host_array(name, tokens)
    if array.dtype.kind not in "iu":
        raise DTypeError(f"{name} must be integers, got dtype {array.dtype}")
    if array.size and (array.min() < 0 or array.max() >= n_rows):
        bad = array[(array < 0) | (array >= n_rows)].flat[0]
        raise ValueError(f"{name} must lie in [0, {n_rows}) ({what}), got {bad}")
    return array.astype(np.int64, copy=False)


def embedding_forward(table, tokens):
    r"""Token embedding lookup, :math:`x_i = E[t_i]` (seeds 002 and 003).

    Seed 002 writes it :math:`W_e \cdot x` with :math:`x` one-hot; the lookup is
    that product without the multiplications by zero.

    Parameters
    ----------
    table : array_like, shape (V, d_model)
        The embedding matrix :math:`E`.
    tokens : array_like of int, any shape
        Values in ``[0, V)``.

    Returns
    -------
    out : numpy.ndarray, shape tokens.shape + (d_model,)
    cache : Cache

    Raises
    ------
    DTypeError
        For non-integer tokens.
    ValueError
        For tokens outside the vocabulary.
    """
    table = _host_operand("table", table, 2, "(V, d_model)")
    tokens = _tokens("tokens", tokens, table.shape[0], "rows of the embedding table")
    saved = {"tokens": tokens, "table_shape": table.shape, "dtype": table.dtype}
    return table[tokens], Cache("embedding", saved)


def embedding_backward(grad_out, cache):
    r"""Gradient of :func:`embedding_forward` with respect to the table.

    :math:`\partial L / \partial E_v = \sum_{i : t_i = v} \partial L / \partial x_i`: each
    row collects the gradients of every position holding that token.
    """
    saved = _require_cache(cache, "embedding")
    tokens, shape = saved["tokens"], saved["table_shape"]
    grad_out = _gradient("grad_out", grad_out, (*tokens.shape, shape[1]), saved["dtype"])
    grad_table = np.zeros(shape, dtype=saved["dtype"])
    np.add.at(grad_table, tokens.ravel(), grad_out.reshape(-1, shape[1]))
    return grad_table


def output_projection_forward(x, weight, bias=None):
    r"""Logits over the vocabulary, :math:`z = x W^\top + b`.

    ``weight`` has the embedding table's shape :math:`V \times d_{model}`, so a
    tied head (GPT-2; Vaswani et al. section 3.4; Press and Wolf 2017) passes
    the embedding table itself and an untied one (LLaMA) its own matrix.

    Parameters
    ----------
    x : array_like, shape (..., d_model)
    weight : array_like, shape (V, d_model)
    bias : array_like, shape (V,), optional

    Returns
    -------
    logits : numpy.ndarray, shape (..., V)
    cache : Cache
    """
    x = _host_operand("x", x, 1, "(..., d_model)")
    d = x.shape[-1]
    weight = _host_operand("weight", weight, 2, "(V, d_model)")
    weight = _weight("weight", weight, (weight.shape[0], d), x.dtype, "(V, d_model)")
    if bias is not None:
        bias = _weight("bias", bias, (weight.shape[0],), x.dtype, "one per vocabulary entry")
    logits = _linear(x, weight.T, bias)
    return logits, Cache("output_projection", {"x": x, "weight": weight, "bias": bias is not None})


def output_projection_backward(grad_logits, cache):
    r"""Gradients of :func:`output_projection_forward`:
    :math:`\bar x = \bar z W`, :math:`\bar W = \bar z^\top x`, :math:`\bar b = \sum \bar z`.

    Returns
    -------
    grad_x : numpy.ndarray, shape (..., d_model)
    grad_weight : numpy.ndarray, shape (V, d_model)
    grad_bias : numpy.ndarray of shape (V,), or None without a bias
    """
    saved = _require_cache(cache, "output_projection")
    x, weight = saved["x"], saved["weight"]
    grad_logits = _gradient("grad_logits", grad_logits, (*x.shape[:-1], weight.shape[0]), x.dtype)
    grad_x, grad_weight_t, grad_bias = _linear_backward(grad_logits, x, weight.T, saved["bias"])
    return grad_x, grad_weight_t.T, grad_bias


def log_softmax(x, *, backend="auto"):
    r"""Log-softmax over the last axis, computed without overflow.

    .. math::

        \log \operatorname{softmax}(x)_j = (x_j - m) - \log \sum_k e^{x_k - m},
        \qquad m = \max_k x_k

    Taking the log of :func:`tfmath.softmax` instead would lose the small
    probabilities to underflow (:math:`\log 0 = -\infty`); here the sum is at
    least 1, and :math:`m + \log\sum` is never formed, since rounding it to the
    precision of :math:`m` (:math:`10^{-3}` for float32 logits near
    :math:`10^4`) would shift every output by that much.

    Parameters
    ----------
    x : array_like, shape (..., V)
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    numpy.ndarray, shape (..., V)
        A row of all ``-inf`` gives ``-inf`` throughout.

    Examples
    --------
    >>> from tfmath.training.layers import log_softmax
    >>> log_softmax([[1000.0, 1000.0]], backend="reference")
    array([[-0.69314718, -0.69314718]])
    """
    return log_softmax_forward(x, backend=backend)[0]


def log_softmax_forward(x, *, backend="auto"):
    """:func:`log_softmax`, also returning the :class:`Cache` for its backward."""
    x = _host_operand("x", x, 1, "(..., V)")
    backend = resolve_backend(backend)
    if x.shape[-1] == 0:
        y = x.copy()
    else:
        y = implementation("log_softmax", backend)(_rows(x)).reshape(x.shape)
    return y, Cache("log_softmax", {"y": y, "backend": backend})


def log_softmax_backward(grad_y, cache):
    r"""Gradient of :func:`log_softmax`: :math:`\bar x_j = \bar y_j - p_j \sum_k \bar y_k`,
    with :math:`p = e^{y}` the softmax."""
    saved = _require_cache(cache, "log_softmax")
    y = saved["y"]
    grad_y = _gradient("grad_y", grad_y, y.shape, y.dtype)
    if y.shape[-1] == 0:
        return grad_y.copy()
    grad_x = implementation("log_softmax_backward", saved["backend"])(_rows(grad_y), _rows(y))
    return grad_x.reshape(y.shape)


REDUCTIONS = ("mean", "sum", "none")


def cross_entropy(
    logits, targets, *, label_smoothing=0.0, ignore_index=-100, reduction="mean", backend="auto"
):
    r"""Cross-entropy of logits against integer targets, with optional label smoothing.

    Seed 002's :math:`\mathcal L = -\sum_i y_i \log \hat y_i` with
    :math:`\hat y = \operatorname{softmax}(z)` and :math:`y` the target
    distribution. For a target class :math:`t` smoothed by :math:`\varepsilon`
    (Szegedy et al. 2016; Vaswani et al. use :math:`\varepsilon = 0.1`),
    :math:`y_j = (1 - \varepsilon)[j = t] + \varepsilon / V`, so per position

    .. math::

        \ell = \log\sum_k e^{z_k} - (1 - \varepsilon)\, z_t
              - \frac{\varepsilon}{V} \sum_j z_j,

    computed from the logits directly (never from :math:`\log \hat y`), so it
    neither overflows nor takes :math:`\log 0`. These are PyTorch's
    ``cross_entropy`` semantics.

    Parameters
    ----------
    logits : array_like, shape (..., V)
    targets : array_like of int, shape (...)
        Classes in ``[0, V)``, or ``ignore_index``.
    label_smoothing : float, optional
        :math:`\varepsilon \in [0, 1]`.
    ignore_index : int, optional
        Positions with this target (padding) contribute nothing and are not counted.
    reduction : {"mean", "sum", "none"}, optional
        Mean over counted positions (NaN when none is counted), the seed's sum,
        or the per-position losses.
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    float or numpy.ndarray
        A scalar, or an array shaped like ``targets`` for ``reduction="none"``.

    Raises
    ------
    ShapeError
        When ``targets`` is not shaped like ``logits`` without its last axis.
    DTypeError
        For non-integer targets.
    ValueError
        For targets outside ``[0, V)``, smoothing outside [0, 1], an unknown reduction.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.training.layers import cross_entropy
    >>> float(cross_entropy([[0.0, 0.0, 0.0, 0.0]], [2], backend="reference")) == np.log(4)
    True
    """
    return cross_entropy_forward(
        logits,
        targets,
        label_smoothing=label_smoothing,
        ignore_index=ignore_index,
        reduction=reduction,
        backend=backend,
    )[0]


def cross_entropy_forward(
    logits, targets, *, label_smoothing=0.0, ignore_index=-100, reduction="mean", backend="auto"
):
    """:func:`cross_entropy`, also returning the :class:`Cache` for its backward."""
    logits = _host_operand("logits", logits, 1, "(..., V)")
    _features("logits", logits)
    targets, ignore_index = _targets(targets, logits.shape, ignore_index)
    smoothing = real("label_smoothing", label_smoothing)
    if not 0 <= smoothing <= 1:
        raise ValueError(f"label_smoothing must lie in [0, 1], got {smoothing}")
    reduction = choice("reduction", reduction, REDUCTIONS)
    backend = resolve_backend(backend)
    rows, flat_targets = _rows(logits), np.ascontiguousarray(targets.ravel())
    losses, row_max, log_sum = implementation("cross_entropy", backend)(
        rows, flat_targets, smoothing, ignore_index
    )
    counted = int(np.count_nonzero(flat_targets != ignore_index))
    loss = _reduce(losses.reshape(targets.shape), reduction, counted)
    saved = {
        "logits": rows,
        "targets": flat_targets,
        "row_max": row_max,
        "log_sum": log_sum,
        "smoothing": smoothing,
        "ignore_index": ignore_index,
        "reduction": reduction,
        "counted": counted,
        "shape": logits.shape,
        "backend": backend,
    }
    return loss, Cache("cross_entropy", saved)


def _targets(targets, logits_shape, ignore_index):
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int | np.integer):
        raise TypeError(f"ignore_index must be an integer, got {ignore_index!r}")
    array = host_array("targets", targets)
    if array.dtype.kind not in "iu":
        raise DTypeError(f"targets must be integers, got dtype {array.dtype}")
    if array.shape != logits_shape[:-1]:
        raise ShapeError(
            f"targets must have shape {logits_shape[:-1]} (logits {logits_shape} without "
            f"the class axis), got {array.shape}"
        )
    counted = array[array != ignore_index]
    n_classes = logits_shape[-1]
    if counted.size and (counted.min() < 0 or counted.max() >= n_classes):
        bad = counted[(counted < 0) | (counted >= n_classes)].flat[0]
        raise ValueError(
            f"targets must lie in [0, {n_classes}) or equal ignore_index={ignore_index}, got {bad}"
        )
    return array.astype(np.int64), int(ignore_index)


def _reduce(losses, reduction, counted):
    if reduction == "none":
        return losses
    total = losses.sum(dtype=losses.dtype)
    if reduction == "sum":
        return total
    with np.errstate(invalid="ignore", divide="ignore"):
        return total / losses.dtype.type(counted)


def cross_entropy_backward(grad_loss, cache):
    r"""Gradient of :func:`cross_entropy` with respect to the logits.

    .. math:: \frac{\partial \ell}{\partial z_j} = \operatorname{softmax}(z)_j - y_j,

    times the upstream gradient (divided by the number of counted positions for
    ``reduction="mean"``); ignored positions get zeros.

    Parameters
    ----------
    grad_loss : float or array_like
        :math:`\partial L / \partial \text{loss}`: a scalar (1.0 when the loss is
        the objective) for "mean" and "sum", an array shaped like ``targets`` for "none".
    cache : Cache
        From :func:`cross_entropy_forward`.

    Returns
    -------
    numpy.ndarray
        Shaped like ``logits``.
    """
    saved = _require_cache(cache, "cross_entropy")
    logits, targets = saved["logits"], saved["targets"]
    per_row = _per_row_gradient(grad_loss, saved, logits.dtype)
    grad = implementation("cross_entropy_backward", saved["backend"])(
        per_row,
        logits,
        targets,
        saved["row_max"],
        saved["log_sum"],
        saved["smoothing"],
        saved["ignore_index"],
    )
    return grad.reshape(saved["shape"])


def _per_row_gradient(grad_loss, saved, dtype):
    n_rows = saved["targets"].shape[0]
    if saved["reduction"] == "none":
        grad = _gradient("grad_loss", grad_loss, saved["shape"][:-1], dtype)
        return np.ascontiguousarray(grad.ravel())
    grad = _gradient("grad_loss", grad_loss, (), dtype)
    if saved["reduction"] == "mean":
        grad = grad / max(saved["counted"], 1)
    return np.full(n_rows, grad, dtype=dtype)
