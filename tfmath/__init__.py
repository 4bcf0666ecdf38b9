"""tfmath: a Numba-accelerated toolkit for the mathematics of transformers.

Every numerical routine has a CPU kernel (``numba.njit``), a CUDA kernel
(``numba.cuda.jit``) and a NumPy reference, chosen with ``backend=``.

The package, from the top down (each layer imports only the layers below it):

- tools: :mod:`tfmath.tools` (the ``tfmath`` command, benchmarks),
  :mod:`tfmath.report` and the :mod:`tfmath.experiments` it runs;
- measurements on the mathematics: :mod:`tfmath.analysis`;
- the training stack: :mod:`tfmath.training` (parameters, layers, models,
  optimiser, loop, sweeps), beside :mod:`tfmath.nn`, PyTorch's signatures over the
  topics and the training layers' functions;
- kernel-backed topics, which validate, dispatch and package results:
  :mod:`tfmath.attention`, :mod:`tfmath.positional`, :mod:`tfmath.variance`,
  :mod:`tfmath.efficient`, :mod:`tfmath.rnn`, :mod:`tfmath.variants`; and closed forms with no
  kernels: :mod:`tfmath.formulas`;
- the contract under the kernels (problem types, their builders, codes,
  layouts, argument checks): ``tfmath._contract``; the registry of
  implementations: ``tfmath._dispatch``;
- the implementations: ``tfmath.kernels.cpu``, ``tfmath.kernels.cuda`` and the
  NumPy oracles ``tfmath.reference``, beside the infrastructure they build on:
  the JIT options (``tfmath._jit``), the disk cache of compiled kernels
  (``tfmath._kernel_cache``), BLAS's thread count (``tfmath._blas_threads``),
  the CUDA switches (``tfmath._cuda_switches``) and the one module that imports
  ``numba.cuda`` (``tfmath._cuda``).

This file only re-exports.
"""

from tfmath._dispatch import BackendInfo, backends
from tfmath._version import __version__
from tfmath.attention import attention_grad, scaled_dot_product_attention, softmax
from tfmath.efficient import linear_attention, sparse_attention, sparse_attention_mask
from tfmath.errors import (
    AllocationError,
    ArgumentError,
    BackendUnavailableError,
    DTypeError,
    FitWarning,
    LayoutError,
    ShapeError,
    TfmathError,
)
from tfmath.formulas.accounting import (
    ModelConfig,
    activation_memory_per_layer,
    count_parameters,
    flops_per_token,
    kv_cache_bytes_per_token,
)
from tfmath.formulas.scaling import (
    chinchilla_loss,
    chinchilla_optimal,
    critical_batch_size,
    fit_scaling_law,
    kaplan_joint_loss,
    kaplan_loss,
)
from tfmath.positional import (
    alibi_bias,
    alibi_slopes,
    embed,
    rotary_embedding,
    sinusoidal_encoding,
)
from tfmath.rnn import elman_rnn
from tfmath.training.layers import cross_entropy, layer_norm, log_softmax, rms_norm
from tfmath.variance import (
    dot_product_variance,
    sample_scores,
    score_variance,
    softmax_row_statistics,
)
from tfmath.variants import (
    BlockMask,
    RelativePositionBias,
    create_block_mask,
    flash_attention,
    flash_attention_grad,
    flash_attention_varlen,
    flash_attention_varlen_grad,
    flex_attention,
    flex_attention_grad,
)
from tfmath.view import AttentionView, attention_vectors, attention_view

__all__ = [
    "AllocationError",
    "ArgumentError",
    "AttentionView",
    "BackendInfo",
    "BackendUnavailableError",
    "BlockMask",
    "DTypeError",
    "FitWarning",
    "LayoutError",
    "ModelConfig",
    "RelativePositionBias",
    "ShapeError",
    "TfmathError",
    "__version__",
    "activation_memory_per_layer",
    "alibi_bias",
    "alibi_slopes",
    "attention_grad",
    "attention_vectors",
    "attention_view",
    "backends",
    "chinchilla_loss",
    "chinchilla_optimal",
    "count_parameters",
    "create_block_mask",
    "critical_batch_size",
    "cross_entropy",
    "dot_product_variance",
    "elman_rnn",
    "embed",
    "fit_scaling_law",
    "flash_attention",
    "flash_attention_grad",
    "flash_attention_varlen",
    "flash_attention_varlen_grad",
    "flex_attention",
    "flex_attention_grad",
    "flops_per_token",
    "kaplan_joint_loss",
    "kaplan_loss",
    "kv_cache_bytes_per_token",
    "layer_norm",
    "linear_attention",
    "log_softmax",
    "rms_norm",
    "rotary_embedding",
    "sample_scores",
    "scaled_dot_product_attention",
    "score_variance",
    "sinusoidal_encoding",
    "softmax",
    "softmax_row_statistics",
    "sparse_attention",
    "sparse_attention_mask",
]
