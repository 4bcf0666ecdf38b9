"""Gradients summed back to the shape of a broadcast operand, with NumPy."""

from tfmath._contract.layout import sum_to_shape

__all__ = ["sum_to_shape"]
