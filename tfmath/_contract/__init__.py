"""The contract between the public modules and the implementations under them.

Public topic modules (:mod:`tfmath.attention`, ...) turn user arguments into a
*problem*: a frozen record of validated operands and options, which carries
the backend that will run it. Kernels (``tfmath.kernels.cpu``,
``tfmath.kernels.cuda``) and the NumPy oracles (``tfmath.reference``) receive
problems and read them through the layout helpers here; they import only this
package, the infrastructure (``tfmath._jit``, ``tfmath._blas_threads``,
``tfmath._cuda_switches``, ``tfmath._cuda``) and ``tfmath.errors``, never a
topic module, so the drawing of the imports has them at the bottom.

:mod:`~tfmath._contract.checks`
    Argument checks that every public function uses, raising
    :class:`~tfmath.errors.TfmathError` subclasses that name the argument.
:mod:`~tfmath._contract.backend`
    The ``backend`` argument: which backend runs a call (``"auto"`` decided here).
:mod:`~tfmath._contract.layout`
    Batch shapes, broadcast indices and the flattened views kernels take.
:mod:`~tfmath._contract.attention`, :mod:`~tfmath._contract.efficient`,
:mod:`~tfmath._contract.variance`, :mod:`~tfmath._contract.rnn`
    The problem types, their builders, and the integer codes and constants
    that kernels and oracles share.
"""
