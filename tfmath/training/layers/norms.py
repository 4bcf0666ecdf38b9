"""LayerNorm and RMSNorm, forward and backward."""

from tfmath._contract.backend import resolve_backend
from tfmath._contract.checks import (
    choice,
    integer,
    plain_rows,
)
from tfmath._contract.tensors import accepts_tensors
from tfmath._dispatch import implementation
from tfmath.training.layers._base import (
    Cache,
    _eps,
    _features,
    _gradient,
    _host_operand,
    _require_cache,
    _rows,
    _weight,
    half_precision,
)
from tfmath.training.params import Parameters, ParameterSpec

#: Normalisations a block can use.
NORMS = ("layer_norm", "rms_norm")


@accepts_tensors(autograd=lambda: (layer_norm_forward, layer_norm_backward))
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
    rows = plain_rows(x, (weight, bias), eps, backend)
    if rows is not None:
        return implementation("layer_norm", "cpu")(rows, weight, bias, eps)[0].reshape(x.shape)
    return layer_norm_forward(x, weight, bias, eps, backend=backend)[0]


@half_precision
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
    saved["backend"] = backend
    return y.reshape(x.shape), Cache("layer_norm", saved)


@half_precision
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


@accepts_tensors(autograd=lambda: (rms_norm_forward, rms_norm_backward))
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
        :math:`\epsilon \ge 0`; 1e-6 as LLaMA's (PyTorch's ``rms_norm`` defaults to
        the dtype's machine epsilon, which differs where rows are small).
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
    rows = plain_rows(x, (weight,), eps, backend)
    if rows is not None:
        return implementation("rms_norm", "cpu")(rows, weight, eps)[0].reshape(x.shape)
    return rms_norm_forward(x, weight, eps, backend=backend)[0]


@half_precision
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


@half_precision
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


@half_precision
def norm_forward(params, x, norm, eps, backend="auto"):
    """The norm named ``norm`` (one of :data:`NORMS`) with its parameters ``params``.

    Returns
    -------
    y : numpy.ndarray
    cache : Cache
        For :func:`norm_backward`.
    """
    if norm == "layer_norm":
        params.require(("weight", "bias"), owner="layer_norm")
        return layer_norm_forward(x, params["weight"], params["bias"], eps, backend=backend)
    params.require(("weight",), owner="rms_norm")
    return rms_norm_forward(x, params["weight"], eps, backend=backend)


@half_precision
def norm_backward(grad_y, cache):
    """Gradients of :func:`norm_forward`: ``(grad_x, grads)``, ``grads`` named as its ``params``."""
    if cache.op == "layer_norm":
        grad_x, grad_weight, grad_bias = layer_norm_backward(grad_y, cache)
        return grad_x, Parameters({"weight": grad_weight, "bias": grad_bias})
    grad_x, grad_weight = rms_norm_backward(grad_y, cache)
    return grad_x, Parameters({"weight": grad_weight})
