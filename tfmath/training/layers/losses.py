"""Log-softmax and cross-entropy, forward and backward."""

import numpy as np

from tfmath._contract.backend import resolve_backend
from tfmath._contract.checks import (
    choice,
    host_array,
    real,
)
from tfmath._contract.tensors import accepts_tensors
from tfmath._dispatch import implementation
from tfmath.errors import ArgumentError, DTypeError, ShapeError
from tfmath.training.layers._base import (
    Cache,
    _features,
    _gradient,
    _host_operand,
    _require_cache,
    _rows,
    half_precision,
)


@accepts_tensors(autograd=lambda: (log_softmax_forward, log_softmax_backward), reads_outputs=True)
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


@half_precision
def log_softmax_forward(x, *, backend="auto"):
    """:func:`log_softmax`, also returning the :class:`Cache` for its backward."""
    x = _host_operand("x", x, 1, "(..., V)")
    backend = resolve_backend(backend)
    if x.shape[-1] == 0:
        y = x.copy()
    else:
        y = implementation("log_softmax", backend)(_rows(x)).reshape(x.shape)
    return y, Cache("log_softmax", {"y": y, "backend": backend})


@half_precision
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


@accepts_tensors(autograd=lambda: (cross_entropy_forward, cross_entropy_backward))
@half_precision
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
    ``cross_entropy`` semantics, with the classes on the last axis of ``logits``
    (PyTorch's are on dimension 1: pass ``torch.movedim(logits, 1, -1)``; logits of
    shape ``(N, C, d)`` with ``C == d`` would otherwise be read the other way silently).

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
    >>> bool(float(cross_entropy([[0.0, 0.0, 0.0, 0.0]], [2], backend="reference")) == np.log(4))
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


@half_precision
def cross_entropy_forward(
    logits, targets, *, label_smoothing=0.0, ignore_index=-100, reduction="mean", backend="auto"
):
    """:func:`cross_entropy`, also returning the :class:`Cache` for its backward."""
    logits = _host_operand("logits", logits, 1, "(..., V)")
    _features("logits", logits)
    targets, ignore_index = _targets(targets, logits.shape, ignore_index)
    smoothing = real("label_smoothing", label_smoothing)
    if not 0 <= smoothing <= 1:
        raise ArgumentError(f"label_smoothing must lie in [0, 1], got {smoothing}")
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
        raise DTypeError(f"ignore_index must be an integer, got {ignore_index!r}")
    if not -(2**63) <= ignore_index < 2**63:
        # Targets are compared with it as 64-bit integers.
        raise ArgumentError(f"ignore_index must lie in [-2**63, 2**63), got {ignore_index}")
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
        raise ArgumentError(
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


@half_precision
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
