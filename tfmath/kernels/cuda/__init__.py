"""Numba CUDA kernels and their launchers.

Kernels are built per dtype on first use (shared-memory arrays need their
dtype at compile time), so importing a module here compiles nothing.
"""
