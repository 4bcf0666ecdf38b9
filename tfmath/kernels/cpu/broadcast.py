"""Gradients summed back to the shape of a broadcast operand on the CPU: NumPy's sums
(a reduction over a few batch entries, which NumPy runs at memory speed)."""

from tfmath._contract.layout import sum_to_shape

__all__ = ["sum_to_shape"]
