"""What every backend of the transformer layers shares: the activation codes.

The scalar formulas of the activations are written once, in
:mod:`tfmath.kernels.formulas`, and compiled by each kernel family; the NumPy
oracle (:mod:`tfmath.reference.layers`) writes them again on arrays, from the
textbook forms, on purpose: it is what the kernels are tested against.
"""

#: FFN nonlinearities and the code the kernels know them by.
ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "swiglu": 3}
RELU, GELU, GELU_TANH, SWIGLU = (ACTIVATIONS[name] for name in ACTIVATIONS)
