"""Numba CPU kernels, compiled on first use and cached on disk."""
