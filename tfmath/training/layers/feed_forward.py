"""The position-wise feed-forward network and its activations (ReLU, GELU, SwiGLU)."""

import numpy as np

from tfmath._contract.backend import resolve_backend
from tfmath._contract.checks import (
    choice,
    integer,
)
from tfmath._contract.layers import ACTIVATIONS
from tfmath._contract.tensors import accepts_tensors
from tfmath._dispatch import implementation
from tfmath.errors import ShapeError
from tfmath.training.layers._base import (
    Cache,
    _features,
    _gradient,
    _host_operand,
    _linear,
    _linear_backward,
    _named_grads,
    _require_cache,
    _rows,
    _weight,
    half_precision,
)
from tfmath.training.params import ParameterSpec


@accepts_tensors(autograd=lambda: (ffn_activation_forward, ffn_activation_backward))
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


@half_precision
def ffn_activation_forward(h, activation="gelu", *, backend="auto"):
    """:func:`ffn_activation`, also returning the :class:`Cache` for its backward."""
    code = ACTIVATIONS[choice("activation", activation, ACTIVATIONS)]
    h = _host_operand("h", h)
    _features("h", h)
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


@half_precision
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


@half_precision
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


@half_precision
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
