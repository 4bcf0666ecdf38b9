"""Plain NumPy reference implementations: the oracles the tests compare kernels with.

They are written to be read, not to be fast: each follows the formula in its
docstring as directly as NumPy allows.
"""
