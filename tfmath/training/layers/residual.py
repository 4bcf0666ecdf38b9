"""Residual connections with post- or pre-LN normalisation."""

from tfmath._contract.checks import (
    choice,
)
from tfmath.training.layers._base import (
    Cache,
    _gradient,
    _host_operand,
    _require_cache,
    half_precision,
)
from tfmath.training.layers.norms import NORMS, norm_backward, norm_forward

#: Where the normalisation sits: ``"post"``, LayerNorm(x + Sublayer(x)) as the
#: seeds and Vaswani et al. write it, or ``"pre"``, x + Sublayer(LayerNorm(x)).
NORM_ORDERS = ("post", "pre")


@half_precision
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
        y, norm_cache = norm_forward(norm_params, x + sub_out, norm, eps, backend)
    else:
        z, norm_cache = norm_forward(norm_params, x, norm, eps, backend)
        sub_out, sub_cache = sublayer(z)
        y = x + sub_out
    saved = {"order": order, "sublayer": sub_cache, "norm": norm_cache, "shape": x.shape}
    return y, Cache("residual", {**saved, "dtype": x.dtype})


@half_precision
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
        grad_h, norm_grads = norm_backward(grad_y, saved["norm"])
        grad_sub, extra = sublayer_backward(grad_h, saved["sublayer"])
        return grad_h + grad_sub, norm_grads, extra
    grad_z, extra = sublayer_backward(grad_y, saved["sublayer"])
    grad_x_norm, norm_grads = norm_backward(grad_z, saved["norm"])
    return grad_y + grad_x_norm, norm_grads, extra
